//! The runtime: drives the pure pipeline with the real sources and publishers.
//!
//! One loop owns the pipeline. It drains events in batches (so a flood of 10,000 list
//! events is one reconciliation, not 10,000), applies the registry's diffs to the running
//! watches, and runs at most one publication at a time as its own task.
//!
//! With leader election, every replica watches, assembles and serves HTTP (and runs its
//! hook), but only the lease holder writes to the cluster (ConfigMap, statuses, Events).
//! A replica that becomes leader writes the current snapshot at once, numbered after the
//! one already in the ConfigMap.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant as StdInstant;

use anyhow::Context;
use kube::Client;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::api::mapping::{self, MappingKind};
use crate::cli::RunArgs;
use crate::core::aggregator::Event;
use crate::core::assembler::{self, EndpointsApi, Snapshot};
use crate::core::keys::{KubeKey, WatchKey};
use crate::core::pipeline::{Pipeline, Step};
use crate::lease::{Leadership, LeaseConfig};
use crate::metrics::Metrics;
use crate::publishers::Publisher;
use crate::publishers::configmap::ConfigMapPublisher;
use crate::publishers::events::EventPublisher;
use crate::publishers::hook::HookPublisher;
use crate::publishers::http::{self, HttpPublisher, ServerState, SnapshotStore};
use crate::publishers::status::StatusPublisher;
use crate::sources::consul::{ConsulSource, Settings as ConsulSettings};
use crate::sources::kube::KubeSource;
use crate::sources::{Source, Watches};

/// Most events folded into the world per batch.
const MAX_BATCH: usize = 10_000;

/// The operator's fixed watches: its own CRD and Ambassador's route kinds (those the API
/// server serves), per watched namespace, plus the static `--watch` keys.
async fn fixed_keys(client: &Client, args: &RunArgs) -> anyhow::Result<BTreeSet<WatchKey>> {
    let mut kinds = vec![KubeKey::new(assembler::resolvers::GROUP, "v1alpha1", assembler::resolvers::KIND)];
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

/// This replica's name in the lease and in Events' `reportingInstance`.
fn identity(args: &RunArgs) -> String {
    args.leader_election_identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let host = host.trim();
        format!("{}-{}", if host.is_empty() { "consul-resolver-operator" } else { host }, std::process::id())
    })
}

/// Where snapshots go: `local` ones on every replica, `cluster` ones only on the leader.
struct Publishers {
    local: Vec<Arc<dyn Publisher>>,
    cluster: Vec<Arc<dyn Publisher>>,
}

