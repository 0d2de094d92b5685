//! The world: folds source events into one store per watch key, and knows when it is
//! complete.
//!
//! The world holds one store per watch key: the current objects of a Kubernetes key, the
//! current endpoints and index of a Consul key. Because every consumer reads the same
//! store, sharing a watch shares its cache, and a delete reaches every consumer (which
//! kube-runtime's shared streams do not do on their own).
//!
//! Objects are decoded once, when they arrive ([`crate::ingest`]), and the world records
//! what each batch changed ([`Changes`]) so the assembler redoes only that.
//!
//! Completeness (bootstrap) gates only the first publication (see the pipeline). The
//! operator's fixed keys (its own kinds, `--watch`) must have listed; they have no timeout,
//! because publishing half the Mappings black-holes the other half. A key the world implies
//! (a Secret, a Service's endpoints, a Consul service) is settled once it has listed or
//! answered (an empty list is an answer), once the API server has rejected its watch, or
//! once the bootstrap timeout has passed since it was added: one dead Consul or one
//! forbidden namespace cannot block all configuration; such a key is published as
//! unsynced. Time is passed in, never read, so this module is tested with a paused clock
//! and no I/O.

use std::collections::{BTreeMap, BTreeSet, btree_map};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use super::ingest::Reading;
use super::keys::{ConsulKey, KubeKey, WatchKey};
use super::model::{ConsulEvent, Endpoints, Event, KubeEvent, KubeObject, ObjectId, Stored, WatchFailure};

/// The store of one Kubernetes key.
#[derive(Debug, Clone)]
pub struct KubeStore {
    pub added_at: Instant,
    reading: Reading,
    pub objects: BTreeMap<ObjectId, Stored>,
    /// A list after the first (a watch that had to start again: 410 Gone, an API server
    /// restart), while it comes.
    relisting: Option<Relist>,
    /// Its first list is folded in as it comes (see [`World::track_fixed`]).
    as_it_comes: bool,
    /// During a first list folded in as it comes: the objects it has brought so far.
    seen: Option<BTreeSet<ObjectId>>,
    pub listed: bool,
    /// The last failure, cleared by the next success.
    pub failure: Option<WatchFailure>,
}

/// What a relist has brought so far, against the objects stored. The stored objects stay
/// as they are until it is done, and what it brings unchanged is held by its id only: at
/// the scale profile a namespace holds 11,000 Mappings, and a complete second copy of them
/// for the length of a list is memory no steady state needs.
#[derive(Debug, Clone, Default)]
struct Relist {
    /// The objects it brought that are new or differ from the stored ones, and those whose
    /// JSON is kept (a resolver's status is current even when what is read of it is not
    /// new).
    fresh: BTreeMap<ObjectId, Stored>,
    /// The ones it brought as stored: those of `fresh` not here are new or differ.
    unchanged: BTreeSet<ObjectId>,
}

impl KubeStore {
    fn new(added_at: Instant, reading: Reading) -> Self {
        KubeStore {
            added_at,
            reading,
            objects: BTreeMap::new(),
            relisting: None,
            as_it_comes: false,
            seen: None,
            listed: false,
            failure: None,
        }
    }

    /// Stores `obj` as read, and says whether it differs from what was stored. Stored
    /// even when it does not: its JSON (a resolver's status) is current.
    fn put(&mut self, obj: KubeObject) -> bool {
        let stored = self.reading.decode(&obj);
        let changed = self.objects.get(&obj.id).is_none_or(|old| !self.reading.same(old, &stored));
        self.objects.insert(obj.id, stored);
        changed
    }

    /// Why the API server refuses this watch, while it does.
    pub fn rejection(&self) -> Option<&str> {
        self.failure.as_ref().filter(|f| f.rejected).map(|f| f.message.as_str())
    }
}

/// The state of one Consul key.
#[derive(Debug, Clone)]
pub struct ConsulStore {
    pub added_at: Instant,
    /// The last answer's index and endpoints; `None` until Consul first answers.
    pub index: Option<u64>,
    pub endpoints: Endpoints,
    pub changed_at: Option<Instant>,
    pub last_error: Option<String>,
    /// The last answer came from an agent's cache cut off from its servers since then.
    pub cut_off_since: Option<SystemTime>,
    /// The last query was refused by Consul (`ConsulEvent::Refused`): the key is known for
    /// the first snapshot even if it never answered.
    pub refused: bool,
}

impl ConsulStore {
    pub fn answered(&self) -> bool {
        self.index.is_some()
    }
}

