//! The `ConsulResolver` status (the `crd` feature): what the operator last observed and
//! published for a resolver, and its condition types and reasons.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Condition types the operator sets on a ConsulResolver's status.
pub mod condition {
    /// The resolver's services are watched and its part of the snapshot was published.
    pub const READY: &str = "Ready";
    /// The last query to Consul for this resolver succeeded.
    pub const CONSUL_REACHABLE: &str = "ConsulReachable";
    /// Every service of this resolver answered once (or the bootstrap timeout passed).
    pub const BOOTSTRAPPED: &str = "Bootstrapped";
    /// Reason used on `Ready=False` when the spec cannot be used as written.
    pub const REASON_INVALID_SPEC: &str = "InvalidSpec";
    /// Reason used when a Secret the spec names is missing or unreadable.
    pub const REASON_SECRET_UNAVAILABLE: &str = "SecretUnavailable";
}

/// What the operator last observed and published for this resolver.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConsulResolverStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `ConsulReachable` and `Bootstrapped`, as metav1.Conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Number of Consul services watched through this resolver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub services: Option<u32>,
    /// Number of endpoints across those services in the last snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<u32>,
    /// The snapshot in which this status last changed (statuses are written only when
    /// they change, not on every publication).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_snapshot: Option<SnapshotRef>,
    /// Per-service detail, sorted by name and bounded (see `servicesTruncated`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub service_details: Vec<ServiceStatus>,
    /// True when `serviceDetails` was cut to its bound; counts above stay exact.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub services_truncated: bool,
}

/// A published snapshot, by id and time.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotRef {
    pub id: u64,
    /// RFC 3339 time of publication.
    pub time: String,
}

/// One watched Consul service of a resolver.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceStatus {
    pub name: String,
    pub endpoints: u32,
    /// Consul's `X-Consul-Index` for the last answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u64>,
    /// RFC 3339 time the operator saw this service's endpoints change (or first saw them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_change: Option<String>,
    /// The last error querying this service, if the last query failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// Present when the endpoints published for this service are the ones last obtained,
    /// not a current answer (the resolver's settings changed, its spec or Secret is not
    /// usable, or its queries fail).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale: Option<StaleStatus>,
}

/// Since when, and why, a service's published endpoints are not current.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StaleStatus {
    /// RFC 3339 time from which they have been stale.
    pub since: String,
    pub reason: String,
}
