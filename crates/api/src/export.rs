//! The `ConsulService` spec: one Consul service exported as a Kubernetes Service without a
//! selector and its EndpointSlices, for any consumer (kube-proxy, a mesh, a Gateway API
//! implementation, `curl http://name.namespace`). With the `crd` feature it is also the
//! custom resource, with its status. docs/export.md says what consumers see, and why.
//!
//! The doc comments on the spec fields become the CRD schema's descriptions, so they are
//! written for `kubectl explain consulservice.spec`.

use std::collections::BTreeMap;

#[cfg(feature = "crd")]
use kube::CustomResource;
#[cfg(feature = "crd")]
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::names;
use crate::resolver::NonEmpty;
use crate::rules::CelRule;

/// The custom resource's kind (its group and version are the resolver's).
pub const KIND: &str = "ConsulService";

/// Most ports a Service may expose here: each is a port of every slice.
pub const MAX_PORTS: usize = 32;

/// Most labels, and most annotations, an export may put on its Service.
pub const MAX_SERVICE_METADATA: usize = 64;
/// Longest annotation value an export may put on its Service: 64 of them, with their keys,
/// stay well within the API server's 256 KiB for all of an object's annotations.
pub const MAX_ANNOTATION_VALUE: usize = 2048;

/// Export one Consul service, read through a ConsulResolver, as a Kubernetes Service
/// without a selector (same name, same namespace) and its EndpointSlices.
#[allow(clippy::duplicated_attributes)]
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "crd", derive(CustomResource, JsonSchema))]
#[cfg_attr(
    feature = "crd",
    kube(
        group = "consulresolver.io",
        version = "v1alpha1",
        kind = "ConsulService",
        plural = "consulservices",
        singular = "consulservice",
        shortname = "csvc",
        namespaced,
        status = "crate::status::ConsulServiceStatus",
        derive = "PartialEq",
        doc = "A Consul service exported as a Kubernetes Service and EndpointSlices.",
        printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
        printcolumn(name = "Consul", type_ = "string", json_path = ".spec.service"),
        printcolumn(name = "Endpoints", type_ = "integer", json_path = ".status.endpoints"),
        printcolumn(name = "Excluded", type_ = "integer", json_path = ".status.excluded"),
        printcolumn(name = "Slices", type_ = "integer", json_path = ".status.slices"),
        printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ConsulServiceSpec {
    /// The ConsulResolver to read the service through, found as a Mapping's `resolver` is:
    /// one of that name in this namespace, else the single one elsewhere whose
    /// `allowedNamespaces` admits this namespace. Absent: the operator's
    /// `--default-resolver`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(length(min = 1, max = 253)))]
    pub resolver: Option<String>,

    /// The Consul service's name. Its instances are the endpoints; which of them are
    /// admitted (health, tags, filter) is the resolver's business.
    #[cfg_attr(feature = "crd", schemars(length(min = 1, max = 512)))]
    pub service: String,

    /// The Service's ports. Absent: one port per distinct instance port, named
    /// `tcp-<port>`, each forwarding to the instances registered with that port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(length(min = 1, max = 32), transform = ports_rules))]
    pub ports: Option<Vec<ExportPort>>,

    /// A headless Service (`clusterIP: None`): DNS answers with the endpoints' addresses,
    /// and no virtual IP is allocated. Changing it replaces the Service (its clusterIP
    /// cannot change in place).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headless: Option<bool>,

    /// The address family of the Service and its slices. Instances of the other family
    /// are left out and reported in the status. Default `IPv4`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(schema_with = "ip_family_schema"))]
    pub ip_family: Option<IpFamily>,

    /// Also write a core `Endpoints` object of the Service's name, for consumers that read
    /// Endpoints rather than EndpointSlices (Emissary's KubernetesEndpointResolver,
    /// Prometheus `role: endpoints`, Traefik before 3.1); without it they see the Service as
    /// empty. At most 1,000 addresses (ready first, then by address), annotated
    /// `endpoints.kubernetes.io/over-capacity: truncated` when cut. Off by default:
    /// Endpoints are deprecated from Kubernetes 1.33, and every change is written twice.
    /// Turning it off deletes the Endpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<bool>,

    /// `PreferClose`: zone-aware routing. Each endpoint's slice entry is hinted for its own
    /// Consul locality zone (`hints.forZones`), so kube-proxy sends a node's traffic to
    /// endpoints in the node's zone; no hints at all while any endpoint has no zone. Consul
    /// zone names must be the nodes' `topology.kubernetes.io/zone` values. Absent: no hints
    /// ever (kube-proxy follows hints whenever every endpoint has one). Hints need
    /// Kubernetes 1.21 or later (`discovery.k8s.io/v1`); on 1.20 none are written. From
    /// 1.31 the Service carries `spec.trafficDistribution: PreferClose` too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(schema_with = "traffic_distribution_schema"))]
    pub traffic_distribution: Option<TrafficDistribution>,

    /// Labels to put on the Service, for what selects Services by label (a
    /// ServiceMonitor). Removing one here removes it from the Service. The operator's own
    /// keys (`app.kubernetes.io/managed-by`, anything under `consulresolver.io/`, and the
    /// Kubernetes keys it writes on slices and Endpoints) are refused. At most 64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(schema_with = "service_labels_schema"))]
    pub service_labels: Option<BTreeMap<String, String>>,

    /// Annotations to put on the Service, for what reads Services' annotations
    /// (external-dns). Removing one here removes it from the Service. The operator's own
    /// keys are refused, as for `serviceLabels`. At most 64, each value at most 2048
    /// characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(schema_with = "service_annotations_schema"))]
    pub service_annotations: Option<BTreeMap<String, String>>,

    /// Ambassador IDs this export belongs to, as a resolver's: ignored unless the list
    /// contains the operator's `--ambassador-id`. Empty or absent means `["default"]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(length(max = 64)))]
    pub ambassador_id: Option<Vec<NonEmpty>>,
}

/// How the ports of `spec.ports` must relate, as the API server checks it from Kubernetes
/// 1.25 ([`crate::rules`]); the operator reports the same as `InvalidSpec`. Each port is
/// its own only once in the list; a port without a protocol is TCP, as the Service's.
pub const PORTS_RULES: [CelRule; 2] = [
    CelRule {
        rule: "self.all(p, self.exists_one(q, q.name == p.name))",
        message: "spec.ports: two ports have the same name",
    },
    CelRule {
        rule: "self.all(p, self.exists_one(q, q.port == p.port \
               && (has(q.protocol) ? q.protocol : 'TCP') == (has(p.protocol) ? p.protocol : 'TCP')))",
        message: "spec.ports: two ports have the same port and protocol (TCP when not set)",
    },
];

#[cfg(feature = "crd")]
fn ports_rules(schema: &mut schemars::Schema) {
    crate::rules::add(schema, &PORTS_RULES);
}

/// One port of the exported Service.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "crd", derive(JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ExportPort {
    /// The port's name, also the slices' port name (consumers join the two by it): a DNS
    /// label.
    #[cfg_attr(
        feature = "crd",
        schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))
    )]
    pub name: String,
    /// The port the Service listens on.
    #[cfg_attr(feature = "crd", schemars(range(min = 1, max = 65535)))]
    pub port: u16,
    /// The instances' port to forward to. Absent: each instance's port as registered in
    /// Consul.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(range(min = 1, max = 65535)))]
    pub target_port: Option<u16>,
    /// `TCP` (default), `UDP` or `SCTP`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(schema_with = "protocol_schema"))]
    pub protocol: Option<Protocol>,
    /// The application protocol (`http`, `kubernetes.io/h2c`, ...), passed on to consumers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(length(min = 1, max = 316)))]
    pub app_protocol: Option<String>,
}

