//! Endpoints of referenced Kubernetes Services: which watch brings them, and reading
//! them from EndpointSlices (`discovery.k8s.io/v1`) or, on API servers that do not serve
//! that, core `Endpoints`.

use std::collections::{BTreeMap, BTreeSet};

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

    /// The watch that brings the endpoints of Service `namespace/name` and nothing else
    /// (see [`Scoping`] for when its namespace's watch serves it instead).
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

/// The label that ties an EndpointSlice to its Service.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

impl EndpointsApi {
    /// The one watch that brings the endpoints of every Service of `namespace`: used once
    /// more than [`Scoping`]'s threshold of its Services are routed to. EndpointSlices are
    /// selected by the presence of the Service label (slices of a Service only).
    pub fn namespace_key(self, namespace: &str) -> KubeKey {
        let key = KubeKey::new(self.group(), "v1", self.kind()).in_namespace(namespace);
        match self {
            EndpointsApi::EndpointSlices => key.with_labels(SERVICE_NAME_LABEL),
            EndpointsApi::Endpoints => key,
        }
    }
}

/// Per namespace, whether its routed-to Services' endpoints come from one watch each or
/// from one watch of the whole namespace. One watch per Service reads only what is routed
/// to, but costs the API server a list, a watch and (over HTTP/1.1) a connection per
/// Service: thousands at scale. Past `above` Services in a namespace, one watch of the
/// namespace serves them all (the Consul side's feed, for Kubernetes); back below half of
/// that, one each again, so a count hovering at the threshold does not flip the watches.
#[derive(Debug, Clone, Default)]
pub(crate) struct Scoping {
    wide: BTreeSet<String>,
}

impl Scoping {
    /// Decides again from the number of routed-to Services per namespace.
    pub(crate) fn update<'a>(&mut self, counts: impl Iterator<Item = (&'a str, usize)>, above: usize) {
        let counts: BTreeMap<&str, usize> = counts.collect();
        self.wide.retain(|ns| counts.get(ns.as_str()).is_some_and(|&n| n > above / 2));
        for (ns, n) in counts {
            if n > above {
                self.wide.insert(ns.to_owned());
            }
        }
    }

    pub(crate) fn is_wide(&self, namespace: &str) -> bool {
        self.wide.contains(namespace)
    }

    /// The watch that brings the endpoints of Service `namespace/name` now.
    pub(crate) fn key(&self, api: EndpointsApi, namespace: &str, name: &str) -> KubeKey {
        if self.is_wide(namespace) { api.namespace_key(namespace) } else { api.key(namespace, name) }
    }
}

/// The endpoints of Service `service` among the objects of a watch (decoded at ingestion),
/// sorted and de-duplicated across its EndpointSlices. A Service's own watch holds only
/// its objects; a namespace's holds every Service's, told apart by the decoded name.
pub(crate) fn merge<'a>(service: &str, objects: impl Iterator<Item = &'a Stored>) -> Vec<KubeEndpoint> {
    let mut out = BTreeSet::new();
    for obj in objects {
        if let Decoded::Endpoints { service: of, endpoints } = &obj.decoded
            && of == service
        {
            out.extend(endpoints.iter().cloned());
        }
    }
    out.into_iter().collect()
}

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
    fn namespaces_go_wide_past_the_threshold_and_back_at_half() {
        let mut s = Scoping::default();
        let update = |s: &mut Scoping, shop: usize, blog: usize| {
            s.update([("shop", shop), ("blog", blog)].into_iter().filter(|(_, n)| *n > 0), 100)
        };
        update(&mut s, 100, 3);
        assert!(!s.is_wide("shop"), "at the threshold: one watch each");
        update(&mut s, 101, 3);
        assert!(s.is_wide("shop") && !s.is_wide("blog"));
        assert_eq!(s.key(EndpointsApi::Endpoints, "shop", "web"), EndpointsApi::Endpoints.namespace_key("shop"));
        assert_eq!(s.key(EndpointsApi::Endpoints, "blog", "web"), EndpointsApi::Endpoints.key("blog", "web"));
        update(&mut s, 51, 3);
        assert!(s.is_wide("shop"), "above half: still one watch for the namespace");
        update(&mut s, 50, 3);
        assert!(!s.is_wide("shop"), "at half: one each again");
        update(&mut s, 200, 0);
        update(&mut s, 0, 0);
        assert!(!s.is_wide("shop"), "a namespace no longer routed to is forgotten");
        let k = EndpointsApi::Endpoints.namespace_key("shop");
        assert_eq!((k.label_selector, k.field_selector), (None, None));
    }

    #[test]
    fn a_slice_names_its_service_by_label() {
        let obj = json!({"metadata": {"name": "billing-abc", "labels": {"kubernetes.io/service-name": "billing"}}});
        assert_eq!(service_of_slice(&obj), "billing");
        assert_eq!(service_of_slice(&json!({"metadata": {"name": "x"}})), "");
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
