//! The `/_sim/` control API: fault injection, the request log and connection statistics.
//!
//! Real Consul has none of this; it exists so that tests can provoke failures and assert on
//! what a client did. See the module documentation of [`crate::sim`] for the endpoint list.
//! Control requests are not subject to faults, ACLs or the request log.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::acl::TokenSource;
use super::catalog::ServiceKey;
use super::state::Shared;

/// How many requests a fault applies to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Budget {
    /// Not active. JSON `0`.
    #[default]
    Off,
    /// The next `n` matching requests. JSON `n`.
    Count(u64),
    /// Every matching request until cleared. JSON `"always"`.
    Always,
}

impl Budget {
    /// Consumes one use; true if the fault applies to this request.
    pub fn take(&mut self) -> bool {
        match *self {
            Budget::Off => false,
            Budget::Always => true,
            Budget::Count(n) => {
                *self = if n <= 1 { Budget::Off } else { Budget::Count(n - 1) };
                n >= 1
            }
        }
    }

    pub fn is_active(&self) -> bool {
        !matches!(self, Budget::Off | Budget::Count(0))
    }
}

impl Serialize for Budget {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Budget::Off => s.serialize_u64(0),
            Budget::Count(n) => s.serialize_u64(*n),
            Budget::Always => s.serialize_str("always"),
        }
    }
}

impl<'de> Deserialize<'de> for Budget {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Count(u64),
            Word(String),
        }
        match Raw::deserialize(d)? {
            Raw::Count(0) => Ok(Budget::Off),
            Raw::Count(n) => Ok(Budget::Count(n)),
            Raw::Word(w) if w == "always" => Ok(Budget::Always),
            Raw::Word(w) if w == "off" => Ok(Budget::Off),
            Raw::Word(w) => {
                Err(serde::de::Error::custom(format!("expected a count, \"always\" or \"off\", got {w:?}")))
            }
        }
    }
}

/// The simulator's current misbehaviour. `GET /_sim/faults` returns it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Faults {
    /// Added before every `/v1/` request is handled.
    pub latency_ms: u64,
    /// Health queries answer 500 `No cluster leader`; while active, `/v1/status/leader`
    /// answers `""` (without consuming the budget).
    pub no_leader: Budget,
    /// Health queries answer 429 `Too Many Requests` (the RPC rate limit; the connection stays
    /// open, unlike the connection-limit 429).
    pub too_many_requests: Budget,
    /// Answer with the legacy `null` shapes (see [`crate::sim`]).
    pub null_variants: bool,
    /// The `X-Consul-KnownLeader` header value (`false` is normal with the streaming backend).
    pub known_leader: bool,
}

impl Faults {
    pub(crate) fn defaults(null_variants: bool) -> Self {
        Faults {
            latency_ms: 0,
            no_leader: Budget::Off,
            too_many_requests: Budget::Off,
            null_variants,
            known_leader: true,
        }
    }

    pub(crate) fn apply(&mut self, patch: FaultsPatch) {
        let FaultsPatch { latency_ms, no_leader, too_many_requests, null_variants, known_leader } = patch;
        if let Some(v) = latency_ms {
            self.latency_ms = v;
        }
        if let Some(v) = no_leader {
            self.no_leader = v;
        }
        if let Some(v) = too_many_requests {
            self.too_many_requests = v;
        }
        if let Some(v) = null_variants {
            self.null_variants = v;
        }
        if let Some(v) = known_leader {
            self.known_leader = v;
        }
    }
}

/// A partial update of [`Faults`]: `PUT /_sim/faults` body. Absent fields are left alone;
/// unknown fields are rejected so that a typo in a test does not silently do nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultsPatch {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub no_leader: Option<Budget>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub too_many_requests: Option<Budget>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub null_variants: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub known_leader: Option<bool>,
}

/// What became of a logged request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Still being handled (typically blocked).
    InFlight,
    /// A response was sent (any status).
    Answered,
    /// Closed without a response by `POST /_sim/drop-blocking`.
    Dropped,
    /// The client went away (or the simulator shut down) before the answer.
    Cancelled,
}

