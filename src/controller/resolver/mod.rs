//! The ConsulResolver controller: each resolver's status and Events, written from the
//! published snapshot by a kube-runtime `Controller`, one resolver at a time.
//!
//! The snapshot and the watch set come from one reading of the whole world (the pipeline);
//! what this controller adds is per-resolver delivery: each resolver is reconciled on its
//! own, so one resolver's failing status write (a conflict, a webhook, a deleted object)
//! retries with its own backoff and never fails the ConfigMap or another resolver's status.
//! Each reconcile compares the status the snapshot implies with the live object's, so a
//! status edited or wiped with kubectl is repaired, and statuses are written only while
//! this replica leads, each write bounded by the leadership deadline.
//!
//! No second list or watch: the Controller's store is fed from the world, which already
//! watches ConsulResolvers (the runtime calls [`ResolverController::sync`] after each
//! batch of events). Reconciles are triggered when a resolver object changes, after each
//! publication for the resolvers whose part of the snapshot changed (`reconcile_on`), on
//! gaining leadership, and every `--resync-period`.

pub(crate) mod events;
pub(crate) mod metrics;
pub(crate) mod status;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::api::{ApiResource, DynamicObject, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use tokio::sync::watch;

use super::feed::{Backoff, Feed, Ref, Running};
use crate::kube_client::{FIELD_MANAGER, error_reason, status_code};
use crate::leadership::Leadership;
use crate::vitals::Vitals;
use consul_resolver_api::resolver::ConsulResolver;
use consul_resolver_api::resolver::{GROUP, KIND};
use consul_resolver_api::status::ConsulResolverStatus;
use consul_resolver_core::assembler::Snapshot;
use consul_resolver_core::assembler::snapshot::{Part, ResolverEntry};
use consul_resolver_core::world::World;
use events::Events;
use metrics::ControllerMetrics;

/// Reconciles running at once: enough to catch up quickly after gaining leadership, few
/// enough not to flood the API server with status writes.
const CONCURRENCY: u16 = 8;

/// Why a reconcile failed; the resolver is retried with its own backoff.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReconcileError {
    #[error("leadership lapsed while writing the status of {0}")]
    LeadershipLapsed(String),
    #[error("writing the status of {0}: {1}")]
    Write(String, #[source] kube::Error),
}

impl ReconcileError {
    fn reason(&self) -> &'static str {
        match self {
            ReconcileError::LeadershipLapsed(_) => "leadership_lapsed",
            ReconcileError::Write(_, e) => error_reason(e),
        }
    }
}

/// The resolvers' part of the latest snapshot: all a reconcile reads, kept without the
/// rest of the snapshot (at scale, Mappings are most of it). The entries are shared with
/// the snapshot, not copied.
struct Published {
    snapshot_id: u64,
    resolvers: BTreeMap<(String, String), Part<ResolverEntry>>,
}

impl Published {
    fn of(snapshot: &Snapshot) -> Published {
        let resolvers =
            snapshot.content.resolvers.iter().map(|r| ((r.namespace.clone(), r.name.clone()), r.clone())).collect();
        Published { snapshot_id: snapshot.id, resolvers }
    }

    fn resolver(&self, namespace: &str, name: &str) -> Option<&ResolverEntry> {
        self.resolvers.get(&(namespace.to_owned(), name.to_owned())).map(|r| &**r)
    }
}

/// Our last status write to a resolver, until the watch brings it back: a reconcile in
/// between compares with (and writes on top of) what we wrote, not the older object.
struct Written {
    before: Option<String>,
    after: Option<String>,
    status: ConsulResolverStatus,
}

struct Context {
    client: kube::Client,
    resource: ApiResource,
    leadership: Leadership,
    latest: watch::Receiver<Option<Arc<Published>>>,
    events: Events,
    metrics: ControllerMetrics,
    resync: Duration,
    backoff: Backoff,
    written: Mutex<HashMap<Ref, Written>>,
}

