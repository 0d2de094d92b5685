//! The source's own tasks beside the watches (each server's planner, the change feeds, the
//! reachability probe) are restarted when they panic: a dead planner would never place a
//! watch again, a dead feed would leave its members to the sweep, and a probe that dies
//! while its server is down would leave every watch of it waiting for good. A task that
//! returns ends as it should (its server or feed is gone). Each restart is logged and
//! counted in `watch_restarts_total{source="consul",reason="<task>_panicked"}`. A task that
//! panics [`MAX_RESTARTS`] times without a healthy run in between is reported to the
//! embedding program ([`Failing`], `ConsulSource::on_failing`), whose health check fails:
//! something is wrong that a restart of the process may mend, as for a watch that keeps
//! ending.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;

use crate::Metrics;

/// The first wait before a restart, doubled per restart up to [`LONGEST_WAIT`].
const FIRST_WAIT: Duration = Duration::from_secs(1);
const LONGEST_WAIT: Duration = Duration::from_secs(30);
/// A run this long was healthy: the count of restarts starts over.
const HEALTHY_RUN: Duration = Duration::from_secs(60);
/// Restarts without a healthy run in between after which the task is reported failing.
pub(crate) const MAX_RESTARTS: u32 = 5;

/// Where a task that keeps panicking is reported: the embedding program's health check,
/// once it has said where ([`Failing::report_to`]); only logged before. Cloning shares it.
#[derive(Clone, Default)]
pub(crate) struct Failing(Arc<Mutex<Option<Report>>>);

type Report = Box<dyn Fn(String) + Send + Sync>;

impl Failing {
    pub(crate) fn report_to(&self, report: impl Fn(String) + Send + Sync + 'static) {
        *self.0.lock().expect("failing poisoned") = Some(Box::new(report));
    }

    fn report(&self, why: String) {
        tracing::error!("{why}");
        if let Some(report) = self.0.lock().expect("failing poisoned").as_ref() {
            report(why);
        }
    }
}

/// Spawns `make()`, and again after a panic, until a run returns or the handle is
/// aborted (which aborts the run too). `task` names it in logs and in the reason label.
pub(crate) fn spawn_restarting<F, Fut>(task: &'static str, metrics: &Metrics, make: F) -> JoinHandle<()>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (restarts, failing) = (metrics.restarts.clone(), metrics.failing.clone());
    tokio::spawn(async move {
        let mut in_a_row = 0u32;
        loop {
            let began = Instant::now();
            match AbortOnDropHandle::new(tokio::spawn(make())).await {
                Err(e) if e.is_panic() => {
                    in_a_row = if began.elapsed() >= HEALTHY_RUN { 1 } else { in_a_row + 1 };
                    let wait = FIRST_WAIT.saturating_mul(1 << (in_a_row - 1).min(5)).min(LONGEST_WAIT);
                    tracing::error!(task, restart_in = ?wait, "a task of the Consul source panicked; restarting it");
                    restarts.with_label_values(&["consul", &format!("{task}_panicked")]).inc();
                    if in_a_row == MAX_RESTARTS {
                        failing.report(format!("the Consul source's {task} task panicked {in_a_row} times in a row"));
                    }
                    tokio::time::sleep(wait).await;
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
        let metrics = crate::Metrics::unregistered();
        let restarts = metrics.restarts.clone();
        let runs = Arc::new(AtomicU32::new(0));
        let counted = runs.clone();
        let t0 = Instant::now();
        let started = Arc::new(std::sync::Mutex::new(Vec::new()));
        let at = started.clone();
        let handle = spawn_restarting("planner", &metrics, move || {
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

    /// The fifth panic in a row is reported, once; a healthy run starts the count over.
    #[tokio::test(start_paused = true)]
    async fn a_task_that_keeps_panicking_is_reported_failing_once() {
        let metrics = crate::Metrics::unregistered();
        let reports = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = reports.clone();
        metrics.failing.report_to(move |why| sink.lock().unwrap().push(why));
        let runs = Arc::new(AtomicU32::new(0));
        let counted = runs.clone();
        // Runs 0-3 panic at once, run 4 after a healthy minute, runs 5-9 at once, run 10 returns.
        let handle = spawn_restarting("feed", &metrics, move || {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 4 {
                    tokio::time::sleep(HEALTHY_RUN).await;
                }
                assert!(n >= 10, "run {n} fails");
            }
        });
        handle.await.unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 11);
        let reports = reports.lock().unwrap();
        assert_eq!(*reports, ["the Consul source's feed task panicked 5 times in a row"], "{reports:?}");
    }
}
