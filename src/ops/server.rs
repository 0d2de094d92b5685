//! The ops server's connections. It answers kubelet probes and Prometheus, but anything that
//! reaches the pod can connect to it, so what a client can hold is bounded, and a flood of
//! idle or slow clients never keeps a probe or a scrape out:
//!
//! - at most [`Limits::max_connections`] connections; when full, a new connection closes the
//!   one that has been idle longest (no request in flight, or only one held waiting for the
//!   next snapshot, see [`Waiting`]), so the newcomer (a probe) gets in and the flood pays;
//!   only when every connection is busy is the newcomer closed;
//! - a request's head must arrive within [`Limits::header_timeout`] of the connection's
//!   start or of the previous response (hyper's header-read timeout, which also bounds how
//!   long a kept-alive connection may sit idle);
//! - an `accept()` error (out of descriptors, say) backs off doubling from 5 ms to 1 s instead
//!   of spinning on a runtime thread.
//!
//! HTTP/1.1 only: probes, Prometheus and snapshot readers all speak it, and one protocol
//! keeps the limits above true for every connection.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus::core::Collector;
use prometheus::{IntCounterVec, IntGauge, Registry};
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::measure::{counter_vec, int_gauge, register_all};

/// What one client may hold of the ops server.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
}

impl Limits {
    /// Far above what probes and a few Prometheus servers use (a handful), far below a
    /// process's descriptor limit, which the operator also needs for its Consul and
    /// Kubernetes connections. The header timeout is generous for any real client (they send
    /// their head at once) and ends a slow or idle one within seconds.
    pub(crate) const DEFAULT: Limits = Limits { max_connections: 256, header_timeout: Duration::from_secs(10) };
}

/// The server's metrics, registered beside the code that measures them.
#[derive(Clone)]
pub(crate) struct ServerMetrics {
    /// `ops_connections`: connections open now.
    connections: IntGauge,
    /// `ops_connections_closed_total{reason}`: connections the server closed itself.
    closed: IntCounterVec,
    /// `ops_requests_waiting`: requests held until the next snapshot ([`Waiting`]).
    waiting: IntGauge,
}

/// Why the server closed a connection.
const EVICTED: &str = "evicted";
const FULL: &str = "full";
const HEADER_TIMEOUT: &str = "header_timeout";

impl ServerMetrics {
    pub(crate) fn unregistered() -> ServerMetrics {
        ServerMetrics {
            connections: int_gauge("ops_connections", "Connections open to the ops server (--listen)"),
            closed: counter_vec(
                "ops_connections_closed_total",
                "Connections the ops server closed itself: evicted (idle longest when the cap was reached), full (every connection busy), header_timeout",
                &["reason"],
            ),
            waiting: int_gauge(
                "ops_requests_waiting",
                "Requests to the ops server held until the next snapshot (/snapshot?wait=)",
            ),
        }
    }

    pub(crate) fn register(registry: &Registry) -> prometheus::Result<ServerMetrics> {
        let m = ServerMetrics::unregistered();
        register_all(registry, m.collectors())?;
        for reason in [EVICTED, FULL, HEADER_TIMEOUT] {
            m.closed.with_label_values(&[reason]);
        }
        Ok(m)
    }

    /// What [`ServerMetrics::register`] registers.
    pub(crate) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![Box::new(self.connections.clone()), Box::new(self.closed.clone()), Box::new(self.waiting.clone())]
    }
}

/// One open connection, as far as the cap is concerned.
struct Open {
    /// The last request's start or end (or the accept): the eviction order.
    last_active: Instant,
    /// Requests being answered: a busy connection is never evicted.
    busy: usize,
    close: CancellationToken,
}

/// The open connections, shared by the accept loop and each connection's requests.
#[derive(Default)]
struct Table {
    next_id: u64,
    open: HashMap<u64, Open>,
}

impl Table {
    /// Makes room for one more under `max`: the longest-idle connection is told to close.
    /// `Err` when every connection is busy (the newcomer is then refused).
    fn make_room(&mut self, max: usize) -> Result<bool, ()> {
        if self.open.len() < max {
            return Ok(false);
        }
        let victim =
            self.open.iter().filter(|(_, c)| c.busy == 0).min_by_key(|(_, c)| c.last_active).map(|(id, _)| *id);
        match victim.and_then(|id| self.open.remove(&id)) {
            Some(c) => {
                c.close.cancel();
                Ok(true)
            }
            None => Err(()),
        }
    }

    fn admit(&mut self, now: Instant) -> (u64, CancellationToken) {
        let id = self.next_id;
        self.next_id += 1;
        let close = CancellationToken::new();
        self.open.insert(id, Open { last_active: now, busy: 0, close: close.clone() });
        (id, close)
    }

    fn touch(&mut self, id: u64, busy: isize, now: Instant) {
        if let Some(c) = self.open.get_mut(&id) {
            c.busy = c.busy.saturating_add_signed(busy);
            c.last_active = now;
        }
    }
}

/// Adds `by` to a connection's requests in flight while it lives, and marks the connection
/// active at both ends: 1 while a request is answered (busy), -1 while that request only
/// waits ([`Waiting`]).
struct InFlight {
    table: Arc<Mutex<Table>>,
    id: u64,
    by: isize,
}

impl InFlight {
    fn add(table: &Arc<Mutex<Table>>, id: u64, by: isize) -> InFlight {
        table.lock().expect("connection table poisoned").touch(id, by, Instant::now());
        InFlight { table: table.clone(), id, by }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.table.lock().expect("connection table poisoned").touch(self.id, -self.by, Instant::now());
    }
}

