//! The runtime: drives the pure pipeline with the real sources and publishers. This
//! module wires the parts together from the command line; `event_loop` is the one loop
//! that owns the pipeline; `publication` the outlets that deliver each snapshot to every
//! publisher on its own.
//!
//! With leader election, every replica watches, assembles and serves HTTP (and runs its
//! hook), but only the lease holder writes to the cluster (ConfigMap, statuses, Events),
//! each write bounded by its leadership deadline. A replica that becomes leader writes the
//! current snapshot at once, numbered after the one already in the ConfigMap.

mod event_loop;
pub(crate) mod metrics;
mod publication;
mod publisher_events;
mod registry;
mod settings;
mod xds;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use kube::Client;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::cli::{KubeArgs, RunArgs};
use crate::controller::export::{ExportConfig, ExportController, ServerFeatures, SliceVersion};
use crate::controller::resolver::ResolverController;
use crate::leadership::{Campaign, Leadership};
use crate::ops::ServerState;
use crate::ops::health::Heartbeat;
use crate::publishers::Publisher;
use crate::publishers::configmap::ConfigMapPublisher;
use crate::publishers::hook::HookPublisher;
use crate::publishers::http::SnapshotStore;
use crate::publishers::xds::XdsPublisher;
use crate::sources::Watches;
use crate::sources::kube::{Discovered, KubeSource};
use crate::vitals::Vitals;
use consul_resolver_api::mapping::{self, MappingKind};
use consul_resolver_api::resolver;
use consul_resolver_core::assembler::{self, EndpointsApi};
use consul_resolver_core::keys::{KubeKey, WatchKey};
use consul_resolver_core::model::Event;
use consul_resolver_core::pipeline::{Pipeline, WallClock};
use consul_watch::ConsulSource;
use event_loop::EventLoop;
use publication::{OutletConfig, Outlets};
use publisher_events::PublisherEvents;
use registry::Metrics;

/// What the start-up discovers before anything is watched: the fixed watches and the
/// endpoints API served. Every group is asked at once: nothing is watched until all have
/// answered, and asked one after the other, their round trips would add up on every cold
/// start.
async fn start_up_discovery(
    client: &Client,
    discovered: &Discovered,
    args: &KubeArgs,
) -> anyhow::Result<(BTreeSet<WatchKey>, EndpointsApi)> {
    // The endpoints API is asked until an answer is authoritative; a start-up that fails
    // meanwhile (the CRD missing, the API server unreachable) ends it.
    tokio::try_join!(fixed_keys(client, discovered, args), async { Ok(endpoints_api(client, discovered).await) })
}

/// The operator's fixed watches: its own CRD and Ambassador's route kinds (those the API
/// server serves), per watched namespace, plus the static `--watch` keys.
async fn fixed_keys(client: &Client, discovered: &Discovered, args: &KubeArgs) -> anyhow::Result<BTreeSet<WatchKey>> {
    let resolvers = KubeKey::new(resolver::GROUP, resolver::VERSION, resolver::KIND);
    let routes: Vec<KubeKey> =
        MappingKind::ALL.into_iter().map(|k| KubeKey::new(mapping::GROUP, "", k.kind())).collect();
    // Exports only where their CRD is installed (crds/consulservice.yaml).
    let exports = KubeKey::new(resolver::GROUP, resolver::VERSION, consul_resolver_api::export::KIND);
    // The groups are asked at once ([`start_up_discovery`]). Kinds of one group share its
    // discovery: the second waits for the first and reads what it found.
    let (found_resolvers, found_routes, found_exports) = tokio::join!(
        discovered.resolve(client, &resolvers),
        futures::future::join_all(routes.iter().map(|key| discovered.resolve(client, key))),
        discovered.resolve(client, &exports),
    );
    found_resolvers
        .map_err(anyhow::Error::msg)
        .context("the ConsulResolver CRD is not installed (kubectl apply -f crds/)")?;
    let mut kinds = vec![resolvers];
    for (key, found) in routes.into_iter().zip(found_routes) {
        match found {
            Ok(_) => kinds.push(key),
            Err(e) => tracing::warn!(kind = %key.kind, error = %e, "Ambassador kind not served; not watched"),
        }
    }
    match found_exports {
        Ok(_) => kinds.push(exports),
        Err(e) => {
            tracing::warn!(error = %e, "the ConsulService CRD is not installed: no exports (kubectl apply -f crds/)")
        }
    }
    let mut keys = BTreeSet::new();
    for kind in kinds {
        if args.namespaces.is_empty() {
            keys.insert(WatchKey::Kube(kind));
        } else {
            for ns in &args.namespaces {
                keys.insert(WatchKey::Kube(kind.clone().in_namespace(ns.clone())));
            }
        }
    }
    keys.extend(args.watches.iter().cloned().map(WatchKey::Kube));
    Ok(keys)
}

