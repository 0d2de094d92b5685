//! The change feed of one group of watches: how watches without a blocking query of their
//! own ("fed" watches) learn which of them to re-read (docs/consul.md, "Services without a
//! blocking query of their own").
//!
//! A group is what one answer of the feed's queries is the same for: datacenter, namespace,
//! partition, token (ACLs filter what a token sees) and, over TLS, the address and TLS
//! settings (what a connection trusts). Plain-HTTP spellings of one server share a feed.
//!
//! Two blocking queries, each holding one lane of the server's budget for the feed's life:
//! `/v1/health/state/any` (every check write) and `/v1/catalog/services` (every service
//! registration change); and while the group is large and the plan gives it two lanes more,
//! `/v1/health/state/critical` and `/v1/health/state/warning` (a check into or out of either
//! status, answered in a moment where every check's answer takes a real agent a second at
//! 150,000 checks; what several checks queries show wakes its members once:
//! [`crate::woken`]). Their
//! answers are diffed ([`crate::changes`]) and only the members they name are woken: those
//! whose service names, or nodes, the diff names (what the member asked about, not what its
//! last answer kept: see [`Heard`]); a Connect member also when a new name appears (a
//! proxy's name is any), a member with a `filter` on any node check. A catalog move the
//! checks do not account for is located ([`crate::locate`]): the nodes and instances it
//! wrote are woken, or, when that cannot explain every index of the move, every member
//! (each re-read still goes through the small read pool, so the burst is spread). All the
//! queries follow the watch rules: paced, backoff with jitter on errors, the
//! index reset after a failure or when it goes backwards; while the server is down they
//! wait for it ([`crate::reach`]).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, Semaphore, watch};
use tokio::time::Instant;

use crate::catch_up::CatchUp;
use crate::changes::{CatalogMove, CatalogView, ChecksView, Stale, checked_index_by_index};
use crate::client::{CheckState, Heard, HttpClient, Scope};
use crate::error::QueryError;
use crate::locate::{self, Located, Locator};
use crate::metrics::{Metrics, contact_scope};
use crate::observe;
use crate::reach::{Reach, Reachability};
use crate::reads::ReadPool;
use crate::timing::{Backoff, IndexState, pace};
use crate::woken::Woken;
use consul_resolver_core::keys::{ConsulKey, QueryOptions, Secret, TlsSettings};

/// What identifies one feed: see the module's doc.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct FeedKey {
    scope: Scope,
    token: Option<Secret>,
    /// `https://` only: the address as spelled (the name TLS verifies) and the settings.
    tls: Option<(String, Option<TlsSettings>)>,
}

impl FeedKey {
    /// The feed that can serve `key`'s watch; `None` when no feed can: the instances of a
    /// peer or a sameness group come from another cluster, whose checks and catalog the
    /// local feed does not see.
    pub(crate) fn of(key: &ConsulKey) -> Option<FeedKey> {
        if key.scope.remote.is_some() {
            return None;
        }
        let server = &key.scope.server;
        let tls = server.address.starts_with("https://").then(|| (server.address.clone(), server.tls.clone()));
        Some(FeedKey { scope: Scope::of(key), token: server.token.clone(), tls })
    }
}

/// What a feed runs on: its server's lanes, reachability and metrics.
#[derive(Clone)]
pub(crate) struct FeedEnv {
    pub lanes: Arc<Semaphore>,
    /// The server's read pool, which the locate step's reads share with fed re-reads.
    pub reads: ReadPool,
    pub reach: Arc<Reachability>,
    pub metrics: Metrics,
    pub wait: Duration,
    /// How many checks of the group start its critical and warning checks' queries (and half
    /// of it stops them): `Settings::status_queries_from_checks`.
    pub statuses_from: usize,
    /// Tells the server to plan again: the feed asks for its status lanes, or gives them up.
    pub replan: Arc<Notify>,
}

/// The members of a feed, shared by its queries and by the memberships. The queries run in
/// [`Feed::run`], a task the server owns: dropping the task stops them, whoever still holds
/// the feed.
pub(crate) struct Feed {
    members: Mutex<Members>,
    /// The checks view's index, for a catalog move waiting on it.
    checks_index: watch::Sender<u64>,
    /// Whether the critical and warning checks' queries run.
    status_lanes: watch::Sender<StatusLanes>,
    /// How long a catalog move waits for the checks view ([`crate::catch_up`]).
    catch_up: Mutex<CatchUp>,
    /// What the locate step learnt of this feed's token and catalog ([`crate::locate`]).
    locator: Mutex<Locator>,
}

/// The critical and warning checks' queries run while the feed asks for their lanes (its
/// group is large: the queries are worth their requests) and the server's plan gives them.
#[derive(Debug, Clone, Copy, Default)]
struct StatusLanes {
    asked: bool,
    given: bool,
}

impl StatusLanes {
    fn runs(&self) -> bool {
        self.asked && self.given
    }
}

