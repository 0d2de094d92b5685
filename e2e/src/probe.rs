//! A prober: one request through a proxy every few milliseconds, on one keep-alive
//! connection, each recorded with when it was sent, when it completed and who answered it
//! (the backend named by its `x-backend` header, or the proxy's own status, or an error).
//! Tests ask the record request by request: from when a backend got no more traffic, when
//! one first got some, how many each got in a window.
//!
//! Requests are sequential, one in flight at a time: a slow answer delays the next one
//! rather than piling up. The prober runs on a thread and runtime of its own, so its pace
//! does not depend on what the test's thread does.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::sync::Notify;

use crate::backends::BACKEND_HEADER;

/// What to probe, and how often.
#[derive(Clone, Debug)]
pub struct ProbeConfig {
    /// The proxy's listener.
    pub target: SocketAddr,
    /// Path (and query) of each request.
    pub path: String,
    /// Extra request headers (a route may match on one).
    pub headers: Vec<(String, String)>,
    /// From one request's start to the next one's (later when a request takes longer).
    pub interval: Duration,
    /// A request not answered within this is recorded as [`ProbeError::Timeout`] and its
    /// connection dropped.
    pub timeout: Duration,
    /// Samples kept; the oldest go first. 360,000 is half an hour at 5 ms, about 20 MB.
    pub max_samples: usize,
}

impl ProbeConfig {
    /// Every 5 ms, a 1 s timeout, half an hour of samples.
    pub fn new(target: SocketAddr, path: &str) -> ProbeConfig {
        ProbeConfig {
            target,
            path: path.to_owned(),
            headers: Vec::new(),
            interval: Duration::from_millis(5),
            timeout: Duration::from_secs(1),
            max_samples: 360_000,
        }
    }

    pub fn with_header(mut self, name: &str, value: &str) -> ProbeConfig {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    pub fn with_interval(mut self, interval: Duration) -> ProbeConfig {
        self.interval = interval;
        self
    }
}

/// One request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    pub sent: Instant,
    pub done: Instant,
    pub outcome: Outcome,
}

/// Who answered a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A backend: a 2xx answer naming it in `x-backend`.
    Backend(Arc<str>),
    /// Any other answer, the proxy's own (503: no healthy or reachable backend, no such
    /// cluster), by status.
    Status(u16),
    /// No answer at all.
    Error(ProbeError),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ProbeError {
    /// No connection to the proxy.
    Connect,
    /// The connection failed during the request.
    Request,
    Timeout,
}

impl Outcome {
    /// The backend that answered, if one did.
    pub fn backend(&self) -> Option<&str> {
        match self {
            Outcome::Backend(name) => Some(name),
            _ => None,
        }
    }
}

/// The requests of a window, by outcome.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub backends: BTreeMap<String, usize>,
    pub statuses: BTreeMap<u16, usize>,
    pub errors: BTreeMap<ProbeError, usize>,
}

impl Counts {
    /// Requests backend `name` answered.
    pub fn of(&self, name: &str) -> usize {
        self.backends.get(name).copied().unwrap_or(0)
    }

    /// Requests no backend answered (a proxy status or an error).
    pub fn failed(&self) -> usize {
        self.statuses.values().sum::<usize>() + self.errors.values().sum::<usize>()
    }

    pub fn total(&self) -> usize {
        self.backends.values().sum::<usize>() + self.failed()
    }
}

/// The samples kept, oldest first, and what they say.
#[derive(Clone, Debug, Default)]
pub struct Record {
    samples: VecDeque<Sample>,
    /// Samples dropped to stay within `max_samples`.
    dropped: u64,
    /// The last error's text, for a failing test to show.
    pub last_error: Option<String>,
}