#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[cfg_attr(feature = "crd", derive(JsonSchema))]
pub enum Protocol {
    #[default]
    #[serde(rename = "TCP")]
    Tcp,
    #[serde(rename = "UDP")]
    Udp,
    #[serde(rename = "SCTP")]
    Sctp,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }
}

#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[cfg_attr(feature = "crd", derive(JsonSchema))]
pub enum IpFamily {
    #[default]
    IPv4,
    IPv6,
}

impl IpFamily {
    pub fn as_str(self) -> &'static str {
        match self {
            IpFamily::IPv4 => "IPv4",
            IpFamily::IPv6 => "IPv6",
        }
    }
}

/// How traffic to the exported Service is spread over its endpoints.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "crd", derive(JsonSchema))]
pub enum TrafficDistribution {
    /// Endpoints in the client's zone first (zone hints on the slices).
    PreferClose,
}

// Optional enums: the derived schema lists `null` among the values, which the API server
// refuses in a CRD ("unknown object type nil"), as for the resolver's `consistency`. A
// protocol's `maxLength` (the longest value's) bounds the cost of the rule that reads it.
#[cfg(feature = "crd")]
fn ip_family_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "enum": ["IPv4", "IPv6"],
        "nullable": true,
        "description": "The address family of the Service and its slices: `IPv4` (default) or `IPv6`. Instances of the other family are left out and reported in the status."
    })
}

