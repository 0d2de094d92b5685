//! The aggregator: folds source events into the world and knows when it is complete.
//!
//! The world holds one store per watch key: the current objects of a Kubernetes key, the
//! current endpoints and index of a Consul key. Because every consumer reads the same
//! store, sharing a watch shares its cache, and a delete reaches every consumer (which
//! kube-runtime's shared streams do not do on their own).
//!
//! Completeness (bootstrap): a Kubernetes key is synced once it has listed; it has no
//! timeout, because publishing half the Mappings black-holes the other half. A Consul key
//! is synced once Consul answered (an empty list is an answer), or once the bootstrap
//! timeout has passed since the key was added, so one dead Consul cannot block all
//! configuration; such a key is published as unsynced. Time is passed in, never read, so
//! this module is tested with a paused clock and no I/O.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use super::keys::{ConsulKey, KubeKey, WatchKey};
use super::model::{Endpoint, KubeObject, ObjectId};

/// What a Kubernetes source reports. Mirrors a list-then-watch stream: after a (re)list
/// starts, objects are collected and replace the key's store atomically at `ListDone`, so
/// readers never see a half-relisted store.
#[derive(Debug, Clone, PartialEq)]
pub enum KubeEvent {
    ListStarted,
    Listed(KubeObject),
    ListDone,
    Applied(KubeObject),
    Deleted(ObjectId),
    /// The watch failed; the source retries with backoff. The store keeps its objects.
    Failed(String),
}

/// What a Consul source reports.
#[derive(Debug, Clone, PartialEq)]
pub enum ConsulEvent {
    /// Consul answered: the full current endpoint list (sorted) and its index.
    Answer { index: u64, endpoints: Vec<Endpoint> },
    /// A query failed; the last known endpoints stay in place.
    Failed(String),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Kube(KubeKey, KubeEvent),
    Consul(ConsulKey, ConsulEvent),
}

/// The store of one Kubernetes key.
#[derive(Debug, Clone, Default)]
pub struct KubeStore {
    pub objects: BTreeMap<ObjectId, KubeObject>,
    relisting: Option<BTreeMap<ObjectId, KubeObject>>,
    pub listed: bool,
    pub last_error: Option<String>,
}

/// The state of one Consul key.
#[derive(Debug, Clone)]
pub struct ConsulStore {
    pub added_at: Instant,
    /// The last answer's index and endpoints; `None` until Consul first answers.
    pub index: Option<u64>,
    pub endpoints: Vec<Endpoint>,
    pub changed_at: Option<Instant>,
    pub last_error: Option<String>,
}

impl ConsulStore {
    pub fn answered(&self) -> bool {
        self.index.is_some()
    }
}

/// Whether the world may be published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// Complete: every Kubernetes key listed; every Consul key answered, except
    /// `unsynced` ones whose bootstrap timeout has passed.
    Ready { unsynced: Vec<ConsulKey> },
    /// Still waiting. `deadline` is when the next Consul timeout passes (the caller
    /// re-checks then); `None` when only Kubernetes keys are pending.
    Waiting { kube_pending: usize, consul_pending: usize, deadline: Option<Instant> },
}

#[derive(Debug, Clone)]
pub struct World {
    kube: BTreeMap<KubeKey, KubeStore>,
    consul: BTreeMap<ConsulKey, ConsulStore>,
    bootstrap_timeout: Duration,
    /// Bumped by every change to content; lets callers skip work when nothing changed.
    revision: u64,
}

impl World {
    pub fn new(bootstrap_timeout: Duration) -> Self {
        World { kube: BTreeMap::new(), consul: BTreeMap::new(), bootstrap_timeout, revision: 0 }
    }

    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// A watch for `key` started: its store exists, empty and unsynced.
    pub fn track(&mut self, key: &WatchKey, now: Instant) {
        match key {
            WatchKey::Kube(k) => {
                self.kube.entry(k.clone()).or_default();
            }
            WatchKey::Consul(k) => {
                self.consul.entry(k.clone()).or_insert_with(|| ConsulStore {
                    added_at: now,
                    index: None,
                    endpoints: Vec::new(),
                    changed_at: None,
                    last_error: None,
                });
            }
        }
        self.revision += 1;
    }

