//! Decoding the objects that carry a Kubernetes Service's endpoints, once, as they arrive:
//! EndpointSlices (`discovery.k8s.io/v1`) and core `Endpoints`.

use std::collections::BTreeSet;

use serde_json::Value;

use crate::model::{KubeEndpoint, KubePort};

/// The label that ties an EndpointSlice to its Service.
pub(crate) const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// The Service an EndpointSlice belongs to (empty without the label).
pub(crate) fn service_of_slice(slice: &Value) -> String {
    slice
        .pointer("/metadata/labels")
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
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
    fn a_slice_names_its_service_by_label() {
        let obj = json!({"metadata": {"name": "billing-abc", "labels": {"kubernetes.io/service-name": "billing"}}});
        assert_eq!(service_of_slice(&obj), "billing");
        assert_eq!(service_of_slice(&json!({"metadata": {"name": "x"}})), "");
    }
}
