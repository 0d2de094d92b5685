//! The Kubernetes source: one kube-runtime watcher per key (kind + namespace +
//! selectors), with backoff, translated into the core's list/apply/delete events.
//!
//! Objects are handled as JSON ([`wire::WireObject`]): the core has no Kubernetes types, and
//! the same code serves our CRD, Ambassador's kinds, Secrets, EndpointSlices and any kind
//! given with `--watch`. The version is the one the API server prefers unless the key
//! pins one; it is found by discovery, so older API servers work too.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::discovery::{self, ApiCapabilities, ApiGroup, ApiResource, Scope};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::time::Instant;

use super::EventSink;
use super::metrics::SourceMetrics;
use consul_resolver_core::keys::KubeKey;
use consul_resolver_core::model::{Event, KubeEvent, WatchFailure};
use wire::WireObject;

mod wire;

/// Cloning shares the client, metrics and discovery cache.
#[derive(Clone)]
pub(crate) struct KubeSource {
    client: Client,
    metrics: SourceMetrics,
    discovered: Discovered,
}

impl KubeSource {
    /// `discovered`: what discovery found so far (the start-up's checks of the kinds it
    /// watches included), shared by every watch.
    pub(crate) fn new(client: Client, metrics: SourceMetrics, discovered: Discovered) -> Self {
        KubeSource { client, metrics, discovered }
    }
}

/// How long a group's discovery is reused. Thousands of watches of one kind (a Service's
/// endpoints each) then cost one discovery request, not one each; a CRD whose served
/// versions change is seen within this, or at once by a watch the API server refuses (the
/// entry is dropped when a watch of its kind fails).
const DISCOVERY_TTL: Duration = Duration::from_secs(300);

/// A group as keys name it: the group and the version (empty: the preferred one).
type GroupId = (String, String);

/// What discovery found for a group (at that version, or every version served), and when.
type Found = (Instant, Arc<ApiGroup>);

/// What discovery found, per group as keys name it, shared by every watch of the source.
/// Kinds of one group share its discovery: a start-up asks once for `getambassador.io`,
/// not once for Mappings and again for TCPMappings, and once for our group's two kinds.
/// Each group's entry is held across its discovery, so that watches of one kind starting
/// together (a cold start's hundreds) wait for the first one's answer instead of each
/// asking; other groups are not held up (each request has the client's deadline).
#[derive(Clone, Default)]
pub(crate) struct Discovered(Arc<std::sync::Mutex<HashMap<GroupId, Slot>>>);

/// One group's discovery: empty until found, locked while asked.
type Slot = Arc<tokio::sync::Mutex<Option<Found>>>;

impl Discovered {
    fn id(key: &KubeKey) -> GroupId {
        (key.group.clone(), key.version.clone())
    }

    fn entry(&self, key: &KubeKey) -> Slot {
        self.0.lock().expect("discovery cache").entry(Self::id(key)).or_default().clone()
    }

    /// The resource of `key`'s kind: from its group's discovery while fresh, else found by
    /// asking again. A kind the group lacked is asked for again (its CRD may be new).
    pub(crate) async fn resolve(
        &self,
        client: &Client,
        key: &KubeKey,
    ) -> Result<(ApiResource, ApiCapabilities), String> {
        let entry = self.entry(key);
        let mut found = entry.lock().await;
        if let Some((at, group)) = found.as_ref()
            && at.elapsed() < DISCOVERY_TTL
            && let Some(kind) = group.recommended_kind(&key.kind)
        {
            return Ok(kind);
        }
        let group = Arc::new(discover(client, key).await?);
        *found = Some((Instant::now(), group.clone()));
        group
            .recommended_kind(&key.kind)
            .ok_or_else(|| format!("the API server does not serve kind {} in group {:?}", key.kind, key.group))
    }

    /// Forgets `key`'s group: a watch of it was refused, maybe for a version no longer
    /// served.
    fn forget(&self, key: &KubeKey) {
        self.0.lock().expect("discovery cache").remove(&Self::id(key));
    }
}

impl KubeSource {
    /// The watch of `key`: runs until dropped, reporting into `events`.
    pub(crate) fn watch(&self, key: KubeKey, events: EventSink) -> impl Future<Output = ()> + Send + use<> {
        run(self.client.clone(), key, events, self.metrics.clone(), self.discovered.clone())
    }
}

