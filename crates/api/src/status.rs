//! The `ConsulResolver` status (the `crd` feature): what the operator last observed and
//! published for a resolver, and its condition types and reasons.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Condition types the operator sets on a ConsulResolver's status, in the order it lists
/// them.
pub mod condition {
    /// Whether the resolver's part of the snapshot is current: its spec is usable and every
    /// service it names answered its last query.
    pub const READY: &str = "Ready";
    /// Whether the last query to Consul for each of this resolver's services succeeded.
    pub const CONSUL_REACHABLE: &str = "ConsulReachable";
    /// Whether every service of this resolver answered at least once.
    pub const BOOTSTRAPPED: &str = "Bootstrapped";

    /// Every condition type, in the order they appear on the status.
    pub const ALL: [&str; 3] = [READY, CONSUL_REACHABLE, BOOTSTRAPPED];
}

/// Reasons of the resolver's conditions (and of its Warning Events), each with the
/// conditions that carry it. `docs/snapshot.md` lists them (a test checks it).
pub mod reason {
    // Why the resolver cannot be queried as it stands: the snapshot's `unusable.reason`
    // (the core's `UnusableReason`), set on all three conditions.

    /// The spec cannot be used as written (fixed by editing the resolver): `Ready=False`,
    /// `ConsulReachable=Unknown`, `Bootstrapped=False`, and a Warning Event.
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// A Secret the spec names is missing, unreadable or does not hold what the spec says:
    /// `Ready=False`, `ConsulReachable=False`, `Bootstrapped=False`, and a Warning Event.
    pub const SECRET_UNAVAILABLE: &str = "SecretUnavailable";
    /// A Secret the spec names has not been read yet, a moment after it is first named:
    /// `Ready=False`, `ConsulReachable=Unknown`, `Bootstrapped=False`.
    pub const WAITING_FOR_SECRET: &str = "WaitingForSecret";

    // Ready.

    /// `Ready=True`: usable, and every service answered its last query.
    pub const PUBLISHED: &str = "Published";
    /// `Ready=False`: a query to Consul failed (`ConsulReachable=False/QueryFailed`).
    pub const CONSUL_UNREACHABLE: &str = "ConsulUnreachable";
    /// `Ready=False`: some services have not answered yet (`Bootstrapped=False`).
    pub const BOOTSTRAP_INCOMPLETE: &str = "BootstrapIncomplete";

    // ConsulReachable.

    /// `ConsulReachable=True`: the last query of every service succeeded.
    pub const QUERIES_SUCCEEDED: &str = "QueriesSucceeded";
    /// `ConsulReachable=False`: the last query of at least one service failed.
    pub const QUERY_FAILED: &str = "QueryFailed";
    /// `ConsulReachable=Unknown`: no Mapping uses the resolver and it names no service.
    pub const NO_SERVICES: &str = "NoServices";
    /// `ConsulReachable=Unknown`: no query has failed, but some services have not answered
    /// yet.
    pub const WAITING: &str = "Waiting";

    // Bootstrapped.

    /// `Bootstrapped=True`: every service answered at least once.
    pub const ALL_SERVICES_ANSWERED: &str = "AllServicesAnswered";
    /// `Bootstrapped=False`: some services have not answered since the operator started or
    /// the resolver's settings changed.
    pub const SERVICES_UNSYNCED: &str = "ServicesUnsynced";

    /// Every reason the operator sets.
    pub const ALL: [&str; 12] = [
        INVALID_SPEC,
        SECRET_UNAVAILABLE,
        WAITING_FOR_SECRET,
        PUBLISHED,
        CONSUL_UNREACHABLE,
        BOOTSTRAP_INCOMPLETE,
        QUERIES_SUCCEEDED,
        QUERY_FAILED,
        NO_SERVICES,
        WAITING,
        ALL_SERVICES_ANSWERED,
        SERVICES_UNSYNCED,
    ];
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

/// Condition types and reasons of a `ConsulService` (an export). docs/export.md lists them.
pub mod export {
    /// Whether the Service and its slices hold the service's current endpoints.
    pub const READY: &str = "Ready";
    /// Whether the Service and its slices are written as the export says.
    pub const EXPORTED: &str = "Exported";
    /// Whether a Service of the export's name exists that the operator does not own (it is
    /// then never touched, and no slice is written for it).
    pub const CONFLICT: &str = "Conflict";
    /// Every condition type, in the order they appear on the status.
    pub const ALL: [&str; 3] = [READY, EXPORTED, CONFLICT];

    pub mod reason {
        /// `Ready=True`, `Exported=True`: written, from a current answer.
        pub const EXPORTED: &str = "Exported";
        /// `Ready=False`: the endpoints are the ones last obtained (Consul unreachable, the
        /// resolver unusable); slices carry the stale annotations.
        pub const STALE: &str = "Stale";
        /// `Ready=False`: Consul has not answered for the service yet.
        pub const WAITING: &str = "WaitingForConsul";
        /// The spec cannot be used as written.
        pub const INVALID_SPEC: &str = "InvalidSpec";
        /// The resolver named is missing, ambiguous, does not serve this namespace, or is
        /// unusable.
        pub const RESOLVER_UNAVAILABLE: &str = "ResolverUnavailable";
        /// `Conflict=True`: a Service of this name exists and is not ours.
        pub const SERVICE_EXISTS: &str = "ServiceExists";
        /// `Conflict=False`.
        pub const NO_CONFLICT: &str = "NoConflict";
        /// `Exported=False`: a write to the API server failed (retried with backoff).
        pub const WRITE_FAILED: &str = "WriteFailed";
    }
}

/// What the operator last wrote for an export.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConsulServiceStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Exported` and `Conflict`, as metav1.Conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The Service the operator manages for this export (same namespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    /// Endpoints in its slices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<u32>,
    /// Instances left out (see `excludedInstances`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub excluded: Option<u32>,
    /// EndpointSlices written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slices: Option<u32>,
    /// The first instances left out, and why (bounded; `excluded` is the exact count).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub excluded_instances: Vec<ExcludedInstance>,
    /// Present while the slices hold the endpoints last obtained, not a current answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale: Option<StaleStatus>,
}

/// A Consul instance an export leaves out.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExcludedInstance {
    pub node: String,
    pub service_id: String,
    pub address: String,
    /// Why, e.g. "loopback address (127.0.0.0/8)".
    pub reason: String,
}
