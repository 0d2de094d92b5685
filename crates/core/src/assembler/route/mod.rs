//! Pass one: routing. Each consumer (a Mapping, or an export) is taken to its target: a
//! resolver's Consul service, a Kubernetes Service, an address, or unresolved with a
//! problem. A Mapping and an export of the same resolver's service are two uses of one
//! target, so one watch. The routes
//! table, and how many routes use each target, change together, only through
//! [`Routes::add`] and [`Routes::remove`], so pass two can trust the uses it reads.

mod consumer;
mod lookup;
mod target;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;

use consul_resolver_api::mapping::{self, MappingKind};
use consul_resolver_api::names::NamespacedName;

use super::Config;
use super::kept::Kept;
use super::resolvers::Resolver;
use super::snapshot::{ExportEntry, MappingEntry, Part, Parts, Problem};
use crate::model::{Decoded, ObjectId};
use crate::world::World;
use consul_resolver_api::export;
use consul_resolver_api::resolver::GROUP;

pub(crate) use consumer::Consumer;
use lookup::Lookup;
pub use lookup::ResolverName;

/// What routing reads besides the consumers themselves.
pub(crate) struct Inputs<'a> {
    pub(crate) cfg: &'a Config,
    /// The resolvers in scope, sorted by namespace and name.
    pub(crate) resolvers: &'a [Resolver],
    /// The endpoints kept: a route through an unusable resolver stands while its service's
    /// endpoints are kept.
    pub(crate) kept: &'a Kept,
}

/// One consumer, routed. Kept small, with what is rare or large boxed: the routes table
/// holds one per Mapping, in B-tree nodes about half full (the Mappings come sorted), so
/// each byte here costs about two (see the size test).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Routed {
    /// Its snapshot entry; `None` when it cannot be read at all (a problem only).
    entry: Option<Entry>,
    problem: Option<Box<Problem>>,
    uses: Uses,
}

/// A route's entry in the snapshot.
#[derive(Debug, Clone, PartialEq)]
enum Entry {
    Mapping(Part<MappingEntry>),
    /// Without its `source`: that is read in pass two's state when the content is made.
    Export(Box<ExportEntry>),
}

/// The target a route reads endpoints from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Uses {
    /// A resolver's service.
    Consul(NamespacedName, String),
    /// A Kubernetes Service.
    Kube(NamespacedName),
    Nothing,
}

/// The routes as a content takes them.
#[derive(Debug, Clone)]
struct Listed {
    mappings: Parts<MappingEntry>,
    /// The exports' entries, without their `source`, each with the resolver service it reads.
    exports: Vec<(ExportEntry, Option<(NamespacedName, String)>)>,
    problems: Vec<Problem>,
}

/// Pass one's state: every route, and per target the routes that use it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Routes {
    /// The resolvers by name, for the routes that name one.
    lookup: Lookup,
    routes: BTreeMap<Consumer, Routed>,
    /// What contents take of the routes, made when a content first asks after a route
    /// came, went or changed: at 110,000 routes, a walk of them per publication was a tenth
    /// of the operator's CPU per change, and a content after a Consul change holds the same
    /// Mappings' list.
    listed: OnceLock<Listed>,
    /// Per resolver, per service, how many routes use it.
    consul_uses: BTreeMap<NamespacedName, BTreeMap<String, usize>>,
    /// Per Kubernetes Service, the routes to it.
    kube_uses: BTreeMap<NamespacedName, BTreeSet<Consumer>>,
    /// Per resolver, the services that started or stopped being routed to since pass two
    /// last took them ([`Routes::take_touched`]).
    touched: BTreeMap<NamespacedName, BTreeSet<String>>,
}

impl Routes {
    /// Routes every Mapping again: the resolvers changed.
    pub(crate) fn route_all(&mut self, world: &World, inputs: &Inputs<'_>) {
        self.lookup = Lookup::new(inputs.resolvers, world);
        self.routes.clear();
        self.listed.take();
        self.consul_uses.clear();
        self.kube_uses.clear();
        for kind in MappingKind::ALL {
            self.route_kind(world, kind, inputs);
        }
        self.route_exports(world, inputs);
    }