/// What changed in the world since it was last asked: the assembler redoes only this.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    /// Kubernetes keys whose store changed, with the objects that did; `None`: all of them
    /// (the key was added or removed, listed for the first time, or its rejection came or
    /// went). A relist names the objects it changed.
    pub kube: BTreeMap<KubeKey, Option<BTreeSet<ObjectId>>>,
    /// Consul keys whose answer, error or presence changed.
    pub consul: BTreeSet<ConsulKey>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.kube.is_empty() && self.consul.is_empty()
    }

    fn all_of(&mut self, key: &KubeKey) {
        self.kube.insert(key.clone(), None);
    }

    /// Records `key` as changed, with no object named yet; what was recorded stays
    /// (`None`, all of them, included).
    fn touched(&mut self, key: &KubeKey) -> Option<&mut BTreeSet<ObjectId>> {
        self.kube.entry(key.clone()).or_insert_with(|| Some(BTreeSet::new())).as_mut()
    }

    fn object(&mut self, key: &KubeKey, id: &ObjectId) {
        if let Some(ids) = self.touched(key) {
            ids.insert(id.clone());
        }
    }
}

/// Whether the world is complete enough for the first publication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// Every fixed key listed; every other key listed, answered, rejected or past the
    /// bootstrap timeout.
    Ready,
    /// Still waiting. `deadline` is when the next timeout passes (the caller re-checks
    /// then); `None` when only fixed keys are pending.
    Waiting { kube_pending: usize, consul_pending: usize, deadline: Option<Instant> },
}

#[derive(Debug, Clone)]
pub struct World {
    kube: BTreeMap<KubeKey, KubeStore>,
    consul: BTreeMap<ConsulKey, ConsulStore>,
    /// The Consul keys neither answered nor refused, with when each was added: what the
    /// first publication may wait for. Until it, readiness is asked after every batch of
    /// events, and a look at every store each time was 2 % of the operator's CPU to its
    /// first snapshot at 10,000 services (docs/benchmarks.md).
    unsettled: BTreeMap<ConsulKey, Instant>,
    bootstrap_timeout: Duration,
    /// Keys whose objects the snapshot copies whole (`--watch`): kept as JSON, and any
    /// change of them is a change. Of the others only what the assembler reads matters, so
    /// a write of `status` alone (the operator's own status writes, echoed by the watch)
    /// is not.
    verbatim: BTreeSet<KubeKey>,
    changes: Changes,
}

impl World {
    pub fn new(bootstrap_timeout: Duration) -> Self {
        World {
            kube: BTreeMap::new(),
            consul: BTreeMap::new(),
            unsettled: BTreeMap::new(),
            bootstrap_timeout,
            verbatim: BTreeSet::new(),
            changes: Changes::default(),
        }
    }

    /// Marks `keys` as copied whole into the snapshot.
    pub fn copy_verbatim(mut self, keys: impl IntoIterator<Item = KubeKey>) -> Self {
        self.verbatim.extend(keys);
        self
    }

    /// What changed since the last call.
    pub fn take_changes(&mut self) -> Changes {
        std::mem::take(&mut self.changes)
    }

    /// A watch for `key` started: its store exists, empty and unsynced.
    pub fn track(&mut self, key: &WatchKey, now: Instant) {
        match key {
            WatchKey::Kube(k) => {
                let reading = Reading::of(k, self.verbatim.contains(k));
                self.kube.entry(k.clone()).or_insert_with(|| KubeStore::new(now, reading));
                self.changes.all_of(k);
            }
            WatchKey::Consul(k) => {
                if let btree_map::Entry::Vacant(v) = self.consul.entry(k.clone()) {
                    v.insert(ConsulStore {
                        added_at: now,
                        index: None,
                        endpoints: Endpoints::from([]),
                        changed_at: None,
                        last_error: None,
                        cut_off_since: None,
                        refused: false,
                    });
                    self.unsettled.insert(k.clone(), now);
                }
                self.changes.consul.insert(k.clone());
            }
        }
    }

    /// A watch of the operator's own (its kinds, `--watch`) started. Unlike other keys,
    /// its first list is folded in as it comes, a page at a time, so the watches its
    /// objects imply (Consul services above all) start while the rest is still listing
    /// instead of after. That is safe for these keys only: the first publication waits
    /// for every one of them to be listed, however long (`readiness`), so a partial list
    /// is never published; and they are set once, before it. Later lists (after a
    /// watch's 410 Gone) are taken whole as for any key.
    pub fn track_fixed(&mut self, key: &WatchKey, now: Instant) {
        self.track(key, now);
        if let WatchKey::Kube(k) = key
            && let Some(store) = self.kube.get_mut(k)
        {
            store.as_it_comes = !store.listed;
        }
    }

    /// The watch for `key` stopped: its data leaves the world.
    pub fn untrack(&mut self, key: &WatchKey) {
        match key {
            WatchKey::Kube(k) => {
                if self.kube.remove(k).is_some() {
                    self.changes.all_of(k);
                }
            }
            WatchKey::Consul(k) => {
                self.unsettled.remove(k);
                if self.consul.remove(k).is_some() {
                    self.changes.consul.insert(k.clone());
                }
            }
        }
    }

