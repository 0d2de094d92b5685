//! Pass two for Kubernetes: the Services routed to, and their endpoints, from a watch of
//! their own or (past the threshold) their namespace's ([`Scoping`]).

use std::collections::BTreeMap;
use std::sync::OnceLock;

use consul_resolver_api::mapping::{self, MappingKind};
use consul_resolver_api::names::NamespacedName;

use super::Inputs;
use super::shared::SharedIndexes;
use crate::assembler::desired::Desired;
use crate::assembler::kube_endpoints::{self, EndpointsApi, Scoping, WatchLimits};
use crate::assembler::route::Routes;
use crate::assembler::snapshot::{KubeServiceEntry, Part, Parts};
use crate::keys::{KubeKey, WatchKey};
use crate::world::{Changes, World};

/// A Kubernetes Service routed to, as last read.
#[derive(Debug, Clone)]
struct KubeTarget {
    /// The watch its endpoints come from (its own, or its namespace's): a desired watch
    /// while the target is in [`KubeTargets`].
    key: KubeKey,
    entry: Part<KubeServiceEntry>,
    /// Moved to `key` before it listed: `entry` is still the previous watch's.
    awaiting: bool,
}

/// Pass two's Kubernetes state.
#[derive(Debug, Clone, Default)]
pub(crate) struct KubeTargets {
    targets: BTreeMap<NamespacedName, KubeTarget>,
    /// Which namespaces' endpoints are watched whole.
    scoping: Scoping,
    /// The targets were not read: not every route was known yet.
    deferred: bool,
    /// Namespaces watched whole while a cold start's routes still listed
    /// ([`KubeTargets::watch_early`]), each holding its watch in the desired watches until
    /// the first pass that knows every route hands it to its targets, or stops it if the
    /// layout does not watch it whole after all.
    early: BTreeMap<String, KubeKey>,
    /// How many Services were routed to when the early watches were last decided.
    early_decided_at: usize,
    /// The shared watches' objects by Service: a change re-reads only its own.
    shared: SharedIndexes,
    /// The next pass reads every target again ([`KubeTargets::read_everything_next`]).
    reread: bool,
    /// The entries as one shared list, made when a content first asks after a read: a
    /// content after a Consul change holds the same list.
    listed: OnceLock<Parts<KubeServiceEntry>>,
}

impl KubeTargets {
    /// The targets' snapshot entries, sorted by namespace and name: the same list until a
    /// target is read again.
    pub(crate) fn entries(&self) -> Parts<KubeServiceEntry> {
        self.listed.get_or_init(|| self.targets.values().map(|t| t.entry.clone()).collect()).clone()
    }

    /// The targets whose endpoints cannot be watched, and why.
    pub(crate) fn errors(&self) -> impl Iterator<Item = (&NamespacedName, &str)> {
        self.targets.iter().filter_map(|(id, t)| Some((id, t.entry.error.as_deref()?)))
    }

    /// See [`Scoping::over_budget`].
    pub(crate) fn over_budget(&self) -> Option<(usize, usize)> {
        self.scoping.over_budget()
    }

