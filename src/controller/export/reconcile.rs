//! One export's reconcile, in steps with their own errors: validate the spec, build what
//! it asks for from the published snapshot (or, while nothing says, hold what the cluster
//! has), apply the Service and the slices that changed, then the status.
//!
//! Every request is bounded by the leadership deadline, and every write goes through the
//! fenced client (its body leaves only while this replica leads, `kube_client/fence.rs`),
//! so a deposed leader's late request cannot undo the current one's. Deletes name the uid
//! they mean (`Preconditions`): an object re-created under the same name meanwhile is not
//! deleted by a request meant for its predecessor.

use std::future::Future;

use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, Preconditions};
use kube::{Resource, ResourceExt};
use serde_json::Value;
use tokio::time::Instant;

use super::status::{self, Outcome};
use super::{Exports, objects};
use crate::controller::conditions::whole_seconds;
use crate::controller::{Job, Next, ReconcileError, within};
use crate::kube_client::{FIELD_MANAGER, status_code};
use consul_resolver_api::export::{ConsulService, ConsulServiceSpec, IpFamily};
use consul_resolver_api::status::ConsulServiceStatus;
use consul_resolver_core::assembler::snapshot::ExportEntry;
use consul_resolver_core::export::layout::LiveSlice;
use consul_resolver_core::export::{Desired, endpoints, held, knows, layout};

/// A request within the leadership deadline, to an object that may be gone or replaced
/// meanwhile (`None`: the API server said 404, or 409 for a precondition on the uid: for a
/// delete, as good as done, since the object meant is gone).
async fn within_unless_gone<T>(
    until: Instant,
    what: &str,
    f: impl Future<Output = kube::Result<T>>,
) -> Result<Option<T>, ReconcileError> {
    match within(until, what, f).await {
        Err(ReconcileError::Write(_, e)) if matches!(status_code(&e), Some(404 | 409)) => Ok(None),
        r => r.map(Some),
    }
}

/// A delete of exactly the object with `uid`.
fn delete_exactly(uid: &str) -> DeleteParams {
    let preconditions = Preconditions { uid: Some(uid.to_owned()), resource_version: None };
    DeleteParams { preconditions: Some(preconditions), ..DeleteParams::default() }
}

/// The kinds an export writes besides its status.
#[derive(Clone, Copy)]
enum Written {
    Service,
    Slice,
    Endpoints,
}

impl Written {
    fn resource(self, ctx: &Exports) -> &ApiResource {
        match self {
            Written::Service => &ctx.services,
            Written::Slice => &ctx.slices,
            Written::Endpoints => &ctx.endpoints,
        }
    }

    /// As errors name it.
    fn kind(self) -> &'static str {
        match self {
            Written::Service => "Service",
            Written::Slice => "EndpointSlice",
            Written::Endpoints => "Endpoints",
        }
    }

    /// Its `kind` label in the export's write counter.
    fn label(self) -> &'static str {
        match self {
            Written::Service => "service",
            Written::Slice => "endpointslice",
            Written::Endpoints => "endpoints",
        }
    }
}

/// Deletes exactly the `written` object `name` with `uid`, counted when it was still there
/// (gone already, or replaced by another uid, is as good as done).
async fn delete_one(
    ctx: &Exports,
    written: Written,
    (namespace, name): (&str, &str),
    uid: &str,
    until: Instant,
) -> Result<(), ReconcileError> {
    let writer: Api<DynamicObject> = Api::namespaced_with(ctx.writer.clone(), namespace, written.resource(ctx));
    let shown = format!("{} {namespace}/{name}", written.kind());
    if within_unless_gone(until, &shown, writer.delete(name, &delete_exactly(uid))).await?.is_some() {
        ctx.metrics.writes.with_label_values(&[written.label(), "delete"]).inc();
    }
    Ok(())
}

/// Whether the Service (or Endpoints) `live` is the one this operator instance keeps for
/// export `name`.
fn ours(live: &Value, name: &str, instance: &str) -> bool {
    live["metadata"]["labels"][objects::EXPORT].as_str() == Some(name)
        && live["metadata"]["labels"][objects::INSTANCE].as_str() == Some(instance)
}