#[derive(Default)]
struct Members {
    next_id: u64,
    all: HashMap<u64, Member>,
    /// The members that asked about each service name (see [`Heard`]): a change to a few
    /// services wakes theirs without a look at every member, which at 10,000 fed services
    /// was 4 % of the operator's CPU per change (docs/benchmarks.md).
    by_name: HashMap<String, Vec<u64>>,
    /// When both queries had answered once: the feed's diffs cover everything since.
    baseline_at: Option<Instant>,
    /// When the feed last acted on an answer. A member whose last read was sent after
    /// this (and after the baseline) misses nothing: anything its read did not see comes
    /// in a later answer, acted on once it is a member.
    last_answer: Option<Instant>,
}

struct Member {
    /// What its watch's latest answer asked about: the watch's own copy, shared.
    heard: Arc<Heard>,
    /// A Connect watch: its proxies may carry any name.
    connect: bool,
    /// A watch with a `filter`: Consul left out instances we never saw, and their nodes
    /// with them (a filter may select on checks), so any node check may concern it.
    filtered: bool,
    wake: watch::Sender<()>,
}

impl Members {
    fn join(&mut self, heard: Arc<Heard>, query: &QueryOptions, last_read: Instant) -> (u64, watch::Receiver<()>) {
        let id = self.next_id;
        self.next_id += 1;
        let (wake, mut rx) = watch::channel(());
        let covered =
            self.baseline_at.is_some_and(|b| b <= last_read) && self.last_answer.is_none_or(|a| a <= last_read);
        if !covered {
            rx.mark_changed();
        }
        self.index(id, &heard.names);
        self.all.insert(id, Member { heard, connect: query.connect, filtered: query.filter.is_some(), wake });
        (id, rx)
    }

    /// Records what member `id`'s latest answer asked about.
    fn saw(&mut self, id: u64, heard: &Arc<Heard>) {
        let Some(m) = self.all.get_mut(&id) else { return };
        if Arc::ptr_eq(&m.heard, heard) || m.heard == *heard {
            return;
        }
        let old = std::mem::replace(&mut m.heard, heard.clone());
        if old.names != heard.names {
            self.unindex(id, &old.names);
            self.index(id, &heard.names);
        }
    }

    fn leave(&mut self, id: u64) {
        if let Some(m) = self.all.remove(&id) {
            self.unindex(id, &m.heard.names);
        }
    }

    fn index(&mut self, id: u64, names: &BTreeSet<String>) {
        for name in names {
            self.by_name.entry(name.clone()).or_default().push(id);
        }
    }

    fn unindex(&mut self, id: u64, names: &BTreeSet<String>) {
        for name in names {
            if let Some(ids) = self.by_name.get_mut(name) {
                ids.retain(|&i| i != id);
                if ids.is_empty() {
                    self.by_name.remove(name);
                }
            }
        }
    }

    fn wake(&self, stale: &Stale) {
        if !stale.everything && stale.nodes.is_empty() && stale.appeared.is_empty() {
            // Services alone (a health or port change): their members, by name.
            let named = stale.services.iter().filter_map(|n| self.by_name.get(n)).flatten();
            for m in named.filter_map(|id| self.all.get(id)) {
                m.wake.send_replace(());
            }
            return;
        }
        for m in self.all.values() {
            if stale.everything
                || m.heard.names.iter().any(|n| stale.services.contains(n))
                || m.heard.nodes.iter().any(|n| stale.nodes.contains(n))
                || (m.connect && !stale.appeared.is_empty())
                || (m.filtered && !stale.nodes.is_empty())
            {
                m.wake.send_replace(());
            }
        }
    }
}

/// A fed watch's subscription; leaving is dropping it.
pub(crate) struct Membership {
    feed: Arc<Feed>,
    id: u64,
    /// Changed when the feed says this watch's service may have changed.
    pub changes: watch::Receiver<()>,
}

impl Membership {
    /// Records what the member's latest answer asked about.
    pub(crate) fn saw(&self, heard: &Arc<Heard>) {
        self.feed.lock().saw(self.id, heard);
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.feed.lock().leave(self.id);
    }
}

