//! The pipeline's pure core: world, registry, limiter and assembler joined into one state
//! machine that the runtime drives with events and the clock.
//!
//! After every batch of events the world is re-read and the registry reconciled, so new
//! watches start as soon as the data that implies them arrives (a Mapping naming a new
//! service starts that service's watch). Publication is gated on the world being complete
//! (see the aggregator), paced by the limiter, and skipped when the content hash equals
//! the last successful publication.
//!
//! This is the ConsulResolver controller, level-triggered over the whole world rather than
//! a kube-runtime `Controller` with a per-object queue: a Mapping change re-reads every
//! resolver it could name (the mapper is the assembler's resolver lookup), and a resolver's
//! desired keys, validation problems and status all come from the same read of the world
//! that the snapshot does. A per-object `Controller` would need its own reflector cache
//! (or a second watch) of resolvers and Mappings beside the world, and its reconciles would
//! publish desired keys from a different moment than the snapshot's.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::aggregator::{Event, Readiness, World};
use super::assembler::{self, Assembly, Snapshot};
use super::keys::WatchKey;
use super::limiter::{Limiter, Next};
use super::registry::{ConsumerId, Diff, Registry};

/// What the runtime should do next.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Publish this, then call [`Pipeline::published`].
    Publish(Arc<Snapshot>),
    /// Call `poll` again at this instant, or sooner when events arrive.
    WaitUntil(Instant),
    /// Nothing to do until events arrive or the publication in flight finishes.
    Idle,
}

/// Backoff after failed publications: doubling from the window, capped.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(30);

pub struct Pipeline {
    world: World,
    registry: Registry<WatchKey>,
    limiter: Limiter,
    config: assembler::Config,
    window: Duration,
    /// Revision of the world the registry was last reconciled against.
    reconciled_revision: Option<u64>,
    /// The content read at `reconciled_revision`, so a publication of an unchanged world
    /// does not assemble it a second time.
    assembled: Option<(u64, assembler::Content)>,
    last_published_hash: Option<String>,
    /// Publish the next snapshot even if its content was published already.
    force: bool,
    last_id: u64,
    failures: u32,
    retry_at: Option<Instant>,
}

impl Pipeline {
    /// The consumer for the operator's fixed watches (its own kinds, `--watch` flags).
    pub fn fixed_consumer() -> ConsumerId {
        ConsumerId::new("fixed")
    }

    /// The consumer for watches the world implies.
    pub fn assembler_consumer() -> ConsumerId {
        ConsumerId::new("assembler")
    }

    pub fn new(config: assembler::Config, bootstrap_timeout: Duration, window: Duration) -> Self {
        let mut limiter = Limiter::new(window);
        // The first complete world is always published, even if it is empty.
        limiter.changed();
        Pipeline {
            world: World::new(bootstrap_timeout),
            registry: Registry::new(),
            limiter,
            config,
            window,
            reconciled_revision: None,
            assembled: None,
            last_published_hash: None,
            force: false,
            last_id: 0,
            failures: 0,
            retry_at: None,
        }
    }

    pub fn world(&self) -> &World {
        &self.world
    }

    pub fn registry(&self) -> &Registry<WatchKey> {
        &self.registry
    }

    pub fn config(&self) -> &assembler::Config {
        &self.config
    }

    /// Sets the fixed watches; returns the watches to start and stop.
    pub fn set_fixed(&mut self, keys: BTreeSet<WatchKey>, now: Instant) -> Diff<WatchKey> {
        let diff = self.registry.set(&Self::fixed_consumer(), keys);
        self.track(&diff, now);
        let more = self.reconcile(now);
        merge(diff, more)
    }

    /// Changes how the assembler reads the world (e.g. after discovery).
    pub fn set_config(&mut self, config: assembler::Config, now: Instant) -> Diff<WatchKey> {
        self.config = config;
        self.reconciled_revision = None;
        self.assembled = None;
        self.limiter.changed();
        self.reconcile(now)
    }

