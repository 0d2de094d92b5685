//! The assembler: turns the world into a deterministic snapshot and, from the same
//! reading, the set of watches the world implies (the feedback loop: Mappings name
//! services, services become Consul or EndpointSlice watches, resolvers name Secrets).
//!
//! It works in two passes and incrementally. Pass one routes each Mapping to its target
//! (a resolver's Consul service, a Kubernetes Service, an address). Pass two reads each
//! target's endpoints, and derives the desired watches from the targets. Between changes it
//! keeps both passes' results, and redoes only what the world's [`Changes`] touch:
//! - a Consul answer touches only the services read through that query;
//! - a Mapping change only its own route and the targets it adds or drops;
//! - a resolver or Secret change re-reads the resolvers and re-routes every Mapping
//!   (rare, and cheap: Mappings are decoded once, when they arrive);
//! - the desired watches are derived again only when a route or a resolver changed, so a
//!   Consul-only change never touches the registry.
//!
//! Problems (a bad `service`, an unknown or ambiguous resolver, an invalid resolver spec)
//! are values in the snapshot, never panics, and never guesses.

pub mod gzip;
pub mod kept;
pub(crate) mod kube_endpoints;
pub mod resolvers;
pub mod snapshot;

use std::collections::{BTreeMap, BTreeSet};
use std::time::SystemTime;

use crate::delta::Delta;
use crate::keys::{ConsulKey, KubeKey, WatchKey};
use crate::model::{Decoded, Endpoints, MappingObject, ObjectId, Stored};
use crate::world::{Changes, ConsulStore, World};
use consul_resolver_api::mapping::{self, MappingKind};
use consul_resolver_api::names::{self, NamespacedName};
use consul_resolver_api::resolver::{GROUP, KIND};
use consul_resolver_api::service::Host;

pub use kept::Kept;
use kept::{KeptService, ServiceOf};
pub use kube_endpoints::EndpointsApi;
use kube_endpoints::Scoping;
use resolvers::Resolver;
use snapshot::{
    Bootstrap, KubeServiceEntry, MappingEntry, Part, Problem, ResolverEntry, ServiceEntry, Stale, Target,
    UnusableReason, WatchedEntry,
};
pub use snapshot::{Content, Snapshot};

/// A resolver named by `namespace/name`, or by `name` alone (looked up like a Mapping's
/// `resolver`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolverName {
    pub namespace: Option<String>,
    pub name: String,
}

/// `NAME` or `NAMESPACE/NAME`, each part held to Kubernetes' rule for it (a resolver's name
/// is an object name, an RFC 1123 subdomain; a namespace an RFC 1123 label).
impl std::str::FromStr for ResolverName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (namespace, name) = match s.split_once('/') {
            Some((ns, name)) => (Some(ns), name),
            None => (None, s),
        };
        let bad = |why: &str| format!("{s:?} is not NAME or NAMESPACE/NAME: {why}");
        if let Some(ns) = namespace {
            names::dns1123_label(ns).map_err(|why| bad(&format!("namespace {ns:?} {why}")))?;
        }
        names::dns1123_subdomain(name).map_err(|why| bad(&format!("name {name:?} {why}")))?;
        Ok(ResolverName { namespace: namespace.map(str::to_owned), name: name.to_owned() })
    }
}

/// The default of [`Config::endpoints_namespace_watch_above`].
pub const DEFAULT_ENDPOINTS_NAMESPACE_WATCH_ABOVE: usize = 100;

/// What the assembler needs besides the world.
#[derive(Debug, Clone)]
pub struct Config {
    /// Resolvers and Mappings of other Ambassador IDs are ignored.
    pub ambassador_id: String,
    /// Resolver for Mappings that name none; without it they are Kubernetes services.
    pub default_resolver: Option<ResolverName>,
    pub endpoints_api: EndpointsApi,
    /// Past this many routed-to Services in one namespace, their endpoints come from one
    /// watch of the namespace instead of one each ([`kube_endpoints::Scoping`]).
    pub endpoints_namespace_watch_above: usize,
    /// The operator's environment, for `${VAR}` in resolver addresses.
    pub env: BTreeMap<String, String>,
    /// Static `--watch` keys, whose objects are copied into the snapshot.
    pub static_watches: Vec<KubeKey>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            ambassador_id: consul_resolver_api::DEFAULT_AMBASSADOR_ID.to_owned(),
            default_resolver: None,
            endpoints_api: EndpointsApi::default(),
            endpoints_namespace_watch_above: DEFAULT_ENDPOINTS_NAMESPACE_WATCH_ABOVE,
            env: BTreeMap::new(),
            static_watches: Vec::new(),
        }
    }
}

/// The objects of a namespace's endpoints watch by the Service they belong to.
fn group(store: &crate::world::KubeStore) -> BTreeMap<&str, Vec<&Stored>> {
    let mut by_service: BTreeMap<&str, Vec<&Stored>> = BTreeMap::new();
    for obj in store.objects.values() {
        if let Decoded::Endpoints { service, .. } = &obj.decoded {
            by_service.entry(service.as_str()).or_default().push(obj);
        }
    }
    by_service
}

