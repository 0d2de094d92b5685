//! The pipeline's pure core: world, registry, limiter and assembler joined into one state
//! machine that the runtime drives with events and the clock.
//!
//! After every batch of events the assembler folds in what the batch changed, and the
//! registry is told which watches start or stop being implied, so new watches start as soon
//! as the data that implies them arrives (a Mapping naming a new service starts that
//! service's watch). A batch of Consul answers alone touches only those services' entries
//! and never the registry. The first publication waits for the world to be
//! complete (see the world); after that nothing holds publication back: a new, slow or
//! failing key is published unsynced, with its error, and its answers as they come.
//! Publications are paced by the limiter and skipped when the content hash equals the last
//! successful publication.
//!
//! The snapshot and the watch set come from one reading of the world, so they always agree.
//! Resolver statuses are written from the published snapshot by the resolver controller
//! (`crate::controller`), per resolver, with its own retries.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use super::assembler::segment::Cutter;
use super::assembler::{self, Assembler, Snapshot};
use super::delta::Delta;
use super::keys::{KubeKey, WatchKey};
use super::limiter::{Limiter, Next};
use super::model::Event;
use super::registry::{ConsumerId, Registry};
use super::world::{Readiness, World};

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

/// The wall-clock time of one instant of the monotonic clock, so the core can show times
/// (a service stale since ...) without reading a clock.
#[derive(Debug, Clone, Copy)]
pub struct WallClock {
    pub instant: Instant,
    pub wall: SystemTime,
}

impl WallClock {
    /// The wall-clock time of `at` (on the monotonic clock's scale: a later step of the
    /// system clock does not move it).
    pub fn at(&self, at: Instant) -> SystemTime {
        match at.checked_duration_since(self.instant) {
            Some(after) => self.wall + after,
            None => self.wall - (self.instant - at),
        }
    }
}

pub struct Pipeline {
    world: World,
    registry: Registry<WatchKey>,
    limiter: Limiter,
    assembler: Assembler,
    clock: WallClock,
    window: Duration,
    /// The operator's own watches: the first publication waits for them however long.
    fixed: BTreeSet<KubeKey>,
    /// The world has been complete once; publication no longer waits for anything.
    bootstrapped: bool,
    last_published_hash: Option<String>,
    /// Cuts each content into segments, reusing the last one's where they are the same.
    cutter: Cutter,
    /// The snapshot of the failed publication being retried: a retry of the same content
    /// keeps its id.
    retrying: Option<(String, u64)>,
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

    pub fn new(config: assembler::Config, bootstrap_timeout: Duration, window: Duration, clock: WallClock) -> Self {
        let mut limiter = Limiter::new(window);
        // The first complete world is always published, even if it is empty.
        limiter.changed();
        Pipeline {
            world: World::new(bootstrap_timeout).copy_verbatim(config.static_watches.iter().cloned()),
            registry: Registry::new(),
            limiter,
            assembler: Assembler::new(config),
            clock,
            window,
            fixed: BTreeSet::new(),
            bootstrapped: false,
            last_published_hash: None,
            cutter: Cutter::default(),
            retrying: None,
            force: false,
            last_id: 0,
            failures: 0,
            retry_at: None,
        }
    }

    pub fn world(&self) -> &World {
        &self.world
    }

    /// The operator's configuration of the pipeline.
    pub fn config(&self) -> &assembler::Config {
        self.assembler.config()
    }

    /// `Some((namespaces, budget))` while the namespaces of routed-to Services need more
    /// endpoints watches than the budget and the cluster may not be watched whole
    /// ([`assembler::WatchLimits`]).
    pub fn endpoints_over_budget(&self) -> Option<(usize, usize)> {
        self.assembler.endpoints_over_budget()
    }

    pub fn registry(&self) -> &Registry<WatchKey> {
        &self.registry
    }

    /// What the assembler holds now, for tests.
    #[cfg(test)]
    pub(crate) fn assembler(&self) -> &Assembler {
        &self.assembler
    }