/// A `--watch` with the operator's own snapshot ConfigMaps left out (logged when it
/// changes the key): a publication must never come back as input.
fn without_own_output(key: KubeKey) -> KubeKey {
    let narrowed = crate::publishers::configmap::without_snapshots(key.clone());
    if narrowed != key {
        tracing::info!(watch = %key, now = %narrowed, label = crate::publishers::configmap::LABEL_SNAPSHOT,
            "--watch of ConfigMaps: the operator's snapshot ConfigMaps are left out (they carry the label)");
    }
    narrowed
}

/// EndpointSlices where `discovery.k8s.io/v1` is served (1.21+), else core Endpoints
/// (and v1beta1 slices for exports). The choice holds for the process's life, so only an
/// authoritative answer selects the fallback: the group version absent (404), or served
/// without the kind. Anything else (a 429, a 5xx, a timeout) is asked again with backoff,
/// while `/readyz` is still false: guessed wrong, the process would read the 1,000-address
/// Endpoints and write slices a 1.25+ server refuses, until restarted.
async fn endpoints_api(client: &Client, discovered: &Discovered) -> EndpointsApi {
    let key = KubeKey::new("discovery.k8s.io", "v1", "EndpointSlice");
    let mut delay = DISCOVERY_RETRY_FIRST;
    loop {
        // Through the discovery cache, which the watches of EndpointSlices then reuse.
        if discovered.resolve(client, &key).await.is_ok() {
            return EndpointsApi::EndpointSlices;
        }
        match endpoints_api_from(client.list_api_group_resources("discovery.k8s.io/v1").await) {
            Ok(api) => return api,
            Err(why) => {
                tracing::warn!(error = %why, retry_in = ?delay, "cannot tell whether discovery.k8s.io/v1 is served; asking again");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(DISCOVERY_RETRY_MAX);
            }
        }
    }
}

/// The first wait before discovery is asked again, doubled up to [`DISCOVERY_RETRY_MAX`].
const DISCOVERY_RETRY_FIRST: Duration = Duration::from_millis(200);
const DISCOVERY_RETRY_MAX: Duration = Duration::from_secs(10);

/// What an answer to `GET /apis/discovery.k8s.io/v1` says of the endpoints API, or why it
/// says nothing for sure.
fn endpoints_api_from(
    answer: kube::Result<k8s_openapi::apimachinery::pkg::apis::meta::v1::APIResourceList>,
) -> Result<EndpointsApi, String> {
    match answer {
        Ok(list) if list.resources.iter().any(|r| r.kind == "EndpointSlice") => Ok(EndpointsApi::EndpointSlices),
        Ok(_) => Ok(EndpointsApi::Endpoints),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(EndpointsApi::Endpoints),
        Err(e) => Err(e.to_string()),
    }
}

/// How the time from SIGTERM to exit (`--shutdown-timeout`) is shared (docs/operations.md,
/// "Shutdown and the grace period"). The pod's terminationGracePeriodSeconds covers all of
/// it plus a margin: past the grace period the kubelet kills the process, and a leader
/// killed before it released the Lease leaves the standby waiting out the lease duration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ShutdownBudget {
    /// When the writers still in flight (publications, status writes) are cut off.
    writers_until: Instant,
    /// When the shutdown ends, the Lease release included.
    until: Instant,
    /// What the Lease release is always left, at the end.
    release: Duration,
}

impl ShutdownBudget {
    /// `total` from `signalled`, its last `release` (at most half of it) kept for the Lease
    /// release. The writers stop first, so no write of ours lands after the Lease is handed
    /// over; they get the rest, publishers and status controller side by side, as they
    /// write different objects.
    fn new(signalled: Instant, total: Duration, release: Duration) -> ShutdownBudget {
        let release = release.min(total / 2);
        let until = signalled + total;
        ShutdownBudget { writers_until: until - release, until, release }
    }