/// A consumer of targets: what the routes table is keyed by. Each one routes to at most one
/// target (a resolver's Consul service, a Kubernetes Service), and every consumer of one
/// target shares its watch. Sorts as the snapshot's entries do: Mappings by kind, namespace
/// and name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Consumer {
    /// A Mapping or TCPMapping.
    Mapping { kind: MappingKind, id: NamespacedName },
}

impl Consumer {
    fn mapping(kind: MappingKind, id: &ObjectId) -> Self {
        Consumer::Mapping { kind, id: NamespacedName::new(id.namespace.clone().unwrap_or_default(), id.name.clone()) }
    }

    /// A problem reported on this consumer's object.
    fn problem(&self, message: String) -> Problem {
        match self {
            Consumer::Mapping { kind, id } => {
                Problem { kind: kind.kind().into(), namespace: id.namespace.clone(), name: id.name.clone(), message }
            }
        }
    }
}

/// One Mapping, routed.
#[derive(Debug, Clone)]
struct Routed {
    /// Its snapshot entry; `None` when it cannot be read at all (a problem only).
    entry: Option<Part<MappingEntry>>,
    problem: Option<Problem>,
    uses: Uses,
}

/// The target a route reads endpoints from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Uses {
    /// A resolver's service.
    Consul(NamespacedName, String),
    /// A Kubernetes Service.
    Kube(NamespacedName),
    Nothing,
}

/// A Kubernetes Service routed to, as last read.
#[derive(Debug, Clone)]
struct KubeTarget {
    /// The watch its endpoints come from (its own, or its namespace's).
    key: KubeKey,
    entry: Part<KubeServiceEntry>,
    /// Moved to `key` before it listed: `entry` is still the previous watch's.
    awaiting: bool,
}

/// The assembler's state between changes: what each pass produced, and what the services'
/// entries were read from.
#[derive(Debug, Clone)]
pub struct Assembler {
    cfg: Config,
    /// Endpoints last obtained per resolver service (last known good).
    kept: Kept,
    /// Resolvers in scope, sorted by namespace and name.
    resolvers: Vec<Resolver>,
    lookup: Lookup,
    routes: BTreeMap<Consumer, Routed>,
    /// Per resolver, per service, how many routes use it.
    consul_uses: BTreeMap<NamespacedName, BTreeMap<String, usize>>,
    /// Per Kubernetes Service, the routes to it.
    kube_uses: BTreeMap<NamespacedName, BTreeSet<Consumer>>,
    /// Per resolver, its services' entries; and the resolver's whole entry.
    services: BTreeMap<NamespacedName, BTreeMap<String, Part<ServiceEntry>>>,
    resolver_entries: BTreeMap<NamespacedName, Part<ResolverEntry>>,
    kube_targets: BTreeMap<NamespacedName, KubeTarget>,
    /// Which namespaces' endpoints are watched whole.
    scoping: Scoping,
    /// The Kubernetes targets were not read: not every route was known yet.
    kube_deferred: bool,
    /// The desired watches, each with how many targets or resolvers imply it (a query can
    /// be shared by resolvers with the same settings).
    desired: BTreeMap<WatchKey, usize>,
    /// Per resolver, the services that started or stopped being routed to since its
    /// services were last read.
    touched: BTreeMap<NamespacedName, BTreeSet<String>>,
    /// Nothing has been read yet: the first update reads everything.
    fresh: bool,
}

impl Assembler {
    pub fn new(cfg: Config) -> Self {
        Assembler {
            cfg,
            kept: Kept::default(),
            resolvers: Vec::new(),
            lookup: Lookup::default(),
            routes: BTreeMap::new(),
            consul_uses: BTreeMap::new(),
            kube_uses: BTreeMap::new(),
            services: BTreeMap::new(),
            resolver_entries: BTreeMap::new(),
            kube_targets: BTreeMap::new(),
            scoping: Scoping::default(),
            kube_deferred: false,
            desired: BTreeMap::new(),
            touched: BTreeMap::new(),
            fresh: true,
        }
    }

    /// The watches the world implies (besides the operator's fixed ones).
    pub fn desired(&self) -> impl Iterator<Item = &WatchKey> {
        self.desired.keys()
    }

    /// Makes the next update read everything, as a first one does (tests compare the
    /// incremental result with it).
    #[cfg(test)]
    pub(crate) fn read_everything_next(&mut self) {
        self.fresh = true;
    }

    #[cfg(test)]
    pub(crate) fn kept(&self) -> &Kept {
        &self.kept
    }

