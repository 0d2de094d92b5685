//! The connection budget of one Consul server (its resolved socket addresses, however the
//! resolvers spell them), the clients that talk to it, and the change feeds of the watches
//! the budget cannot give a blocking query of their own (see docs/consul.md).
//!
//! Every request holds a permit for its whole life, and the permits of one server add up to
//! `--consul-max-connections`, so no more requests are in flight than the budget allows
//! (open connections follow: reqwest reuses an idle connection before opening one). The
//! permits are split three ways:
//! - `slots`: dedicated blocking queries, one per watch while they last;
//! - `feeds`: the change feeds' blocking queries (two per feed; a feed takes a free slot
//!   when these are used up);
//! - `reads`: short non-blocking reads (first answers, and re-reads of fed watches).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::Instant;

use crate::client::{HttpClient, Scope};
use crate::feed::{Feed, FeedKey};
use crate::metrics::Metrics;
use consul_resolver_core::keys::{ConsulKey, TlsSettings};
use consul_resolver_core::model::Endpoint;

/// How the budget is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Split {
    pub slots: usize,
    pub feeds: usize,
    pub reads: usize,
}

impl Split {
    /// A tenth (at least one) for reads, then two for feeds (one feed's two queries) as far
    /// as the budget goes, the rest for dedicated blocking queries. A watch without a slot
    /// is as prompt as one with a slot while its feed runs, so the feed comes first.
    pub(crate) fn of(budget: usize) -> Split {
        let budget = budget.max(1);
        let reads = (budget / 10).max(1);
        let rest = budget.saturating_sub(reads);
        let feeds = rest.min(2);
        Split { slots: rest - feeds, feeds, reads }
    }
}

/// Clients are shared by the watches with one address spelling and TLS settings, and
/// dropped (closing their connections) when the last of them ends.
type ClientKey = (String, Option<TlsSettings>);

pub(crate) struct Pool {
    pub wait: Duration,
    max_connections: usize,
    max_body: usize,
    pub slots: Arc<Semaphore>,
    pub reads: Arc<Semaphore>,
    feed_permits: Arc<Semaphore>,
    clients: Mutex<HashMap<ClientKey, Weak<HttpClient>>>,
    feeds: Mutex<HashMap<FeedKey, Arc<Feed>>>,
    /// Where the requests of this server's watches and feeds are counted.
    pub metrics: Metrics,
}

impl Pool {
    pub(crate) fn new(max_connections: usize, wait: Duration, max_body: usize, metrics: Metrics) -> Arc<Pool> {
        let split = Split::of(max_connections);
        Arc::new(Pool {
            wait,
            max_connections,
            max_body,
            slots: Arc::new(Semaphore::new(split.slots)),
            reads: Arc::new(Semaphore::new(split.reads)),
            feed_permits: Arc::new(Semaphore::new(split.feeds)),
            clients: Mutex::new(HashMap::new()),
            feeds: Mutex::new(HashMap::new()),
            metrics,
        })
    }

    /// The client for this address spelling and TLS settings, shared while anyone holds it.
    pub(crate) fn client(&self, address: &str, tls: Option<&TlsSettings>) -> Result<Arc<HttpClient>, String> {
        let mut clients = self.clients.lock().expect("client map poisoned");
        let key = (address.to_owned(), tls.cloned());
        if let Some(c) = clients.get(&key).and_then(Weak::upgrade) {
            return Ok(c);
        }
        clients.retain(|_, c| c.strong_count() > 0);
        let c = Arc::new(HttpClient::new(address, tls, self.max_connections, self.max_body, self.slots.clone())?);
        clients.insert(key, Arc::downgrade(&c));
        Ok(c)
    }

    /// Clients alive (for tests of eviction).
    #[cfg(test)]
    pub(crate) fn live_clients(&self) -> usize {
        self.clients.lock().expect("client map poisoned").values().filter(|c| c.strong_count() > 0).count()
    }

    /// A permit for one feed query for the feed's life: one of the feeds' own, or else the
    /// first slot to come free.
    pub(crate) async fn feed_permit(&self) -> Option<OwnedSemaphorePermit> {
        if let Ok(p) = self.feed_permits.clone().try_acquire_owned() {
            return Some(p);
        }
        tokio::select! {
            p = self.feed_permits.clone().acquire_owned() => p.ok(),
            p = self.slots.clone().acquire_owned() => p.ok(),
        }
    }

    /// Joins (starting if needed) the change feed of `key`'s scope; `first_read` is when the
    /// watch's first read was sent.
    pub(crate) fn join_feed(
        self: &Arc<Self>,
        key: &ConsulKey,
        client: &Arc<HttpClient>,
        first_read: Instant,
    ) -> FeedMembership {
        let fk: FeedKey = (Scope::of(key), key.server.clone());
        let mut feeds = self.feeds.lock().expect("feed map poisoned");
        let feed =
            feeds.entry(fk.clone()).or_insert_with(|| Arc::new(Feed::start(self.clone(), fk.clone(), client.clone())));
        let (id, changes) = feed.join(&key.service, first_read);
        FeedMembership { pool: self.clone(), key: fk, feed: feed.clone(), id, changes }
    }

    fn leave_feed(&self, key: &FeedKey, id: u64) {
        let mut feeds = self.feeds.lock().expect("feed map poisoned");
        if let Some(f) = feeds.get(key) {
            f.leave(id);
            if f.is_empty() {
                // The last member's handle drops the feed, aborting its queries.
                feeds.remove(key);
            }
        }
    }
}

/// A fed watch's subscription; leaving is dropping it (the last member stops the feed).
pub(crate) struct FeedMembership {
    pool: Arc<Pool>,
    key: FeedKey,
    feed: Arc<Feed>,
    id: u64,
    /// Changed when the feed says this watch's service may have changed.
    pub changes: watch::Receiver<()>,
}

impl FeedMembership {
    /// Records the member's latest endpoints (their nodes' checks concern it).
    pub(crate) fn saw(&self, endpoints: &[Endpoint]) {
        self.feed.saw(self.id, endpoints);
    }
}

impl Drop for FeedMembership {
    fn drop(&mut self) {
        self.pool.leave_feed(&self.key, self.id);
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
        assert_eq!(Split::of(3), Split { slots: 0, feeds: 2, reads: 1 });
        assert_eq!(Split::of(4), Split { slots: 1, feeds: 2, reads: 1 });
    }

    #[tokio::test]
    async fn clients_are_shared_and_dropped_with_their_last_user() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let pool = Pool::new(10, Duration::from_secs(1), 1 << 20, Metrics::unregistered());
        let a = pool.client("http://127.0.0.1:8500", None).unwrap();
        let b = pool.client("http://127.0.0.1:8500", None).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        let c = pool.client("http://localhost:8500", None).unwrap();
        assert!(!Arc::ptr_eq(&a, &c), "one client per spelling (the Host header and TLS name differ)");
        assert_eq!(pool.live_clients(), 2);
        drop((a, b));
        assert_eq!(pool.live_clients(), 1);
        drop(c);
        assert_eq!(pool.live_clients(), 0);
    }
}
