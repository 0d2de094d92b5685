//! The ConsulResolver controller: each resolver's status and Events, written from its part
//! of the published snapshot, one resolver at a time, on the driver both controllers share
//! (`controller`).
//!
//! Each reconcile compares the status the snapshot implies with the live object's, so a
//! status edited or wiped with kubectl is repaired. What this controller keeps besides is
//! its own: the Warning Events already reported, and its last status write to each
//! resolver until the watch brings it back.

pub(crate) mod events;
pub(crate) mod metrics;
pub(crate) mod status;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::api::{ApiResource, DynamicObject, Patch, PatchParams};
use kube::{Api, ResourceExt};
use serde::Deserialize;

use super::feed::Ref;
use super::{Driver, Job, Next, ReconcileError, Reconciler, within};
use crate::kube_client::{FIELD_MANAGER, status_code};
use crate::leadership::Leadership;
use crate::vitals::Vitals;
use consul_resolver_api::resolver::{ConsulResolver, KIND};
use consul_resolver_api::status::ConsulResolverStatus;
use consul_resolver_core::assembler::Snapshot;
use consul_resolver_core::assembler::snapshot::{Part, ResolverEntry};
use events::Events;
use metrics::ControllerMetrics;

/// The running ConsulResolver controller.
pub(crate) type ResolverController = Driver<Resolvers>;

/// Our last status write to a resolver: a reconcile before the watch brings it back
/// compares with (and writes on top of) what we wrote, not the older object; one after
/// compares with what we wrote too, rather than reading it back out of the object.
struct Written {
    before: Option<String>,
    after: Option<String>,
    status: Arc<ConsulResolverStatus>,
}

/// What the resolver controller keeps of its own.
pub(crate) struct Resolvers {
    client: kube::Client,
    events: Events,
    metrics: ControllerMetrics,
    written: Mutex<HashMap<Ref, Written>>,
}

impl Resolvers {
    /// The live status and resourceVersion of `obj`, counting our own write the store has
    /// not seen yet. At the version our write made, the status is what we wrote, shared:
    /// every publication reconciles every resolver, and copying a status of 50 services'
    /// details out of the object and parsing it each time was about a tenth of the
    /// operator's allocations during changes at 10,000 services (heaptrack).
    fn live(&self, obj: &DynamicObject, at: &Ref) -> (Option<Arc<ConsulResolverStatus>>, Option<String>) {
        let rv = obj.resource_version();
        if let Some(w) = self.written.lock().expect("written lock").get(at) {
            if w.before == rv {
                return (Some(w.status.clone()), w.after.clone());
            }
            if rv.is_some() && w.after == rv {
                return (Some(w.status.clone()), rv);
            }
        }
        // A status that does not parse (edited by hand) is treated as absent: rewritten.
        let status = obj.data.get("status").and_then(|s| ConsulResolverStatus::deserialize(s).ok());
        (status.map(Arc::new), rv)
    }

    /// Writes `desired` as `obj`'s status, conditional on the version `rv` it was compared
    /// with: a status written meanwhile (by another replica that believed it led, or by a
    /// user) is a conflict, retried with the new one.
    async fn write(
        &self,
        obj: &DynamicObject,
        job: &Job<ResolverEntry>,
        rv: Option<String>,
        desired: ConsulResolverStatus,
        snapshot_id: u64,
    ) -> Result<Next, ReconcileError> {
        let (namespace, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
        let patch = serde_json::json!({
            "apiVersion": <ConsulResolver as kube::Resource>::api_version(&()),
            "kind": KIND,
            "metadata": {"name": name, "resourceVersion": rv},
            "status": desired,
        });
        let resource = ApiResource::erase::<ConsulResolver>(&());
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), &namespace, &resource);
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let shown = format!("the status of ConsulResolver {namespace}/{name}");
        match within(job.until, &shown, api.patch_status(&name, &params, &Patch::Apply(&patch))).await {
            // Deleted meanwhile: nothing to write.
            Err(ReconcileError::Write(_, e)) if status_code(&e) == Some(404) => Ok(Next::OnChange),
            Err(e) => {
                if matches!(e, ReconcileError::Write(..)) {
                    self.written.lock().expect("written lock").remove(&job.at);
                }
                Err(e)
            }
            Ok(updated) => {
                tracing::debug!(resolver = %format!("{namespace}/{name}"), snapshot = snapshot_id, "status written");
                let w = Written { before: rv, after: updated.resource_version(), status: Arc::new(desired) };
                self.written.lock().expect("written lock").insert(job.at.clone(), w);
                Ok(Next::Resync)
            }
        }
    }
}