impl Feed {
    pub(crate) fn new() -> Arc<Feed> {
        Arc::new(Feed {
            members: Mutex::default(),
            checks_index: watch::Sender::new(0),
            status_lanes: watch::Sender::new(StatusLanes::default()),
            catch_up: Mutex::default(),
            locator: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Members> {
        self.members.lock().expect("feed members poisoned")
    }

    fn catch_up(&self) -> std::sync::MutexGuard<'_, CatchUp> {
        self.catch_up.lock().expect("feed catch-up poisoned")
    }

    fn locator(&self) -> std::sync::MutexGuard<'_, Locator> {
        self.locator.lock().expect("feed locator poisoned")
    }

    /// Adds a member that asked about `heard` in a read sent at `last_read`. Its receiver
    /// is already marked changed (re-read at once) unless the feed had its baseline and
    /// acted on no answer since that read was sent, so nothing between the read and
    /// joining is lost.
    pub(crate) fn join(self: &Arc<Self>, heard: Arc<Heard>, query: &QueryOptions, last_read: Instant) -> Membership {
        let (id, changes) = self.lock().join(heard, query, last_read);
        Membership { feed: self.clone(), id, changes }
    }

    /// Whether the feed asks for lanes for its critical and warning checks' queries.
    pub(crate) fn asks_for_status_lanes(&self) -> bool {
        self.status_lanes.borrow().asked
    }

    /// The plan gives the feed the lanes of its critical and warning checks' queries, or
    /// takes them back.
    pub(crate) fn give_status_lanes(&self, given: bool) {
        self.status_lanes.send_if_modified(|l| std::mem::replace(&mut l.given, given) != given);
    }

    /// The group holds `checks`: the feed asks for its status lanes from `from` checks
    /// until fewer than half of that. True when that changed (the server plans again).
    fn held_checks(&self, checks: usize, from: usize) -> bool {
        self.status_lanes.send_if_modified(|l| {
            let asked = checks >= if l.asked { from / 2 } else { from };
            std::mem::replace(&mut l.asked, asked) != asked
        })
    }
}

/// Which of the feed's queries.
#[derive(Clone, Copy, Debug)]
enum Query {
    Checks,
    Catalog,
    Status(Status),
}

/// The statuses whose checks a large group's feed also queries on their own.
#[derive(Clone, Copy, Debug)]
enum Status {
    Critical,
    Warning,
}

impl Status {
    const ALL: [Status; 2] = [Status::Critical, Status::Warning];

    fn state(self) -> CheckState {
        match self {
            Status::Critical => CheckState::Critical,
            Status::Warning => CheckState::Warning,
        }
    }

    fn observed(self) -> observe::Query {
        match self {
            Status::Critical => observe::Query::Critical,
            Status::Warning => observe::Query::Warning,
        }
    }
}

impl Feed {
    /// The feed's queries, run until the task is dropped. `scope_key` is a key of the
    /// group, for the metrics (which count requests per scope).
    pub(crate) async fn run(self: Arc<Self>, client: Arc<HttpClient>, scope_key: ConsulKey, env: FeedEnv) {
        let checks = Mutex::new(ChecksView::default());
        let critical = Mutex::new(ChecksView::default());
        let warning = Mutex::new(ChecksView::default());
        let woken = Mutex::new(Woken::default());
        let baselines = Mutex::new(0u8);
        let ctx = Ctx {
            feed: &self,
            client: &client,
            scope: Scope::of(&scope_key),
            key: contact_scope(&scope_key),
            env: &env,
            checks: &checks,
            critical: &critical,
            warning: &warning,
            woken: &woken,
        };
        tokio::join!(
            ctx.query(Query::Checks, &baselines),
            ctx.query(Query::Catalog, &baselines),
            ctx.status_lanes(&baselines)
        );
    }
}

struct Ctx<'a> {
    feed: &'a Feed,
    client: &'a Arc<HttpClient>,
    scope: Scope,
    /// The group's contact scope (server, token, TLS, dc, ns, partition).
    key: ConsulKey,
    env: &'a FeedEnv,
    /// Every check of the group.
    checks: &'a Mutex<ChecksView>,
    /// The group's critical checks.
    critical: &'a Mutex<ChecksView>,
    /// The group's warning checks.
    warning: &'a Mutex<ChecksView>,
    /// What the checks views woke members for.
    woken: &'a Mutex<Woken>,
}

