//! The runtime: drives the pure pipeline with the real sources and publishers.
//!
//! One loop owns the pipeline. It drains events in batches (so a flood of 10,000 list
//! events is one reconciliation, not 10,000), applies the registry's diffs to the running
//! watches, feeds the resolver controller's store, and runs at most one task at a time
//! against the publishers: a publication, or (every resync period) a repair of the
//! snapshot ConfigMap. Every publisher's part has a deadline, so a hung one fails the
//! publication (retried with backoff) instead of holding back every later one.
//!
//! With leader election, every replica watches, assembles and serves HTTP (and runs its
//! hook), but only the lease holder writes to the cluster (ConfigMap, statuses, Events),
//! each write bounded by its leadership deadline. A replica that becomes leader writes the
//! current snapshot at once, numbered after the one already in the ConfigMap.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant as StdInstant, SystemTime};

use anyhow::Context;
use kube::Client;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::cli::RunArgs;
use crate::controller::ResolverController;
use crate::leadership::{Campaign, Leadership, LeaseConfig};
use crate::metrics::Metrics;
use crate::publishers::Publisher;
use crate::publishers::configmap::ConfigMapPublisher;
use crate::publishers::hook::HookPublisher;
use crate::publishers::http::{self, HttpPublisher, ServerState, SnapshotStore};
use crate::sources::Watches;
use crate::sources::consul::{ConsulSource, Settings as ConsulSettings};
use crate::sources::kube::KubeSource;
use consul_resolver_api::mapping::{self, MappingKind};
use consul_resolver_api::resolver;
use consul_resolver_core::assembler::{self, EndpointsApi, Snapshot};
use consul_resolver_core::keys::{KubeKey, WatchKey};
use consul_resolver_core::model::Event;
use consul_resolver_core::pipeline::{Pipeline, Step, WallClock};

/// Most events folded into the world per batch.
const MAX_BATCH: usize = 10_000;