/// One export's reconcile, while leading: an export of another operator is let go; an
/// invalid spec holds the live slices; otherwise the export is applied as its snapshot
/// entry says. The status follows each.
pub(super) async fn reconcile(
    ctx: &Exports,
    obj: &DynamicObject,
    job: Job<ExportEntry>,
) -> Result<Next, ReconcileError> {
    let (namespace, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
    let live_status = obj.data.get("status").cloned().and_then(|s| serde_json::from_value(s).ok());
    let generation = obj.metadata.generation;
    let now = k8s_openapi::jiff::Timestamp::now();
    let status_after = |outcome: &Outcome| status::status_for(&name, generation, outcome, live_status.as_ref(), now);
    // Another operator's export (another Ambassador ID): not ours to judge, and whatever we
    // wrote for it while it was ours goes, so its new operator can take the name.
    if parse(obj).is_ok_and(|s| !s.serves_ambassador_id(&ctx.ambassador_id)) {
        ctx.forget_stale(&namespace, &name);
        ctx.set_write_failing(&namespace, &name, false);
        remove(ctx, &namespace, &name, &obj.uid().unwrap_or_default(), job.until).await?;
        return Ok(Next::OnChange);
    }
    let spec = match validate(obj) {
        Ok(spec) => spec,
        Err(why) => {
            let held = hold_invalid(ctx, obj, &why, job.until).await?;
            // The Endpoints are held with the slices; a spec that cannot even be read
            // leaves them as they are.
            if let (Some(d), Ok(spec)) = (&held, parse(obj)) {
                sync_endpoints(ctx, obj, spec.endpoints.unwrap_or(false), Some(d), job.until).await?;
            }
            ctx.set_stale(&namespace, &name, held.as_ref());
            ctx.set_write_failing(&namespace, &name, false);
            let s = status_after(&Outcome::Invalid(why, held));
            update_status(ctx, obj, &s, live_status.as_ref(), job.until).await?;
            return Ok(Next::OnChange);
        }
    };
    let Some((_, entry)) = job.entry(&namespace, &name) else { return Ok(Next::OnChange) };
    let outcome = match apply(ctx, obj, &spec, entry, job.until).await {
        Ok(outcome) => outcome,
        Err(e) => {
            // Said on the export (a missing grant reads as "forbidden" there), then retried
            // with backoff; a status write that fails too changes nothing about that. The
            // metric says it where alerts can see it.
            ctx.set_write_failing(&namespace, &name, true);
            let s = status_after(&Outcome::Failed(e.to_string()));
            let _ = update_status(ctx, obj, &s, live_status.as_ref(), job.until).await;
            return Err(e);
        }
    };
    let desired = match &outcome {
        Outcome::Exported { desired, .. } | Outcome::Held { desired, .. } => Some(desired),
        _ => None,
    };
    ctx.set_stale(&namespace, &name, desired);
    ctx.set_write_failing(&namespace, &name, false);
    update_status(ctx, obj, &status_after(&outcome), live_status.as_ref(), job.until).await?;
    Ok(Next::Resync)
}

/// The spec as the export holds it, or why it cannot be read.
fn parse(obj: &DynamicObject) -> Result<ConsulServiceSpec, String> {
    let spec = obj.data.get("spec").ok_or("spec is missing")?;
    serde_json::from_value(spec.clone()).map_err(|e| format!("spec is not valid: {e}"))
}

/// Validate: the spec, or why it cannot be used.
fn validate(obj: &DynamicObject) -> Result<ConsulServiceSpec, String> {
    let spec = parse(obj)?;
    spec.validate(&obj.name_any())?;
    objects::refuse_own_keys(&spec)?;
    Ok(spec)
}

/// What the cluster holds for one export: our Service (`None`: absent) and our slices.
struct Live {
    service: Option<Value>,
    slices: Vec<(LiveSlice, String)>,
}

impl Live {
    fn slices(&self) -> Vec<LiveSlice> {
        self.slices.iter().map(|(s, _)| s.clone()).collect()
    }

    fn service_uid(&self) -> &str {
        self.service.as_ref().and_then(|s| s["metadata"]["uid"].as_str()).unwrap_or_default()
    }
}

/// The live Service of `name`, any owner's (`None`: absent).
async fn get_service(
    ctx: &Exports,
    namespace: &str,
    name: &str,
    until: Instant,
) -> Result<Option<Value>, ReconcileError> {
    let services: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), namespace, &ctx.services);
    let found = within(until, &format!("Service {namespace}/{name}"), services.get_opt(name)).await?;
    Ok(found.map(|s| serde_json::to_value(s).unwrap_or_default()))
}

