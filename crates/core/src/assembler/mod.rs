//! The assembler: turns the world into a deterministic snapshot and, from the same
//! reading, the set of watches the world implies (the feedback loop: Mappings name
//! services, services become Consul or EndpointSlice watches, resolvers name Secrets).
//!
//! Problems (a bad `service`, an unknown or ambiguous resolver, an invalid resolver spec)
//! are values in the snapshot, never panics, and never guesses.

pub mod kept;
pub mod kube_endpoints;
pub mod resolvers;
pub mod snapshot;

use std::collections::{BTreeMap, BTreeSet};
use std::time::SystemTime;

use crate::keys::{KubeKey, WatchKey};
use crate::world::{ConsulStore, World};
use consul_resolver_api::mapping::{self, Mapping, MappingKind};
use consul_resolver_api::names;
use consul_resolver_api::service::{Host, ServiceRef};

pub use kept::Kept;
use kept::{KeptService, ServiceOf};
pub use kube_endpoints::EndpointsApi;
use resolvers::Resolver;
use snapshot::{
    Bootstrap, KubeServiceEntry, MappingEntry, Problem, ResolverEntry, ServiceEntry, Stale, Target, UnusableReason,
    WatchedEntry,
};
pub use snapshot::{Content, Snapshot};
/// A resolver named by `namespace/name`, or by `name` alone (looked up like a Mapping's
/// `resolver`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolverName {
    pub namespace: Option<String>,
    pub name: String,
}

impl std::str::FromStr for ResolverName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let valid = |p: &str| !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
        match s.split_once('/') {
            Some((ns, name)) if valid(ns) && valid(name) => {
                Ok(ResolverName { namespace: Some(ns.into()), name: name.into() })
            }
            None if valid(s) => Ok(ResolverName { namespace: None, name: s.into() }),
            _ => Err(format!("{s:?} is not NAME or NAMESPACE/NAME")),
        }
    }
}

/// What the assembler needs besides the world.
#[derive(Debug, Clone)]
pub struct Config {
    /// Resolvers and Mappings of other Ambassador IDs are ignored.
    pub ambassador_id: String,
    /// Resolver for Mappings that name none; without it they are Kubernetes services.
    pub default_resolver: Option<ResolverName>,
    pub endpoints_api: EndpointsApi,
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
            env: BTreeMap::new(),
            static_watches: Vec::new(),
        }
    }
}

/// One reading of the world.
#[derive(Debug, Clone)]
pub struct Assembly {
    pub content: Content,
    /// The watches this world implies (besides the operator's fixed ones).
    pub desired: BTreeSet<WatchKey>,
    /// The endpoints to keep serving if a service's query stops being usable (see [`kept`]).
    pub kept: Kept,
}

/// Reads the world once, producing the snapshot content, the desired watches and the
/// endpoints to keep. `kept` is what the previous reading kept; `now` stamps the moment a
/// service's endpoints become stale.
pub fn assemble(world: &World, cfg: &Config, kept: &Kept, now: SystemTime) -> Assembly {
    let resolvers = resolvers::read(world, &cfg.ambassador_id, &cfg.env);
    let mut reading = Reading::new(world, cfg, kept, now, &resolvers);
    reading.route_mappings();
    reading.finish()
}

/// Where a Mapping's traffic goes, before the services it names are read.
enum Route {
    /// Through `resolvers[resolver]`.
    Consul {
        resolver: usize,
        service: String,
        port: Option<u16>,
    },
    Kubernetes {
        namespace: String,
        service: String,
        port: Option<u16>,
    },
    Address(String),
    /// Why it cannot be routed.
    Unresolved(String),
}

/// A Mapping, as a problem names it.
struct MappingRef {
    kind: &'static str,
    namespace: String,
    name: String,
}

/// The state of one [`assemble`] pass.
struct Reading<'a> {
    world: &'a World,
    cfg: &'a Config,
    kept: &'a Kept,
    now: SystemTime,
    resolvers: &'a [Resolver],
    lookup: Lookup<'a>,
    /// Per resolver (same positions as `resolvers`), the Consul services to watch.
    consul_services: Vec<BTreeSet<String>>,
    /// Per referenced Kubernetes Service (namespace, name), the Mappings routed to it.
    kube_services: BTreeMap<(String, String), Vec<MappingRef>>,
    mappings: Vec<MappingEntry>,
    problems: Vec<Problem>,
}