    /// Folds `changes` of `world` in: redoes what they touch, and says which watches start
    /// or stop being desired (sorted, disjoint). `now` stamps the moment a service's
    /// endpoints become stale.
    pub fn update(&mut self, world: &World, changes: &Changes, now: SystemTime) -> Delta<WatchKey> {
        // Namespaces are watched only for resolvers that select them by label.
        let everything =
            self.fresh || changes.kube.keys().any(|k| k.is(GROUP, KIND) || k.is("", "Secret") || k.is("", "Namespace"));
        self.fresh = false;
        let mut delta = Delta::default();
        if everything {
            // Resolvers (or the Secrets they read) changed: read them, route every Mapping
            // and read every service again, and derive the desired watches anew.
            self.resolvers = resolvers::read(world, &self.cfg.ambassador_id, &self.cfg.env);
            self.lookup = Lookup::new(&self.resolvers, world);
            self.reroute_all(world);
            self.read_services(world, None, now, &mut delta);
            self.read_kube_targets(world, changes, true, &mut delta);
            let before = std::mem::take(&mut self.desired);
            self.desired = self.derive_desired();
            return Delta {
                added: self.desired.keys().filter(|k| !before.contains_key(k)).cloned().collect(),
                removed: before.into_keys().filter(|k| !self.desired.contains_key(k)).collect(),
            };
        }
        let mut routes_changed = false;
        for (key, ids) in &changes.kube {
            let Some(kind) = MappingKind::ALL.into_iter().find(|k| key.is(mapping::GROUP, k.kind())) else {
                continue;
            };
            match ids {
                // Every one is routed again: no short circuit.
                Some(ids) => {
                    for id in ids {
                        routes_changed |= self.reroute(world, kind, id);
                    }
                }
                None => routes_changed |= self.reroute_kind(world, kind),
            }
        }
        // Services whose entry must be read again: those read through a changed query.
        let mut dirty: BTreeMap<NamespacedName, BTreeSet<String>> = BTreeMap::new();
        for key in &changes.consul {
            for r in &self.resolvers {
                if r.settings.as_ref().is_ok_and(|s| s.queries(key)) {
                    dirty.entry(r.id()).or_default().insert(key.service.clone());
                }
            }
        }
        if !dirty.is_empty() || !self.touched.is_empty() {
            self.read_services(world, Some(&dirty), now, &mut delta);
        }
        self.read_kube_targets(world, changes, routes_changed, &mut delta);
        self.apply_delta(delta)
    }

    /// The snapshot content, from the parts kept (pointer copies, and the small lists).
    pub fn content(&self, world: &World) -> Content {
        let mut problems: Vec<Problem> = self
            .resolvers
            .iter()
            .filter_map(|r| {
                let u = r.settings.as_ref().err().filter(|u| u.reason != UnusableReason::WaitingForSecret)?;
                Some(Problem {
                    kind: KIND.into(),
                    namespace: r.namespace.clone(),
                    name: r.name.clone(),
                    message: u.message.clone(),
                })
            })
            .collect();
        problems.extend(self.routes.values().filter_map(|r| r.problem.clone()));
        for (id, target) in &self.kube_targets {
            let Some(why) = &target.entry.error else { continue };
            for consumer in self.kube_uses.get(id).into_iter().flatten() {
                problems.push(consumer.problem(format!("cannot watch the endpoints of Service {id}: {why}")));
            }
        }
        problems.sort();
        problems.dedup();
        let resolvers: Vec<Part<ResolverEntry>> =
            self.resolvers.iter().filter_map(|r| self.resolver_entries.get(&r.id()).cloned()).collect();
        let unsynced = resolvers
            .iter()
            .flat_map(|r| {
                r.services.iter().filter(|s| !s.synced).map(|s| format!("{}/{}/{}", r.namespace, r.name, s.name))
            })
            .collect::<Vec<_>>();
        let watched = self
            .cfg
            .static_watches
            .iter()
            .map(|key| WatchedEntry {
                watch: key.to_string(),
                objects: world
                    .kube()
                    .get(key)
                    .into_iter()
                    .flat_map(|s| s.objects.values())
                    .filter_map(|o| o.raw.clone())
                    .collect(),
            })
            .collect();
        Content {
            bootstrap: Bootstrap { complete: unsynced.is_empty(), unsynced },
            resolvers,
            mappings: self.routes.values().filter_map(|r| r.entry.clone()).collect(),
            kubernetes_services: self.kube_targets.values().map(|t| t.entry.clone()).collect(),
            watched,
            problems,
        }
    }

    /// Routes every Mapping again (the resolvers changed).
    fn reroute_all(&mut self, world: &World) {
        self.routes.clear();
        self.consul_uses.clear();
        self.kube_uses.clear();
        for kind in MappingKind::ALL {
            for (id, stored) in world.objects_of(mapping::GROUP, kind.kind()) {
                let consumer = Consumer::mapping(kind, id);
                if let Decoded::Mapping(m) = &stored.decoded
                    && let Some(routed) = self.route(&consumer, m)
                {
                    self.add_route(consumer, routed);
                }
            }
        }
    }