impl Record {
    pub fn samples(&self) -> &VecDeque<Sample> {
        &self.samples
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The samples sent in `[from, to)` (`to`: `None` for up to now).
    pub fn window(
        &self,
        from: Instant,
        to: Option<Instant>,
    ) -> impl DoubleEndedIterator<Item = &Sample> + ExactSizeIterator {
        self.samples.range(self.bounds(from, to))
    }

    /// The indices of the samples sent in `[from, to)`. A window reaching back past
    /// samples already dropped is a test's mistake and panics: its answer would be wrong,
    /// silently.
    fn bounds(&self, from: Instant, to: Option<Instant>) -> std::ops::Range<usize> {
        if self.dropped > 0 {
            let oldest = self.samples.front().map(|s| s.sent);
            assert!(
                oldest.is_some_and(|o| o <= from),
                "the window starts before the oldest sample kept ({} dropped): raise max_samples",
                self.dropped
            );
        }
        let start = self.samples.partition_point(|s| s.sent < from);
        let end = to.map_or(self.samples.len(), |to| self.samples.partition_point(|s| s.sent < to));
        start..end.max(start)
    }

    /// The first request sent at or after `after` that backend `name` answered.
    pub fn first_hit(&self, name: &str, after: Instant) -> Option<&Sample> {
        self.window(after, None).find(|s| s.outcome.backend() == Some(name))
    }

    /// Among the requests sent in `[after, until)`, the instant from which backend `name`
    /// answered none: when the first request after the last one it answered was sent (the
    /// first of the window when it answered none). `None` when it answered the window's
    /// last request, or no request followed its last one yet.
    ///
    /// Exact to the request: the proxy stopped choosing `name` between the last request it
    /// answered and this one (with k backends in round robin, up to k-1 requests later).
    pub fn gone_since(&self, name: &str, after: Instant, until: Option<Instant>) -> Option<Instant> {
        // From the end backwards: as far back as the last request it answered.
        let range = self.bounds(after, until);
        let last = self.samples.range(range.clone()).rposition(|s| s.outcome.backend() == Some(name));
        let next = range.start + last.map_or(0, |i| i + 1);
        (next < range.end).then(|| self.samples[next].sent)
    }

    /// Requests sent in `[from, to)`, by outcome.
    pub fn counts(&self, from: Instant, to: Option<Instant>) -> Counts {
        let mut counts = Counts::default();
        for s in self.window(from, to) {
            match &s.outcome {
                Outcome::Backend(name) => *counts.backends.entry(name.to_string()).or_default() += 1,
                Outcome::Status(code) => *counts.statuses.entry(*code).or_default() += 1,
                Outcome::Error(e) => *counts.errors.entry(*e).or_default() += 1,
            }
        }
        counts
    }

    fn push(&mut self, sample: Sample, max: usize) {
        if self.samples.len() >= max.max(1) {
            self.samples.pop_front();
            self.dropped += 1;
        }
        self.samples.push_back(sample);
    }
}

/// The record and a condition variable rung at each new sample.
#[derive(Default)]
struct Shared {
    record: Mutex<Record>,
    changed: Condvar,
}

/// A running prober; stopped when dropped.
pub struct Prober {
    shared: Arc<Shared>,
    stop: Arc<Notify>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Prober {
    pub fn start(config: ProbeConfig) -> anyhow::Result<Prober> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("the prober's runtime")?;
        let shared = Arc::new(Shared::default());
        let stop = Arc::new(Notify::new());
        let (s, n) = (shared.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("prober".to_owned())
            .spawn(move || rt.block_on(probe(config, s, n)))
            .context("the prober's thread")?;
        Ok(Prober { shared, stop, thread: Some(thread) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Record> {
        self.shared.record.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Asks the record as it is now.
    pub fn with<T>(&self, f: impl FnOnce(&Record) -> T) -> T {
        f(&self.lock())
    }

    /// A copy of the record so far.
    pub fn record(&self) -> Record {
        self.lock().clone()
    }

    /// Stops probing (the request in flight is abandoned) and returns the record.
    pub fn stop(mut self) -> Record {
        self.halt();
        self.record()
    }

    fn halt(&mut self) {
        self.stop.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Asks `check` at each new sample until it answers `Some`, or `deadline` passes (an
    /// error saying `what`, with the last window's counts).
    pub fn wait_until<T>(
        &self,
        deadline: Instant,
        what: &str,
        mut check: impl FnMut(&Record) -> Option<T>,
    ) -> anyhow::Result<T> {
        let mut record = self.lock();
        loop {
            if let Some(v) = check(&record) {
                return Ok(v);
            }
            let now = Instant::now();
            if now >= deadline {
                let oldest = record.samples.front().map_or(now, |s| s.sent);
                let from = now.checked_sub(Duration::from_secs(1)).unwrap_or(now).max(oldest);
                let counts = record.counts(from, None);
                bail!("timed out waiting for {what}; the last second: {counts:?}; last error: {:?}", record.last_error);
            }
            record = self.shared.changed.wait_timeout(record, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Waits for the first request sent at or after `after` that backend `name` answers.
    pub fn wait_first_hit(&self, name: &str, after: Instant, deadline: Instant) -> anyhow::Result<Sample> {
        self.wait_until(deadline, &format!("a request answered by {name}"), |r| r.first_hit(name, after).cloned())
    }

    /// Waits until backend `name` has answered none of the requests sent over the last
    /// `quiet`, and at least `min_requests` were sent meanwhile; returns
    /// [`Record::gone_since`] from `after`.
    pub fn wait_gone(
        &self,
        name: &str,
        after: Instant,
        quiet: Duration,
        min_requests: usize,
        deadline: Instant,
    ) -> anyhow::Result<Instant> {
        self.wait_until(deadline, &format!("{name} to answer nothing for {quiet:?}"), |r| {
            let since = r.gone_since(name, after, None)?;
            let last = r.samples.back()?;
            let quiet_enough = last.sent.saturating_duration_since(since) >= quiet;
            (quiet_enough && r.window(since, None).len() >= min_requests).then_some(since)
        })
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.halt();
    }
}

async fn probe(config: ProbeConfig, shared: Arc<Shared>, stop: Arc<Notify>) {
    let mut tick = tokio::time::interval(config.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut conn: Option<SendRequest<Empty<Bytes>>> = None;
    let mut names: HashMap<String, Arc<str>> = HashMap::new();
    loop {
        tokio::select! {
            () = stop.notified() => return,
            _ = tick.tick() => {}
        }
        let sent = Instant::now();
        let result = tokio::select! {
            () = stop.notified() => return,
            r = tokio::time::timeout(config.timeout, request(&config, &mut conn)) => r,
        };
        let done = Instant::now();
        let outcome = match result {
            Ok(Ok(Answer::Backend(name))) => {
                let interned = names.entry(name).or_insert_with_key(|n| Arc::from(n.as_str()));
                Outcome::Backend(interned.clone())
            }
            Ok(Ok(Answer::Status(code))) => Outcome::Status(code),
            Ok(Err((kind, why))) => {
                conn = None;
                shared.record.lock().unwrap_or_else(|e| e.into_inner()).last_error = Some(why);
                Outcome::Error(kind)
            }
            Err(_) => {
                conn = None;
                let why = format!("no answer within {:?}", config.timeout);
                shared.record.lock().unwrap_or_else(|e| e.into_inner()).last_error = Some(why);
                Outcome::Error(ProbeError::Timeout)
            }
        };
        shared
            .record
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Sample { sent, done, outcome }, config.max_samples);
        shared.changed.notify_all();
    }
}

enum Answer {
    Backend(String),
    Status(u16),
}

/// One request on the kept connection (a new one when there is none or it closed).
async fn request(
    config: &ProbeConfig,
    conn: &mut Option<SendRequest<Empty<Bytes>>>,
) -> Result<Answer, (ProbeError, String)> {
    if conn.as_ref().is_none_or(SendRequest::is_closed) {
        *conn = Some(connect(config.target).await.map_err(|e| (ProbeError::Connect, format!("{e:#}")))?);
    }
    let sender = conn.as_mut().expect("connected above");
    let failed = |e: hyper::Error| (ProbeError::Request, e.to_string());
    sender.ready().await.map_err(failed)?;
    let mut request = hyper::Request::get(&config.path).header(hyper::header::HOST, config.target.to_string());
    for (name, value) in &config.headers {
        request = request.header(name, value);
    }
    let request = request.body(Empty::new()).map_err(|e| (ProbeError::Request, e.to_string()))?;
    let response = sender.send_request(request).await.map_err(failed)?;
    let status = response.status();
    let backend = response.headers().get(BACKEND_HEADER).and_then(|v| v.to_str().ok()).map(str::to_owned);
    // Read to the end, so that the connection can carry the next request.
    response.into_body().collect().await.map_err(failed)?;
    Ok(match backend {
        Some(name) if status.is_success() => Answer::Backend(name),
        _ => Answer::Status(status.as_u16()),
    })
}

async fn connect(target: SocketAddr) -> anyhow::Result<SendRequest<Empty<Bytes>>> {
    let stream = tokio::net::TcpStream::connect(target).await.with_context(|| format!("connecting to {target}"))?;
    stream.set_nodelay(true)?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    Ok(sender)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Samples 5 ms apart from `t0`: a backend's name, a status code, or "err".
    fn record(outcomes: &[&str], max: usize) -> (Instant, Record) {
        let t0 = Instant::now();
        let mut record = Record::default();
        for (i, o) in outcomes.iter().enumerate() {
            let sent = t0 + Duration::from_millis(5 * i as u64);
            let outcome = match (*o, o.parse::<u16>()) {
                ("err", _) => Outcome::Error(ProbeError::Request),
                (_, Ok(code)) => Outcome::Status(code),
                (name, Err(_)) => Outcome::Backend(Arc::from(name)),
            };
            record.push(Sample { sent, done: sent + Duration::from_millis(1), outcome }, max);
        }
        (t0, record)
    }

    fn at(t0: Instant, i: u64) -> Instant {
        t0 + Duration::from_millis(5 * i)
    }

    #[test]
    fn gone_since_is_the_request_after_the_last_one_answered_in_the_window() {
        let (t0, r) = record(&["a", "b", "a", "b", "a", "503", "a", "503", "b", "a"], 100);
        // Up to now, b answered the second to last: as far as anyone knows, gone from the last.
        assert_eq!(r.gone_since("b", t0, None), Some(at(t0, 9)));
        // Until it came back (the ninth), it was gone from the fifth.
        assert_eq!(r.gone_since("b", t0, Some(at(t0, 8))), Some(at(t0, 4)));
        assert_eq!(r.first_hit("b", at(t0, 4)).map(|s| s.sent), Some(at(t0, 8)));
        // Never answered in the window: gone from its first request.
        assert_eq!(r.gone_since("c", at(t0, 2), None), Some(at(t0, 2)));
        // Answered the window's last request: not gone.
        assert_eq!(r.gone_since("a", t0, None), None);
        let counts = r.counts(at(t0, 4), Some(at(t0, 8)));
        assert_eq!((counts.of("a"), counts.of("b"), counts.statuses.get(&503).copied()), (2, 0, Some(2)));
        assert_eq!((counts.failed(), counts.total()), (2, 4));
    }

    #[test]
    fn errors_count_as_failures_not_as_a_backend() {
        let (t0, r) = record(&["a", "err", "502", "a"], 100);
        let counts = r.counts(t0, None);
        assert_eq!(counts.backends.len(), 1);
        assert_eq!((counts.errors.get(&ProbeError::Request).copied(), counts.failed()), (Some(1), 2));
    }

    #[test]
    #[should_panic(expected = "raise max_samples")]
    fn a_window_older_than_the_samples_kept_is_refused() {
        let (t0, r) = record(&["a", "b", "a", "b"], 3);
        assert_eq!(r.len(), 3);
        r.counts(t0, None);
    }
}
