//! An Envoy xDS control plane: the Aggregated Discovery Service over gRPC, serving one
//! EDS cluster (CDS) and its endpoints (EDS) per upstream, to state-of-the-world and delta
//! clients alike.
//!
//! The operator feeds an [`XdsServer`] with [`Changes`] and serves it on a listener it
//! bound ([`XdsServer::serve`]):
//!
//! ```no_run
//! use consul_resolver_xds::{Changes, EndpointHealth, Upstream, UpstreamEndpoint, XdsConfig, XdsServer};
//!
//! # async fn run(registry: &prometheus::Registry) -> Result<(), Box<dyn std::error::Error>> {
//! let xds = XdsServer::new();
//! xds.register_metrics(registry)?;
//! let listener = tokio::net::TcpListener::bind("0.0.0.0:18000").await?;
//! let serving = xds.clone();
//! let shutdown = async {
//!     let _ = tokio::signal::ctrl_c().await;
//! };
//! tokio::spawn(async move { serving.serve(listener, XdsConfig::default(), shutdown).await });
//!
//! // Once the whole view is known: clients waiting since they connected get it now.
//! let web = Upstream {
//!     name: "web.shop:80".to_owned(),
//!     endpoints: vec![UpstreamEndpoint {
//!         address: "10.0.0.7".to_owned(),
//!         port: 8080,
//!         zone: Some("eu-west-1a".to_owned()),
//!         health: EndpointHealth::Healthy,
//!         weight: 1,
//!     }],
//! };
//! let report = xds.update(Changes { upserts: vec![web], removals: Vec::new(), complete: true });
//! for rejection in &report.rejections {
//!     tracing::warn!(%rejection, "left out of what Envoy is served");
//! }
//! // Then each change as it comes: only what it touches is rebuilt and sent.
//! xds.update(Changes { removals: vec!["web.shop:80".to_owned()], ..Default::default() });
//! # Ok(())
//! # }
//! ```
//!
//! What the server guarantees:
//!
//! - **Nothing before the first update.** A client that connects earlier waits; its first
//!   response describes a complete view, never a partial one.
//! - **Cost by change.** Each upstream is encoded once per change and shared by every
//!   client; its version is derived from the encoded bytes (equal content, equal version).
//!   A client catches up with what changed since it last looked, not with everything: an
//!   endpoint change sends that one `ClusterLoadAssignment` (the cluster's resource does
//!   not change), to the clients that subscribed to it. The state of the world's CDS is the
//!   exception the protocol imposes: a cluster added or removed sends every cluster.
//! - **Nothing Envoy would refuse.** What Envoy would NACK and can be told in advance (an
//!   address that is not an IP literal, port 0, weight 0, duplicate endpoints, an empty or
//!   over-long name) is left out, counted, and reported ([`UpdateReport`],
//!   [`XdsServer::rejections`]).
//! - **A refusal stays with its client and resource.** When a client NACKs, the resources
//!   its message names are held back from that client at the version it refused (it keeps
//!   what it had); everything else in the response counts as accepted, and a later version
//!   of a refused resource is offered again. When the message names none, everything the
//!   response changed is held back, and the status says so.
//! - **Resumption without resending.** A delta client's `initial_resource_versions`, and a
//!   state-of-the-world client's `version_info` on a new stream, count as held: after an
//!   operator restart, only what changed meanwhile is sent.
//! - **Bounded per client.** One response waits for a client at most; one that does not
//!   take it, or does not answer it (ACK or NACK), within the deadline has its stream
//!   closed. Responses are computed from the
//!   latest view when they can be sent, so a slow client receives fewer, larger responses,
//!   not a backlog. A response of a type is sent only once the previous one of that type is
//!   answered. HTTP/2 keepalive closes the connections of clients that vanished.

mod delta;
mod metrics;
mod resources;
mod server;
mod session;
mod sotw;
mod state;
mod status;
mod tracker;

use std::future::Future;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};

use tokio::net::TcpListener;
use tokio::sync::watch;

pub use resources::{EndpointHealth, RejectReason, Rejection, Upstream, UpstreamEndpoint};
pub use server::{ServeError, TlsConfig, XdsConfig};
pub use state::{Changes, UpdateReport};
pub use status::{ClientStatus, Nack, TypeStatus, Variant};

/// What every stream shares.
#[derive(Debug)]
pub(crate) struct XdsShared {
    view: RwLock<state::View>,
    /// Bumped after each update: streams wake and look at what changed.
    notify: watch::Sender<u64>,
    clients: status::Clients,
    metrics: metrics::Metrics,
    /// Streams open, against `XdsConfig::max_clients`.
    streams: AtomicUsize,
}

impl XdsShared {
    pub(crate) fn view(&self) -> RwLockReadGuard<'_, state::View> {
        self.view.read().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The xDS server: fed by the operator, served to Envoys. Cheap to clone; clones share
/// everything.
#[derive(Clone, Debug)]
pub struct XdsServer {
    shared: Arc<XdsShared>,
}

impl Default for XdsServer {
    fn default() -> XdsServer {
        XdsServer::new()
    }
}

impl XdsServer {
    /// A server with nothing to serve yet: clients wait for the first [`update`](Self::update).
    pub fn new() -> XdsServer {
        let shared = XdsShared {
            view: RwLock::default(),
            notify: watch::Sender::new(0),
            clients: status::Clients::default(),
            metrics: metrics::Metrics::new(),
            streams: AtomicUsize::new(0),
        };
        XdsServer { shared: Arc::new(shared) }
    }

    /// Applies `changes` and wakes the clients. The first call makes the view ready: it
    /// must describe everything (`complete`, or all upstreams as upserts).
    pub fn update(&self, changes: Changes) -> UpdateReport {
        let report = self.shared.view.write().unwrap_or_else(PoisonError::into_inner).apply(changes);
        for rejection in &report.rejections {
            self.shared.metrics.rejected.with_label_values(&[rejection.reason.label()]).inc();
        }
        self.shared.notify.send_modify(|generation| *generation += 1);
        report
    }

    /// Everything currently left out of what is served, and why.
    pub fn rejections(&self) -> Vec<Rejection> {
        self.shared.view().rejections()
    }

    /// The number of upstreams served.
    pub fn upstreams(&self) -> usize {
        self.shared.view().len()
    }

    /// Every connected client, sorted by node id.
    pub fn clients(&self) -> Vec<ClientStatus> {
        self.shared.clients.snapshot()
    }

    /// The names of the `consul_resolver_xds_*` metrics, for the operator's list of what
    /// it exposes.
    pub fn metric_names(&self) -> Vec<String> {
        self.shared.metrics.names()
    }

    /// Registers the `consul_resolver_xds_*` metrics.
    pub fn register_metrics(&self, registry: &prometheus::Registry) -> prometheus::Result<()> {
        self.shared.metrics.register(registry)
    }

    /// Serves on `listener` until `shutdown` completes; then every stream is ended and
    /// this returns once the connections are closed.
    pub async fn serve(
        &self,
        listener: TcpListener,
        config: XdsConfig,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ServeError> {
        server::serve(self.shared.clone(), listener, config, shutdown).await
    }
}
