//! The `ConsulResolver` spec: where a set of Mappings finds its Consul. With the `crd`
//! feature it is also the custom resource (`ConsulResolver`, status in [`crate::status`]).
//!
//! The doc comments on the spec fields become the CRD schema's descriptions, so they are
//! written for `kubectl explain consulresolver.spec`.

#[cfg(feature = "crd")]
use kube::CustomResource;
#[cfg(feature = "crd")]
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::rules::CelRule;
#[cfg(feature = "crd")]
use crate::status::ConsulResolverStatus;

/// The custom resource's API group, version and kind (the `crd` derive below spells them
/// out again: attributes cannot name constants; a test checks they agree).
pub const GROUP: &str = "consulresolver.io";
pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "ConsulResolver";

/// Where and how to query Consul for the services of Mappings that name this resolver.
// clippy reads the repeated `type_ = "integer"` of two printcolumns as a duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "crd", derive(CustomResource, JsonSchema))]
#[cfg_attr(
    feature = "crd",
    kube(
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
    )
)]
#[cfg_attr(feature = "crd", schemars(transform = spec_rules))]
#[serde(rename_all = "camelCase")]
pub struct ConsulResolverSpec {
    /// Consul HTTP address: `host:port` or `http(s)://host:port`. `${VAR}` is expanded from
    /// the operator's environment, for the variables its `--address-env` allows (default
    /// `HOST_IP`), e.g. `${HOST_IP}:8500` for the node-local agent.
    #[cfg_attr(
        feature = "crd",
        schemars(length(min = 1, max = 512), regex(pattern = r"^([Hh][Tt][Tt][Pp][Ss]?://)?[^\s/?#]+/?$"))
    )]
    pub address: String,

    /// Consul datacenter, sent as `?dc=`. Empty means the agent's own datacenter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(length(min = 1, max = 253), regex(pattern = r"^[A-Za-z0-9_.-]+$")))]
    pub datacenter: Option<String>,

    /// Consul Enterprise namespace, sent as `ns`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Za-z0-9_-]+$")))]
    pub namespace: Option<String>,

    /// Consul Enterprise admin partition, sent as `partition`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Za-z0-9_-]+$")))]
    pub partition: Option<String>,

    /// Consul cluster peer whose imported services to read (cluster peering, Consul 1.13+),
    /// sent as `?peer=`. Not with `samenessGroup`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "crd",
        schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$"))
    )]
    pub peer: Option<String>,

    /// Consul sameness group (Consul Enterprise 1.16+), sent as `?sameness-group=`: the
    /// instances of the group's first member (the local partition or a peer) that has
    /// healthy ones. Not with `peer`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "crd",
        schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$"))
    )]
    pub sameness_group: Option<String>,

    /// A Consul filter expression (go-bexpr, e.g. `Service.Meta.version == "2"`), sent as
    /// `?filter=` and applied by Consul (agents 1.4 and later). Consul's answer to an
    /// expression it cannot read is shown on this resolver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(length(min = 1, max = 2048)))]
    pub filter: Option<String>,

    /// Secret in this resolver's namespace holding the Consul ACL token, sent as
    /// `X-Consul-Token`. The token is re-read when the Secret changes and is never logged
    /// or shown in status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret_ref: Option<SecretKeyRef>,

    /// TLS settings for an `https://` address. Certificates are verified by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<ConsulTls>,

    /// The aggregate check statuses an instance may have to be published (its worst
    /// check, node checks included; maintenance counts as critical), e.g.
    /// `[passing, warning]`. Default `[passing]`. Replaces `onlyPassing`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(length(min = 1, max = 3), extend("x-kubernetes-list-type" = "set")))]
    pub health_statuses: Option<Vec<HealthStatus>>,

    /// Deprecated alias: `true` is `healthStatuses: [passing]`, `false` admits every status
    /// (critical included). Set one of the two, not both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub only_passing: Option<bool>,

    /// Only instances carrying all of these tags; `!tag` instead drops the instances that
    /// carry `tag`. Compared case-insensitively, as Consul does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(length(max = 64)))]
    pub tags: Option<Vec<NonEmpty>>,

    /// Read consistency: `default` (the leader answers), `stale` (any server, possibly
    /// behind; spreads the load) or `consistent` (the leader confirms it still leads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(schema_with = "consistency_schema"))]
    pub consistency: Option<ConsistencyMode>,

    /// Answer from the agent's cache (`?cached`), refreshed in the background by the agent.
    /// Not with `consistency: consistent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached: Option<bool>,

    /// Publish the services' Connect sidecar proxies (`/v1/health/connect/<service>`)
    /// instead of the services' own instances.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connect: Option<bool>,

    /// Which address of an instance to publish: `service` (its own address, or its node's
    /// when empty: the default), `node` (the node's), or the name of a tagged address such
    /// as `lan_ipv4`, `wan` or `wan_ipv6` (the service's, with its port, else the node's,
    /// else the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z][a-z0-9_]*$")))]
    pub address_type: Option<String>,

    /// Consul services to always watch through this resolver, even when no Mapping
    /// references them. At most 1,000: each is a watch of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(length(max = 1000)))]
    pub services: Option<Vec<NonEmpty>>,

    /// Ambassador IDs this resolver belongs to. The resolver is ignored unless the list
    /// contains the operator's `--ambassador-id` (default `default`). Empty or absent means
    /// `["default"]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(length(max = 64)))]
    pub ambassador_id: Option<Vec<NonEmpty>>,

    /// Which namespaces' Mappings may use this resolver, and with it its token (as Gateway
    /// API's `allowedRoutes.namespaces`). Absent: `from: Same`, only Mappings in this
    /// resolver's namespace. A Mapping elsewhere that names it gets a problem, and no watch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_namespaces: Option<AllowedNamespaces>,
}

