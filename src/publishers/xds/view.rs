//! What Envoy is told, derived from the snapshot: one cluster per Consul service a resolver
//! watches and per port of a Kubernetes Service some Mapping routes to (names in
//! docs/xds.md), and what changed since the last snapshot handed over.
//!
//! A snapshot's entries are shared parts: an entry that did not change is the very same
//! part as before, and so is a resolver none of whose services changed. Telling what
//! changed is a walk of the sorted lists comparing pointers, skipping unchanged resolvers
//! whole, and naming and building Envoy's resources costs only what changed.
//!
//! What is never sent (docs/xds.md, "Guarantees"): a cluster whose endpoints are not known
//! (a Consul service that never answered, a Kubernetes Service whose endpoints have not
//! listed). Such an entry keeps what Envoy was last told, if anything, so a read that fails
//! or has not answered yet never empties a cluster.

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashMap};

use consul_resolver_core::assembler::snapshot::{Content, KubeServiceEntry, Part, Parts, ResolverEntry, ServiceEntry};
use consul_resolver_core::model::Endpoint;
use consul_resolver_xds::{Changes, EndpointHealth, Upstream, UpstreamEndpoint};

/// Cluster names start with these, by the kind of upstream.
const CONSUL: &str = "consul";
const KUBERNETES: &str = "kubernetes";

/// The cluster of a Consul service watched through a resolver.
pub(crate) fn consul_cluster(resolver_namespace: &str, resolver_name: &str, service: &str) -> String {
    format!("{CONSUL}/{resolver_namespace}/{resolver_name}/{service}")
}

/// The cluster of a Kubernetes Service's endpoint port: by the port's name, or the Service
/// alone when its port is unnamed (a Service of one port). A port's name always holds a
/// letter, so the two never collide.
pub(crate) fn kube_cluster(namespace: &str, service: &str, port_name: Option<&str>) -> String {
    match port_name {
        Some(port) => format!("{KUBERNETES}/{namespace}/{service}/{port}"),
        None => format!("{KUBERNETES}/{namespace}/{service}"),
    }
}

/// What was last handed over: the snapshot's entries, to compare by pointer, and the
/// clusters each entry made, by the entry's key (`consul/…`, or `kubernetes/…` without a
/// port).
#[derive(Default)]
pub(crate) struct View {
    resolvers: Vec<Part<ResolverEntry>>,
    kube: Parts<KubeServiceEntry>,
    told: HashMap<String, Vec<String>>,
}

impl View {
    /// What `content` changes against the last snapshot handed over, which it then
    /// becomes. An unchanged resolver is one pointer comparison, whatever it holds; only
    /// the entries that changed are named, built and compared with what was told.
    pub(crate) fn update(&mut self, content: &Content) -> Changes {
        let mut changes = Changes::default();
        let resolvers = std::mem::replace(&mut self.resolvers, content.resolvers.clone());
        let by_name = |a: &ResolverEntry, b: &ResolverEntry| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name));
        merge(&resolvers, &content.resolvers, by_name, |before, now| self.resolver(before, now, &mut changes));
        let kube = std::mem::replace(&mut self.kube, content.kubernetes_services.clone());
        // The same list (after a Consul change) has not one entry to compare.
        if !Parts::ptr_eq(&kube, &content.kubernetes_services) {
            self.kube_services(&kube, &content.kubernetes_services, &mut changes);
        }
        changes.removals.sort();
        changes
    }

    /// The Kubernetes Services' clusters, compared entry by entry.
    fn kube_services(
        &mut self,
        before: &[Part<KubeServiceEntry>],
        now: &[Part<KubeServiceEntry>],
        changes: &mut Changes,
    ) {
        let by_name =
            |a: &KubeServiceEntry, b: &KubeServiceEntry| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name));
        merge(before, now, by_name, |before, now| {
            let entry = now.or(before).expect("merge names one side at least");
            let key = kube_cluster(&entry.namespace, &entry.name, None);
            match now {
                Some(now) => self.visit(key, changes, |_| kube_upstreams(now)),
                None => self.forget(&key, changes),
            }
        });
    }

    /// A resolver that changed, came or went: its services, compared one by one.
    fn resolver(
        &mut self,
        before: Option<&Part<ResolverEntry>>,
        now: Option<&Part<ResolverEntry>>,
        changes: &mut Changes,
    ) {
        let r = now.or(before).expect("merge names one side at least");
        let by_name = |a: &ServiceEntry, b: &ServiceEntry| a.name.cmp(&b.name);
        merge(services(before), services(now), by_name, |was, is| {
            let service = is.or(was).expect("merge names one side at least");
            let key = consul_cluster(&r.namespace, &r.name, &service.name);
            match is {
                Some(is) => self.visit(key, changes, |key| consul_upstreams(key, is)),
                None => self.forget(&key, changes),
            }
        });
    }

    /// An entry that is new or changed: built again, unless its endpoints are not known,
    /// when what Envoy has stays (nothing, or the last known endpoints).
    fn visit(&mut self, key: String, changes: &mut Changes, build: impl FnOnce(&str) -> Option<Vec<Upstream>>) {
        let Some(upstreams) = build(&key) else { return };
        let mut clusters: Vec<String> = upstreams.iter().map(|u| u.name.clone()).collect();
        changes.upserts.extend(upstreams);
        // A port whose endpoints all left is emptied, not removed, while its Service is
        // routed to: Envoy keeps the cluster warm for when they come back.
        if let Some(before) = self.told.get(&key) {
            let gone: Vec<String> = before.iter().filter(|c| !clusters.contains(c)).cloned().collect();
            changes.upserts.extend(gone.iter().map(|name| Upstream { name: name.clone(), endpoints: Vec::new() }));
            clusters.extend(gone);
        }
        self.told.insert(key, clusters);
    }

    /// An entry no longer in the snapshot: its clusters go.
    fn forget(&mut self, key: &str, changes: &mut Changes) {
        if let Some(clusters) = self.told.remove(key) {
            changes.removals.extend(clusters);
        }
    }
}

