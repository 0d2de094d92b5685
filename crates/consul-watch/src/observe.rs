//! What every Consul request tells the metrics: its outcome and duration
//! (`consul_resolver_consul_requests_total`, `..._consul_request_duration_seconds`), and
//! whether Consul was reached, per scope (`..._consul_last_success_timestamp_seconds` and
//! `..._last_failure_...`, per resolver). Kept apart from the client so that wrapping a
//! request is one call where it is made, and the client stays about HTTP.

use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use crate::client::request_timeout;
use crate::error::QueryError;
pub(crate) use crate::metrics::Query;
use crate::metrics::{Metrics, contact_scope};
use consul_resolver_core::keys::ConsulKey;

/// The outcome label of a finished request: `ok`, `timeout` (no complete answer within its
/// limit), `transport` (no connection, reset, DNS), `403`, `429`, `4xx`, `5xx`, `invalid`
/// (Consul answered something unusable: a body that does not parse or is too large, a
/// redirect; or the request could not be made, e.g. a token that is no header value).
pub(crate) fn outcome<T>(result: &Result<T, QueryError>, took: Duration, limit: Duration) -> &'static str {
    match result {
        Ok(_) => "ok",
        // The request's limit covers the whole exchange: only a timeout takes that long.
        Err(QueryError::Network { .. }) if took >= limit => "timeout",
        // A failed TLS handshake is a connection that could not be made.
        Err(QueryError::Network { .. } | QueryError::Tls { .. }) => "transport",
        Err(QueryError::Forbidden { .. }) => "403",
        Err(QueryError::RateLimited { .. }) => "429",
        Err(QueryError::Status { status, .. }) if *status >= 500 => "5xx",
        Err(QueryError::Status { status, .. }) if *status >= 400 => "4xx",
        Err(QueryError::Status { .. } | QueryError::Body { .. } | QueryError::Redirect { .. }) => "invalid",
        Err(QueryError::TooLarge { .. }) => "invalid",
    }
}

/// Whether an outcome means Consul was reached (`Some(true)`: it answered, even with a
/// refusal; `Some(false)`: it could not be reached or could not serve; `None`: no request
/// went out).
fn reached(outcome: &str) -> Option<bool> {
    match outcome {
        "timeout" | "transport" | "5xx" => Some(false),
        "invalid" => None,
        _ => Some(true),
    }
}

