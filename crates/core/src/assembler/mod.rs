//! The assembler: turns the world into a deterministic snapshot and, from the same
//! reading, the set of watches the world implies (the feedback loop: Mappings name
//! services, services become Consul or EndpointSlice watches, resolvers name Secrets).
//!
//! It works in two passes and incrementally, each pass owning its state:
//! - [`route`]: pass one routes each consumer (a Mapping) to its target (a resolver's
//!   Consul service, a Kubernetes Service, an address), and counts the routes per target;
//! - [`read`]: pass two reads each target's endpoints (and each service a resolver lists);
//! - [`desired`]: the watches the passes' results imply, counted, changed by whatever
//!   starts or stops holding one.
//!
//! This module only orchestrates them. Between changes it keeps both passes' results, and
//! redoes only what the world's [`Changes`] touch:
//! - a Consul answer touches only the services read through that query;
//! - a Mapping change only its own route and the targets it adds or drops;
//! - a resolver or Secret change re-reads the resolvers and re-routes every Mapping
//!   (rare, and cheap: Mappings are decoded once, when they arrive);
//! - the desired watches change only when a route, a target's watch or a resolver changed,
//!   so a Consul-only change never touches the registry.
//!
//! Problems (a bad `service`, an unknown or ambiguous resolver, an invalid resolver spec)
//! are values in the snapshot, never panics, and never guesses.

mod desired;
pub mod gzip;
pub mod kept;
pub(crate) mod kube_endpoints;
mod read;
pub mod resolvers;
mod route;
pub mod segment;
pub mod snapshot;
mod write;

use std::collections::BTreeMap;
use std::time::SystemTime;

use crate::delta::Delta;
use crate::keys::{KubeKey, WatchKey};
use crate::world::{Changes, World};
use consul_resolver_api::export;
use consul_resolver_api::mapping::{self, MappingKind};
use consul_resolver_api::resolver::{GROUP, KIND};

use desired::Desired;
pub use kept::Kept;
pub use kube_endpoints::{
    DEFAULT_ENDPOINTS_NAMESPACE_WATCH_ABOVE, DEFAULT_ENDPOINTS_WATCH_BUDGET, EndpointsApi, WatchLimits,
};
use read::{KubeTargets, Services};
use resolvers::Resolver;
pub use route::ResolverName;
use route::Routes;
use snapshot::{Bootstrap, ExportEntry, Part, Problem, UnusableReason, WatchedEntry};
pub use snapshot::{Content, Snapshot};

/// What the assembler needs besides the world.
#[derive(Debug, Clone)]
pub struct Config {
    /// Resolvers and Mappings of other Ambassador IDs are ignored.
    pub ambassador_id: String,
    /// Resolver for Mappings that name none; without it they are Kubernetes services.
    pub default_resolver: Option<ResolverName>,
    pub endpoints_api: EndpointsApi,
    /// How many endpoints watches, and of what breadth ([`kube_endpoints::Scoping`]).
    pub endpoint_watches: WatchLimits,
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
            endpoint_watches: WatchLimits::default(),
            env: BTreeMap::new(),
            static_watches: Vec::new(),
        }
    }
}

/// The assembler's state between changes: what each pass produced.
#[derive(Debug, Clone)]
pub struct Assembler {
    cfg: Config,
    /// Resolvers in scope, sorted by namespace and name: read by both passes.
    resolvers: Vec<Resolver>,
    /// Pass one.
    routes: Routes,
    /// Pass two: resolvers' services, and Kubernetes Services routed to.
    services: Services,
    kube: KubeTargets,
    desired: Desired,
    /// Nothing has been read yet: the first update reads everything.
    fresh: bool,
}

impl Assembler {
    pub fn new(cfg: Config) -> Self {
        Assembler {
            cfg,
            resolvers: Vec::new(),
            routes: Routes::default(),
            services: Services::default(),
            kube: KubeTargets::default(),
            desired: Desired::default(),
            fresh: true,
        }
    }

    /// What it was configured with.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The watches the world implies (besides the operator's fixed ones).
    pub fn desired(&self) -> impl Iterator<Item = &WatchKey> {
        self.desired.keys()
    }

    /// See [`crate::pipeline::Pipeline::endpoints_over_budget`].
    pub(crate) fn endpoints_over_budget(&self) -> Option<(usize, usize)> {
        self.kube.over_budget()
    }

    /// Makes the next update read everything, as a first one does (tests compare the
    /// incremental result with it).
    #[cfg(test)]
    pub(crate) fn read_everything_next(&mut self) {
        self.fresh = true;
        self.kube.read_everything_next();
    }

    #[cfg(test)]
    pub(crate) fn kept(&self) -> &Kept {
        self.services.kept()
    }

    /// Each desired watch with its count, as kept from update to update.
    #[cfg(test)]
    pub(crate) fn desired_counts(&self) -> &BTreeMap<WatchKey, usize> {
        self.desired.counts()
    }

