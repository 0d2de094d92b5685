//! The ConsulService controller: exports Consul services as Kubernetes Services without a
//! selector and their EndpointSlices (docs/export.md), one export at a time, only while
//! this replica leads.
//!
//! Like the resolver controller (`crate::controller`), its store is fed from the world,
//! which already watches ConsulServices, and it reconciles from the published snapshot:
//! an export is reconciled when its object changes, when its part of a snapshot changes
//! (its routing, or the Consul service's entry it reads), on gaining leadership and every
//! resync period. Each export fails and retries alone.
//!
//! The routing (which resolver, with the same namespace rules as a Mapping's) and the
//! watch are the core's: an export is a consumer of the shared watch registry, so a Consul
//! service a Mapping and an export both name is one watch. What is written is planned by
//! `consul_resolver_core::export`; this module reads and writes the API server.

pub(crate) mod metrics;
mod objects;
mod reconcile;
mod status;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{ApiResource, DynamicObject};
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{ResourceExt, core::GroupVersionKind};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::controller::feed::{Backoff, Feed, Running};
use crate::kube_client::error_reason;
use crate::leadership::Leadership;
use crate::vitals::Vitals;
use consul_resolver_api::export::{ConsulService, KIND};
use consul_resolver_api::resolver::GROUP;
use consul_resolver_core::assembler::Snapshot;
use consul_resolver_core::assembler::snapshot::{ExportEntry, Part};
use consul_resolver_core::export::Desired;
use consul_resolver_core::world::World;
use metrics::ExportMetrics;
pub(crate) use objects::SliceVersion;

/// Exports reconciled at once: each writes a Service and its slices, so fewer than the
/// resolver controller's status writes. Retries back off as the resolver controller's do
/// (`controller::retry_delay`).
const CONCURRENCY: u16 = 4;

/// Why an export's reconcile failed; it is retried alone with backoff.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ExportError {
    #[error("leadership lapsed while writing {0}")]
    LeadershipLapsed(String),
    #[error("writing {0}: {1}")]
    Write(String, #[source] kube::Error),
}

impl ExportError {
    fn reason(&self) -> &'static str {
        match self {
            ExportError::LeadershipLapsed(_) => "leadership_lapsed",
            ExportError::Write(_, e) => error_reason(e),
        }
    }
}

/// The exports' part of the latest snapshot.
struct Published {
    exports: BTreeMap<(String, String), Part<ExportEntry>>,
}

impl Published {
    fn of(snapshot: &Snapshot) -> Published {
        let exports =
            snapshot.content.exports.iter().map(|e| ((e.namespace.clone(), e.name.clone()), e.clone())).collect();
        Published { exports }
    }
}

/// What every reconcile shares.
pub(crate) struct Context {
    /// Reads.
    client: kube::Client,
    /// Writes: the fenced client, whose request bodies leave only while this replica leads.
    writer: kube::Client,
    resource: ApiResource,
    services: ApiResource,
    slices: ApiResource,
    version: SliceVersion,
    /// The instance label's value (from `--ambassador-id`).
    instance: String,
    ambassador_id: String,
    leadership: Leadership,
    latest: watch::Receiver<Option<Arc<Published>>>,
    metrics: ExportMetrics,
    resync: Duration,
    backoff: Backoff,
}

async fn reconcile(obj: Arc<DynamicObject>, ctx: Arc<Context>) -> Result<Action, ExportError> {
    let result = reconcile_export(&obj, &ctx).await;
    let at = ObjectRef::from_obj_with(&*obj, ctx.resource.clone());
    match &result {
        Ok(_) => {
            ctx.metrics.reconciles.with_label_values(&["success"]).inc();
            ctx.backoff.forget(&at);
        }
        Err(_) => ctx.metrics.reconciles.with_label_values(&["error"]).inc(),
    }
    result
}

