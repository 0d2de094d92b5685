//! The one loop that owns the pipeline, with a named handler per thing it waits for.
//!
//! It drains events in batches (so a flood of 10,000 list events is one reconciliation,
//! not 10,000), applies the registry's diffs to the running watches, feeds the resolver
//! controller's store, and publishes: each new snapshot is served over HTTP at once and
//! handed to the other publishers' outlets, which deliver it on their own
//! (`publication`), so none of them holds back the loop or each other.
//!
//! It beats a heartbeat every time it turns, and turns at least every second (a tick that
//! also refreshes the gauges read from the world), so `/healthz` tells a wedged loop from
//! an idle one.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use tokio::sync::mpsc;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::publication::Outlets;
use super::registry::Metrics;
use crate::controller::export::ExportController;
use crate::controller::resolver::ResolverController;
use crate::leadership::Leadership;
use crate::measure::unix_seconds;
use crate::ops::health::{BEAT_EVERY, Heartbeat};
use crate::publishers::http::SnapshotStore;
use crate::sources::Watches;
use consul_resolver_api::resolver;
use consul_resolver_core::assembler::{Snapshot, resolvers};
use consul_resolver_core::keys::{KubeKey, WatchKey};
use consul_resolver_core::model::Event;
use consul_resolver_core::pipeline::{Pipeline, Step};

/// Most events folded into the world per batch.
const MAX_BATCH: usize = 10_000;

/// The longest a published snapshot's resolver statuses wait for the ConfigMap to hold it
/// (a ConfigMap write slower than this, or stuck, holds no status back longer).
const STATUSES_WAIT_AT_MOST: Duration = Duration::from_secs(1);

pub(super) struct EventLoop {
    pub(super) pipeline: Pipeline,
    pub(super) watches: Watches,
    pub(super) events: mpsc::Receiver<Event>,
    pub(super) leadership: Leadership,
    /// Where `/snapshot` is served from.
    pub(super) store: Arc<SnapshotStore>,
    pub(super) outlets: Outlets,
    pub(super) controller: ResolverController,
    /// `None` where the ConsulService CRD is not installed.
    pub(super) exports: Option<ExportController>,
    pub(super) metrics: Metrics,
    /// `/readyz`: set once a snapshot is assembled and served.
    pub(super) ready: Arc<AtomicBool>,
    pub(super) identity: String,
    /// `/healthz`: beaten every turn.
    pub(super) heartbeat: Arc<Heartbeat>,
    /// When the process started, for the bootstrap duration.
    pub(super) started: Instant,
}

/// What the event loop hands back when it stops, for the shutdown to finish in order.
pub(super) type Stopped = (ResolverController, Option<ExportController>, Watches, Outlets);

/// Events received and not yet published: since when, and how many.
#[derive(Debug, Clone, Copy)]
struct Unpublished {
    since: Instant,
    since_wall: SystemTime,
    events: u64,
}

impl Unpublished {
    fn merge(a: Option<Unpublished>, b: Option<Unpublished>) -> Option<Unpublished> {
        match (a, b) {
            (Some(a), Some(b)) => Some(Unpublished {
                since: a.since.min(b.since),
                since_wall: a.since_wall.min(b.since_wall),
                events: a.events + b.events,
            }),
            (a, b) => a.or(b),
        }
    }
}

/// What the loop keeps between turns.
struct Turn {
    leading: bool,
    logged_waiting: bool,
    /// Events received since the last publication (cleared when the pipeline has nothing
    /// to publish: they changed nothing).
    pending: Option<Unpublished>,
    /// A published snapshot whose resolver statuses wait for the ConfigMap to hold it.
    held: Option<Held>,
}

/// The latest snapshot whose resolver statuses are held back, and until when at most (the
/// first held one's deadline: a stream of publications cannot hold statuses for ever).
struct Held {
    snapshot: Arc<Snapshot>,
    until: Instant,
}

