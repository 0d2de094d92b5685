//! Pass two for Consul: each resolver's services (listed in its spec, or routed to), their
//! entries, and the endpoints kept of them.

use std::collections::{BTreeMap, BTreeSet};

use consul_resolver_api::names::NamespacedName;

use super::Inputs;
use super::entry::{Lists, resolver_entry, service_entry};
use crate::assembler::desired::Desired;
use crate::assembler::kept::{Kept, ServiceOf};
use crate::assembler::resolvers::{Resolver, Settings};
use crate::assembler::snapshot::{Part, Parts, ResolverEntry, ServiceEntry};
use crate::keys::{ConsulKey, WatchKey};

/// Pass two's Consul state.
#[derive(Debug, Clone, Default)]
pub(crate) struct Services {
    /// Per resolver in scope, its services as read.
    by_resolver: BTreeMap<NamespacedName, ResolverServices>,
    /// Per resolver in scope, its snapshot entry (with its services' entries, shared).
    entries: BTreeMap<NamespacedName, Part<ResolverEntry>>,
    /// Resolvers whose services changed since their entry was made: it is made again
    /// when a document needs it ([`Services::make_entries`]), not at every reading. At a
    /// cold start, readings come with every page of Mappings and batch of first answers,
    /// and each entry lists every service of its resolver.
    stale: BTreeSet<NamespacedName>,
    /// Endpoints last obtained per resolver service (last known good).
    kept: Kept,
}

/// One resolver's services. Each one's query is a desired watch while it is here (and the
/// resolver usable): [`ResolverServices::insert`] and [`ResolverServices::remove`] keep
/// [`Desired`] in step.
#[derive(Debug, Clone, Default)]
struct ResolverServices {
    /// The settings the services are read with; `None` while the resolver is unusable.
    settings: Option<Settings>,
    services: BTreeMap<String, Part<ServiceEntry>>,
}

impl ResolverServices {
    fn new(r: &Resolver) -> Self {
        ResolverServices { settings: r.settings.as_ref().ok().cloned(), services: BTreeMap::new() }
    }

    fn watch(&self, name: &str) -> Option<WatchKey> {
        self.settings.as_ref().map(|s| WatchKey::Consul(s.key(name)))
    }

    fn insert(&mut self, name: &str, entry: Part<ServiceEntry>, desired: &mut Desired) {
        if self.services.insert(name.to_owned(), entry).is_none()
            && let Some(key) = self.watch(name)
        {
            desired.add(key);
        }
    }

    /// Whether `name` was one of its services.
    fn remove(&mut self, name: &str, desired: &mut Desired) -> bool {
        let was = self.services.remove(name).is_some();
        if was && let Some(key) = self.watch(name) {
            desired.remove(key);
        }
        was
    }

    /// Stops every query; the entries remain, for reuse.
    fn release(self, desired: &mut Desired) -> BTreeMap<String, Part<ServiceEntry>> {
        for name in self.services.keys() {
            if let Some(key) = self.watch(name) {
                desired.remove(key);
            }
        }
        self.services
    }
}

/// The service entries made in one reading, by service name: resolvers that follow the
/// same Consul (the same query) get equal entries, and share one part, so its JSON is made
/// and kept once, and the document's runs of them are the same pieces. At the scale
/// profile's five resolvers, 44 MB of JSON kept once instead of five times.
#[derive(Default)]
struct Made(BTreeMap<String, Part<ServiceEntry>>);

impl Made {
    /// A part of `entry`: the one made for another resolver if it is equal, else
    /// `previous` if it is equal, else a new one.
    fn part(&mut self, name: &str, entry: ServiceEntry, previous: Option<Part<ServiceEntry>>) -> Part<ServiceEntry> {
        if let Some(part) = self.0.get(name).filter(|p| ***p == entry) {
            return part.clone();
        }
        let part = previous.filter(|p| **p == entry).unwrap_or_else(|| Part::new(entry));
        self.0.insert(name.to_owned(), part.clone());
        part
    }
}

/// Per resolver, the services read through a query in `changed`: their entries must be
/// read again.
pub(crate) fn answered(
    resolvers: &[Resolver],
    changed: &BTreeSet<ConsulKey>,
) -> BTreeMap<NamespacedName, BTreeSet<String>> {
    let mut answered: BTreeMap<NamespacedName, BTreeSet<String>> = BTreeMap::new();
    for key in changed {
        for r in resolvers {
            if r.settings.as_ref().is_ok_and(|s| s.queries(key)) {
                answered.entry(r.id()).or_default().insert(key.service.clone());
            }
        }
    }
    answered
}

impl Services {
    /// The snapshot entries of `resolvers`: those made, and (made now, not kept) those
    /// whose services changed since.
    pub(crate) fn entries(&self, resolvers: &[Resolver]) -> Vec<Part<ResolverEntry>> {
        let mut lists = Lists::of(self.entries.values());
        let entry = |r: &Resolver| {
            let id = r.id();
            if self.stale.contains(&id) { self.entry_anew(r, &id, &mut lists) } else { self.entries.get(&id).cloned() }
        };
        resolvers.iter().filter_map(entry).collect()
    }

    /// Makes again the entries of the resolvers whose services changed.
    pub(crate) fn make_entries(&mut self, resolvers: &[Resolver]) {
        if self.stale.is_empty() {
            return;
        }
        let mut lists = Lists::of(self.entries.values());
        let made: Vec<(NamespacedName, Part<ResolverEntry>)> = resolvers
            .iter()
            .map(|r| (r, r.id()))
            .filter(|(_, id)| self.stale.contains(id))
            .filter_map(|(r, id)| {
                let entry = self.entry_anew(r, &id, &mut lists)?;
                Some((id, entry))
            })
            .collect();
        self.entries.extend(made);
        self.stale.clear();
    }

