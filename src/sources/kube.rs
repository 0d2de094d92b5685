//! The Kubernetes source: one kube-runtime watcher per key (kind + namespace +
//! selectors), with backoff, translated into the core's list/apply/delete events.
//!
//! Objects are handled as JSON (`DynamicObject`): the core has no Kubernetes types, and
//! the same code serves our CRD, Ambassador's kinds, Secrets, EndpointSlices and any kind
//! given with `--watch`. The version is the one the API server prefers unless the key
//! pins one; it is found by discovery, so older API servers work too.

use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use kube::api::DynamicObject;
use kube::discovery::{self, ApiCapabilities, ApiResource, Scope};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};

use super::{EventSink, Source};
use crate::core::aggregator::{Event, KubeEvent};
use crate::core::keys::{KubeKey, WatchKey};
use crate::core::model::{KubeObject, ObjectId};

pub struct KubeSource {
    client: Client,
}

impl KubeSource {
    pub fn new(client: Client) -> Self {
        KubeSource { client }
    }
}

impl Source for KubeSource {
    fn name(&self) -> &'static str {
        "kubernetes"
    }

    fn accepts(&self, key: &WatchKey) -> bool {
        matches!(key, WatchKey::Kube(_))
    }

    fn watch(&self, key: WatchKey, events: EventSink) -> BoxFuture<'static, ()> {
        let WatchKey::Kube(key) = key else {
            return futures::future::ready(()).boxed();
        };
        run(self.client.clone(), key, events).boxed()
    }
}

/// Finds the API resource for a key: the pinned version, or the preferred one.
pub async fn resolve(client: &Client, key: &KubeKey) -> Result<(ApiResource, ApiCapabilities), String> {
    let group = if key.version.is_empty() {
        discovery::group(client, &key.group).await
    } else {
        let gv = kube::core::GroupVersion { group: key.group.clone(), version: key.version.clone() };
        discovery::pinned_group(client, &gv).await
    }
    .map_err(|e| format!("discovery of {key} failed: {e}"))?;
    group
        .recommended_kind(&key.kind)
        .ok_or_else(|| format!("the API server does not serve kind {} in group {:?}", key.kind, key.group))
}

async fn run(client: Client, key: KubeKey, events: EventSink) {
    let send = |ev: KubeEvent| {
        let events = events.clone();
        let key = key.clone();
        async move { events.send(Event::Kube(key, ev)).await.is_ok() }
    };
    // Discovery can fail while a CRD is being installed: retry, reporting the error.
    let mut delay = Duration::from_millis(250);
    let (resource, caps) = loop {
        match resolve(&client, &key).await {
            Ok(found) => break found,
            Err(e) => {
                tracing::warn!(watch = %key, error = %e, "cannot watch yet; retrying");
                if !send(KubeEvent::Failed(e)).await {
                    return;
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(30));
            }
        }
    };
    let api: Api<DynamicObject> = match (&caps.scope, &key.namespace) {
        (Scope::Namespaced, Some(ns)) => Api::namespaced_with(client, ns, &resource),
        _ => Api::all_with(client, &resource),
    };
    let mut config = watcher::Config::default();
    if let Some(l) = &key.label_selector {
        config = config.labels(l);
    }
    if let Some(f) = &key.field_selector {
        config = config.fields(f);
    }
    let mut stream = watcher(api, config).default_backoff().boxed();
    while let Some(item) = stream.next().await {
        let ev = match item {
            Ok(watcher::Event::Init) => KubeEvent::ListStarted,
            Ok(watcher::Event::InitApply(o)) => match to_object(o) {
                Some(o) => KubeEvent::Listed(o),
                None => continue,
            },
            Ok(watcher::Event::InitDone) => KubeEvent::ListDone,
            Ok(watcher::Event::Apply(o)) => match to_object(o) {
                Some(o) => KubeEvent::Applied(o),
                None => continue,
            },
            Ok(watcher::Event::Delete(o)) => KubeEvent::Deleted(ObjectId {
                namespace: o.metadata.namespace.clone(),
                name: o.metadata.name.clone().unwrap_or_default(),
            }),
            Err(e) => {
                tracing::warn!(watch = %key, error = %e, "watch error; retrying with backoff");
                KubeEvent::Failed(e.to_string())
            }
        };
        if !send(ev).await {
            return;
        }
    }
}

fn to_object(o: DynamicObject) -> Option<KubeObject> {
    let mut value = serde_json::to_value(&o).ok()?;
    // managedFields are large and never read: keep them out of the world's memory.
    if let Some(meta) = value.get_mut("metadata").and_then(|m| m.as_object_mut()) {
        meta.remove("managedFields");
    }
    KubeObject::from_value(value)
}