#[cfg(feature = "crd")]
fn traffic_distribution_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "enum": ["PreferClose"],
        "nullable": true,
        "description": "`PreferClose`: each endpoint is hinted for its own Consul locality zone (`hints.forZones`), so kube-proxy keeps a node's traffic in its zone; no hints while any endpoint has no zone. Consul zone names must be the nodes' `topology.kubernetes.io/zone` values. Absent: no hints ever. Hints need Kubernetes 1.21 or later; on 1.20 none are written. From 1.31 the Service carries `spec.trafficDistribution: PreferClose` too."
    })
}

#[cfg(feature = "crd")]
fn protocol_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "string",
        "enum": ["TCP", "UDP", "SCTP"],
        "maxLength": 4,
        "nullable": true,
        "description": "`TCP` (default), `UDP` or `SCTP`."
    })
}

// Maps bounded in the schema: the API server refuses an export with too many keys or too
// long a value, before the operator sees it. Key syntax is the operator's to check (a
// structural schema cannot constrain a map's keys).
#[cfg(feature = "crd")]
fn service_labels_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "additionalProperties": {"type": "string", "maxLength": 63},
        "maxProperties": MAX_SERVICE_METADATA,
        "nullable": true
    })
}

#[cfg(feature = "crd")]
fn service_annotations_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "additionalProperties": {"type": "string", "maxLength": MAX_ANNOTATION_VALUE},
        "maxProperties": MAX_SERVICE_METADATA,
        "nullable": true
    })
}

impl ConsulServiceSpec {
    /// Whether this export belongs to the operator's Ambassador ID.
    pub fn serves_ambassador_id(&self, id: &str) -> bool {
        match self.ambassador_id.as_deref() {
            None | Some([]) => id == crate::DEFAULT_AMBASSADOR_ID,
            Some(ids) => ids.iter().any(|i| i.0 == id),
        }
    }

    /// What the schema cannot say: the rules a Service's ports must follow, checked before
    /// anything is written. `name` is the export's (and so the Service's) name.
    pub fn validate(&self, name: &str) -> Result<(), String> {
        names::dns1035_label(name).map_err(|why| format!("metadata.name {name:?} cannot name a Service: it {why}"))?;
        if self.service.trim().is_empty() {
            return Err("spec.service is empty".into());
        }
        if let Some(r) = &self.resolver {
            names::dns1123_subdomain(r).map_err(|why| format!("spec.resolver {r:?} is not a valid name: it {why}"))?;
        }
        self.validate_service_metadata()?;
        let Some(ports) = &self.ports else { return Ok(()) };
        if ports.is_empty() {
            return Err("spec.ports is empty: leave it out to expose the instances' own ports".into());
        }
        if ports.len() > MAX_PORTS {
            return Err(format!("spec.ports has {} ports; at most {MAX_PORTS}", ports.len()));
        }
        for (i, p) in ports.iter().enumerate() {
            names::dns1123_label(&p.name)
                .map_err(|why| format!("spec.ports[{i}].name {:?} is not a valid port name: it {why}", p.name))?;
            if p.port == 0 || p.target_port == Some(0) {
                return Err(format!("spec.ports[{i}]: ports are 1-65535"));
            }
            if let Some(j) = ports[..i].iter().position(|q| q.name == p.name) {
                return Err(format!("spec.ports[{i}].name {:?} is also spec.ports[{j}]'s", p.name));
            }
            let proto = p.protocol.unwrap_or_default();
            if let Some(j) = ports[..i].iter().position(|q| q.port == p.port && q.protocol.unwrap_or_default() == proto)
            {
                return Err(format!("spec.ports[{i}]: port {}/{} is also spec.ports[{j}]'s", p.port, proto.as_str()));
            }
        }
        Ok(())
    }

    /// The Service's labels and annotations as the API server would take them (it would
    /// refuse the whole Service otherwise, and the export would fail on every write).
    fn validate_service_metadata(&self) -> Result<(), String> {
        let label_value =
            |v: &str| names::label_value(v).map_err(|why| format!("is not a valid label value: it {why}"));
        let annotation_value = |v: &str| match v.chars().count() > MAX_ANNOTATION_VALUE {
            true => Err(format!("is longer than {MAX_ANNOTATION_VALUE} characters")),
            false => Ok(()),
        };
        check_map("spec.serviceLabels", self.service_labels.as_ref(), label_value)?;
        check_map("spec.serviceAnnotations", self.service_annotations.as_ref(), annotation_value)
    }
}

