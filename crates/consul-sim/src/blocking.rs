//! Waiting for the index of a blocking query to move past the client's.
//!
//! Every blocking query waits on the one `changes` channel that each catalog write bumps, and
//! re-reads its own index when woken (see `state`). Normally the wait is part of the request:
//! when the client goes away, hyper drops the request and the wait with it, as current agents
//! cancel the query. With `no_server_cancel`, as on older agents, the wait runs as a task of
//! its own that outlives the request, still counted in the stats, until its wait ends or a
//! write moves its index.

use std::sync::Arc;

use tokio::sync::watch;
use tokio::time::Instant;

use super::catalog::{Catalog, Origin, ServiceKey, StateFilter};
use super::faults::Quirks;
use super::state::{BlockingGuard, Shared, read_lock};

/// The index a read reports and blocks on.
#[derive(Clone, Debug)]
pub(crate) enum Watched {
    /// `/v1/health/service/<name>`: the service's own index from where the read looks
    /// ([`Catalog::origin_index`]), or with `single_health_index` the catalog's raft index.
    Service(Origin, ServiceKey),
    /// `/v1/health/connect/<name>`: the destination's Connect index (its key from
    /// `catalog::connect_key`), or with `single_health_index` the catalog's raft index.
    Connect(ServiceKey),
    /// `/v1/catalog/services`.
    CatalogServices,
    /// `/v1/health/state/<state>`: reports the checks table's index, but a blocking query
    /// of one status wakes only for a write to a check of that status
    /// ([`Catalog::state_stirred_index`]).
    ChecksInState(StateFilter),
    /// `/v1/catalog/nodes`.
    Nodes,
    /// `/v1/catalog/node-services/<node>`.
    NodeServices(String),
}

impl Watched {
    /// The raw index (possibly 0 or below the client's); see [`reported_index`].
    pub(crate) fn index(&self, c: &Catalog, quirks: Quirks) -> u64 {
        match self {
            Watched::Service(..) | Watched::Connect(_) if quirks.single_health_index => c.raft_index(),
            Watched::Service(origin, key) => c.origin_index(origin, key),
            Watched::Connect(key) => c.connect_index(key),
            Watched::CatalogServices => c.services_index(),
            Watched::ChecksInState(_) => c.checks_index(),
            Watched::Nodes => c.nodes_index(),
            Watched::NodeServices(node) => c.node_services_index(node),
        }
    }

    /// What a blocking query waits on: its index, but for the checks of one status.
    fn stirred_index(&self, c: &Catalog, quirks: Quirks) -> u64 {
        match self {
            Watched::ChecksInState(filter) => c.state_stirred_index(*filter),
            _ => self.index(c, quirks),
        }
    }
}

/// Whether a read must answer `X-Consul-Index: 0` at once (`zero_index_when_empty`).
pub(crate) fn answers_zero(c: &Catalog, quirks: Quirks) -> bool {
    quirks.zero_index_when_empty && c.has_no_service()
}

/// The `X-Consul-Index` of a read: never below 1, except `0` on an older agent whose catalog
/// holds no service.
pub(crate) fn reported_index(watched: &Watched, c: &Catalog, quirks: Quirks) -> u64 {
    if answers_zero(c, quirks) { 0 } else { watched.index(c, quirks).max(1) }
}

/// How a wait ended.
pub(crate) enum Woken {
    /// The index moved past the client's, or the wait timed out: answer.
    Ready,
    /// `drop-blocking`, or the simulator is stopping: close without an answer.
    Dropped,
}

/// One blocking query's wait, counted in the stats from [`Wait::start`] until it ends.
pub(crate) struct Wait {
    shared: Arc<Shared>,
    watched: Watched,
    quirks: Quirks,
    min_index: u64,
    deadline: Instant,
    changes: watch::Receiver<()>,
    drops: watch::Receiver<()>,
    shutdown: watch::Receiver<bool>,
    guard: BlockingGuard,
}

impl Wait {
    pub(crate) fn start(
        shared: &Arc<Shared>,
        label: &str,
        watched: Watched,
        quirks: Quirks,
        min_index: u64,
        deadline: Instant,
    ) -> Self {
        let changes = shared.changes.subscribe();
        // Subscribe to drops before counting ourselves as blocked, so that a drop which
        // counts us is guaranteed to reach us.
        let mut drops = shared.drops.subscribe();
        drops.mark_unchanged();
        let shutdown = shared.shutdown.subscribe();
        let guard = BlockingGuard::new(shared, label);
        Wait { shared: shared.clone(), watched, quirks, min_index, deadline, changes, drops, shutdown, guard }
    }

    /// Waits in this request, or with `no_server_cancel` in a task that outlives it.
    pub(crate) async fn finish(self) -> Woken {
        if self.quirks.no_server_cancel { self.detached().await } else { self.run().await }
    }

    /// As Consul's blocking query: an index already past the client's answers at once;
    /// otherwise the query waits until what it watches is written ([`Watched::stirred_index`])
    /// and its index has moved past the client's.
    async fn run(mut self) -> Woken {
        let mut stirred_at_start = None;
        loop {
            // Mark seen before reading, so a write between the read and the wait still wakes us.
            self.changes.mark_unchanged();
            {
                let c = read_lock(&self.shared.catalog);
                let stirred = self.watched.stirred_index(&c, self.quirks);
                // At the first look any index past the client's will do; later, only one
                // that what the query watches moved since.
                let moved = self.watched.index(&c, self.quirks) > self.min_index;
                if moved && stirred_at_start.is_none_or(|at_start| at_start != stirred) {
                    return Woken::Ready;
                }
                stirred_at_start.get_or_insert(stirred);
            }
            tokio::select! {
                r = self.changes.changed() => {
                    if r.is_err() {
                        // The sender lives as long as `shared`; unreachable in practice.
                        return Woken::Ready;
                    }
                }
                () = tokio::time::sleep_until(self.deadline) => return Woken::Ready,
                _ = self.drops.changed() => return Woken::Dropped,
                _ = self.shutdown.wait_for(|stop| *stop) => return Woken::Dropped,
            }
        }
    }

    async fn detached(mut self) -> Woken {
        // Dropped with this future if the client goes first: the task then runs on, detached.
        let _request = self.guard.detachable();
        // A join error means the task was cancelled (the runtime is stopping).
        tokio::spawn(self.run()).await.unwrap_or(Woken::Dropped)
    }
}