impl Ctx<'_> {
    /// The critical and warning checks' queries, while the group holds at least
    /// `statuses_from` checks and until it holds fewer than half of that, and while the plan
    /// gives them their lanes. Below, every check's answer is quick (about 10 ms from a real
    /// agent at 1,000 checks), and a flip costs the group one request less without them.
    /// While they do not run they hold no lane, and their next answers are baselines again.
    async fn status_lanes(&self, baselines: &Mutex<u8>) {
        let mut lanes = self.feed.status_lanes.subscribe();
        loop {
            if lanes.wait_for(StatusLanes::runs).await.is_err() {
                return;
            }
            tokio::select! {
                _ = async {
                    tokio::join!(
                        self.query(Query::Status(Status::Critical), baselines),
                        self.query(Query::Status(Status::Warning), baselines)
                    )
                } => return,
                _ = lanes.wait_for(|l| !l.runs()) => {
                    for status in Status::ALL {
                        *self.status_view(status).lock().expect("status checks view poisoned") = ChecksView::default();
                    }
                    self.woken().statuses_stopped();
                }
            }
        }
    }

    /// The view of one status's checks.
    fn status_view(&self, status: Status) -> &Mutex<ChecksView> {
        match status {
            Status::Critical => self.critical,
            Status::Warning => self.warning,
        }
    }

    /// One of the feed's queries, for as long as it runs: a lane held throughout, paced,
    /// backing off on errors, waiting while the server is down.
    async fn query(&self, q: Query, baselines: &Mutex<u8>) {
        let Ok(_lane) = self.env.lanes.acquire().await else { return };
        let mut reach = self.env.reach.subscribe();
        let mut catalog = CatalogView::default();
        let mut state = IndexState::default();
        let mut backoff = Backoff::default();
        let mut last: Option<Instant> = None;
        loop {
            if !matches!(*reach.borrow_and_update(), Reach::Up) {
                // The index is forgotten (the server may come back as another cluster) and
                // the next answer is diffed against the last one seen.
                state.reset();
                backoff.reset();
                if reach.wait_for(|r| matches!(r, Reach::Up)).await.is_err() {
                    return;
                }
            }
            if let Some(at) = last {
                // Answers without an index cannot be blocked on: the feed then asks once a
                // `wait`, as a blocking query that never returned early would.
                let gap = if state.cannot_block() {
                    self.env.wait
                } else {
                    pace(Duration::from_millis(100), &mut rand::rng())
                };
                tokio::time::sleep_until(at + gap).await;
            }
            last = Some(Instant::now());
            let block = state.block(self.env.wait);
            let answered = tokio::select! {
                a = async {
                    match q {
                        Query::Checks => self.checks(block).await,
                        Query::Catalog => self.catalog(block, &mut catalog).await,
                        Query::Status(status) => self.status(status, block).await,
                    }
                } => a,
                // The server went down: the query in flight is dropped.
                _ = reach.wait_for(|r| !matches!(r, Reach::Up)) => continue,
            };
            match answered {
                Ok((index, first)) => {
                    backoff.reset();
                    let could_block = !state.cannot_block();
                    state.observe(block.map(|b| b.0), index);
                    if could_block && state.cannot_block() {
                        tracing::warn!(consul = %self.client.address(), feed = ?q,
                            "Consul's answers carry no X-Consul-Index (a proxy in between strips it?): the change feed cannot block and asks once a --consul-wait; fed services follow changes only that often");
                    }
                    if first {
                        let mut b = baselines.lock().expect("baselines poisoned");
                        *b += 1;
                        if *b == 2 {
                            // Both views (every check's and the catalog's) have a baseline:
                            // everyone who joined before re-reads once, and later joiners
                            // need not.
                            let mut members = self.feed.lock();
                            let now = Instant::now();
                            members.baseline_at = Some(now);
                            members.last_answer = Some(now);
                            members.wake(&Stale::everything());
                        }
                    }
                }
                Err(e) => {
                    // Never block on the old index after a failure (docs/consul-protocol.md).
                    state.reset();
                    self.env.reach.suspect(self.client, &e);
                    let delay = backoff.failure(&mut rand::rng()).max(e.retry_after().unwrap_or_default());
                    tracing::warn!(consul = %self.client.address(), feed = ?q, error = %e, retry_in = ?delay,
                        "change feed query failed; services without their own blocking query are re-read when it recovers");
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        _ = reach.wait_for(|r| !matches!(r, Reach::Up)) => {}
                    }
                }
            }
        }
    }

    /// Acts on an answer: wakes what it names (possibly nothing), and records when.
    fn wake(&self, stale: &Stale) {
        let mut members = self.feed.lock();
        members.last_answer = Some(Instant::now());
        if !stale.is_empty() {
            members.wake(stale);
        }
    }

    /// One checks answer: wakes what it names. Returns the index (`None`: the answer had
    /// none), and whether it was the view's first answer.
    async fn checks(&self, block: Option<(u64, Duration)>) -> Result<(Option<u64>, bool), QueryError> {
        let token = self.key.scope.server.token.as_ref();
        let sent = Instant::now();
        let health_state = || {
            self.client.health_state(CheckState::Any, &self.scope, token, block, |index, body| {
                let mut view = self.checks.lock().expect("checks view poisoned");
                let (stale, first) = self.apply_checks(CheckState::Any, &mut view, index, body)?;
                if self.feed.held_checks(view.len(), self.env.statuses_from) {
                    self.env.replan.notify_one();
                }
                self.feed.catch_up().checks_answered(Instant::now(), |after, upto| view.accounts_for(after, upto));
                Ok((stale, first))
            })
        };
        let answer =
            observe::request(&self.env.metrics, observe::Query::Checks, Some(&self.key), block, health_state).await?;
        if block.is_none() {
            // The answer's cost alone, no waiting in it: how far behind the catalog's
            // answers this query's can run.
            self.feed.catch_up().observe(sent.elapsed());
        }
        let index = indexed(&self.env.metrics, observe::Query::Checks, &answer);
        let (stale, first) = answer.value;
        self.feed.checks_index.send_replace(answer.index);
        // A baseline names nothing: the members re-read once both views have one.
        self.wake(&if first { Stale::default() } else { stale });
        Ok((index, first))
    }

    /// One answer of the checks in `status`: wakes the members of checks that moved into or
    /// out of it or were written in it, without waiting for every check's answer, which
    /// takes a real agent a second at 150,000 checks. Never a baseline of the feed's: every
    /// check's answer shows the same writes.
    async fn status(&self, status: Status, block: Option<(u64, Duration)>) -> Result<(Option<u64>, bool), QueryError> {
        let token = self.key.scope.server.token.as_ref();
        let health_state = || {
            self.client.health_state(status.state(), &self.scope, token, block, |index, body| {
                let mut view = self.status_view(status).lock().expect("status checks view poisoned");
                let (stale, first) = self.apply_checks(status.state(), &mut view, index, body)?;
                Ok(if first { Stale::default() } else { stale })
            })
        };
        let answer =
            observe::request(&self.env.metrics, status.observed(), Some(&self.key), block, health_state).await?;
        let index = indexed(&self.env.metrics, status.observed(), &answer);
        self.wake(&answer.value);
        Ok((index, false))
    }

    /// Applies an answer of `state`'s checks to `view`: what it names that no answer woke
    /// members for already, and whether it was the view's first.
    fn apply_checks(
        &self,
        state: CheckState,
        view: &mut ChecksView,
        index: u64,
        body: &mut dyn std::io::Read,
    ) -> Result<(Stale, bool), String> {
        let first = view.index().is_none();
        let written = view.apply(index, body)?;
        Ok((self.woken().name(state, written, index), first))
    }

    fn woken(&self) -> std::sync::MutexGuard<'_, Woken> {
        self.woken.lock().expect("woken checks poisoned")
    }

    /// One catalog answer: wakes the services its body names, and everyone when the move is
    /// not accounted for by check writes.
    async fn catalog(
        &self,
        block: Option<(u64, Duration)>,
        view: &mut CatalogView,
    ) -> Result<(Option<u64>, bool), QueryError> {
        let token = self.key.scope.server.token.as_ref();
        let catalog =
            move || self.client.catalog_services(&self.scope, token, block, move |index, body| view.apply(index, body));
        let answer =
            observe::request(&self.env.metrics, observe::Query::Catalog, Some(&self.key), block, catalog).await?;
        let index = indexed(&self.env.metrics, observe::Query::Catalog, &answer);
        match answer.value {
            CatalogMove::Baseline => {
                self.wake(&Stale::default());
                return Ok((index, true));
            }
            CatalogMove::Unchanged => self.wake(&Stale::default()),
            CatalogMove::Restarted => self.wake(&Stale::everything()),
            CatalogMove::Moved { named, appeared, after, upto } => {
                self.wake(&Stale { services: named, appeared, ..Stale::default() });
                let (judged, wait) = (Instant::now(), self.feed.catch_up().wait());
                let mut caught_up = self.feed.checks_index.subscribe();
                let _ = tokio::time::timeout(wait, caught_up.wait_for(|i| *i >= upto)).await;
                let accounted = self.checks.lock().expect("checks view poisoned").accounts_for(after, upto);
                if accounted {
                    self.feed.catch_up().observe(judged.elapsed());
                } else {
                    self.feed.catch_up().judged_early(after, upto, judged);
                    self.unaccounted(after, upto, wait).await;
                }
            }
        }
        Ok((index, false))
    }
}