impl Context {
    /// The live status and resourceVersion of `obj`, counting our own write the store has
    /// not seen yet.
    fn live(&self, obj: &DynamicObject, at: &Ref) -> (Option<ConsulResolverStatus>, Option<String>) {
        let rv = obj.resource_version();
        if let Some(w) = self.written.lock().expect("written lock").get(at)
            && w.before == rv
        {
            return (Some(w.status.clone()), w.after.clone());
        }
        // A status that does not parse (edited by hand) is treated as absent: rewritten.
        let status = obj.data.get("status").cloned().and_then(|s| serde_json::from_value(s).ok());
        (status, rv)
    }
}

async fn reconcile(obj: Arc<DynamicObject>, ctx: Arc<Context>) -> Result<Action, ReconcileError> {
    let started = std::time::Instant::now();
    let at = ObjectRef::from_obj_with(&*obj, ctx.resource.clone());
    let result = reconcile_status(&obj, &at, &ctx).await;
    ctx.metrics.reconcile_seconds.observe(started.elapsed().as_secs_f64());
    match &result {
        Ok(_) => {
            ctx.metrics.reconciles.with_label_values(&["success"]).inc();
            ctx.backoff.forget(&at);
        }
        Err(e) => {
            ctx.metrics.reconciles.with_label_values(&["error"]).inc();
            ctx.metrics.reconcile_errors.with_label_values(&[e.reason()]).inc();
        }
    }
    result
}

async fn reconcile_status(obj: &DynamicObject, at: &Ref, ctx: &Context) -> Result<Action, ReconcileError> {
    // Followers write nothing; gaining leadership triggers every resolver again.
    let Some(until) = ctx.leadership.until() else { return Ok(Action::await_change()) };
    let published = ctx.latest.borrow().clone();
    let (namespace, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
    // Not in a snapshot yet, or not ours (another Ambassador ID): nothing to say.
    let Some((published, entry)) = published.as_ref().and_then(|p| Some((p, p.resolver(&namespace, &name)?))) else {
        return Ok(Action::await_change());
    };
    ctx.events.report(obj, entry, until).await;

    let (live, rv) = ctx.live(obj, at);
    let now = k8s_openapi::jiff::Timestamp::now();
    let desired = status::status_for(entry, published.snapshot_id, now, live.as_ref());
    if live.as_ref().is_some_and(|l| status::same_apart_from_snapshot(l, &desired)) {
        return Ok(Action::requeue(ctx.resync));
    }
    // Conditional on the version we compared with: a status written meanwhile (by another
    // replica that believed it led, or by a user) is a conflict, retried with the new one.
    let patch = serde_json::json!({
        "apiVersion": <ConsulResolver as kube::Resource>::api_version(&()),
        "kind": KIND,
        "metadata": {"name": name, "resourceVersion": rv},
        "status": desired,
    });
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), &namespace, &ctx.resource);
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let shown = format!("ConsulResolver {namespace}/{name}");
    match tokio::time::timeout_at(until, api.patch_status(&name, &params, &Patch::Apply(&patch))).await {
        Err(_) => Err(ReconcileError::LeadershipLapsed(shown)),
        // Deleted meanwhile: nothing to write.
        Ok(Err(e)) if status_code(&e) == Some(404) => Ok(Action::await_change()),
        Ok(Err(e)) => {
            ctx.written.lock().expect("written lock").remove(at);
            Err(ReconcileError::Write(shown, e))
        }
        Ok(Ok(updated)) => {
            tracing::debug!(resolver = %format!("{namespace}/{name}"), snapshot = published.snapshot_id, "status written");
            let w = Written { before: rv, after: updated.resource_version(), status: desired };
            ctx.written.lock().expect("written lock").insert(at.clone(), w);
            Ok(Action::requeue(ctx.resync))
        }
    }
}

fn error_policy(obj: Arc<DynamicObject>, error: &ReconcileError, ctx: Arc<Context>) -> Action {
    let delay = ctx.backoff.failed(ObjectRef::from_obj_with(&*obj, ctx.resource.clone()));
    tracing::warn!(error = %error, retry_in = ?delay, "resolver reconcile failed");
    Action::requeue(delay)
}