    /// Folds one event in. Returns whether the world's content changed. Events for keys
    /// that are not tracked (a stopped watch's last words) are ignored.
    pub fn apply(&mut self, event: Event, now: Instant) -> bool {
        match event {
            Event::Kube(key, ev) => {
                let Some(store) = self.kube.get_mut(&key) else { return false };
                match apply_kube(store, ev) {
                    KubeChange::None => false,
                    KubeChange::Objects(ids) => {
                        for id in &ids {
                            self.changes.object(&key, id);
                        }
                        true
                    }
                    KubeChange::Listed => {
                        self.changes.touched(&key);
                        true
                    }
                    KubeChange::All => {
                        self.changes.all_of(&key);
                        true
                    }
                }
            }
            Event::Consul(key, ev) => {
                let Some(store) = self.consul.get_mut(&key) else { return false };
                let changed = apply_consul(store, ev, now);
                // A refusal settles a key until a failure that may pass; an answer for good.
                if store.answered() || store.refused {
                    self.unsettled.remove(&key);
                } else if !self.unsettled.contains_key(&key) {
                    self.unsettled.insert(key.clone(), store.added_at);
                }
                if changed {
                    self.changes.consul.insert(key);
                }
                changed
            }
        }
    }

    /// Whether the world is complete; `fixed` says which Kubernetes keys are the
    /// operator's own (they must list, however long it takes).
    pub fn readiness(&self, now: Instant, fixed: impl Fn(&KubeKey) -> bool) -> Readiness {
        let (mut kube_pending, mut consul_pending) = (0, 0);
        let mut deadline: Option<Instant> = None;
        let mut wait_until = |added_at: Instant| {
            let due = added_at + self.bootstrap_timeout;
            let pending = now < due;
            if pending {
                deadline = Some(deadline.map_or(due, |d| d.min(due)));
            }
            pending
        };
        for (key, store) in &self.kube {
            let pending = if fixed(key) {
                !store.listed
            } else {
                !store.listed && store.rejection().is_none() && wait_until(store.added_at)
            };
            kube_pending += usize::from(pending);
        }
        // Refused: Consul said all it will say until the resolver changes.
        for &added_at in self.unsettled.values() {
            consul_pending += usize::from(wait_until(added_at));
        }
        if kube_pending == 0 && consul_pending == 0 {
            Readiness::Ready
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
    pub fn objects_of<'a>(
        &'a self,
        group: &'a str,
        kind: &'a str,
    ) -> impl Iterator<Item = (&'a ObjectId, &'a Stored)> + 'a {
        let mut seen = BTreeSet::new();
        self.kube
            .iter()
            .filter(move |(k, _)| k.is(group, kind))
            .flat_map(|(_, s)| s.objects.iter())
            .filter(move |(id, _)| seen.insert(*id))
    }

    /// The object `id` of this group and kind, from whichever key holds it.
    pub fn object_of(&self, group: &str, kind: &str, id: &ObjectId) -> Option<&Stored> {
        self.kube.iter().filter(|(k, _)| k.is(group, kind)).find_map(|(_, s)| s.objects.get(id))
    }
}

/// What one event changed in a Kubernetes store.
enum KubeChange {
    None,
    /// These objects (never empty).
    Objects(Vec<ObjectId>),
    /// A first list folded in as it came is complete, with no object changed by it.
    Listed,
    All,
}

fn apply_kube(store: &mut KubeStore, ev: KubeEvent) -> KubeChange {
    // A rejection is content (the snapshot reports it), so its start and end are changes.
    let was_rejected = store.rejection().is_some();
    let changed_if = |changed: bool, what: KubeChange| match (changed, was_rejected) {
        (_, true) => KubeChange::All,
        (true, false) => what,
        (false, false) => KubeChange::None,
    };
    match ev {
        KubeEvent::ListStarted if store.as_it_comes && !store.listed => {
            // A list started again (the last one failed part way): what it brought stays
            // until this one is done, which removes what it does not bring.
            store.seen = Some(BTreeSet::new());
            KubeChange::None
        }
        KubeEvent::ListStarted => {
            store.relisting = Some(Relist::default());
            KubeChange::None
        }
        KubeEvent::Listed(obj) if store.seen.is_some() => {
            store.seen.get_or_insert_default().insert(obj.id.clone());
            let id = obj.id.clone();
            changed_if(store.put(obj), KubeChange::Objects(vec![id]))
        }
        KubeEvent::Listed(obj) => {
            hold_relisted(store, obj);
            KubeChange::None
        }
        KubeEvent::ListDone if store.seen.is_some() => finish_list_as_it_came(store),
        KubeEvent::ListDone => match finish_relist(store) {
            // A first list changes all of the key.
            None => changed_if(true, KubeChange::All),
            Some(named) => changed_if(!named.is_empty(), KubeChange::Objects(named)),
        },
        KubeEvent::Applied(obj) => {
            store.failure = None;
            let id = obj.id.clone();
            changed_if(store.put(obj), KubeChange::Objects(vec![id]))
        }
        KubeEvent::Deleted(id) => {
            store.failure = None;
            let changed = store.objects.remove(&id).is_some();
            changed_if(changed, KubeChange::Objects(vec![id]))
        }
        KubeEvent::Failed(f) => {
            let changed = (f.rejected || was_rejected) && store.failure.as_ref() != Some(&f);
            store.failure = Some(f);
            if changed { KubeChange::All } else { KubeChange::None }
        }
    }
}