    /// Routes every Mapping of `kind` again (its watch relisted, or came or went).
    fn reroute_kind(&mut self, world: &World, kind: MappingKind) -> bool {
        let mine: Vec<Consumer> = self
            .routes
            .keys()
            .filter(|c| matches!(c, Consumer::Mapping { kind: k, .. } if *k == kind))
            .cloned()
            .collect();
        for key in mine {
            self.remove_route(&key);
        }
        for (id, stored) in world.objects_of(mapping::GROUP, kind.kind()) {
            let consumer = Consumer::mapping(kind, id);
            if let Decoded::Mapping(m) = &stored.decoded
                && let Some(routed) = self.route(&consumer, m)
            {
                self.add_route(consumer, routed);
            }
        }
        true
    }

    /// Routes one Mapping again; whether its route changed.
    fn reroute(&mut self, world: &World, kind: MappingKind, id: &ObjectId) -> bool {
        let key = Consumer::mapping(kind, id);
        let now = world.object_of(mapping::GROUP, kind.kind(), id).and_then(|stored| match &stored.decoded {
            Decoded::Mapping(m) => self.route(&key, m),
            _ => None,
        });
        let before = self.routes.get(&key);
        let same = match (before, &now) {
            (None, None) => true,
            (Some(b), Some(n)) => b.entry == n.entry && b.problem == n.problem && b.uses == n.uses,
            _ => false,
        };
        if same {
            return false;
        }
        self.remove_route(&key);
        if let Some(routed) = now {
            self.add_route(key, routed);
        }
        true
    }

    fn add_route(&mut self, key: Consumer, routed: Routed) {
        match &routed.uses {
            Uses::Consul(rid, service) => {
                let uses = self.consul_uses.entry(rid.clone()).or_default().entry(service.clone()).or_default();
                *uses += 1;
                if *uses == 1 {
                    self.touched.entry(rid.clone()).or_default().insert(service.clone());
                }
            }
            Uses::Kube(target) => {
                self.kube_uses.entry(target.clone()).or_default().insert(key.clone());
            }
            Uses::Nothing => {}
        }
        self.routes.insert(key, routed);
    }

    fn remove_route(&mut self, key: &Consumer) {
        let Some(routed) = self.routes.remove(key) else { return };
        match routed.uses {
            Uses::Consul(rid, service) => {
                if let Some(services) = self.consul_uses.get_mut(&rid) {
                    if let Some(n) = services.get_mut(&service) {
                        *n -= 1;
                        if *n == 0 {
                            services.remove(&service);
                            self.touched.entry(rid.clone()).or_default().insert(service);
                        }
                    }
                    if services.is_empty() {
                        self.consul_uses.remove(&rid);
                    }
                }
            }
            Uses::Kube(target) => {
                if let Some(by) = self.kube_uses.get_mut(&target) {
                    by.remove(key);
                    if by.is_empty() {
                        self.kube_uses.remove(&target);
                    }
                }
            }
            Uses::Nothing => {}
        }
    }

    /// Pass one for one Mapping: where its traffic goes. `None`: not this operator's.
    fn route(&self, consumer: &Consumer, m: &Result<MappingObject, String>) -> Option<Routed> {
        let m = match m {
            Ok(m) => m,
            Err(e) => {
                return Some(Routed { entry: None, problem: Some(consumer.problem(e.clone())), uses: Uses::Nothing });
            }
        };
        if !m.serves_ambassador_id(&self.cfg.ambassador_id) {
            return None;
        }
        let (target, uses, why) = match &m.target {
            Err(e) => (Target::Unresolved, Uses::Nothing, Some(format!("spec.service: {e}"))),
            Ok(svc) => self.target(m, svc),
        };
        let problem = why.map(|why| consumer.problem(why));
        let entry = MappingEntry {
            kind: m.kind.kind().into(),
            namespace: m.namespace.clone(),
            name: m.name.clone(),
            service: m.service.clone(),
            target,
        };
        Some(Routed { entry: Some(Part::new(entry)), problem, uses })
    }

