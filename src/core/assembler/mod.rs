//! The assembler: turns the world into a deterministic snapshot and, from the same
//! reading, the set of watches the world implies (the feedback loop: Mappings name
//! services, services become Consul or EndpointSlice watches, resolvers name Secrets).
//!
//! Problems (a bad `service`, an unknown or ambiguous resolver, an invalid resolver spec)
//! are values in the snapshot, never panics, and never guesses.

pub mod kube_endpoints;
pub mod resolvers;
pub mod snapshot;

use std::collections::{BTreeMap, BTreeSet};

use crate::api::mapping::{self, Mapping, MappingKind};
use crate::api::service::{Host, ServiceRef};
use crate::core::aggregator::World;
use crate::core::keys::{ConsulKey, KubeKey, WatchKey};

pub use kube_endpoints::EndpointsApi;
use resolvers::Resolver;
use snapshot::{Bootstrap, KubeServiceEntry, MappingEntry, Problem, ResolverEntry, ServiceEntry, Target, WatchedEntry};
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
            ambassador_id: crate::api::DEFAULT_AMBASSADOR_ID.to_owned(),
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
}

/// Reads the world once, producing both the snapshot content and the desired watches.
pub fn assemble(world: &World, cfg: &Config) -> Assembly {
    let mut secrets = BTreeSet::new();
    let resolvers = resolvers::read(world, &cfg.ambassador_id, &cfg.env, &mut secrets);
    let mut problems: Vec<Problem> = resolvers
        .iter()
        .filter_map(|r| {
            r.settings.as_ref().err().map(|e| Problem {
                kind: resolvers::KIND.into(),
                namespace: r.namespace.clone(),
                name: r.name.clone(),
                message: e.clone(),
            })
        })
        .collect();
    let lookup = Lookup::new(&resolvers);

    // Consul services per resolver (by index into `resolvers`), Kubernetes services.
    let mut consul_services: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    let mut kube_services: BTreeSet<(String, String)> = BTreeSet::new();
    for (i, r) in resolvers.iter().enumerate() {
        if r.settings.is_ok() {
            let extra = r.spec.iter().flat_map(|s| s.services.iter().flatten());
            consul_services.entry(i).or_default().extend(extra.map(|s| s.0.clone()));
        }
    }

    let mut mappings = Vec::new();
    for kind in MappingKind::ALL {
        for obj in world.objects_of(mapping::GROUP, kind.kind()) {
            let m = match Mapping::from_object(kind, &obj.value) {
                Ok(m) => m,
                Err(e) => {
                    problems.push(Problem {
                        kind: kind.kind().into(),
                        namespace: obj.id.namespace.clone().unwrap_or_default(),
                        name: obj.id.name.clone(),
                        message: e.to_string(),
                    });
                    continue;
                }
            };
            if !m.spec.serves_ambassador_id(&cfg.ambassador_id) {
                continue;
            }
            let mut problem = |message: String| {
                problems.push(Problem {
                    kind: kind.kind().into(),
                    namespace: m.namespace.clone(),
                    name: m.name.clone(),
                    message,
                })
            };
            let raw = m.spec.service.clone().unwrap_or_default();
            let target = match ServiceRef::parse(&raw) {
                Err(e) => {
                    problem(format!("spec.service: {e}"));
                    Target::Unresolved
                }
                Ok(svc) => resolve_target(
                    &m,
                    &svc,
                    cfg,
                    &resolvers,
                    &lookup,
                    &mut problem,
                    &mut consul_services,
                    &mut kube_services,
                ),
            };
            mappings.push(MappingEntry {
                kind: kind.kind().into(),
                namespace: m.namespace.clone(),
                name: m.name.clone(),
                service: raw,
                target,
            });
        }
    }
    mappings.sort();
    problems.sort();
    problems.dedup();

    let mut desired: BTreeSet<WatchKey> = secrets.into_iter().map(WatchKey::Kube).collect();
    let mut unsynced = Vec::new();
    let resolver_entries = resolvers
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let services = match &r.settings {
                Err(_) => Vec::new(),
                Ok(settings) => consul_services
                    .get(&i)
                    .into_iter()
                    .flatten()
                    .map(|service| {
                        let key = settings.key(service);
                        let entry = service_entry(world, &key);
                        if !entry.synced {
                            unsynced.push(format!("{}/{}/{}", r.namespace, r.name, service));
                        }
                        desired.insert(WatchKey::Consul(key));
                        entry
                    })
                    .collect(),
            };
            ResolverEntry {
                namespace: r.namespace.clone(),
                name: r.name.clone(),
                generation: r.generation,
                address: r.settings.as_ref().map(|s| s.server().address.clone()).unwrap_or_default(),
                datacenter: r.spec.as_ref().and_then(|s| s.datacenter.clone()),
                invalid: r.settings.as_ref().err().cloned(),
                services,
            }
        })
        .collect();

    let kubernetes_services = kube_services
        .into_iter()
        .map(|(namespace, name)| {
            let key = cfg.endpoints_api.key(&namespace, &name);
            let store = world.kube().get(&key);
            let endpoints = store.map(|s| cfg.endpoints_api.read(s.objects.values())).unwrap_or_default();
            desired.insert(WatchKey::Kube(key));
            KubeServiceEntry { synced: store.is_some_and(|s| s.listed), namespace, name, endpoints }
        })
        .collect();

    let watched = cfg
        .static_watches
        .iter()
        .map(|key| WatchedEntry {
            watch: key.to_string(),
            objects: world
                .kube()
                .get(key)
                .into_iter()
                .flat_map(|s| s.objects.values())
                .map(|o| (*o.value).clone())
                .collect(),
        })
        .collect();

    let content = Content {
        bootstrap: Bootstrap { complete: unsynced.is_empty(), unsynced },
        resolvers: resolver_entries,
        mappings,
        kubernetes_services,
        watched,
        problems,
    };
    Assembly { content, desired }
}

