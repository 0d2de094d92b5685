//! Pass two for Kubernetes: the Services routed to, and their endpoints, from a watch of
//! their own or (past the threshold) their namespace's ([`Scoping`]).

use std::collections::BTreeMap;

use consul_resolver_api::mapping::{self, MappingKind};
use consul_resolver_api::names::NamespacedName;

use super::Inputs;
use crate::assembler::desired::Desired;
use crate::assembler::kube_endpoints::{self, Scoping};
use crate::assembler::snapshot::{KubeServiceEntry, Part};
use crate::keys::{KubeKey, WatchKey};
use crate::model::{Decoded, Stored};
use crate::world::{Changes, KubeStore};

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
}

impl KubeTargets {
    /// The targets' snapshot entries, sorted by namespace and name.
    pub(crate) fn entries(&self) -> impl Iterator<Item = &Part<KubeServiceEntry>> {
        self.targets.values().map(|t| &t.entry)
    }

    /// The targets whose endpoints cannot be watched, and why.
    pub(crate) fn errors(&self) -> impl Iterator<Item = (&NamespacedName, &str)> {
        self.targets.iter().filter_map(|(id, t)| Some((id, t.entry.error.as_deref()?)))
    }

    /// See [`Scoping::over_budget`].
    pub(crate) fn over_budget(&self) -> Option<(usize, usize)> {
        self.scoping.over_budget()
    }

    /// Each target's watch: what the desired watches must count for Kubernetes targets
    /// (the test's recount).
    #[cfg(test)]
    pub(crate) fn watches(&self) -> impl Iterator<Item = WatchKey> + '_ {
        self.targets.values().map(|t| WatchKey::Kube(t.key.clone()))
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
        let routes_known = world
            .kube()
            .iter()
            .filter(|(k, _)| MappingKind::ALL.into_iter().any(|m| k.is(mapping::GROUP, m.kind())))
            .all(|(_, s)| s.listed);
        if !routes_known {
            self.deferred = true;
            return;
        }
        let deferred = std::mem::take(&mut self.deferred);
        if !routes_changed && !deferred && !changes.kube.keys().any(|k| k.is(api.group(), api.kind())) {
            return;
        }
        if routes_changed || deferred {
            let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
            for target in routes.kube_targets() {
                *counts.entry(target.namespace.as_str()).or_default() += 1;
            }
            self.scoping.update(&counts, cfg.endpoint_watches);
        }
        // A namespace's or the cluster's watch holds every Service's objects: grouped once
        // per pass.
        let mut grouped: BTreeMap<KubeKey, Grouped<'_>> = BTreeMap::new();
        let mut targets = BTreeMap::new();
        for id in routes.kube_targets() {
            let (ns, name) = (&id.namespace, &id.name);
            let key = self.scoping.key(api, ns, name);
            let previous = self.targets.remove(id);
            let target = match previous {
                Some(t) if t.key == key && !changes.kube.contains_key(&key) => t,
                previous => {
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
                        // Moved to a watch that has not listed yet: what the old one last
                        // said stands until the new one has listed (never an empty gap).
                        Some(p) if (moved || p.awaiting) && !listed && error.is_none() => {
                            KubeTarget { key, entry: p.entry, awaiting: true }
                        }
                        _ => {
                            let endpoints = match store {
                                None => Vec::new(),
                                Some(s) if self.scoping.is_shared(ns) => {
                                    let by_service = grouped.entry(key.clone()).or_insert_with(|| group(s));
                                    let objects = by_service.get(&(ns.as_str(), name.as_str()));
                                    kube_endpoints::merge(name, objects.into_iter().flatten().copied())
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
        for gone in std::mem::replace(&mut self.targets, targets).into_values() {
            desired.remove(WatchKey::Kube(gone.key));
        }
    }
}

/// The objects of a shared endpoints watch by the Service they belong to: (namespace, name).
type Grouped<'a> = BTreeMap<(&'a str, &'a str), Vec<&'a Stored>>;

/// The objects of a namespace's or the cluster's endpoints watch, by their Service.
fn group(store: &KubeStore) -> Grouped<'_> {
    let mut by_service: Grouped<'_> = BTreeMap::new();
    for (id, obj) in &store.objects {
        if let (Decoded::Endpoints { service, .. }, Some(ns)) = (&obj.decoded, id.namespace.as_deref()) {
            by_service.entry((ns, service.as_str())).or_default().push(obj);
        }
    }
    by_service
}
