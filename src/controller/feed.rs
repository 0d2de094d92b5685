//! A kube-runtime Controller's store fed from the world instead of a watch of its own: the
//! world already watches the kind, so the controllers of resolvers and of exports add no
//! list or watch. Shared by both; each keeps its own reconcile and context.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use futures::channel::mpsc;
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::reflector::store::{Store, Writer};
use kube::runtime::watcher;
use serde_json::Value;

use consul_resolver_core::world::World;

pub(crate) type Ref = ObjectRef<DynamicObject>;

/// The store and the triggers of one controller.
pub(crate) struct Feed {
    writer: Writer<DynamicObject>,
    resource: ApiResource,
    /// The objects in the store, as the world holds them, by namespace and name.
    fed: BTreeMap<(String, String), (Arc<Value>, DynamicObject)>,
    /// The store is filled (at the first publication: before it, there is nothing to say).
    ready: bool,
    objects: mpsc::UnboundedSender<Arc<DynamicObject>>,
    refs: mpsc::UnboundedSender<Ref>,
}

/// What the Controller is built from: its store, the changed objects, the extra triggers.
pub(crate) struct Streams {
    pub(crate) reader: Store<DynamicObject>,
    pub(crate) objects: mpsc::UnboundedReceiver<Arc<DynamicObject>>,
    pub(crate) refs: mpsc::UnboundedReceiver<Ref>,
}

impl Feed {
    pub(crate) fn new(resource: ApiResource) -> (Feed, Streams) {
        let writer = Writer::new(resource.clone());
        let reader = writer.as_reader();
        let (objects, objects_rx) = mpsc::unbounded();
        let (refs, refs_rx) = mpsc::unbounded();
        let feed = Feed { writer, resource, fed: BTreeMap::new(), ready: false, objects, refs };
        (feed, Streams { reader, objects: objects_rx, refs: refs_rx })
    }

    pub(crate) fn resource(&self) -> &ApiResource {
        &self.resource
    }

    /// Brings the store up to date with the world's objects of `group`/`kind`, triggering a
    /// reconcile of each one that changed. Returns those that are gone.
    pub(crate) fn sync(&mut self, world: &World, group: &str, kind: &str) -> Vec<DynamicObject> {
        let mut seen = BTreeSet::new();
        for (id, stored) in world.objects_of(group, kind) {
            let Some(raw) = &stored.raw else { continue };
            let id = (id.namespace.clone().unwrap_or_default(), id.name.clone());
            seen.insert(id.clone());
            if self.fed.get(&id).is_some_and(|(v, _)| Arc::ptr_eq(v, raw) || v == raw) {
                continue;
            }
            let Ok(dynamic) = serde_json::from_value::<DynamicObject>((**raw).clone()) else { continue };
            if self.ready {
                self.writer.apply_watcher_event(&watcher::Event::Apply(dynamic.clone()));
                let _ = self.objects.unbounded_send(Arc::new(dynamic.clone()));
            }
            self.fed.insert(id, (raw.clone(), dynamic));
        }
        let gone: Vec<_> = self.fed.keys().filter(|id| !seen.contains(*id)).cloned().collect();
        let mut removed = Vec::new();
        for id in gone {
            if let Some((_, dynamic)) = self.fed.remove(&id) {
                if self.ready {
                    self.writer.apply_watcher_event(&watcher::Event::Delete(dynamic.clone()));
                }
                removed.push(dynamic);
            }
        }
        removed
    }

    /// Fills the store with what the world has listed, the first time (the first
    /// publication), and reconciles every object. Whether it was the first time.
    pub(crate) fn fill(&mut self) -> bool {
        if self.ready {
            return false;
        }
        self.writer.apply_watcher_event(&watcher::Event::Init);
        for (_, dynamic) in self.fed.values() {
            self.writer.apply_watcher_event(&watcher::Event::InitApply(dynamic.clone()));
        }
        self.writer.apply_watcher_event(&watcher::Event::InitDone);
        self.ready = true;
        self.trigger_all();
        true
    }

    /// Reconciles the object `namespace/name`.
    pub(crate) fn trigger(&self, namespace: &str, name: &str) {
        let _ = self.refs.unbounded_send(ObjectRef::new_with(name, self.resource.clone()).within(namespace));
    }

    /// Reconciles every object (once the store is filled).
    pub(crate) fn trigger_all(&self) {
        if !self.ready {
            return;
        }
        for (_, dynamic) in self.fed.values() {
            let _ = self.refs.unbounded_send(ObjectRef::from_obj_with(dynamic, self.resource.clone()));
        }
    }
}