    /// The target of a Mapping whose `service` parsed, what it reads, and why it cannot
    /// be routed.
    fn target(
        &self,
        m: &MappingObject,
        svc: &consul_resolver_api::service::ServiceRef,
    ) -> (Target, Uses, Option<String>) {
        let unresolved = |why: String| (Target::Unresolved, Uses::Nothing, Some(why));
        let (name, namespace) = match &svc.host {
            Host::Ip(_) => {
                let address = consul_resolver_api::service::ServiceRef { scheme: None, ..svc.clone() }.to_string();
                return (Target::Address { address }, Uses::Nothing, None);
            }
            Host::Service { name, namespace } => (name, namespace),
        };
        let wanted = match (&m.resolver, &self.cfg.default_resolver) {
            (Some(r), _) => ResolverName { namespace: None, name: r.clone() },
            (None, Some(d)) => d.clone(),
            (None, None) => {
                let ns = namespace.clone().unwrap_or_else(|| m.namespace.clone());
                // The name goes into a label or field selector: check it first.
                if let Err(why) = names::dns1035_label(name) {
                    return unresolved(format!(
                        "spec.service: {name:?} is not a valid Kubernetes Service name: it {why}"
                    ));
                }
                if let Err(why) = names::dns1123_label(&ns) {
                    return unresolved(format!("spec.service: {ns:?} is not a valid namespace: it {why}"));
                }
                let target = Target::Kubernetes { namespace: ns.clone(), service: name.clone(), port: svc.port };
                return (target, Uses::Kube(NamespacedName::new(ns, name.clone())), None);
            }
        };
        match self.lookup.find(&self.resolvers, &m.namespace, &wanted) {
            Found::One(i) => {
                let r = &self.resolvers[i];
                let rid = r.id();
                match &r.settings {
                    // Unless served from the endpoints last obtained, or waiting a moment
                    // for a Secret: then the Mapping keeps its route.
                    Err(u)
                        if u.reason != UnusableReason::WaitingForSecret
                            && self.kept.get(&ServiceOf::new(&rid, name)).is_none() =>
                    {
                        unresolved(format!("resolver {rid} cannot be used: {}", u.message))
                    }
                    _ => {
                        let target = Target::Consul {
                            resolver_namespace: r.namespace.clone(),
                            resolver_name: r.name.clone(),
                            service: name.clone(),
                            port: svc.port,
                        };
                        (target, Uses::Consul(rid, name.clone()), None)
                    }
                }
            }
            Found::None => {
                let shown = match &wanted.namespace {
                    Some(ns) => format!("{ns}/{}", wanted.name),
                    None => wanted.name.clone(),
                };
                unresolved(format!(
                    "resolver {shown:?}: no ConsulResolver of that name in {} or any other watched namespace",
                    m.namespace
                ))
            }
            Found::NotServed(all) => unresolved(format!(
                "resolver {} does not serve Mappings from namespace {}: its spec.allowedNamespaces does not admit it (absent, only its own namespace; `from: All`, or `from: Selector` with the namespace's labels, shares it)",
                all.join(", "),
                m.namespace
            )),
            Found::Ambiguous(all) => unresolved(format!(
                "resolver {:?} is ambiguous: no ConsulResolver of that name in {}, and several elsewhere ({}); name one in the Mapping's namespace",
                wanted.name,
                m.namespace,
                all.join(", ")
            )),
        }
    }

    /// Pass two for Consul: each resolver's services (listed in its spec, or routed to)
    /// and their entries. With `dirty` (`None`: everything), reads the services read
    /// through a changed query, and those of resolvers whose routes changed; drops those no
    /// longer wanted; rebuilds the entries of resolvers whose services changed. Records the
    /// queries that start or stop being wanted in `delta`.
    fn read_services(
        &mut self,
        world: &World,
        dirty: Option<&BTreeMap<NamespacedName, BTreeSet<String>>>,
        now: SystemTime,
        delta: &mut Delta<WatchKey>,
    ) {
        let touched = std::mem::take(&mut self.touched);
        let Some(dirty) = dirty else { return self.read_all_services(world, now, delta) };
        for r in &self.resolvers {
            let rid = r.id();
            let answered = dirty.get(&rid);
            let routed = touched.get(&rid);
            if answered.is_none() && routed.is_none() {
                continue; // Neither its queries nor its routes changed.
            }
            let uses = self.consul_uses.get(&rid);
            let wanted =
                |name: &str| r.listed_services().any(|s| s == name) || uses.is_some_and(|u| u.contains_key(name));
            let mine = self.services.entry(rid.clone()).or_default();
            let mut changed = false;
            let names: BTreeSet<&String> = answered.into_iter().chain(routed).flatten().collect();
            for name in names {
                if !wanted(name) {
                    if mine.remove(name.as_str()).is_some() {
                        forget_service(r, &rid, name, &mut self.kept, delta);
                        changed = true;
                    }
                    continue;
                }
                let previous = mine.get(name.as_str());
                if previous.is_some() && !answered.is_some_and(|a| a.contains(name)) {
                    continue; // Still wanted, and its answer did not change.
                }
                if previous.is_none()
                    && let Ok(settings) = &r.settings
                {
                    delta.added.push(WatchKey::Consul(settings.key(name)));
                }
                let entry = service_entry(world, r, &rid, name, &mut self.kept, now).map(Part::new);
                if entry.as_deref() != previous.map(|p| &**p) {
                    changed = true;
                    match entry {
                        Some(entry) => mine.insert(name.clone(), entry),
                        None => mine.remove(name.as_str()),
                    };
                }
            }
            if changed || !self.resolver_entries.contains_key(&rid) {
                let entry = resolver_entry(r, mine);
                self.resolver_entries.insert(rid, entry);
            }
        }
    }