impl<'a> Reading<'a> {
    fn new(world: &'a World, cfg: &'a Config, kept: &'a Kept, now: SystemTime, resolvers: &'a [Resolver]) -> Self {
        let problems = resolvers
            .iter()
            .filter_map(|r| {
                let u = r.settings.as_ref().err().filter(|u| u.reason != UnusableReason::WaitingForSecret)?;
                Some(Problem {
                    kind: resolvers::KIND.into(),
                    namespace: r.namespace.clone(),
                    name: r.name.clone(),
                    message: u.message.clone(),
                })
            })
            .collect();
        Reading {
            world,
            cfg,
            kept,
            now,
            resolvers,
            lookup: Lookup::new(resolvers),
            consul_services: resolvers.iter().map(|r| r.listed_services().map(str::to_owned).collect()).collect(),
            kube_services: BTreeMap::new(),
            mappings: Vec::new(),
            problems,
        }
    }

    fn problem(&mut self, kind: &str, namespace: &str, name: &str, message: String) {
        self.problems.push(Problem { kind: kind.into(), namespace: namespace.into(), name: name.into(), message });
    }

    /// Reads every Mapping of the operator's Ambassador ID and routes it.
    fn route_mappings(&mut self) {
        for kind in MappingKind::ALL {
            for obj in self.world.objects_of(mapping::GROUP, kind.kind()) {
                let m = match Mapping::from_object(kind, &obj.value) {
                    Ok(m) => m,
                    Err(e) => {
                        let ns = obj.id.namespace.clone().unwrap_or_default();
                        self.problem(kind.kind(), &ns, &obj.id.name, e.to_string());
                        continue;
                    }
                };
                if !m.spec.serves_ambassador_id(&self.cfg.ambassador_id) {
                    continue;
                }
                let raw = m.spec.service.clone().unwrap_or_default();
                let route = match ServiceRef::parse(&raw) {
                    Err(e) => Route::Unresolved(format!("spec.service: {e}")),
                    Ok(svc) => self.route(&m, &svc),
                };
                let target = match route {
                    Route::Consul { resolver, service, port } => {
                        let r = &self.resolvers[resolver];
                        self.consul_services[resolver].insert(service.clone());
                        Target::Consul {
                            resolver_namespace: r.namespace.clone(),
                            resolver_name: r.name.clone(),
                            service,
                            port,
                        }
                    }
                    Route::Kubernetes { namespace, service, port } => {
                        let by = MappingRef { kind: kind.kind(), namespace: m.namespace.clone(), name: m.name.clone() };
                        self.kube_services.entry((namespace.clone(), service.clone())).or_default().push(by);
                        Target::Kubernetes { namespace, service, port }
                    }
                    Route::Address(address) => Target::Address { address },
                    Route::Unresolved(why) => {
                        self.problem(kind.kind(), &m.namespace, &m.name, why);
                        Target::Unresolved
                    }
                };
                self.mappings.push(MappingEntry {
                    kind: kind.kind().into(),
                    namespace: m.namespace.clone(),
                    name: m.name.clone(),
                    service: raw,
                    target,
                });
            }
        }
    }

