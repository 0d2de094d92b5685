//! One export's reconcile, in steps with their own errors: validate the spec, build what
//! it asks for from the published snapshot, apply the Service and the slices that changed,
//! then the status. Every request is bounded by the leadership deadline, so nothing is
//! written after this replica may have lost the Lease.

use std::future::Future;

use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde_json::Value;
use tokio::time::Instant;

use super::objects;
use super::status::Outcome;
use super::{Context, ExportError};
use crate::kube_client::{FIELD_MANAGER, status_code};
use consul_resolver_api::export::{ConsulService, ConsulServiceSpec};
use consul_resolver_core::assembler::snapshot::ExportEntry;
use consul_resolver_core::export::{Desired, layout};

/// A request within the leadership deadline.
async fn within<T>(until: Instant, what: &str, f: impl Future<Output = kube::Result<T>>) -> Result<T, ExportError> {
    match tokio::time::timeout_at(until, f).await {
        Err(_) => Err(ExportError::LeadershipLapsed(what.to_owned())),
        Ok(r) => r.map_err(|e| ExportError::Write(what.to_owned(), e)),
    }
}

/// A request within the leadership deadline, to an object that may be gone meanwhile
/// (`None`: the API server said 404, which for a delete is as good as done).
async fn within_unless_gone<T>(
    until: Instant,
    what: &str,
    f: impl Future<Output = kube::Result<T>>,
) -> Result<Option<T>, ExportError> {
    match within(until, what, f).await {
        Err(ExportError::Write(_, e)) if status_code(&e) == Some(404) => Ok(None),
        r => r.map(Some),
    }
}

/// Whether the Service `live` is the one this operator instance keeps for export `name`.
fn ours(live: &DynamicObject, name: &str, instance: &str) -> bool {
    live.labels().get(objects::EXPORT).map(String::as_str) == Some(name)
        && live.labels().get(objects::INSTANCE).map(String::as_str) == Some(instance)
}

/// The spec as the export holds it, or why it cannot be read.
pub(super) fn parse(obj: &DynamicObject) -> Result<ConsulServiceSpec, String> {
    let spec = obj.data.get("spec").ok_or("spec is missing")?;
    serde_json::from_value(spec.clone()).map_err(|e| format!("spec is not valid: {e}"))
}

/// Validate: the spec, or why it cannot be used.
pub(super) fn validate(obj: &DynamicObject) -> Result<ConsulServiceSpec, String> {
    let spec = parse(obj)?;
    spec.validate(&obj.name_any())?;
    Ok(spec)
}

/// Apply: the Service and the slices, as `desired` says; what happened, for the status.
pub(super) async fn apply<'a>(
    ctx: &Context,
    obj: &DynamicObject,
    entry: &ExportEntry,
    desired: &'a Desired,
    until: Instant,
) -> Result<Outcome<'a>, ExportError> {
    let (namespace, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
    let services: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), &namespace, &ctx.services);
    let shown = format!("Service {namespace}/{name}");
    let live = within(until, &shown, services.get_opt(&name)).await?;
    if live.as_ref().is_some_and(|s| !ours(s, &name, &ctx.instance)) {
        remove_slices(ctx, &namespace, &name, until).await?;
        return Ok(Outcome::Conflict);
    }
    if entry.source.is_none()
        && let Some(why) = &entry.problem
    {
        // No resolver, nothing kept: no endpoints. The Service stays (the export does).
        remove_slices(ctx, &namespace, &name, until).await?;
        return Ok(Outcome::NoResolver(why.clone()));
    }
    if desired.ports.is_empty() && !desired.headless {
        remove_slices(ctx, &namespace, &name, until).await?;
        return Ok(Outcome::NoPorts { desired });
    }
    let uid = obj.uid().unwrap_or_default();
    let owner = objects::owner(&ConsulService::api_version(&()), &ConsulService::kind(&()), &name, &uid);
    let labels = objects::service_labels(&name, &ctx.instance);
    let want = objects::service(&namespace, &name, desired, &labels, owner);
    let mut live = live.map(|s| serde_json::to_value(s).unwrap_or_default());
    // clusterIP cannot change in place: headless and not are different Services.
    if let Some(l) = &live
        && objects::is_headless(l) != desired.headless
    {
        within(until, &shown, services.delete(&name, &DeleteParams::default())).await?;
        ctx.metrics.writes.with_label_values(&["service", "delete"]).inc();
        live = None;
    }
    let service_uid = match live.filter(|l| objects::service_matches(l, &want)) {
        Some(l) => l["metadata"]["uid"].as_str().unwrap_or_default().to_owned(),
        None => {
            let params = PatchParams::apply(FIELD_MANAGER).force();
            let written = within(until, &shown, services.patch(&name, &params, &Patch::Apply(&want))).await?;
            ctx.metrics.writes.with_label_values(&["service", "apply"]).inc();
            written.uid().unwrap_or_default()
        }
    };
    let slices = apply_slices(ctx, &namespace, &name, desired, &service_uid, until).await?;
    Ok(Outcome::Exported { desired, slices, waiting: entry.source.as_ref().is_none_or(|s| !s.synced) })
}

