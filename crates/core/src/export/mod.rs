//! Exports: what a `ConsulService` asks the cluster to hold, from the Consul service's
//! entry in the snapshot. Pure: the edge (`src/export/`) reads the live Service and slices,
//! asks [`layout::plan`] what to write, and writes only that.
//!
//! docs/export.md gives the rules consumers depend on and why; the ones decided here:
//! - one Service port per `spec.ports` entry, or (without it) one per distinct instance
//!   port, named `tcp-<port>`; slice port names are the Service's (consumers join on them);
//! - instances are grouped by the ports they serve: a slice's endpoints share its ports;
//! - one address family, canonical addresses, nothing unroutable ([`address`]);
//! - `zone` is the instance's Consul locality zone; `nodeName` is never set (a Consul node
//!   is not a Kubernetes Node);
//! - every instance in the entry was admitted by the resolver's health statuses (the query
//!   asks Consul only for those), so each is ready and serving; the others are left out.

pub mod address;
pub mod layout;

use std::collections::BTreeMap;

use consul_resolver_api::export::{ConsulServiceSpec, IpFamily};

use crate::assembler::snapshot::{ServiceEntry, Stale};
use crate::model::Endpoint;

/// Most endpoints in one slice: the control plane's default (the API allows 1,000; every
/// change to a slice goes to every node, so smaller slices mean smaller writes).
pub const MAX_ENDPOINTS_PER_SLICE: usize = 100;

/// A port: of the exported Service (`port` is what it listens on), or of a slice (`port`
/// is the instances' port; its `name` is the Service port's, which consumers join on).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Port {
    pub name: String,
    pub port: u16,
    pub protocol: &'static str,
    pub app_protocol: Option<String>,
}

/// One endpoint of a slice.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SliceEndpoint {
    /// Canonical IP address; endpoints are identified by it within a slice group.
    pub address: String,
    pub ready: bool,
    pub serving: bool,
    /// The instance's Consul locality zone, for topology-aware consumers.
    pub zone: Option<String>,
}

/// An instance the export leaves out, and why.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Excluded {
    pub node: String,
    pub service_id: String,
    pub address: String,
    pub reason: String,
}

/// What an export asks for, before it is laid out into slices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Desired {
    pub ports: Vec<Port>,
    pub headless: bool,
    pub family: IpFamily,
    /// Endpoints by the ports they serve, by address.
    pub groups: BTreeMap<Vec<Port>, BTreeMap<String, SliceEndpoint>>,
    /// Sorted.
    pub excluded: Vec<Excluded>,
    /// The endpoints are the ones last obtained, not a current answer.
    pub stale: Option<Stale>,
}

impl Desired {
    /// What `spec` asks for, given the service's entry (`None`: nothing known yet, so no
    /// endpoints).
    pub fn of(spec: &ConsulServiceSpec, entry: Option<&ServiceEntry>) -> Desired {
        let family = spec.ip_family.unwrap_or_default();
        let endpoints: &[Endpoint] = entry.map(|e| &*e.endpoints).unwrap_or_default();
        let mut groups: BTreeMap<Vec<Port>, BTreeMap<String, SliceEndpoint>> = BTreeMap::new();
        let mut excluded = Vec::new();
        let mut default_ports = std::collections::BTreeSet::new();
        for e in endpoints {
            let address = match address::admit(&e.address, family) {
                Ok(a) => a,
                Err(why) => {
                    excluded.push(Excluded {
                        node: e.node.clone(),
                        service_id: e.service_id.clone(),
                        address: e.address.clone(),
                        reason: why.message(),
                    });
                    continue;
                }
            };
            let ports = match &spec.ports {
                Some(ports) => ports
                    .iter()
                    .map(|p| Port {
                        name: p.name.clone(),
                        port: p.target_port.unwrap_or(e.port),
                        protocol: p.protocol.unwrap_or_default().as_str(),
                        app_protocol: p.app_protocol.clone(),
                    })
                    .collect(),
                None => {
                    default_ports.insert(e.port);
                    vec![Port { name: default_port_name(e.port), port: e.port, protocol: "TCP", app_protocol: None }]
                }
            };
            // The same address twice in a group (two registrations of one process) is one
            // endpoint.
            groups
                .entry(ports)
                .or_default()
                .insert(address.clone(), SliceEndpoint { address, ready: true, serving: true, zone: e.zone.clone() });
        }
        excluded.sort();
        let ports = match &spec.ports {
            Some(ports) => ports
                .iter()
                .map(|p| Port {
                    name: p.name.clone(),
                    port: p.port,
                    protocol: p.protocol.unwrap_or_default().as_str(),
                    app_protocol: p.app_protocol.clone(),
                })
                .collect(),
            None => default_ports
                .into_iter()
                .map(|p| Port { name: default_port_name(p), port: p, protocol: "TCP", app_protocol: None })
                .collect(),
        };
        Desired {
            ports,
            headless: spec.headless.unwrap_or(false),
            family,
            groups,
            excluded,
            stale: entry.and_then(|e| e.stale.clone()),
        }
    }