    fn route(&self, m: &Mapping, svc: &ServiceRef) -> Route {
        let (name, namespace) = match &svc.host {
            Host::Ip(_) => return Route::Address(ServiceRef { scheme: None, ..svc.clone() }.to_string()),
            Host::Service { name, namespace } => (name, namespace),
        };
        let wanted = match (&m.spec.resolver, &self.cfg.default_resolver) {
            (Some(r), _) => ResolverName { namespace: None, name: r.clone() },
            (None, Some(d)) => d.clone(),
            (None, None) => {
                let ns = namespace.clone().unwrap_or_else(|| m.namespace.clone());
                // The name goes into a label or field selector: check it first.
                if let Err(why) = names::dns1035_label(name) {
                    return Route::Unresolved(format!(
                        "spec.service: {name:?} is not a valid Kubernetes Service name: it {why}"
                    ));
                }
                if let Err(why) = names::dns1123_label(&ns) {
                    return Route::Unresolved(format!("spec.service: {ns:?} is not a valid namespace: it {why}"));
                }
                return Route::Kubernetes { namespace: ns, service: name.clone(), port: svc.port };
            }
        };
        match self.lookup.find(&m.namespace, &wanted) {
            Found::One(i) => {
                let r = &self.resolvers[i];
                match &r.settings {
                    // Unless served from the endpoints last obtained, or waiting a moment
                    // for a Secret: then the Mapping keeps its route.
                    Err(u)
                        if u.reason != UnusableReason::WaitingForSecret
                            && self.kept.get(&service_of(r, name)).is_none() =>
                    {
                        Route::Unresolved(format!("resolver {}/{} cannot be used: {}", r.namespace, r.name, u.message))
                    }
                    _ => Route::Consul { resolver: i, service: name.clone(), port: svc.port },
                }
            }
            Found::None => {
                let shown = match &wanted.namespace {
                    Some(ns) => format!("{ns}/{}", wanted.name),
                    None => wanted.name.clone(),
                };
                Route::Unresolved(format!(
                    "resolver {shown:?}: no ConsulResolver of that name in {} or any other watched namespace",
                    m.namespace
                ))
            }
            Found::Ambiguous(all) => Route::Unresolved(format!(
                "resolver {:?} is ambiguous: no ConsulResolver of that name in {}, and several elsewhere ({}); name one in the Mapping's namespace",
                wanted.name,
                m.namespace,
                all.join(", ")
            )),
        }
    }

    /// Reads the services routed to, and puts the snapshot together.
    fn finish(mut self) -> Assembly {
        let mut desired: BTreeSet<WatchKey> =
            self.resolvers.iter().flat_map(|r| r.secrets.iter().cloned()).map(WatchKey::Kube).collect();
        let mut kept = Kept::default();
        let mut unsynced = Vec::new();
        let mut resolver_entries = Vec::with_capacity(self.resolvers.len());
        for (r, names) in self.resolvers.iter().zip(&self.consul_services) {
            let mut services = Vec::with_capacity(names.len());
            for name in names {
                let of = service_of(r, name);
                let previous = self.kept.get(&of);
                let read = match &r.settings {
                    Ok(settings) => {
                        let key = settings.key(name);
                        let read = self.current(self.world.consul().get(&key), &key, previous, name);
                        desired.insert(WatchKey::Consul(key));
                        Some(read)
                    }
                    Err(u) => match previous {
                        Some(p) => Some(self.stale(p, u.message.clone(), None, name)),
                        None if u.reason == UnusableReason::WaitingForSecret => Some(Read::unsynced(name, None)),
                        None => None,
                    },
                };
                let Some(Read { entry, keep }) = read else { continue };
                if !entry.synced {
                    unsynced.push(format!("{}/{}/{}", r.namespace, r.name, name));
                }
                if let Some(k) = keep {
                    kept.insert(of, k);
                }
                services.push(entry);
            }
            resolver_entries.push(ResolverEntry {
                namespace: r.namespace.clone(),
                name: r.name.clone(),
                generation: r.generation,
                address: r.settings.as_ref().map(|s| s.server().address.clone()).unwrap_or_default(),
                datacenter: r.spec.as_ref().and_then(|s| s.datacenter.clone()),
                unusable: r.settings.as_ref().err().cloned(),
                services,
            });
        }

        let mut kubernetes_services = Vec::with_capacity(self.kube_services.len());
        for ((namespace, name), by) in std::mem::take(&mut self.kube_services) {
            let key = self.cfg.endpoints_api.key(&namespace, &name);
            let store = self.world.kube().get(&key);
            let error = store.and_then(|s| s.rejection()).map(str::to_owned);
            if let Some(why) = &error {
                for m in &by {
                    let message = format!("cannot watch the endpoints of Service {namespace}/{name}: {why}");
                    self.problem(m.kind, &m.namespace, &m.name, message);
                }
            }
            let endpoints = store.map(|s| self.cfg.endpoints_api.read(s.objects.values())).unwrap_or_default();
            desired.insert(WatchKey::Kube(key));
            kubernetes_services.push(KubeServiceEntry {
                synced: store.is_some_and(|s| s.listed),
                namespace,
                name,
                error,
                endpoints,
            });
        }

        let watched = self
            .cfg
            .static_watches
            .iter()
            .map(|key| WatchedEntry {
                watch: key.to_string(),
                objects: self
                    .world
                    .kube()
                    .get(key)
                    .into_iter()
                    .flat_map(|s| s.objects.values())
                    .map(|o| (*o.value).clone())
                    .collect(),
            })
            .collect();

        let mut mappings = self.mappings;
        mappings.sort();
        let mut problems = self.problems;
        problems.sort();
        problems.dedup();
        let content = Content {
            bootstrap: Bootstrap { complete: unsynced.is_empty(), unsynced },
            resolvers: resolver_entries,
            mappings,
            kubernetes_services,
            watched,
            problems,
        };
        Assembly { content, desired, kept }
    }