    fn route_exports(&mut self, world: &World, inputs: &Inputs<'_>) {
        for (id, stored) in world.objects_of(GROUP, export::KIND) {
            let consumer = Consumer::export(id);
            if let Decoded::Export(e) = &stored.decoded
                && let Some(routed) = target::route_export(inputs, &self.lookup, &consumer, e)
            {
                self.add(consumer, routed);
            }
        }
    }

    /// Routes every export again (their watch relisted, or came or went).
    pub(crate) fn reroute_exports(&mut self, world: &World, inputs: &Inputs<'_>) -> bool {
        let mine: Vec<Consumer> = self.routes.keys().filter(|c| matches!(c, Consumer::Export(_))).cloned().collect();
        for consumer in mine {
            self.remove(&consumer);
        }
        self.route_exports(world, inputs);
        true
    }

    /// Routes one export again; whether its route changed.
    pub(crate) fn reroute_export(&mut self, world: &World, id: &ObjectId, inputs: &Inputs<'_>) -> bool {
        let consumer = Consumer::export(id);
        let now = world.object_of(GROUP, export::KIND, id).and_then(|stored| match &stored.decoded {
            Decoded::Export(e) => target::route_export(inputs, &self.lookup, &consumer, e),
            _ => None,
        });
        self.replace(consumer, now)
    }

    /// Routes every Mapping of `kind` again (its watch relisted, or came or went).
    pub(crate) fn reroute_kind(&mut self, world: &World, kind: MappingKind, inputs: &Inputs<'_>) -> bool {
        let mine: Vec<Consumer> = self
            .routes
            .keys()
            .filter(|c| matches!(c, Consumer::Mapping { kind: k, .. } if *k == kind))
            .cloned()
            .collect();
        for consumer in mine {
            self.remove(&consumer);
        }
        self.route_kind(world, kind, inputs);
        true
    }

    fn route_kind(&mut self, world: &World, kind: MappingKind, inputs: &Inputs<'_>) {
        for (id, stored) in world.objects_of(mapping::GROUP, kind.kind()) {
            let consumer = Consumer::mapping(kind, id);
            if let Decoded::Mapping(m) = &stored.decoded
                && let Some(routed) = target::route(inputs, &self.lookup, &consumer, m)
            {
                self.add(consumer, routed);
            }
        }
    }

    /// Routes one Mapping again; whether its route changed.
    pub(crate) fn reroute(&mut self, world: &World, kind: MappingKind, id: &ObjectId, inputs: &Inputs<'_>) -> bool {
        let consumer = Consumer::mapping(kind, id);
        let now = world.object_of(mapping::GROUP, kind.kind(), id).and_then(|stored| match &stored.decoded {
            Decoded::Mapping(m) => target::route(inputs, &self.lookup, &consumer, m),
            _ => None,
        });
        self.replace(consumer, now)
    }

    /// Puts `now` in `consumer`'s place; whether that changed its route.
    fn replace(&mut self, consumer: Consumer, now: Option<Routed>) -> bool {
        if self.routes.get(&consumer) == now.as_ref() {
            return false;
        }
        self.remove(&consumer);
        if let Some(routed) = now {
            self.add(consumer, routed);
        }
        true
    }

    fn add(&mut self, consumer: Consumer, routed: Routed) {
        match &routed.uses {
            Uses::Consul(resolver, service) => {
                let uses = self.consul_uses.entry(resolver.clone()).or_default().entry(service.clone()).or_default();
                *uses += 1;
                if *uses == 1 {
                    self.touched.entry(resolver.clone()).or_default().insert(service.clone());
                }
            }
            Uses::Kube(target) => {
                self.kube_uses.entry(target.clone()).or_default().insert(consumer.clone());
            }
            Uses::Nothing => {}
        }
        self.routes.insert(consumer, routed);
        self.listed.take();
    }