    /// Each target's watch, and each early one: what the desired watches must count for
    /// Kubernetes targets (the test's recount).
    #[cfg(test)]
    pub(crate) fn watches(&self) -> impl Iterator<Item = WatchKey> + '_ {
        let early = self.early.values();
        self.targets.values().map(|t| &t.key).chain(early).map(|k| WatchKey::Kube(k.clone()))
    }

    /// The Services routed to, their endpoints read again when their watch changed, moved
    /// (between their own and their namespace's), or they are new. A target's watch is
    /// added to `desired` when it comes or moves, and removed when it moves or goes.
    pub(crate) fn read(&mut self, inputs: &Inputs<'_>, changes: &Changes, routes_changed: bool, desired: &mut Desired) {
        let Inputs { world, cfg, routes, .. } = *inputs;
        let api = cfg.endpoints_api;
        // Until every route is known (a cold start's Mappings are folded in as they come),
        // how many Services a namespace has is not known either: starting a watch per
        // Service of the first pages would start, then stop, up to a threshold's worth.
        // Namespaces that the layout of the routes seen so far watches whole start early,
        // so that they list beside the routes instead of after them.
        let routes_known = world
            .kube()
            .iter()
            .filter(|(k, _)| MappingKind::ALL.into_iter().any(|m| k.is(mapping::GROUP, m.kind())))
            .all(|(_, s)| s.listed);
        if !routes_known {
            self.deferred = true;
            // The changes of this pass are not folded into the indexes: built anew later.
            self.shared.clear();
            if self.targets.is_empty() && routes_changed {
                self.watch_early(routes, cfg.endpoint_watches, api, desired);
            }
            return;
        }
        let deferred = std::mem::take(&mut self.deferred);
        if !routes_changed && !deferred && !changes.kube.keys().any(|k| k.is(api.group(), api.kind())) {
            return;
        }
        if routes_changed || deferred {
            self.scoping.update(&per_namespace(routes), cfg.endpoint_watches);
        }
        self.listed.take();
        let touched = self.shared.update(world, changes, api);
        let reread = std::mem::take(&mut self.reread);
        let mut targets = BTreeMap::new();
        for id in routes.kube_targets() {
            let key = self.scoping.key(api, &id.namespace, &id.name);
            let target = match self.targets.remove(id) {
                Some(t) if t.key == key && !reread && !touched.get(&key).is_some_and(|t| t.has(id)) => t,
                previous => self.read_target(world, id, key, previous, desired),
            };
            targets.insert(id.clone(), target);
        }
        for gone in std::mem::replace(&mut self.targets, targets).into_values() {
            desired.remove(WatchKey::Kube(gone.key));
        }
        // The early watches are their targets' now, or stop.
        for key in std::mem::take(&mut self.early).into_values() {
            desired.remove(WatchKey::Kube(key));
        }
    }

    /// While a cold start's routes list: starts the watch of each namespace that the layout
    /// of the routes known so far watches whole ([`kube_endpoints::early_namespaces`]).
    ///
    /// Decided again only once the Services routed to have grown by an eighth since: a cold
    /// start's routes may come in hundreds of passes, and each decision counts every target
    /// (at 10,000 Services, about 80 decisions instead of one a pass).
    fn watch_early(&mut self, routes: &Routes, limits: WatchLimits, api: EndpointsApi, desired: &mut Desired) {
        let now = routes.kube_target_count();
        if now <= self.early_decided_at + self.early_decided_at / 8 {
            return;
        }
        self.early_decided_at = now;
        for namespace in kube_endpoints::early_namespaces(&per_namespace(routes), &self.early, limits) {
            let key = api.namespace_key(&namespace);
            desired.add(WatchKey::Kube(key.clone()));
            self.early.insert(namespace, key);
        }
    }

    /// Reads target `id` (new, moved, or its objects changed) from watch `key`, adding the
    /// watch to `desired` when it comes or moves, and removing the one it moved from.
    fn read_target(
        &mut self,
        world: &World,
        id: &NamespacedName,
        key: KubeKey,
        previous: Option<KubeTarget>,
        desired: &mut Desired,
    ) -> KubeTarget {
        let store = world.kube().get(&key);
        let moved = previous.as_ref().is_some_and(|p| p.key != key);
        if previous.is_none() || moved {
            desired.add(WatchKey::Kube(key.clone()));
        }
        if let Some(p) = previous.as_ref().filter(|_| moved) {
            desired.remove(WatchKey::Kube(p.key.clone()));
        }
        let listed = store.is_some_and(|s| s.listed);
        let error = store.and_then(|s| s.rejection()).map(str::to_owned);
        match previous {
            // Moved to a watch that has not listed yet: what the old one last said stands
            // until the new one has listed (never an empty gap).
            Some(p) if (moved || p.awaiting) && !listed && error.is_none() => {
                KubeTarget { key, entry: p.entry, awaiting: true }
            }
            _ => {
                let endpoints = match store {
                    None => Vec::new(),
                    Some(s) if self.scoping.is_shared(&id.namespace) => {
                        kube_endpoints::merge(&id.name, self.shared.objects(&key, s, id))
                    }
                    Some(s) => kube_endpoints::merge(&id.name, s.objects.values()),
                };
                let entry = Part::new(KubeServiceEntry {
                    namespace: id.namespace.clone(),
                    name: id.name.clone(),
                    synced: listed,
                    error,
                    endpoints,
                });
                KubeTarget { key, entry, awaiting: false }
            }
        }
    }

    /// Makes the next pass read every target from its watch again, and build the shared
    /// watches' indexes anew (the tests' full reading).
    #[cfg(test)]
    pub(crate) fn read_everything_next(&mut self) {
        self.reread = true;
        self.shared.clear();
    }
}

/// The Services routed to in each namespace.
fn per_namespace(routes: &Routes) -> BTreeMap<&str, usize> {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for target in routes.kube_targets() {
        *counts.entry(target.namespace.as_str()).or_default() += 1;
    }
    counts
}
