//! Endpoints of referenced Kubernetes Services: which watch brings them (EndpointSlices,
//! `discovery.k8s.io/v1`, or, on API servers that do not serve that, core `Endpoints`), and
//! a Service's endpoints from what its watch holds (decoded at ingestion:
//! `crate::ingest::endpoints`).

use std::collections::{BTreeMap, BTreeSet};

use crate::ingest::endpoints::SERVICE_NAME_LABEL;
use crate::keys::KubeKey;
use crate::model::{Decoded, KubeEndpoint, Stored};

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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn keys_select_one_service() {
        let k = EndpointsApi::EndpointSlices.key("shop", "billing");
        assert_eq!(k.label_selector.as_deref(), Some("kubernetes.io/service-name=billing"));
        let k = EndpointsApi::Endpoints.key("shop", "billing");
        assert_eq!(k.field_selector.as_deref(), Some("metadata.name=billing"));
        assert_eq!(k.namespace.as_deref(), Some("shop"));
    }
}
