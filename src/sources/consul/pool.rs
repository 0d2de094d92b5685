//! The connection budget of one Consul address, and the change feeds used when the watched
//! services outnumber it (see docs/consul.md).
//!
//! Every request holds a permit for its whole life, and the permits of one address add up
//! to `--consul-max-connections`, so no more requests are in flight than the budget allows
//! (open connections follow: reqwest reuses an idle connection before opening one). The
//! permits are split three ways:
//! - `slots`: dedicated blocking queries, one per watch while they last;
//! - `feeds`: blocking queries on `/v1/catalog/services`, one per scope that has watches
//!   without a slot ("fed" watches);
//! - `reads`: short non-blocking reads (first answers, and re-reads of fed watches).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Semaphore, watch};
use tokio_util::task::AbortOnDropHandle;

use super::client::{HttpClient, Scope};
use super::timing::{Backoff, IndexState};
use consul_resolver_core::keys::{ConsulKey, ConsulServer, TlsSettings};

/// How the budget is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Split {
    pub slots: usize,
    pub feeds: usize,
    pub reads: usize,
}

impl Split {
    /// A tenth (at least one) for reads, up to two for feeds when there is room, the rest
    /// for dedicated blocking queries.
    pub(crate) fn of(budget: usize) -> Split {
        let budget = budget.max(1);
        let reads = (budget / 10).max(1);
        let rest = budget.saturating_sub(reads);
        let feeds = (rest / 2).min(2);
        Split { slots: rest - feeds, feeds, reads }
    }
}

/// What identifies one change feed: the scope it covers, and the server (token, TLS) it
/// reads with, so ACL filtering is that of the watches it serves.
type FeedKey = (Scope, ConsulServer);

struct Feed {
    changes: watch::Receiver<u64>,
    members: usize,
    _task: AbortOnDropHandle<()>,
}

pub(crate) struct Pool {
    address: String,
    max_connections: usize,
    wait: Duration,
    pub slots: Arc<Semaphore>,
    pub reads: Arc<Semaphore>,
    feed_permits: Arc<Semaphore>,
    clients: tokio::sync::Mutex<HashMap<Option<TlsSettings>, HttpClient>>,
    feeds: Mutex<HashMap<FeedKey, Feed>>,
}

impl Pool {
    pub(crate) fn new(address: &str, max_connections: usize, wait: Duration) -> Arc<Pool> {
        let split = Split::of(max_connections);
        Arc::new(Pool {
            address: address.to_owned(),
            max_connections,
            wait,
            slots: Arc::new(Semaphore::new(split.slots)),
            reads: Arc::new(Semaphore::new(split.reads)),
            feed_permits: Arc::new(Semaphore::new(split.feeds)),
            clients: tokio::sync::Mutex::new(HashMap::new()),
            feeds: Mutex::new(HashMap::new()),
        })
    }

    /// The client for these TLS settings, built once.
    pub(crate) async fn client(&self, tls: Option<&TlsSettings>) -> Result<HttpClient, String> {
        let mut clients = self.clients.lock().await;
        if let Some(c) = clients.get(&tls.cloned()) {
            return Ok(c.clone());
        }
        let c = HttpClient::new(&self.address, tls, self.max_connections).await?;
        clients.insert(tls.cloned(), c.clone());
        Ok(c)
    }

    /// Joins (starting if needed) the change feed of `key`'s scope. The receiver's value
    /// changes whenever the feed sees the catalog change, and once after the feed's own
    /// first read (so nothing between a member's last read and the feed's start is lost).
    pub(crate) fn join_feed(self: &Arc<Self>, key: &ConsulKey, client: HttpClient) -> FeedMembership {
        let fk: FeedKey = (Scope::of(key), key.server.clone());
        let mut feeds = self.feeds.lock().expect("feed map poisoned");
        let feed = feeds.entry(fk.clone()).or_insert_with(|| {
            let (tx, rx) = watch::channel(0);
            let task = tokio::spawn(run_feed(self.clone(), fk.clone(), client, tx));
            Feed { changes: rx, members: 0, _task: AbortOnDropHandle::new(task) }
        });
        feed.members += 1;
        let mut changes = feed.changes.clone();
        changes.mark_unchanged();
        FeedMembership { pool: self.clone(), key: fk, changes }
    }

    fn leave_feed(&self, key: &FeedKey) {
        let mut feeds = self.feeds.lock().expect("feed map poisoned");
        if let Some(f) = feeds.get_mut(key) {
            f.members -= 1;
            if f.members == 0 {
                // Dropping the feed aborts its task and the blocking query in flight.
                feeds.remove(key);
            }
        }
    }
}

/// A fed watch's subscription; leaving is dropping it (the last member stops the feed).
pub(crate) struct FeedMembership {
    pool: Arc<Pool>,
    key: FeedKey,
    pub changes: watch::Receiver<u64>,
}

impl Drop for FeedMembership {
    fn drop(&mut self) {
        self.pool.leave_feed(&self.key);
    }
}

/// The feed loop: a blocking query on `/v1/catalog/services` following the same index rules
/// as a watch, bumping the generation whenever the index moves.
async fn run_feed(pool: Arc<Pool>, (scope, server): FeedKey, client: HttpClient, changes: watch::Sender<u64>) {
    let mut state = IndexState::default();
    let mut backoff = Backoff::default();
    let mut first = true;
    loop {
        if !first {
            let delay = super::timing::pace(Duration::from_millis(100), &mut rand::rng());
            tokio::time::sleep(delay).await;
        }
        first = false;
        let Ok(_permit) = pool.feed_permits.clone().acquire_owned().await else { return };
        let block = state.block(pool.wait);
        match client.catalog_services(&scope, server.token.as_ref(), block).await {
            Ok(index) => {
                backoff.reset();
                let before = state.index();
                state.observe(block.map(|b| b.0), index);
                if before != Some(index) {
                    changes.send_modify(|g| *g += 1);
                }
            }
            Err(e) => {
                tracing::warn!(consul = %pool.address, error = %e, "change feed failed; fed services fall back to periodic re-reads");
                drop(_permit);
                let delay = backoff.failure(&mut rand::rng()).max(e.retry_after().unwrap_or_default());
                tokio::time::sleep(delay).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_adds_up_to_the_budget() {
        for budget in 1..300 {
            let s = Split::of(budget);
            assert_eq!(s.slots + s.feeds + s.reads, budget, "{budget}: {s:?}");
            assert!(s.reads >= 1);
        }
        assert_eq!(Split::of(100), Split { slots: 88, feeds: 2, reads: 10 });
        assert_eq!(Split::of(1), Split { slots: 0, feeds: 0, reads: 1 });
    }
}