    /// The watch for `key` stopped: its data leaves the world.
    pub fn untrack(&mut self, key: &WatchKey) {
        let removed = match key {
            WatchKey::Kube(k) => self.kube.remove(k).is_some(),
            WatchKey::Consul(k) => self.consul.remove(k).is_some(),
        };
        if removed {
            self.revision += 1;
        }
    }

    /// Folds one event in. Returns whether the world's content changed. Events for keys
    /// that are not tracked (a stopped watch's last words) are ignored.
    pub fn apply(&mut self, event: Event, now: Instant) -> bool {
        let changed = match event {
            Event::Kube(key, ev) => match self.kube.get_mut(&key) {
                Some(store) => apply_kube(store, ev),
                None => false,
            },
            Event::Consul(key, ev) => match self.consul.get_mut(&key) {
                Some(store) => apply_consul(store, ev, now),
                None => false,
            },
        };
        if changed {
            self.revision += 1;
        }
        changed
    }

    pub fn readiness(&self, now: Instant) -> Readiness {
        let kube_pending = self.kube.values().filter(|s| !s.listed).count();
        let mut consul_pending = 0;
        let mut deadline: Option<Instant> = None;
        let mut unsynced = Vec::new();
        for (key, store) in &self.consul {
            if store.answered() {
                continue;
            }
            let due = store.added_at + self.bootstrap_timeout;
            if now >= due {
                unsynced.push(key.clone());
            } else {
                consul_pending += 1;
                deadline = Some(deadline.map_or(due, |d| d.min(due)));
            }
        }
        if kube_pending == 0 && consul_pending == 0 {
            Readiness::Ready { unsynced }
        } else {
            Readiness::Waiting { kube_pending, consul_pending, deadline }
        }
    }

    pub fn kube(&self) -> &BTreeMap<KubeKey, KubeStore> {
        &self.kube
    }

    pub fn consul(&self) -> &BTreeMap<ConsulKey, ConsulStore> {
        &self.consul
    }

    /// Objects of every tracked key of this group and kind (any version or scope), each
    /// object once even when several keys hold it.
    pub fn objects_of<'a>(&'a self, group: &'a str, kind: &'a str) -> impl Iterator<Item = &'a KubeObject> + 'a {
        let mut seen = std::collections::BTreeSet::new();
        self.kube
            .iter()
            .filter(move |(k, _)| k.is(group, kind))
            .flat_map(|(_, s)| s.objects.values())
            .filter(move |o| seen.insert(o.id.clone()))
    }
}

fn apply_kube(store: &mut KubeStore, ev: KubeEvent) -> bool {
    match ev {
        KubeEvent::ListStarted => {
            store.relisting = Some(BTreeMap::new());
            false
        }
        KubeEvent::Listed(obj) => {
            store.relisting.get_or_insert_with(BTreeMap::new).insert(obj.id.clone(), obj);
            false
        }
        KubeEvent::ListDone => {
            let fresh = store.relisting.take().unwrap_or_default();
            let changed = !store.listed || fresh != store.objects;
            store.objects = fresh;
            store.listed = true;
            store.last_error = None;
            changed
        }
        KubeEvent::Applied(obj) => {
            store.last_error = None;
            let old = store.objects.insert(obj.id.clone(), obj.clone());
            old.as_ref() != Some(&obj)
        }
        KubeEvent::Deleted(id) => store.objects.remove(&id).is_some(),
        KubeEvent::Failed(e) => {
            store.last_error = Some(e);
            false
        }
    }
}

