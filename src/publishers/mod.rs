//! Publishers: the edge that writes snapshots out. The runtime publishes to all of them
//! in turn, one snapshot at a time; a publication that fails anywhere is retried later
//! with whatever is current then.

pub mod configmap;
pub mod events;
pub mod hook;
pub mod http;
pub mod status;
#[cfg(test)]
mod test_api;

use std::sync::Arc;

use futures::future::BoxFuture;

use crate::core::assembler::Snapshot;

pub trait Publisher: Send + Sync + 'static {
    fn name(&self) -> &'static str;
    fn publish(&self, snapshot: Arc<Snapshot>) -> BoxFuture<'static, Result<(), String>>;

    /// Forgets what this publisher believes it has already written, so the next
    /// publication writes everything: another writer (an earlier leader) may have written
    /// since.
    fn forget(&self) {}
}