fn services(resolver: Option<&Part<ResolverEntry>>) -> &[Part<ServiceEntry>] {
    resolver.map_or(&[][..], |r| &r.services[..])
}

/// Walks two lists sorted by `order` (the snapshot's lists are: docs/snapshot.md) side by
/// side, and calls `f` with the entry of each key on either side, except where both sides
/// hold the very same part, which is skipped: that is what makes an unchanged snapshot
/// cost a pointer comparison per entry, and an unchanged resolver one.
fn merge<T>(
    before: &[Part<T>],
    now: &[Part<T>],
    order: impl Fn(&T, &T) -> Ordering,
    mut f: impl FnMut(Option<&Part<T>>, Option<&Part<T>>),
) {
    debug_assert!(now.is_sorted_by(|x, y| order(x, y).is_lt()), "the snapshot's lists are sorted");
    let (mut b, mut n) = (before.iter().peekable(), now.iter().peekable());
    loop {
        let side = match (b.peek(), n.peek()) {
            (None, None) => return,
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (Some(x), Some(y)) if Part::ptr_eq(x, y) => {
                b.next();
                n.next();
                continue;
            }
            (Some(x), Some(y)) => order(x, y),
        };
        match side {
            Ordering::Less => f(b.next(), None),
            Ordering::Greater => f(None, n.next()),
            Ordering::Equal => f(b.next(), n.next()),
        }
    }
}

/// A Consul service's cluster, or `None` while its endpoints are not known: it never
/// answered and keeps nothing from before.
fn consul_upstreams(name: &str, service: &ServiceEntry) -> Option<Vec<Upstream>> {
    let known = service.synced || service.stale.is_some() || !service.endpoints.is_empty();
    known.then(|| {
        vec![Upstream { name: name.to_owned(), endpoints: service.endpoints.iter().map(consul_endpoint).collect() }]
    })
}

/// Every instance in the snapshot is one its resolver admits (its query asks only for
/// those), so each serves, at its Consul weight. Envoy refuses a weight of 0; Consul's 0
/// (a warning instance meant to take no traffic while others can) is Envoy's degraded
/// host, used only when too few healthy ones are left.
fn consul_endpoint(e: &Endpoint) -> UpstreamEndpoint {
    let (health, weight) = match e.weight.unwrap_or(1) {
        0 => (EndpointHealth::Degraded, 1),
        w => (EndpointHealth::Healthy, w),
    };
    UpstreamEndpoint { address: e.address.clone(), port: e.port, zone: e.zone.clone(), health, weight }
}