    /// Reads every resolver's services anew: after the resolvers (or their Secrets)
    /// changed.
    fn read_all_services(&mut self, world: &World, now: SystemTime, delta: &mut Delta<WatchKey>) {
        let mut old_services = std::mem::take(&mut self.services);
        let mut old_entries = std::mem::take(&mut self.resolver_entries);
        for r in &self.resolvers {
            let rid = r.id();
            let mut wanted: BTreeSet<&str> = r.listed_services().collect();
            wanted.extend(self.consul_uses.get(&rid).into_iter().flatten().map(|(s, _)| s.as_str()));
            let mut old = old_services.remove(&rid).unwrap_or_default();
            let mut mine = BTreeMap::new();
            for name in wanted {
                let previous = old.remove(name);
                if previous.is_none()
                    && let Ok(settings) = &r.settings
                {
                    delta.added.push(WatchKey::Consul(settings.key(name)));
                }
                if let Some(entry) = service_entry(world, r, &rid, name, &mut self.kept, now) {
                    // The same entry keeps its allocation: equal parts stay shared.
                    let entry = previous.filter(|p| **p == entry).unwrap_or_else(|| Part::new(entry));
                    mine.insert(name.to_owned(), entry);
                }
            }
            for name in old.keys() {
                forget_service(r, &rid, name, &mut self.kept, delta);
            }
            let fresh = resolver_entry(r, &mine);
            let entry = old_entries.remove(&rid).filter(|e| **e == *fresh).unwrap_or(fresh);
            self.resolver_entries.insert(rid.clone(), entry);
            self.services.insert(rid, mine);
        }
        // Resolvers deleted (or out of scope) let their kept endpoints go.
        let services = &self.services;
        self.kept.retain(|of| services.get(&of.resolver).is_some_and(|s| s.contains_key(&of.service)));
    }

    /// Pass two for Kubernetes: the Services routed to, their endpoints read again when
    /// their watch changed, moved (between their own and their namespace's), or they are
    /// new. Records endpoint watches that start or stop being wanted in `delta`.
    fn read_kube_targets(
        &mut self,
        world: &World,
        changes: &Changes,
        routes_changed: bool,
        delta: &mut Delta<WatchKey>,
    ) {
        let api = self.cfg.endpoints_api;
        // Until every route is known (a cold start's Mappings are folded in as they come),
        // how many Services a namespace has is not known either: starting a watch per
        // Service of the first pages would start, then stop, up to a threshold's worth.
        let routes_known = world
            .kube()
            .iter()
            .filter(|(k, _)| MappingKind::ALL.into_iter().any(|m| k.is(mapping::GROUP, m.kind())))
            .all(|(_, s)| s.listed);
        if !routes_known {
            self.kube_deferred = true;
            return;
        }
        let deferred = std::mem::take(&mut self.kube_deferred);
        if !routes_changed && !deferred && !changes.kube.keys().any(|k| k.is(api.group(), api.kind())) {
            return;
        }
        if routes_changed || deferred {
            let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
            for target in self.kube_uses.keys() {
                *counts.entry(target.namespace.as_str()).or_default() += 1;
            }
            self.scoping.update(counts.into_iter(), self.cfg.endpoints_namespace_watch_above);
        }
        // A namespace's watch holds every Service's objects: grouped once per pass.
        let mut grouped: BTreeMap<KubeKey, BTreeMap<&str, Vec<&Stored>>> = BTreeMap::new();
        let mut targets = BTreeMap::new();
        for id in self.kube_uses.keys() {
            let (ns, name) = (&id.namespace, &id.name);
            let key = self.scoping.key(api, ns, name);
            let previous = self.kube_targets.remove(id);
            let target = match previous {
                Some(t) if t.key == key && !changes.kube.contains_key(&key) => t,
                previous => {
                    let store = world.kube().get(&key);
                    let moved = previous.as_ref().is_some_and(|p| p.key != key);
                    if previous.is_none() || moved {
                        delta.added.push(WatchKey::Kube(key.clone()));
                    }
                    if let Some(p) = previous.as_ref().filter(|_| moved) {
                        delta.removed.push(WatchKey::Kube(p.key.clone()));
                    }
                    let listed = store.is_some_and(|s| s.listed);
                    let error = store.and_then(|s| s.rejection()).map(str::to_owned);
                    match previous {
                        // Moved to a watch that has not listed yet: what the old one last
                        // said stands until the new one has listed (never an empty gap).
                        Some(p) if (moved || p.awaiting) && !listed && error.is_none() => {
                            KubeTarget { key, entry: p.entry, awaiting: true }
                        }
                        _ => {
                            let endpoints = match store {
                                None => Vec::new(),
                                Some(s) if self.scoping.is_wide(ns) => {
                                    let by_service = grouped.entry(key.clone()).or_insert_with(|| group(s));
                                    kube_endpoints::merge(
                                        name,
                                        by_service.get(name.as_str()).into_iter().flatten().copied(),
                                    )
                                }
                                Some(s) => kube_endpoints::merge(name, s.objects.values()),
                            };
                            let entry = Part::new(KubeServiceEntry {
                                namespace: ns.clone(),
                                name: name.clone(),
                                synced: listed,
                                error,
                                endpoints,
                            });
                            KubeTarget { key, entry, awaiting: false }
                        }
                    }
                }
            };
            targets.insert(id.clone(), target);
        }
        for target in std::mem::replace(&mut self.kube_targets, targets).into_values() {
            delta.removed.push(WatchKey::Kube(target.key));
        }
    }