    /// Endpoints in all groups.
    pub fn endpoint_count(&self) -> usize {
        self.groups.values().map(BTreeMap::len).sum()
    }
}

fn default_port_name(port: u16) -> String {
    format!("tcp-{port}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Health;

    pub(crate) fn endpoint(address: &str, port: u16) -> Endpoint {
        Endpoint {
            address: address.into(),
            port,
            node: format!("node-{address}"),
            service_id: format!("web-{address}-{port}"),
            tags: vec![],
            meta: Default::default(),
            health: Health::Passing,
            zone: None,
        }
    }

    pub(crate) fn entry(endpoints: Vec<Endpoint>) -> ServiceEntry {
        ServiceEntry {
            name: "web".into(),
            synced: true,
            index: Some(1),
            error: None,
            stale: None,
            endpoints: endpoints.into(),
        }
    }

    fn spec(v: serde_json::Value) -> ConsulServiceSpec {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn without_ports_each_instance_port_is_a_service_port_and_a_group() {
        let e = entry(vec![endpoint("10.0.0.1", 8080), endpoint("10.0.0.2", 8080), endpoint("10.0.0.3", 9090)]);
        let d = Desired::of(&spec(serde_json::json!({"service": "web"})), Some(&e));
        let names: Vec<_> = d.ports.iter().map(|p| (p.name.as_str(), p.port)).collect();
        assert_eq!(names, [("tcp-8080", 8080), ("tcp-9090", 9090)]);
        assert_eq!(d.groups.len(), 2);
        let sizes: Vec<_> = d.groups.iter().map(|(p, e)| (p[0].name.as_str(), e.len())).collect();
        assert_eq!(sizes, [("tcp-8080", 2), ("tcp-9090", 1)]);
    }

    #[test]
    fn named_ports_forward_to_each_instance_port_or_the_target_port() {
        let e = entry(vec![endpoint("10.0.0.1", 8080), endpoint("10.0.0.2", 8081)]);
        let s = spec(serde_json::json!({"service": "web", "ports": [
            {"name": "http", "port": 80, "appProtocol": "http"},
            {"name": "metrics", "port": 9100, "targetPort": 9100}
        ]}));
        let d = Desired::of(&s, Some(&e));
        assert_eq!(d.ports.iter().map(|p| p.port).collect::<Vec<_>>(), [80, 9100]);
        // Different instance ports: different port sets, different groups.
        let sets: Vec<Vec<u16>> = d.groups.keys().map(|ps| ps.iter().map(|p| p.port).collect()).collect();
        assert_eq!(sets, [vec![8080, 9100], vec![8081, 9100]]);
        assert!(d.groups.keys().flatten().all(|p| d.ports.iter().any(|s| s.name == p.name)));
    }

    #[test]
    fn unroutable_and_other_family_instances_are_excluded_with_a_reason() {
        let e = entry(vec![
            endpoint("10.0.0.1", 80),
            endpoint("127.0.0.1", 80),
            endpoint("web-1.node.consul", 80),
            endpoint("2001:db8::1", 80),
        ]);
        let d = Desired::of(&spec(serde_json::json!({"service": "web"})), Some(&e));
        assert_eq!(d.endpoint_count(), 1);
        let reasons: Vec<_> =
            d.excluded.iter().map(|x| (x.address.as_str(), x.reason.split(':').next().unwrap())).collect();
        assert_eq!(
            reasons,
            [
                ("127.0.0.1", "loopback address"),
                ("2001:db8::1", "not an IPv4 address (spec.ipFamily)"),
                ("web-1.node.consul", "not an IP address")
            ]
        );
    }

    #[test]
    fn nothing_known_is_no_endpoints_and_staleness_is_carried() {
        let d = Desired::of(&spec(serde_json::json!({"service": "web", "headless": true})), None);
        assert!(d.groups.is_empty() && d.headless && d.stale.is_none());
        let mut e = entry(vec![endpoint("10.0.0.1", 80)]);
        e.stale = Some(Stale { since: "2026-11-25T00:00:00Z".into(), reason: "Consul unreachable".into() });
        let d = Desired::of(&spec(serde_json::json!({"service": "web"})), Some(&e));
        assert_eq!(d.stale.as_ref().unwrap().reason, "Consul unreachable");
        assert_eq!(d.endpoint_count(), 1);
    }
}