/// A Kubernetes Service's clusters, one per port name its endpoints carry, or `None` while
/// its endpoints have not listed. An address two slices both hold (slices are rebalanced
/// by their controller) is one endpoint, ready if either says so.
fn kube_upstreams(service: &KubeServiceEntry) -> Option<Vec<Upstream>> {
    if !service.synced {
        return None;
    }
    let mut by_port: BTreeMap<Option<&str>, BTreeMap<(&str, u16), bool>> = BTreeMap::new();
    for e in &service.endpoints {
        for port in &e.ports {
            let ready = by_port.entry(port.name.as_deref()).or_default().entry((&e.address, port.port)).or_default();
            *ready |= e.ready;
        }
    }
    let endpoint = |((address, port), ready): ((&str, u16), bool)| UpstreamEndpoint {
        address: address.to_owned(),
        port,
        zone: None,
        health: if ready { EndpointHealth::Healthy } else { EndpointHealth::Unhealthy },
        weight: 1,
    };
    let cluster = |port| kube_cluster(&service.namespace, &service.name, port);
    let upstreams = by_port.into_iter().map(|(port, endpoints)| Upstream {
        name: cluster(port),
        endpoints: endpoints.into_iter().map(endpoint).collect(),
    });
    Some(upstreams.collect())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::test_fixtures::{content, resolver_entry};
    use consul_resolver_core::assembler::snapshot::Stale;
    use consul_resolver_core::model::Health;
    use consul_resolver_core::model::{KubeEndpoint, KubePort};

    fn instance(address: &str, health: Health) -> Endpoint {
        Endpoint {
            address: address.into(),
            port: 8080,
            node: "node-1".into(),
            service_id: address.into(),
            tags: vec![],
            meta: BTreeMap::new(),
            health,
            zone: Some("zone-a".into()),
            weight: None,
        }
    }

    fn service(name: &str, synced: bool, endpoints: Vec<Endpoint>) -> Part<ServiceEntry> {
        Part::new(ServiceEntry {
            name: name.into(),
            synced,
            index: None,
            error: None,
            stale: None,
            endpoints: Arc::from(endpoints),
        })
    }

    fn with_services(services: Vec<Part<ServiceEntry>>) -> Content {
        let mut resolver = resolver_entry("shop", "consul");
        resolver.services = services.into();
        content(vec![resolver])
    }

    /// A pod: its address, its ports (name, number), whether it is ready.
    type Pod<'a> = (&'a str, &'a [(Option<&'a str>, u16)], bool);

    fn kube(name: &str, synced: bool, endpoints: Vec<Pod<'_>>) -> Part<KubeServiceEntry> {
        let endpoints = endpoints
            .into_iter()
            .map(|(address, ports, ready)| KubeEndpoint {
                address: address.into(),
                ports: ports
                    .iter()
                    .map(|(name, port)| KubePort { name: name.map(str::to_owned), port: *port })
                    .collect(),
                ready,
            })
            .collect();
        Part::new(KubeServiceEntry { namespace: "shop".into(), name: name.into(), synced, error: None, endpoints })
    }

    fn nothing(changes: &Changes) -> bool {
        changes.upserts.is_empty() && changes.removals.is_empty()
    }

    fn names(changes: &Changes) -> Vec<&str> {
        changes.upserts.iter().map(|u| u.name.as_str()).collect()
    }

    #[test]
    fn a_consul_service_is_one_cluster_with_its_instances_zones_and_health() {
        let mut view = View::default();
        let weighted = |address, health, weight| Endpoint { weight, ..instance(address, health) };
        let web = service(
            "web",
            true,
            vec![
                instance("10.0.0.1", Health::Passing),
                weighted("10.0.0.2", Health::Passing, Some(3)),
                weighted("10.0.0.3", Health::Warning, Some(0)),
            ],
        );
        let changes = view.update(&with_services(vec![web]));
        assert_eq!(names(&changes), ["consul/shop/consul/web"]);
        let endpoints = &changes.upserts[0].endpoints;
        assert_eq!((endpoints[0].address.as_str(), endpoints[0].port), ("10.0.0.1", 8080));
        assert_eq!(endpoints[1].zone.as_deref(), Some("zone-a"));
        // Admitted by the resolver's query, so they serve, at Consul's weights; a weight
        // of 0 is Envoy's degraded host.
        let served: Vec<_> = endpoints.iter().map(|e| (e.health, e.weight)).collect();
        assert_eq!(served, [(EndpointHealth::Healthy, 1), (EndpointHealth::Healthy, 3), (EndpointHealth::Degraded, 1)]);
        assert!(changes.removals.is_empty());
    }

    #[test]
    fn only_the_entry_that_changed_is_built_again() {
        let mut view = View::default();
        let (web, api) =
            (service("web", true, vec![]), service("api", true, vec![instance("10.0.0.1", Health::Passing)]));
        view.update(&with_services(vec![api.clone(), web.clone()]));
        // The same parts: nothing to tell.
        assert!(nothing(&view.update(&with_services(vec![api.clone(), web.clone()]))));
        // An equal value in a new part is built again (the assembler shares unchanged
        // parts, so a new part means a change), and only it.
        let web2 = service("web", true, vec![instance("10.0.0.9", Health::Passing)]);
        let changes = view.update(&with_services(vec![api, web2]));
        assert_eq!(names(&changes), ["consul/shop/consul/web"]);
        assert_eq!(changes.upserts[0].endpoints[0].address, "10.0.0.9");
    }

    #[test]
    fn a_service_never_answered_is_not_told_and_one_that_stops_answering_keeps_what_was_told() {
        let mut view = View::default();
        // Never answered: no cluster at all (Envoy would warm it and then serve it empty).
        assert!(nothing(&view.update(&with_services(vec![service("web", false, vec![])]))));
        let answered =
            view.update(&with_services(vec![service("web", true, vec![instance("10.0.0.1", Health::Passing)])]));
        assert_eq!(names(&answered), ["consul/shop/consul/web"]);
        // Its settings changed and the new query has not answered, keeping nothing: what
        // Envoy has stays, neither emptied nor removed.
        assert!(nothing(&view.update(&with_services(vec![service("web", false, vec![])]))));
        // Kept endpoints marked stale are known: they are told.
        let mut kept = ServiceEntry::clone(&service("web", false, vec![instance("10.0.0.2", Health::Passing)]));
        kept.stale = Some(Stale { since: "2026-01-01T00:00:00Z".into(), reason: "token".into() });
        let changes = view.update(&with_services(vec![Part::new(kept)]));
        assert_eq!(changes.upserts[0].endpoints[0].address, "10.0.0.2");
    }

    #[test]
    fn a_service_answered_empty_is_told_empty_and_one_no_longer_routed_to_is_removed() {
        let mut view = View::default();
        view.update(&with_services(vec![service("web", true, vec![instance("10.0.0.1", Health::Passing)])]));
        let emptied = view.update(&with_services(vec![service("web", true, vec![])]));
        assert_eq!(names(&emptied), ["consul/shop/consul/web"]);
        assert!(emptied.upserts[0].endpoints.is_empty());
        let gone = view.update(&with_services(vec![]));
        assert!(gone.upserts.is_empty());
        assert_eq!(gone.removals, ["consul/shop/consul/web"]);
        // Told once: gone for good.
        assert!(nothing(&view.update(&with_services(vec![]))));
    }

    #[test]
    fn a_resolver_that_comes_or_goes_adds_or_removes_its_services_and_no_other() {
        let mut view = View::default();
        let resolver = |namespace: &str, services: &[&str]| {
            let mut r = resolver_entry(namespace, "consul");
            r.services =
                services.iter().map(|s| service(s, true, vec![instance("10.0.0.1", Health::Passing)])).collect();
            Part::new(r)
        };
        let (a, b) = (resolver("a", &["api", "web"]), resolver("b", &["web"]));
        let mut c = content(vec![]);
        c.resolvers = vec![a.clone()];
        view.update(&c);
        c.resolvers = vec![a.clone(), b.clone()];
        assert_eq!(names(&view.update(&c)), ["consul/b/consul/web"]);
        c.resolvers = vec![b];
        let gone = view.update(&c);
        assert!(gone.upserts.is_empty());
        assert_eq!(gone.removals, ["consul/a/consul/api", "consul/a/consul/web"]);
    }

    #[test]
    fn a_kubernetes_service_is_a_cluster_per_port_name_with_readiness_as_health() {
        let mut view = View::default();
        let mut c = content(vec![]);
        let two_ports: &[(Option<&str>, u16)] = &[(Some("http"), 8080), (Some("metrics"), 9090)];
        // Sorted by namespace and name, as in every snapshot.
        c.kubernetes_services = Parts::from(vec![
            kube("pending", false, vec![]),
            kube("single", true, vec![("10.1.0.3", &[(None, 80)], true)]),
            // 10.1.0.1 in two slices, one of them saying it is not ready yet.
            kube(
                "web",
                true,
                vec![("10.1.0.1", two_ports, false), ("10.1.0.2", two_ports, false), ("10.1.0.1", two_ports, true)],
            ),
        ]);
        let changes = view.update(&c);
        assert_eq!(
            names(&changes),
            ["kubernetes/shop/single", "kubernetes/shop/web/http", "kubernetes/shop/web/metrics"]
        );
        let http = &changes.upserts[1].endpoints;
        assert_eq!(
            http.iter().map(|e| (e.port, e.health)).collect::<Vec<_>>(),
            [(8080, EndpointHealth::Healthy), (8080, EndpointHealth::Unhealthy)]
        );
        // Every pod gone: the ports' clusters are emptied, not removed, while routed to.
        c.kubernetes_services.to_mut()[2] = kube("web", true, vec![]);
        let emptied = view.update(&c);
        assert_eq!(names(&emptied), ["kubernetes/shop/web/http", "kubernetes/shop/web/metrics"]);
        assert!(emptied.upserts.iter().all(|u| u.endpoints.is_empty()));
        assert!(emptied.removals.is_empty());
        // No longer routed to: all its clusters go.
        c.kubernetes_services.to_mut().remove(2);
        assert_eq!(view.update(&c).removals, ["kubernetes/shop/web/http", "kubernetes/shop/web/metrics"]);
    }
}