/// The running controller, and the store it reads, fed from the world.
pub(crate) struct ResolverController {
    feed: Feed,
    latest: watch::Sender<Option<Arc<Published>>>,
    ctx: Arc<Context>,
    running: Running,
}

impl ResolverController {
    /// Starts the controller; statuses are written every `resync` at the latest.
    pub(crate) fn spawn(
        client: kube::Client,
        leadership: Leadership,
        identity: String,
        metrics: ControllerMetrics,
        resync: Duration,
        vitals: &Arc<Vitals>,
    ) -> ResolverController {
        let resource = ApiResource::erase::<ConsulResolver>(&());
        let (feed, streams) = Feed::new(resource.clone());
        let (latest, latest_rx) = watch::channel(None);
        let ctx = Arc::new(Context {
            events: Events::new(client.clone(), FIELD_MANAGER, identity, metrics.clone()),
            client,
            resource,
            leadership,
            latest: latest_rx,
            metrics,
            resync,
            backoff: Backoff::default(),
            written: Mutex::default(),
        });
        let running = streams.run(CONCURRENCY, reconcile, error_policy, ctx.clone(), "status controller", vitals);
        ResolverController { feed, latest, ctx, running }
    }

    /// Brings the store up to date with the world's resolvers, triggering a reconcile of
    /// each one that changed (a spec edit, a status wiped by hand).
    pub(crate) fn sync(&mut self, world: &World) {
        for gone in self.feed.sync(world, GROUP, KIND) {
            let at = ObjectRef::from_obj_with(&gone, self.feed.resource().clone());
            self.ctx.written.lock().expect("written lock").remove(&at);
            self.ctx.backoff.forget(&at);
        }
    }

    /// `snapshot` was published: reconcile the resolvers whose part of it changed.
    pub(crate) fn published(&mut self, snapshot: &Snapshot) {
        let previous = self.latest.send_replace(Some(Arc::new(Published::of(snapshot))));
        if self.feed.fill() {
            return; // The first snapshot: every resolver is reconciled.
        }
        for entry in &snapshot.content.resolvers {
            let before = previous.as_ref().and_then(|p| p.resolver(&entry.namespace, &entry.name));
            if before != Some(entry) {
                self.feed.trigger(&entry.namespace, &entry.name);
            }
        }
    }

    /// This replica just became leader: whatever it believed was written may have been
    /// overwritten since, so every resolver is reconciled again.
    pub(crate) fn leading(&mut self) {
        self.ctx.events.forget();
        self.ctx.written.lock().expect("written lock").clear();
        self.feed.trigger_all();
    }

