//! The change feed of one scope (datacenter, namespace, partition, and the server with its
//! token, so ACL filtering is that of the watches it serves): how watches without a
//! blocking query of their own ("fed" watches) learn which of them to re-read.
//!
//! Two blocking queries, each holding one permit of the address's budget for the feed's
//! life: `/v1/health/state/any` (every check write) and `/v1/catalog/services` (every
//! service registration change). Their answers are diffed ([`crate::changes`]) and only the
//! members they name are woken; a catalog move the checks do not account for wakes every
//! member (each re-read still goes through the small read pool, so the burst is spread).
//! Both queries follow the watch rules: paced, backoff with jitter on errors, the index
//! reset after a failure or when it goes backwards.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;

use crate::changes::{CatalogMove, CatalogView, ChecksView, Stale};
use crate::client::{HttpClient, Scope};
use crate::error::QueryError;
use crate::observe;
use crate::pool::Pool;
use crate::timing::{Backoff, IndexState, pace};
use consul_resolver_core::keys::{ConsulKey, ConsulServer};
use consul_resolver_core::model::Endpoint;

/// What identifies one feed.
pub(crate) type FeedKey = (Scope, ConsulServer);

/// How long a catalog move waits for the checks query to catch up with its index before it
/// is judged (a registration writes the catalog and its check at one index, and the two
/// answers race).
const CHECKS_CATCH_UP: Duration = Duration::from_millis(250);

/// A running feed; dropping it stops its queries.
pub(crate) struct Feed {
    shared: Arc<Shared>,
    _task: AbortOnDropHandle<()>,
}

struct Shared {
    members: Mutex<Members>,
    /// The checks view's index, for a catalog move waiting on it.
    checks_index: watch::Sender<u64>,
}

#[derive(Default)]
struct Members {
    next_id: u64,
    all: HashMap<u64, Member>,
    /// When both queries had answered once: the feed's diffs cover everything since.
    baseline_at: Option<Instant>,
    /// When the feed last acted on an answer. A member whose first read was sent after
    /// this (and after the baseline) misses nothing: anything its read did not see comes
    /// in a later answer, acted on once it is a member.
    last_answer: Option<Instant>,
}

struct Member {
    /// Lower case, as Consul compares service names.
    service: String,
    /// Nodes of its last answer: a node check change there wakes it.
    nodes: BTreeSet<String>,
    wake: watch::Sender<()>,
}

impl Members {
    fn join(&mut self, service: &str, first_read: Instant) -> (u64, watch::Receiver<()>) {
        let id = self.next_id;
        self.next_id += 1;
        let (wake, mut rx) = watch::channel(());
        let covered = self.baseline_at.is_some() && self.last_answer.is_none_or(|a| a <= first_read);
        if !covered {
            rx.mark_changed();
        }
        self.all.insert(id, Member { service: service.to_ascii_lowercase(), nodes: BTreeSet::new(), wake });
        (id, rx)
    }

    fn wake(&self, stale: &Stale) {
        for m in self.all.values() {
            if stale.everything
                || stale.services.contains(&m.service)
                || m.nodes.iter().any(|n| stale.nodes.contains(n))
            {
                m.wake.send_replace(());
            }
        }
    }
}

