//! The source's own tasks beside the watches (each server's planner, the change feeds, the
//! reachability probe) are restarted when they panic: a dead planner would never place a
//! watch again, a dead feed would leave its members to the sweep, and a probe that dies
//! while its server is down would leave every watch of it waiting for good. A task that
//! returns ends as it should (its server or feed is gone). Each restart is logged and
//! counted in `watch_restarts_total{source="consul",reason="<task>_panicked"}`.

use std::future::Future;
use std::time::Duration;

use prometheus::IntCounterVec;
use tokio::task::JoinHandle;
use tokio_util::task::AbortOnDropHandle;

/// The first wait before a restart, doubled per restart up to [`LONGEST_WAIT`].
const FIRST_WAIT: Duration = Duration::from_secs(1);
const LONGEST_WAIT: Duration = Duration::from_secs(30);

/// Spawns `make()`, and again after a panic, until a run returns or the handle is
/// aborted (which aborts the run too). `task` names it in logs and in the reason label.
pub(crate) fn spawn_restarting<F, Fut>(task: &'static str, restarts: IntCounterVec, make: F) -> JoinHandle<()>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    tokio::spawn(async move {
        let mut wait = FIRST_WAIT;
        loop {
            match AbortOnDropHandle::new(tokio::spawn(make())).await {
                Err(e) if e.is_panic() => {
                    tracing::error!(task, restart_in = ?wait, "a task of the Consul source panicked; restarting it");
                    restarts.with_label_values(&["consul", &format!("{task}_panicked")]).inc();
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(LONGEST_WAIT);
                }
                // Returned (its work is over), or cancelled at shutdown.
                _ => return,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};
    use tokio::time::Instant;

    /// Panics are restarted after 1 s, then 2 s; a run that returns ends it.
    #[tokio::test(start_paused = true)]
    async fn a_task_that_panics_is_restarted_with_backoff_and_one_that_returns_is_not() {
        let restarts = crate::Metrics::unregistered().restarts;
        let runs = Arc::new(AtomicU32::new(0));
        let counted = runs.clone();
        let t0 = Instant::now();
        let started = Arc::new(std::sync::Mutex::new(Vec::new()));
        let at = started.clone();
        let handle = spawn_restarting("planner", restarts.clone(), move || {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            at.lock().unwrap().push(t0.elapsed().as_secs());
            async move {
                assert!(n >= 2, "run {n} fails");
            }
        });
        handle.await.unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 3);
        assert_eq!(*started.lock().unwrap(), [0, 1, 3], "restarted after 1 s, then 2 s");
        assert_eq!(restarts.with_label_values(&["consul", "planner_panicked"]).get(), 2);
    }
}