/// Holds one object of a list that is not folded in as it comes, until the list is done.
fn hold_relisted(store: &mut KubeStore, obj: KubeObject) {
    let reading = store.reading;
    let stored = reading.decode(&obj);
    let relist = store.relisting.get_or_insert_default();
    if !store.listed {
        // A first list changes all of the key: nothing to compare.
        relist.fresh.insert(obj.id, stored);
        return;
    }
    let same = store.objects.get(&obj.id).is_some_and(|old| reading.same(old, &stored));
    if same {
        relist.unchanged.insert(obj.id.clone());
    } else {
        relist.unchanged.remove(&obj.id);
    }
    if !same || stored.raw.is_some() {
        relist.fresh.insert(obj.id, stored);
    }
}

/// Ends a list folded in as it came: what it did not bring is gone.
fn finish_list_as_it_came(store: &mut KubeStore) -> KubeChange {
    let seen = store.seen.take().unwrap_or_default();
    let gone = remove_all_but(&mut store.objects, |id| seen.contains(id));
    let first = !store.listed;
    store.listed = true;
    store.failure = None;
    match (gone.is_empty(), first) {
        (false, _) => KubeChange::Objects(gone),
        // Nothing new in the objects, but the kind is now known whole: what waits
        // for it (the endpoints watches wait for every route) goes on.
        (true, true) => KubeChange::Listed,
        (true, false) => KubeChange::None,
    }
}

/// Ends a held list by putting what it brought in place of the objects. Returns the objects
/// it changed, as a watch would have named them one by one, or `None` for a first list.
fn finish_relist(store: &mut KubeStore) -> Option<Vec<ObjectId>> {
    let Relist { fresh, unchanged } = store.relisting.take().unwrap_or_default();
    let gone = remove_all_but(&mut store.objects, |id| unchanged.contains(id) || fresh.contains_key(id));
    let first = !store.listed;
    let mut named: Vec<ObjectId> =
        if first { Vec::new() } else { fresh.keys().filter(|id| !unchanged.contains(*id)).cloned().collect() };
    named.extend(gone);
    if store.objects.is_empty() {
        store.objects = fresh;
    } else {
        store.objects.extend(fresh);
    }
    store.listed = true;
    store.failure = None;
    (!first).then_some(named)
}

/// Removes the objects `kept` does not keep, in one pass; returns their ids.
fn remove_all_but(objects: &mut BTreeMap<ObjectId, Stored>, kept: impl Fn(&ObjectId) -> bool) -> Vec<ObjectId> {
    let mut gone = Vec::new();
    objects.retain(|id, _| {
        let keep = kept(id);
        if !keep {
            gone.push(id.clone());
        }
        keep
    });
    gone
}

fn apply_consul(store: &mut ConsulStore, ev: ConsulEvent, now: Instant) -> bool {
    let (index, endpoints, cut_off_since) = match ev {
        ConsulEvent::Answer { index, endpoints } => (index, endpoints, None),
        ConsulEvent::Cached { index, endpoints, cut_off_since } => (index, endpoints, Some(cut_off_since)),
        ConsulEvent::Failed(e) => return record_error(store, e, false),
        ConsulEvent::Refused(e) => return record_error(store, e, true),
    };
    store.refused = false;
    let first = !store.answered();
    let errored = store.last_error.take().is_some();
    // Being cut off, or no longer, is a change; a later answer of the same cut-off keeps
    // when it began.
    let cut_off_changed = store.cut_off_since.is_some() != cut_off_since.is_some();
    if cut_off_changed {
        store.cut_off_since = cut_off_since;
    }
    // The index is that of the answer that brought the endpoints: an answer with the same
    // endpoints (a wake-up, a timeout) changes nothing, not even it, so the snapshot never
    // depends on when else it happens to be read.
    if first || endpoints[..] != store.endpoints[..] {
        store.index = Some(index);
        store.endpoints = endpoints;
        store.changed_at = Some(now);
        true
    } else {
        // Same content: not an event for the snapshot, but a cleared error is.
        if errored {
            store.index = Some(index);
        }
        errored || cut_off_changed
    }
}