/// A map of keys to values bound for an object's metadata: at most
/// [`MAX_SERVICE_METADATA`] keys, each a qualified name, each value as `value` says.
fn check_map(
    field: &str,
    map: Option<&BTreeMap<String, String>>,
    value: impl Fn(&str) -> Result<(), String>,
) -> Result<(), String> {
    let Some(map) = map else { return Ok(()) };
    if map.len() > MAX_SERVICE_METADATA {
        return Err(format!("{field} has {} keys; at most {MAX_SERVICE_METADATA}", map.len()));
    }
    for (key, v) in map {
        names::qualified_name(key).map_err(|why| format!("{field}: key {key:?} is not a valid key: it {why}"))?;
        value(v).map_err(|why| format!("{field}[{key:?}]: the value {why}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(ports: serde_json::Value) -> ConsulServiceSpec {
        serde_json::from_value(serde_json::json!({"service": "web", "ports": ports})).unwrap()
    }

    #[test]
    fn a_plain_export_is_valid_and_its_defaults_are_tcp_and_ipv4() {
        let s: ConsulServiceSpec = serde_json::from_value(serde_json::json!({"service": "web"})).unwrap();
        assert_eq!(s.validate("web"), Ok(()));
        assert_eq!(s.ip_family.unwrap_or_default(), IpFamily::IPv4);
        let p = spec(serde_json::json!([{"name": "http", "port": 80}]));
        assert_eq!(p.ports.unwrap()[0].protocol.unwrap_or_default(), Protocol::Tcp);
    }

    #[test]
    fn bad_specs_are_refused_naming_the_field() {
        let cases = [
            (spec(serde_json::json!([])), "web", "spec.ports is empty"),
            (spec(serde_json::json!([{"name": "Http", "port": 80}])), "web", "spec.ports[0].name"),
            (
                spec(serde_json::json!([{"name": "a", "port": 80}, {"name": "a", "port": 81}])),
                "web",
                "also spec.ports[0]'s",
            ),
            (spec(serde_json::json!([{"name": "a", "port": 80}, {"name": "b", "port": 80}])), "web", "80/TCP"),
            (spec(serde_json::json!([{"name": "a", "port": 0}])), "web", "1-65535"),
            (spec(serde_json::json!([{"name": "a", "port": 80}])), "1web", "cannot name a Service"),
        ];
        for (s, name, want) in cases {
            let err = s.validate(name).unwrap_err();
            assert!(err.contains(want), "{err:?} should say {want:?}");
        }
        // The Service's labels and annotations, as the API server takes them.
        let meta = |labels: serde_json::Value, annotations: serde_json::Value| -> ConsulServiceSpec {
            serde_json::from_value(serde_json::json!({"service": "web", "serviceLabels": labels,
                "serviceAnnotations": annotations}))
            .unwrap()
        };
        let ok = meta(
            serde_json::json!({"team": "shop", "prometheus.io/scrape": ""}),
            serde_json::json!({"external-dns.alpha.kubernetes.io/hostname": "web.example.com, www.example.com"}),
        );
        assert_eq!(ok.validate("web"), Ok(()));
        let metadata_cases = [
            (meta(serde_json::json!({"Bad Key": "x"}), serde_json::json!({})), "spec.serviceLabels: key \"Bad Key\""),
            (meta(serde_json::json!({"team": "a b"}), serde_json::json!({})), "not a valid label value"),
            (meta(serde_json::json!({}), serde_json::json!({"UPPER.io/x": "y"})), "spec.serviceAnnotations: key"),
            (
                meta(serde_json::json!({}), serde_json::json!({"a": "x".repeat(MAX_ANNOTATION_VALUE + 1)})),
                "longer than 2048",
            ),
        ];
        for (s, want) in metadata_cases {
            let err = s.validate("web").unwrap_err();
            assert!(err.contains(want), "{err:?} should say {want:?}");
        }
        let many: serde_json::Map<String, serde_json::Value> =
            (0..=MAX_SERVICE_METADATA).map(|i| (format!("k{i}"), serde_json::json!("v"))).collect();
        let err = meta(serde_json::Value::Object(many), serde_json::json!({})).validate("web").unwrap_err();
        assert!(err.contains("65 keys; at most 64"), "{err}");
        // The same port number over two protocols is fine (DNS on 53/TCP and 53/UDP).
        let dns = spec(serde_json::json!([{"name": "a", "port": 53}, {"name": "b", "port": 53, "protocol": "UDP"}]));
        assert_eq!(dns.validate("dns"), Ok(()));
    }
}
