//! The simulator's shared state: the catalog, change notification, faults, the connection
//! table, the request log and counters.
//!
//! One `std::sync::Mutex` per concern, never held across an `.await`. Blocking queries wait on
//! a single `watch` channel that is bumped after every catalog write and re-check their own
//! service's index: simple, and per-service isolation follows from the index check (a change
//! to B wakes a blocker on A, which finds A's index unchanged and goes back to sleep).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::Config;
use super::catalog::{Catalog, ServiceKey, StateEntry};
use super::faults::{Faults, FaultsPatch, Outcome, Quirks, RequestRecord, Stats};
use super::render::{self, CheckJsonCache};

/// The negotiated protocol, as counted in `Stats::open_connections_by_protocol`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Protocol {
    H1,
    H2,
}

impl Protocol {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Protocol::H1 => "h1",
            Protocol::H2 => "h2",
        }
    }
}

/// Locks, ignoring poisoning: the protected data stays consistent because no code panics
/// while holding a lock, and a test tool should keep answering regardless.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) fn read_lock<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Default)]
struct ConnTable {
    open: HashMap<IpAddr, usize>,
    peak: HashMap<IpAddr, usize>,
    open_total: usize,
    peak_total: usize,
    /// Open connections by negotiated protocol (`h1`, `h2`), once serving.
    by_protocol: BTreeMap<&'static str, usize>,
}

/// Blocking queries in flight.
#[derive(Default)]
struct BlockingTable {
    per_label: BTreeMap<String, usize>,
    /// Those whose client went away (see [`Detach`]).
    detached: usize,
}

struct RequestLog {
    capacity: usize,
    next_seq: u64,
    records: VecDeque<RequestRecord>,
}

impl RequestLog {
    fn get_mut(&mut self, seq: u64) -> Option<&mut RequestRecord> {
        let first = self.records.front()?.seq;
        let i = usize::try_from(seq.checked_sub(first)?).ok()?;
        self.records.get_mut(i)
    }
}

/// What an agent cut off from its servers still has: its cache, as of `since`.
#[derive(Clone)]
pub(crate) struct CutOff {
    pub since: Instant,
    pub catalog: Arc<Catalog>,
}

pub(crate) struct Shared {
    pub config: Config,
    /// Read under a shared lock: an answer of every check, a walk of them all, does not hold
    /// up a query of a few, as Consul's state store (MVCC) does not.
    pub catalog: RwLock<Catalog>,
    /// Bumped after every catalog write (and index override): wakes blocking queries.
    pub changes: watch::Sender<()>,
    /// Bumped by `drop_blocking`: in-flight blocking queries close their connection.
    pub drops: watch::Sender<()>,
    /// Set once when the simulator stops: the accept loop, connections and blocking
    /// queries left running without a client (`no_server_cancel`) end.
    pub shutdown: watch::Sender<bool>,
    faults: Mutex<Faults>,
    /// The checks' JSON kept between `/v1/health/state` answers.
    check_json: Mutex<CheckJsonCache>,
    /// While `agent_cut_off` is on: when it began, and the catalog as the agent's cache
    /// last saw it then.
    cut_off: Mutex<Option<CutOff>>,
    conns: Mutex<ConnTable>,
    log: Mutex<RequestLog>,
    blocking: Mutex<BlockingTable>,
    rejected_connections: AtomicU64,
    injected_429: AtomicU64,
    requests_total: AtomicU64,
    /// The most requests in flight at once on one connection.
    peak_streams: AtomicUsize,
    started: Instant,
}

impl Shared {
    pub(crate) fn new(config: Config) -> Self {
        let catalog = Catalog::new(config.datacenter.clone(), config.initial_index);
        let faults = Faults::defaults(&config);
        let capacity = config.request_log_capacity;
        Shared {
            config,
            catalog: RwLock::new(catalog),
            changes: watch::Sender::new(()),
            drops: watch::Sender::new(()),
            shutdown: watch::Sender::new(false),
            faults: Mutex::new(faults),
            check_json: Mutex::new(CheckJsonCache::default()),
            cut_off: Mutex::new(None),
            conns: Mutex::new(ConnTable::default()),
            log: Mutex::new(RequestLog { capacity, next_seq: 1, records: VecDeque::new() }),
            blocking: Mutex::new(BlockingTable::default()),
            rejected_connections: AtomicU64::new(0),
            injected_429: AtomicU64::new(0),
            requests_total: AtomicU64::new(0),
            peak_streams: AtomicUsize::new(0),
            started: Instant::now(),
        }
    }