/// A failed query: the last endpoints stay; whether Consul refused the query is kept for
/// readiness.
fn record_error(store: &mut ConsulStore, error: String, refused: bool) -> bool {
    let changed = store.last_error.as_deref() != Some(error.as_str()) || store.refused != refused;
    store.last_error = Some(error);
    store.refused = refused;
    changed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::Secret;
    use serde_json::json;
    use std::collections::BTreeSet;

    use crate::model::Endpoint;

    /// An object of any kind costs its id and this in its kind's B-tree, about twice over
    /// (nodes about half full): a Mapping, four times the size of the rest, is boxed.
    #[test]
    fn a_stored_object_is_small() {
        let size = std::mem::size_of::<crate::model::Stored>();
        assert!(size <= 64, "a stored object is {size} bytes");
    }

    fn mappings() -> KubeKey {
        KubeKey::new("getambassador.io", "", "Mapping")
    }

    fn consul(service: &str) -> ConsulKey {
        let mut key = crate::test_support::consul_key("http://127.0.0.1:8500", service);
        key.scope_mut().server.token = Some(Secret::new("t"));
        key
    }

    fn obj(ns: &str, name: &str, v: i64) -> KubeObject {
        KubeObject::from_value(json!({"metadata": {"namespace": ns, "name": name}, "spec": {"v": v}})).unwrap()
    }

    fn ep(addr: &str) -> Endpoint {
        Endpoint { node: "n1".into(), service_id: format!("svc-{addr}"), ..crate::test_support::endpoint(addr, 80) }
    }

    const TIMEOUT: Duration = Duration::from_secs(30);

    #[tokio::test(start_paused = true)]
    async fn not_ready_until_every_kube_key_listed() {
        let now = Instant::now();
        let mut w = World::new(TIMEOUT);
        w.track(&mappings().into(), now);
        let fixed = |_: &KubeKey| true;
        assert_eq!(w.readiness(now, fixed), Readiness::Waiting { kube_pending: 1, consul_pending: 0, deadline: None });
        w.apply(Event::Kube(mappings(), KubeEvent::ListStarted), now);
        w.apply(Event::Kube(mappings(), KubeEvent::Listed(obj("a", "m1", 1))), now);
        // Half listed is still not ready, however long it takes: Kubernetes has no timeout.
        assert!(matches!(w.readiness(now + TIMEOUT * 10, fixed), Readiness::Waiting { .. }));
        assert!(w.apply(Event::Kube(mappings(), KubeEvent::ListDone), now));
        assert_eq!(w.readiness(now, fixed), Readiness::Ready);
        assert_eq!(w.kube()[&mappings()].objects.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn consul_keys_sync_on_first_answer_even_empty() {
        let now = Instant::now();
        let mut w = World::new(TIMEOUT);
        w.track(&consul("a").into(), now);
        assert_eq!(
            w.readiness(now, |_| true),
            Readiness::Waiting { kube_pending: 0, consul_pending: 1, deadline: Some(now + TIMEOUT) }
        );
        assert!(w.apply(Event::Consul(consul("a"), ConsulEvent::Answer { index: 5, endpoints: vec![].into() }), now));
        assert_eq!(w.readiness(now, |_| true), Readiness::Ready);
    }

    #[tokio::test(start_paused = true)]
    async fn bootstrap_timeout_publishes_unreachable_services_as_unsynced() {
        let start = Instant::now();
        let mut w = World::new(TIMEOUT);
        w.track(&consul("dead").into(), start);
        w.track(&consul("alive").into(), start);
        w.apply(
            Event::Consul(consul("alive"), ConsulEvent::Answer { index: 1, endpoints: vec![ep("10.0.0.1")].into() }),
            start,
        );
        w.apply(Event::Consul(consul("dead"), ConsulEvent::Failed("connection refused".into())), start);
        tokio::time::advance(TIMEOUT - Duration::from_millis(1)).await;
        assert!(matches!(w.readiness(Instant::now(), |_| true), Readiness::Waiting { consul_pending: 1, .. }));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(w.readiness(Instant::now(), |_| true), Readiness::Ready);
        assert!(!w.consul()[&consul("dead")].answered(), "published as unsynced");
        // A key added later gets its own full timeout.
        w.track(&consul("late").into(), Instant::now());
        assert!(matches!(w.readiness(Instant::now(), |_| true), Readiness::Waiting { consul_pending: 1, .. }));
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_query_holds_nobody_back_until_the_timeout() {
        let start = Instant::now();
        let mut w = World::new(TIMEOUT);
        w.track(&consul("bad-filter").into(), start);
        let refusal = "Consul at http://c:8500 answered 400: Failed to create boolean expression evaluator";
        assert!(w.apply(Event::Consul(consul("bad-filter"), ConsulEvent::Refused(refusal.into())), start));
        assert_eq!(w.readiness(start, |_| true), Readiness::Ready, "known: known to be refused");
        assert_eq!(w.consul()[&consul("bad-filter")].last_error.as_deref(), Some(refusal));
        // The same message, now a failure that may pass (the server went away): pending
        // again, and a change.
        assert!(w.apply(Event::Consul(consul("bad-filter"), ConsulEvent::Failed(refusal.into())), start));
        assert!(matches!(w.readiness(start, |_| true), Readiness::Waiting { consul_pending: 1, .. }));
        assert!(w.apply(Event::Consul(consul("bad-filter"), ConsulEvent::Refused(refusal.into())), start));
        assert!(!w.apply(Event::Consul(consul("bad-filter"), ConsulEvent::Refused(refusal.into())), start));
    }

    /// Readiness reads the unsettled keys kept as events come: over random tracks,
    /// untracks, answers, failures, refusals and time, it says what a look at every store
    /// says.
    #[tokio::test(start_paused = true)]
    async fn readiness_kept_as_events_come_is_what_every_store_says() {
        let start = Instant::now();
        let mut w = World::new(TIMEOUT);
        let mut rng = crate::test_support::Rng(0x005e_ed0f_ba5e);
        let names = ["a", "b", "c", "d", "e", "f"];
        let mut kinds_seen = [0usize; 2];
        for step in 0..5_000u64 {
            let now = start + Duration::from_millis(step * 40);
            let key = consul(names[rng.below(names.len())]);
            let ev = |e| Event::Consul(key.clone(), e);
            match rng.below(8) {
                0 => w.track(&key.clone().into(), now),
                1 => w.untrack(&key.clone().into()),
                2 | 3 => _ = w.apply(ev(ConsulEvent::Failed("refused".into())), now),
                4 => _ = w.apply(ev(ConsulEvent::Refused("400".into())), now),
                _ if rng.below(4) == 0 => {
                    _ = w.apply(ev(ConsulEvent::Answer { index: step, endpoints: vec![].into() }), now);
                }
                _ => {}
            }
            let pending: Vec<Instant> = w
                .consul()
                .values()
                .filter(|s| !s.answered() && !s.refused && now < s.added_at + TIMEOUT)
                .map(|s| s.added_at + TIMEOUT)
                .collect();
            let expected = match pending.iter().min() {
                None => Readiness::Ready,
                Some(&due) => {
                    Readiness::Waiting { kube_pending: 0, consul_pending: pending.len(), deadline: Some(due) }
                }
            };
            assert_eq!(w.readiness(now, |_| true), expected, "step {step}");
            kinds_seen[usize::from(expected == Readiness::Ready)] += 1;
        }
        assert!(kinds_seen.iter().all(|&n| n > 500), "both ready and waiting, often: {kinds_seen:?}");
    }

    fn secret() -> KubeKey {
        KubeKey::new("", "v1", "Secret").in_namespace("a").with_fields("metadata.name=t")
    }

    #[tokio::test(start_paused = true)]
    async fn implied_kube_keys_settle_when_listed_rejected_or_late_fixed_ones_only_when_listed() {
        let start = Instant::now();
        let mut w = World::new(TIMEOUT);
        w.track(&mappings().into(), start);
        w.track(&secret().into(), start);
        let fixed = |k: &KubeKey| *k == mappings();
        w.apply(Event::Kube(mappings(), KubeEvent::ListStarted), start);
        w.apply(Event::Kube(mappings(), KubeEvent::ListDone), start);
        assert_eq!(
            w.readiness(start, fixed),
            Readiness::Waiting { kube_pending: 1, consul_pending: 0, deadline: Some(start + TIMEOUT) }
        );
        // A transient failure keeps it pending; a rejection settles it at once.
        assert!(!w.apply(Event::Kube(secret(), KubeEvent::Failed(WatchFailure::transient("connection reset"))), start));
        assert!(matches!(w.readiness(start, fixed), Readiness::Waiting { kube_pending: 1, .. }));
        let forbidden = WatchFailure::rejected("secrets is forbidden");
        assert!(w.apply(Event::Kube(secret(), KubeEvent::Failed(forbidden.clone())), start), "a rejection is news");
        assert!(!w.apply(Event::Kube(secret(), KubeEvent::Failed(forbidden)), start), "the same one is not");
        assert_eq!(w.readiness(start, fixed), Readiness::Ready);
        assert_eq!(w.kube()[&secret()].rejection(), Some("secrets is forbidden"));
        // Listing clears it, and that is news too.
        w.apply(Event::Kube(secret(), KubeEvent::ListStarted), start);
        assert!(w.apply(Event::Kube(secret(), KubeEvent::ListDone), start));
        assert_eq!(w.kube()[&secret()].rejection(), None);

        // A silent implied key is waited for until the bootstrap timeout; a fixed one forever.
        let mut w = World::new(TIMEOUT);
        w.track(&mappings().into(), start);
        w.track(&secret().into(), start);
        tokio::time::advance(TIMEOUT).await;
        assert_eq!(
            w.readiness(Instant::now(), fixed),
            Readiness::Waiting { kube_pending: 1, consul_pending: 0, deadline: None },
            "only the fixed key is still waited for"
        );
        let rejected_fixed = WatchFailure::rejected("mappings is forbidden");
        w.apply(Event::Kube(mappings(), KubeEvent::Failed(rejected_fixed)), Instant::now());
        assert!(matches!(w.readiness(Instant::now(), fixed), Readiness::Waiting { kube_pending: 1, .. }));
    }

    #[tokio::test(start_paused = true)]
    async fn a_fixed_keys_first_list_is_folded_in_as_it_comes_and_a_restarted_one_ends_whole() {
        let now = Instant::now();
        let fixed = |k: &KubeKey| *k == mappings();
        let mut w = World::new(TIMEOUT);
        w.track_fixed(&mappings().into(), now);
        w.take_changes();
        let ev = |e| Event::Kube(mappings(), e);
        w.apply(ev(KubeEvent::ListStarted), now);
        assert!(w.apply(ev(KubeEvent::Listed(obj("a", "m1", 1))), now), "an object of the first page is news");
        assert!(w.apply(ev(KubeEvent::Listed(obj("a", "m2", 1))), now));
        assert_eq!(w.kube()[&mappings()].objects.len(), 2);
        assert_eq!(w.take_changes().kube[&mappings()].as_ref().map(BTreeSet::len), Some(2), "object by object");
        assert!(!w.kube()[&mappings()].listed);
        assert!(matches!(w.readiness(now, fixed), Readiness::Waiting { kube_pending: 1, .. }), "still not listed");
        // The list fails part way and starts again; m2 went meanwhile.
        w.apply(ev(KubeEvent::Failed(WatchFailure::transient("connection reset"))), now);
        w.apply(ev(KubeEvent::ListStarted), now);
        assert!(!w.apply(ev(KubeEvent::Listed(obj("a", "m1", 1))), now), "the same object again is no news");
        assert!(w.apply(ev(KubeEvent::ListDone), now), "m2 is gone");
        assert_eq!(w.kube()[&mappings()].objects.keys().map(|id| id.name.as_str()).collect::<Vec<_>>(), ["m1"]);
        assert_eq!(w.readiness(now, fixed), Readiness::Ready);
        w.take_changes();
        // Once listed, a list (after 410 Gone) is taken whole again.
        w.apply(ev(KubeEvent::ListStarted), now);
        assert!(!w.apply(ev(KubeEvent::Listed(obj("a", "m3", 1))), now), "held until the list is done");
        assert_eq!(w.kube()[&mappings()].objects.len(), 1);
        assert!(w.apply(ev(KubeEvent::ListDone), now));
        assert_eq!(w.kube()[&mappings()].objects.keys().map(|id| id.name.as_str()).collect::<Vec<_>>(), ["m3"]);
        // Any other key's first list is taken whole.
        let mut w = World::new(TIMEOUT);
        w.track(&mappings().into(), now);
        w.apply(ev(KubeEvent::ListStarted), now);
        assert!(!w.apply(ev(KubeEvent::Listed(obj("a", "m1", 1))), now));
        assert!(w.kube()[&mappings()].objects.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn identical_answers_are_not_changes_and_errors_keep_endpoints() {
        let now = Instant::now();
        let mut w = World::new(TIMEOUT);
        w.track(&consul("a").into(), now);
        let answer =
            |i| Event::Consul(consul("a"), ConsulEvent::Answer { index: i, endpoints: vec![ep("10.0.0.1")].into() });
        assert!(w.apply(answer(5), now));
        w.take_changes();
        assert!(!w.apply(answer(6), now), "a new index with the same content is not a change");
        assert!(w.take_changes().is_empty());
        assert_eq!(w.consul()[&consul("a")].index, Some(5), "the index of the answer that brought them");
        assert!(w.apply(Event::Consul(consul("a"), ConsulEvent::Failed("500 No cluster leader".into())), now));
        assert_eq!(w.consul()[&consul("a")].endpoints[..], [ep("10.0.0.1")], "errors keep the last endpoints");
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

    /// A Mapping of `service`.
    fn mapping(name: &str, service: &str) -> KubeObject {
        KubeObject::from_value(json!({"apiVersion": "getambassador.io/v3alpha1", "kind": "Mapping",
            "metadata": {"namespace": "a", "name": name}, "spec": {"prefix": "/", "service": service}}))
        .unwrap()
    }

    fn list(w: &mut World, key: &KubeKey, objects: impl IntoIterator<Item = KubeObject>, now: Instant) -> bool {
        let events = std::iter::once(KubeEvent::ListStarted)
            .chain(objects.into_iter().map(KubeEvent::Listed))
            .chain([KubeEvent::ListDone]);
        events.fold(false, |changed, ev| w.apply(Event::Kube(key.clone(), ev), now) | changed)
    }

    /// A relist (after 410 Gone, say) names what it changed, as a watch would have, rather
    /// than the whole key: the assembler reads again a few objects, not 11,000.
    #[tokio::test(start_paused = true)]
    async fn a_relist_names_only_what_it_changed() {
        let now = Instant::now();
        let mut w = World::new(TIMEOUT);
        w.track(&mappings().into(), now);
        list(&mut w, &mappings(), vec![mapping("m1", "s1"), mapping("m2", "s2"), mapping("m3", "s3")], now);
        assert_eq!(w.take_changes().kube.get(&mappings()), Some(&None), "the first list: all of it");
        // m1 as it was, m2 changed, m3 gone, m4 new.
        assert!(list(&mut w, &mappings(), vec![mapping("m1", "s1"), mapping("m2", "s9"), mapping("m4", "s4")], now));
        let named = w.take_changes().kube[&mappings()].clone().expect("objects, not the whole key");
        assert_eq!(named.iter().map(|id| id.name.as_str()).collect::<Vec<_>>(), ["m2", "m3", "m4"]);
        let store = &w.kube()[&mappings()];
        assert_eq!(store.objects.keys().map(|id| id.name.as_str()).collect::<Vec<_>>(), ["m1", "m2", "m4"]);
        let m2 = store.objects.values().nth(1).unwrap();
        assert!(
            matches!(&m2.decoded, crate::model::Decoded::Mapping(m) if m.as_ref().as_ref().is_ok_and(|m| m.service == "s9")),
            "{m2:?}"
        );
        // A relist that brings everything as it was changes nothing.
        assert!(!list(&mut w, &mappings(), vec![mapping("m1", "s1"), mapping("m2", "s9"), mapping("m4", "s4")], now));
        assert!(w.take_changes().is_empty());
    }

    /// A resolver's status is not what the assembler reads of it, but its controller reads
    /// the JSON: a relist keeps the JSON it brought even when nothing read changed.
    #[tokio::test(start_paused = true)]
    async fn a_relist_keeps_a_resolvers_current_json() {
        let now = Instant::now();
        let resolvers = KubeKey::new(consul_resolver_api::resolver::GROUP, "", consul_resolver_api::resolver::KIND);
        let resolver = |phase: &str| {
            KubeObject::from_value(json!({"metadata": {"namespace": "a", "name": "r", "generation": 1},
                "spec": {"address": "http://127.0.0.1:8500"}, "status": {"phase": phase}}))
            .unwrap()
        };
        let mut w = World::new(TIMEOUT);
        w.track(&resolvers.clone().into(), now);
        list(&mut w, &resolvers, vec![resolver("Pending")], now);
        w.take_changes();
        assert!(!list(&mut w, &resolvers, vec![resolver("Ready")], now), "the spec is the same");
        let raw = w.kube()[&resolvers].objects.values().next().unwrap().raw.clone().unwrap();
        assert_eq!(raw["status"]["phase"], "Ready");
    }

    /// While a relist comes, what it brings unchanged is held by its id, not as a second
    /// copy of the store.
    #[tokio::test(start_paused = true)]
    async fn a_relist_holds_no_second_copy_of_the_store() {
        let now = Instant::now();
        // Made one at a time as the list comes, so that what is measured is the world's.
        let objects = || (0..2_000).map(|i| mapping(&format!("mapping-{i}"), &format!("service-{i}")));
        let mut w = World::new(TIMEOUT);
        w.track(&mappings().into(), now);
        let before = heap_peak::live_heap();
        list(&mut w, &mappings(), objects(), now);
        let store = (heap_peak::live_heap() - before) as usize;
        let (_, peak) = heap_peak::peak_heap(|| list(&mut w, &mappings(), objects(), now));
        assert!(peak < store / 3, "a relist of {store} bytes of Mappings held {peak} more at its peak");
    }

    #[tokio::test(start_paused = true)]
    async fn changes_name_the_objects_or_the_whole_key() {
        let now = Instant::now();
        let mut w = World::new(TIMEOUT);
        w.track(&mappings().into(), now);
        w.track(&consul("a").into(), now);
        let tracked = w.take_changes();
        assert_eq!(tracked.kube.get(&mappings()), Some(&None), "a new key: all of it");
        assert!(tracked.consul.contains(&consul("a")));
        for ev in [KubeEvent::ListStarted, KubeEvent::Listed(obj("a", "m1", 1)), KubeEvent::ListDone] {
            w.apply(Event::Kube(mappings(), ev), now);
        }
        assert_eq!(w.take_changes().kube.get(&mappings()), Some(&None), "a list: all of it");
        w.apply(Event::Kube(mappings(), KubeEvent::Applied(obj("a", "m2", 1))), now);
        w.apply(Event::Kube(mappings(), KubeEvent::Deleted(obj("a", "m1", 1).id)), now);
        let ids = w.take_changes().kube[&mappings()].clone().unwrap();
        let names: Vec<_> = ids.iter().map(|id| id.name.as_str()).collect();
        assert_eq!(names, ["m1", "m2"]);
        assert!(w.take_changes().is_empty(), "taken");
    }

    #[tokio::test(start_paused = true)]
    async fn events_for_stopped_watches_are_ignored() {
        let now = Instant::now();
        let mut w = World::new(TIMEOUT);
        w.track(&consul("a").into(), now);
        w.untrack(&consul("a").into());
        assert!(!w.apply(Event::Consul(consul("a"), ConsulEvent::Answer { index: 1, endpoints: vec![].into() }), now));
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