/// The operator's fixed watches: its own CRD and Ambassador's route kinds (those the API
/// server serves), per watched namespace, plus the static `--watch` keys.
async fn fixed_keys(client: &Client, args: &RunArgs) -> anyhow::Result<BTreeSet<WatchKey>> {
    let mut kinds = vec![KubeKey::new(resolver::GROUP, resolver::VERSION, resolver::KIND)];
    crate::sources::kube::resolve(client, &kinds[0])
        .await
        .map_err(anyhow::Error::msg)
        .context("the ConsulResolver CRD is not installed (kubectl apply -f crds/)")?;
    for kind in MappingKind::ALL {
        let key = KubeKey::new(mapping::GROUP, "", kind.kind());
        match crate::sources::kube::resolve(client, &key).await {
            Ok(_) => kinds.push(key),
            Err(e) => tracing::warn!(kind = kind.kind(), error = %e, "Ambassador kind not served; not watched"),
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

/// EndpointSlices where `discovery.k8s.io/v1` is served (1.21+), else core Endpoints.
async fn endpoints_api(client: &Client) -> EndpointsApi {
    let key = KubeKey::new("discovery.k8s.io", "v1", "EndpointSlice");
    match crate::sources::kube::resolve(client, &key).await {
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

/// Where snapshots go: `local` ones on every replica, the ConfigMap only on the leader.
struct Publishers {
    local: Vec<Arc<dyn Publisher>>,
    configmap: Option<Arc<ConfigMapPublisher>>,
    leadership: Leadership,
    timeout: Duration,
    metrics: Metrics,
}

/// What the one task against the publishers is doing.
enum Task {
    Publication(Arc<Snapshot>, JoinHandle<bool>),
    Repair(JoinHandle<()>),
}

pub(crate) async fn run(args: RunArgs, shutdown: CancellationToken) -> anyhow::Result<()> {
    let identity = identity(&args);
    let client = crate::kube_client::client(&identity, args.kube_timeout)
        .await
        .context("cannot build a Kubernetes client (KUBECONFIG or in-cluster)")?;
    let metrics = Metrics::new();
    let store = Arc::new(SnapshotStore::default());
    let ready = Arc::new(AtomicBool::new(false));
    let state = ServerState { store: store.clone(), metrics: metrics.clone(), ready: ready.clone() };
    let (bound, server) = http::serve(args.listen, state, shutdown.clone())
        .await
        .with_context(|| format!("--listen {}: cannot bind", args.listen))?;
    tracing::info!(address = %bound, "serving /metrics /healthz /readyz /snapshot");

    let fixed = fixed_keys(&client, &args).await?;
    let config = assembler::Config {
        ambassador_id: args.ambassador_id.clone(),
        default_resolver: args.default_resolver.clone(),
        endpoints_api: endpoints_api(&client).await,
        env: std::env::vars().collect(),
        static_watches: args.watches.clone(),
    };
    tracing::info!(endpoints = ?config.endpoints_api, watches = fixed.len(), %identity, "starting");

    let (tx, mut rx) = mpsc::channel::<Event>(4096);
    let consul = ConsulSource::new(ConsulSettings {
        wait: args.consul_wait,
        max_connections: args.consul_max_connections as usize,
        ..ConsulSettings::default()
    });
    let mut watches = Watches::new(KubeSource::new(client.clone(), metrics.clone()), consul, tx);
    let clock = WallClock { instant: Instant::now(), wall: SystemTime::now() };
    let mut pipeline = Pipeline::new(config, args.bootstrap_timeout, args.coalesce_window, clock);
    watches.apply(&pipeline.set_fixed(fixed, Instant::now()));

    let (mut leadership, campaign) = match args.leader_election_lease.clone() {
        Some(lease) => {
            tracing::info!(%lease, %identity, "campaigning for the leader lease");
            let config = LeaseConfig { lease, identity: identity.clone(), duration: args.leader_election_duration };
            let (leadership, campaign) = Campaign::spawn(client.clone(), config);
            (leadership, Some(campaign))
        }
        None => (Leadership::always(), None),
    };

    let mut local: Vec<Arc<dyn Publisher>> = vec![Arc::new(HttpPublisher(store))];
    if let Some(command) = args.on_snapshot.clone() {
        let dir = std::env::temp_dir().join("consul-resolver-operator");
        local.push(Arc::new(HookPublisher::new(command, args.on_snapshot_timeout, dir)));
    }
    let configmap = args
        .snapshot_configmap
        .clone()
        .map(|t| Arc::new(ConfigMapPublisher::new(client.clone(), t, leadership.clone())));
    // The hook has its own limit, which kills it: give it that, plus a moment to reap.
    let publish_timeout = args.publish_timeout.max(args.on_snapshot_timeout + Duration::from_secs(5));
    let publishers = Arc::new(Publishers {
        local,
        configmap: configmap.clone(),
        leadership: leadership.clone(),
        timeout: publish_timeout,
        metrics: metrics.clone(),
    });
    let mut controller = ResolverController::spawn(
        client.clone(),
        leadership.clone(),
        identity.clone(),
        metrics.clone(),
        args.resync_period,
    );

    let mut leading = leadership.is_leading();
    metrics.leader.set(leading as i64);
    let mut task: Option<Task> = None;
    let mut logged_waiting = false;
    let mut repair_due = Instant::now() + args.resync_period;

    loop {
        let step = if task.is_none() { pipeline.poll(Instant::now()) } else { Step::Idle };
        let wake = match step {
            Step::Publish(snapshot) => {
                let handle = tokio::spawn(publish(publishers.clone(), snapshot.clone()));
                task = Some(Task::Publication(snapshot, handle));
                continue;
            }
            Step::WaitUntil(at) => Some(at),
            Step::Idle => None,
        };
        if !pipeline.has_published() && !logged_waiting {
            tracing::info!(readiness = ?pipeline.readiness(Instant::now()), "waiting for a complete world before the first snapshot");
            logged_waiting = true;
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            now_leading = leadership.changed() => {
                if now_leading != leading {
                    tracing::info!(%identity, leading = now_leading, "leadership changed");
                    metrics.leader.set(now_leading as i64);
                }
                if now_leading && !leading {
                    // Another replica may have written since we last did (or we never
                    // did): write everything again, continuing its snapshot ids.
                    if let Some(c) = &configmap {
                        c.forget();
                    }
                    let floor = match &configmap {
                        Some(c) => c.published_id().await.unwrap_or_else(|e| {
                            tracing::warn!(error = %e, "cannot read the last snapshot id; continuing from ours");
                            None
                        }),
                        None => None,
                    };
                    pipeline.republish(floor.unwrap_or(0));
                    controller.leading();
                }
                leading = now_leading;
            }
            Some(first) = rx.recv() => {
                let mut batch = vec![first];
                while batch.len() < MAX_BATCH {
                    match rx.try_recv() {
                        Ok(e) => batch.push(e),
                        Err(_) => break,
                    }
                }
                for e in &batch {
                    let source = match e { Event::Kube(..) => "kubernetes", Event::Consul(..) => "consul" };
                    metrics.events.with_label_values(&[source]).inc();
                }
                let diff = pipeline.apply(batch, Instant::now());
                watches.apply(&diff);
                controller.sync(pipeline.world());
                for (source, n) in watches.counts() {
                    metrics.watches.with_label_values(&[source]).set(n as i64);
                }
            }
            done = finished(&mut task), if task.is_some() => {
                match (task.take(), done) {
                    (Some(Task::Publication(snapshot, _)), ok) => {
                        pipeline.published(&snapshot, ok, Instant::now());
                        controller.published(&snapshot);
                        if ok {
                            ready.store(true, Ordering::Relaxed);
                            metrics.bootstrapped.set(1);
                        }
                    }
                    (Some(Task::Repair(_)), _) | (None, _) => {}
                }
            }
            _ = tokio::time::sleep_until(repair_due), if task.is_none() => {
                repair_due = Instant::now() + args.resync_period;
                if let Some(c) = configmap.clone().filter(|_| leadership.is_leading()) {
                    let metrics = metrics.clone();
                    task = Some(Task::Repair(tokio::spawn(async move {
                        match c.repair().await {
                            Ok(names) if names.is_empty() => {}
                            Ok(names) => {
                                tracing::warn!(configmaps = ?names, "the snapshot ConfigMap was deleted or edited; written again");
                                metrics.repairs.with_label_values(&["configmap"]).inc();
                            }
                            Err(e) => tracing::warn!(error = %e, "cannot check the snapshot ConfigMap; trying again at the next resync"),
                        }
                    })));
                }
            }
            _ = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now)), if wake.is_some() => {}
        }
    }
    // Let the task in flight finish: a half-written snapshot helps nobody (each write is
    // bounded by the leadership deadline and the publish timeout).
    let _ = finished(&mut task).await;
    controller.shutdown(args.kube_timeout).await;
    if let Some(campaign) = campaign {
        campaign.release().await;
    }
    drop(watches);
    let _ = server.await;
    tracing::info!("stopped");
    Ok(())
}

/// Waits for the task in flight: `true` for a publication that succeeded.
async fn finished(task: &mut Option<Task>) -> bool {
    match task {
        Some(Task::Publication(_, handle)) => handle.await.unwrap_or(false),
        Some(Task::Repair(handle)) => {
            let _ = handle.await;
            true
        }
        None => true,
    }
}

/// One publication: every local publisher, then the ConfigMap while leading, each within
/// the publish timeout.
async fn publish(publishers: Arc<Publishers>, snapshot: Arc<Snapshot>) -> bool {
    let started = StdInstant::now();
    let metrics = &publishers.metrics;
    let mut ok = true;
    let cluster = publishers
        .configmap
        .iter()
        .filter(|_| publishers.leadership.is_leading())
        .map(|c| c.clone() as Arc<dyn Publisher>);
    for p in publishers.local.iter().cloned().chain(cluster) {
        let result = match tokio::time::timeout(publishers.timeout, p.publish(snapshot.clone())).await {
            Ok(r) => r,
            Err(_) => Err(format!("did not finish within {:?} (--publish-timeout)", publishers.timeout)),
        };
        if let Err(e) = result {
            tracing::warn!(publisher = p.name(), id = snapshot.id, error = %e, "publication failed; will retry");
            metrics.publish_failures.with_label_values(&[p.name()]).inc();
            ok = false;
        }
    }
    metrics.publish_seconds.observe(started.elapsed().as_secs_f64());
    if ok {
        metrics.snapshots_published.inc();
        metrics.snapshot_id.set(snapshot.id as i64);
        metrics.problems.set(snapshot.content.problems.len() as i64);
        tracing::info!(
            id = snapshot.id,
            hash = %snapshot.hash,
            complete = snapshot.content.bootstrap.complete,
            mappings = snapshot.content.mappings.len(),
            resolvers = snapshot.content.resolvers.len(),
            problems = snapshot.content.problems.len(),
            "snapshot published"
        );
    }
    ok
}