impl Feed {
    pub(crate) fn start(pool: Arc<Pool>, key: FeedKey, client: Arc<HttpClient>) -> Feed {
        let shared = Arc::new(Shared { members: Mutex::default(), checks_index: watch::Sender::new(0) });
        let task = tokio::spawn(run(pool, key, client, shared.clone()));
        Feed { shared, _task: AbortOnDropHandle::new(task) }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.lock().all.is_empty()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Members> {
        self.shared.members.lock().expect("feed members poisoned")
    }

    /// Adds a member watching `service`, whose first read was sent at `first_read`. Its
    /// receiver is already marked changed (re-read at once) unless the feed had its
    /// baseline and acted on no answer since that read was sent, so nothing between the
    /// read and joining is lost.
    pub(crate) fn join(&self, service: &str, first_read: Instant) -> (u64, watch::Receiver<()>) {
        self.lock().join(service, first_read)
    }

    pub(crate) fn leave(&self, id: u64) {
        self.lock().all.remove(&id);
    }

    /// Records the nodes of a member's latest answer.
    pub(crate) fn saw(&self, id: u64, endpoints: &[Endpoint]) {
        if let Some(m) = self.lock().all.get_mut(&id) {
            m.nodes = endpoints.iter().map(|e| e.node.clone()).collect();
        }
    }
}

/// Which of the two queries.
#[derive(Clone, Copy, Debug)]
enum Query {
    Checks,
    Catalog,
}

async fn run(pool: Arc<Pool>, (scope, server): FeedKey, client: Arc<HttpClient>, shared: Arc<Shared>) {
    let checks = Mutex::new(ChecksView::default());
    let baselines = Mutex::new(0u8);
    let ctx = Ctx { pool: &pool, scope: &scope, server: &server, client: &client, shared: &shared, checks: &checks };
    // The checks query takes its permit first: with room for only one query (a budget of
    // two), health changes are what must stay prompt; the catalog's then wait for the sweep.
    let checks_permit = pool.feed_permit().await;
    // `permit`: taken already, or `None` to wait for one.
    let one = |q: Query, permit: Option<Option<tokio::sync::OwnedSemaphorePermit>>| {
        let ctx = &ctx;
        let baselines = &baselines;
        async move {
            let _permit = match permit {
                Some(p) => p,
                None => ctx.pool.feed_permit().await,
            };
            let mut catalog = CatalogView::default();
            let mut state = IndexState::default();
            let mut backoff = Backoff::default();
            let mut last: Option<Instant> = None;
            loop {
                if let Some(at) = last {
                    let gap = pace(Duration::from_millis(100), &mut rand::rng());
                    tokio::time::sleep_until(at + gap).await;
                }
                last = Some(Instant::now());
                let block = state.block(ctx.pool.wait);
                let answered = match q {
                    Query::Checks => ctx.checks(block).await,
                    Query::Catalog => ctx.catalog(block, &mut catalog).await,
                };
                match answered {
                    Ok((index, first)) => {
                        backoff.reset();
                        state.observe(block.map(|b| b.0), index);
                        if first {
                            let mut b = baselines.lock().expect("baselines poisoned");
                            *b += 1;
                            if *b == 2 {
                                // Both views have a baseline: everyone who joined before
                                // re-reads once, and later joiners need not.
                                let mut members = ctx.shared.members.lock().expect("feed members poisoned");
                                let now = Instant::now();
                                members.baseline_at = Some(now);
                                members.last_answer = Some(now);
                                members.wake(&Stale::everything());
                            }
                        }
                    }
                    Err(e) => {
                        // The server may come back as another cluster with a lower index:
                        // never block on the old one (docs/consul-protocol.md).
                        state.reset();
                        let step = backoff.failure(&mut rand::rng());
                        let delay = step.max(e.retry_after().unwrap_or_default());
                        tracing::warn!(consul = %ctx.client.address(), feed = ?q, error = %e, retry_in = ?delay,
                            "change feed query failed; services without their own blocking query are re-read when it recovers");
                        tokio::time::sleep(delay).await;
                    }
                }
            }
        }
    };
    tokio::join!(one(Query::Checks, Some(checks_permit)), one(Query::Catalog, None));
}

struct Ctx<'a> {
    pool: &'a Pool,
    scope: &'a Scope,
    server: &'a ConsulServer,
    client: &'a HttpClient,
    shared: &'a Shared,
    checks: &'a Mutex<ChecksView>,
}