    /// When the Lease release must be done, starting `now`: by the end of the budget, and
    /// never with less than its own time (the event loop may have been slow to return, in
    /// a takeover's read bounded by --kube-timeout; the grace period's margin covers it).
    fn release_until(&self, now: Instant) -> Instant {
        self.until.max(now + self.release)
    }
}

/// When `shutdown` was signalled (the budget counts from there, not from when the event
/// loop got round to returning).
fn signalled(shutdown: &CancellationToken) -> tokio::task::JoinHandle<Instant> {
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        shutdown.cancelled().await;
        Instant::now()
    })
}

/// What every subsystem is built on: this replica's name, its Kubernetes client (and the
/// configuration fenced writers are built from), its metrics and vitals.
struct Base {
    identity: String,
    kube_config: kube::Config,
    client: Client,
    metrics: Metrics,
    vitals: Arc<Vitals>,
}

impl Base {
    async fn connect(args: &RunArgs, shutdown: &CancellationToken) -> anyhow::Result<Base> {
        let identity = args.leadership.identity();
        let context = "cannot build a Kubernetes client (KUBECONFIG or in-cluster)";
        let kube_config = crate::kube_client::config(&identity).await.context(context)?;
        let client = crate::kube_client::client(kube_config.clone(), args.kube.kube_timeout).context(context)?;
        let vitals = Vitals::new(shutdown.clone());
        Ok(Base { identity, kube_config, client, metrics: Metrics::new(), vitals })
    }

    /// A client whose requests go out only while leading (kube_client/fence.rs), for
    /// `what`: a deposed leader's late write must not undo the current leader's.
    fn fenced(&self, args: &RunArgs, leadership: &Leadership, what: &str) -> anyhow::Result<Client> {
        crate::kube_client::fenced(self.kube_config.clone(), args.kube.kube_timeout, leadership.clone())
            .with_context(|| format!("cannot build the {what} Kubernetes client"))
    }
}

/// What the ops server shares with the event loop: the snapshots it serves, readiness and
/// the heartbeat, and the server's task.
struct Ops {
    store: Arc<SnapshotStore>,
    ready: Arc<AtomicBool>,
    heartbeat: Arc<Heartbeat>,
    server: tokio::task::JoinHandle<()>,
}

impl Ops {
    async fn serve(
        args: &RunArgs,
        base: &Base,
        started: Instant,
        shutdown: &CancellationToken,
        xds: Option<&xds::Xds>,
    ) -> anyhow::Result<Ops> {
        let (store, ready) = (Arc::new(SnapshotStore::default()), Arc::new(AtomicBool::new(false)));
        let heartbeat = Arc::new(Heartbeat::new(started));
        let metrics = base.metrics.clone();
        let state = ServerState {
            store: store.clone(),
            render: Arc::new(move || metrics.render()),
            server_metrics: base.metrics.ops_server.clone(),
            ready: ready.clone(),
            heartbeat: heartbeat.clone(),
            heartbeat_timeout: args.ops.heartbeat_timeout,
            vitals: base.vitals.clone(),
            inflating: Arc::new(tokio::sync::Semaphore::new(crate::ops::MAX_INFLATING)),
            xds: xds.map(|x| x.server.clone()),
        };
        let listen = args.ops.listen;
        let limits = crate::ops::server::Limits::DEFAULT;
        let (bound, server) = crate::ops::serve(listen, state, limits, shutdown.clone())
            .await
            .with_context(|| format!("--listen {listen}: cannot bind"))?;
        tracing::info!(address = %bound, "serving /metrics /healthz /readyz /snapshot");
        Ok(Ops { store, ready, heartbeat, server })
    }
}