/// Our slices of the Service `name`, read back against the labels and owner they should
/// have, with their uids.
async fn list_slices(
    ctx: &Exports,
    namespace: &str,
    name: &str,
    labels: &std::collections::BTreeMap<String, String>,
    service_uid: Option<&str>,
    until: Instant,
) -> Result<Vec<(LiveSlice, String)>, ReconcileError> {
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), namespace, &ctx.slices);
    let shown = format!("EndpointSlices of {namespace}/{name}");
    let selector = objects::slice_selector(name, &ctx.instance);
    let listed = within(until, &shown, api.list(&ListParams::default().labels(&selector))).await?;
    Ok(listed
        .items
        .iter()
        .map(|s| {
            let value = serde_json::to_value(s).unwrap_or_default();
            (objects::live_slice(&value, labels, service_uid), s.uid().unwrap_or_default())
        })
        .collect())
}

/// Apply: the Service, the slices and (with `spec.endpoints`) the Endpoints, as the export
/// and its snapshot entry say; what happened, for the status.
async fn apply(
    ctx: &Exports,
    obj: &DynamicObject,
    spec: &ConsulServiceSpec,
    entry: &ExportEntry,
    until: Instant,
) -> Result<Outcome, ReconcileError> {
    let outcome = apply_service_and_slices(ctx, obj, spec, entry, until).await?;
    // The Endpoints hold what the slices hold, and only while they hold something.
    let desired = match &outcome {
        Outcome::Exported { desired, .. } | Outcome::Held { desired, .. } => Some(desired),
        _ => None,
    };
    sync_endpoints(ctx, obj, spec.endpoints.unwrap_or(false), desired, until).await?;
    Ok(outcome)
}