/// How the fields of a spec must relate, as the API server checks it from Kubernetes 1.25
/// ([`crate::rules`]); the operator reports the same as `InvalidSpec`, with these messages.
pub const SPEC_RULES: [CelRule; 5] = [
    CelRule {
        rule: "!has(self.healthStatuses) || !has(self.onlyPassing)",
        message: "spec.healthStatuses and spec.onlyPassing are both set: keep healthStatuses",
    },
    // Required tags never start with `!`; an excluded one is the rest of a `!tag`. Compared
    // case-insensitively (ASCII), as Consul and the operator compare tags.
    CelRule {
        rule: "!has(self.tags) || !self.tags.exists(x, x.startsWith('!') \
               && self.tags.exists(t, !t.startsWith('!') && t.lowerAscii() == x.substring(1).lowerAscii()))",
        message: "spec.tags both requires and excludes a tag (`tag` and `!tag`, in any case): no instance could match",
    },
    CelRule {
        rule: "!has(self.cached) || !self.cached || !has(self.consistency) || self.consistency != 'consistent'",
        message: "spec.cached cannot be combined with consistency: consistent (the agent's cache is not)",
    },
    CelRule {
        rule: "!has(self.peer) || !has(self.samenessGroup)",
        message: "spec.peer and spec.samenessGroup are both set: a sameness group names its peers",
    },
    // A `${VAR}` may expand to the scheme, and only the operator knows its value: such an
    // address is left to the operator's check.
    CelRule {
        rule: "!has(self.tls) || self.address.lowerAscii().startsWith('https://') || self.address.contains('${')",
        message: "spec.tls is set but spec.address is not https://",
    },
];

#[cfg(feature = "crd")]
fn spec_rules(schema: &mut schemars::Schema) {
    crate::rules::add(schema, &SPEC_RULES);
}

/// Which namespaces' Mappings may use a resolver.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(feature = "crd", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct AllowedNamespaces {
    /// `Same` (the default): only the resolver's own namespace. `All`: every namespace the
    /// operator watches. `Selector`: its own and those whose labels match `selector`.
    #[serde(default)]
    pub from: FromNamespaces,

    /// With `from: Selector`, the namespaces' labels to match (as a Kubernetes label
    /// selector: `matchLabels` and `matchExpressions`, all of them must hold). Absent, it
    /// matches no other namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<NamespaceSelector>,
}

/// Where the Mappings that may use a resolver come from (Gateway API's `FromNamespaces`).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "crd", derive(JsonSchema))]
pub enum FromNamespaces {
    #[default]
    Same,
    All,
    Selector,
}

/// A label selector over namespaces (Kubernetes' `LabelSelector`).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(feature = "crd", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct NamespaceSelector {
    /// Labels a namespace must carry, with these values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub match_labels: Option<BTreeMap<String, String>>,
    /// Requirements a namespace's labels must meet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(length(max = 32)))]
    pub match_expressions: Option<Vec<LabelRequirement>>,
}

/// One requirement of a namespace selector.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "crd", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct LabelRequirement {
    pub key: String,
    pub operator: LabelOperator,
    /// The values for `In` and `NotIn` (at least one); none for `Exists` and `DoesNotExist`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub values: Option<Vec<String>>,
}

/// How a requirement compares a label.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "crd", derive(JsonSchema))]
pub enum LabelOperator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

