//! The one loop that owns the pipeline, with a named handler per thing it waits for.
//!
//! It drains events in batches (so a flood of 10,000 list events is one reconciliation,
//! not 10,000), applies the registry's diffs to the running watches, feeds the resolver
//! controller's store, and runs at most one task at a time against the publishers: a
//! publication, or (every resync period) a repair of the snapshot ConfigMap.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::publication::{self, Done, Publishers, Task};
use crate::controller::ResolverController;
use crate::leadership::Leadership;
use crate::ops::metrics::Metrics;
use crate::sources::Watches;
use consul_resolver_core::model::Event;
use consul_resolver_core::pipeline::{Pipeline, Step};

/// Most events folded into the world per batch.
const MAX_BATCH: usize = 10_000;

pub(super) struct EventLoop {
    pub(super) pipeline: Pipeline,
    pub(super) watches: Watches,
    pub(super) events: mpsc::Receiver<Event>,
    pub(super) leadership: Leadership,
    pub(super) publishers: Arc<Publishers>,
    pub(super) controller: ResolverController,
    pub(super) metrics: Metrics,
    /// `/readyz`: set once a snapshot was published.
    pub(super) ready: Arc<AtomicBool>,
    pub(super) identity: String,
    pub(super) resync_period: Duration,
}

/// What the loop keeps between turns.
struct Turn {
    leading: bool,
    task: Option<Task>,
    repair_due: Instant,
    logged_waiting: bool,
}

impl EventLoop {
    /// Runs until `shutdown`, then lets the task in flight finish: a half-written
    /// snapshot helps nobody (each write is bounded by the leadership deadline and the
    /// publish timeout).
    pub(super) async fn run(mut self, shutdown: CancellationToken) -> (ResolverController, Watches) {
        let leading = self.leadership.is_leading();
        self.metrics.leader.set(leading as i64);
        let mut turn =
            Turn { leading, task: None, repair_due: Instant::now() + self.resync_period, logged_waiting: false };
        loop {
            let step = if turn.task.is_none() { self.pipeline.poll(Instant::now()) } else { Step::Idle };
            let wake = match step {
                Step::Publish(snapshot) => {
                    turn.task = Some(self.publishers.publish(snapshot));
                    continue;
                }
                Step::WaitUntil(at) => Some(at),
                Step::Idle => None,
            };
            if !self.pipeline.has_published() && !turn.logged_waiting {
                tracing::info!(readiness = ?self.pipeline.readiness(Instant::now()), "waiting for a complete world before the first snapshot");
                turn.logged_waiting = true;
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                now_leading = self.leadership.changed() => self.on_leadership(&mut turn, now_leading).await,
                Some(first) = self.events.recv() => self.on_events(first),
                done = publication::finished(&mut turn.task), if turn.task.is_some() => {
                    turn.task = None;
                    self.on_task_done(done);
                }
                _ = tokio::time::sleep_until(turn.repair_due), if turn.task.is_none() => {
                    turn.repair_due = Instant::now() + self.resync_period;
                    turn.task = self.publishers.repair();
                }
                _ = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now)), if wake.is_some() => {}
            }
        }
        if turn.task.is_some() {
            let done = publication::finished(&mut turn.task).await;
            self.on_task_done(done);
        }
        (self.controller, self.watches)
    }

    /// A batch of source events, starting with `first`: fold it into the world and bring
    /// the running watches and the controller's store in line.
    fn on_events(&mut self, first: Event) {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match self.events.try_recv() {
                Ok(e) => batch.push(e),
                Err(_) => break,
            }
        }
        for e in &batch {
            let source = match e {
                Event::Kube(..) => "kubernetes",
                Event::Consul(..) => "consul",
            };
            self.metrics.events.with_label_values(&[source]).inc();
        }
        let diff = self.pipeline.apply(batch, Instant::now());
        self.watches.apply(&diff);
        self.controller.sync(self.pipeline.world());
        for (source, n) in self.watches.counts() {
            self.metrics.watches.with_label_values(&[source]).set(n as i64);
        }
    }

    /// The lease was won or lost. A replica that becomes leader writes the current
    /// snapshot at once, numbered after the one already in the ConfigMap, and every
    /// resolver's status.
    async fn on_leadership(&mut self, turn: &mut Turn, now_leading: bool) {
        if now_leading != turn.leading {
            tracing::info!(identity = %self.identity, leading = now_leading, "leadership changed");
            self.metrics.leader.set(now_leading as i64);
        }
        if now_leading && !turn.leading {
            let floor = self.publishers.took_over().await;
            self.pipeline.republish(floor);
            self.controller.leading();
        }
        turn.leading = now_leading;
    }

    fn on_task_done(&mut self, done: Done) {
        match done {
            Done::Published { snapshot, ok } => {
                self.pipeline.published(&snapshot, ok, Instant::now());
                self.controller.published(&snapshot);
                if ok {
                    self.ready.store(true, Ordering::Relaxed);
                    self.metrics.bootstrapped.set(1);
                }
            }
            Done::Repaired => {}
        }
    }
}