/// The Service and the slices, as the export and its snapshot entry say.
async fn apply_service_and_slices(
    ctx: &Exports,
    obj: &DynamicObject,
    spec: &ConsulServiceSpec,
    entry: &ExportEntry,
    until: Instant,
) -> Result<Outcome, ReconcileError> {
    let (namespace, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
    let service = get_service(ctx, &namespace, &name, until).await?;
    if service.as_ref().is_some_and(|s| !ours(s, &name, &ctx.instance)) {
        remove_slices(ctx, &namespace, &name, None, until).await?;
        return Ok(Outcome::Conflict);
    }
    if entry.source.is_none()
        && !entry.resolver_unusable
        && let Some(why) = &entry.problem
    {
        // No resolver serves it: nothing to keep. The Service stays (the export does).
        remove_slices(ctx, &namespace, &name, None, until).await?;
        return Ok(Outcome::NoResolver(why.clone()));
    }
    let source = entry.source.as_deref();
    let mut desired = Desired::of(spec, source);
    if ctx.version != objects::SliceVersion::V1 {
        // Only a 1.20 server serves v1beta1 alone, and it has no `hints` field.
        desired.drop_hints();
    }
    let labels = objects::slice_labels(&name, &ctx.instance, desired.headless);
    let service_uid = service.as_ref().and_then(|s| s["metadata"]["uid"].as_str());
    let live = Live { slices: list_slices(ctx, &namespace, &name, &labels, service_uid, until).await?, service };
    if !knows(source) {
        let reason = entry
            .problem
            .clone()
            .or_else(|| source.and_then(|s| s.error.clone()))
            .unwrap_or_else(|| "Consul has not answered for this service since the operator started".to_owned());
        if let Some(outcome) = hold(ctx, &namespace, &name, &live, desired.family, &reason, until).await? {
            return Ok(outcome);
        }
    }
    if desired.ports.is_empty() && !desired.headless {
        remove_slices(ctx, &namespace, &name, None, until).await?;
        return Ok(Outcome::NoPorts { desired });
    }
    let service_uid = apply_service(ctx, obj, spec, &desired, live.service, until).await?;
    let slices = write_slices(ctx, &namespace, &name, &desired, &live.slices, &service_uid, true, until).await?;
    Ok(Outcome::Exported { desired, slices, waiting: source.is_none_or(|s| !s.synced) })
}

/// The Service as `desired` says, with the labels and annotations `spec` asks for,
/// written unless it already is; its uid. Server-side apply: a label or annotation the
/// export no longer asks for is removed by the apply that leaves it out.
async fn apply_service(
    ctx: &Exports,
    obj: &DynamicObject,
    spec: &ConsulServiceSpec,
    desired: &Desired,
    live: Option<Value>,
    until: Instant,
) -> Result<String, ReconcileError> {
    let (namespace, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
    let uid = obj.uid().unwrap_or_default();
    let owner = objects::owner(&ConsulService::api_version(&()), &ConsulService::kind(&()), &name, &uid);
    let (labels, annotations) = objects::service_metadata(spec, objects::service_labels(&name, &ctx.instance));
    let distribution = ctx.features.service_traffic_distribution(spec.traffic_distribution);
    let want = objects::service(&namespace, &name, desired, (&labels, &annotations), distribution, owner);
    let shown = format!("Service {namespace}/{name}");
    let writer: Api<DynamicObject> = Api::namespaced_with(ctx.writer.clone(), &namespace, &ctx.services);
    let mut live = live;
    if let Some(l) = &live
        && objects::needs_replace(l, &want)
    {
        let live_uid = l["metadata"]["uid"].as_str().unwrap_or_default();
        delete_one(ctx, Written::Service, (&namespace, &name), live_uid, until).await?;
        live = None;
    }
    if let Some(l) = live.filter(|l| objects::service_matches(l, &want)) {
        return Ok(l["metadata"]["uid"].as_str().unwrap_or_default().to_owned());
    }
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let written = within(until, &shown, writer.patch(&name, &params, &Patch::Apply(&want))).await?;
    ctx.metrics.writes.with_label_values(&["service", "apply"]).inc();
    Ok(written.uid().unwrap_or_default())
}

/// The export's Endpoints: with `on` and something to hold (`desired`), written unless
/// they already are as planned; otherwise deleted, if ours. Named as the Service and owned
/// by the export as it is, and never mirrored into slices (the skip-mirror label). When
/// off, the read is what finds one written while it was on.
async fn sync_endpoints(
    ctx: &Exports,
    obj: &DynamicObject,
    on: bool,
    desired: Option<&Desired>,
    until: Instant,
) -> Result<(), ReconcileError> {
    let (namespace, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
    let Some(desired) = desired.filter(|_| on) else {
        let live = leftover_endpoints(ctx, &namespace, &name, until).await?;
        if let Some(live) = live.filter(|l| ours(l, &name, &ctx.instance)) {
            let uid = live["metadata"]["uid"].as_str().unwrap_or_default();
            delete_one(ctx, Written::Endpoints, (&namespace, &name), uid, until).await?;
        }
        return Ok(());
    };
    let live = get_endpoints(ctx, &namespace, &name, until).await?;
    let export_uid = obj.uid().unwrap_or_default();
    let labels = objects::endpoints_labels(&name, &ctx.instance);
    let plan = endpoints::plan(desired);
    if live.as_ref().is_some_and(|l| objects::endpoints_match(l, &plan, &labels, &export_uid)) {
        return Ok(());
    }
    let owner = objects::owner(&ConsulService::api_version(&()), &ConsulService::kind(&()), &name, &export_uid);
    let body = objects::endpoints(&namespace, &name, &plan, &labels, owner);
    let writer: Api<DynamicObject> = Api::namespaced_with(ctx.writer.clone(), &namespace, &ctx.endpoints);
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let shown = format!("Endpoints {namespace}/{name}");
    within(until, &shown, writer.patch(&name, &params, &Patch::Apply(&body))).await?;
    ctx.metrics.writes.with_label_values(&["endpoints", "apply"]).inc();
    Ok(())
}

/// The live Endpoints of `name`, anyone's (`None`: absent).
async fn get_endpoints(
    ctx: &Exports,
    namespace: &str,
    name: &str,
    until: Instant,
) -> Result<Option<Value>, ReconcileError> {
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), namespace, &ctx.endpoints);
    let found = within(until, &format!("Endpoints {namespace}/{name}"), api.get_opt(name)).await?;
    Ok(found.map(|e| serde_json::to_value(e).unwrap_or_default()))
}

/// The live Endpoints of `name` where no export asks for them: one left from when the
/// option was on. An operator whose role predates the option may not read Endpoints (403):
/// then there can be none of ours to clean up, and exports without the option go on.
async fn leftover_endpoints(
    ctx: &Exports,
    namespace: &str,
    name: &str,
    until: Instant,
) -> Result<Option<Value>, ReconcileError> {
    match get_endpoints(ctx, namespace, name, until).await {
        Err(ReconcileError::Write(_, e)) if status_code(&e) == Some(403) => {
            tracing::debug!(export = %format!("{namespace}/{name}"), "may not read Endpoints: none to clean up");
            Ok(None)
        }
        other => other,
    }
}

/// While nothing says what the export should hold (no answer since this process started,
/// or its resolver cannot be used now), its live slices are the last known good: kept as
/// they are, marked stale. The Service is left as it is. `None`: nothing to hold (no
/// Service of ours, or no live endpoints), so the export is built as usual.
async fn hold(
    ctx: &Exports,
    namespace: &str,
    name: &str,
    live: &Live,
    family: IpFamily,
    reason: &str,
    until: Instant,
) -> Result<Option<Outcome>, ReconcileError> {
    let Some(service) = &live.service else { return Ok(None) };
    // Whole seconds, as the conditions' times.
    let now = whole_seconds(k8s_openapi::jiff::Timestamp::now());
    let mut desired = held(&live.slices(), family, reason, &now.to_string());
    if desired.endpoint_count() == 0 {
        return Ok(None);
    }
    desired.headless = objects::is_headless(service);
    let kept: Vec<(LiveSlice, String)> =
        live.slices.iter().filter(|(s, _)| s.family == Some(family) && !s.endpoints.is_empty()).cloned().collect();
    let slices = write_slices(ctx, namespace, name, &desired, &kept, live.service_uid(), false, until).await?;
    Ok(Some(Outcome::Held { desired, slices }))
}

/// The export's spec cannot be used: its live slices are held as they are, marked stale
/// for `why` (an edit that breaks the spec must not take the traffic away). The export's
/// status says why; nothing else is written.
async fn hold_invalid(
    ctx: &Exports,
    obj: &DynamicObject,
    why: &str,
    until: Instant,
) -> Result<Option<Desired>, ReconcileError> {
    let (namespace, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
    let Some(service) = get_service(ctx, &namespace, &name, until).await?.filter(|s| ours(s, &name, &ctx.instance))
    else {
        return Ok(None);
    };
    let labels = objects::slice_labels(&name, &ctx.instance, objects::is_headless(&service));
    let service_uid = service["metadata"]["uid"].as_str();
    let slices = list_slices(ctx, &namespace, &name, &labels, service_uid, until).await?;
    let Some(family) = slices.iter().find(|(s, _)| !s.endpoints.is_empty()).and_then(|(s, _)| s.family) else {
        return Ok(None);
    };
    let live = Live { service: Some(service), slices };
    let reason = format!("the ConsulService's spec cannot be used: {why}");
    Ok(hold(ctx, &namespace, &name, &live, family, &reason, until).await?.and_then(|o| match o {
        Outcome::Held { desired, .. } => Some(desired),
        _ => None,
    }))
}

/// Writes the slices of `desired`'s plan against `live` that differ, and (with `delete`)
/// deletes those it no longer needs. Returns how many the export has.
#[allow(clippy::too_many_arguments)]
async fn write_slices(
    ctx: &Exports,
    namespace: &str,
    name: &str,
    desired: &Desired,
    live: &[(LiveSlice, String)],
    service_uid: &str,
    delete: bool,
    until: Instant,
) -> Result<usize, ReconcileError> {
    let writer: Api<DynamicObject> = Api::namespaced_with(ctx.writer.clone(), namespace, &ctx.slices);
    let labels = objects::slice_labels(name, &ctx.instance, desired.headless);
    let live_slices: Vec<LiveSlice> = live.iter().map(|(s, _)| s.clone()).collect();
    let plan = layout::plan(name, desired, &live_slices);
    let owner = objects::owner("v1", "Service", name, service_uid);
    let params = PatchParams::apply(FIELD_MANAGER).force();
    for slice in plan.slices.iter().filter(|s| plan.write.contains(&s.name)) {
        let body = objects::slice(ctx.version, namespace, slice, desired, &labels, owner.clone());
        let what = format!("EndpointSlice {namespace}/{}", slice.name);
        within(until, &what, writer.patch(&slice.name, &params, &Patch::Apply(&body))).await?;
        ctx.metrics.writes.with_label_values(&["endpointslice", "apply"]).inc();
    }
    if delete {
        for gone in &plan.delete {
            if let Some((_, uid)) = live.iter().find(|(s, _)| &s.name == gone) {
                delete_one(ctx, Written::Slice, (namespace, gone), uid, until).await?;
            }
        }
    }
    Ok(plan.slices.len())
}

/// Deletes our slices for the Service `name`: all of them, or (`owner`) only those the
/// Service with that uid owns.
async fn remove_slices(
    ctx: &Exports,
    namespace: &str,
    name: &str,
    owner: Option<&str>,
    until: Instant,
) -> Result<(), ReconcileError> {
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), namespace, &ctx.slices);
    let shown = format!("EndpointSlices of {namespace}/{name}");
    let selector = objects::slice_selector(name, &ctx.instance);
    let listed = within(until, &shown, api.list_metadata(&ListParams::default().labels(&selector))).await?;
    for s in listed.items {
        let controller = s.metadata.owner_references.iter().flatten().find(|r| r.controller == Some(true));
        if owner.is_some_and(|uid| controller.is_none_or(|r| r.uid != uid)) {
            continue;
        }
        delete_one(ctx, Written::Slice, (namespace, &s.name_any()), &s.uid().unwrap_or_default(), until).await?;
    }
    Ok(())
}

