//! The watch of one key as a state machine: given what happened, what to do next. No I/O
//! and no clock or randomness of its own (both are passed in), so every transition is
//! unit-tested on a paused clock; [`super::run`] performs what it says.
//!
//! What it decides, and the rules of docs/consul-protocol.md it keeps:
//! - the first query is a read (no index); a dedicated watch then blocks on the index of its
//!   last answer (never below 1), and forgets it after a failure or when an answer's index
//!   goes backwards (the server may be a new cluster);
//! - two queries are never closer than the minimum interval plus a little random;
//! - a failure backs off (250 ms doubling to a minute, jittered; a longer `Retry-After` wins);
//! - a fed watch reads when its feed names it, a fed or swept one at the latest every sweep;
//! - while its server is down it sends nothing; when the server is back it reads once, after a
//!   random moment within [`RESUME_SPREAD`];
//! - content comparison: only a first answer, a changed one, or any answer after an error
//!   (which clears it) is an event; a failure only when its message changes.

use std::time::{Duration, SystemTime};

use rand::Rng;
use tokio::time::Instant;

use crate::error::QueryError;
use crate::reach::RESUME_SPREAD;
use crate::timing::{Backoff, IndexState, pace};
use consul_resolver_core::model::{ConsulEvent, Endpoint, Endpoints};

/// What a watch is, as its server decided (or, over HTTP/2, the protocol did).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Before its server placed it: only its first read.
    Unplaced,
    /// Its own blocking query, holding a lane of the budget.
    Dedicated,
    /// Its own blocking query, as an HTTP/2 stream.
    Multiplexed,
    /// Reads when its change feed names it, or at the sweep.
    Fed,
    /// Neither a lane nor a feed could be given: reads at the sweep.
    Swept,
}

impl Mode {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Mode::Unplaced => "unplaced",
            Mode::Dedicated => "dedicated",
            Mode::Multiplexed => "multiplexed",
            Mode::Fed => "fed",
            Mode::Swept => "swept",
        }
    }
}

/// The timing settings a watch follows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    /// `wait` of blocking queries.
    pub wait: Duration,
    /// Least time between two queries (plus up to half of it at random).
    pub min_interval: Duration,
    /// Longest a fed or swept watch goes without reading.
    pub sweep: Duration,
}

/// What to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Send the query: blocking on `(index, wait)`, or a read (`None`).
    Query(Option<(u64, Duration)>),
    /// Nothing before this instant, unless something happens.
    Sleep(Instant),
    /// Nothing until something happens.
    Idle,
}

/// What the watch last reported, for content comparison.
#[derive(Debug, Default)]
struct Reported {
    endpoints: Option<Endpoints>,
    error: Option<String>,
    /// Since when the answers come from an agent's cache cut off from its servers.
    cut_off: Option<SystemTime>,
}

impl Reported {
    /// An answer (from a cut-off agent cache since `cut_off`): sent when it is the first,
    /// its endpoints changed, it follows an error, or the cut-off began or ended. A cut-off
    /// keeps the time it was first seen to begin (each answer's `Age` moves by a second or
    /// so with its arrival).
    fn answer(&mut self, index: u64, endpoints: Vec<Endpoint>, cut_off: Option<SystemTime>) -> Option<ConsulEvent> {
        let same_cut_off = self.cut_off.is_some() == cut_off.is_some();
        if self.error.is_none() && same_cut_off && self.endpoints.as_deref() == Some(&endpoints[..]) {
            return None;
        }
        if !same_cut_off {
            self.cut_off = cut_off;
        }
        self.error = None;
        let endpoints = Endpoints::from(endpoints);
        self.endpoints = Some(endpoints.clone());
        Some(match self.cut_off {
            Some(cut_off_since) => ConsulEvent::Cached { index, endpoints, cut_off_since },
            None => ConsulEvent::Answer { index, endpoints },
        })
    }

    /// A failure, sent when its message is new; `refused` when Consul refused the query.
    fn failure(&mut self, message: String, refused: bool) -> Option<ConsulEvent> {
        if self.error.as_ref() == Some(&message) {
            return None;
        }
        self.error = Some(message.clone());
        Some(if refused { ConsulEvent::Refused(message) } else { ConsulEvent::Failed(message) })
    }
}