/// One `/v1/` request as the simulator saw it. `GET /_sim/requests` returns a list of these.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Increasing from 1, never reused (not even after a clear).
    pub seq: u64,
    /// Milliseconds since the simulator started.
    pub at_ms: u64,
    /// The client's `ip:port`.
    pub peer: String,
    pub method: String,
    /// The path as sent (still percent-encoded).
    pub path: String,
    /// The raw query string, `""` if none.
    pub query: String,
    /// For health queries: the service name (decoded).
    pub service: Option<String>,
    /// `?ns=` or `X-Consul-Namespace`, if sent.
    pub namespace: Option<String>,
    /// `?partition=`, if sent.
    pub partition: Option<String>,
    /// The presented ACL token. Returned verbatim: this is a test tool and tests need to know
    /// which token was used.
    pub token: Option<String>,
    pub token_source: Option<TokenSource>,
    /// For blocking queries: the effective wait after defaulting and capping.
    pub wait_ms: Option<u64>,
    /// For blocking queries: the wait plus the random extra actually applied.
    pub timeout_ms: Option<u64>,
    pub outcome: Outcome,
    pub status: Option<u16>,
    /// The `X-Consul-Index` answered, if any.
    pub index: Option<u64>,
    pub duration_ms: Option<u64>,
}

/// `GET /_sim/stats`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Open connections per client IP (IPs with none are left out).
    pub open_connections: BTreeMap<String, usize>,
    /// The most connections each client IP held at once since start or the last reset.
    pub peak_connections: BTreeMap<String, usize>,
    pub open_connections_total: usize,
    pub peak_connections_total: usize,
    /// Connections refused with 429 because their client IP was at the limit.
    pub rejected_connections: u64,
    /// 429s produced by the `too_many_requests` fault.
    pub injected_429: u64,
    /// Every 429 sent: `rejected_connections + injected_429`.
    pub total_429: u64,
    /// `/v1/` requests received.
    pub requests_total: u64,
    /// Blocking queries currently waiting, per service name (`/v1/catalog/services` blockers
    /// are counted under `"_catalog_services"`).
    pub blocking: BTreeMap<String, usize>,
    pub blocking_total: usize,
}

/// `PUT /_sim/services/<name>/index` and `POST /_sim/reset-index` body.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexBody {
    pub index: u64,
}

type Resp = Response<Full<Bytes>>;

fn json<T: Serialize>(status: StatusCode, value: &T) -> Resp {
    let body = serde_json::to_vec_pretty(value).unwrap_or_else(|_| b"null".to_vec());
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    resp
}

fn text(status: StatusCode, body: impl Into<String>) -> Resp {
    let mut resp = Response::new(Full::new(Bytes::from(body.into())));
    *resp.status_mut() = status;
    resp
}

async fn read_json<T: serde::de::DeserializeOwned>(req: Request<Incoming>, empty_ok: bool) -> Result<Option<T>, Resp> {
    let bytes = Limited::new(req.into_body(), 1 << 20)
        .collect()
        .await
        .map_err(|e| text(StatusCode::BAD_REQUEST, format!("reading body: {e}")))?
        .to_bytes();
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return if empty_ok { Ok(None) } else { Err(text(StatusCode::BAD_REQUEST, "a JSON body is required")) };
    }
    serde_json::from_slice(&bytes).map(Some).map_err(|e| text(StatusCode::BAD_REQUEST, format!("bad JSON body: {e}")))
}

/// Serves one `/_sim/...` request.
pub(crate) async fn handle(shared: &Arc<Shared>, req: Request<Incoming>) -> Resp {
    match route(shared, req).await {
        Ok(r) | Err(r) => r,
    }
}