async fn reconcile_export(obj: &DynamicObject, ctx: &Context) -> Result<Action, ExportError> {
    let Some(until) = ctx.leadership.until() else { return Ok(Action::await_change()) };
    let (namespace, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
    let live_status = obj.data.get("status").cloned().and_then(|s| serde_json::from_value(s).ok());
    let generation = obj.metadata.generation;
    let now = k8s_openapi::jiff::Timestamp::now();
    // Another operator's export (another Ambassador ID): not ours to judge, and whatever we
    // wrote for it while it was ours goes, so its new operator can take the name.
    if reconcile::parse(obj).is_ok_and(|s| !s.serves_ambassador_id(&ctx.ambassador_id)) {
        ctx.forget_stale(&namespace, &name);
        reconcile::remove(ctx, &namespace, &name, &obj.uid().unwrap_or_default(), until).await?;
        return Ok(Action::await_change());
    }
    let spec = match reconcile::validate(obj) {
        Ok(spec) => spec,
        Err(why) => {
            let held = reconcile::hold_invalid(ctx, obj, &why, until).await?;
            ctx.set_stale(&namespace, &name, held.as_ref());
            let s =
                status::status_for(&name, generation, &status::Outcome::Invalid(why, held), live_status.as_ref(), now);
            reconcile::update_status(ctx, obj, &s, live_status.as_ref(), until).await?;
            return Ok(Action::await_change());
        }
    };
    let published = ctx.latest.borrow().clone();
    let Some(entry) = published.as_ref().and_then(|p| p.exports.get(&(namespace.clone(), name.clone())).cloned())
    else {
        return Ok(Action::await_change());
    };
    let outcome = match reconcile::apply(ctx, obj, &spec, &entry, until).await {
        Ok(outcome) => outcome,
        Err(e) => {
            // Said on the export (a missing grant reads as "forbidden" there), then retried
            // with backoff; a status write that fails too changes nothing about that.
            let failed = status::Outcome::Failed(e.to_string());
            let s = status::status_for(&name, generation, &failed, live_status.as_ref(), now);
            let _ = reconcile::update_status(ctx, obj, &s, live_status.as_ref(), until).await;
            return Err(e);
        }
    };
    let desired = match &outcome {
        status::Outcome::Exported { desired, .. } | status::Outcome::Held { desired, .. } => Some(desired),
        _ => None,
    };
    ctx.set_stale(&namespace, &name, desired);
    let s = status::status_for(&name, generation, &outcome, live_status.as_ref(), now);
    reconcile::update_status(ctx, obj, &s, live_status.as_ref(), until).await?;
    Ok(Action::requeue(ctx.resync))
}

impl Context {
    /// The stale metric of an export, from what it holds (`None`: nothing).
    fn set_stale(&self, namespace: &str, name: &str, desired: Option<&Desired>) {
        match desired.and_then(|d| d.stale.as_ref()).and_then(|s| chrono::DateTime::parse_from_rfc3339(&s.since).ok()) {
            Some(t) => self.metrics.stale_since.with_label_values(&[namespace, name]).set(t.timestamp() as f64),
            None => self.forget_stale(namespace, name),
        }
    }

    fn forget_stale(&self, namespace: &str, name: &str) {
        let _ = self.metrics.stale_since.remove_label_values(&[namespace, name]);
    }
}

fn error_policy(obj: Arc<DynamicObject>, error: &ExportError, ctx: Arc<Context>) -> Action {
    let delay = ctx.backoff.failed(ObjectRef::from_obj_with(&*obj, ctx.resource.clone()));
    tracing::warn!(export = %format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any()),
        error = %error, reason = error.reason(), retry_in = ?delay, "export reconcile failed");
    Action::requeue(delay)
}

/// The running controller, and the store it reads, fed from the world.
pub(crate) struct ExportController {
    feed: Feed,
    latest: watch::Sender<Option<Arc<Published>>>,
    ctx: Arc<Context>,
    running: Running,
    /// Exports deleted: their Service and slices are removed, one task each.
    removals: Vec<JoinHandle<()>>,
}

