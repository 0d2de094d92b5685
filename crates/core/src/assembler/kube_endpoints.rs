//! Endpoints of referenced Kubernetes Services: which watch brings them, and reading
//! them from EndpointSlices (`discovery.k8s.io/v1`) or, on API servers that do not serve
//! that, core `Endpoints`.

use std::collections::BTreeSet;

use serde_json::Value;

use crate::keys::KubeKey;
use crate::model::{Decoded, KubeEndpoint, KubePort, Stored};

/// Which API carries Service endpoints on this API server (found by discovery).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EndpointsApi {
    /// `discovery.k8s.io/v1` EndpointSlices, selected by `kubernetes.io/service-name`.
    #[default]
    EndpointSlices,
    /// Core `v1` Endpoints, selected by `metadata.name` (API servers before 1.21).
    Endpoints,
}

impl EndpointsApi {
    /// The API group of the objects that carry endpoints.
    pub(crate) fn group(self) -> &'static str {
        match self {
            EndpointsApi::EndpointSlices => "discovery.k8s.io",
            EndpointsApi::Endpoints => "",
        }
    }

    /// The kind of the objects that carry endpoints.
    pub(crate) fn kind(self) -> &'static str {
        match self {
            EndpointsApi::EndpointSlices => "EndpointSlice",
            EndpointsApi::Endpoints => "Endpoints",
        }
    }

    /// The one watch that brings the endpoints of Service `namespace/name`: never a
    /// whole namespace's worth.
    pub fn key(self, namespace: &str, name: &str) -> KubeKey {
        match self {
            EndpointsApi::EndpointSlices => KubeKey::new(self.group(), "v1", self.kind())
                .in_namespace(namespace)
                .with_labels(format!("kubernetes.io/service-name={name}")),
            EndpointsApi::Endpoints => KubeKey::new(self.group(), "v1", self.kind())
                .in_namespace(namespace)
                .with_fields(format!("metadata.name={name}")),
        }
    }
}

/// The endpoints of the objects of one Service's watch (decoded at ingestion), sorted and
/// de-duplicated across its EndpointSlices.
pub(crate) fn merge<'a>(objects: impl Iterator<Item = &'a Stored>) -> Vec<KubeEndpoint> {
    let mut out = BTreeSet::new();
    for obj in objects {
        if let Decoded::Endpoints(eps) = &obj.decoded {
            out.extend(eps.iter().cloned());
        }
    }
    out.into_iter().collect()
}

/// The endpoints of one EndpointSlice.
pub(crate) fn from_slice(slice: &Value) -> Vec<KubeEndpoint> {
    let mut out = BTreeSet::new();
    read_slice(slice, &mut out);
    out.into_iter().collect()
}

/// The endpoints of one core Endpoints object.
pub(crate) fn from_endpoints(endpoints: &Value) -> Vec<KubeEndpoint> {
    let mut out = BTreeSet::new();
    read_endpoints(endpoints, &mut out);
    out.into_iter().collect()
}

fn ports(list: Option<&Value>) -> Vec<KubePort> {
    let mut ports: Vec<KubePort> = list
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|p| {
            let port = u16::try_from(p.get("port")?.as_u64()?).ok()?;
            let name = p.get("name").and_then(Value::as_str).filter(|n| !n.is_empty()).map(str::to_owned);
            Some(KubePort { name, port })
        })
        .collect();
    ports.sort();
    ports
}

fn read_slice(slice: &Value, out: &mut BTreeSet<KubeEndpoint>) {
    let ports = ports(slice.get("ports"));
    for ep in slice.get("endpoints").and_then(Value::as_array).into_iter().flatten() {
        // `ready` absent means ready (API convention for EndpointSlice conditions).
        let ready = ep.pointer("/conditions/ready").and_then(Value::as_bool).unwrap_or(true);
        for addr in ep.get("addresses").and_then(Value::as_array).into_iter().flatten() {
            if let Some(address) = addr.as_str() {
                out.insert(KubeEndpoint { address: address.to_owned(), ports: ports.clone(), ready });
            }
        }
    }
}

fn read_endpoints(endpoints: &Value, out: &mut BTreeSet<KubeEndpoint>) {
    for subset in endpoints.get("subsets").and_then(Value::as_array).into_iter().flatten() {
        let ports = ports(subset.get("ports"));
        for (field, ready) in [("addresses", true), ("notReadyAddresses", false)] {
            for addr in subset.get(field).and_then(Value::as_array).into_iter().flatten() {
                if let Some(ip) = addr.get("ip").and_then(Value::as_str) {
                    out.insert(KubeEndpoint { address: ip.to_owned(), ports: ports.clone(), ready });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_endpoint_slices() {
        let obj = &json!({
            "metadata": {"name": "billing-abc", "namespace": "shop"},
            "ports": [{"name": "http", "port": 8080}],
            "endpoints": [
                {"addresses": ["10.0.0.2"], "conditions": {"ready": true}},
                {"addresses": ["10.0.0.1"]},
                {"addresses": ["10.0.0.3"], "conditions": {"ready": false}}
            ]
        });
        let eps = from_slice(obj);
        let got: Vec<_> = eps.iter().map(|e| (e.address.as_str(), e.ready, e.ports[0].port)).collect();
        assert_eq!(got, [("10.0.0.1", true, 8080), ("10.0.0.2", true, 8080), ("10.0.0.3", false, 8080)]);
    }

    #[test]
    fn reads_core_endpoints() {
        let obj = &json!({
            "metadata": {"name": "billing", "namespace": "shop"},
            "subsets": [{"addresses": [{"ip": "10.0.0.9"}], "notReadyAddresses": [{"ip": "10.0.0.8"}],
                         "ports": [{"port": 80}]}]
        });
        let eps = from_endpoints(obj);
        let got: Vec<_> = eps.iter().map(|e| (e.address.as_str(), e.ready)).collect();
        assert_eq!(got, [("10.0.0.8", false), ("10.0.0.9", true)]);
    }

    #[test]
    fn keys_select_one_service() {
        let k = EndpointsApi::EndpointSlices.key("shop", "billing");
        assert_eq!(k.label_selector.as_deref(), Some("kubernetes.io/service-name=billing"));
        let k = EndpointsApi::Endpoints.key("shop", "billing");
        assert_eq!(k.field_selector.as_deref(), Some("metadata.name=billing"));
        assert_eq!(k.namespace.as_deref(), Some("shop"));
    }
}
