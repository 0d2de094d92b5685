//! The `ConsulResolver` custom resource: where a set of Mappings finds its Consul.
//!
//! The doc comments on the spec fields become the CRD schema's descriptions, so they are
//! written for `kubectl explain consulresolver.spec`.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
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

/// Where and how to query Consul for the services of Mappings that name this resolver.
// clippy reads the repeated `type_ = "integer"` of two printcolumns as a duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[kube(
    group = "consulresolver.io",
    version = "v1alpha1",
    kind = "ConsulResolver",
    plural = "consulresolvers",
    singular = "consulresolver",
    shortname = "cres",
    namespaced,
    status = "ConsulResolverStatus",
    derive = "PartialEq",
    doc = "A Consul agent or server that Ambassador Mappings resolve their services through.",
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
    printcolumn(name = "Services", type_ = "integer", json_path = ".status.services"),
    printcolumn(name = "Endpoints", type_ = "integer", json_path = ".status.endpoints"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct ConsulResolverSpec {
    /// Consul HTTP address: `host:port` or `http(s)://host:port`. `${VAR}` is expanded from
    /// the operator's environment, e.g. `${HOST_IP}:8500` for the node-local agent.
    #[schemars(length(min = 1))]
    pub address: String,

    /// Consul datacenter, sent as `?dc=`. Empty means the agent's own datacenter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub datacenter: Option<String>,

    /// Consul Enterprise namespace, sent as `ns`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub namespace: Option<String>,

    /// Consul Enterprise admin partition, sent as `partition`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub partition: Option<String>,

    /// Secret in this resolver's namespace holding the Consul ACL token, sent as
    /// `X-Consul-Token`. The token is re-read when the Secret changes and is never logged
    /// or shown in status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret_ref: Option<SecretKeyRef>,

    /// TLS settings for an `https://` address. Certificates are verified by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<ConsulTls>,

    /// Only instances whose every check is passing (Consul's `?passing`). Default `true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub only_passing: Option<bool>,

    /// Only instances carrying all of these tags.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tags: Option<Vec<NonEmpty>>,

    /// Consul services to always watch through this resolver, even when no Mapping
    /// references them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub services: Option<Vec<NonEmpty>>,

    /// Ambassador IDs this resolver belongs to. The resolver is ignored unless the list
    /// contains the operator's `--ambassador-id` (default `default`). Empty or absent means
    /// `["default"]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ambassador_id: Option<Vec<NonEmpty>>,
}

/// A non-empty string (the schema rejects `""` so mistakes surface at `kubectl apply`).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(transparent)]
pub struct NonEmpty(pub String);

impl JsonSchema for NonEmpty {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "NonEmptyString".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({ "type": "string", "minLength": 1 })
    }
}

impl std::ops::Deref for NonEmpty {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

/// A key of a Secret in the resolver's own namespace.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Name of the Secret (same namespace as the resolver).
    #[schemars(length(min = 1))]
    pub name: String,
    /// Key within the Secret's data.
    #[schemars(length(min = 1))]
    pub key: String,
}

/// TLS to Consul.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConsulTls {
    /// Secret key holding the PEM CA bundle that signs Consul's certificate. Absent means
    /// the system roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretKeyRef>,
    /// Name to verify the server certificate against (SNI), when it differs from the
    /// address's host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub server_name: Option<String>,
    /// Skip certificate verification. Off by default; for test clusters only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub insecure_skip_verify: Option<bool>,
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

impl ConsulResolverSpec {
    /// Whether this resolver belongs to the operator's Ambassador ID.
    pub fn serves_ambassador_id(&self, id: &str) -> bool {
        match self.ambassador_id.as_deref() {
            None | Some([]) => id == crate::api::DEFAULT_AMBASSADOR_ID,
            Some(ids) => ids.iter().any(|i| i.0 == id),
        }
    }

    pub fn only_passing(&self) -> bool {
        self.only_passing.unwrap_or(true)
    }
}
