//! The transport: gRPC over HTTP/2 with keepalive, optional TLS and mutual TLS, a bound on
//! the clients served and an optional allow-list of node ids.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};

use crate::XdsShared;
use crate::delta::Delta;
use crate::session::{self, Limits, Protocol};
use crate::sotw::Sotw;

/// How the server is served.
#[derive(Clone, Debug)]
pub struct XdsConfig {
    /// Streams served at once; the next is refused with `RESOURCE_EXHAUSTED`.
    pub max_clients: usize,
    /// HTTP/2 pings on an idle connection, and how long an answer may take before the
    /// connection is closed: how a vanished client is noticed.
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
    /// How long a client may take to take a response and to answer it (ACK or NACK; a
    /// stuck client's stream is then closed), to send its first request, and to complete
    /// a TLS handshake.
    pub response_deadline: Duration,
    pub tls: Option<TlsConfig>,
    /// When set, only clients whose node id is listed are served; others are refused with
    /// `PERMISSION_DENIED`.
    pub allowed_node_ids: Option<BTreeSet<String>>,
}

impl Default for XdsConfig {
    fn default() -> XdsConfig {
        XdsConfig {
            max_clients: 1024,
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(10),
            response_deadline: Duration::from_secs(60),
            tls: None,
            allowed_node_ids: None,
        }
    }
}

/// The server's certificate, and the CA client certificates must chain to for mutual TLS.
#[derive(Clone)]
pub struct TlsConfig {
    /// PEM: the certificate chain, leaf first.
    pub cert_pem: Vec<u8>,
    /// PEM: the private key.
    pub key_pem: Vec<u8>,
    /// PEM: when set, a client must present a certificate issued by one of these.
    pub client_ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("TlsConfig").field("mutual", &self.client_ca_pem.is_some()).finish_non_exhaustive()
    }
}

/// Why serving failed.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("the TLS configuration is not usable: {0}")]
    Tls(#[source] tonic::transport::Error),
    #[error("the xDS server failed: {0}")]
    Transport(#[source] tonic::transport::Error),
}

/// An HTTP/2 connection carries at most this many streams; Envoy opens one ADS stream.
const MAX_STREAMS_PER_CONNECTION: u32 = 8;

/// Serves until `shutdown` completes, then ends every stream and returns.
pub(crate) async fn serve(
    shared: Arc<XdsShared>,
    listener: TcpListener,
    config: XdsConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let limits = Arc::new(Limits {
        response_deadline: config.response_deadline,
        allowed_nodes: config.allowed_node_ids,
        max_clients: config.max_clients,
    });
    let (stop_tx, stop) = watch::channel(false);
    let service = Ads { shared, limits, stop };
    let mut builder = Server::builder()
        .http2_keepalive_interval(Some(config.keepalive_interval))
        .http2_keepalive_timeout(Some(config.keepalive_timeout))
        .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION));
    if let Some(tls) = &config.tls {
        builder = builder.tls_config(server_tls(tls, config.response_deadline)).map_err(ServeError::Tls)?;
    }
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let shutdown = async move {
        shutdown.await;
        // Streams never end on their own: end them, so the graceful shutdown completes.
        let _ = stop_tx.send(true);
    };
    builder
        .add_service(AggregatedDiscoveryServiceServer::new(service))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(ServeError::Transport)
}

fn server_tls(tls: &TlsConfig, handshake_deadline: Duration) -> ServerTlsConfig {
    let mut config =
        ServerTlsConfig::new().identity(Identity::from_pem(&tls.cert_pem, &tls.key_pem)).timeout(handshake_deadline);
    if let Some(ca) = &tls.client_ca_pem {
        config = config.client_ca_root(Certificate::from_pem(ca)).client_auth_optional(false);
    }
    config
}

struct Ads {
    shared: Arc<XdsShared>,
    limits: Arc<Limits>,
    stop: watch::Receiver<bool>,
}

/// The responses of one stream, as tonic sends them.
type Outbound<R> = ReceiverStream<Result<R, Status>>;

/// A place among the `max_clients` served, given back when the stream ends.
struct Slot(Arc<XdsShared>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.streams.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Ads {
    fn open<P: Protocol>(
        &self,
        request: Request<Streaming<P::Request>>,
    ) -> Result<Response<Outbound<P::Response>>, Status> {
        if self.shared.streams.fetch_add(1, Ordering::AcqRel) >= self.limits.max_clients {
            self.shared.streams.fetch_sub(1, Ordering::AcqRel);
            self.shared.metrics.refused.with_label_values(&["max_clients"]).inc();
            return Err(Status::resource_exhausted("the xDS server serves as many clients as it may"));
        }
        let slot = Slot(self.shared.clone());
        let peer = request.remote_addr().map(|addr| addr.to_string());
        // One response waits here at most: the memory a client holds is bounded, and one
        // that stops reading is noticed by the deadline on the next send.
        let (tx, rx) = mpsc::channel(1);
        let (shared, limits, stop) = (self.shared.clone(), self.limits.clone(), self.stop.clone());
        tokio::spawn(async move {
            session::run::<P>(shared, limits, request.into_inner(), tx, peer, stop).await;
            drop(slot);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = Outbound<DiscoveryResponse>;
    type DeltaAggregatedResourcesStream = Outbound<DeltaDiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        self.open::<Sotw>(request)
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        self.open::<Delta>(request)
    }
}
