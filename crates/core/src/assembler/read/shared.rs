//! The objects of shared endpoints watches (a namespace's or the cluster's) by the Service
//! they belong to, kept from pass to pass and updated from the objects that changed. A
//! change on a shared watch then re-reads only its own Service: without this, every change
//! re-read every Service the watch serves (thousands, with the cluster's), and made each one's
//! snapshot part again.

use std::collections::{BTreeMap, BTreeSet};

use consul_resolver_api::names::NamespacedName;

use crate::assembler::kube_endpoints::EndpointsApi;
use crate::keys::KubeKey;
use crate::model::{Decoded, ObjectId, Stored};
use crate::world::{Changes, KubeStore, World};

/// One shared watch's objects by Service.
#[derive(Debug, Clone, Default)]
struct Index {
    by_service: BTreeMap<NamespacedName, BTreeSet<ObjectId>>,
    owner: BTreeMap<ObjectId, NamespacedName>,
}

impl Index {
    fn build(store: &KubeStore) -> Self {
        let mut index = Index::default();
        for id in store.objects.keys() {
            index.refresh(store, id);
        }
        index
    }

    /// Files `id` under the Service its object now belongs to (none once deleted); returns
    /// the Services it left and joined.
    fn refresh(&mut self, store: &KubeStore, id: &ObjectId) -> [Option<NamespacedName>; 2] {
        let left = self.owner.remove(id);
        if let Some(old) = &left
            && let Some(ids) = self.by_service.get_mut(old)
        {
            ids.remove(id);
            if ids.is_empty() {
                self.by_service.remove(old);
            }
        }
        let joined = store.objects.get(id).and_then(|obj| service_of(id, obj));
        if let Some(service) = &joined {
            self.owner.insert(id.clone(), service.clone());
            self.by_service.entry(service.clone()).or_default().insert(id.clone());
        }
        [left, joined]
    }
}

/// The Service an endpoints object belongs to (decoded at ingestion).
fn service_of(id: &ObjectId, obj: &Stored) -> Option<NamespacedName> {
    match (&obj.decoded, &id.namespace) {
        (Decoded::Endpoints { service, .. }, Some(ns)) => {
            Some(NamespacedName { namespace: ns.clone(), name: service.clone() })
        }
        _ => None,
    }
}

/// What changed on one endpoints watch in a pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Touched {
    /// Everything it serves (a watch of one Service, or one listed again whole).
    All,
    /// These Services' objects (a shared watch).
    Services(BTreeSet<NamespacedName>),
}

impl Touched {
    pub(super) fn has(&self, service: &NamespacedName) -> bool {
        match self {
            Touched::All => true,
            Touched::Services(s) => s.contains(service),
        }
    }
}

/// The indexes of every shared endpoints watch in the world.
#[derive(Debug, Clone, Default)]
pub(super) struct SharedIndexes {
    indexes: BTreeMap<KubeKey, Index>,
}

impl SharedIndexes {
    /// Folds in a pass's changes of endpoints watches; returns what each touched.
    pub(super) fn update(&mut self, world: &World, changes: &Changes, api: EndpointsApi) -> BTreeMap<KubeKey, Touched> {
        let mut touched = BTreeMap::new();
        for (key, ids) in changes.kube.iter().filter(|(k, _)| k.is(api.group(), api.kind())) {
            let store = world.kube().get(key);
            let what = match (api.is_shared(key), store, ids) {
                (false, ..) => Touched::All,
                (true, None, _) => {
                    self.indexes.remove(key);
                    Touched::All
                }
                (true, Some(store), Some(ids)) if self.indexes.contains_key(key) => {
                    let index = self.indexes.get_mut(key).expect("checked");
                    Touched::Services(ids.iter().flat_map(|id| index.refresh(store, id)).flatten().collect())
                }
                (true, Some(store), _) => {
                    self.indexes.insert(key.clone(), Index::build(store));
                    Touched::All
                }
            };
            touched.insert(key.clone(), what);
        }
        touched
    }

    /// The objects of `service` that shared watch `key` holds.
    pub(super) fn objects<'a>(
        &mut self,
        key: &KubeKey,
        store: &'a KubeStore,
        service: &NamespacedName,
    ) -> impl Iterator<Item = &'a Stored> + use<'a> {
        let index = self.indexes.entry(key.clone()).or_insert_with(|| Index::build(store));
        let ids: Vec<ObjectId> = index.by_service.get(service).into_iter().flatten().cloned().collect();
        ids.into_iter().filter_map(|id| store.objects.get(&id))
    }

    /// Forgets every index: they are built from the stores again when next read.
    pub(super) fn clear(&mut self) {
        self.indexes.clear();
    }
}
