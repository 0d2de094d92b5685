//! Whether a Consul server answers, decided once for all its watches (docs/consul.md, "When
//! Consul goes away").
//!
//! A request that cannot reach the server (refused, reset, timed out) makes the watch that
//! sent it suspect the server. One probe, `GET /v1/status/leader`, checks at once: if it
//! gets any HTTP answer the failure was that request's alone (a cut-off body, a slow
//! query), and the watch retries on its own backoff. If the probe fails too the server is
//! down: every watch and feed of it drops what it has in flight, reports the failure, and
//! waits, while the probe alone keeps trying, once a second and then every two seconds.
//! When a probe answers, the server is up again and every watch resumes at once, each after
//! a random moment within a second (a thousand watches do not reconnect in one burst), from
//! a read without index (the server may be a new cluster with a lower index).
//!
//! So while a server is down it sees at most one connection attempt a second, however many
//! watches follow it, and every service converges within a few seconds of its return
//! instead of each watch's own backoff (up to a minute).

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;

use crate::client::HttpClient;
use crate::error::QueryError;
use crate::metrics::Metrics;
use crate::observe::{self, Query};
use crate::reads::ReadPool;

/// How long one probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The least time between two probes while the server is up: a watch failing over and over
/// on its own (a cut-off body) must not turn into a probe loop.
const PROBE_GAP_WHILE_UP: Duration = Duration::from_secs(1);

/// Watches resume spread over this after the server is back.
pub(crate) const RESUME_SPREAD: Duration = Duration::from_secs(1);

/// What the watches of a server know of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reach {
    Up,
    /// It does not answer: why, as the failed request or probe said (no address: each watch
    /// names its own).
    Down {
        cause: Arc<str>,
    },
}

/// The delays between probes of a server that is down: one second, then two, then every
/// two seconds (at most one connection attempt a second, and a return noticed within two).
#[derive(Debug, Default)]
pub(crate) struct ProbeSchedule {
    failures: u32,
}

impl ProbeSchedule {
    pub(crate) fn next_delay(&mut self) -> Duration {
        self.failures += 1;
        if self.failures == 1 { Duration::from_secs(1) } else { Duration::from_secs(2) }
    }
}

/// The reachability of one server.
pub(crate) struct Reachability {
    state: watch::Sender<Reach>,
    probing: Mutex<Probing>,
    /// Probes are short reads: they take a permit of the server's read pool.
    reads: ReadPool,
    metrics: Metrics,
}

#[derive(Default)]
struct Probing {
    task: Option<AbortOnDropHandle<()>>,
    last: Option<Instant>,
}

impl Reachability {
    pub(crate) fn new(reads: ReadPool, metrics: Metrics) -> Arc<Self> {
        Arc::new(Reachability { state: watch::Sender::new(Reach::Up), probing: Mutex::default(), reads, metrics })
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<Reach> {
        self.state.subscribe()
    }

    /// A request through `client` failed to reach the server: probe it now, unless a probe
    /// runs already or (while up) ran within the last second.
    pub(crate) fn suspect(self: &Arc<Self>, client: &Arc<HttpClient>, error: &QueryError) {
        if !error.unreachable() {
            return;
        }
        let mut probing = self.probing.lock().expect("probing poisoned");
        let running = probing.task.as_ref().is_some_and(|t| !t.is_finished());
        let up = matches!(*self.state.borrow(), Reach::Up);
        if running || (up && probing.last.is_some_and(|t| t.elapsed() < PROBE_GAP_WHILE_UP)) {
            return;
        }
        let (reach, client) = (Arc::downgrade(self), client.clone());
        let task =
            crate::restart::spawn_restarting("probe", &self.metrics, move || probe(reach.clone(), client.clone()));
        probing.task = Some(AbortOnDropHandle::new(task));
    }

    fn went(&self, reach: Reach) {
        let changed = self.state.send_if_modified(|now| {
            let changed = std::mem::discriminant(now) != std::mem::discriminant(&reach);
            *now = reach.clone();
            changed
        });
        if changed {
            match &reach {
                Reach::Down { cause } => {
                    self.metrics.unreachable_servers.inc();
                    tracing::warn!(%cause, "Consul server unreachable: its watches wait for it, one probe tries");
                }
                Reach::Up => {
                    self.metrics.unreachable_servers.dec();
                    tracing::info!("Consul server reachable again: its watches resume");
                }
            }
        }
    }
}

impl Drop for Reachability {
    fn drop(&mut self) {
        if matches!(*self.state.borrow(), Reach::Down { .. }) {
            self.metrics.unreachable_servers.dec();
        }
    }
}

/// Probes until the server answers; says it is down after the first failed probe.
async fn probe(reach: Weak<Reachability>, client: Arc<HttpClient>) {
    let mut schedule = ProbeSchedule::default();
    loop {
        let Some(r) = reach.upgrade() else { return };
        let outcome = {
            let _permit = r.reads.permit().await;
            r.probing.lock().expect("probing poisoned").last = Some(Instant::now());
            observe::request(&r.metrics, Query::Probe, None, None, || client.probe(PROBE_TIMEOUT)).await
        };
        match outcome {
            Err(e) if e.unreachable() => r.went(Reach::Down { cause: e.cause().into() }),
            // Any answer, even a refusal, is a server that is there.
            _ => {
                r.went(Reach::Up);
                return;
            }
        }
        drop(r);
        tokio::time::sleep(schedule.next_delay()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_back_off_to_two_seconds_never_more_than_one_a_second() {
        let mut s = ProbeSchedule::default();
        let delays: Vec<Duration> = (0..5).map(|_| s.next_delay()).collect();
        assert_eq!(delays, [1, 2, 2, 2, 2].map(Duration::from_secs));
    }
}
