//! The background tasks the event loop relies on (the status controllers, the leader
//! election campaign, each publisher's outlet, the ops server, the watches' supervisors):
//! one that ends before shutdown, by a panic or a return, is logged with its cause and fails
//! `/healthz`, so the pod is restarted rather than running on without statuses, leadership
//! or an output. A leaf: every subsystem reports here, and the ops server reads it.

use std::future::Future;
use std::sync::Mutex;

use tokio_util::sync::CancellationToken;

/// The background tasks that must outlive the run, and those that did not.
#[derive(Debug)]
pub(crate) struct Vitals {
    /// Cancelled at shutdown: from then on, tasks end as they should.
    shutdown: CancellationToken,
    /// Why each task that ended early ended, in order.
    dead: Mutex<Vec<String>>,
}

impl Vitals {
    pub(crate) fn new(shutdown: CancellationToken) -> std::sync::Arc<Vitals> {
        std::sync::Arc::new(Vitals { shutdown, dead: Mutex::default() })
    }

    /// `task`, watched: if it ends before shutdown (returns, panics, or is dropped), that
    /// is recorded under `name`.
    pub(crate) fn watch<F: Future>(
        self: &std::sync::Arc<Self>,
        name: &'static str,
        task: F,
    ) -> impl Future<Output = F::Output> + use<F> {
        let mut guard = Guard { name, vitals: self.clone(), returned: false };
        async move {
            let out = task.await;
            guard.returned = true;
            drop(guard);
            out
        }
    }

    /// `Ok` while every watched task lives (or the process is shutting down); else which
    /// ended and how, for `/healthz`.
    pub(crate) fn check(&self) -> Result<(), String> {
        let dead = self.dead.lock().expect("vitals poisoned");
        if dead.is_empty() { Ok(()) } else { Err(dead.join("; ")) }
    }

    /// Something that keeps failing, that a restart of the process might mend: `/healthz`
    /// fails with `why` from now on.
    pub(crate) fn failing(&self, why: String) {
        tracing::error!("{why}: /healthz fails so the pod restarts");
        self.dead.lock().expect("vitals poisoned").push(why);
    }

    fn died(&self, name: &str, how: &str) {
        tracing::error!(task = name, "a background task {how} before shutdown: /healthz fails so the pod restarts");
        self.dead.lock().expect("vitals poisoned").push(format!("the {name} task {how}"));
    }
}

/// Dropped when its task ends, however it ends.
struct Guard {
    name: &'static str,
    vitals: std::sync::Arc<Vitals>,
    returned: bool,
}

impl Drop for Guard {
    fn drop(&mut self) {
        if self.vitals.shutdown.is_cancelled() {
            return;
        }
        let how = if std::thread::panicking() {
            "panicked (its message is logged above)"
        } else if self.returned {
            "returned"
        } else {
            "was cancelled"
        };
        self.vitals.died(self.name, how);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_task_that_ends_before_shutdown_is_reported_and_one_after_is_not() {
        let shutdown = CancellationToken::new();
        let vitals = Vitals::new(shutdown.clone());
        let alive = tokio::spawn(vitals.watch("forever", std::future::pending::<()>()));
        assert!(vitals.check().is_ok());
        let panicked = tokio::spawn(vitals.watch("status controller", async { panic!("boom") }));
        assert!(panicked.await.unwrap_err().is_panic());
        tokio::spawn(vitals.watch("campaign", async {})).await.unwrap();
        let why = vitals.check().unwrap_err();
        assert!(why.contains("the status controller task panicked"), "{why}");
        assert!(why.contains("the campaign task returned"), "{why}");
        alive.abort();
        let _ = alive.await;
        assert!(vitals.check().unwrap_err().contains("the forever task was cancelled"));

        // At shutdown tasks end as they should: nothing more is recorded.
        shutdown.cancel();
        tokio::spawn(vitals.watch("outlet", async {})).await.unwrap();
        assert!(!vitals.check().unwrap_err().contains("outlet"));
    }
}
