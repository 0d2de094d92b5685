//! The change feed of one scope (datacenter, namespace, partition, and the server with its
//! token, so ACL filtering is that of the watches it serves): how watches without a
//! blocking query of their own ("fed" watches) learn which of them to re-read.
//!
//! Two blocking queries, each holding one permit of the address's budget for the feed's
//! life: `/v1/health/state/any` (every check write) and `/v1/catalog/services` (every
//! service registration change). Their answers are diffed ([`super::changes`]) and only the
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

use super::changes::{CatalogMove, CatalogView, ChecksView, Stale};
use super::client::{HttpClient, QueryError, Scope};
use super::pool::Pool;
use super::timing::{Backoff, IndexState, pace};
use consul_resolver_core::keys::ConsulServer;
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
    /// When both queries had answered once: a member whose first read started after this
    /// misses nothing, the feed's diffs cover everything since.
    baseline_at: Option<Instant>,
}

struct Member {
    /// Lower case, as Consul compares service names.
    service: String,
    /// Nodes of its last answer: a node check change there wakes it.
    nodes: BTreeSet<String>,
    wake: watch::Sender<()>,
}

impl Members {
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
    /// receiver is already marked changed (re-read at once) unless the feed's baseline
    /// predates that read, so nothing between the read and joining is lost.
    pub(crate) fn join(&self, service: &str, first_read: Instant) -> (u64, watch::Receiver<()>) {
        let mut members = self.lock();
        let id = members.next_id;
        members.next_id += 1;
        let (wake, mut rx) = watch::channel(());
        if members.baseline_at.is_none_or(|b| b > first_read) {
            rx.mark_changed();
        }
        members.all.insert(id, Member { service: service.to_ascii_lowercase(), nodes: BTreeSet::new(), wake });
        (id, rx)
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
                                members.baseline_at = Some(Instant::now());
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
    fn wake(&self, stale: &Stale) {
        if !stale.is_empty() {
            self.shared.members.lock().expect("feed members poisoned").wake(stale);
        }
    }

    /// One checks answer: wakes what it names. Returns the index, and whether it was the
    /// view's first answer.
    async fn checks(&self, block: Option<(u64, Duration)>) -> Result<(u64, bool), QueryError> {
        let answer = self.client.health_state(self.scope, self.server.token.as_ref(), block).await?;
        let (stale, first) = {
            let mut view = self.checks.lock().expect("checks view poisoned");
            let first = view.index().is_none();
            (view.apply(answer.index, answer.value), first)
        };
        self.shared.checks_index.send_replace(answer.index);
        if !first {
            self.wake(&stale);
        }
        Ok((answer.index, first))
    }

    /// One catalog answer: wakes the services its body names, and everyone when the move is
    /// not accounted for by check writes.
    async fn catalog(&self, block: Option<(u64, Duration)>, view: &mut CatalogView) -> Result<(u64, bool), QueryError> {
        let answer = self.client.catalog_services(self.scope, self.server.token.as_ref(), block).await?;
        let index = answer.index;
        match view.apply(index, answer.value) {
            CatalogMove::Baseline => return Ok((index, true)),
            CatalogMove::Unchanged => {}
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
