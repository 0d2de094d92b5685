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

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use kube::Client;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::cli::RunArgs;
use crate::controller::ResolverController;
use crate::export::{ExportConfig, ExportController, SliceVersion};
use crate::leadership::{Campaign, Leadership, LeaseConfig};
use crate::metrics::Metrics;
use crate::ops::ServerState;
use crate::ops::health::{Heartbeat, Vitals};
use crate::publishers::Publisher;
use crate::publishers::configmap::ConfigMapPublisher;
use crate::publishers::hook::HookPublisher;
use crate::publishers::http::SnapshotStore;
use crate::sources::Watches;
use crate::sources::kube::{Discovered, KubeSource};
use consul_resolver_api::mapping::{self, MappingKind};
use consul_resolver_api::resolver;
use consul_resolver_core::assembler::{self, EndpointsApi};
use consul_resolver_core::keys::{KubeKey, WatchKey};
use consul_resolver_core::model::Event;
use consul_resolver_core::pipeline::{Pipeline, WallClock};
use consul_watch::{ConsulSource, Settings as ConsulSettings};
use event_loop::EventLoop;
use publication::{OutletConfig, Outlets};
use publisher_events::PublisherEvents;

/// The operator's fixed watches: its own CRD and Ambassador's route kinds (those the API
/// server serves), per watched namespace, plus the static `--watch` keys.
async fn fixed_keys(client: &Client, discovered: &Discovered, args: &RunArgs) -> anyhow::Result<BTreeSet<WatchKey>> {
    let mut kinds = vec![KubeKey::new(resolver::GROUP, resolver::VERSION, resolver::KIND)];
    discovered
        .resolve(client, &kinds[0])
        .await
        .map_err(anyhow::Error::msg)
        .context("the ConsulResolver CRD is not installed (kubectl apply -f crds/)")?;
    for kind in MappingKind::ALL {
        let key = KubeKey::new(mapping::GROUP, "", kind.kind());
        match discovered.resolve(client, &key).await {
            Ok(_) => kinds.push(key),
            Err(e) => tracing::warn!(kind = kind.kind(), error = %e, "Ambassador kind not served; not watched"),
        }
    }
    // Exports only where their CRD is installed (crds/consulservice.yaml).
    let exports = KubeKey::new(resolver::GROUP, resolver::VERSION, consul_resolver_api::export::KIND);
    match discovered.resolve(client, &exports).await {
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

/// EndpointSlices where `discovery.k8s.io/v1` is served (1.21+), else core Endpoints.
async fn endpoints_api(client: &Client, discovered: &Discovered) -> EndpointsApi {
    let key = KubeKey::new("discovery.k8s.io", "v1", "EndpointSlice");
    match discovered.resolve(client, &key).await {
        Ok(_) => EndpointsApi::EndpointSlices,
        Err(_) => EndpointsApi::Endpoints,
    }
}

/// This replica's name in the lease, in Events' `reportingInstance` and in its
/// User-Agent.
fn identity(args: &RunArgs) -> String {
    args.leader_election_identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let host = host.trim();
        format!("{}-{}", if host.is_empty() { "consul-resolver-operator" } else { host }, std::process::id())
    })
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

pub(crate) async fn run(args: RunArgs, shutdown: CancellationToken) -> anyhow::Result<()> {
    let started = Instant::now();
    let signalled = signalled(&shutdown);
    let identity = identity(&args);
    let kube_config = crate::kube_client::config(&identity)
        .await
        .context("cannot build a Kubernetes client (KUBECONFIG or in-cluster)")?;
    let client = crate::kube_client::client(kube_config.clone(), args.kube_timeout)
        .context("cannot build a Kubernetes client (KUBECONFIG or in-cluster)")?;
    let metrics = Metrics::new();
    let store = Arc::new(SnapshotStore::default());
    let ready = Arc::new(AtomicBool::new(false));
    let heartbeat = Arc::new(Heartbeat::new(started));
    let vitals = Vitals::new(shutdown.clone());
    let state = ServerState {
        store: store.clone(),
        render: {
            let metrics = metrics.clone();
            Arc::new(move || metrics.render())
        },
        server_metrics: metrics.ops_server.clone(),
        ready: ready.clone(),
        heartbeat: heartbeat.clone(),
        heartbeat_timeout: args.heartbeat_timeout,
        vitals: vitals.clone(),
    };
    let (bound, server) = crate::ops::serve(args.listen, state, crate::ops::server::Limits::DEFAULT, shutdown.clone())
        .await
        .with_context(|| format!("--listen {}: cannot bind", args.listen))?;
    tracing::info!(address = %bound, "serving /metrics /healthz /readyz /snapshot");

    let mut args = args;
    args.watches = args.watches.into_iter().map(without_own_output).collect();
    // Discovery found here for the start-up's checks is reused by the watches of those kinds.
    let discovered = Discovered::default();
    let fixed = fixed_keys(&client, &discovered, &args).await?;
    let config = assembler::Config {
        ambassador_id: args.ambassador_id.clone(),
        default_resolver: args.default_resolver.clone(),
        endpoints_api: endpoints_api(&client, &discovered).await,
        endpoints_namespace_watch_above: args.endpoints_namespace_watch_above,
        // Only the variables an address may name: the rest of the environment may hold
        // secrets, and an expanded address is published.
        env: std::env::vars().filter(|(name, _)| args.address_env.contains(name)).collect(),
        static_watches: args.watches.clone(),
    };
    tracing::info!(endpoints = ?config.endpoints_api, watches = fixed.len(), %identity, "starting");
    let exporting = fixed
        .iter()
        .any(|k| matches!(k, WatchKey::Kube(k) if k.is(resolver::GROUP, consul_resolver_api::export::KIND)));
    // Slices of the version the watches read: `discovery.k8s.io/v1` where served (1.21+).
    let v1 = config.endpoints_api == EndpointsApi::EndpointSlices;

    let (tx, rx) = mpsc::channel::<Event>(4096);
    let consul = ConsulSource::new(
        ConsulSettings {
            wait: args.consul_wait,
            max_connections: args.consul_max_connections as usize,
            sweep: args.consul_sweep,
            max_response_bytes: usize::try_from(args.consul_max_response_bytes).unwrap_or(usize::MAX),
            ..ConsulSettings::default()
        },
        metrics.sources.consul.clone(),
    );
    // Until the first snapshot: its reads are what counts, and the blocking queries would
    // only compete with them (released in the event loop's first publication).
    consul.hold_blocking();
    let mut watches = Watches::new(
        KubeSource::new(client.clone(), metrics.sources.clone(), discovered),
        consul,
        tx,
        metrics.sources.clone(),
    );
    let clock = WallClock { instant: Instant::now(), wall: SystemTime::now() };
    let (ambassador_id, env) = (config.ambassador_id.clone(), config.env.clone());
    let mut pipeline = Pipeline::new(config, args.bootstrap_timeout, args.coalesce_window, clock);
    watches.apply(&pipeline.set_fixed(fixed, Instant::now()));

    let (leadership, campaign) = match args.leader_election_lease.clone() {
        Some(lease) => {
            tracing::info!(%lease, %identity, "campaigning for the leader lease");
            let config = LeaseConfig { lease, identity: identity.clone(), duration: args.leader_election_duration };
            let (leadership, campaign) = Campaign::spawn(client.clone(), config, &vitals);
            (leadership, Some(campaign))
        }
        None => (Leadership::always(), None),
    };

    let mut local: Vec<Arc<dyn Publisher>> = Vec::new();
    let hook_dir = args.on_snapshot.is_some().then(hook_dir);
    if let (Some(command), Some(dir)) = (args.on_snapshot.clone(), &hook_dir) {
        let publisher = HookPublisher::new(command, args.on_snapshot_timeout, dir.clone(), metrics.publishers.clone());
        local.push(Arc::new(publisher));
    }
    let configmap = match args.snapshot_configmap.clone() {
        // Its own client: the parts of a split snapshot are large, and their bodies go out
        // only while leading (kube_client/fence.rs).
        Some(target) => {
            let writer = crate::kube_client::fenced(kube_config, args.kube_timeout, leadership.clone())
                .context("cannot build the snapshot ConfigMap's Kubernetes client")?;
            Some(Arc::new(ConfigMapPublisher::new(writer, target, leadership.clone())))
        }
        None => None,
    };
    let events = PublisherEvents::new(
        client.clone(),
        crate::kube_client::FIELD_MANAGER,
        identity.clone(),
        leadership.clone(),
        args.snapshot_configmap.as_ref(),
        args.kube_timeout,
        metrics.controller.event_failures.clone(),
    );
    // The hook has its own limit, which kills it: give it that, plus a moment to reap.
    let publish_timeout = args.publish_timeout.max(args.on_snapshot_timeout + Duration::from_secs(5));
    let outlets = Outlets::start(
        local,
        configmap,
        &leadership,
        OutletConfig {
            timeout: publish_timeout,
            resync_period: args.resync_period,
            metrics: metrics.publishers.clone(),
            vitals: vitals.clone(),
            events: Some(Arc::new(events)),
        },
    );
    let controller = ResolverController::spawn(
        client.clone(),
        leadership.clone(),
        identity.clone(),
        metrics.controller.clone(),
        args.resync_period,
        &vitals,
    );
    let exports = if exporting {
        let cfg = ExportConfig {
            version: if v1 { SliceVersion::V1 } else { SliceVersion::V1beta1 },
            ambassador_id: args.ambassador_id.clone(),
            resync: args.resync_period,
            metrics: metrics.exports.clone(),
        };
        Some(ExportController::spawn(client.clone(), leadership.clone(), cfg, &vitals))
    } else {
        None
    };

    let event_loop = EventLoop {
        pipeline,
        watches,
        events: rx,
        leadership,
        store,
        outlets,
        controller,
        exports,
        metrics,
        ready,
        identity,
        heartbeat,
        started,
        ambassador_id,
        env,
    };
    let (controller, exports, watches, outlets) = event_loop.run(shutdown).await;
    let signalled = signalled.await.unwrap_or_else(|_| Instant::now());
    // A Lease request's own limit, within the client's --kube-timeout.
    let release = campaign.as_ref().map_or(Duration::ZERO, |c| c.release_time().min(args.kube_timeout));
    let budget = ShutdownBudget::new(signalled, args.shutdown_timeout, release);
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
    let _ = server.await;
    // The hook's copy of the last snapshot goes with the process (it can be tens of MB).
    if let Some(dir) = hook_dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    tracing::info!("stopped");
    Ok(())
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
}
