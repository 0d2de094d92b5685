//! Exports: what a `ConsulService` asks the cluster to hold, from the Consul service's
//! entry in the snapshot. Pure: the edge (`src/controller/export/`) reads the live Service and slices,
//! asks [`layout::plan`] what to write, and writes only that.
//!
//! docs/export.md gives the rules consumers depend on and why; the ones decided here:
//! - one Service port per `spec.ports` entry, or (without it) one per distinct instance
//!   port, named `tcp-<port>`; slice port names are the Service's (consumers join on them);
//! - instances are grouped by the ports they serve: a slice's endpoints share its ports;
//! - one address family, canonical addresses, nothing unroutable ([`address`]);
//! - `zone` is the instance's Consul locality zone; `nodeName` is never set (a Consul node
//!   is not a Kubernetes Node);
//! - zone hints only with `spec.trafficDistribution: PreferClose` ([`Desired::of`]):
//!   kube-proxy follows hints whenever every ready endpoint has one, so they are never
//!   written unasked;
//! - every instance in the entry was admitted by the resolver's health statuses (the query
//!   asks Consul only for those), so each is ready and serving; the others are left out;
//! - with `spec.endpoints`, a core `Endpoints` object holding what the slices hold, capped
//!   at 1,000 addresses ([`endpoints`]).

pub mod address;
pub mod endpoints;
pub mod layout;

use std::collections::{BTreeMap, BTreeSet};

use consul_resolver_api::export::{ConsulServiceSpec, IpFamily, TrafficDistribution};
use layout::LiveSlice;

use crate::assembler::snapshot::{ServiceEntry, Stale};
use crate::model::Endpoint;

/// Most endpoints in one slice: the control plane's default (the API allows 1,000; every
/// change to a slice goes to every node, so smaller slices mean smaller writes).
pub const MAX_ENDPOINTS_PER_SLICE: usize = 100;

/// Most Service ports made from instance ports when `spec.ports` is absent. Dynamic ports
/// (Nomad, schedulers that pick a port per instance) would otherwise give one Service port
/// and one slice per instance; the most common ports are kept, the instances of the others
/// are excluded with a reason that names `spec.ports` (the limit of `spec.ports` too).
pub const MAX_DEFAULT_PORTS: usize = 32;

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
    /// The zone it is hinted for (`hints.forZones`), with `spec.trafficDistribution`.
    pub hint: Option<String>,
}

/// An instance the export leaves out, and why.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Excluded {
    pub node: String,
    pub service_id: String,
    pub address: String,
    pub reason: String,
}