/// Discovers `key`'s group: at the pinned version, or every version served (the preferred
/// one is the kind's).
async fn discover(client: &Client, key: &KubeKey) -> Result<ApiGroup, String> {
    if key.version.is_empty() {
        discovery::group(client, &key.group).await
    } else {
        let gv = kube::core::GroupVersion { group: key.group.clone(), version: key.version.clone() };
        discovery::pinned_group(client, &gv).await
    }
    .map_err(|e| format!("discovery of {key} failed: {e}"))
}

/// What a failed watch means: a status the API server gave (4xx other than 410 Gone and
/// 429 is a rejection of the request itself), or a transport failure.
fn failure(e: &watcher::Error) -> (WatchFailure, &'static str) {
    let status = match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => Some(&**s),
        watcher::Error::WatchError(s) => Some(&**s),
        _ => None,
    };
    let Some(s) = status else { return (WatchFailure::transient(e.to_string()), "transport") };
    let message = format!("the API server answered {} {}: {}", s.code, s.reason, s.message);
    let reason = match s.code {
        400 => "bad_request",
        401 => "unauthorized",
        403 => "forbidden",
        404 => "not_found",
        410 => "gone",
        429 => "throttled",
        c if c >= 500 => "server_error",
        _ => "rejected",
    };
    let rejected = (400..500).contains(&s.code) && s.code != 410 && s.code != 429;
    (WatchFailure { message, rejected }, reason)
}

