//! Liveness: the event loop beats a [`Heartbeat`] every time it turns, and at least every
//! [`BEAT_EVERY`] while idle; `/healthz` fails when it has not beaten for longer than
//! `--heartbeat-timeout`. A loop wedged in a step that never ends (a deadlock, a blocking
//! call, an await without a deadline) then gets the process restarted by its liveness
//! probe, where a plain "the HTTP server answers" check would stay green forever.
//!
//! The background tasks the loop relies on are watched by [`crate::vitals::Vitals`], which
//! fails `/healthz` too.
//!
//! [`LivenessMetrics`] show the same from outside: the heartbeat as a timestamp, and the
//! tasks alive in the async runtime (a leak shows as steady growth).

use std::sync::Mutex;
use std::time::Duration;

use prometheus::core::Collector;
use prometheus::{Gauge, IntGauge, Registry};
use tokio::time::Instant;

use crate::measure::{gauge, int_gauge, register_all};

/// How often an idle loop beats: far below any sensible timeout.
pub(crate) const BEAT_EVERY: Duration = Duration::from_secs(1);

/// When the event loop last turned.
#[derive(Debug)]
pub(crate) struct Heartbeat {
    last: Mutex<Instant>,
}

impl Heartbeat {
    /// A heart that beats now: the loop has the timeout to start turning.
    pub(crate) fn new(now: Instant) -> Self {
        Heartbeat { last: Mutex::new(now) }
    }

    pub(crate) fn beat(&self, now: Instant) {
        *self.last.lock().expect("heartbeat poisoned") = now;
    }

    /// `Ok` while the last beat is at most `timeout` old; else why not, for `/healthz`.
    pub(crate) fn check(&self, now: Instant, timeout: Duration) -> Result<(), String> {
        let silent = now.saturating_duration_since(*self.last.lock().expect("heartbeat poisoned"));
        if silent <= timeout {
            Ok(())
        } else {
            Err(format!(
                "the event loop has not turned for {} (more than --heartbeat-timeout {})",
                humantime::format_duration(Duration::from_millis(silent.as_millis() as u64)),
                humantime::format_duration(timeout)
            ))
        }
    }
}

/// The liveness metrics. Cloning shares them.
#[derive(Clone)]
pub(crate) struct LivenessMetrics {
    /// Set by the event loop each time it beats the [`Heartbeat`].
    pub heartbeat_timestamp: Gauge,
    /// Tasks alive in the async runtime, read at each scrape: a task that outlives its
    /// watch (a leak) shows as steady growth (the soak benchmark follows it).
    runtime_tasks: IntGauge,
}

impl LivenessMetrics {
    /// Metrics counted but exported nowhere (tests).
    pub(crate) fn unregistered() -> LivenessMetrics {
        LivenessMetrics {
            heartbeat_timestamp: gauge(
                "heartbeat_timestamp_seconds",
                "Unix time the event loop last turned (it turns at least every second; /healthz fails when it stops)",
            ),
            runtime_tasks: int_gauge(
                "runtime_tasks",
                "Tasks alive in the operator's async runtime, read at each scrape (steady growth is a leak)",
            ),
        }
    }

    pub(crate) fn register(registry: &Registry) -> prometheus::Result<LivenessMetrics> {
        let m = LivenessMetrics::unregistered();
        register_all(registry, m.collectors())?;
        Ok(m)
    }

    /// What [`LivenessMetrics::register`] registers.
    pub(crate) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![Box::new(self.heartbeat_timestamp.clone()), Box::new(self.runtime_tasks.clone())]
    }

    /// Reads the tasks alive, before a scrape.
    pub(crate) fn refresh(&self) {
        // Scrapes are served on the runtime; outside one (a unit test) the gauge stays as is.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let alive = runtime.metrics().num_alive_tasks();
            self.runtime_tasks.set(i64::try_from(alive).unwrap_or(i64::MAX));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn stale_only_past_the_timeout_and_fresh_again_after_a_beat() {
        let timeout = Duration::from_secs(60);
        let h = Heartbeat::new(Instant::now());
        assert!(h.check(Instant::now(), timeout).is_ok());
        tokio::time::advance(timeout).await;
        assert!(h.check(Instant::now(), timeout).is_ok(), "exactly the timeout is still alive");
        tokio::time::advance(Duration::from_millis(1)).await;
        let why = h.check(Instant::now(), timeout).unwrap_err();
        assert!(why.contains("has not turned for 1m 1ms") && why.contains("--heartbeat-timeout 1m"), "{why}");
        h.beat(Instant::now());
        assert!(h.check(Instant::now(), timeout).is_ok());
    }
}
