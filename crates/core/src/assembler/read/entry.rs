//! One Consul service's entry: its query's answer, or the endpoints last obtained (stale,
//! with since when and why), or nothing yet.

use std::collections::BTreeMap;
use std::time::SystemTime;

use consul_resolver_api::names::NamespacedName;

use crate::assembler::kept::{self, Kept, KeptService, ServiceOf};
use crate::assembler::resolvers::Resolver;
use crate::assembler::snapshot::{Part, Parts, ResolverEntry, ServiceEntry, Stale, UnusableReason};
use crate::keys::ConsulKey;
use crate::model::Endpoints;
use crate::world::{ConsulStore, World};

/// A resolver's entry in the snapshot, with its services' entries (shared), as one list
/// with any of `lists` that holds the very same parts.
pub(super) fn resolver_entry(
    r: &Resolver,
    services: &BTreeMap<String, Part<ServiceEntry>>,
    lists: &mut Lists,
) -> Part<ResolverEntry> {
    Part::new(ResolverEntry {
        namespace: r.namespace.clone(),
        name: r.name.clone(),
        generation: r.generation,
        address: r.settings.as_ref().map(|s| s.server().address.clone()).unwrap_or_default(),
        datacenter: r.spec.as_ref().and_then(|s| s.datacenter.clone()),
        unusable: r.settings.as_ref().err().cloned(),
        services: lists.list(services),
    })
}

/// The services' lists of the resolver entries made in one reading (and of those kept
/// from before): resolvers that follow the same Consul and the same services share one
/// list, which a document then writes once ([`crate::assembler::segment::Segmenter::run`]).
#[derive(Default)]
pub(super) struct Lists(Vec<Parts<ServiceEntry>>);

impl Lists {
    /// Lists already made, to share.
    pub(super) fn of<'a>(entries: impl IntoIterator<Item = &'a Part<ResolverEntry>>) -> Self {
        Lists(entries.into_iter().map(|e| e.services.clone()).collect())
    }

    /// `services` as a list: one made before if it holds the very same parts. The list is
    /// made once and compared with the others as lists (pointers in sequence), not along
    /// the map once per candidate.
    fn list(&mut self, services: &BTreeMap<String, Part<ServiceEntry>>) -> Parts<ServiceEntry> {
        let list: Vec<Part<ServiceEntry>> = services.values().cloned().collect();
        let same = |made: &&Parts<ServiceEntry>| {
            made.len() == list.len() && made.iter().zip(&list).all(|(a, b)| Part::ptr_eq(a, b))
        };
        // The lists made in this reading first: resolvers that follow the same services
        // are made one after the other.
        if let Some(made) = self.0.iter().rev().find(same) {
            return made.clone();
        }
        let list = Parts::from(list);
        self.0.push(list.clone());
        list
    }
}

/// One service's entry: its query's answer, or (until the query answers, or while the
/// resolver is unusable) the endpoints last obtained, or nothing to show. Updates what is
/// kept of it.
pub(super) fn service_entry(
    world: &World,
    r: &Resolver,
    resolver: &NamespacedName,
    name: &str,
    kept: &mut Kept,
    now: SystemTime,
) -> Option<ServiceEntry> {
    let of = ServiceOf::new(resolver, name);
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