    /// The desired watches counted from scratch, from what the passes hold now and the
    /// resolvers' current settings: what [`Assembler::desired_counts`] must always equal,
    /// however the updates that led here went.
    #[cfg(test)]
    pub(crate) fn recount(&self) -> BTreeMap<WatchKey, usize> {
        let secrets = self.resolvers.iter().flat_map(|r| r.secrets.iter().cloned().map(WatchKey::Kube));
        let namespaces = self.resolvers.iter().any(Resolver::selects_namespaces).then(resolvers::namespaces_key);
        let mut counts = BTreeMap::new();
        for key in secrets
            .chain(namespaces.map(WatchKey::Kube))
            .chain(self.services.watches(&self.resolvers))
            .chain(self.kube.watches())
        {
            *counts.entry(key).or_default() += 1;
        }
        counts
    }

    /// Folds `changes` of `world` in: redoes what they touch, and says which watches start
    /// or stop being desired. `now` stamps the moment a service's endpoints become stale.
    pub fn update(&mut self, world: &World, changes: &Changes, now: SystemTime) -> Delta<WatchKey> {
        // Namespaces are watched only for resolvers that select them by label.
        let everything =
            self.fresh || changes.kube.keys().any(|k| k.is(GROUP, KIND) || k.is("", "Secret") || k.is("", "Namespace"));
        self.fresh = false;
        if everything {
            // Resolvers (or the Secrets they read) changed: read them, route every Mapping
            // and read every service again.
            let resolvers = resolvers::read(world, &self.cfg.ambassador_id, &self.cfg.env);
            self.desired.resolvers_changed(&self.resolvers, &resolvers);
            self.resolvers = resolvers;
            let inputs = route::Inputs { cfg: &self.cfg, resolvers: &self.resolvers, kept: self.services.kept() };
            self.routes.route_all(world, &inputs);
            self.routes.take_touched(); // Every service is read.
            let inputs = read::Inputs { world, cfg: &self.cfg, resolvers: &self.resolvers, routes: &self.routes, now };
            self.services.read_all(&inputs, &mut self.desired);
            self.kube.read(&inputs, changes, true, &mut self.desired);
            return self.desired.take();
        }
        let inputs = route::Inputs { cfg: &self.cfg, resolvers: &self.resolvers, kept: self.services.kept() };
        let mut routes_changed = false;
        for (key, ids) in &changes.kube {
            if key.is(GROUP, export::KIND) {
                // Exports read Consul services only: no Kubernetes target moves.
                match ids {
                    Some(ids) => {
                        for id in ids {
                            self.routes.reroute_export(world, id, &inputs);
                        }
                    }
                    None => {
                        self.routes.reroute_exports(world, &inputs);
                    }
                }
                continue;
            }
            let Some(kind) = MappingKind::ALL.into_iter().find(|k| key.is(mapping::GROUP, k.kind())) else {
                continue;
            };
            match ids {
                // Every one is routed again: no short circuit.
                Some(ids) => {
                    for id in ids {
                        routes_changed |= self.routes.reroute(world, kind, id, &inputs);
                    }
                }
                None => routes_changed |= self.routes.reroute_kind(world, kind, &inputs),
            }
        }
        // Services whose entry must be read again: those read through a changed query, and
        // those that started or stopped being routed to.
        let answered = read::answered(&self.resolvers, &changes.consul);
        let touched = self.routes.take_touched();
        let inputs = read::Inputs { world, cfg: &self.cfg, resolvers: &self.resolvers, routes: &self.routes, now };
        if !answered.is_empty() || !touched.is_empty() {
            self.services.read(&inputs, &answered, &touched, &mut self.desired);
        }
        self.kube.read(&inputs, changes, routes_changed, &mut self.desired);
        self.desired.take()
    }

    /// Makes again, and keeps, the resolvers' entries whose services changed: before a
    /// document, not at every update.
    pub(crate) fn make_entries(&mut self) {
        self.services.make_entries(&self.resolvers);
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
        problems.extend(self.routes.problems().cloned());
        for (target, why) in self.kube.errors() {
            let message = || format!("cannot watch the endpoints of Service {target}: {why}");
            problems.extend(self.routes.kube_consumers(target).map(|c| c.problem(message())));
        }
        problems.sort();
        problems.dedup();
        let resolvers = self.services.entries(&self.resolvers);
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
            mappings: self.routes.mappings(),
            kubernetes_services: self.kube.entries(),
            watched,
            problems,
            exports: self
                .routes
                .exports()
                .map(|(e, reads)| {
                    let source =
                        reads.and_then(|(resolver, service)| self.services.service(resolver, service).cloned());
                    Part::new(ExportEntry { source, ..e.clone() })
                })
                .collect(),
        }
    }
}