impl Ctx<'_> {
    /// A catalog move over `(after, upto]` the checks did not account for within `waited`:
    /// wakes what locating it names, or everyone.
    async fn unaccounted(&self, after: u64, upto: u64, waited: Duration) {
        let located = tokio::time::timeout(locate::LOCATE_WITHIN, self.locate(after, upto)).await.ok().flatten();
        match located {
            Some(stale) => {
                tracing::debug!(consul = %self.client.address(), after, upto, services = ?stale.services, nodes = ?stale.nodes,
                    "catalog moved without check writes; located what it wrote: re-reading those");
                self.wake(&stale);
            }
            None => {
                tracing::debug!(consul = %self.client.address(), after, upto, waited = ?waited,
                    "catalog moved without check writes to account for it: re-reading every fed service");
                self.wake(&Stale::everything());
            }
        }
    }

    /// What a move over `(after, upto]` wrote, when every index of it is explained
    /// ([`crate::locate`]); `None` when it is not, or locating is not worth it.
    async fn locate(&self, after: u64, upto: u64) -> Option<Stale> {
        let members = self.feed.lock().all.len();
        let may = self.feed.locator().may_try(Instant::now());
        if !may || !checked_index_by_index(after, upto) || !locate::worth_it(1, members) {
            return None;
        }
        let token = self.key.scope.server.token.as_ref();
        let nodes = self.read(|| self.client.catalog_nodes(&self.scope, token)).await?;
        if !locate::worth_it(nodes.len(), members) {
            self.feed.locator().too_many_nodes(Instant::now());
            return None;
        }
        let mut located = Located::new(after, upto);
        for node in &nodes {
            located.node(node);
            located.instances(&self.read(|| self.client.node_services(&self.scope, token, &node.node)).await?);
        }
        located.explained(&self.checks.lock().expect("checks view poisoned"))
    }

    /// One read of the locate step: through the server's read pool, counted; a failure
    /// (`None`) is reported to reachability, and a refusal remembered. The request is made
    /// once the permit is held (`make`, as in `observe::request`).
    async fn read<T, F>(&self, make: impl FnOnce() -> F) -> Option<T>
    where
        F: Future<Output = Result<T, QueryError>>,
    {
        let _permit = self.env.reads.permit().await?;
        let result = observe::request(&self.env.metrics, observe::Query::Locate, Some(&self.key), None, make).await;
        result
            .inspect_err(|e| {
                tracing::debug!(consul = %self.client.address(), error = %e, "locating a catalog move failed");
                self.env.reach.suspect(self.client, e);
                self.feed.locator().failed(e);
            })
            .ok()
    }
}