/// Runs one request of `key`'s scope (`None`: of no scope, a probe; `block`: its index and
/// wait, `None` for a read) and records what came of it.
///
/// The request is made here (`make`), not given: an `async fn` keeps a future it is given
/// apart from the one it awaits, so a given request would be held twice for as long as it
/// runs (rust-lang/rust#62958). A dedicated watch's blocking query runs all the time, so
/// that was 16 KB per watch instead of 8 (`a_counted_query_is_small`).
pub(crate) async fn request<T, F>(
    metrics: &Metrics,
    query: Query,
    key: Option<&ConsulKey>,
    block: Option<(u64, Duration)>,
    make: impl FnOnce() -> F,
) -> Result<T, QueryError>
where
    F: Future<Output = Result<T, QueryError>>,
{
    let started = Instant::now();
    let result = make().await;
    let took = started.elapsed();
    let outcome = outcome(&result, took, request_timeout(block));
    let mode = if block.is_some() { "blocking" } else { "read" };
    metrics.requests.with_label_values(&[query.label(), mode, outcome]).inc();
    metrics.request_seconds.with_label_values(&[mode]).observe(took.as_secs_f64());
    if matches!(query, Query::Service) && result.is_err() {
        metrics.errors.with_label_values(&["consul", outcome]).inc();
    }
    if let (Some(key), Some(answered)) = (key, reached(outcome)) {
        metrics.contact.record(&contact_scope(key), answered, SystemTime::now());
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(e: QueryError) -> Result<(), QueryError> {
        Err(e)
    }

    #[test]
    fn outcomes_are_a_small_fixed_set() {
        let a = || "http://127.0.0.1:8500".to_owned();
        let (short, limit) = (Duration::from_millis(5), Duration::from_secs(15));
        let cases = [
            (Ok(()), "ok"),
            (err(QueryError::Network { address: a(), cause: "connection refused".into() }), "transport"),
            (err(QueryError::Forbidden { address: a(), body: "ACL not found".into() }), "403"),
            (err(QueryError::RateLimited { address: a(), retry_after: None }), "429"),
            (err(QueryError::Status { address: a(), status: 500, body: "No cluster leader".into() }), "5xx"),
            (err(QueryError::Status { address: a(), status: 404, body: String::new() }), "4xx"),
            (err(QueryError::Status { address: a(), status: 0, body: "not a header".into() }), "invalid"),
            (err(QueryError::Body { address: a(), cause: "eof".into() }), "invalid"),
            (err(QueryError::TooLarge { address: a(), limit: 1 }), "invalid"),
        ];
        for (result, expected) in cases {
            assert_eq!(outcome(&result, short, limit), expected, "{result:?}");
        }
        let slow = err(QueryError::Network { address: a(), cause: "operation timed out".into() });
        assert_eq!(outcome(&slow, limit, limit), "timeout");
        assert_eq!(reached("403"), Some(true), "a refusal is an answer: Consul is there");
        assert_eq!(reached("5xx"), Some(false));
    }

    /// A dedicated watch holds its blocking query's future, counted, for as long as the
    /// query waits: at budget 1,200 a thousand of them at once. What only some queries do
    /// (connect, HTTP/2, walk a sameness group) is boxed where it happens, and the request
    /// is made inside the counting, not handed to it whole; it was 16 KB, twice an 8 KB
    /// query.
    #[tokio::test]
    async fn a_counted_query_is_small() {
        let budget = std::sync::Arc::new(tokio::sync::Semaphore::new(4));
        let client = crate::client::HttpClient::new("http://127.0.0.1:8500", None, 4, 1 << 20, budget).unwrap();
        let (metrics, k) = (Metrics::unregistered(), key("t"));
        let block = Some((7, Duration::from_secs(60)));
        let counted = request(&metrics, Query::Service, Some(&k), block, || client.health(&k, block));
        let size = std::mem::size_of_val(&counted);
        assert!(size <= 2048, "a counted blocking query is {size} bytes");
    }

    fn key(token: &str) -> ConsulKey {
        crate::test_support::key("web", Some(token))
    }

    /// A request that runs out its limit (on the paused clock) is a timeout, by mode, and
    /// a failure to reach its scope; an answer is a success there.
    #[tokio::test(start_paused = true)]
    async fn requests_are_counted_timed_and_reach_their_scope() {
        let metrics = Metrics::unregistered();
        let k = key("t");
        let block = Some((7, Duration::from_secs(60)));
        let limit = request_timeout(block);
        let hung = async {
            tokio::time::sleep(limit).await;
            err(QueryError::Network { address: "a".into(), cause: "operation timed out".into() })
        };
        assert!(request(&metrics, Query::Service, Some(&k), block, || hung).await.is_err());
        assert_eq!(metrics.requests("service", "blocking", "timeout"), 1);
        let h = metrics.request_seconds.with_label_values(&["blocking"]);
        assert_eq!((h.get_sample_count(), h.get_sample_sum()), (1, limit.as_secs_f64()));
        let scope = contact_scope(&k);
        let last = metrics.contact().last(&scope);
        assert!(last.failure.is_some() && last.success.is_none(), "{last:?}");
        assert_eq!(metrics.contact().last(&contact_scope(&key("other token"))), Default::default(), "per scope");

        let read = async { Ok::<_, QueryError>(()) };
        request(&metrics, Query::Catalog, Some(&k), None, || read).await.unwrap();
        assert_eq!(metrics.requests("catalog", "read", "ok"), 1);
        assert!(metrics.contact().last(&scope).success.is_some());
        assert_eq!(metrics.requests_total(), 2);
        let series = |q: &str, m: &str, o: &str| ([q, m, o].map(String::from), 1);
        let mut counts = metrics.request_counts();
        counts.sort();
        assert_eq!(counts, [series("catalog", "read", "ok"), series("service", "blocking", "timeout")]);
    }
}