#[derive(Debug)]
pub(crate) struct Machine {
    timing: Timing,
    mode: Mode,
    index: IndexState,
    backoff: Backoff,
    reported: Reported,
    /// No query before this: pacing after the last one, backoff after a failure, the spread
    /// after an outage.
    not_before: Option<Instant>,
    /// A read is owed: the first one, the feed named the watch, a retry, a resume.
    read_due: bool,
    /// When a fed or swept watch reads anyway.
    sweep_at: Option<Instant>,
    /// The server does not answer: nothing is sent until it does.
    server_down: bool,
}

impl Machine {
    pub(crate) fn new(timing: Timing) -> Self {
        Machine {
            timing,
            mode: Mode::Unplaced,
            index: IndexState::default(),
            backoff: Backoff::default(),
            reported: Reported::default(),
            not_before: None,
            read_due: true,
            sweep_at: None,
            server_down: false,
        }
    }

    pub(crate) fn mode(&self) -> Mode {
        self.mode
    }

    pub(crate) fn next(&self, now: Instant) -> Next {
        if self.server_down {
            return Next::Idle;
        }
        // Which query is due, if any; then no sooner than pacing and backoff allow.
        let query = match self.mode {
            Mode::Dedicated | Mode::Multiplexed if !self.index.cannot_block() => self.index.block(self.timing.wait),
            _ if self.read_due => None,
            Mode::Unplaced => return Next::Idle,
            // A query that cannot block (its answers carry no index) would answer at once,
            // again and again: such a watch reads at the sweep, as a swept one does.
            Mode::Fed | Mode::Swept | Mode::Dedicated | Mode::Multiplexed => match self.sweep_at {
                Some(at) if now < at => return Next::Sleep(at),
                _ => None,
            },
        };
        match self.not_before {
            Some(at) if now < at => Next::Sleep(at),
            _ => Next::Query(query),
        }
    }

    /// Whether the next query would block: what a failure or a lower index throws away.
    pub(crate) fn blocking(&self) -> bool {
        self.index.block(self.timing.wait).is_some()
    }

    /// A query goes out now.
    pub(crate) fn sent(&mut self, now: Instant, rng: &mut impl Rng) {
        self.not_before = Some(now + pace(self.timing.min_interval, rng));
    }

    /// The answer to a query that sent `sent` (its index; `None` for a read), carrying
    /// `index` (`None`: no `X-Consul-Index`), from an agent cache cut off from its servers
    /// since `cut_off`, if so.
    pub(crate) fn answered(
        &mut self,
        sent: Option<u64>,
        index: Option<u64>,
        endpoints: Vec<Endpoint>,
        cut_off: Option<SystemTime>,
        now: Instant,
        rng: &mut impl Rng,
    ) -> Option<ConsulEvent> {
        self.backoff.reset();
        self.index.observe(sent, index);
        if sent.is_none() {
            self.read_due = false;
        }
        // A read the sweep was due for schedules the next one. A read the feed asked for
        // does not move it: the watch keeps its own phase (see `place`).
        let sweeps = matches!(self.mode, Mode::Fed | Mode::Swept) || self.index.cannot_block();
        if sent.is_none() && sweeps && self.sweep_at.is_none_or(|at| at <= now) {
            self.sweep_at = Some(self.next_sweep(now, rng));
        }
        self.reported.answer(index.unwrap_or(1), endpoints, cut_off)
    }

    /// Whether the last answer carried no index, so this watch cannot block and reads at
    /// the sweep whatever its mode.
    pub(crate) fn cannot_block(&self) -> bool {
        self.index.cannot_block()
    }

    /// The query failed: back off, forget the index (the server may come back as another
    /// cluster with a lower one), and owe a read.
    pub(crate) fn failed(&mut self, error: &QueryError, now: Instant, rng: &mut impl Rng) -> Option<ConsulEvent> {
        self.index.reset();
        let delay = self.backoff.failure(rng).max(error.retry_after().unwrap_or_default());
        self.not_before = Some(self.not_before.map_or(now + delay, |at| at.max(now + delay)));
        self.read_due = true;
        self.reported.failure(error.to_string(), error.refused())
    }