/// An answer's index, `None` when it had none (counted in
/// `consul_unindexed_answers_total{query}`).
fn indexed<T>(metrics: &Metrics, query: observe::Query, answer: &crate::client::Answer<T>) -> Option<u64> {
    if !answer.indexed {
        metrics.unindexed.with_label_values(&[query.label()]).inc();
    }
    answer.indexed.then_some(answer.index)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn set(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn plain() -> QueryOptions {
        QueryOptions::default()
    }

    fn heard(names: &[&str], nodes: &[&str]) -> Arc<Heard> {
        Arc::new(Heard { names: set(names), nodes: set(nodes) })
    }

    #[tokio::test(start_paused = true)]
    async fn a_joiner_rereads_unless_the_feed_saw_nothing_after_its_read() {
        let mut m = Members::default();
        let t0 = Instant::now();
        let (_, before_baseline) = m.join(heard(&["web"], &[]), &plain(), t0);
        assert!(before_baseline.has_changed().unwrap(), "no baseline yet: re-read");

        tokio::time::advance(Duration::from_millis(10)).await;
        let now = Instant::now();
        (m.baseline_at, m.last_answer) = (Some(now), Some(now));
        tokio::time::advance(Duration::from_millis(10)).await;
        let read = Instant::now();
        let (_, covered) = m.join(heard(&["api"], &[]), &plain(), read);
        assert!(!covered.has_changed().unwrap(), "read after the baseline and the last answer");

        // An answer acted on between a read and the join: that read may have missed it.
        let read = Instant::now();
        tokio::time::advance(Duration::from_millis(10)).await;
        m.last_answer = Some(Instant::now());
        let (_, raced) = m.join(heard(&["db"], &[]), &plain(), read);
        assert!(raced.has_changed().unwrap(), "an answer came between its read and its join");
    }

    /// A member is woken by the names and nodes it asked about: a node of an instance its
    /// last answer filtered out (critical) included, so the node's recovery is heard.
    #[tokio::test(start_paused = true)]
    async fn members_wake_for_what_they_asked_about() {
        let mut m = Members::default();
        let (_, mut web) = m.join(heard(&["web"], &["n1", "n2-critical"]), &plain(), Instant::now());
        let connect = QueryOptions { connect: true, ..plain() };
        let (_, mut mesh) = m.join(heard(&["mesh", "mesh-sidecar-proxy"], &["n3"]), &connect, Instant::now());
        let quiet = |web: &mut watch::Receiver<()>, mesh: &mut watch::Receiver<()>| {
            web.mark_unchanged();
            mesh.mark_unchanged();
        };
        quiet(&mut web, &mut mesh);
        m.wake(&Stale { nodes: set(&["n2-critical"]), ..Stale::default() });
        assert!(web.has_changed().unwrap() && !mesh.has_changed().unwrap());
        quiet(&mut web, &mut mesh);
        m.wake(&Stale { services: set(&["mesh-sidecar-proxy"]), ..Stale::default() });
        assert!(!web.has_changed().unwrap() && mesh.has_changed().unwrap(), "a proxy's own name");
        quiet(&mut web, &mut mesh);
        m.wake(&Stale { appeared: set(&["mesh-edge"]), ..Stale::default() });
        assert!(!web.has_changed().unwrap() && mesh.has_changed().unwrap(), "a new name: maybe a new proxy");
        quiet(&mut web, &mut mesh);
        m.wake(&Stale { services: set(&["other"]), nodes: set(&["n9"]), ..Stale::default() });
        assert!(!web.has_changed().unwrap() && !mesh.has_changed().unwrap());
        m.wake(&Stale::everything());
        assert!(web.has_changed().unwrap() && mesh.has_changed().unwrap());
        // A filter may hide nodes: any node check concerns it.
        let filtered = QueryOptions { filter: Some("Service.Meta.v == \"2\"".into()), ..plain() };
        let (_, mut f) = m.join(heard(&["api"], &["n1"]), &filtered, Instant::now());
        f.mark_unchanged();
        m.wake(&Stale { nodes: set(&["n7"]), ..Stale::default() });
        assert!(f.has_changed().unwrap());
    }

    /// The names a member asked about follow its reads, and leave with it.
    #[tokio::test(start_paused = true)]
    async fn a_member_is_woken_by_the_names_its_latest_read_asked_about() {
        let mut m = Members::default();
        let (id, mut moved) = m.join(heard(&["web"], &["n1"]), &plain(), Instant::now());
        let (_, mut stayed) = m.join(heard(&["web"], &["n1"]), &plain(), Instant::now());
        m.saw(id, &heard(&["api", "api-sidecar-proxy"], &["n1"]));
        moved.mark_unchanged();
        stayed.mark_unchanged();
        m.wake(&Stale { services: set(&["web"]), ..Stale::default() });
        assert!(!moved.has_changed().unwrap() && stayed.has_changed().unwrap());
        m.wake(&Stale { services: set(&["api-sidecar-proxy"]), ..Stale::default() });
        assert!(moved.has_changed().unwrap());
        m.leave(id);
        assert_eq!(m.by_name.keys().collect::<Vec<_>>(), ["web"], "the names of members that left go");
        m.wake(&Stale { services: set(&["api"]), ..Stale::default() });
    }

    /// A member holds its watch's copy of what it heard, not one of its own, and an equal
    /// answer's copy does not replace it.
    #[tokio::test(start_paused = true)]
    async fn a_member_shares_what_its_watch_heard() {
        let mut m = Members::default();
        let watch = heard(&["web"], &["n1", "n2", "n3"]);
        let (id, _) = m.join(watch.clone(), &plain(), Instant::now());
        assert!(Arc::ptr_eq(&m.all[&id].heard, &watch), "a copy of its own");
        m.saw(id, &heard(&["web"], &["n1", "n2", "n3"]));
        assert!(Arc::ptr_eq(&m.all[&id].heard, &watch), "replaced by an equal copy");
        let moved = heard(&["web"], &["n4"]);
        m.saw(id, &moved);
        assert!(Arc::ptr_eq(&m.all[&id].heard, &moved));
        assert_eq!(Arc::strong_count(&watch), 1, "the old copy is let go");
    }

    /// A Consul answering `GET <path>` with `answer(path)`'s status and body, on kept-alive
    /// connections; the paths asked, in order.
    async fn consul(answer: fn(&str) -> (u16, String)) -> (String, Arc<Mutex<Vec<String>>>) {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = format!("http://{}", listener.local_addr().unwrap());
        let asked = Arc::new(Mutex::new(Vec::new()));
        let log = asked.clone();
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let log = log.clone();
                tokio::spawn(async move {
                    let mut conn = BufReader::new(conn);
                    let mut line = String::new();
                    let mut path = String::new();
                    while conn.read_line(&mut line).await.is_ok_and(|n| n > 0) {
                        if let Some(target) = line.strip_prefix("GET ") {
                            path = target.split([' ', '?']).next().unwrap_or_default().to_owned();
                        } else if line == "\r\n" {
                            log.lock().unwrap().push(path.clone());
                            let (status, body) = answer(&path);
                            let head = format!(
                                "HTTP/1.1 {status} X\r\nX-Consul-Index: 12\r\nContent-Length: {}\r\n\r\n",
                                body.len()
                            );
                            if conn.get_mut().write_all([head, body].concat().as_bytes()).await.is_err() {
                                return;
                            }
                        }
                        line.clear();
                    }
                });
            }
        });
        (address, asked)
    }

    /// A feed of members watching `web`, `api`, `db` and `cache`, and a catalog move to
    /// judge against what `answer` says, with a checks view that saw no check write.
    struct Judged {
        feed: Arc<Feed>,
        members: Vec<Membership>,
        client: Arc<HttpClient>,
        env: FeedEnv,
        key: ConsulKey,
        checks: Mutex<ChecksView>,
        critical: Mutex<ChecksView>,
        warning: Mutex<ChecksView>,
        woken: Mutex<Woken>,
    }

    impl Judged {
        async fn new(address: &str, services: &[&str]) -> Judged {
            let _ = rustls::crypto::ring::default_provider().install_default();
            let feed = Feed::new();
            let members = services.iter().map(|s| feed.join(heard(&[s], &["n1"]), &plain(), Instant::now())).collect();
            let lanes = Arc::new(Semaphore::new(4));
            let reads = ReadPool::new(1, lanes.clone());
            let metrics = Metrics::unregistered();
            let env = FeedEnv {
                lanes,
                reach: crate::reach::Reachability::new(reads.clone(), metrics.clone()),
                reads,
                metrics,
                wait: Duration::from_secs(1),
                statuses_from: 0,
                replan: Arc::new(Notify::new()),
            };
            let client = Arc::new(HttpClient::new(address, None, 4, 1 << 20, env.lanes.clone()).unwrap());
            let key = consul_resolver_core::test_support::consul_key(address, "web");
            Judged {
                feed,
                members,
                client,
                env,
                key,
                checks: Mutex::new(ChecksView::default()),
                critical: Mutex::new(ChecksView::default()),
                warning: Mutex::new(ChecksView::default()),
                woken: Mutex::new(Woken::default()),
            }
        }

        /// Judges an unaccounted move over `(after, upto]`; returns the services woken.
        async fn unaccounted(&mut self, after: u64, upto: u64) -> Vec<usize> {
            for m in &mut self.members {
                m.changes.mark_unchanged();
            }
            let ctx = Ctx {
                feed: &self.feed,
                client: &self.client,
                scope: Scope::of(&self.key),
                key: contact_scope(&self.key),
                env: &self.env,
                checks: &self.checks,
                critical: &self.critical,
                warning: &self.warning,
                woken: &self.woken,
            };
            ctx.unaccounted(after, upto, Duration::ZERO).await;
            (0..self.members.len()).filter(|&i| self.members[i].changes.has_changed().unwrap()).collect()
        }
    }

    /// One node, `n1`: `web` written at 11, `api` at 3; anything else, 403.
    fn one_node(path: &str) -> (u16, String) {
        match path {
            "/v1/catalog/nodes" => {
                (200, r#"[{"Node":"n1","Address":"10.0.0.1","CreateIndex":2,"ModifyIndex":2}]"#.into())
            }
            "/v1/catalog/node-services/n1" => (
                200,
                r#"{"Node":{"Node":"n1","ModifyIndex":2},"Services":[
                    {"ID":"web-1","Service":"web","Port":8081,"ModifyIndex":11},
                    {"ID":"api-1","Service":"api","Port":9090,"ModifyIndex":3}]}"#
                    .into(),
            ),
            _ => (403, "Permission denied".into()),
        }
    }

    const FOUR: [&str; 4] = ["web", "api", "db", "cache"];

    #[tokio::test]
    async fn a_located_move_wakes_what_it_wrote_and_a_gap_everyone() {
        let (address, asked) = consul(one_node).await;
        let mut judged = Judged::new(&address, &FOUR).await;
        assert_eq!(judged.unaccounted(10, 11).await, [0], "web's port change, located: web alone");
        assert_eq!(asked.lock().unwrap().len(), 2, "the node list and the node's instances");
        assert_eq!(judged.unaccounted(10, 12).await, [0, 1, 2, 3], "index 12 is unexplained: everyone");
        assert_eq!(judged.unaccounted(12, 13).await, [0, 1, 2, 3], "nothing located: everyone");
        assert_eq!(judged.env.metrics.requests("locate", "read", "ok"), 6);
        // Three members: the node list alone would cost a quarter of waking them.
        let mut few = Judged::new(&address, &FOUR[..3]).await;
        asked.lock().unwrap().clear();
        assert_eq!(few.unaccounted(10, 11).await, [0, 1, 2]);
        assert!(asked.lock().unwrap().is_empty(), "not worth a request");
    }

    #[tokio::test]
    async fn a_failed_locate_wakes_everyone_and_a_refusal_is_not_asked_again() {
        fn failing(path: &str) -> (u16, String) {
            match path {
                "/v1/catalog/node-services/n1" => (500, "rpc error".into()),
                _ => one_node(path),
            }
        }
        let (address, _) = consul(failing).await;
        let mut judged = Judged::new(&address, &FOUR).await;
        assert_eq!(judged.unaccounted(10, 11).await, [0, 1, 2, 3]);
        assert_eq!(judged.env.metrics.requests("locate", "read", "5xx"), 1);

        fn refusing(_: &str) -> (u16, String) {
            (403, "Permission denied".into())
        }
        let (address, asked) = consul(refusing).await;
        let mut judged = Judged::new(&address, &FOUR).await;
        assert_eq!(judged.unaccounted(10, 11).await, [0, 1, 2, 3]);
        assert_eq!(judged.unaccounted(11, 12).await, [0, 1, 2, 3]);
        assert_eq!(*asked.lock().unwrap(), ["/v1/catalog/nodes"], "refused once: not asked again");
    }

    #[test]
    fn plain_http_spellings_share_a_feed_and_tls_ones_do_not() {
        let key = |address: &str, token: Option<&str>| {
            let mut key = consul_resolver_core::test_support::consul_key(address, "web");
            key.scope_mut().server.token = token.map(Secret::new);
            key
        };
        assert_eq!(FeedKey::of(&key("http://127.0.0.1:8500", None)), FeedKey::of(&key("http://localhost:8500", None)));
        let mut peered = key("http://127.0.0.1:8500", None);
        peered.scope_mut().remote = Some(consul_resolver_core::keys::Remote::Peer("other".into()));
        assert_eq!(FeedKey::of(&peered), None, "another cluster's instances: no local feed sees them");
        assert_ne!(
            FeedKey::of(&key("http://127.0.0.1:8500", None)),
            FeedKey::of(&key("http://127.0.0.1:8500", Some("t")))
        );
        assert_ne!(
            FeedKey::of(&key("https://127.0.0.1:8501", None)),
            FeedKey::of(&key("https://localhost:8501", None))
        );
    }
}