impl Excluded {
    fn of(e: &Endpoint, reason: String) -> Excluded {
        Excluded { node: e.node.clone(), service_id: e.service_id.clone(), address: e.address.clone(), reason }
    }
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

/// Whether `entry` says what the export should hold: a current answer, or endpoints the
/// operator obtained itself and keeps (stale). `false` (nothing answered since this
/// process started, or no usable resolver): the export's live slices are the last known
/// good ([`held`]), not an empty answer.
pub fn knows(entry: Option<&ServiceEntry>) -> bool {
    entry.is_some_and(|e| e.synced || e.stale.is_some())
}

impl Desired {
    /// What `spec` asks for, given the service's entry (`None`: nothing known yet, so no
    /// endpoints).
    pub fn of(spec: &ConsulServiceSpec, entry: Option<&ServiceEntry>) -> Desired {
        let family = spec.ip_family.unwrap_or_default();
        let endpoints: &[Endpoint] = entry.map(|e| &*e.endpoints).unwrap_or_default();
        let mut excluded = Vec::new();
        let admitted = admitted(spec, endpoints, family, &mut excluded);
        let ports = match &spec.ports {
            Some(ports) => ports.iter().map(|p| service_port(p, p.port)).collect(),
            None => default_ports(&admitted, &mut excluded)
                .into_iter()
                .map(|p| Port { name: default_port_name(p), port: p, protocol: "TCP", app_protocol: None })
                .collect::<Vec<_>>(),
        };
        let mut groups: BTreeMap<Vec<Port>, BTreeMap<String, SliceEndpoint>> = BTreeMap::new();
        for (e, address) in admitted {
            let slice_ports: Vec<Port> = match &spec.ports {
                Some(spec_ports) => {
                    spec_ports.iter().map(|p| service_port(p, p.target_port.unwrap_or(e.port))).collect()
                }
                None if ports.iter().any(|p| p.port == e.port) => {
                    vec![Port { name: default_port_name(e.port), port: e.port, protocol: "TCP", app_protocol: None }]
                }
                None => continue, // beyond the port cap: excluded by `default_ports`
            };
            // The same address twice in a group (two registrations of one process) is one
            // endpoint.
            groups.entry(slice_ports).or_default().insert(
                address.clone(),
                SliceEndpoint { address, ready: true, serving: true, zone: e.zone.clone(), hint: None },
            );
        }
        if spec.traffic_distribution == Some(TrafficDistribution::PreferClose) {
            hint_own_zones(&mut groups);
        }
        excluded.sort();
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

    /// The same without zone hints: where the slices cannot carry them (`v1beta1`, whose
    /// 1.20 server refuses the field under server-side apply).
    pub fn drop_hints(&mut self) {
        self.groups.values_mut().flat_map(BTreeMap::values_mut).for_each(|e| e.hint = None);
    }
}

/// Each ready endpoint hinted for its own zone, or none at all when a ready one has no
/// zone: kube-proxy ignores the hints of a Service unless every ready endpoint has one, and
/// hinting only some would say something it does not follow.
fn hint_own_zones(groups: &mut BTreeMap<Vec<Port>, BTreeMap<String, SliceEndpoint>>) {
    if groups.values().flat_map(BTreeMap::values).any(|e| e.ready && e.zone.is_none()) {
        return;
    }
    groups.values_mut().flat_map(BTreeMap::values_mut).filter(|e| e.ready).for_each(|e| e.hint = e.zone.clone());
}

/// The instances that can be endpoints, with their canonical address; the others are
/// pushed to `excluded` with the reason.
fn admitted<'a>(
    spec: &ConsulServiceSpec,
    endpoints: &'a [Endpoint],
    family: IpFamily,
    excluded: &mut Vec<Excluded>,
) -> Vec<(&'a Endpoint, String)> {
    // Whether an instance's own port is forwarded to: a port registered as 0 (DNS-only and
    // external services register none) would put port 0 into the Service, which the API
    // server refuses, freezing the whole export.
    let uses_instance_port = spec.ports.as_ref().is_none_or(|ps| ps.iter().any(|p| p.target_port.is_none()));
    let mut admitted = Vec::new();
    for e in endpoints {
        match address::admit(&e.address, family) {
            Err(why) => excluded.push(Excluded::of(e, why.message())),
            Ok(_) if uses_instance_port && e.port == 0 => excluded.push(Excluded::of(
                e,
                "no port: the instance is registered without one (set a targetPort in spec.ports to forward to a fixed port)"
                    .into(),
            )),
            Ok(address) => admitted.push((e, address)),
        }
    }
    admitted
}

/// Without `spec.ports`: the instance ports that become Service ports, at most
/// [`MAX_DEFAULT_PORTS`], the most common first (ties: the lower port). The instances of
/// the others are pushed to `excluded`.
fn default_ports(admitted: &[(&Endpoint, String)], excluded: &mut Vec<Excluded>) -> BTreeSet<u16> {
    let mut counts: BTreeMap<u16, usize> = BTreeMap::new();
    for (e, _) in admitted {
        *counts.entry(e.port).or_default() += 1;
    }
    let mut by_use: Vec<(u16, usize)> = counts.into_iter().collect();
    by_use.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let kept: BTreeSet<u16> = by_use.iter().take(MAX_DEFAULT_PORTS).map(|(p, _)| *p).collect();
    for (e, _) in admitted.iter().filter(|(e, _)| !kept.contains(&e.port)) {
        let reason = format!(
            "port {}: the instances have {} distinct ports and only the {MAX_DEFAULT_PORTS} most common become Service ports (set spec.ports to choose)",
            e.port,
            by_use.len()
        );
        excluded.push(Excluded::of(e, reason));
    }
    kept
}

/// A port of `spec.ports`, listening (Service) or forwarding (slice) on `port`.
fn service_port(p: &consul_resolver_api::export::ExportPort, port: u16) -> Port {
    Port {
        name: p.name.clone(),
        port,
        protocol: p.protocol.unwrap_or_default().as_str(),
        app_protocol: p.app_protocol.clone(),
    }
}

fn default_port_name(port: u16) -> String {
    format!("tcp-{port}")
}

/// The live slices held as they are, stale for `reason` since the time already on them, or
/// `now` (RFC 3339) if none is: the export's last known good while nothing says what it
/// should hold ([`knows`]). The cluster's own slices are what survives a restart; an
/// operator that starts while Consul cannot be read must not replace them with nothing.
/// Only slices of `family` that hold endpoints are kept.
pub fn held(live: &[LiveSlice], family: IpFamily, reason: &str, now: &str) -> Desired {
    let live: Vec<&LiveSlice> = live.iter().filter(|l| l.family == Some(family) && !l.endpoints.is_empty()).collect();
    // RFC 3339 times in UTC compare as text.
    let since = live.iter().filter_map(|l| l.stale.as_ref()).map(|s| s.since.as_str()).min().unwrap_or(now);
    let mut groups: BTreeMap<Vec<Port>, BTreeMap<String, SliceEndpoint>> = BTreeMap::new();
    let mut ports = BTreeSet::new();
    for l in &live {
        ports.extend(l.ports.iter().cloned());
        let group = groups.entry(l.ports.clone()).or_default();
        group.extend(l.endpoints.iter().map(|e| (e.address.clone(), e.clone())));
    }
    Desired {
        ports: ports.into_iter().collect(),
        headless: false,
        family,
        groups,
        excluded: Vec::new(),
        stale: Some(Stale { since: since.to_owned(), reason: reason.to_owned() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An instance on a node of its own (slices name the node).
    pub(crate) fn endpoint(address: &str, port: u16) -> Endpoint {
        let node = format!("node-{address}");
        Endpoint { node, service_id: format!("web-{address}-{port}"), ..crate::test_support::endpoint(address, port) }
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

    /// What an export of `spec` should hold while Consul answers `eps`.
    pub(crate) fn desired(spec_json: serde_json::Value, eps: Vec<Endpoint>) -> Desired {
        Desired::of(&spec(spec_json), Some(&entry(eps)))
    }

    /// `n` instances on `port`, 10.1.0.1 upwards.
    pub(crate) fn web(n: usize, port: u16) -> Vec<Endpoint> {
        (0..n).map(|i| endpoint(&format!("10.1.{}.{}", i / 250, i % 250 + 1), port)).collect()
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

    #[test]
    fn an_instance_without_a_port_is_excluded_unless_every_port_has_a_target() {
        let e = entry(vec![endpoint("10.0.0.1", 8080), endpoint("10.0.0.2", 0)]);
        let d = Desired::of(&spec(serde_json::json!({"service": "web"})), Some(&e));
        assert_eq!(d.ports.iter().map(|p| p.port).collect::<Vec<_>>(), [8080], "never port 0 in the Service");
        assert_eq!(d.endpoint_count(), 1);
        assert_eq!(d.excluded.len(), 1);
        assert!(d.excluded[0].reason.starts_with("no port"), "{:?}", d.excluded);
        // A port with a targetPort forwards to a fixed port: the instance's own is not used.
        let fixed =
            spec(serde_json::json!({"service": "web", "ports": [{"name": "dns", "port": 53, "targetPort": 53}]}));
        let d = Desired::of(&fixed, Some(&e));
        assert_eq!((d.endpoint_count(), d.excluded.len()), (2, 0));
        // One port without a target uses it: excluded again.
        let mixed = spec(serde_json::json!({"service": "web", "ports": [
            {"name": "dns", "port": 53, "targetPort": 53}, {"name": "http", "port": 80}]}));
        let d = Desired::of(&mixed, Some(&e));
        assert_eq!((d.endpoint_count(), d.excluded.len()), (1, 1));
        assert!(d.groups.keys().flatten().all(|p| p.port != 0));
    }

    #[test]
    fn without_spec_ports_the_most_common_ports_are_kept_and_the_rest_excluded() {
        // 40 instances on dynamic ports, and 5 on port 8080 (the most common).
        let mut eps: Vec<Endpoint> = (0..40).map(|i| endpoint(&format!("10.0.1.{}", i + 1), 20000 + i)).collect();
        eps.extend((0..5).map(|i| endpoint(&format!("10.0.2.{}", i + 1), 8080)));
        let d = Desired::of(&spec(serde_json::json!({"service": "web"})), Some(&entry(eps)));
        assert_eq!(d.ports.len(), MAX_DEFAULT_PORTS);
        assert!(d.ports.iter().any(|p| p.port == 8080), "the most common port is kept");
        // Ties go to the lower port: 20000..20030 are kept, 20031..20039 are not.
        assert!(d.ports.iter().any(|p| p.port == 20030) && !d.ports.iter().any(|p| p.port == 20031));
        assert_eq!(d.endpoint_count(), 5 + 31);
        assert_eq!(d.excluded.len(), 9);
        assert!(d.excluded.iter().all(|x| x.reason.contains("spec.ports")), "{:?}", d.excluded);
        // Each kept port's instances are in its group; none of an excluded port is.
        assert_eq!(d.groups.len(), MAX_DEFAULT_PORTS);
        // At the limit, nothing is excluded.
        let eps: Vec<Endpoint> = (0..32).map(|i| endpoint(&format!("10.0.1.{}", i + 1), 20000 + i)).collect();
        let d = Desired::of(&spec(serde_json::json!({"service": "web"})), Some(&entry(eps)));
        assert_eq!((d.ports.len(), d.excluded.len()), (32, 0));
    }

    fn in_zone(address: &str, zone: Option<&str>) -> Endpoint {
        Endpoint { zone: zone.map(str::to_owned), ..endpoint(address, 80) }
    }

    fn hints(d: &Desired) -> Vec<Option<&str>> {
        d.groups.values().flat_map(BTreeMap::values).map(|e| e.hint.as_deref()).collect()
    }

    #[test]
    fn zone_hints_only_when_asked_and_only_when_every_endpoint_has_a_zone() {
        let zoned = entry(vec![in_zone("10.0.0.1", Some("a")), in_zone("10.0.0.2", Some("b"))]);
        let asked = spec(serde_json::json!({"service": "web", "trafficDistribution": "PreferClose"}));
        let d = Desired::of(&asked, Some(&zoned));
        assert_eq!(hints(&d), [Some("a"), Some("b")], "each for its own zone");
        // Not asked: never, even with every zone known.
        let plain = Desired::of(&spec(serde_json::json!({"service": "web"})), Some(&zoned));
        assert_eq!(hints(&plain), [None, None]);
        // One endpoint without a zone: none at all.
        let partly = entry(vec![in_zone("10.0.0.1", Some("a")), in_zone("10.0.0.2", None)]);
        assert_eq!(hints(&Desired::of(&asked, Some(&partly))), [None, None]);
        // Where the slices cannot carry them.
        let mut d = d;
        d.drop_hints();
        assert_eq!(hints(&d), [None, None]);
        assert!(
            serde_json::from_value::<ConsulServiceSpec>(
                serde_json::json!({"service": "web", "trafficDistribution": "PreferAnywhere"})
            )
            .is_err()
        );
    }

    #[test]
    fn an_entry_known_is_an_answer_or_endpoints_kept_and_nothing_else() {
        assert!(!knows(None));
        let mut e = entry(vec![]);
        assert!(knows(Some(&e)), "a current answer, even an empty one");
        e.synced = false;
        assert!(!knows(Some(&e)), "nothing answered yet: the live slices are the last known good");
        e.stale = Some(Stale { since: "2026-11-25T00:00:00Z".into(), reason: "Consul unreachable".into() });
        assert!(knows(Some(&e)), "endpoints the operator obtained and keeps");
    }

    #[test]
    fn held_slices_keep_their_endpoints_and_the_earliest_stale_time_and_plan_no_move() {
        let e = entry((0..150).map(|i| endpoint(&format!("10.0.{}.{}", i / 100, i % 100 + 1), 8080)).collect());
        let s = spec(serde_json::json!({"service": "web"}));
        let d = Desired::of(&s, Some(&e));
        let plan = layout::plan("web", &d, &[]);
        let mut live: Vec<LiveSlice> = plan
            .slices
            .iter()
            .map(|p| LiveSlice {
                name: p.name.clone(),
                family: Some(IpFamily::IPv4),
                ports: p.ports.clone(),
                endpoints: p.endpoints.clone(),
                stale: None,
                hinted: false,
                intact: true,
            })
            .collect();
        // A previous leader marked one slice stale already; its time is kept.
        live[1].stale = Some(Stale { since: "2026-11-20T00:00:00Z".into(), reason: "old".into() });
        let h = held(&live, IpFamily::IPv4, "Consul unreachable", "2026-11-27T00:00:00Z");
        assert_eq!(h.endpoint_count(), 150);
        assert_eq!(h.ports, d.ports, "the Service's ports, from the slices");
        let stale = h.stale.clone().unwrap();
        assert_eq!((stale.since.as_str(), stale.reason.as_str()), ("2026-11-20T00:00:00Z", "Consul unreachable"));
        let again = layout::plan("web", &h, &live);
        assert_eq!(
            again.slices.iter().map(|s| s.endpoints.clone()).collect::<Vec<_>>(),
            live.iter().map(|l| l.endpoints.clone()).collect::<Vec<_>>(),
            "every endpoint stays where it is"
        );
        assert!(again.delete.is_empty());
        assert_eq!(again.write.len(), 2, "both slices get the stale marks");
        // Without a time on any slice, the time is now.
        live[1].stale = None;
        assert_eq!(
            held(&live, IpFamily::IPv4, "r", "2026-11-27T00:00:00Z").stale.unwrap().since,
            "2026-11-27T00:00:00Z"
        );
        // Nothing live of the family: nothing held.
        assert_eq!(held(&live, IpFamily::IPv6, "r", "2026-11-27T00:00:00Z").endpoint_count(), 0);
    }
}
