//! The one task the loop runs against the publishers at a time: a publication, or a
//! repair of the snapshot ConfigMap. Each publisher's part has a deadline, so a hung one
//! fails the publication (retried with backoff) instead of holding back every later one.

use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use tokio::task::JoinHandle;

use crate::leadership::Leadership;
use crate::ops::metrics::Metrics;
use crate::publishers::configmap::ConfigMapPublisher;
use crate::publishers::{PublishError, Publisher};
use consul_resolver_core::assembler::Snapshot;

/// Where snapshots go: `local` ones on every replica, the ConfigMap only on the leader.
pub(super) struct Publishers {
    pub(super) local: Vec<Arc<dyn Publisher>>,
    pub(super) configmap: Option<Arc<ConfigMapPublisher>>,
    pub(super) leadership: Leadership,
    pub(super) timeout: Duration,
    pub(super) metrics: Metrics,
}

impl Publishers {
    /// This replica just became leader. Another one may have written since we last did
    /// (or we never did): forget what we wrote, so everything is written again, and
    /// return the id of the snapshot in the ConfigMap now, so ours continue after it.
    pub(super) async fn took_over(&self) -> u64 {
        let Some(c) = &self.configmap else { return 0 };
        c.forget();
        match c.published_id().await {
            Ok(id) => id.unwrap_or(0),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the last snapshot id; continuing from ours");
                0
            }
        }
    }

    /// Starts a publication of `snapshot`.
    pub(super) fn publish(self: &Arc<Self>, snapshot: Arc<Snapshot>) -> Task {
        let handle = tokio::spawn(publish(self.clone(), snapshot.clone()));
        Task::Publication(snapshot, handle)
    }

    /// Starts a repair of the snapshot ConfigMap, if there is one and we lead.
    pub(super) fn repair(&self) -> Option<Task> {
        let c = self.configmap.clone().filter(|_| self.leadership.is_leading())?;
        let metrics = self.metrics.clone();
        Some(Task::Repair(tokio::spawn(async move {
            match c.repair().await {
                Ok(names) if names.is_empty() => {}
                Ok(names) => {
                    tracing::warn!(configmaps = ?names, "the snapshot ConfigMap was deleted or edited; written again");
                    metrics.repairs.with_label_values(&["configmap"]).inc();
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot check the snapshot ConfigMap; trying again at the next resync");
                    metrics.publish_failures.with_label_values(&["configmap", e.reason()]).inc();
                }
            }
        })))
    }
}

/// What the one task against the publishers is doing.
pub(super) enum Task {
    Publication(Arc<Snapshot>, JoinHandle<bool>),
    Repair(JoinHandle<()>),
}

/// How a task ended.
pub(super) enum Done {
    Published { snapshot: Arc<Snapshot>, ok: bool },
    Repaired,
}

/// Waits for the task in flight, if any; pending forever without one.
pub(super) async fn finished(task: &mut Option<Task>) -> Done {
    match task {
        Some(Task::Publication(snapshot, handle)) => {
            // A panicked publication is a failed one: retried like any other.
            let ok = handle.await.unwrap_or(false);
            Done::Published { snapshot: snapshot.clone(), ok }
        }
        Some(Task::Repair(handle)) => {
            let _ = handle.await;
            Done::Repaired
        }
        None => std::future::pending().await,
    }
}

/// One publication: every local publisher, then the ConfigMap while leading, each within
/// the publish timeout. `true` when all of them succeeded.
async fn publish(publishers: Arc<Publishers>, snapshot: Arc<Snapshot>) -> bool {
    let started = StdInstant::now();
    let metrics = &publishers.metrics;
    let mut ok = true;
    let cluster = publishers
        .configmap
        .iter()
        .filter(|_| publishers.leadership.is_leading())
        .map(|c| c.clone() as Arc<dyn Publisher>);
    for p in publishers.local.iter().cloned().chain(cluster) {
        let one = StdInstant::now();
        let result = match tokio::time::timeout(publishers.timeout, p.publish(snapshot.clone())).await {
            Ok(r) => r,
            Err(_) => Err(PublishError::Timeout(publishers.timeout)),
        };
        metrics.publisher_seconds.with_label_values(&[p.name()]).observe(one.elapsed().as_secs_f64());
        if let Err(e) = result {
            tracing::warn!(publisher = p.name(), id = snapshot.id, error = %e, "publication failed; will retry");
            metrics.publish_failures.with_label_values(&[p.name(), e.reason()]).inc();
            ok = false;
        }
    }
    metrics.publish_seconds.observe(started.elapsed().as_secs_f64());
    if ok {
        metrics.snapshots_published.inc();
        metrics.snapshot_id.set(snapshot.id as i64);
        metrics.snapshot_bytes.set(snapshot.to_json().len() as i64);
        if let Some(parts) = publishers.configmap.as_ref().and_then(|c| c.parts_written()) {
            metrics.configmap_parts.set(parts as i64);
        }
        metrics.problems.set(snapshot.content.problems.len() as i64);
        tracing::info!(
            id = snapshot.id,
            hash = %snapshot.hash,
            complete = snapshot.content.bootstrap.complete,
            mappings = snapshot.content.mappings.len(),
            resolvers = snapshot.content.resolvers.len(),
            problems = snapshot.content.problems.len(),
            "snapshot published"
        );
    }
    ok
}