async fn run(client: Client, key: KubeKey, events: EventSink, metrics: SourceMetrics, discovered: Discovered) {
    let send = |ev: KubeEvent| {
        let events = events.clone();
        let key = key.clone();
        async move { events.send(Event::Kube(key, ev)).await.is_ok() }
    };
    // Discovery can fail while a CRD is being installed: retry, reporting the error.
    let mut delay = Duration::from_millis(250);
    let (resource, caps) = loop {
        match discovered.resolve(&client, &key).await {
            Ok(found) => break found,
            Err(e) => {
                tracing::warn!(watch = %key, error = %e, "cannot watch yet; retrying");
                metrics.watch_errors.with_label_values(&["kubernetes", "discovery"]).inc();
                if !send(KubeEvent::Failed(WatchFailure::transient(e))).await {
                    return;
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(30));
            }
        }
    };
    let api: Api<WireObject> = match (&caps.scope, &key.namespace) {
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
    // Every list after the first is a restart: after an error (its reason), or when the
    // API server expired the watch's resourceVersion (410 Gone, also an error here).
    let mut listed_before = false;
    let mut last_error: Option<&'static str> = None;
    while let Some(item) = stream.next().await {
        let ev = match item {
            Ok(watcher::Event::Init) => {
                if listed_before {
                    let reason = last_error.take().unwrap_or("relist");
                    metrics.watch_restarts.with_label_values(&["kubernetes", reason]).inc();
                }
                listed_before = true;
                KubeEvent::ListStarted
            }
            Ok(watcher::Event::InitApply(o)) => match o.into_object() {
                Some(o) => KubeEvent::Listed(o),
                None => continue,
            },
            Ok(watcher::Event::InitDone) => KubeEvent::ListDone,
            Ok(watcher::Event::Apply(o)) => match o.into_object() {
                Some(o) => KubeEvent::Applied(o),
                None => continue,
            },
            Ok(watcher::Event::Delete(o)) => KubeEvent::Deleted(o.id()),
            Err(e) => {
                let (failure, reason) = failure(&e);
                tracing::warn!(watch = %key, error = %failure.message, rejected = failure.rejected, "watch error; retrying with backoff");
                metrics.watch_errors.with_label_values(&["kubernetes", reason]).inc();
                if reason == "not_found" {
                    discovered.forget(&key);
                }
                last_error = Some(reason);
                KubeEvent::Failed(failure)
            }
        };
        if !send(ev).await {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::serve;
    use kube::core::Status;

    /// Watches of one kind share its discovery: one request for any number of them, again
    /// only once a watch of it was refused (or the entry aged).
    #[tokio::test]
    async fn one_discovery_per_kind_whatever_the_number_of_watches() {
        let api = serve(Arc::new(|_: &str, path: &str, _: &[u8]| match path {
            "/api/v1" => (
                200,
                serde_json::json!({"kind": "APIResourceList", "groupVersion": "v1", "resources": [
                    {"name": "endpoints", "singularName": "", "namespaced": true, "kind": "Endpoints",
                     "verbs": ["list", "watch"]}]}),
            ),
            _ => crate::test_fixtures::not_found(path),
        }))
        .await;
        let discovered = Discovered::default();
        for name in ["a", "b", "c"] {
            let key =
                KubeKey::new("", "v1", "Endpoints").in_namespace("shop").with_fields(format!("metadata.name={name}"));
            let (resource, caps) = discovered.resolve(&api.client, &key).await.unwrap();
            assert_eq!((resource.plural.as_str(), caps.scope.clone()), ("endpoints", Scope::Namespaced));
        }
        assert_eq!(api.take(), ["GET v1"], "three watches, one discovery");
        let key = KubeKey::new("", "v1", "Endpoints").in_namespace("shop");
        discovered.forget(&key);
        discovered.resolve(&api.client, &key).await.unwrap();
        assert_eq!(api.take(), ["GET v1"], "forgotten after a refused watch: discovered again");
    }

    /// Kinds of one group share its discovery: Mapping and TCPMapping (preferred version)
    /// cost the group list and the group's version once; a kind the group lacked is asked
    /// for again, in case its CRD came since.
    #[tokio::test]
    async fn kinds_of_one_group_share_its_discovery() {
        let api = serve(Arc::new(|_: &str, path: &str, _: &[u8]| match path {
            "/apis" => (
                200,
                serde_json::json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                    {"name": "getambassador.io", "versions": [{"groupVersion": "getambassador.io/v3alpha1", "version": "v3alpha1"}],
                     "preferredVersion": {"groupVersion": "getambassador.io/v3alpha1", "version": "v3alpha1"}}]}),
            ),
            "/apis/getambassador.io/v3alpha1" => (
                200,
                serde_json::json!({"kind": "APIResourceList", "groupVersion": "getambassador.io/v3alpha1", "resources": [
                    {"name": "mappings", "singularName": "mapping", "namespaced": true, "kind": "Mapping",
                     "verbs": ["list", "watch"]},
                    {"name": "tcpmappings", "singularName": "tcpmapping", "namespaced": true, "kind": "TCPMapping",
                     "verbs": ["list", "watch"]}]}),
            ),
            _ => crate::test_fixtures::not_found(path),
        }))
        .await;
        let discovered = Discovered::default();
        for kind in ["Mapping", "TCPMapping", "Mapping"] {
            let (resource, _) =
                discovered.resolve(&api.client, &KubeKey::new("getambassador.io", "", kind)).await.unwrap();
            assert_eq!((resource.kind.as_str(), resource.version.as_str()), (kind, "v3alpha1"));
        }
        assert_eq!(api.take(), ["GET apis", "GET v3alpha1"], "two kinds, one discovery");
        let missing = discovered.resolve(&api.client, &KubeKey::new("getambassador.io", "", "Host")).await;
        assert!(missing.unwrap_err().contains("does not serve kind Host"));
        assert_eq!(api.take(), ["GET apis", "GET v3alpha1"], "a kind the group lacked: asked again");
    }

    fn status(code: u16, reason: &str) -> Box<Status> {
        Box::new(Status::failure("secrets is forbidden", reason).with_code(code))
    }

    #[test]
    fn four_hundreds_are_rejections_but_gone_and_throttling_are_not() {
        let list = |code, reason| failure(&watcher::Error::InitialListFailed(kube::Error::Api(status(code, reason))));
        let (f, reason) = list(403, "Forbidden");
        assert!(f.rejected);
        assert_eq!(reason, "forbidden");
        assert_eq!(f.message, "the API server answered 403 Forbidden: secrets is forbidden");
        assert!(list(400, "BadRequest").0.rejected);
        assert!(!list(429, "TooManyRequests").0.rejected);
        assert!(!list(500, "InternalError").0.rejected);
        let gone = failure(&watcher::Error::WatchError(status(410, "Gone")));
        assert_eq!((gone.0.rejected, gone.1), (false, "gone"));
        let (f, reason) = failure(&watcher::Error::NoResourceVersion);
        assert_eq!((f.rejected, reason), (false, "transport"));
    }
}