impl Reconciler for Resolvers {
    type Object = ConsulResolver;
    type Entry = ResolverEntry;
    const NAME: &'static str = "status controller";
    const NOUN: &'static str = "resolver";
    /// Enough to catch up quickly after gaining leadership, few enough not to flood the
    /// API server with status writes.
    const CONCURRENCY: u16 = 8;
    const CUT_OFF: &'static str = "status writes in flight cut off at the end of their share of --shutdown-timeout \
                                   (the next leader writes every resolver's status again)";

    fn entries(snapshot: &Snapshot) -> &[Part<ResolverEntry>] {
        &snapshot.content.resolvers
    }

    fn object_of(entry: &ResolverEntry) -> (&str, &str) {
        (&entry.namespace, &entry.name)
    }

    async fn reconcile(&self, obj: &DynamicObject, job: Job<ResolverEntry>) -> Result<Next, ReconcileError> {
        let (namespace, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
        // Not in a snapshot yet, or not ours (another Ambassador ID): nothing to say.
        let Some((snapshot_id, entry)) = job.entry(&namespace, &name) else { return Ok(Next::OnChange) };
        self.events.report(obj, entry, job.until).await;
        let (live, rv) = self.live(obj, &job.at);
        let now = k8s_openapi::jiff::Timestamp::now();
        let desired = status::status_for(entry, snapshot_id, now, live.as_deref());
        if live.as_deref().is_some_and(|l| status::same_apart_from_snapshot(l, &desired)) {
            return Ok(Next::Resync);
        }
        self.write(obj, &job, rv, desired, snapshot_id).await
    }

    fn count(&self, result: Result<(), &'static str>, took: Duration) {
        let m = &self.metrics;
        m.reconcile_seconds.observe(took.as_secs_f64());
        match result {
            Ok(()) => m.reconciles.with_label_values(&["success"]).inc(),
            Err(reason) => {
                m.reconciles.with_label_values(&["error"]).inc();
                m.reconcile_errors.with_label_values(&[reason]).inc();
            }
        }
    }

    fn gone(self: &Arc<Self>, _: &DynamicObject, at: &Ref, _: &Leadership) {
        self.written.lock().expect("written lock").remove(at);
    }

    /// Still-broken resolvers are reported once more, and every status compared with the
    /// object as it is now.
    fn leading(&self) {
        self.events.forget();
        self.written.lock().expect("written lock").clear();
    }
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
        let own = Resolvers {
            events: Events::new(client.clone(), FIELD_MANAGER, identity, metrics.clone()),
            client,
            metrics,
            written: Mutex::default(),
        };
        Driver::start(own, leadership, resync, vitals)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::{content, resolver_entry, serve};
    use consul_resolver_api::resolver::GROUP;
    use consul_resolver_core::keys::{KubeKey, WatchKey};
    use consul_resolver_core::model::KubeObject;
    use consul_resolver_core::model::{Event as WorldEvent, KubeEvent};
    use consul_resolver_core::world::World;
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

    /// At the version our own write made, a resolver's status is the one we wrote, shared:
    /// neither copied nor parsed out of the object again. At any other version it is the
    /// object's.
    #[tokio::test]
    async fn our_write_brought_back_is_compared_as_written_not_parsed_again() {
        let api = serve(Arc::new(|_: &str, _: &str, _: &[u8]| (405, json!({})))).await;
        let metrics = ControllerMetrics::unregistered();
        let r = Resolvers {
            events: Events::new(api.client.clone(), FIELD_MANAGER, "test".into(), metrics.clone()),
            client: api.client.clone(),
            metrics,
            written: Mutex::default(),
        };
        let details: Vec<Value> = (0..50).map(|i| json!({"name": format!("svc-{i:02}"), "endpoints": 3})).collect();
        let status = json!({"observedGeneration": 3, "services": 50, "serviceDetails": details});
        let ours: Arc<ConsulResolverStatus> = Arc::new(serde_json::from_value(status.clone()).unwrap());
        let object = |rv: &str, status: &Value| -> DynamicObject {
            serde_json::from_value(resolver(rv, status.clone()).to_value()).unwrap()
        };
        let at = Ref::from_obj_with(&object("1", &status), ApiResource::erase::<ConsulResolver>(&()));
        let w = Written { before: Some("1".into()), after: Some("w1".into()), status: ours.clone() };
        r.written.lock().unwrap().insert(at.clone(), w);

        // Before the watch brings the write back: what we wrote, at the version it made.
        let (live, rv) = r.live(&object("1", &json!(null)), &at);
        assert!(live.is_some_and(|l| Arc::ptr_eq(&l, &ours)));
        assert_eq!(rv.as_deref(), Some("w1"));

        // Brought back: the same, without copying or parsing its 50 services.
        let brought_back = object("w1", &status);
        let ((live, rv), held) = crate::test_fixtures::peak_heap(|| r.live(&brought_back, &at));
        assert!(live.is_some_and(|l| Arc::ptr_eq(&l, &ours)), "not the status we wrote");
        assert_eq!(rv.as_deref(), Some("w1"));
        assert!(held < 64, "{held} bytes held to read back our own status");

        // Written over by someone else: the object's own status.
        let edited = json!({"observedGeneration": 3, "services": 7});
        let (live, rv) = r.live(&object("w2", &edited), &at);
        assert_eq!(live.unwrap().services, Some(7));
        assert_eq!(rv.as_deref(), Some("w2"));
    }

    /// A leader stopped before its first publication's statuses were due (SIGTERM while
    /// the first snapshot waits for Consul, or for the ConfigMap to hold it) has no status
    /// write in flight: it stops at once, not at the end of its share of the shutdown
    /// budget, and says nothing was cut off.
    #[tokio::test(start_paused = true)]
    async fn a_controller_stopped_before_any_publication_stops_at_once() {
        let api = serve(Arc::new(|_: &str, _: &str, _: &[u8]| (405, json!({})))).await;
        let (lead, leadership) = Leadership::manual();
        lead.send_replace(Some(tokio::time::Instant::now() + Duration::from_secs(3600)));
        let mut c = ResolverController::spawn(
            api.client.clone(),
            leadership,
            "test".into(),
            ControllerMetrics::unregistered(),
            Duration::from_secs(3600),
            &Vitals::new(tokio_util::sync::CancellationToken::new()),
        );
        c.sync(&world_with(resolver("1", json!(null))));
        c.leading();
        let asked = tokio::time::Instant::now();
        c.shutdown(Duration::from_secs(20)).await;
        let took = asked.elapsed();
        assert!(took < Duration::from_secs(1), "stopped after {took:?} with nothing in flight");
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