/// The sources (Kubernetes and Consul) feeding one event channel, and the pipeline with
/// the fixed watches applied.
fn start_sources(
    args: &RunArgs,
    base: &Base,
    discovered: Discovered,
    fixed: BTreeSet<WatchKey>,
    config: assembler::Config,
) -> (Watches, mpsc::Receiver<Event>, Pipeline) {
    let (tx, rx) = mpsc::channel::<Event>(4096);
    let consul = ConsulSource::new(args.consul.settings(), base.metrics.sources.consul.clone());
    // Until the first snapshot: its reads are what counts, and the blocking queries would
    // only compete with them (released in the event loop's first publication).
    consul.hold_blocking();
    let health = base.vitals.clone();
    consul.on_failing(move |why| health.failing(why));
    let kube = KubeSource::new(base.client.clone(), base.metrics.sources.clone(), discovered);
    let mut watches = Watches::new(kube, consul, tx, base.metrics.sources.clone(), base.vitals.clone());
    let clock = WallClock { instant: Instant::now(), wall: SystemTime::now() };
    let publication = &args.publication;
    let mut pipeline = Pipeline::new(config, publication.bootstrap_timeout, publication.coalesce_window, clock);
    watches.apply(&pipeline.set_fixed(fixed, Instant::now()));
    (watches, rx, pipeline)
}

/// The leader election campaign, or a leadership that always holds without a Lease.
fn campaign(args: &RunArgs, base: &Base) -> (Leadership, Option<Campaign>) {
    match args.leadership.lease(&base.identity) {
        Some(config) => {
            tracing::info!(lease = %config.lease, identity = %base.identity, "campaigning for the leader lease");
            let (leadership, campaign) = Campaign::spawn(base.client.clone(), config, &base.vitals);
            (leadership, Some(campaign))
        }
        None => (Leadership::always(), None),
    }
}

/// Each publisher's outlet: the hook and xDS (every replica), the ConfigMap (while
/// leading), with the Events that report publications.
fn start_outlets(
    args: &RunArgs,
    base: &Base,
    leadership: &Leadership,
    hook_dir: Option<&std::path::PathBuf>,
    xds: Option<&xds::Xds>,
) -> anyhow::Result<Outlets> {
    let publication = &args.publication;
    let mut local: Vec<Arc<dyn Publisher>> = Vec::new();
    if let Some(xds) = xds {
        local.push(Arc::new(XdsPublisher::new(xds.server.clone())));
    }
    if let (Some(command), Some(dir)) = (publication.on_snapshot.clone(), hook_dir) {
        let metrics = base.metrics.publishers.clone();
        local.push(Arc::new(HookPublisher::new(command, publication.on_snapshot_timeout, dir.clone(), metrics)));
    }
    // Its own client: the parts of a split snapshot are large.
    let configmap = match publication.snapshot_configmap.clone() {
        Some(target) => {
            let writer = base.fenced(args, leadership, "snapshot ConfigMap's")?;
            Some(Arc::new(ConfigMapPublisher::new(writer, target, leadership.clone())))
        }
        None => None,
    };
    let events = PublisherEvents::new(
        base.client.clone(),
        crate::kube_client::FIELD_MANAGER,
        base.identity.clone(),
        leadership.clone(),
        publication.snapshot_configmap.as_ref(),
        args.kube.kube_timeout,
        base.metrics.controller.event_failures.clone(),
    );
    let config = OutletConfig {
        timeout: publication.publish_timeout(),
        resync_period: args.kube.resync_period,
        metrics: base.metrics.publishers.clone(),
        vitals: base.vitals.clone(),
        events: Some(Arc::new(events)),
    };
    Ok(Outlets::start(local, configmap, leadership, config))
}

/// Whether the ConsulService CRD is installed: its kind is among the fixed watches.
fn exports_installed(fixed: &BTreeSet<WatchKey>) -> bool {
    let export_kind = consul_resolver_api::export::KIND;
    fixed.iter().any(|k| matches!(k, WatchKey::Kube(k) if k.is(resolver::GROUP, export_kind)))
}

/// The export controller, writing slices of the version the watches read
/// (`discovery.k8s.io/v1` where served, 1.21+), and the Service's fields the API server's
/// version has.
async fn start_exports(
    args: &RunArgs,
    base: &Base,
    leadership: &Leadership,
    endpoints_api: EndpointsApi,
) -> anyhow::Result<ExportController> {
    let v1 = endpoints_api == EndpointsApi::EndpointSlices;
    let cfg = ExportConfig {
        version: if v1 { SliceVersion::V1 } else { SliceVersion::V1beta1 },
        features: server_features(&base.client).await,
        ambassador_id: args.resolution.ambassador_id.clone(),
        resync: args.kube.resync_period,
        metrics: base.metrics.exports.clone(),
    };
    let writer = base.fenced(args, leadership, "exports'")?;
    Ok(ExportController::spawn(base.client.clone(), writer, leadership.clone(), cfg, &base.vitals))
}