    /// Applies the watches that start or stop being wanted to the counts; says which are
    /// now wanted at all, or no longer.
    fn apply_delta(&mut self, delta: Delta<WatchKey>) -> Delta<WatchKey> {
        let mut updated = Delta::default();
        for key in delta.removed {
            if let Some(n) = self.desired.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    self.desired.remove(&key);
                    updated.removed.push(key);
                }
            }
        }
        for key in delta.added {
            let n = self.desired.entry(key.clone()).or_default();
            *n += 1;
            if *n == 1 {
                updated.added.push(key);
            }
        }
        // Removed and added back in one update: nothing to do for the registry.
        updated.added.retain(|k| !updated.removed.contains(k));
        updated.removed.retain(|k| !self.desired.contains_key(k));
        updated.added.sort();
        updated.removed.sort();
        updated
    }

    /// The watches the routes and resolvers imply, counted: their Secrets, their
    /// services' Consul queries, and the endpoints of the Kubernetes Services routed to.
    fn derive_desired(&self) -> BTreeMap<WatchKey, usize> {
        let mut desired: BTreeMap<WatchKey, usize> = BTreeMap::new();
        let mut count = |key: WatchKey| *desired.entry(key).or_default() += 1;
        for r in &self.resolvers {
            r.secrets.iter().cloned().map(WatchKey::Kube).for_each(&mut count);
            let Ok(settings) = &r.settings else { continue };
            let rid = r.id();
            for name in self.services.get(&rid).into_iter().flat_map(|s| s.keys()) {
                count(WatchKey::Consul(settings.key(name)));
            }
        }
        for target in self.kube_targets.values() {
            count(WatchKey::Kube(target.key.clone()));
        }
        if self.resolvers.iter().any(Resolver::selects_namespaces) {
            count(WatchKey::Kube(resolvers::namespaces_key()));
        }
        desired
    }
}

/// A service resolver `r` no longer wants: its query stops, and its kept endpoints go.
fn forget_service(r: &Resolver, rid: &NamespacedName, name: &str, kept: &mut Kept, delta: &mut Delta<WatchKey>) {
    if let Ok(settings) = &r.settings {
        delta.removed.push(WatchKey::Consul(settings.key(name)));
    }
    kept.remove(&ServiceOf::new(rid, name));
}

/// A resolver's entry in the snapshot, with its services' entries (shared).
fn resolver_entry(r: &Resolver, services: &BTreeMap<String, Part<ServiceEntry>>) -> Part<ResolverEntry> {
    Part::new(ResolverEntry {
        namespace: r.namespace.clone(),
        name: r.name.clone(),
        generation: r.generation,
        address: r.settings.as_ref().map(|s| s.server().address.clone()).unwrap_or_default(),
        datacenter: r.spec.as_ref().and_then(|s| s.datacenter.clone()),
        unusable: r.settings.as_ref().err().cloned(),
        services: services.values().cloned().collect(),
    })
}

/// One service's entry: its query's answer, or (until the query answers, or while the
/// resolver is unusable) the endpoints last obtained, or nothing to show. Updates what is
/// kept of it.
fn service_entry(
    world: &World,
    r: &Resolver,
    rid: &NamespacedName,
    name: &str,
    kept: &mut Kept,
    now: SystemTime,
) -> Option<ServiceEntry> {
    let of = ServiceOf::new(rid, name);
    let previous = kept.get(&of).cloned();
    let (entry, keep) = match &r.settings {
        Ok(settings) => {
            let key = settings.key(name);
            current(world.consul().get(&key), &key, previous.as_ref(), name, now)
        }
        Err(u) => match &previous {
            Some(p) => stale(p, u.message.clone(), None, name, now),
            None if u.reason == UnusableReason::WaitingForSecret => (unsynced(name, None), None),
            None => return None,
        },
    };
    match keep {
        Some(k) => kept.insert(of, k),
        None => kept.remove(&of),
    }
    Some(entry)
}

/// A service whose resolver is usable: its query's answer, or (until the query answers)
/// the endpoints last obtained.
fn current(
    store: Option<&ConsulStore>,
    key: &ConsulKey,
    previous: Option<&KeptService>,
    name: &str,
    now: SystemTime,
) -> (ServiceEntry, Option<KeptService>) {
    let error = store.and_then(|s| s.last_error.clone());
    match (store.filter(|s| s.answered()), previous) {
        (Some(s), _) => {
            // Current. A failing query keeps its endpoints; they are stale from the first
            // failure on. An agent answering from a cache cut off from its servers gives
            // endpoints stale since the cut-off.
            let since = previous.filter(|p| p.key == *key).and_then(|p| p.stale_since).unwrap_or(now);
            let (stale_since, stale) = match (&error, s.cut_off_since) {
                (Some(e), _) => (Some(since), Some(Stale { since: kept::rfc3339(since), reason: e.clone() })),
                (None, Some(cut)) => {
                    let at = kept::rfc3339(cut);
                    let reason = format!(
                        "the Consul agent answers from its cache, cut off from its servers since {at} \
                         (X-Cache: HIT with an Age): changes since then are not seen"
                    );
                    (Some(cut), Some(Stale { since: at, reason }))
                }
                (None, None) => (None, None),
            };
            let entry = ServiceEntry {
                name: name.to_owned(),
                synced: true,
                index: s.index,
                error,
                stale,
                endpoints: s.endpoints.clone(),
            };
            let keep = KeptService { key: key.clone(), index: s.index, endpoints: s.endpoints.clone(), stale_since };
            (entry, Some(keep))
        }
        (None, Some(p)) => {
            let changed = kept::changed_settings(&p.key, key);
            let reason = match (changed.is_empty(), &error) {
                (true, Some(e)) => e.clone(),
                (true, None) => "waiting for Consul to answer".to_owned(),
                (false, Some(e)) => {
                    format!(
                        "the resolver's {} changed, and the query with the new settings failed: {e}",
                        changed.join(", ")
                    )
                }
                (false, None) => format!(
                    "the resolver's {} changed: waiting for Consul to answer with the new settings",
                    changed.join(", ")
                ),
            };
            stale(p, reason, error, name, now)
        }
        (None, None) => (unsynced(name, error), None),
    }
}