    fn remove(&mut self, consumer: &Consumer) {
        let Some(routed) = self.routes.remove(consumer) else { return };
        self.listed.take();
        match routed.uses {
            Uses::Consul(resolver, service) => {
                if let Some(services) = self.consul_uses.get_mut(&resolver) {
                    if let Some(n) = services.get_mut(&service) {
                        *n -= 1;
                        if *n == 0 {
                            services.remove(&service);
                            self.touched.entry(resolver.clone()).or_default().insert(service);
                        }
                    }
                    if services.is_empty() {
                        self.consul_uses.remove(&resolver);
                    }
                }
            }
            Uses::Kube(target) => {
                if let Some(by) = self.kube_uses.get_mut(&target) {
                    by.remove(consumer);
                    if by.is_empty() {
                        self.kube_uses.remove(&target);
                    }
                }
            }
            Uses::Nothing => {}
        }
    }

    /// Per resolver, the services that started or stopped being routed to since the last
    /// call: pass two reads them.
    pub(crate) fn take_touched(&mut self) -> BTreeMap<NamespacedName, BTreeSet<String>> {
        std::mem::take(&mut self.touched)
    }

    /// Whether some route goes to `resolver`'s `service`.
    pub(crate) fn routes_to(&self, resolver: &NamespacedName, service: &str) -> bool {
        self.consul_uses.get(resolver).is_some_and(|u| u.contains_key(service))
    }

    /// The services of `resolver` that routes go to.
    pub(crate) fn routed_services(&self, resolver: &NamespacedName) -> impl Iterator<Item = &str> {
        self.consul_uses.get(resolver).into_iter().flat_map(|u| u.keys().map(String::as_str))
    }

    /// The Kubernetes Services routed to, sorted by namespace and name.
    pub(crate) fn kube_targets(&self) -> impl Iterator<Item = &NamespacedName> {
        self.kube_uses.keys()
    }

    /// How many Kubernetes Services are routed to.
    pub(crate) fn kube_target_count(&self) -> usize {
        self.kube_uses.len()
    }

    /// Who routes to the Kubernetes Service `target`.
    pub(crate) fn kube_consumers(&self, target: &NamespacedName) -> impl Iterator<Item = &Consumer> {
        self.kube_uses.get(target).into_iter().flatten()
    }

    /// The routes' snapshot entries, in the snapshot's order: the same list until a route
    /// changes.
    pub(crate) fn mappings(&self) -> Parts<MappingEntry> {
        self.listed().mappings.clone()
    }

    /// The exports' entries, sorted by namespace and name, without their `source`, each
    /// with the resolver service it reads.
    pub(crate) fn exports(&self) -> impl Iterator<Item = (&ExportEntry, Option<(&NamespacedName, &str)>)> {
        self.listed().exports.iter().map(|(e, reads)| (e, reads.as_ref().map(|(r, s)| (r, s.as_str()))))
    }

    /// The routes' problems.
    pub(crate) fn problems(&self) -> impl Iterator<Item = &Problem> {
        self.listed().problems.iter()
    }

    fn listed(&self) -> &Listed {
        self.listed.get_or_init(|| {
            let (mut mappings, mut exports, mut problems) = (Vec::new(), Vec::new(), Vec::new());
            for r in self.routes.values() {
                match (&r.entry, &r.uses) {
                    (Some(Entry::Mapping(m)), _) => mappings.push(m.clone()),
                    (Some(Entry::Export(e)), Uses::Consul(resolver, service)) => {
                        exports.push((ExportEntry::clone(e), Some((resolver.clone(), service.clone()))))
                    }
                    (Some(Entry::Export(e)), _) => exports.push((ExportEntry::clone(e), None)),
                    (None, _) => {}
                }
                problems.extend(r.problem.iter().map(|p| Problem::clone(p)));
            }
            Listed { mappings: mappings.into(), exports, problems }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A route in the table costs its key and this, about twice over (half-full B-tree
    /// nodes), per Mapping: the entry, a problem and an export are held behind pointers.
    #[test]
    fn a_route_is_small() {
        let size = std::mem::size_of::<Routed>();
        assert!(size <= 96, "a route is {size} bytes");
    }
}