    /// Resolver `r`'s (`id`) entry made from its services as read, sharing a list of
    /// `lists` where one holds the very same services.
    fn entry_anew(&self, r: &Resolver, id: &NamespacedName, lists: &mut Lists) -> Option<Part<ResolverEntry>> {
        let mine = self.by_resolver.get(id)?;
        Some(resolver_entry(r, &mine.services, lists))
    }

    /// The entry of `resolver`'s `service`, if it is one of its services.
    pub(crate) fn service(&self, resolver: &NamespacedName, service: &str) -> Option<&Part<ServiceEntry>> {
        self.by_resolver.get(resolver)?.services.get(service)
    }

    pub(crate) fn kept(&self) -> &Kept {
        &self.kept
    }

    /// Reads again the services `answered` (their query changed) and those `touched` (they
    /// started or stopped being routed to); drops those no longer wanted; rebuilds the
    /// entries of resolvers whose services changed.
    pub(crate) fn read(
        &mut self,
        inputs: &Inputs<'_>,
        answered: &BTreeMap<NamespacedName, BTreeSet<String>>,
        touched: &BTreeMap<NamespacedName, BTreeSet<String>>,
        desired: &mut Desired,
    ) {
        let Inputs { world, resolvers, routes, now, .. } = *inputs;
        let mut made = Made::default();
        for r in resolvers {
            let id = r.id();
            let answered = answered.get(&id);
            let routed = touched.get(&id);
            if answered.is_none() && routed.is_none() {
                continue; // Neither its queries nor its routes changed.
            }
            let wanted = |name: &str| r.listed_services().any(|s| s == name) || routes.routes_to(&id, name);
            let mine = self.by_resolver.entry(id.clone()).or_insert_with(|| ResolverServices::new(r));
            let mut changed = false;
            let names: BTreeSet<&String> = answered.into_iter().chain(routed).flatten().collect();
            for name in names {
                if !wanted(name) {
                    if mine.remove(name, desired) {
                        self.kept.remove(&ServiceOf::new(&id, name));
                        changed = true;
                    }
                    continue;
                }
                let previous = mine.services.get(name.as_str());
                if previous.is_some() && !answered.is_some_and(|a| a.contains(name)) {
                    continue; // Still wanted, and its answer did not change.
                }
                let entry = service_entry(world, r, &id, name, &mut self.kept, now).map(|e| made.part(name, e, None));
                if entry.as_deref() != previous.map(|p| &**p) {
                    changed = true;
                    match entry {
                        Some(entry) => mine.insert(name, entry, desired),
                        None => {
                            mine.remove(name, desired);
                        }
                    }
                }
            }
            if changed || !self.entries.contains_key(&id) {
                self.stale.insert(id);
            }
        }
    }

    /// Reads every resolver's services anew: after the resolvers (or their Secrets)
    /// changed. Every query is released and added again, so a changed setting moves each
    /// service to its new query.
    pub(crate) fn read_all(&mut self, inputs: &Inputs<'_>, desired: &mut Desired) {
        let Inputs { world, resolvers, routes, now, .. } = *inputs;
        let mut old_services = std::mem::take(&mut self.by_resolver);
        let mut old_entries = std::mem::take(&mut self.entries);
        self.stale.clear();
        let mut made = Made::default();
        let mut lists = Lists::of(old_entries.values());
        for r in resolvers {
            let id = r.id();
            let mut wanted: BTreeSet<&str> = r.listed_services().collect();
            wanted.extend(routes.routed_services(&id));
            let mut old = old_services.remove(&id).map(|o| o.release(desired)).unwrap_or_default();
            let mut mine = ResolverServices::new(r);
            for name in wanted {
                let previous = old.remove(name);
                if let Some(entry) = service_entry(world, r, &id, name, &mut self.kept, now) {
                    // The same entry keeps its allocation: equal parts stay shared.
                    let entry = made.part(name, entry, previous);
                    mine.insert(name, entry, desired);
                }
            }
            for name in old.keys() {
                self.kept.remove(&ServiceOf::new(&id, name));
            }
            let fresh = resolver_entry(r, &mine.services, &mut lists);
            let same = |e: &Part<ResolverEntry>| Parts::ptr_eq(&e.services, &fresh.services) && **e == *fresh;
            let entry = old_entries.remove(&id).filter(same).unwrap_or(fresh);
            self.entries.insert(id.clone(), entry);
            self.by_resolver.insert(id, mine);
        }
        // Resolvers deleted (or out of scope): their queries stop, their kept endpoints go.
        for old in old_services.into_values() {
            old.release(desired);
        }
        let by_resolver = &self.by_resolver;
        self.kept.retain(|of| by_resolver.get(&of.resolver).is_some_and(|s| s.services.contains_key(&of.service)));
    }

    /// Each service's query, once per resolver that reads it: what the desired watches
    /// must count for Consul (the test's recount).
    #[cfg(test)]
    pub(crate) fn watches<'a>(&'a self, resolvers: &'a [Resolver]) -> impl Iterator<Item = WatchKey> + 'a {
        resolvers.iter().flat_map(move |r| {
            let settings = r.settings.as_ref().ok();
            let names = self.by_resolver.get(&r.id()).into_iter().flat_map(|s| s.services.keys());
            names.filter_map(move |name| settings.map(|s| WatchKey::Consul(s.key(name))))
        })
    }
}