impl NamespaceSelector {
    /// Whether `labels` meet the selector, as the API server decides it. A requirement
    /// that cannot hold as written (`In` without values, `Exists` with some) matches
    /// nothing, rather than everything.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        let by_label = self.match_labels.iter().flatten().all(|(k, v)| labels.get(k) == Some(v));
        by_label
            && self.match_expressions.iter().flatten().all(|r| {
                let values = r.values.as_deref().unwrap_or_default();
                let value = labels.get(&r.key);
                match r.operator {
                    LabelOperator::In => !values.is_empty() && value.is_some_and(|v| values.contains(v)),
                    LabelOperator::NotIn => !values.is_empty() && value.is_none_or(|v| !values.contains(v)),
                    LabelOperator::Exists => values.is_empty() && value.is_some(),
                    LabelOperator::DoesNotExist => values.is_empty() && value.is_none(),
                }
            })
    }
}

impl ConsulResolverSpec {
    /// Whether Mappings in `namespace`, whose labels are `labels` (`None`: not known), may
    /// use this resolver, itself in `own_namespace`.
    pub fn serves_namespace(
        &self,
        own_namespace: &str,
        namespace: &str,
        labels: Option<&BTreeMap<String, String>>,
    ) -> bool {
        if namespace == own_namespace {
            return true;
        }
        let Some(allowed) = &self.allowed_namespaces else { return false };
        match allowed.from {
            FromNamespaces::Same => false,
            FromNamespaces::All => true,
            FromNamespaces::Selector => allowed.selector.as_ref().zip(labels).is_some_and(|(s, l)| s.matches(l)),
        }
    }

    /// Whether whom it serves depends on namespaces' labels.
    pub fn selects_namespaces(&self) -> bool {
        self.allowed_namespaces.as_ref().is_some_and(|a| a.from == FromNamespaces::Selector)
    }
}

/// A non-empty string of at most 512 characters (the schema rejects `""` and longer strings
/// so mistakes surface at `kubectl apply`).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(transparent)]
pub struct NonEmpty(pub String);

#[cfg(feature = "crd")]
impl JsonSchema for NonEmpty {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "NonEmptyString".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({ "type": "string", "minLength": 1, "maxLength": 512 })
    }
}

impl std::ops::Deref for NonEmpty {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

/// A Consul check status.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "crd", derive(JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum HealthStatus {
    Passing,
    Warning,
    Critical,
}

/// Consul's read consistency modes.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "crd", derive(JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum ConsistencyMode {
    #[default]
    Default,
    Stale,
    Consistent,
}

/// The schema of an optional `consistency`: the derived one lists `null` among the enum's
/// values, which the API server refuses in a CRD ("unknown object type nil"). `maxLength`
/// (the longest value's) bounds the cost of the rule that reads it ([`SPEC_RULES`]).
#[cfg(feature = "crd")]
fn consistency_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "enum": ["default", "stale", "consistent"],
        "maxLength": 10,
        "nullable": true,
        "description": "Read consistency: `default` (the leader answers), `stale` (any server, possibly behind; spreads the load) or `consistent` (the leader confirms it still leads)."
    })
}

/// A key of a Secret in the resolver's own namespace.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "crd", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Name of the Secret (same namespace as the resolver).
    #[cfg_attr(
        feature = "crd",
        schemars(
            length(min = 1, max = 253),
            regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
        )
    )]
    pub name: String,
    /// Key within the Secret's data.
    #[cfg_attr(feature = "crd", schemars(length(min = 1, max = 253), regex(pattern = r"^[-._a-zA-Z0-9]+$")))]
    pub key: String,
}

/// How the fields of `spec.tls` must relate ([`SPEC_RULES`] for the rest of the spec).
pub const TLS_RULES: [CelRule; 1] = [CelRule {
    rule: "has(self.clientCertSecretRef) == has(self.clientKeySecretRef)",
    message: "spec.tls.clientCertSecretRef and spec.tls.clientKeySecretRef go together: set both or neither",
}];

#[cfg(feature = "crd")]
fn tls_rules(schema: &mut schemars::Schema) {
    crate::rules::add(schema, &TLS_RULES);
}

/// TLS to Consul.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[cfg_attr(feature = "crd", derive(JsonSchema))]
#[cfg_attr(feature = "crd", schemars(transform = tls_rules))]
#[serde(rename_all = "camelCase")]
pub struct ConsulTls {
    /// Secret key holding the PEM CA bundle that signs Consul's certificate. Absent means
    /// the system roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretKeyRef>,
    /// Name to verify the server certificate against (SNI), when it differs from the
    /// address's host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(length(min = 1, max = 253), regex(pattern = r"^[A-Za-z0-9.-]+$")))]
    pub server_name: Option<String>,
    /// Skip certificate verification. Off by default; for test clusters only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub insecure_skip_verify: Option<bool>,
    /// Secret key holding the PEM client certificate (chain) presented to Consul, for a
    /// Consul that verifies incoming HTTPS clients (`verify_incoming`). Set together with
    /// `clientKeySecretRef`; for a `kubernetes.io/tls` Secret the keys are `tls.crt` and
    /// `tls.key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert_secret_ref: Option<SecretKeyRef>,
    /// Secret key holding the PEM private key of `clientCertSecretRef` (PKCS#8, PKCS#1 or
    /// SEC1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key_secret_ref: Option<SecretKeyRef>,
}