/// What the API server's version says it knows, asked a few times: taken as knowing
/// nothing, the exports' Services would lose the fields the operator set on them until the
/// next restart. Still unanswered, it is taken so (warned).
async fn server_features(client: &Client) -> ServerFeatures {
    let mut delay = DISCOVERY_RETRY_FIRST;
    for attempt in 1..=VERSION_ATTEMPTS {
        match client.apiserver_version().await {
            Ok(info) => return ServerFeatures::of(&info),
            Err(e) if attempt == VERSION_ATTEMPTS => {
                tracing::warn!(error = %e, "cannot read the API server's version: the Service's spec.trafficDistribution is not written");
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?delay, "cannot read the API server's version; asking again");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(DISCOVERY_RETRY_MAX);
            }
        }
    }
    ServerFeatures::default()
}

/// How many times `/version` is asked at start (0.2 s doubling between: about 6 s in all).
const VERSION_ATTEMPTS: u32 = 6;

pub(crate) async fn run(mut args: RunArgs, shutdown: CancellationToken) -> anyhow::Result<()> {
    let started = Instant::now();
    let signalled = signalled(&shutdown);
    let base = Base::connect(&args, &shutdown).await?;
    let xds = xds::serve(&args.xds, &base, &shutdown).await?;
    let ops = Ops::serve(&args, &base, started, &shutdown, xds.as_ref()).await?;
    args.kube.watches = std::mem::take(&mut args.kube.watches).into_iter().map(without_own_output).collect();
    // Discovery found here for the start-up's checks is reused by the watches of those kinds.
    let discovered = Discovered::default();
    let (fixed, endpoints_api) = start_up_discovery(&base.client, &discovered, &args.kube).await?;
    tracing::info!(endpoints = ?endpoints_api, watches = fixed.len(), identity = %base.identity, "starting");
    let exporting = exports_installed(&fixed);
    let config = args.pipeline_config(endpoints_api);
    let (watches, events, pipeline) = start_sources(&args, &base, discovered, fixed, config);
    let (leadership, campaign) = campaign(&args, &base);
    let hook_dir = args.publication.on_snapshot.is_some().then(hook_dir);
    let outlets = start_outlets(&args, &base, &leadership, hook_dir.as_ref(), xds.as_ref())?;
    let resync = args.kube.resync_period;
    let metrics = base.metrics.controller.clone();
    let (client, identity) = (base.client.clone(), base.identity.clone());
    let controller = ResolverController::spawn(client, leadership.clone(), identity, metrics, resync, &base.vitals);
    let exports = if exporting { Some(start_exports(&args, &base, &leadership, endpoints_api).await?) } else { None };
    let event_loop = EventLoop {
        pipeline,
        watches,
        events,
        leadership,
        store: ops.store,
        outlets,
        controller,
        exports,
        metrics: base.metrics,
        ready: ops.ready,
        identity: base.identity,
        heartbeat: ops.heartbeat,
        started,
    };
    let stopped = event_loop.run(shutdown).await;
    shut_down(&args, stopped, campaign, signalled).await;
    let _ = ops.server.await;
    if let Some(xds) = xds {
        // Its streams were ended at the signal; a client that holds its connection open
        // must not hold the exit.
        let _ = tokio::time::timeout(XDS_CLOSE, xds.task).await;
    }
    // The hook's copy of the last snapshot goes with the process (it can be tens of MB).
    if let Some(dir) = hook_dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    tracing::info!("stopped");
    Ok(())
}

/// How long the exit waits for xDS clients to close their connections.
const XDS_CLOSE: Duration = Duration::from_secs(2);

/// The writers in flight finish or are cut off within the shutdown budget, then the Lease
/// is released, then the watches stop.
async fn shut_down(
    args: &RunArgs,
    (controller, exports, watches, outlets): event_loop::Stopped,
    campaign: Option<Campaign>,
    signalled: tokio::task::JoinHandle<Instant>,
) {
    let signalled = signalled.await.unwrap_or_else(|_| Instant::now());
    // A Lease request's own limit, within the client's --kube-timeout.
    let release = campaign.as_ref().map_or(Duration::ZERO, |c| c.release_time().min(args.kube.kube_timeout));
    let budget = ShutdownBudget::new(signalled, args.ops.shutdown_timeout, release);
    let within = budget.writers_until.saturating_duration_since(Instant::now());
    tracing::info!(
        writers_within = ?within,
        all_within = ?budget.until.saturating_duration_since(Instant::now()),
        "shutdown: publications and status writes in flight may finish, then what is left is cut off and the Lease \
         (with leader election) released"
    );
    tokio::join!(outlets.shutdown(budget.writers_until), controller.shutdown(within), async {
        if let Some(exports) = exports {
            exports.shutdown(within).await;
        }
    });
    if let Some(campaign) = campaign {
        campaign.release(budget.release_until(Instant::now())).await;
    }
    drop(watches);
}

