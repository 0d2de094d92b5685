//! Consul watches driven directly (no Kubernetes), for the Consul source's tests: start
//! watches of keys and wait, with a deadline, for their events.

use std::time::Duration;

use consul_resolver_core::keys::ConsulKey;
use consul_resolver_core::model::{ConsulEvent, Endpoint, Event};
use consul_watch::{ConsulSource, Metrics, Settings};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;

/// How long a wait for an event may take before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// Running watches and the events they send.
pub struct Watches {
    source: ConsulSource,
    /// What the watches counted (requests by query, mode and outcome).
    pub metrics: Metrics,
    tx: mpsc::Sender<Event>,
    rx: mpsc::Receiver<Event>,
    tasks: Vec<AbortOnDropHandle<()>>,
}

impl Watches {
    pub fn new(settings: Settings) -> Self {
        let (tx, rx) = mpsc::channel(100_000);
        let metrics = Metrics::unregistered();
        Watches { source: ConsulSource::new(settings, metrics.clone()), metrics, tx, rx, tasks: Vec::new() }
    }

    pub fn start(&mut self, key: &ConsulKey) {
        let fut = self.source.watch(key.clone(), self.tx.clone());
        self.tasks.push(AbortOnDropHandle::new(tokio::spawn(fut)));
    }

    /// The next event of any watch, or `None` at `deadline`.
    pub async fn next(&mut self, deadline: Instant) -> Option<Event> {
        tokio::time::timeout_at(deadline, self.rx.recv()).await.ok().flatten()
    }

    /// Stops every watch (their tasks are aborted, dropping the requests in flight).
    pub fn stop_all(&mut self) {
        self.tasks.clear();
    }

    /// Waits for an event of `key` satisfying `pred`; panics at the deadline.
    pub async fn until(&mut self, key: &ConsulKey, what: &str, pred: impl Fn(&ConsulEvent) -> bool) -> ConsulEvent {
        let deadline = Instant::now() + DEADLINE;
        loop {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(Event::Consul(k, ev))) if &k == key && pred(&ev) => return ev,
                Ok(Some(_)) => {}
                Ok(None) => panic!("event channel closed"),
                Err(_) => panic!("timed out waiting for {what} of {key}"),
            }
        }
    }

    /// Waits for an answer of `key` whose endpoints satisfy `pred`, and returns them.
    pub async fn answer(&mut self, key: &ConsulKey, what: &str, pred: impl Fn(&[Endpoint]) -> bool) -> Vec<Endpoint> {
        match self.until(key, what, |ev| matches!(ev, ConsulEvent::Answer { endpoints, .. } if pred(endpoints))).await {
            ConsulEvent::Answer { endpoints, .. } => endpoints,
            _ => unreachable!("until returns what the predicate accepted"),
        }
    }

    /// Waits for a failure of `key` and returns its message.
    pub async fn failure(&mut self, key: &ConsulKey, what: &str) -> String {
        match self.until(key, what, |ev| matches!(ev, ConsulEvent::Failed(_))).await {
            ConsulEvent::Failed(m) => m,
            _ => unreachable!("until returns what the predicate accepted"),
        }
    }
}