    /// Lets the reconciles in flight finish (each is bounded by the leadership deadline)
    /// for at most `within` (the shutdown's budget for them), starts no other, then stops.
    /// Status writes still in flight then are cut off, with a log line: the next leader
    /// reconciles every resolver at its takeover, so nothing is lost but time, and the
    /// Lease release that follows is what lets it take over at once.
    pub(crate) async fn shutdown(self, within: Duration) {
        if self.running.shutdown(within).await {
            tracing::warn!(
                "shutdown: status writes in flight cut off at the end of their share of --shutdown-timeout (the next \
                 leader writes every resolver's status again)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::{content, resolver_entry, serve};
    use consul_resolver_core::keys::{KubeKey, WatchKey};
    use consul_resolver_core::model::KubeObject;
    use consul_resolver_core::model::{Event as WorldEvent, KubeEvent};
    use serde_json::{Value, json};

    fn resolvers() -> KubeKey {
        KubeKey::new(GROUP, "v1alpha1", KIND)
    }

    fn resolver(rv: &str, status: Value) -> KubeObject {
        KubeObject::from_value(json!({"apiVersion": "consulresolver.io/v1alpha1", "kind": "ConsulResolver",
            "metadata": {"namespace": "shop", "name": "consul", "uid": "u-1", "resourceVersion": rv, "generation": 3},
            "spec": {"address": "127.0.0.1:8500"}, "status": status}))
        .unwrap()
    }

    fn world_with(obj: KubeObject) -> World {
        let mut w = World::new(Duration::from_secs(30));
        let now = tokio::time::Instant::now();
        w.track(&WatchKey::Kube(resolvers()), now);
        for e in [KubeEvent::ListStarted, KubeEvent::Listed(obj), KubeEvent::ListDone] {
            w.apply(WorldEvent::Kube(resolvers(), e), now);
        }
        w
    }

    /// Status patches the fake API server received: (resourceVersion sent, status).
    type Patches = Arc<Mutex<Vec<(Value, Value)>>>;

    async fn wait_until(what: &str, cond: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn statuses_are_written_conditionally_repaired_and_retried_only_while_leading() {
        let patches: Patches = Arc::default();
        let conflicts = Arc::new(Mutex::new(0u32));
        let (seen, conflict) = (patches.clone(), conflicts.clone());
        let api = serve(Arc::new(move |method: &str, path: &str, body: &[u8]| {
            if method != "PATCH" || !path.ends_with("/status") {
                return (405, json!({}));
            }
            let body: Value = serde_json::from_slice(body).unwrap();
            let mut pending = conflict.lock().unwrap();
            if *pending > 0 {
                *pending -= 1;
                return (
                    409,
                    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "reason": "Conflict", "code": 409, "message": "the object has been modified"}),
                );
            }
            let mut seen = seen.lock().unwrap();
            seen.push((body["metadata"]["resourceVersion"].clone(), body["status"].clone()));
            let rv = format!("w{}", seen.len());
            (
                200,
                json!({"apiVersion": "consulresolver.io/v1alpha1", "kind": "ConsulResolver",
                "metadata": {"namespace": "shop", "name": "consul", "resourceVersion": rv}, "status": body["status"]}),
            )
        }))
        .await;
        let (lead, leadership) = Leadership::manual();
        let metrics = ControllerMetrics::unregistered();
        let mut c = ResolverController::spawn(
            api.client.clone(),
            leadership,
            "test".into(),
            metrics.clone(),
            Duration::from_secs(3600),
            &Vitals::new(tokio_util::sync::CancellationToken::new()),
        );
        let snapshot = |id| Arc::new(content(vec![resolver_entry("shop", "consul")]).into_snapshot(id));

        let reconciled = || metrics.reconciles.with_label_values(&["success"]).get();
        let written = || patches.lock().unwrap().len();

        // A follower reconciles but writes nothing.
        c.sync(&world_with(resolver("1", json!(null))));
        c.published(&snapshot(1));
        wait_until("the first reconcile", || reconciled() == 1).await;
        assert_eq!(written(), 0, "written without leading");

        // Leading: the status is written, conditional on the version it was computed from.
        lead.send_replace(Some(tokio::time::Instant::now() + Duration::from_secs(3600)));
        c.leading();
        wait_until("a status patch", || written() == 1).await;
        let (rv, status) = patches.lock().unwrap()[0].clone();
        assert_eq!(rv, "1");
        assert_eq!(status["observedGeneration"], 3);
        assert_eq!(status["conditions"][0]["type"], "Ready");

        // The watch brings our write back; a new snapshot with the same content, and the
        // object changing, reconcile it again: nothing to write.
        wait_until("the write's reconcile to finish", || reconciled() == 2).await;
        c.published(&snapshot(2));
        c.sync(&world_with(resolver("w1", status.clone())));
        wait_until("a reconcile of the unchanged status", || reconciled() == 3).await;
        assert_eq!(written(), 1, "an unchanged status is not written again");

        // Someone wipes the status (the watch brings it back empty, at a new version):
        // repaired, on top of that version. The first attempt conflicts and is retried.
        *conflicts.lock().unwrap() = 1;
        c.sync(&world_with(resolver("5", json!(null))));
        wait_until("the repair", || written() == 2).await;
        let (rv, status) = patches.lock().unwrap()[1].clone();
        assert_eq!(rv, "5");
        assert_eq!(status["lastSnapshot"]["id"], 2, "the snapshot it is written from");
        assert_eq!(metrics.reconcile_errors.with_label_values(&["conflict"]).get(), 1);
        assert!(metrics.reconciles.with_label_values(&["success"]).get() >= 2);
        c.shutdown(Duration::from_secs(5)).await;
    }
}
