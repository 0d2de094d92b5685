//! Publishers: the edge that writes whole snapshots out (HTTP, the hook, the ConfigMap).
//! The runtime publishes to all of them in turn, one snapshot at a time, each within a
//! deadline; a publication that fails anywhere is retried later with whatever is current
//! then. Resolver statuses and Events are per resolver, written by the resolver controller
//! (`crate::controller`), so one resolver's failing status never holds back a publication.

pub(crate) mod configmap;
pub(crate) mod hook;
pub(crate) mod http;

use std::sync::Arc;

use futures::future::BoxFuture;

use consul_resolver_core::assembler::Snapshot;

pub(crate) trait Publisher: Send + Sync + 'static {
    fn name(&self) -> &'static str;
    fn publish(&self, snapshot: Arc<Snapshot>) -> BoxFuture<'static, Result<(), String>>;

    /// Forgets what this publisher believes it has already written, so the next
    /// publication writes everything: another writer (an earlier leader) may have written
    /// since.
    fn forget(&self) {}
}