/// Where the hook's snapshot file is written: a directory of this process's own. Two
/// operators on one machine (two replicas sharing /tmp, or the e2e suite's) must not write
/// one file: one's hook could read the other's snapshot, written between its rename and
/// the hook's read.
fn hook_dir() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("consul-resolver-operator-{}", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shutdown_budget_keeps_the_lease_release_its_time_at_the_end() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        // The defaults: 20 s, of which the release (a third of the 15 s lease) keeps 5 s.
        let b = ShutdownBudget::new(t0, s(20), s(5));
        assert_eq!((b.writers_until, b.until), (t0 + s(15), t0 + s(20)));
        assert_eq!(b.release_until(t0 + s(3)), t0 + s(20), "writers done early: the release has the rest");
        // The event loop returned late: the release still gets its own time.
        assert_eq!(b.release_until(t0 + s(18)), t0 + s(23));
        // A release longer than half the budget leaves the writers the other half.
        let b = ShutdownBudget::new(t0, s(6), s(10));
        assert_eq!((b.writers_until, b.until), (t0 + s(3), t0 + s(6)));
        // Without leader election, the writers have it all.
        assert_eq!(ShutdownBudget::new(t0, s(20), Duration::ZERO).writers_until, t0 + s(20));
    }

    /// The start-up asks every group it needs at once. Each discovery answer is held until
    /// three requests were in flight together (or two seconds passed, so that a start-up
    /// asking one after the other fails instead of hanging).
    #[tokio::test]
    async fn the_start_up_asks_every_group_at_once() {
        use http_body_util::Full;
        use hyper::{Request, Response};

        let (most, watch_most) = tokio::sync::watch::channel(0usize);
        let (most, in_flight) = (Arc::new(most), Arc::new(std::sync::atomic::AtomicUsize::new(0)));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (most2, in_flight2) = (most.clone(), in_flight.clone());
        let server = tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let (most, in_flight, watch_most) = (most2.clone(), in_flight2.clone(), most2.subscribe());
                let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let (most, in_flight) = (most.clone(), in_flight.clone());
                    let mut watch_most = watch_most.clone();
                    async move {
                        let now = in_flight.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                        most.send_modify(|m| *m = (*m).max(now));
                        let _ = tokio::time::timeout(Duration::from_secs(2), watch_most.wait_for(|&m| m >= 3)).await;
                        in_flight.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                        let body = discovery_answer(req.uri().path());
                        let code = if body.is_null() { 404 } else { 200 };
                        let body = Full::new(bytes::Bytes::from(serde_json::to_vec(&body).unwrap()));
                        Ok::<_, std::convert::Infallible>(Response::builder().status(code).body(body).unwrap())
                    }
                });
                tokio::spawn(async move {
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
                });
            }
        });
        let client = kube::Client::try_from(kube::Config::new(format!("http://{addr}").parse().unwrap())).unwrap();
        let argv = ["consul-resolver-operator", "run", "--namespace", "shop"];
        let args = match <crate::cli::Cli as clap::Parser>::try_parse_from(argv).unwrap().command {
            crate::cli::Command::Run(args) => *args,
            other => panic!("{other:?}"),
        };

        let (fixed, endpoints) = start_up_discovery(&client, &Discovered::default(), &args.kube).await.unwrap();
        server.abort();

        let kinds: Vec<String> = fixed.iter().map(ToString::to_string).collect();
        assert_eq!(fixed.len(), 4, "{kinds:?}");
        for kind in ["ConsulResolver", "ConsulService", "Mapping", "TCPMapping"] {
            assert!(kinds.iter().any(|k| k.starts_with(&format!("{kind}."))), "{kind} in {kinds:?}");
        }
        assert_eq!(endpoints, EndpointsApi::EndpointSlices);
        assert!(*watch_most.borrow() >= 3, "at most {} discovery requests at once", *watch_most.borrow());
    }

    /// The API server's discovery of the groups the start-up asks for.
    fn discovery_answer(path: &str) -> serde_json::Value {
        let resources = |gv: &str, kinds: &[(&str, &str)]| {
            let resources: Vec<_> = kinds
                .iter()
                .map(|(kind, plural)| {
                    serde_json::json!({"name": plural, "singularName": "", "namespaced": true, "kind": kind,
                        "verbs": ["get", "list", "watch"]})
                })
                .collect();
            serde_json::json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources})
        };
        match path {
            "/apis" => serde_json::json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [{
                "name": "getambassador.io",
                "versions": [{"groupVersion": "getambassador.io/v2", "version": "v2"}],
                "preferredVersion": {"groupVersion": "getambassador.io/v2", "version": "v2"}}]}),
            "/apis/getambassador.io/v2" => {
                resources("getambassador.io/v2", &[("Mapping", "mappings"), ("TCPMapping", "tcpmappings")])
            }
            "/apis/consulresolver.io/v1alpha1" => resources(
                "consulresolver.io/v1alpha1",
                &[("ConsulResolver", "consulresolvers"), ("ConsulService", "consulservices")],
            ),
            "/apis/discovery.k8s.io/v1" => resources("discovery.k8s.io/v1", &[("EndpointSlice", "endpointslices")]),
            _ => serde_json::Value::Null,
        }
    }

    /// The endpoints API is asked until the answer is authoritative, but a start-up that
    /// fails meanwhile (nothing answers: the API server unreachable) still ends, with its
    /// error, instead of waiting for that answer forever.
    #[tokio::test]
    async fn a_start_up_that_fails_is_not_held_by_the_endpoints_api_retries() {
        let nothing = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
        let client = kube::Client::try_from(kube::Config::new(format!("http://{nothing}").parse().unwrap())).unwrap();
        let argv = ["consul-resolver-operator", "run"];
        let args = match <crate::cli::Cli as clap::Parser>::try_parse_from(argv).unwrap().command {
            crate::cli::Command::Run(args) => *args,
            other => panic!("{other:?}"),
        };
        let discovered = Discovered::default();
        let ended = tokio::time::timeout(Duration::from_secs(20), start_up_discovery(&client, &discovered, &args.kube));
        let result = ended.await.expect("the start-up ends");
        assert!(result.is_err(), "nothing answers: the start-up fails");
    }

    /// Only an authoritative answer selects the fallback: a 404 at once; a 503 or a 429 is
    /// asked again until the server says (here, that v1 is served).
    #[tokio::test]
    async fn the_endpoints_api_falls_back_only_on_an_authoritative_answer() {
        use crate::test_fixtures::{self, serve};
        let v1 = "/apis/discovery.k8s.io/v1";
        let refusals = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = refusals.clone();
        let flaky = serve(Arc::new(move |_: &str, path: &str, _: &[u8]| {
            if path != v1 {
                return test_fixtures::not_found(path);
            }
            // Two requests (the cached discovery and the direct one) per attempt.
            match counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
                0 | 1 => (503, serde_json::json!({"kind": "Status", "code": 503, "reason": "ServiceUnavailable"})),
                2 | 3 => (429, serde_json::json!({"kind": "Status", "code": 429, "reason": "TooManyRequests"})),
                _ => (200, discovery_answer(v1)),
            }
        }))
        .await;
        let api = endpoints_api(&flaky.client, &Discovered::default()).await;
        assert_eq!(api, EndpointsApi::EndpointSlices, "a 503 and a 429 are not a fallback");
        assert!(refusals.load(std::sync::atomic::Ordering::SeqCst) >= 5);

        let absent = serve(Arc::new(|_: &str, path: &str, _: &[u8]| test_fixtures::not_found(path))).await;
        assert_eq!(endpoints_api(&absent.client, &Discovered::default()).await, EndpointsApi::Endpoints);
        assert!(absent.take().len() <= 3, "asked once: {:?}", absent.take());
        // Served without the kind: the fallback too.
        let list = serde_json::from_value(serde_json::json!({"groupVersion": "discovery.k8s.io/v1", "resources": []}));
        assert_eq!(endpoints_api_from(Ok(list.unwrap())), Ok(EndpointsApi::Endpoints));
    }
}