    /// Folds a batch of events in; returns the watches to start and stop.
    pub fn apply(&mut self, events: impl IntoIterator<Item = Event>, now: Instant) -> Diff<WatchKey> {
        let mut changed = false;
        for e in events {
            changed |= self.world.apply(e, now);
        }
        if changed {
            self.limiter.changed();
        }
        self.reconcile(now)
    }

    fn reconcile(&mut self, now: Instant) -> Diff<WatchKey> {
        if self.reconciled_revision == Some(self.world.revision()) {
            return Diff::default();
        }
        let Assembly { desired, content } = assembler::assemble(&self.world, &self.config);
        let diff = self.registry.set(&Self::assembler_consumer(), desired);
        self.track(&diff, now);
        self.reconciled_revision = Some(self.world.revision());
        // Starting or stopping watches changed the world after it was read: then the
        // content is read again at publication.
        self.assembled = diff.is_empty().then(|| (self.world.revision(), content));
        diff
    }

    fn track(&mut self, diff: &Diff<WatchKey>, now: Instant) {
        for k in &diff.stop {
            self.world.untrack(k);
        }
        for k in &diff.start {
            self.world.track(k, now);
        }
        if !diff.is_empty() {
            self.limiter.changed();
        }
    }

    pub fn readiness(&self, now: Instant) -> Readiness {
        self.world.readiness(now)
    }

    /// Whether a snapshot has been published (the operator is ready).
    pub fn has_published(&self) -> bool {
        self.last_published_hash.is_some()
    }

    pub fn poll(&mut self, now: Instant) -> Step {
        if let Readiness::Waiting { deadline, .. } = self.world.readiness(now) {
            return deadline.map_or(Step::Idle, Step::WaitUntil);
        }
        if let Some(at) = self.retry_at.filter(|&at| now < at) {
            return Step::WaitUntil(at);
        }
        loop {
            match self.limiter.poll(now) {
                Next::Idle => return Step::Idle,
                Next::WaitUntil(at) => return Step::WaitUntil(at),
                Next::Publish => {
                    let content = match &self.assembled {
                        Some((rev, content)) if *rev == self.world.revision() => content.clone(),
                        _ => assembler::assemble(&self.world, &self.config).content,
                    };
                    let hash = content.hash();
                    if !self.force && self.last_published_hash.as_deref() == Some(hash.as_str()) {
                        self.limiter.skipped();
                        continue;
                    }
                    self.last_id += 1;
                    return Step::Publish(Arc::new(content.into_snapshot_with_hash(self.last_id, hash)));
                }
            }
        }
    }

    /// Publishes the current world once more even if it is unchanged, with an id above
    /// `floor`: a new leader writes the cluster's copies again (another replica may have
    /// written them last) and continues that replica's ids instead of going back.
    pub fn republish(&mut self, floor: u64) {
        self.last_id = self.last_id.max(floor);
        self.force = true;
        self.limiter.changed();
    }

    /// The publication of `snapshot` finished. A failed one is retried with backoff, with
    /// whatever is current by then.
    pub fn published(&mut self, snapshot: &Snapshot, ok: bool, now: Instant) {
        self.limiter.finished();
        if ok {
            self.last_published_hash = Some(snapshot.hash.clone());
            self.force = false;
            self.failures = 0;
            self.retry_at = None;
        } else {
            self.failures = self.failures.saturating_add(1);
            let delay = self.window.max(Duration::from_millis(100)) * 2u32.saturating_pow(self.failures.min(16));
            self.retry_at = Some(now + delay.min(MAX_RETRY_DELAY));
            self.limiter.changed();
        }
    }
}

fn merge<K: Ord>(mut a: Diff<K>, b: Diff<K>) -> Diff<K> {
    // A key stopped by `a` and started by `b` (or the reverse) nets out.
    for k in b.start {
        match a.stop.iter().position(|s| *s == k) {
            Some(i) => {
                a.stop.remove(i);
            }
            None => a.start.push(k),
        }
    }
    for k in b.stop {
        match a.start.iter().position(|s| *s == k) {
            Some(i) => {
                a.start.remove(i);
            }
            None => a.stop.push(k),
        }
    }
    a.start.sort();
    a.stop.sort();
    a
}