fn apply_consul(store: &mut ConsulStore, ev: ConsulEvent, now: Instant) -> bool {
    match ev {
        ConsulEvent::Answer { index, endpoints } => {
            let first = !store.answered();
            let errored = store.last_error.take().is_some();
            store.index = Some(index);
            if first || endpoints != store.endpoints {
                store.endpoints = endpoints;
                store.changed_at = Some(now);
                true
            } else {
                // Same content: not an event for the snapshot, but a cleared error is.
                errored
            }
        }
        ConsulEvent::Failed(e) => {
            let changed = store.last_error.as_deref() != Some(e.as_str());
            store.last_error = Some(e);
            changed
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::keys::{ConsulServer, Secret};
    use crate::core::model::Health;
    use serde_json::json;
    use std::collections::BTreeSet;

    fn mappings() -> KubeKey {
        KubeKey::new("getambassador.io", "", "Mapping")
    }

    fn consul(service: &str) -> ConsulKey {
        ConsulKey {
            server: ConsulServer { address: "http://127.0.0.1:8500".into(), token: Some(Secret::new("t")), tls: None },
            datacenter: None,
            namespace: None,
            partition: None,
            passing: true,
            tags: BTreeSet::new(),
            service: service.into(),
        }
    }

    fn obj(ns: &str, name: &str, v: i64) -> KubeObject {
        KubeObject::from_value(json!({"metadata": {"namespace": ns, "name": name}, "spec": {"v": v}})).unwrap()
    }

    fn ep(addr: &str) -> Endpoint {
        Endpoint {
            address: addr.into(),
            port: 80,
            node: "n1".into(),
            service_id: format!("svc-{addr}"),
            tags: vec![],
            meta: Default::default(),
            health: Health::Passing,
        }
    }

    const TIMEOUT: Duration = Duration::from_secs(30);

    #[tokio::test(start_paused = true)]
    async fn not_ready_until_every_kube_key_listed() {
        let now = Instant::now();
        let mut w = World::new(TIMEOUT);
        w.track(&mappings().into(), now);
        assert_eq!(w.readiness(now), Readiness::Waiting { kube_pending: 1, consul_pending: 0, deadline: None });
        w.apply(Event::Kube(mappings(), KubeEvent::ListStarted), now);
        w.apply(Event::Kube(mappings(), KubeEvent::Listed(obj("a", "m1", 1))), now);
        // Half listed is still not ready, however long it takes: Kubernetes has no timeout.
        assert!(matches!(w.readiness(now + TIMEOUT * 10), Readiness::Waiting { .. }));
        assert!(w.apply(Event::Kube(mappings(), KubeEvent::ListDone), now));
        assert_eq!(w.readiness(now), Readiness::Ready { unsynced: vec![] });
        assert_eq!(w.kube()[&mappings()].objects.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn consul_keys_sync_on_first_answer_even_empty() {
        let now = Instant::now();
        let mut w = World::new(TIMEOUT);
        w.track(&consul("a").into(), now);
        assert_eq!(
            w.readiness(now),
            Readiness::Waiting { kube_pending: 0, consul_pending: 1, deadline: Some(now + TIMEOUT) }
        );
        assert!(w.apply(Event::Consul(consul("a"), ConsulEvent::Answer { index: 5, endpoints: vec![] }), now));
        assert_eq!(w.readiness(now), Readiness::Ready { unsynced: vec![] });
    }

    #[tokio::test(start_paused = true)]
    async fn bootstrap_timeout_publishes_unreachable_services_as_unsynced() {
        let start = Instant::now();
        let mut w = World::new(TIMEOUT);
        w.track(&consul("dead").into(), start);
        w.track(&consul("alive").into(), start);
        w.apply(
            Event::Consul(consul("alive"), ConsulEvent::Answer { index: 1, endpoints: vec![ep("10.0.0.1")] }),
            start,
        );
        w.apply(Event::Consul(consul("dead"), ConsulEvent::Failed("connection refused".into())), start);
        tokio::time::advance(TIMEOUT - Duration::from_millis(1)).await;
        assert!(matches!(w.readiness(Instant::now()), Readiness::Waiting { consul_pending: 1, .. }));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(w.readiness(Instant::now()), Readiness::Ready { unsynced: vec![consul("dead")] });
        // A key added later gets its own full timeout.
        w.track(&consul("late").into(), Instant::now());
        assert!(matches!(w.readiness(Instant::now()), Readiness::Waiting { consul_pending: 1, .. }));
    }

    #[tokio::test(start_paused = true)]
    async fn identical_answers_are_not_changes_and_errors_keep_endpoints() {
        let now = Instant::now();
        let mut w = World::new(TIMEOUT);
        w.track(&consul("a").into(), now);
        let answer = |i| Event::Consul(consul("a"), ConsulEvent::Answer { index: i, endpoints: vec![ep("10.0.0.1")] });
        assert!(w.apply(answer(5), now));
        let rev = w.revision();
        assert!(!w.apply(answer(6), now), "a new index with the same content is not a change");
        assert_eq!(w.revision(), rev);
        assert!(w.apply(Event::Consul(consul("a"), ConsulEvent::Failed("500 No cluster leader".into())), now));
        assert_eq!(w.consul()[&consul("a")].endpoints, vec![ep("10.0.0.1")], "errors keep the last endpoints");
        assert!(!w.apply(Event::Consul(consul("a"), ConsulEvent::Failed("500 No cluster leader".into())), now));
        assert!(w.apply(answer(7), now), "recovering from an error is a change (status clears)");
        assert_eq!(w.consul()[&consul("a")].last_error, None);
    }

    #[tokio::test(start_paused = true)]
    async fn relist_replaces_atomically_and_deletes_reach_readers() {
        let now = Instant::now();
        let mut w = World::new(TIMEOUT);
        w.track(&mappings().into(), now);
        for ev in [
            KubeEvent::ListStarted,
            KubeEvent::Listed(obj("a", "m1", 1)),
            KubeEvent::Listed(obj("a", "m2", 1)),
            KubeEvent::ListDone,
        ] {
            w.apply(Event::Kube(mappings(), ev), now);
        }
        // A relist after a watch error: until it is done the old objects stay visible.
        w.apply(Event::Kube(mappings(), KubeEvent::ListStarted), now);
        w.apply(Event::Kube(mappings(), KubeEvent::Listed(obj("a", "m1", 2))), now);
        assert_eq!(w.kube()[&mappings()].objects.len(), 2);
        assert!(w.apply(Event::Kube(mappings(), KubeEvent::ListDone), now));
        let names: Vec<_> = w.kube()[&mappings()].objects.keys().map(|id| id.name.as_str()).collect();
        assert_eq!(names, ["m1"], "m2 vanished during the relist: it is deleted");
        assert!(w.apply(Event::Kube(mappings(), KubeEvent::Deleted(obj("a", "m1", 2).id)), now));
        assert!(w.kube()[&mappings()].objects.is_empty());
        assert!(w.apply(Event::Kube(mappings(), KubeEvent::Applied(obj("a", "m3", 1))), now));
    }

    #[tokio::test(start_paused = true)]
    async fn events_for_stopped_watches_are_ignored() {
        let now = Instant::now();
        let mut w = World::new(TIMEOUT);
        w.track(&consul("a").into(), now);
        w.untrack(&consul("a").into());
        assert!(!w.apply(Event::Consul(consul("a"), ConsulEvent::Answer { index: 1, endpoints: vec![] }), now));
        assert!(w.consul().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn objects_of_dedups_across_overlapping_keys() {
        let now = Instant::now();
        let mut w = World::new(TIMEOUT);
        let all = mappings();
        let ns = mappings().in_namespace("a");
        for k in [&all, &ns] {
            w.track(&k.clone().into(), now);
            w.apply(Event::Kube(k.clone(), KubeEvent::Applied(obj("a", "m1", 1))), now);
        }
        assert_eq!(w.objects_of("getambassador.io", "Mapping").count(), 1);
    }
}