    /// Runs a catalog write, with the agent behaviour of the moment, and wakes blocking
    /// queries.
    pub(crate) fn write_catalog<R>(&self, f: impl FnOnce(&mut Catalog) -> R) -> R {
        let keeps_unchanged_checks = self.with_faults(|f| f.keeps_unchanged_checks);
        let mut catalog = self.catalog.write().unwrap_or_else(PoisonError::into_inner);
        catalog.keeps_unchanged_checks = keeps_unchanged_checks;
        let r = f(&mut catalog);
        drop(catalog);
        self.changes.send_replace(());
        r
    }

    /// The body of a `/v1/health/state` answer of `entries`, every check's (`every`) or one
    /// status's. The kept JSON serves every check's answers alone: one status's few checks
    /// are written straight, never waiting on the cache while an answer of every check holds
    /// it, nor walking its rows after (at 150,000 checks either cost more than the answer).
    pub(crate) fn checks_body(&self, entries: Vec<StateEntry>, every: bool, legacy: bool) -> Vec<u8> {
        if legacy || !every {
            return render::checks(&entries, legacy);
        }
        let mut cache = lock(&self.check_json);
        let body = cache.render(&entries);
        drop(entries);
        cache.forget_replaced();
        body
    }

    // ---- faults

    pub(crate) fn faults(&self) -> Faults {
        lock(&self.faults).clone()
    }

    pub(crate) fn set_faults(&self, patch: FaultsPatch) -> Faults {
        let mut f = lock(&self.faults);
        f.apply(patch);
        self.follow_cut_off(f.agent_cut_off);
        f.clone()
    }

    pub(crate) fn clear_faults(&self) -> Faults {
        let mut f = lock(&self.faults);
        *f = Faults::defaults(&self.config);
        self.follow_cut_off(f.agent_cut_off);
        f.clone()
    }

    /// Freezes what the agent's cache holds when it is cut off from its servers, and forgets
    /// it when they are back; blocking queries are woken to answer from the new state.
    fn follow_cut_off(&self, on: bool) {
        let mut cut_off = lock(&self.cut_off);
        match (on, cut_off.is_some()) {
            (true, false) => {
                let catalog = Arc::new(read_lock(&self.catalog).clone());
                *cut_off = Some(CutOff { since: Instant::now(), catalog });
            }
            (false, true) => *cut_off = None,
            _ => return,
        }
        drop(cut_off);
        self.changes.send_replace(());
    }

    /// The agent's cache while it is cut off from its servers.
    pub(crate) fn cut_off(&self) -> Option<CutOff> {
        lock(&self.cut_off).clone()
    }

    pub(crate) fn quirks(&self) -> Quirks {
        lock(&self.faults).quirks()
    }

    pub(crate) fn with_faults<R>(&self, f: impl FnOnce(&mut Faults) -> R) -> R {
        f(&mut lock(&self.faults))
    }

    pub(crate) fn count_injected_429(&self) {
        self.injected_429.fetch_add(1, Ordering::Relaxed);
    }

    /// Closes every in-flight blocking query without a response; returns how many there were.
    pub(crate) fn drop_blocking(&self) -> usize {
        let n = lock(&self.blocking).per_label.values().sum();
        self.drops.send_replace(());
        n
    }

    pub(crate) fn set_service_index(&self, key: &ServiceKey, index: u64) -> bool {
        self.write_catalog(|c| c.set_service_index(key, index))
    }

    pub(crate) fn reset_indexes(&self, index: u64) {
        self.write_catalog(|c| c.reset_indexes(index));
    }

    // ---- connections