    /// A service whose resolver is usable: its query's answer, or (until the query
    /// answers) the endpoints last obtained.
    fn current(
        &self,
        store: Option<&ConsulStore>,
        key: &crate::keys::ConsulKey,
        previous: Option<&KeptService>,
        name: &str,
    ) -> Read {
        let error = store.and_then(|s| s.last_error.clone());
        match (store.filter(|s| s.answered()), previous) {
            (Some(s), _) => {
                // Current. A failing query keeps its endpoints; they are stale from the
                // first failure on.
                let since = previous.filter(|p| p.key == *key).and_then(|p| p.stale_since).unwrap_or(self.now);
                let stale_since = error.is_some().then_some(since);
                let stale = error.as_ref().map(|e| Stale { since: kept::rfc3339(since), reason: e.clone() });
                let entry = ServiceEntry {
                    name: name.to_owned(),
                    synced: true,
                    index: s.index,
                    error,
                    stale,
                    endpoints: s.endpoints.clone(),
                };
                let keep =
                    KeptService { key: key.clone(), index: s.index, endpoints: s.endpoints.clone(), stale_since };
                Read { entry, keep: Some(keep) }
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
                self.stale(p, reason, error, name)
            }
            (None, None) => Read::unsynced(name, error),
        }
    }

    /// The endpoints last obtained, stale for `reason`.
    fn stale(&self, p: &KeptService, reason: String, error: Option<String>, name: &str) -> Read {
        let since = p.stale_since.unwrap_or(self.now);
        let entry = ServiceEntry {
            name: name.to_owned(),
            synced: false,
            index: p.index,
            error,
            stale: Some(Stale { since: kept::rfc3339(since), reason }),
            endpoints: p.endpoints.clone(),
        };
        Read { entry, keep: Some(KeptService { stale_since: Some(since), ..p.clone() }) }
    }
}

/// One service's entry, and what to keep of it for the next reading.
struct Read {
    entry: ServiceEntry,
    keep: Option<KeptService>,
}

impl Read {
    fn unsynced(name: &str, error: Option<String>) -> Read {
        let entry = ServiceEntry {
            name: name.to_owned(),
            synced: false,
            index: None,
            error,
            stale: None,
            endpoints: Vec::new(),
        };
        Read { entry, keep: None }
    }
}

fn service_of(r: &Resolver, service: &str) -> ServiceOf {
    ServiceOf { resolver_namespace: r.namespace.clone(), resolver_name: r.name.clone(), service: service.to_owned() }
}

/// Resolver lookup by name: same namespace first, else the single one of that name.
struct Lookup<'a> {
    by_name: BTreeMap<&'a str, Vec<usize>>,
    resolvers: &'a [Resolver],
}

enum Found {
    One(usize),
    None,
    Ambiguous(Vec<String>),
}

impl<'a> Lookup<'a> {
    fn new(resolvers: &'a [Resolver]) -> Self {
        let mut by_name: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, r) in resolvers.iter().enumerate() {
            by_name.entry(r.name.as_str()).or_default().push(i);
        }
        Lookup { by_name, resolvers }
    }

    fn find(&self, from_namespace: &str, name: &ResolverName) -> Found {
        let candidates = self.by_name.get(name.name.as_str()).map(Vec::as_slice).unwrap_or_default();
        let in_ns = |ns: &str| candidates.iter().copied().find(|&i| self.resolvers[i].namespace == ns);
        if let Some(ns) = &name.namespace {
            return in_ns(ns).map_or(Found::None, Found::One);
        }
        if let Some(i) = in_ns(from_namespace) {
            return Found::One(i);
        }
        match candidates {
            [] => Found::None,
            [i] => Found::One(*i),
            many => Found::Ambiguous(
                many.iter().map(|&i| format!("{}/{}", self.resolvers[i].namespace, self.resolvers[i].name)).collect(),
            ),
        }
    }
}