/// How the controller is set up.
pub(crate) struct ExportConfig {
    pub(crate) version: SliceVersion,
    pub(crate) ambassador_id: String,
    pub(crate) resync: Duration,
    pub(crate) metrics: ExportMetrics,
}

impl ExportController {
    /// `writer`: the fenced client (`kube_client::fenced`) for every write.
    pub(crate) fn spawn(
        client: kube::Client,
        writer: kube::Client,
        leadership: Leadership,
        cfg: ExportConfig,
        vitals: &Arc<Vitals>,
    ) -> ExportController {
        let resource = ApiResource::erase::<ConsulService>(&());
        let services = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "Service"), "services");
        let (group, version) = cfg.version.api_version().split_once('/').expect("group/version");
        let slices = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk(group, version, "EndpointSlice"),
            "endpointslices",
        );
        let (feed, streams) = Feed::new(resource.clone());
        let (latest, latest_rx) = watch::channel(None);
        let ctx = Arc::new(Context {
            client,
            writer,
            resource,
            services,
            slices,
            version: cfg.version,
            instance: objects::instance_value(&cfg.ambassador_id),
            ambassador_id: cfg.ambassador_id,
            leadership,
            latest: latest_rx,
            metrics: cfg.metrics,
            resync: cfg.resync,
            backoff: Backoff::default(),
        });
        let running = streams.run(CONCURRENCY, reconcile, error_policy, ctx.clone(), "export controller", vitals);
        ExportController { feed, latest, ctx, running, removals: Vec::new() }
    }

    /// Brings the store up to date with the world's exports; an export gone has its
    /// Service and slices removed.
    pub(crate) fn sync(&mut self, world: &World) {
        for gone in self.feed.sync(world, GROUP, KIND) {
            let id = (gone.namespace().unwrap_or_default(), gone.name_any());
            let uid = gone.uid().unwrap_or_default();
            self.ctx.forget_stale(&id.0, &id.1);
            let at = ObjectRef::from_obj_with(&gone, self.feed.resource().clone());
            self.ctx.backoff.forget(&at);
            self.removals.retain(|t| !t.is_finished());
            let ctx = self.ctx.clone();
            self.removals.push(tokio::spawn(async move {
                // Only the leader removes; a follower's export deletions are the leader's
                // to carry out (it sees them too).
                let Some(until) = ctx.leadership.until() else { return };
                if let Err(e) = reconcile::remove(&ctx, &id.0, &id.1, &uid, until).await {
                    tracing::warn!(export = %format!("{}/{}", id.0, id.1), error = %e,
                        "could not remove a deleted export's Service and slices (owner references remove them where a garbage collector runs)");
                }
            }));
        }
    }

    /// `snapshot` was published: reconcile the exports whose part of it changed.
    pub(crate) fn published(&mut self, snapshot: &Snapshot) {
        let published = Arc::new(Published::of(snapshot));
        let previous = self.latest.send_replace(Some(published.clone()));
        if self.feed.fill() {
            return; // The first snapshot: every export is reconciled.
        }
        for ((namespace, name), entry) in &published.exports {
            let before = previous.as_ref().and_then(|p| p.exports.get(&(namespace.clone(), name.clone())));
            if before != Some(entry) {
                self.feed.trigger(namespace, name);
            }
        }
    }

    /// This replica just became leader: every export is reconciled again.
    pub(crate) fn leading(&mut self) {
        self.feed.trigger_all();
    }

    /// Lets the reconciles in flight finish for at most `within`, then stops.
    pub(crate) async fn shutdown(self, within: Duration) {
        if self.running.shutdown(within).await {
            tracing::warn!("shutdown: export writes in flight cut off (the next leader reconciles every export again)");
        }
        for t in self.removals {
            t.abort();
        }
    }
}