async fn route(shared: &Arc<Shared>, req: Request<Incoming>) -> Result<Resp, Resp> {
    let path = req.uri().path().trim_end_matches('/').to_owned();
    let query = req.uri().query().unwrap_or("").to_owned();
    let method = req.method().clone();
    let param = |name: &str| {
        url::form_urlencoded::parse(query.as_bytes()).find(|(k, _)| k == name).map(|(_, v)| v.into_owned())
    };

    if let Some(rest) = path.strip_prefix("/_sim/services/")
        && let Some(name) = rest.strip_suffix("/index")
    {
        if method != Method::PUT {
            return Err(text(StatusCode::METHOD_NOT_ALLOWED, "use PUT"));
        }
        let name =
            super::server::percent_decode(name).ok_or_else(|| text(StatusCode::BAD_REQUEST, "bad service name"))?;
        let body: IndexBody = read_json(req, false).await?.unwrap_or_default();
        let key = ServiceKey::scoped(name, param("ns").as_deref(), param("partition").as_deref());
        return if shared.set_service_index(&key, body.index) {
            Ok(json(StatusCode::OK, &serde_json::json!({"service": key.name, "index": body.index})))
        } else {
            Err(text(StatusCode::NOT_FOUND, format!("unknown service {:?}", key.name)))
        };
    }

    match (method, path.as_str()) {
        (Method::GET, "/_sim/faults") => Ok(json(StatusCode::OK, &shared.faults())),
        (Method::PUT, "/_sim/faults") => {
            let patch: FaultsPatch = read_json(req, false).await?.unwrap_or_default();
            Ok(json(StatusCode::OK, &shared.set_faults(patch)))
        }
        (Method::DELETE, "/_sim/faults") => Ok(json(StatusCode::OK, &shared.clear_faults())),
        (Method::POST, "/_sim/drop-blocking") => {
            Ok(json(StatusCode::OK, &serde_json::json!({"dropped": shared.drop_blocking()})))
        }
        (Method::POST, "/_sim/reset-index") => {
            let body: Option<IndexBody> = read_json(req, true).await?;
            let index = body.map_or(1, |b| b.index);
            shared.reset_indexes(index);
            Ok(json(StatusCode::OK, &serde_json::json!({"index": index})))
        }
        (Method::GET, "/_sim/requests") => {
            let mut records = shared.requests();
            if let Some(prefix) = param("path_prefix") {
                records.retain(|r| r.path.starts_with(&prefix));
            }
            Ok(json(StatusCode::OK, &records))
        }
        (Method::DELETE, "/_sim/requests") => {
            Ok(json(StatusCode::OK, &serde_json::json!({"cleared": shared.clear_requests()})))
        }
        (Method::GET, "/_sim/stats") => Ok(json(StatusCode::OK, &shared.stats())),
        (Method::DELETE, "/_sim/stats") => {
            shared.reset_stats();
            Ok(json(StatusCode::OK, &shared.stats()))
        }
        (_, "/_sim/faults" | "/_sim/drop-blocking" | "/_sim/reset-index" | "/_sim/requests" | "/_sim/stats") => {
            Err(text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed"))
        }
        _ => Err(text(StatusCode::NOT_FOUND, "unknown control endpoint")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_counts_down_and_serialises() {
        let mut b = Budget::Count(2);
        assert!(b.take());
        assert_eq!(b, Budget::Count(1));
        assert!(b.take());
        assert_eq!(b, Budget::Off);
        assert!(!b.take());
        let mut a = Budget::Always;
        assert!(a.take() && a.take());
        assert_eq!(serde_json::to_string(&Budget::Always).unwrap(), "\"always\"");
        assert_eq!(serde_json::from_str::<Budget>("3").unwrap(), Budget::Count(3));
        assert_eq!(serde_json::from_str::<Budget>("0").unwrap(), Budget::Off);
        assert!(serde_json::from_str::<Budget>("\"sometimes\"").is_err());
    }

    #[test]
    fn patch_rejects_unknown_fields() {
        assert!(serde_json::from_str::<FaultsPatch>(r#"{"latency": 5}"#).is_err());
        let p: FaultsPatch = serde_json::from_str(r#"{"no_leader": "always"}"#).unwrap();
        let mut f = Faults::defaults(false);
        f.apply(p);
        assert_eq!(f.no_leader, Budget::Always);
        assert_eq!(f.latency_ms, 0);
    }
}
