//! What the `/_sim/` control API sets and reports: injected faults, the request log and
//! connection statistics. Plain data, shared by the simulator's state and its control API.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::Config;
use super::acl::TokenSource;

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
    /// Added to every `/v1/health/state/any` answer once it is ready (a blocking one after
    /// it wakes): the time a real agent takes to build and send every check of a large
    /// catalog (hundreds of milliseconds at 75,000 checks), while other reads, the checks
    /// of one status among them, stay fast.
    pub checks_answer_ms: u64,
    /// Health queries answer 500 `No cluster leader`; while active, `/v1/status/leader`
    /// answers `""` (without consuming the budget).
    pub no_leader: Budget,
    /// Health queries answer 429 `Too Many Requests` (the RPC rate limit; the connection stays
    /// open, unlike the connection-limit 429).
    pub too_many_requests: Budget,
    /// Seconds of `Retry-After` on the 429s of `too_many_requests`; 0 sends none.
    pub retry_after_s: u64,
    /// Health queries answer 200 with Consul's headers and a body that is not JSON (an HTML
    /// error page, as a proxy in front of an agent may send), at once, without blocking.
    pub bad_body: Budget,
    /// Health queries answer 200 with the whole body's `Content-Length`, send half of the
    /// body, and close the connection: an answer cut off mid-body (at once, without blocking).
    pub truncated_body: Budget,
    /// Answer with the legacy `null` shapes (see [`crate`]).
    pub null_variants: bool,
    /// The `X-Consul-KnownLeader` header value (`false` is normal with the streaming backend).
    pub known_leader: bool,
    /// The agent has lost its servers: every `/v1/` request answers 500 `No known Consul
    /// servers`, except `?cached` health reads, which the agent's cache answers with what it
    /// held when it was cut off, `X-Cache: HIT` and an `Age` counting the seconds since.
    pub agent_cut_off: bool,
    /// A proxy between the client and the agent strips `X-Consul-Index` from every answer
    /// (the blocking still happens: the agent sees the `index` sent).
    pub strip_index: bool,
    /// A sameness group picks its member before the health filter: the first member with
    /// any instances (after the read's tags and `filter`) answers, and `?passing` then
    /// filters its instances, to nothing when none passes, rather than failing over.
    pub sameness_before_health: bool,
    /// A registration naming an unchanged check again leaves it as it is ([`Config::keeps_unchanged_checks`]).
    pub keeps_unchanged_checks: bool,
    /// Older agents' behaviours ([`Config::single_health_index`] and the fields after it;
    /// [`Config::legacy`] turns them all on): start-up values from the [`Config`], changeable
    /// at run time like any fault. Each applies to requests that arrive after it is set.
    pub single_health_index: bool,
    pub zero_index_when_empty: bool,
    pub first_tag_only: bool,
    pub no_server_cancel: bool,
    pub unknown_state_is_empty: bool,
    pub ignores_newer_parameters: bool,
}

/// The older-agent switches of [`Faults`], read once per request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Quirks {
    pub single_health_index: bool,
    pub zero_index_when_empty: bool,
    pub first_tag_only: bool,
    pub no_server_cancel: bool,
    pub unknown_state_is_empty: bool,
    pub ignores_newer_parameters: bool,
}

impl Faults {
    /// The start-up state: no faults, the configured response shapes and agent behaviours.
    pub(crate) fn defaults(config: &Config) -> Self {
        Faults {
            latency_ms: 0,
            checks_answer_ms: 0,
            no_leader: Budget::Off,
            too_many_requests: Budget::Off,
            retry_after_s: 0,
            bad_body: Budget::Off,
            truncated_body: Budget::Off,
            null_variants: config.null_variants,
            known_leader: true,
            agent_cut_off: false,
            strip_index: false,
            sameness_before_health: false,
            keeps_unchanged_checks: config.keeps_unchanged_checks,
            single_health_index: config.single_health_index,
            zero_index_when_empty: config.zero_index_when_empty,
            first_tag_only: config.first_tag_only,
            no_server_cancel: config.no_server_cancel,
            unknown_state_is_empty: config.unknown_state_is_empty,
            ignores_newer_parameters: config.ignores_newer_parameters,
        }
    }

    pub(crate) fn quirks(&self) -> Quirks {
        Quirks {
            single_health_index: self.single_health_index,
            zero_index_when_empty: self.zero_index_when_empty,
            first_tag_only: self.first_tag_only,
            no_server_cancel: self.no_server_cancel,
            unknown_state_is_empty: self.unknown_state_is_empty,
            ignores_newer_parameters: self.ignores_newer_parameters,
        }
    }