/// The export with uid `export_uid` is gone, or no longer this operator's (another
/// Ambassador ID): its Service, slices and Endpoints go too, if ours and owned by that export (never
/// those of an export re-created under the same name). Owner references do this where a
/// garbage collector runs; this also covers clusters without one, and is harmless where
/// it does.
pub(super) async fn remove(
    ctx: &Exports,
    namespace: &str,
    name: &str,
    export_uid: &str,
    until: Instant,
) -> Result<(), ReconcileError> {
    // The Endpoints first: they are the export's own, whether or not its Service is left.
    if let Some(live) = leftover_endpoints(ctx, namespace, name, until).await?
        && ours(&live, name, &ctx.instance)
        && objects::controller_uid(&live) == Some(export_uid)
    {
        let uid = live["metadata"]["uid"].as_str().unwrap_or_default();
        delete_one(ctx, Written::Endpoints, (namespace, name), uid, until).await?;
    }
    let Some(service) = get_service(ctx, namespace, name, until).await? else { return Ok(()) };
    if !ours(&service, name, &ctx.instance) || objects::controller_uid(&service) != Some(export_uid) {
        return Ok(());
    }
    let service_uid = service["metadata"]["uid"].as_str().unwrap_or_default();
    remove_slices(ctx, namespace, name, Some(service_uid), until).await?;
    delete_one(ctx, Written::Service, (namespace, name), service_uid, until).await
}

/// The status written (server-side apply on the status subresource), unless the live one
/// already says the same.
async fn update_status(
    ctx: &Exports,
    obj: &DynamicObject,
    status: &ConsulServiceStatus,
    live: Option<&ConsulServiceStatus>,
    until: Instant,
) -> Result<(), ReconcileError> {
    if live == Some(status) {
        return Ok(());
    }
    let (namespace, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
    let patch: Value = serde_json::json!({
        "apiVersion": ConsulService::api_version(&()),
        "kind": ConsulService::kind(&()),
        "metadata": {"name": name},
        "status": status,
    });
    let resource = ApiResource::erase::<ConsulService>(&());
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.writer.clone(), &namespace, &resource);
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let shown = format!("the status of ConsulService {namespace}/{name}");
    // Deleted meanwhile: nothing to say.
    within_unless_gone(until, &shown, api.patch_status(&name, &params, &Patch::Apply(&patch))).await?;
    Ok(())
}

#[cfg(test)]
mod tests;