    /// The watch is now `mode`. A watch that becomes fed or swept takes a phase of its own:
    /// its first sweep falls anywhere in the coming period. Every watch of a server is
    /// placed within the first seconds of a start, and with a phase of a tenth they all
    /// swept within the same tenth of every period (about 4,900 reads in 30 s every five
    /// minutes at 5,000 services; docs/consul.md).
    pub(crate) fn place(&mut self, mode: Mode, now: Instant, rng: &mut impl Rng) {
        let was = std::mem::replace(&mut self.mode, mode);
        match mode {
            Mode::Fed | Mode::Swept if !matches!(was, Mode::Fed | Mode::Swept) => {
                self.sweep_at = Some(now + self.timing.sweep.mul_f64(rng.random_range(0.0..1.0)));
            }
            Mode::Fed | Mode::Swept => {}
            _ => self.sweep_at = None,
        }
    }

    /// The feed says the watch's service may have changed (or it just joined a feed whose
    /// view is newer than its last read).
    pub(crate) fn woken(&mut self) {
        self.read_due = true;
    }

    /// The server stopped answering (`message` names it, from this watch's address): the
    /// failure is reported once, the index forgotten, nothing sent until it is back.
    pub(crate) fn server_down(&mut self, message: String) -> Option<ConsulEvent> {
        self.server_down = true;
        self.index.reset();
        self.reported.failure(message, false)
    }

    /// The server answers again: read once, after a random moment within the spread, so
    /// that its watches do not come back in one burst.
    pub(crate) fn server_up(&mut self, now: Instant, rng: &mut impl Rng) {
        if !std::mem::take(&mut self.server_down) {
            return;
        }
        self.backoff.reset();
        self.read_due = true;
        self.not_before = Some(now + RESUME_SPREAD.mul_f64(rng.random_range(0.0..1.0)));
    }

    /// A period after a sweep, less up to a tenth: the phases taken at placement drift
    /// apart rather than together, and no read is ever more than a period after the last.
    fn next_sweep(&self, now: Instant, rng: &mut impl Rng) -> Instant {
        now + self.timing.sweep.mul_f64(rng.random_range(0.9..1.0))
    }