/// A request's word to the cap that it is only waiting (a reader held until the next
/// snapshot): while it waits, its connection may be closed to make room, as an idle one
/// may, so that held readers never keep a probe out.
pub(crate) struct Waiting {
    table: Arc<Mutex<Table>>,
    id: u64,
    metrics: ServerMetrics,
}

impl Waiting {
    /// Runs `wait` with the connection counted as idle, busy again after (or when dropped).
    pub(crate) async fn idle_while<T>(&self, wait: impl Future<Output = T>) -> T {
        let _idle = InFlight::add(&self.table, self.id, -1);
        let _counted = Counted::new(&self.metrics.waiting);
        wait.await
    }
}

/// One in a gauge while it lives.
struct Counted(IntGauge);

impl Counted {
    fn new(gauge: &IntGauge) -> Counted {
        gauge.inc();
        Counted(gauge.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Backoff between failed `accept()`s: doubling from 5 ms to 1 s, reset by a success.
#[derive(Debug)]
struct AcceptBackoff(Duration);

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(5);
    const CAP: Duration = Duration::from_secs(1);

    fn new() -> Self {
        AcceptBackoff(Self::FIRST)
    }

    fn failed(&mut self) -> Duration {
        let wait = self.0;
        self.0 = (self.0 * 2).min(Self::CAP);
        wait
    }

    fn succeeded(&mut self) {
        self.0 = Self::FIRST;
    }
}

/// Serves `handle` on `listener` within `limits` until `shutdown`.
pub(crate) async fn run<H, F>(
    listener: TcpListener,
    limits: Limits,
    metrics: ServerMetrics,
    shutdown: CancellationToken,
    handle: H,
) where
    H: Fn(Request<Incoming>, Waiting) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<super::body::ResponseBody>> + Send + 'static,
{
    let table = Arc::new(Mutex::new(Table::default()));
    let mut backoff = AcceptBackoff::new();
    loop {
        let stream = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    backoff.succeeded();
                    // Without it, a response written in two parts (a snapshot's head and
                    // body) can wait for the reader's delayed ACK, about 40 ms (Nagle).
                    let _ = stream.set_nodelay(true);
                    stream
                }
                Err(e) => {
                    let wait = backoff.failed();
                    tracing::warn!(error = %e, retry_in = ?wait, "the ops server cannot accept connections");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(wait) => continue,
                    }
                }
            },
        };
        let admitted = {
            let mut t = table.lock().expect("connection table poisoned");
            match t.make_room(limits.max_connections) {
                Ok(evicted) => {
                    if evicted {
                        metrics.closed.with_label_values(&[EVICTED]).inc();
                    }
                    Some(t.admit(Instant::now()))
                }
                Err(()) => None,
            }
        };
        let Some((id, close)) = admitted else {
            metrics.closed.with_label_values(&[FULL]).inc();
            tracing::debug!(max = limits.max_connections, "every ops connection is busy: refused one");
            drop(stream);
            continue;
        };
        metrics.connections.inc();
        let (table, metrics, handle, shutdown) = (table.clone(), metrics.clone(), handle.clone(), shutdown.clone());
        tokio::spawn(async move {
            let requests = {
                let (table, metrics) = (table.clone(), metrics.clone());
                hyper::service::service_fn(move |req: Request<Incoming>| {
                    let busy = InFlight::add(&table, id, 1);
                    let answer = handle(req, Waiting { table: table.clone(), id, metrics: metrics.clone() });
                    async move {
                        let resp = answer.await;
                        drop(busy);
                        Ok::<_, Infallible>(resp)
                    }
                })
            };
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
            let conn = builder.serve_connection(TokioIo::new(stream), requests);
            // Dropping the connection closes its socket: evicted connections are idle, and
            // at shutdown nothing in flight is worth waiting for.
            tokio::select! {
                ended = conn => match ended {
                    Err(e) if e.is_timeout() => metrics.closed.with_label_values(&[HEADER_TIMEOUT]).inc(),
                    Err(e) => tracing::debug!(error = %e, "ops connection ended with an error"),
                    Ok(()) => {}
                },
                _ = close.cancelled() => {}
                _ = shutdown.cancelled() => {}
            }
            table.lock().expect("connection table poisoned").open.remove(&id);
            metrics.connections.dec();
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_table_closes_the_longest_idle_and_never_a_busy_one() {
        let t0 = Instant::now();
        let mut t = Table::default();
        let (a, close_a) = t.admit(t0);
        let (b, close_b) = t.admit(t0 + Duration::from_secs(1));
        assert_eq!(t.make_room(3), Ok(false), "room left: nobody closed");
        // `a` is answering a request: `b` is the one to go, though `a` is older.
        t.touch(a, 1, t0);
        assert_eq!(t.make_room(2), Ok(true));
        assert!(close_b.is_cancelled() && !close_a.is_cancelled());
        assert!(!t.open.contains_key(&b));
        let (_c, _) = t.admit(t0 + Duration::from_secs(2));
        t.touch(_c, 1, t0 + Duration::from_secs(2));
        assert_eq!(t.make_room(2), Err(()), "every connection busy: the newcomer is refused");
        // `a` finishes its request: now active last, yet the only idle one, so it goes.
        t.touch(a, -1, t0 + Duration::from_secs(3));
        assert_eq!(t.make_room(2), Ok(true));
        assert!(close_a.is_cancelled());
    }

    #[test]
    fn accept_failures_back_off_doubling_to_a_cap_and_a_success_resets() {
        let mut b = AcceptBackoff::new();
        let waits: Vec<_> = (0..10).map(|_| b.failed()).collect();
        assert_eq!(waits[..4], [5, 10, 20, 40].map(Duration::from_millis));
        assert_eq!(waits[9], Duration::from_secs(1), "capped at a second: {waits:?}");
        b.succeeded();
        assert_eq!(b.failed(), Duration::from_millis(5));
    }
}
