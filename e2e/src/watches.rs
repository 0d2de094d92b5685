//! Consul watches driven directly (no Kubernetes), for the Consul source's tests: start
//! watches of keys and wait, with a deadline, for their events.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use consul_resolver_core::keys::ConsulKey;
use consul_resolver_core::model::{ConsulEvent, Endpoint, Event};
use consul_watch::{ConsulSource, Metrics, Settings};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;

/// How long a wait for an event may take before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// A sweep period no test reaches, for tests that count what the change feed alone makes
/// a fed watch read, or that a change is seen before any sweep could have caught it.
///
/// It is not "a sweep longer than the test": a fed watch's first sweep falls anywhere in
/// its first period (each watch takes a phase of its own, docs/consul.md), so with a
/// ten-minute period, one of four fed watches swept within a test's first seconds about
/// once in eight runs, and a test counting re-reads failed. Ten thousand years: the odds
/// that any of a thousand watches sweeps within an hour are about one in 90,000.
pub const NO_SWEEP: Duration = Duration::from_secs(10_000 * 365 * 24 * 3600);

/// Running watches and the events they send.
pub struct Watches {
    source: ConsulSource,
    /// What the watches counted (requests by query, mode and outcome).
    pub metrics: Metrics,
    tx: mpsc::Sender<Event>,
    rx: mpsc::Receiver<Event>,
    tasks: BTreeMap<ConsulKey, AbortOnDropHandle<()>>,
    /// Events received while waiting for another key's, kept for that key in arrival order:
    /// a real agent may answer the first reads in any order.
    pending: BTreeMap<ConsulKey, VecDeque<ConsulEvent>>,
}

impl Watches {
    pub fn new(settings: Settings) -> Self {
        let (tx, rx) = mpsc::channel(100_000);
        let metrics = Metrics::unregistered();
        Watches {
            source: ConsulSource::new(settings, metrics.clone()),
            metrics,
            tx,
            rx,
            tasks: BTreeMap::new(),
            pending: BTreeMap::new(),
        }
    }

    /// Dedicated watches read, then wait for [`Watches::release_blocking`] to block (as the
    /// operator holds them until its first snapshot).
    pub fn hold_blocking(&self) {
        self.source.hold_blocking();
    }

    pub fn release_blocking(&self) {
        self.source.release_blocking();
    }

    pub fn start(&mut self, key: &ConsulKey) {
        let fut = self.source.watch(key.clone(), self.tx.clone());
        self.tasks.insert(key.clone(), AbortOnDropHandle::new(tokio::spawn(fut)));
    }

    /// Stops the watch of `key` (its task is aborted, dropping its request in flight), and
    /// forgets its pending events.
    pub fn stop(&mut self, key: &ConsulKey) {
        self.tasks.remove(key);
        self.pending.remove(key);
    }

    /// The next event of any watch (those kept for a key first), or `None` at `deadline`.
    pub async fn next(&mut self, deadline: Instant) -> Option<Event> {
        if let Some(key) = self.pending.iter().find(|(_, q)| !q.is_empty()).map(|(k, _)| k.clone()) {
            let ev = self.pending.get_mut(&key).and_then(VecDeque::pop_front)?;
            return Some(Event::Consul(key, ev));
        }
        tokio::time::timeout_at(deadline, self.rx.recv()).await.ok().flatten()
    }

    /// Stops every watch (their tasks are aborted, dropping the requests in flight).
    pub fn stop_all(&mut self) {
        self.tasks.clear();
    }

    /// Waits for an event of `key` satisfying `pred`; panics at the deadline. Events of
    /// `key` that do not satisfy it are consumed; other keys' events are kept for them.
    pub async fn until(&mut self, key: &ConsulKey, what: &str, pred: impl Fn(&ConsulEvent) -> bool) -> ConsulEvent {
        self.until_within(key, what, DEADLINE, pred).await
    }

    /// [`Watches::until`] with a deadline of `within` from now.
    pub async fn until_within(
        &mut self,
        key: &ConsulKey,
        what: &str,
        within: Duration,
        pred: impl Fn(&ConsulEvent) -> bool,
    ) -> ConsulEvent {
        let deadline = Instant::now() + within;
        while let Some(ev) = self.pending.get_mut(key).and_then(VecDeque::pop_front) {
            if pred(&ev) {
                return ev;
            }
        }
        loop {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(Event::Consul(k, ev))) if &k == key => {
                    if pred(&ev) {
                        return ev;
                    }
                }
                Ok(Some(Event::Consul(k, ev))) => self.pending.entry(k).or_default().push_back(ev),
                Ok(Some(_)) => {}
                Ok(None) => panic!("event channel closed"),
                Err(_) => panic!("timed out after {within:?} waiting for {what} of {key}"),
            }
        }
    }

    /// Starts a watch of each of `keys`, then waits for each one's first answer, of one
    /// instance.
    pub async fn start_each_with_one_instance<'a>(&mut self, keys: impl IntoIterator<Item = &'a ConsulKey> + Clone) {
        for k in keys.clone() {
            self.start(k);
        }
        for k in keys {
            self.answer(k, "the first answer", |e| e.len() == 1).await;
        }
    }

    /// Waits for an answer of `key` whose endpoints satisfy `pred`, and returns them.
    pub async fn answer(&mut self, key: &ConsulKey, what: &str, pred: impl Fn(&[Endpoint]) -> bool) -> Vec<Endpoint> {
        self.answer_within(key, what, DEADLINE, pred).await
    }

    /// [`Watches::answer`] with a deadline of `within` from now.
    pub async fn answer_within(
        &mut self,
        key: &ConsulKey,
        what: &str,
        within: Duration,
        pred: impl Fn(&[Endpoint]) -> bool,
    ) -> Vec<Endpoint> {
        let matches = |ev: &ConsulEvent| matches!(ev, ConsulEvent::Answer { endpoints, .. } if pred(endpoints));
        match self.until_within(key, what, within, matches).await {
            ConsulEvent::Answer { endpoints, .. } => endpoints.to_vec(),
            _ => unreachable!("until returns what the predicate accepted"),
        }
    }

    /// Waits for a failure of `key` and returns its message.
    pub async fn failure(&mut self, key: &ConsulKey, what: &str) -> String {
        match self.until(key, what, |ev| matches!(ev, ConsulEvent::Failed(_) | ConsulEvent::Refused(_))).await {
            ConsulEvent::Failed(m) | ConsulEvent::Refused(m) => m,
            _ => unreachable!("until returns what the predicate accepted"),
        }
    }
}