    /// Whether the watch holds a lane of its server's budget (a dedicated blocking query).
    pub(crate) fn holds_lane(&self) -> bool {
        self.mode == Mode::Dedicated
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    const WAIT: Duration = Duration::from_secs(300);
    const SWEEP: Duration = Duration::from_secs(300);
    const MIN: Duration = Duration::from_millis(100);

    fn machine() -> (Machine, StdRng) {
        (Machine::new(Timing { wait: WAIT, min_interval: MIN, sweep: SWEEP }), StdRng::seed_from_u64(7))
    }

    fn ep(port: u16) -> Endpoint {
        consul_resolver_core::test_support::endpoint("10.0.0.1", port)
    }

    #[test]
    fn consul_refusing_the_query_is_reported_as_refused() {
        let (mut m, mut rng) = machine();
        let now = Instant::now();
        let bad = QueryError::Status {
            address: "a".into(),
            status: 400,
            body: "Failed to create boolean expression evaluator".into(),
        };
        assert!(matches!(m.failed(&bad, now, &mut rng), Some(ConsulEvent::Refused(_))));
        let no_leader = QueryError::Status { address: "a".into(), status: 500, body: "No cluster leader".into() };
        assert!(matches!(m.failed(&no_leader, now, &mut rng), Some(ConsulEvent::Failed(_))));
        let limited = QueryError::RateLimited { address: "a".into(), retry_after: None };
        assert!(matches!(m.failed(&limited, now, &mut rng), Some(ConsulEvent::Failed(_))), "429 passes");
        let forbidden = QueryError::Forbidden { address: "a".into(), body: "ACL not found".into() };
        assert!(matches!(m.failed(&forbidden, now, &mut rng), Some(ConsulEvent::Refused(_))));
    }

    /// The list a watch keeps to tell news from a repeat is the one it reported (the
    /// world holds that one too), not a copy: at 150,000 instances a copy was 24 MB.
    #[test]
    fn the_endpoints_kept_are_the_ones_reported() {
        let (mut m, mut rng) = machine();
        let now = Instant::now();
        let Some(ConsulEvent::Answer { endpoints, .. }) = m.answered(None, Some(3), vec![ep(1)], None, now, &mut rng)
        else {
            panic!("the first answer is reported")
        };
        assert!(std::sync::Arc::ptr_eq(&endpoints, m.reported.endpoints.as_ref().unwrap()));
        assert_eq!(m.answered(None, Some(4), vec![ep(1)], None, now, &mut rng), None, "the same endpoints");
        assert!(m.answered(None, Some(5), vec![ep(2)], None, now, &mut rng).is_some(), "others");
    }

    fn refused() -> QueryError {
        QueryError::Network { address: "http://127.0.0.1:8500".into(), cause: "connection refused".into() }
    }

    /// Runs `next` at now: a query must be due; sends it.
    fn send(m: &mut Machine, rng: &mut StdRng) -> Option<(u64, Duration)> {
        match m.next(Instant::now()) {
            Next::Query(block) => {
                m.sent(Instant::now(), rng);
                block
            }
            other => panic!("expected a query, got {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_query_reads_then_a_dedicated_watch_blocks_on_its_index_paced() {
        let (mut m, mut rng) = machine();
        assert_eq!(send(&mut m, &mut rng), None, "the first query does not block");
        assert!(
            m.answered(None, Some(0), vec![], None, Instant::now(), &mut rng).is_some(),
            "the first answer, even empty"
        );
        assert_eq!(m.next(Instant::now()), Next::Idle, "unplaced after its read: waits to be placed");
        m.place(Mode::Dedicated, Instant::now(), &mut rng);
        // Paced: 100 ms plus up to half of it after the last query.
        let Next::Sleep(at) = m.next(Instant::now()) else { panic!("paced") };
        let gap = at - Instant::now();
        assert!((MIN..MIN * 3 / 2).contains(&gap), "{gap:?}");
        tokio::time::advance(gap).await;
        assert_eq!(send(&mut m, &mut rng), Some((1, WAIT)), "never below 1, even after index 0");
        assert!(
            m.answered(Some(1), Some(9), vec![], None, Instant::now(), &mut rng).is_none(),
            "same content: no event"
        );
        tokio::time::advance(MIN * 2).await;
        assert_eq!(send(&mut m, &mut rng), Some((9, WAIT)));
        assert_eq!(m.mode(), Mode::Dedicated);
    }

    /// Answers without `X-Consul-Index` (a proxy that strips it): a dedicated watch cannot
    /// block, so it reads at the sweep instead of sending "blocking" queries on index 1 that
    /// answer at once, ten a second; an answer with an index makes it block again.
    #[tokio::test(start_paused = true)]
    async fn without_an_index_a_dedicated_watch_reads_at_the_sweep_not_in_a_loop() {
        let (mut m, mut rng) = machine();
        assert_eq!(send(&mut m, &mut rng), None);
        m.answered(None, None, vec![ep(1)], None, Instant::now(), &mut rng);
        m.place(Mode::Dedicated, Instant::now(), &mut rng);
        assert!(m.cannot_block());
        // Placed dedicated, it reads once (its place reset the sweep), then sleeps a sweep.
        tokio::time::advance(MIN * 2).await;
        assert_eq!(send(&mut m, &mut rng), None, "a read, never a query blocking on a made-up index");
        m.answered(None, None, vec![ep(1)], None, Instant::now(), &mut rng);
        let Next::Sleep(at) = m.next(Instant::now()) else { panic!("sleeps until the sweep") };
        assert!(at - Instant::now() >= SWEEP * 9 / 10, "{:?}", at - Instant::now());
        // In the minute after: no query at all (the loop made hundreds).
        tokio::time::advance(Duration::from_secs(60)).await;
        assert!(matches!(m.next(Instant::now()), Next::Sleep(_)));
        // At the sweep it reads; this answer has an index again: it blocks on it.
        tokio::time::advance(SWEEP).await;
        assert_eq!(send(&mut m, &mut rng), None);
        m.answered(None, Some(40), vec![ep(1)], None, Instant::now(), &mut rng);
        assert!(!m.cannot_block());
        tokio::time::advance(MIN * 2).await;
        assert_eq!(send(&mut m, &mut rng), Some((40, WAIT)));
    }

    #[tokio::test(start_paused = true)]
    async fn an_index_going_back_or_a_failure_starts_over_from_a_read() {
        let (mut m, mut rng) = machine();
        send(&mut m, &mut rng);
        m.answered(None, Some(100), vec![ep(1)], None, Instant::now(), &mut rng);
        m.place(Mode::Dedicated, Instant::now(), &mut rng);
        tokio::time::advance(MIN * 2).await;
        assert_eq!(send(&mut m, &mut rng), Some((100, WAIT)));
        m.answered(Some(100), Some(7), vec![ep(1)], None, Instant::now(), &mut rng);
        tokio::time::advance(MIN * 2).await;
        assert_eq!(send(&mut m, &mut rng), None, "the index went back: read without it");
        m.answered(None, Some(7), vec![ep(1)], None, Instant::now(), &mut rng);
        tokio::time::advance(MIN * 2).await;
        assert_eq!(send(&mut m, &mut rng), Some((7, WAIT)));
        assert!(m.blocking());
        let ev = m.failed(&refused(), Instant::now(), &mut rng);
        assert!(matches!(ev, Some(ConsulEvent::Failed(ref msg)) if msg.contains("connection refused")), "{ev:?}");
        assert!(!m.blocking(), "a failure forgets the index");
        assert!(m.failed(&refused(), Instant::now(), &mut rng).is_none(), "the same failure is not repeated");
    }

    #[tokio::test(start_paused = true)]
    async fn failures_back_off_doubling_and_an_answer_clears_the_error() {
        let (mut m, mut rng) = machine();
        m.place(Mode::Dedicated, Instant::now(), &mut rng);
        let mut gaps = Vec::new();
        for _ in 0..4 {
            send(&mut m, &mut rng);
            m.failed(&refused(), Instant::now(), &mut rng);
            let Next::Sleep(at) = m.next(Instant::now()) else { panic!("backing off") };
            gaps.push(at - Instant::now());
            tokio::time::advance(at - Instant::now()).await;
        }
        let ms: Vec<u128> = gaps.iter().map(Duration::as_millis).collect();
        assert!((187..=250).contains(&ms[0]) && (375..=500).contains(&ms[1]), "{ms:?}");
        assert!((750..=1000).contains(&ms[2]) && (1500..=2000).contains(&ms[3]), "{ms:?}");
        assert_eq!(send(&mut m, &mut rng), None, "after a failure: a read");
        let ev = m.answered(None, Some(3), vec![], None, Instant::now(), &mut rng);
        assert!(matches!(ev, Some(ConsulEvent::Answer { .. })), "an answer after an error is sent, so it clears");
        // The backoff starts over.
        tokio::time::advance(MIN * 2).await;
        send(&mut m, &mut rng);
        m.failed(&refused(), Instant::now(), &mut rng);
        let Next::Sleep(at) = m.next(Instant::now()) else { panic!() };
        assert!(at - Instant::now() <= Duration::from_millis(250));
    }

    #[tokio::test(start_paused = true)]
    async fn a_retry_after_longer_than_the_backoff_wins() {
        let (mut m, mut rng) = machine();
        m.place(Mode::Dedicated, Instant::now(), &mut rng);
        send(&mut m, &mut rng);
        let limited = QueryError::RateLimited { address: "a".into(), retry_after: Some(Duration::from_secs(3)) };
        m.failed(&limited, Instant::now(), &mut rng);
        assert_eq!(m.next(Instant::now()), Next::Sleep(Instant::now() + Duration::from_secs(3)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_fed_watch_reads_when_woken_or_at_the_sweep_never_blocks() {
        let (mut m, mut rng) = machine();
        send(&mut m, &mut rng);
        m.answered(None, Some(5), vec![ep(1)], None, Instant::now(), &mut rng);
        m.place(Mode::Fed, Instant::now(), &mut rng);
        let Next::Sleep(sweep) = m.next(Instant::now()) else { panic!("waits for its feed or the sweep") };
        assert!(sweep - Instant::now() <= SWEEP, "its first sweep within a period");
        // Woken: one read, as soon as pacing allows; the sweep keeps its phase.
        tokio::time::advance(MIN * 2).await;
        assert!(Instant::now() < sweep, "this seed's phase leaves room for a woken read");
        m.woken();
        assert_eq!(send(&mut m, &mut rng), None, "a read, never a blocking query");
        m.answered(None, Some(6), vec![ep(2)], None, Instant::now(), &mut rng);
        assert_eq!(m.next(Instant::now()), Next::Sleep(sweep), "a read the feed asked for does not move the sweep");
        // Unwoken, the sweep reads anyway; it schedules the next a period later, less a tenth.
        tokio::time::advance(sweep - Instant::now()).await;
        assert_eq!(send(&mut m, &mut rng), None);
        m.answered(None, Some(6), vec![ep(2)], None, Instant::now(), &mut rng);
        let Next::Sleep(next) = m.next(Instant::now()) else { panic!("the next sweep") };
        assert!((SWEEP * 9 / 10..=SWEEP).contains(&(next - Instant::now())), "{:?}", next - Instant::now());
        // A failed read is retried after the backoff, without waiting to be woken.
        m.failed(&refused(), Instant::now(), &mut rng);
        let Next::Sleep(at) = m.next(Instant::now()) else { panic!() };
        assert!(at - Instant::now() <= Duration::from_millis(250));
        tokio::time::advance(at - Instant::now()).await;
        assert_eq!(send(&mut m, &mut rng), None);
    }

    #[tokio::test(start_paused = true)]
    async fn promoted_it_blocks_on_the_index_of_its_last_read_demoted_it_reads_when_told() {
        let (mut m, mut rng) = machine();
        send(&mut m, &mut rng);
        m.answered(None, Some(42), vec![ep(1)], None, Instant::now(), &mut rng);
        m.place(Mode::Fed, Instant::now(), &mut rng);
        m.place(Mode::Dedicated, Instant::now(), &mut rng);
        assert!(m.holds_lane());
        tokio::time::advance(MIN * 2).await;
        assert_eq!(send(&mut m, &mut rng), Some((42, WAIT)), "no change since its last read is missed");
        m.place(Mode::Fed, Instant::now(), &mut rng);
        assert!(!m.holds_lane());
        tokio::time::advance(MIN * 2).await;
        assert!(matches!(m.next(Instant::now()), Next::Sleep(_)), "fed: it waits for the feed");
        m.woken();
        assert_eq!(send(&mut m, &mut rng), None);
    }

    #[tokio::test(start_paused = true)]
    async fn while_its_server_is_down_it_sends_nothing_then_resumes_within_a_second() {
        let (mut m, mut rng) = machine();
        send(&mut m, &mut rng);
        m.answered(None, Some(9), vec![ep(1)], None, Instant::now(), &mut rng);
        m.place(Mode::Dedicated, Instant::now(), &mut rng);
        let ev = m.server_down("cannot reach Consul at http://127.0.0.1:8500: connection refused".into());
        assert!(matches!(ev, Some(ConsulEvent::Failed(_))), "reported, so its resolver says so at once");
        assert!(!m.blocking(), "the index is forgotten");
        for _ in 0..60 {
            tokio::time::advance(Duration::from_secs(1)).await;
            assert_eq!(m.next(Instant::now()), Next::Idle, "nothing at all while down");
        }
        m.server_up(Instant::now(), &mut rng);
        let Next::Sleep(at) = m.next(Instant::now()) else { panic!("spread") };
        assert!(at - Instant::now() < RESUME_SPREAD);
        tokio::time::advance(at - Instant::now()).await;
        assert_eq!(send(&mut m, &mut rng), None, "a read without index: the server may be a new cluster");
        let ev = m.answered(None, Some(2), vec![ep(1)], None, Instant::now(), &mut rng);
        assert!(matches!(ev, Some(ConsulEvent::Answer { .. })), "the answer clears the failure");
        // Fed watches re-read after an outage too.
        let (mut f, mut rng) = machine();
        send(&mut f, &mut rng);
        f.answered(None, Some(9), vec![], None, Instant::now(), &mut rng);
        f.place(Mode::Fed, Instant::now(), &mut rng);
        f.server_down("down".into());
        f.server_up(Instant::now(), &mut rng);
        tokio::time::advance(RESUME_SPREAD).await;
        assert_eq!(send(&mut f, &mut rng), None);
    }

    /// A cut-off agent cache is reported once, with when the cut-off began, and again when
    /// it ends; a later answer of the same cut-off with the same endpoints is no event.
    #[tokio::test(start_paused = true)]
    async fn an_agent_cut_off_from_its_servers_is_reported_when_it_begins_and_ends() {
        let (mut m, mut rng) = machine();
        let t = |s| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
        send(&mut m, &mut rng);
        assert!(m.answered(None, Some(5), vec![ep(1)], None, Instant::now(), &mut rng).is_some());
        let ev = m.answered(None, Some(5), vec![ep(1)], Some(t(1000)), Instant::now(), &mut rng);
        assert_eq!(ev, Some(ConsulEvent::Cached { index: 5, endpoints: vec![ep(1)].into(), cut_off_since: t(1000) }));
        assert_eq!(
            m.answered(None, Some(5), vec![ep(1)], Some(t(1001)), Instant::now(), &mut rng),
            None,
            "the same cut-off"
        );
        let ev = m.answered(None, Some(6), vec![ep(2)], Some(t(1001)), Instant::now(), &mut rng);
        assert_eq!(ev, Some(ConsulEvent::Cached { index: 6, endpoints: vec![ep(2)].into(), cut_off_since: t(1000) }));
        let ev = m.answered(None, Some(7), vec![ep(2)], None, Instant::now(), &mut rng);
        assert_eq!(ev, Some(ConsulEvent::Answer { index: 7, endpoints: vec![ep(2)].into() }), "back in touch");
    }

    /// Watches placed together (every watch at a start) sweep spread over the whole period,
    /// not within its last tenth, and the feed's reads at the start do not gather them again.
    #[tokio::test(start_paused = true)]
    async fn watches_placed_together_sweep_spread_over_the_period() {
        let mut rng = StdRng::seed_from_u64(3);
        let t0 = Instant::now();
        let sweeps: Vec<Duration> = (0..200)
            .map(|_| {
                let mut m = Machine::new(Timing { wait: WAIT, min_interval: MIN, sweep: SWEEP });
                send(&mut m, &mut rng);
                m.answered(None, Some(5), vec![ep(1)], None, t0, &mut rng);
                m.place(Mode::Fed, t0, &mut rng);
                // The feed's baseline: every member re-reads once.
                m.woken();
                m.answered(None, Some(5), vec![ep(1)], None, t0, &mut rng);
                let Next::Sleep(at) = m.next(t0) else { panic!("waits for the sweep") };
                at - t0
            })
            .collect();
        assert!(sweeps.iter().all(|s| *s <= SWEEP));
        for tenth in 0..10 {
            let within = sweeps.iter().filter(|s| (SWEEP * tenth / 10..SWEEP * (tenth + 1) / 10).contains(*s)).count();
            assert!((5..=40).contains(&within), "{within} of 200 sweeps in tenth {tenth}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn spreads_differ_between_watches() {
        let mut rng = StdRng::seed_from_u64(1);
        let spreads: Vec<Duration> = (0..20)
            .map(|_| {
                let mut m = Machine::new(Timing { wait: WAIT, min_interval: MIN, sweep: SWEEP });
                m.server_down("down".into());
                m.server_up(Instant::now(), &mut rng);
                match m.next(Instant::now()) {
                    Next::Sleep(at) => at - Instant::now(),
                    _ => Duration::ZERO,
                }
            })
            .collect();
        assert!(spreads.iter().all(|s| *s < RESUME_SPREAD));
        let distinct: std::collections::BTreeSet<_> = spreads.iter().collect();
        assert!(distinct.len() > 10, "{spreads:?}");
    }
}