    /// Sets the fixed watches; returns the watches to start and stop.
    pub fn set_fixed(&mut self, keys: BTreeSet<WatchKey>, now: Instant) -> Delta<WatchKey> {
        self.fixed = keys
            .iter()
            .filter_map(|k| match k {
                WatchKey::Kube(k) => Some(k.clone()),
                WatchKey::Consul(_) => None,
            })
            .collect();
        let diff = self.registry.set(&Self::fixed_consumer(), keys);
        self.track(&diff, now);
        let more = self.settle(now);
        diff.then(more)
    }

    /// Folds a batch of events in; returns the watches to start and stop.
    pub fn apply(&mut self, events: impl IntoIterator<Item = Event>, now: Instant) -> Delta<WatchKey> {
        let mut changed = false;
        for e in events {
            changed |= self.world.apply(e, now);
        }
        if changed {
            self.limiter.changed();
        }
        self.settle(now)
    }

    /// Lets the assembler fold in what changed, and the registry follow what it implies,
    /// until nothing more changes (starting a watch adds its empty store to the world).
    fn settle(&mut self, now: Instant) -> Delta<WatchKey> {
        let mut diff = Delta::default();
        loop {
            let changes = self.world.take_changes();
            if changes.is_empty() {
                return diff;
            }
            let wanted = self.assembler.update(&self.world, &changes, self.clock.at(now));
            let more = self.registry.change(&Self::assembler_consumer(), wanted);
            self.track(&more, now);
            diff = diff.then(more);
        }
    }

    fn track(&mut self, diff: &Delta<WatchKey>, now: Instant) {
        for k in &diff.removed {
            self.world.untrack(k);
        }
        for k in &diff.added {
            match k {
                WatchKey::Kube(kube) if self.fixed.contains(kube) => self.world.track_fixed(k, now),
                _ => self.world.track(k, now),
            }
        }
        if !diff.is_empty() {
            self.limiter.changed();
        }
    }

    /// Whether the world is complete enough for the first publication.
    pub fn readiness(&self, now: Instant) -> Readiness {
        self.world.readiness(now, |k| self.fixed.contains(k))
    }

    /// Whether a snapshot has been published (the operator is ready).
    pub fn has_published(&self) -> bool {
        self.last_published_hash.is_some()
    }

    pub fn poll(&mut self, now: Instant) -> Step {
        if !self.bootstrapped {
            if let Readiness::Waiting { deadline, .. } = self.readiness(now) {
                return deadline.map_or(Step::Idle, Step::WaitUntil);
            }
            self.bootstrapped = true;
        }
        if let Some(at) = self.retry_at.filter(|&at| now < at) {
            return Step::WaitUntil(at);
        }
        loop {
            match self.limiter.poll(now) {
                Next::Idle => return Step::Idle,
                Next::WaitUntil(at) => return Step::WaitUntil(at),
                Next::Publish => {
                    // Written once, as segments: the hash is of these, the document is them.
                    self.assembler.make_entries();
                    let content = self.assembler.content(&self.world);
                    let cut = content.cut(&mut self.cutter);
                    let hash = cut.hash.clone();
                    if !self.force && self.last_published_hash.as_deref() == Some(hash.as_str()) {
                        self.retrying = None;
                        self.limiter.skipped();
                        continue;
                    }
                    let id = match &self.retrying {
                        Some((h, id)) if *h == hash => *id,
                        _ => {
                            self.last_id += 1;
                            self.last_id
                        }
                    };
                    self.retrying = Some((hash.clone(), id));
                    return Step::Publish(Arc::new(Snapshot::new(id, content, cut)));
                }
            }
        }
    }

    /// Publishes the current world once more even if it is unchanged, with an id above
    /// `floor`: a new leader writes the cluster's copies again (another replica may have
    /// written them last) and continues that replica's ids instead of going back.
    pub fn republish(&mut self, floor: u64) {
        self.last_id = self.last_id.max(floor);
        if self.retrying.as_ref().is_some_and(|(_, id)| *id <= floor) {
            self.retrying = None;
        }
        self.force = true;
        self.limiter.changed();
    }

    /// The publication of `snapshot` finished. A failed one is retried with backoff, with
    /// whatever is current by then (the same id if that is still the same content).
    pub fn published(&mut self, snapshot: &Snapshot, ok: bool, now: Instant) {
        self.limiter.finished();
        if ok {
            self.last_published_hash = Some(snapshot.hash.clone());
            self.retrying = None;
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