fn service_entry(world: &World, key: &ConsulKey) -> ServiceEntry {
    match world.consul().get(key) {
        Some(store) => ServiceEntry {
            name: key.service.clone(),
            synced: store.answered(),
            index: store.index,
            error: store.last_error.clone(),
            endpoints: store.endpoints.clone(),
        },
        None => {
            ServiceEntry { name: key.service.clone(), synced: false, index: None, error: None, endpoints: Vec::new() }
        }
    }
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

#[allow(clippy::too_many_arguments)]
fn resolve_target(
    m: &Mapping,
    svc: &ServiceRef,
    cfg: &Config,
    resolvers: &[Resolver],
    lookup: &Lookup,
    problem: &mut impl FnMut(String),
    consul_services: &mut BTreeMap<usize, BTreeSet<String>>,
    kube_services: &mut BTreeSet<(String, String)>,
) -> Target {
    let (name, namespace) = match &svc.host {
        Host::Ip(_) => {
            let bare = ServiceRef { scheme: None, ..svc.clone() };
            return Target::Address { address: bare.to_string() };
        }
        Host::Service { name, namespace } => (name, namespace),
    };
    let wanted = match (&m.spec.resolver, &cfg.default_resolver) {
        (Some(r), _) => Some(ResolverName { namespace: None, name: r.clone() }),
        (None, Some(d)) => Some(d.clone()),
        (None, None) => None,
    };
    let Some(wanted) = wanted else {
        let ns = namespace.clone().unwrap_or_else(|| m.namespace.clone());
        kube_services.insert((ns.clone(), name.clone()));
        return Target::Kubernetes { namespace: ns, service: name.clone(), port: svc.port };
    };
    match lookup.find(&m.namespace, &wanted) {
        Found::One(i) => {
            let r = &resolvers[i];
            if let Err(e) = &r.settings {
                problem(format!("resolver {}/{} cannot be used: {e}", r.namespace, r.name));
                return Target::Unresolved;
            }
            consul_services.entry(i).or_default().insert(name.clone());
            Target::Consul {
                resolver_namespace: r.namespace.clone(),
                resolver_name: r.name.clone(),
                service: name.clone(),
                port: svc.port,
            }
        }
        Found::None => {
            let shown = match &wanted.namespace {
                Some(ns) => format!("{ns}/{}", wanted.name),
                None => wanted.name.clone(),
            };
            problem(format!(
                "resolver {shown:?}: no ConsulResolver of that name in {} or any other watched namespace",
                m.namespace
            ));
            Target::Unresolved
        }
        Found::Ambiguous(all) => {
            problem(format!(
                "resolver {:?} is ambiguous: no ConsulResolver of that name in {}, and several elsewhere ({}); name one in the Mapping's namespace",
                wanted.name,
                m.namespace,
                all.join(", ")
            ));
            Target::Unresolved
        }
    }
}

/// Keys of the Consul services in a desired set (for counting and tests).
pub fn consul_keys(desired: &BTreeSet<WatchKey>) -> impl Iterator<Item = &ConsulKey> {
    desired.iter().filter_map(|k| match k {
        WatchKey::Consul(c) => Some(c),
        WatchKey::Kube(_) => None,
    })
}

/// Keys of the Kubernetes watches in a desired set.
pub fn kube_keys(desired: &BTreeSet<WatchKey>) -> impl Iterator<Item = &KubeKey> {
    desired.iter().filter_map(|k| match k {
        WatchKey::Kube(k) => Some(k),
        WatchKey::Consul(_) => None,
    })
}