impl ConsulResolverSpec {
    /// Whether this resolver belongs to the operator's Ambassador ID.
    pub fn serves_ambassador_id(&self, id: &str) -> bool {
        match self.ambassador_id.as_deref() {
            None | Some([]) => id == crate::DEFAULT_AMBASSADOR_ID,
            Some(ids) => ids.iter().any(|i| i.0 == id),
        }
    }
}

#[cfg(all(test, feature = "crd"))]
mod tests {
    use super::*;

    #[test]
    fn the_constants_name_the_custom_resource() {
        use kube::Resource;
        assert_eq!(ConsulResolver::group(&()), GROUP);
        assert_eq!(ConsulResolver::version(&()), VERSION);
        assert_eq!(ConsulResolver::kind(&()), KIND);
    }
}

#[cfg(test)]
mod sharing_tests {
    use super::*;

    fn spec(allowed: serde_json::Value) -> ConsulResolverSpec {
        serde_json::from_value(serde_json::json!({"address": "127.0.0.1:8500", "allowedNamespaces": allowed})).unwrap()
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn whom_a_resolver_serves() {
        let team = labels(&[("team", "shop"), ("env", "prod")]);
        let other = labels(&[("team", "blog")]);
        let unshared: ConsulResolverSpec = serde_json::from_value(serde_json::json!({"address": "a:1"})).unwrap();
        assert!(unshared.serves_namespace("a", "a", None), "its own namespace, always");
        assert!(!unshared.serves_namespace("a", "b", Some(&team)), "absent is Same");
        assert!(!spec(serde_json::json!({"from": "Same"})).serves_namespace("a", "b", Some(&team)));
        assert!(spec(serde_json::json!({"from": "All"})).serves_namespace("a", "b", None));

        let by_label = spec(serde_json::json!({"from": "Selector", "selector": {"matchLabels": {"team": "shop"}}}));
        assert!(by_label.selects_namespaces());
        assert!(by_label.serves_namespace("a", "b", Some(&team)));
        assert!(!by_label.serves_namespace("a", "b", Some(&other)));
        assert!(!by_label.serves_namespace("a", "b", None), "labels not known: not served");
        assert!(!spec(serde_json::json!({"from": "Selector"})).serves_namespace("a", "b", Some(&team)), "no selector");
        let empty = spec(serde_json::json!({"from": "Selector", "selector": {}}));
        assert!(empty.serves_namespace("a", "b", Some(&other)), "an empty selector selects every namespace");

        let expr = |op: &str, values: serde_json::Value| {
            spec(serde_json::json!({"from": "Selector", "selector": {"matchExpressions": [
                {"key": "team", "operator": op, "values": values}]}}))
        };
        assert!(expr("In", serde_json::json!(["shop", "pay"])).serves_namespace("a", "b", Some(&team)));
        assert!(!expr("In", serde_json::json!(["pay"])).serves_namespace("a", "b", Some(&team)));
        assert!(!expr("In", serde_json::json!([])).serves_namespace("a", "b", Some(&team)), "In without values");
        assert!(expr("NotIn", serde_json::json!(["blog"])).serves_namespace("a", "b", Some(&team)));
        assert!(expr("NotIn", serde_json::json!(["blog"])).serves_namespace("a", "b", Some(&labels(&[]))));
        assert!(!expr("NotIn", serde_json::json!(["blog"])).serves_namespace("a", "b", Some(&other)));
        assert!(expr("Exists", serde_json::json!(null)).serves_namespace("a", "b", Some(&other)));
        assert!(
            !expr("Exists", serde_json::json!(["x"])).serves_namespace("a", "b", Some(&other)),
            "Exists with values"
        );
        assert!(expr("DoesNotExist", serde_json::json!(null)).serves_namespace("a", "b", Some(&labels(&[]))));
        assert!(!expr("DoesNotExist", serde_json::json!(null)).serves_namespace("a", "b", Some(&other)));
        // matchLabels and matchExpressions: both must hold.
        let both = spec(serde_json::json!({"from": "Selector", "selector": {"matchLabels": {"env": "prod"},
            "matchExpressions": [{"key": "team", "operator": "In", "values": ["shop"]}]}}));
        assert!(both.serves_namespace("a", "b", Some(&team)));
        assert!(!both.serves_namespace("a", "b", Some(&labels(&[("team", "shop")]))));
    }
}