pub async fn run(args: RunArgs, shutdown: CancellationToken) -> anyhow::Result<()> {
    let client = Client::try_default().await.context("cannot build a Kubernetes client (KUBECONFIG or in-cluster)")?;
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
    tracing::info!(endpoints = ?config.endpoints_api, watches = fixed.len(), "starting");

    let (tx, mut rx) = mpsc::channel::<Event>(4096);
    let consul = ConsulSource::new(ConsulSettings {
        wait: args.consul_wait,
        max_connections: args.consul_max_connections as usize,
        ..ConsulSettings::default()
    });
    let sources: Vec<Arc<dyn Source>> = vec![Arc::new(KubeSource::new(client.clone())), Arc::new(consul)];
    let mut watches = Watches::new(sources, tx);
    let mut pipeline = Pipeline::new(config, args.bootstrap_timeout, args.coalesce_window);
    watches.apply(&pipeline.set_fixed(fixed, Instant::now()));

    let identity = identity(&args);
    let mut local: Vec<Arc<dyn Publisher>> = vec![Arc::new(HttpPublisher(store))];
    if let Some(command) = args.on_snapshot.clone() {
        let dir = std::env::temp_dir().join("consul-resolver-operator");
        local.push(Arc::new(HookPublisher::new(command, args.on_snapshot_timeout, dir)));
    }
    let configmap = args.snapshot_configmap.clone().map(|t| Arc::new(ConfigMapPublisher::new(client.clone(), t)));
    let mut cluster: Vec<Arc<dyn Publisher>> = Vec::new();
    if let Some(c) = &configmap {
        cluster.push(c.clone());
    }
    cluster.push(Arc::new(StatusPublisher::new(client.clone())));
    cluster.push(Arc::new(EventPublisher::new(client.clone(), identity.clone(), metrics.clone())));
    let publishers = Arc::new(Publishers { local, cluster });

    // Without a lease this process always leads; the sender lives as long as the loop.
    let (_always, mut leader, leadership) = match args.leader_election_lease.clone() {
        Some(lease) => {
            tracing::info!(%lease, %identity, "campaigning for the leader lease");
            let config = LeaseConfig { lease, identity: identity.clone(), duration: args.leader_election_duration };
            let (rx, leadership) = Leadership::spawn(client.clone(), config);
            (None, rx, Some(leadership))
        }
        None => {
            let (tx, rx) = watch::channel(true);
            (Some(tx), rx, None)
        }
    };
    let mut leading = *leader.borrow_and_update();
    metrics.leader.set(leading as i64);
    let mut in_flight: Option<(Arc<Snapshot>, tokio::task::JoinHandle<bool>)> = None;
    let mut logged_waiting = false;

    loop {
        let step = if in_flight.is_none() { pipeline.poll(Instant::now()) } else { Step::Idle };
        let wake = match step {
            Step::Publish(snapshot) => {
                let task = tokio::spawn(publish(publishers.clone(), leader.clone(), snapshot.clone(), metrics.clone()));
                in_flight = Some((snapshot, task));
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
            Ok(()) = leader.changed() => {
                let now_leading = *leader.borrow_and_update();
                metrics.leader.set(now_leading as i64);
                if now_leading && !leading {
                    // Another replica may have written since we last did (or we never
                    // did): write everything again, continuing its snapshot ids.
                    for p in &publishers.cluster {
                        p.forget();
                    }
                    let floor = match &configmap {
                        Some(c) => c.published_id().await.unwrap_or_else(|e| {
                            tracing::warn!(error = %e, "cannot read the last snapshot id; continuing from ours");
                            None
                        }),
                        None => None,
                    };
                    pipeline.republish(floor.unwrap_or(0));
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
                for (source, n) in watches.counts() {
                    metrics.watches.with_label_values(&[source]).set(n as i64);
                }
            }
            done = async { (&mut in_flight.as_mut().expect("guarded by is_some").1).await }, if in_flight.is_some() => {
                let (snapshot, _) = in_flight.take().expect("guarded by is_some");
                let ok = done.unwrap_or(false);
                pipeline.published(&snapshot, ok, Instant::now());
                if ok {
                    ready.store(true, Ordering::Relaxed);
                    metrics.bootstrapped.set(1);
                }
            }
            _ = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now)), if wake.is_some() => {}
        }
    }
    // Let a publication in flight finish: a half-written snapshot helps nobody.
    if let Some((_, task)) = in_flight {
        let _ = task.await;
    }
    if let Some(leadership) = leadership {
        leadership.release().await;
    }
    drop(watches);
    let _ = server.await;
    tracing::info!("stopped");
    Ok(())
}

async fn publish(
    publishers: Arc<Publishers>,
    leader: watch::Receiver<bool>,
    snapshot: Arc<Snapshot>,
    metrics: Metrics,
) -> bool {
    let started = StdInstant::now();
    let mut ok = true;
    // Leadership is checked before each cluster write, so a replica that loses the lease
    // mid-publication stops writing at the next publisher (it lost it with a third of the
    // lease duration to spare).
    let cluster = publishers.cluster.iter().filter(|_| *leader.borrow());
    for p in publishers.local.iter().chain(cluster) {
        if let Err(e) = p.publish(snapshot.clone()).await {
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