impl Ctx<'_> {
    /// A key of the feed's scope, for the metrics (which count requests per scope).
    fn key(&self) -> ConsulKey {
        ConsulKey {
            server: self.server.clone(),
            datacenter: self.scope.datacenter.clone(),
            namespace: self.scope.namespace.clone(),
            partition: self.scope.partition.clone(),
            query: Default::default(),
            service: String::new(),
        }
    }

    /// Acts on an answer: wakes what it names (possibly nothing), and records when.
    fn wake(&self, stale: &Stale) {
        let mut members = self.shared.members.lock().expect("feed members poisoned");
        members.last_answer = Some(Instant::now());
        if !stale.is_empty() {
            members.wake(stale);
        }
    }

    /// One checks answer: wakes what it names. Returns the index, and whether it was the
    /// view's first answer.
    async fn checks(&self, block: Option<(u64, Duration)>) -> Result<(u64, bool), QueryError> {
        let health_state = self.client.health_state(self.scope, self.server.token.as_ref(), block);
        let answer =
            observe::request(&self.pool.metrics, observe::Query::Checks, &self.key(), block, health_state).await?;
        let (stale, first) = {
            let mut view = self.checks.lock().expect("checks view poisoned");
            let first = view.index().is_none();
            (view.apply(answer.index, answer.value), first)
        };
        self.shared.checks_index.send_replace(answer.index);
        // A baseline names nothing: the members re-read once both views have one.
        self.wake(&if first { Stale::default() } else { stale });
        Ok((answer.index, first))
    }

    /// One catalog answer: wakes the services its body names, and everyone when the move is
    /// not accounted for by check writes.
    async fn catalog(&self, block: Option<(u64, Duration)>, view: &mut CatalogView) -> Result<(u64, bool), QueryError> {
        let catalog = self.client.catalog_services(self.scope, self.server.token.as_ref(), block);
        let answer = observe::request(&self.pool.metrics, observe::Query::Catalog, &self.key(), block, catalog).await?;
        let index = answer.index;
        match view.apply(index, answer.value) {
            CatalogMove::Baseline => {
                self.wake(&Stale::default());
                return Ok((index, true));
            }
            CatalogMove::Unchanged => self.wake(&Stale::default()),
            CatalogMove::Restarted => self.wake(&Stale::everything()),
            CatalogMove::Moved { named, after, upto } => {
                self.wake(&Stale { services: named, ..Stale::default() });
                let mut caught_up = self.shared.checks_index.subscribe();
                let _ = tokio::time::timeout(CHECKS_CATCH_UP, caught_up.wait_for(|i| *i >= upto)).await;
                let accounted = self.checks.lock().expect("checks view poisoned").accounts_for(after, upto);
                if !accounted {
                    tracing::debug!(consul = %self.client.address(), after, upto,
                        "catalog moved without check writes to account for it: re-reading every fed service");
                    self.wake(&Stale::everything());
                }
            }
        }
        Ok((index, false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_joiner_rereads_unless_the_feed_saw_nothing_after_its_read() {
        let mut m = Members::default();
        let t0 = Instant::now();
        let (_, mut before_baseline) = m.join("web", t0);
        assert!(before_baseline.has_changed().unwrap(), "no baseline yet: re-read");

        tokio::time::advance(Duration::from_millis(10)).await;
        let now = Instant::now();
        (m.baseline_at, m.last_answer) = (Some(now), Some(now));
        tokio::time::advance(Duration::from_millis(10)).await;
        let read = Instant::now();
        let (_, mut covered) = m.join("api", read);
        assert!(!covered.has_changed().unwrap(), "read after the baseline and the last answer");

        // An answer acted on between a read and the join: that read may have missed it.
        let read = Instant::now();
        tokio::time::advance(Duration::from_millis(10)).await;
        m.last_answer = Some(Instant::now());
        let (_, raced) = m.join("db", read);
        assert!(raced.has_changed().unwrap(), "an answer came between its read and its join");

        // Waking by service (case-insensitive names are stored lower case) and by node.
        covered.mark_unchanged();
        let api = m.all.values_mut().find(|x| x.service == "api").unwrap();
        api.nodes = BTreeSet::from(["n1".to_owned()]);
        m.wake(&Stale { nodes: BTreeSet::from(["n1".to_owned()]), ..Stale::default() });
        assert!(covered.has_changed().unwrap());
        before_baseline.mark_unchanged();
        m.wake(&Stale { services: BTreeSet::from(["web".to_owned()]), ..Stale::default() });
        assert!(before_baseline.has_changed().unwrap());
    }
}