/// The slices that changed, written; those no longer wanted, deleted. Returns how many
/// the export has.
async fn apply_slices(
    ctx: &Context,
    namespace: &str,
    name: &str,
    desired: &Desired,
    service_uid: &str,
    until: Instant,
) -> Result<usize, ExportError> {
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), namespace, &ctx.slices);
    let shown = format!("EndpointSlices of {namespace}/{name}");
    let selector = objects::slice_selector(name, &ctx.instance);
    let listed = within(until, &shown, api.list(&ListParams::default().labels(&selector))).await?;
    let labels = objects::slice_labels(name, &ctx.instance);
    let live: Vec<_> = listed
        .items
        .iter()
        .map(|s| objects::live_slice(&serde_json::to_value(s).unwrap_or_default(), &labels, Some(service_uid)))
        .collect();
    let plan = layout::plan(name, desired, &live);
    let owner = objects::owner("v1", "Service", name, service_uid);
    let params = PatchParams::apply(FIELD_MANAGER).force();
    for slice in plan.slices.iter().filter(|s| plan.write.contains(&s.name)) {
        let body = objects::slice(ctx.version, namespace, slice, desired, &labels, owner.clone());
        let what = format!("EndpointSlice {namespace}/{}", slice.name);
        within(until, &what, api.patch(&slice.name, &params, &Patch::Apply(&body))).await?;
        ctx.metrics.writes.with_label_values(&["endpointslice", "apply"]).inc();
    }
    for gone in &plan.delete {
        delete_slice(ctx, &api, namespace, gone, until).await?;
    }
    Ok(plan.slices.len())
}

async fn delete_slice(
    ctx: &Context,
    api: &Api<DynamicObject>,
    namespace: &str,
    name: &str,
    until: Instant,
) -> Result<(), ExportError> {
    let what = format!("EndpointSlice {namespace}/{name}");
    if within_unless_gone(until, &what, api.delete(name, &DeleteParams::default())).await?.is_some() {
        ctx.metrics.writes.with_label_values(&["endpointslice", "delete"]).inc();
    }
    Ok(())
}

/// Deletes every slice of ours for the Service `name`.
pub(super) async fn remove_slices(
    ctx: &Context,
    namespace: &str,
    name: &str,
    until: Instant,
) -> Result<(), ExportError> {
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), namespace, &ctx.slices);
    let shown = format!("EndpointSlices of {namespace}/{name}");
    let selector = objects::slice_selector(name, &ctx.instance);
    let listed = within(until, &shown, api.list_metadata(&ListParams::default().labels(&selector))).await?;
    for s in listed.items {
        delete_slice(ctx, &api, namespace, &s.name_any(), until).await?;
    }
    Ok(())
}

/// The export is gone: its Service (if ours) and slices go too. Owner references do this
/// where a garbage collector runs; this also covers clusters without one, and is harmless
/// where it does.
pub(super) async fn remove(ctx: &Context, namespace: &str, name: &str, until: Instant) -> Result<(), ExportError> {
    remove_slices(ctx, namespace, name, until).await?;
    let services: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), namespace, &ctx.services);
    let shown = format!("Service {namespace}/{name}");
    let Some(live) = within(until, &shown, services.get_opt(name)).await? else { return Ok(()) };
    if ours(&live, name, &ctx.instance)
        && within_unless_gone(until, &shown, services.delete(name, &DeleteParams::default())).await?.is_some()
    {
        ctx.metrics.writes.with_label_values(&["service", "delete"]).inc();
    }
    Ok(())
}

/// The status written (server-side apply on the status subresource), unless the live one
/// already says the same.
pub(super) async fn update_status(
    ctx: &Context,
    obj: &DynamicObject,
    status: &consul_resolver_api::status::ConsulServiceStatus,
    live: Option<&consul_resolver_api::status::ConsulServiceStatus>,
    until: Instant,
) -> Result<(), ExportError> {
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
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), &namespace, &ctx.resource);
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let shown = format!("the status of ConsulService {namespace}/{name}");
    // Deleted meanwhile: nothing to say.
    within_unless_gone(until, &shown, api.patch_status(&name, &params, &Patch::Apply(&patch))).await?;
    Ok(())
}