    pub(crate) fn apply(&mut self, patch: FaultsPatch) {
        let FaultsPatch {
            latency_ms,
            checks_answer_ms,
            no_leader,
            too_many_requests,
            retry_after_s,
            bad_body,
            truncated_body,
            null_variants,
            known_leader,
            agent_cut_off,
            strip_index,
            sameness_before_health,
            keeps_unchanged_checks,
            single_health_index,
            zero_index_when_empty,
            first_tag_only,
            no_server_cancel,
            unknown_state_is_empty,
            ignores_newer_parameters,
        } = patch;
        if let Some(v) = latency_ms {
            self.latency_ms = v;
        }
        if let Some(v) = checks_answer_ms {
            self.checks_answer_ms = v;
        }
        if let Some(v) = no_leader {
            self.no_leader = v;
        }
        if let Some(v) = too_many_requests {
            self.too_many_requests = v;
        }
        if let Some(v) = retry_after_s {
            self.retry_after_s = v;
        }
        if let Some(v) = bad_body {
            self.bad_body = v;
        }
        if let Some(v) = truncated_body {
            self.truncated_body = v;
        }
        if let Some(v) = null_variants {
            self.null_variants = v;
        }
        if let Some(v) = known_leader {
            self.known_leader = v;
        }
        let switches = [
            (single_health_index, &mut self.single_health_index),
            (zero_index_when_empty, &mut self.zero_index_when_empty),
            (first_tag_only, &mut self.first_tag_only),
            (no_server_cancel, &mut self.no_server_cancel),
            (unknown_state_is_empty, &mut self.unknown_state_is_empty),
            (ignores_newer_parameters, &mut self.ignores_newer_parameters),
            (agent_cut_off, &mut self.agent_cut_off),
            (strip_index, &mut self.strip_index),
            (sameness_before_health, &mut self.sameness_before_health),
            (keeps_unchanged_checks, &mut self.keeps_unchanged_checks),
        ];
        for (value, field) in switches {
            if let Some(v) = value {
                *field = v;
            }
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
    pub checks_answer_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub no_leader: Option<Budget>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub too_many_requests: Option<Budget>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_s: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bad_body: Option<Budget>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub truncated_body: Option<Budget>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub null_variants: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub known_leader: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_cut_off: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strip_index: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sameness_before_health: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keeps_unchanged_checks: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub single_health_index: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zero_index_when_empty: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_tag_only: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub no_server_cancel: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unknown_state_is_empty: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ignores_newer_parameters: Option<bool>,
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
    /// For `/v1/health/service` and `/v1/health/connect` queries: the service name (decoded).
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
    /// Open connections by negotiated protocol: `"h1"` (plain HTTP, or TLS with ALPN
    /// `http/1.1` or none) and `"h2"` (TLS with ALPN `h2`). Counted once serving, so a
    /// connection still in its TLS handshake (or refused) is in `open_connections` only.
    pub open_connections_by_protocol: BTreeMap<String, usize>,
    /// The most requests in flight at once on a single connection since start or the last
    /// reset (which restarts it from 0): above 1 only with HTTP/2 multiplexing.
    pub peak_streams_per_connection: usize,
    /// Connections refused with 429 because their client IP was at the limit.
    pub rejected_connections: u64,
    /// 429s produced by the `too_many_requests` fault.
    pub injected_429: u64,
    /// Every 429 sent: `rejected_connections + injected_429`.
    pub total_429: u64,
    /// `/v1/` requests received.
    pub requests_total: u64,
    /// Blocking queries currently waiting, per service name (`/v1/catalog/services` blockers
    /// are counted under `"_catalog_services"`, `/v1/health/state` blockers under
    /// `"_health_state"`, `/v1/health/connect/<name>` blockers under `"_connect/<name>"`).
    pub blocking: BTreeMap<String, usize>,
    pub blocking_total: usize,
    /// Blocking queries still held although their client went away (only with
    /// `no_server_cancel`; they are counted in `blocking` too, until their wait ends or a
    /// write wakes them).
    pub blocking_detached: usize,
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
        let mut f = Faults::defaults(&Config::default());
        f.apply(p);
        assert_eq!(f.no_leader, Budget::Always);
        assert_eq!(f.latency_ms, 0);
        f.apply(serde_json::from_str(r#"{"first_tag_only": true, "no_server_cancel": true}"#).unwrap());
        let q = f.quirks();
        assert!(q.first_tag_only && q.no_server_cancel && !q.single_health_index);
        assert_eq!(
            Faults::defaults(&Config::legacy()).quirks(),
            Quirks {
                single_health_index: true,
                zero_index_when_empty: true,
                first_tag_only: true,
                no_server_cancel: true,
                unknown_state_is_empty: true,
                ignores_newer_parameters: true,
            }
        );
    }
}
