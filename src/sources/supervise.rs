//! A watch task that ends before its key is stopped (it returned, or it panicked) would
//! leave its key's last data published as current, with nobody watching it. Supervised, it
//! is started again with backoff, its key is reported failed meanwhile (the core keeps the
//! last data, marked stale, with the reason), and `watch_restarts_total{source,
//! reason="task_ended"}` counts it. A key whose task keeps ending makes `/healthz` fail
//! after [`MAX_RESTARTS`] restarts without a healthy run in between: something is wrong
//! that a restart of the watch does not mend, and a restart of the process might.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use prometheus::IntCounterVec;
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;

use consul_resolver_core::keys::WatchKey;
use consul_resolver_core::model::{ConsulEvent, Event, KubeEvent, WatchFailure};

use super::EventSink;
use crate::vitals::Vitals;

/// The first wait before a restart, doubled per restart up to [`LONGEST_WAIT`].
const FIRST_WAIT: Duration = Duration::from_secs(1);
const LONGEST_WAIT: Duration = Duration::from_secs(30);
/// A run this long was healthy: the count of restarts starts over.
const HEALTHY_RUN: Duration = Duration::from_secs(60);
/// Restarts without a healthy run in between after which `/healthz` fails.
pub(crate) const MAX_RESTARTS: u32 = 5;

/// What a supervisor reports to.
#[derive(Clone)]
pub(crate) struct Supervision {
    pub(crate) events: EventSink,
    pub(crate) restarts: IntCounterVec,
    pub(crate) vitals: Arc<Vitals>,
}

/// Runs the watch of `key` (`start` makes it anew each time) until dropped, restarting it
/// whenever it ends. Dropping the supervisor aborts the watch it runs.
///
/// A block, not an `async fn`: an `async fn` keeps a copy of each argument beside the one
/// it moves into its body, and every watched service holds one supervisor (see the size
/// test).
#[allow(clippy::manual_async_fn, reason = "an async fn would hold its arguments twice")]
pub(crate) fn supervise<F, Fut>(key: WatchKey, start: F, s: Supervision) -> impl Future<Output = ()>
where
    F: Fn() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    async move { supervised(&key, &start, &s).await }
}

async fn supervised<F, Fut>(key: &WatchKey, start: &F, s: &Supervision)
where
    F: Fn() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut restarts = 0u32;
    loop {
        let began = Instant::now();
        let run = AbortOnDropHandle::new(tokio::spawn(start()));
        let how = match run.await {
            Ok(()) => "ended".to_owned(),
            Err(e) if e.is_panic() => format!("panicked: {}", panic_message(e.into_panic())),
            Err(_) => "was cancelled".to_owned(),
        };
        restarts = if began.elapsed() >= HEALTHY_RUN { 1 } else { restarts + 1 };
        let source = super::source(key);
        s.restarts.with_label_values(&[source, "task_ended"]).inc();
        let wait = FIRST_WAIT.saturating_mul(1 << (restarts - 1).min(5)).min(LONGEST_WAIT);
        let message = format!("the watch task {how}; restarted in {wait:?} (restart {restarts})");
        tracing::error!(watch = %key, source, restarts, "{message}");
        let failed = match key {
            WatchKey::Consul(k) => Event::Consul(k.clone(), ConsulEvent::Failed(message.clone())),
            WatchKey::Kube(k) => Event::Kube(k.clone(), KubeEvent::Failed(WatchFailure::transient(message.clone()))),
        };
        // A full channel means the loop is behind: this waits its turn, as every event does.
        // Boxed: the send's state is needed only while a watch has ended.
        if Box::pin(s.events.send(failed)).await.is_err() {
            return; // The event loop is gone: shutting down.
        }
        if restarts == MAX_RESTARTS {
            s.vitals.failing(format!("the watch of {key} ended {restarts} times in a row ({message})"));
        }
        tokio::time::sleep(wait).await;
    }
}

/// A panic's message, when it has one.
fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(payload) => payload.downcast::<&str>().map(|s| (*s).to_owned()).unwrap_or_else(|_| "?".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::consul_key;
    use std::sync::atomic::{AtomicU32, Ordering};
    use tokio_util::sync::CancellationToken;

    /// A watch that panics is started again after 1 s, 2 s, 4 s...; each time its key is
    /// reported failed with the reason, and counted; the fifth time in a row fails
    /// `/healthz`. Dropping the supervisor stops the watch it runs.
    #[tokio::test(start_paused = true)]
    async fn a_watch_that_panics_is_restarted_with_backoff_reported_and_at_last_unhealthy() {
        let (tx, mut rx) = tokio::sync::mpsc::channel(16);
        let restarts = crate::measure::counter_vec("watch_restarts_total", "restarts", &["source", "reason"]);
        let vitals = Vitals::new(CancellationToken::new());
        let s = Supervision { events: tx, restarts: restarts.clone(), vitals: vitals.clone() };
        let runs = Arc::new(AtomicU32::new(0));
        let counted = runs.clone();
        let start = move || {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                panic!("bug {n}");
            }
        };
        let t0 = Instant::now();
        let supervisor = AbortOnDropHandle::new(tokio::spawn(supervise(
            WatchKey::Consul(consul_key("http://127.0.0.1:8500")),
            start,
            s,
        )));
        let mut seen = Vec::new();
        for _ in 0..MAX_RESTARTS {
            let Some(Event::Consul(_, ConsulEvent::Failed(m))) = rx.recv().await else { panic!("a failure") };
            seen.push((t0.elapsed().as_millis() / 100 * 100, m));
        }
        // Each run lasts 10 ms; the waits between are 1, 2, 4, 8 s.
        let at: Vec<u128> = seen.iter().map(|(t, _)| *t).collect();
        assert_eq!(at, [0, 1000, 3000, 7000, 15000]);
        assert!(seen[0].1.contains("panicked: bug 0"), "{}", seen[0].1);
        assert_eq!(restarts.with_label_values(&["consul", "task_ended"]).get(), u64::from(MAX_RESTARTS));
        let health = vitals.check();
        assert!(health.as_ref().is_err_and(|e| e.contains("ended 5 times")), "{health:?}");
        drop(supervisor);
        let before = runs.load(Ordering::SeqCst);
        tokio::time::advance(Duration::from_secs(120)).await;
        assert_eq!(runs.load(Ordering::SeqCst), before, "stopped with its supervisor");
    }

    /// A watch that ran healthily for a while before it ended starts the count over: one
    /// ending a day is not a reason to restart the process.
    #[tokio::test(start_paused = true)]
    async fn an_ending_after_a_healthy_run_starts_the_count_over() {
        let (tx, mut rx) = tokio::sync::mpsc::channel(16);
        let restarts = crate::measure::counter_vec("watch_restarts_total", "restarts", &["source", "reason"]);
        let vitals = Vitals::new(CancellationToken::new());
        let s = Supervision { events: tx, restarts, vitals: vitals.clone() };
        let start = || async { tokio::time::sleep(HEALTHY_RUN).await };
        let _supervisor = AbortOnDropHandle::new(tokio::spawn(supervise(
            WatchKey::Consul(consul_key("http://127.0.0.1:8500")),
            start,
            s,
        )));
        for _ in 0..MAX_RESTARTS * 2 {
            let Some(Event::Consul(_, ConsulEvent::Failed(m))) = rx.recv().await else { panic!("a failure") };
            assert!(m.contains("restart 1)"), "{m}");
        }
        assert!(vitals.check().is_ok());
    }
}