impl EventLoop {
    /// Runs until `shutdown`; the outlets, returned, finish what they deliver.
    pub(super) async fn run(mut self, shutdown: CancellationToken) -> Stopped {
        // As the handle has reported it: a lease won before the loop ran comes through
        // `changed` at the first turn, and is counted as an acquisition as one won later is.
        let leading = self.leadership.reported();
        // Said once at start, as every change is after it: whether the ConfigMap and the
        // statuses are written by this replica, or wait for the lease.
        tracing::info!(identity = %self.identity, leading, "leadership at start");
        self.metrics.leadership.started(leading);
        let mut turn = Turn { leading, logged_waiting: false, pending: None, held: None };
        // Leading from the start (no election) is a takeover like any other: the
        // ConfigMap's ids continue after the last one written.
        if leading {
            self.take_over().await;
        }
        let mut tick = tokio::time::interval(BEAT_EVERY);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            self.beat();
            let wake = match self.poll(&mut turn) {
                Step::Publish(snapshot) => {
                    self.publish(&mut turn, snapshot);
                    continue;
                }
                Step::WaitUntil(at) => Some(at),
                Step::Idle => None,
            };
            if !self.pipeline.has_published() && !turn.logged_waiting {
                tracing::info!(readiness = ?self.pipeline.readiness(Instant::now()), "waiting for a complete world before the first snapshot");
                turn.logged_waiting = true;
            }
            let held = turn.held.as_ref().map(|h| (h.until, self.outlets.configmap_holds(h.snapshot.id)));
            let (held_until, configmap_holds) = held.unzip();
            tokio::select! {
                _ = shutdown.cancelled() => break,
                now_leading = self.leadership.changed() => self.on_leadership(&mut turn, now_leading).await,
                Some(first) = self.events.recv() => self.on_events(&mut turn, first),
                _ = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now)), if wake.is_some() => {}
                _ = tokio::time::timeout_at(held_until.unwrap_or_else(Instant::now), async {
                    if let Some(holds) = configmap_holds { holds.await }
                }), if held_until.is_some() => self.release_statuses(&mut turn),
                _ = tick.tick() => self.on_tick(),
            }
        }
        (self.controller, self.exports, self.watches, self.outlets)
    }

    fn beat(&self) {
        self.heartbeat.beat(Instant::now());
        self.metrics.liveness.heartbeat_timestamp.set(unix_seconds(SystemTime::now()));
    }

    /// Asks the pipeline what to do. Nothing to publish means the events received since the
    /// last publication changed nothing.
    fn poll(&mut self, turn: &mut Turn) -> Step {
        let started = Instant::now();
        let step = self.pipeline.poll(started);
        match step {
            Step::Publish(_) => {
                self.metrics.pipeline.assemble_seconds.with_label_values(&["snapshot"]).observe(secs(started.elapsed()))
            }
            Step::Idle => turn.pending = None,
            Step::WaitUntil(_) => {}
        }
        self.show_unpublished(turn);
        step
    }

    /// A batch of source events, starting with `first`: fold it into the world and bring
    /// the running watches and the controller's store in line.
    fn on_events(&mut self, turn: &mut Turn, first: Event) {
        let received = Instant::now();
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match self.events.try_recv() {
                Ok(e) => batch.push(e),
                Err(_) => break,
            }
        }
        let mut resolvers_touched = false;
        for e in &batch {
            let source = match e {
                Event::Kube(k, _) => {
                    resolvers_touched |= reads_resolvers(k);
                    "kubernetes"
                }
                Event::Consul(..) => "consul",
            };
            self.metrics.sources.events.with_label_values(&[source]).inc();
        }
        let received_now = Unpublished { since: received, since_wall: SystemTime::now(), events: batch.len() as u64 };
        turn.pending = Unpublished::merge(turn.pending, Some(received_now));
        let diff = self.pipeline.apply(batch, Instant::now());
        self.metrics.pipeline.assemble_seconds.with_label_values(&["apply"]).observe(secs(received.elapsed()));
        self.watches.apply(&diff);
        self.report_endpoints_budget();
        self.controller.sync(self.pipeline.world());
        if let Some(exports) = &mut self.exports {
            exports.sync(self.pipeline.world());
        }
        let watched = diff.added.iter().chain(&diff.removed);
        if resolvers_touched || watched.filter_map(as_kube).any(reads_resolvers) {
            self.show_resolver_scopes();
        }
    }

    /// Says when the endpoints watches go over their budget (confined to namespaces, the
    /// operator cannot watch the cluster whole) and when they fit again.
    fn report_endpoints_budget(&self) {
        let over = self.pipeline.endpoints_over_budget();
        let gauge = &self.metrics.pipeline.endpoints_over_budget;
        if over.is_some() == (gauge.get() == 1) {
            return;
        }
        gauge.set(i64::from(over.is_some()));
        match over {
            Some((namespaces, budget)) => tracing::warn!(
                namespaces,
                budget,
                "the Services routed to span more namespaces than --endpoints-watch-budget allows: one endpoints watch per namespace, over the budget (--namespace rules out one watch of the cluster)"
            ),
            None => tracing::info!("the endpoints watches fit within --endpoints-watch-budget again"),
        }
    }

    /// The lease was won or lost. A replica that becomes leader writes the current
    /// snapshot at once, numbered after the one already in the ConfigMap, and every
    /// resolver's status.
    async fn on_leadership(&mut self, turn: &mut Turn, now_leading: bool) {
        if now_leading != turn.leading {
            tracing::info!(identity = %self.identity, leading = now_leading, "leadership changed");
            self.metrics.leadership.changed(now_leading);
        }
        if now_leading && !turn.leading {
            self.take_over().await;
        }
        if !now_leading {
            self.outlets.lost_leadership();
            // A follower writes no status: nothing to wait for.
            self.release_statuses(turn);
        }
        turn.leading = now_leading;
    }

    /// Writes the current snapshot at once, numbered after the one already in the
    /// ConfigMap, and every resolver's status.
    async fn take_over(&mut self) {
        let floor = self.outlets.took_over().await;
        self.pipeline.republish(floor);
        self.controller.leading();
        if let Some(exports) = &mut self.exports {
            exports.leading();
        }
    }

    /// A new snapshot: served over HTTP at once (the operator is ready from the first),
    /// handed to the outlets, and the resolvers' statuses follow it into the ConfigMap.
    /// Exports follow at once: their EndpointSlices are an output of their own.
    fn publish(&mut self, turn: &mut Turn, snapshot: Arc<Snapshot>) {
        let started = Instant::now();
        let first = !self.pipeline.has_published();
        self.store.push(&snapshot);
        self.outlets.offer(snapshot.clone());
        self.pipeline.published(&snapshot, true, started);
        self.hold_statuses(turn, snapshot.clone());
        if let Some(exports) = &mut self.exports {
            exports.published(&snapshot);
        }
        self.ready.store(true, Ordering::Relaxed);
        let metrics = &self.metrics.pipeline;
        metrics.publish_seconds.observe(secs(started.elapsed()));
        metrics.snapshots_published.inc();
        metrics.snapshot_id.set(snapshot.id as i64);
        metrics.snapshot_bytes.set(snapshot.len() as i64);
        metrics.problems.set(snapshot.content.problems.len() as i64);
        metrics.bootstrapped.set(1);
        metrics.last_publication_timestamp.set(unix_seconds(SystemTime::now()));
        let carried = turn.pending.take();
        if let Some(c) = carried {
            metrics.events_coalesced.inc_by(c.events.saturating_sub(1));
        }
        if first {
            self.watches.first_snapshot_out();
            metrics.bootstrap_seconds.set(secs(self.started.elapsed()));
        } else if let Some(c) = carried {
            // The first publication waited for the world, not for a change: its time is
            // the bootstrap duration's.
            metrics.publication_latency_seconds.observe(secs(c.since.elapsed()));
        }
        tracing::info!(
            id = snapshot.id,
            hash = %snapshot.hash,
            complete = snapshot.content.bootstrap.complete,
            mappings = snapshot.content.mappings.len(),
            resolvers = snapshot.content.resolvers.len(),
            problems = snapshot.content.problems.len(),
            "snapshot published"
        );
        self.show_unpublished(turn);
    }

    /// The resolvers' statuses for `snapshot` wait until the ConfigMap holds it (at most
    /// [`STATUSES_WAIT_AT_MOST`]): a status then never names a snapshot the ConfigMap's
    /// readers cannot find yet, and the status writes do not slow the ConfigMap's, which
    /// is what the readers wait for. Written at once where no ConfigMap is written, and by
    /// a follower (which writes none).
    fn hold_statuses(&mut self, turn: &mut Turn, snapshot: Arc<Snapshot>) {
        if !turn.leading || !self.outlets.has_configmap() {
            self.controller.published(&snapshot);
            return;
        }
        let until = turn.held.as_ref().map_or_else(|| Instant::now() + STATUSES_WAIT_AT_MOST, |h| h.until);
        turn.held = Some(Held { snapshot, until });
    }

    /// The ConfigMap holds the held snapshot (or it waited long enough): its resolvers'
    /// statuses follow.
    fn release_statuses(&mut self, turn: &mut Turn) {
        if let Some(held) = turn.held.take() {
            self.controller.published(&held.snapshot);
        }
    }

    /// Every second: the gauges read from the world.
    fn on_tick(&self) {
        let now = Instant::now();
        let world = self.pipeline.world();
        let kube = world.kube().values().filter(|s| !s.listed).map(|s| s.added_at);
        let consul = world.consul().values().filter(|s| !s.answered()).map(|s| s.added_at);
        for (source, added) in [("kubernetes", kube.collect::<Vec<_>>()), ("consul", consul.collect())] {
            let oldest = added.iter().min().map_or(0.0, |&at| secs(now.saturating_duration_since(at)));
            self.metrics.sources.unsynced_watches.with_label_values(&[source]).set(added.len() as i64);
            self.metrics.sources.unsynced_oldest_seconds.with_label_values(&[source]).set(oldest);
        }
    }

    /// `consul_resolver_unpublished_change_timestamp_seconds`: the oldest event not yet
    /// published; 0 when there is none.
    fn show_unpublished(&self, turn: &Turn) {
        self.metrics
            .pipeline
            .unpublished_change_timestamp
            .set(turn.pending.map_or(0.0, |u| unix_seconds(u.since_wall)));
    }

    /// Which Consul scope each resolver queries, for its contact timestamps.
    fn show_resolver_scopes(&self) {
        let config = self.pipeline.config();
        let scopes = resolvers::read(self.pipeline.world(), &config.ambassador_id, &config.env)
            .into_iter()
            .filter_map(|r| {
                let scope = consul_watch::contact_scope(&r.settings.ok()?.key(""));
                Some(((r.namespace, r.name), scope))
            })
            .collect();
        let sources = &self.metrics.sources;
        sources.consul_contact.set_resolvers(sources.consul.contact(), scopes);
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn as_kube(k: &WatchKey) -> Option<&KubeKey> {
    match k {
        WatchKey::Kube(k) => Some(k),
        WatchKey::Consul(_) => None,
    }
}

/// Whether a key's objects decide resolvers' Consul scopes: the resolvers themselves and
/// the Secrets holding their tokens.
fn reads_resolvers(key: &KubeKey) -> bool {
    key.is(resolver::GROUP, resolver::KIND) || key.is("", "Secret")
}