    /// Counts a new connection from `ip` unless it is at the limit (0 = unlimited).
    pub(crate) fn try_open_connection(&self, ip: IpAddr) -> bool {
        let limit = self.config.max_conns_per_client;
        let mut t = lock(&self.conns);
        let open = t.open.entry(ip).or_insert(0);
        if limit > 0 && *open >= limit {
            drop(t);
            self.rejected_connections.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        *open += 1;
        let now = *open;
        let peak = t.peak.entry(ip).or_insert(0);
        *peak = (*peak).max(now);
        t.open_total += 1;
        t.peak_total = t.peak_total.max(t.open_total);
        true
    }

    pub(crate) fn close_connection(&self, ip: IpAddr) {
        let mut t = lock(&self.conns);
        if let Some(open) = t.open.get_mut(&ip) {
            *open = open.saturating_sub(1);
            if *open == 0 {
                t.open.remove(&ip);
            }
        }
        t.open_total = t.open_total.saturating_sub(1);
    }

    pub(crate) fn protocol_opened(&self, protocol: Protocol) {
        *lock(&self.conns).by_protocol.entry(protocol.label()).or_insert(0) += 1;
    }

    pub(crate) fn protocol_closed(&self, protocol: Protocol) {
        let mut t = lock(&self.conns);
        if let Some(n) = t.by_protocol.get_mut(protocol.label()) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                t.by_protocol.remove(protocol.label());
            }
        }
    }

    /// A connection has `streams` requests in flight.
    pub(crate) fn stream_count_seen(&self, streams: usize) {
        self.peak_streams.fetch_max(streams, Ordering::Relaxed);
    }

    // ---- blocking bookkeeping

    fn blocking_started(&self, label: &str) {
        *lock(&self.blocking).per_label.entry(label.to_owned()).or_insert(0) += 1;
    }

    fn blocking_ended(&self, label: &str) {
        let mut b = lock(&self.blocking);
        if let Some(n) = b.per_label.get_mut(label) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                b.per_label.remove(label);
            }
        }
    }

    fn count_detached(&self, up: bool) {
        let mut b = lock(&self.blocking);
        b.detached = if up { b.detached + 1 } else { b.detached.saturating_sub(1) };
    }

    // ---- request log

    /// Appends a record (its `seq` and `at_ms` are assigned here); returns its `seq`.
    pub(crate) fn log_request(&self, mut record: RequestRecord) -> u64 {
        self.requests_total.fetch_add(1, Ordering::Relaxed);
        record.at_ms = millis(self.started.elapsed());
        let mut log = lock(&self.log);
        record.seq = log.next_seq;
        log.next_seq += 1;
        let seq = record.seq;
        log.records.push_back(record);
        while log.records.len() > log.capacity {
            log.records.pop_front();
        }
        seq
    }

    pub(crate) fn update_request(&self, seq: u64, f: impl FnOnce(&mut RequestRecord)) {
        if let Some(r) = lock(&self.log).get_mut(seq) {
            f(r);
        }
    }

    pub(crate) fn finish_request(&self, seq: u64, outcome: Outcome, status: Option<u16>, index: Option<u64>) {
        let now = millis(self.started.elapsed());
        self.update_request(seq, |r| {
            r.outcome = outcome;
            r.status = status;
            r.index = index;
            r.duration_ms = Some(now.saturating_sub(r.at_ms));
        });
    }

    /// When the simulator started: the origin of every record's `at_ms`.
    pub(crate) fn started(&self) -> Instant {
        self.started
    }

    pub(crate) fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.log).records.iter().cloned().collect()
    }

    /// The `seq` of the latest request logged (0 before any): cheap, unlike [`requests`],
    /// for marking where in the log something began.
    ///
    /// [`requests`]: Self::requests
    pub(crate) fn last_request_seq(&self) -> u64 {
        lock(&self.log).next_seq - 1
    }

    pub(crate) fn clear_requests(&self) -> usize {
        let mut log = lock(&self.log);
        let n = log.records.len();
        log.records.clear();
        n
    }

    // ---- stats

    pub(crate) fn stats(&self) -> Stats {
        let conns = lock(&self.conns);
        let (blocking, blocking_detached) = {
            let b = lock(&self.blocking);
            (b.per_label.clone(), b.detached)
        };
        let rejected = self.rejected_connections.load(Ordering::Relaxed);
        let injected = self.injected_429.load(Ordering::Relaxed);
        Stats {
            open_connections: conns.open.iter().map(|(ip, n)| (ip.to_string(), *n)).collect(),
            peak_connections: conns.peak.iter().map(|(ip, n)| (ip.to_string(), *n)).collect(),
            open_connections_total: conns.open_total,
            peak_connections_total: conns.peak_total,
            open_connections_by_protocol: conns.by_protocol.iter().map(|(p, n)| ((*p).to_owned(), *n)).collect(),
            peak_streams_per_connection: self.peak_streams.load(Ordering::Relaxed),
            rejected_connections: rejected,
            injected_429: injected,
            total_429: rejected + injected,
            requests_total: self.requests_total.load(Ordering::Relaxed),
            blocking_total: blocking.values().sum(),
            blocking,
            blocking_detached,
        }
    }

    /// Resets counters; peaks restart from the current open counts.
    pub(crate) fn reset_stats(&self) {
        let mut conns = lock(&self.conns);
        let ConnTable { open, peak, open_total, peak_total, by_protocol: _ } = &mut *conns;
        *peak = open.clone();
        *peak_total = *open_total;
        drop(conns);
        self.rejected_connections.store(0, Ordering::Relaxed);
        self.injected_429.store(0, Ordering::Relaxed);
        self.requests_total.store(0, Ordering::Relaxed);
        self.peak_streams.store(0, Ordering::Relaxed);
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Decrements the per-IP connection count when the connection ends, however it ends.
pub(crate) struct ConnGuard {
    pub shared: Arc<Shared>,
    pub ip: IpAddr,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.shared.close_connection(self.ip);
    }
}