/// The endpoints last obtained, stale for `reason`.
fn stale(
    p: &KeptService,
    reason: String,
    error: Option<String>,
    name: &str,
    now: SystemTime,
) -> (ServiceEntry, Option<KeptService>) {
    let since = p.stale_since.unwrap_or(now);
    let entry = ServiceEntry {
        name: name.to_owned(),
        synced: false,
        index: p.index,
        error,
        stale: Some(Stale { since: kept::rfc3339(since), reason }),
        endpoints: p.endpoints.clone(),
    };
    (entry, Some(KeptService { stale_since: Some(since), ..p.clone() }))
}

fn unsynced(name: &str, error: Option<String>) -> ServiceEntry {
    ServiceEntry {
        name: name.to_owned(),
        synced: false,
        index: None,
        error,
        stale: None,
        endpoints: Endpoints::from([]),
    }
}

/// Resolver lookup by name: same namespace first, else the single one of that name that
/// serves the Mapping's namespace (`spec.allowedNamespaces`).
#[derive(Debug, Clone, Default)]
struct Lookup {
    /// Positions in the resolver list, by name.
    by_name: BTreeMap<String, Vec<usize>>,
    /// Namespaces' labels, read only when some resolver selects namespaces by them.
    labels: BTreeMap<String, BTreeMap<String, String>>,
}

enum Found {
    One(usize),
    None,
    Ambiguous(Vec<String>),
    /// Resolvers of that name exist, but none serves the Mapping's namespace.
    NotServed(Vec<String>),
}

impl Lookup {
    fn new(resolvers: &[Resolver], world: &World) -> Self {
        let mut by_name: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (i, r) in resolvers.iter().enumerate() {
            by_name.entry(r.name.clone()).or_default().push(i);
        }
        let selecting = resolvers.iter().any(Resolver::selects_namespaces);
        let labels = if selecting { resolvers::namespace_labels(world) } else { BTreeMap::new() };
        Lookup { by_name, labels }
    }

    fn find(&self, resolvers: &[Resolver], from_namespace: &str, name: &ResolverName) -> Found {
        let candidates = self.by_name.get(&name.name).map(Vec::as_slice).unwrap_or_default();
        let in_ns = |ns: &str| candidates.iter().copied().find(|&i| resolvers[i].namespace == ns);
        let serves = |i: usize| resolvers[i].serves(from_namespace, self.labels.get(from_namespace));
        let shown = |i: &usize| format!("{}/{}", resolvers[*i].namespace, resolvers[*i].name);
        if let Some(ns) = &name.namespace {
            return match in_ns(ns) {
                None => Found::None,
                Some(i) if serves(i) => Found::One(i),
                Some(i) => Found::NotServed(vec![shown(&i)]),
            };
        }
        if let Some(i) = in_ns(from_namespace) {
            return Found::One(i);
        }
        // Only those that serve the Mapping's namespace count: a resolver that does not
        // share itself neither answers nor makes the name ambiguous.
        let serving: Vec<usize> = candidates.iter().copied().filter(|&i| serves(i)).collect();
        match (serving.as_slice(), candidates) {
            ([], []) => Found::None,
            ([], others) => Found::NotServed(others.iter().map(shown).collect()),
            ([i], _) => Found::One(*i),
            (many, _) => Found::Ambiguous(many.iter().map(shown).collect()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolver_names_follow_kubernetes_rules() {
        let named = |s: &str| s.parse::<ResolverName>();
        assert_eq!(named("consul"), Ok(ResolverName { namespace: None, name: "consul".into() }));
        assert_eq!(
            named("ops/consul.v2"),
            Ok(ResolverName { namespace: Some("ops".into()), name: "consul.v2".into() })
        );
        for bad in ["", "/consul", "ops/", "Consul", "ops.x/consul", "ops/a/b", "a..b", "-a"] {
            assert!(named(bad).is_err(), "{bad:?}");
        }
    }
}