/// Counts a blocking query as in flight until dropped.
pub(crate) struct BlockingGuard {
    shared: Arc<Shared>,
    label: String,
    detach: Option<Arc<Detach>>,
}

impl BlockingGuard {
    pub(crate) fn new(shared: &Arc<Shared>, label: &str) -> Self {
        shared.blocking_started(label);
        BlockingGuard { shared: shared.clone(), label: label.to_owned(), detach: None }
    }

    /// Lets the query outlive its request: the returned handle, dropped by the request
    /// before this guard, counts the query as detached until this guard goes too.
    pub(crate) fn detachable(&mut self) -> DetachHandle {
        let detach = Arc::new(Detach::default());
        self.detach = Some(detach.clone());
        DetachHandle { shared: self.shared.clone(), detach }
    }
}

impl Drop for BlockingGuard {
    fn drop(&mut self) {
        if let Some(d) = &self.detach {
            let mut st = lock(&d.state);
            st.ended = true;
            if st.detached {
                self.shared.count_detached(false);
            }
        }
        self.shared.blocking_ended(&self.label);
    }
}

/// Whether a detachable blocking query ended, and whether its request went first. Both
/// sides update it under its lock, so the detached count goes up and down exactly once.
#[derive(Default)]
pub(crate) struct Detach {
    state: Mutex<DetachState>,
}

#[derive(Default)]
struct DetachState {
    ended: bool,
    detached: bool,
}

/// Held by the request of a detachable blocking query: dropping it before the query ended
/// (the client went away) counts the query as detached.
pub(crate) struct DetachHandle {
    shared: Arc<Shared>,
    detach: Arc<Detach>,
}

impl Drop for DetachHandle {
    fn drop(&mut self) {
        let mut st = lock(&self.detach.state);
        if !st.ended && !st.detached {
            st.detached = true;
            self.shared.count_detached(true);
        }
    }
}

/// Marks a logged request `cancelled` if its handler is dropped before finishing (the client
/// went away, or the simulator shut down).
pub(crate) struct LogGuard {
    pub shared: Arc<Shared>,
    pub seq: u64,
    pub done: bool,
}

impl LogGuard {
    pub(crate) fn finish(mut self, outcome: Outcome, status: Option<u16>, index: Option<u64>) {
        self.done = true;
        self.shared.finish_request(self.seq, outcome, status, index);
    }
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        if !self.done {
            self.shared.finish_request(self.seq, Outcome::Cancelled, None, None);
        }
    }
}
