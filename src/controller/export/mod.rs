//! The ConsulService controller: exports Consul services as Kubernetes Services without a
//! selector, their EndpointSlices and, where asked, core Endpoints (docs/export.md), one
//! export at a time, only while this replica leads, on the driver both controllers share
//! (`controller`). An export is reconciled when its object changes, when its part of a
//! snapshot changes (its routing, or the Consul service's entry it reads), on gaining
//! leadership and every resync period.
//!
//! The routing (which resolver, with the same namespace rules as a Mapping's) and the
//! watch are the core's: an export is a consumer of the shared watch registry, so a Consul
//! service a Mapping and an export both name is one watch. What is written is planned by
//! `consul_resolver_core::export`; this module reads and writes the API server. What it
//! keeps of its own: the fenced writer client, the removals of deleted exports' objects,
//! and each export's stale metric.

mod features;
pub(crate) mod metrics;
mod objects;
mod reconcile;
mod status;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::api::{ApiResource, DynamicObject};
use kube::{ResourceExt, core::GroupVersionKind};
use tokio::task::JoinHandle;

use super::feed::Ref;
use super::{Driver, Job, Next, ReconcileError, Reconciler};
use crate::leadership::Leadership;
use crate::vitals::Vitals;
use consul_resolver_api::export::ConsulService;
use consul_resolver_core::assembler::Snapshot;
use consul_resolver_core::assembler::snapshot::{ExportEntry, Part};
use consul_resolver_core::export::Desired;
pub(crate) use features::ServerFeatures;
use metrics::ExportMetrics;
pub(crate) use objects::SliceVersion;

/// The running ConsulService controller.
pub(crate) type ExportController = Driver<Exports>;

/// What the export controller keeps of its own.
pub(crate) struct Exports {
    /// Reads.
    client: kube::Client,
    /// Writes: the fenced client, whose request bodies leave only while this replica leads.
    writer: kube::Client,
    services: ApiResource,
    slices: ApiResource,
    /// Core Endpoints, for the exports that ask for them (`spec.endpoints`).
    endpoints: ApiResource,
    version: SliceVersion,
    /// The fields the API server knows beyond those of every supported version.
    features: ServerFeatures,
    /// The instance label's value (from `--ambassador-id`).
    instance: String,
    ambassador_id: String,
    metrics: ExportMetrics,
    /// Deleted exports: their Service and slices are removed, one task each.
    removals: Mutex<Vec<JoinHandle<()>>>,
}

impl Exports {
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

    /// The write-failing metric of an export: set while its status says `WriteFailed`,
    /// absent otherwise (so an export that recovers, turns invalid or goes leaves nothing).
    fn set_write_failing(&self, namespace: &str, name: &str, failing: bool) {
        if failing {
            self.metrics.write_failing.with_label_values(&[namespace, name]).set(1.0);
        } else {
            let _ = self.metrics.write_failing.remove_label_values(&[namespace, name]);
        }
    }
}

impl Reconciler for Exports {
    type Object = ConsulService;
    type Entry = ExportEntry;
    const NAME: &'static str = "export controller";
    const NOUN: &'static str = "export";
    /// Each export writes a Service and its slices, so fewer than the resolver controller's
    /// status writes.
    const CONCURRENCY: u16 = 4;
    const CUT_OFF: &'static str = "export writes in flight cut off (the next leader reconciles every export again)";

    fn entries(snapshot: &Snapshot) -> &[Part<ExportEntry>] {
        &snapshot.content.exports
    }

    fn object_of(entry: &ExportEntry) -> (&str, &str) {
        (&entry.namespace, &entry.name)
    }

    async fn reconcile(&self, obj: &DynamicObject, job: Job<ExportEntry>) -> Result<Next, ReconcileError> {
        reconcile::reconcile(self, obj, job).await
    }

    fn count(&self, result: Result<(), &'static str>, _: Duration) {
        let result = if result.is_ok() { "success" } else { "error" };
        self.metrics.reconciles.with_label_values(&[result]).inc();
    }

    /// An export gone has its Service, slices and Endpoints removed.
    fn gone(self: &Arc<Self>, gone: &DynamicObject, _: &Ref, leadership: &Leadership) {
        let (namespace, name) = (gone.namespace().unwrap_or_default(), gone.name_any());
        let uid = gone.uid().unwrap_or_default();
        self.forget_stale(&namespace, &name);
        self.set_write_failing(&namespace, &name, false);
        let (ctx, leadership) = (self.clone(), leadership.clone());
        let removal = tokio::spawn(async move {
            // Only the leader removes; a follower's export deletions are the leader's to
            // carry out (it sees them too).
            let Some(until) = leadership.until() else { return };
            if let Err(e) = reconcile::remove(&ctx, &namespace, &name, &uid, until).await {
                tracing::warn!(export = %format!("{namespace}/{name}"), error = %e,
                    "could not remove a deleted export's Service and slices (owner references remove them where a garbage collector runs)");
            }
        });
        let mut removals = self.removals.lock().expect("removals lock");
        removals.retain(|t| !t.is_finished());
        removals.push(removal);
    }

    fn stopped(&self) {
        for t in self.removals.lock().expect("removals lock").drain(..) {
            t.abort();
        }
    }
}

/// How the controller is set up.
pub(crate) struct ExportConfig {
    pub(crate) version: SliceVersion,
    pub(crate) features: ServerFeatures,
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
        let services = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "Service"), "services");
        let (group, version) = cfg.version.api_version().split_once('/').expect("group/version");
        let slices = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk(group, version, "EndpointSlice"),
            "endpointslices",
        );
        let endpoints = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "Endpoints"), "endpoints");
        let own = Exports {
            client,
            writer,
            services,
            slices,
            endpoints,
            version: cfg.version,
            features: cfg.features,
            instance: objects::instance_value(&cfg.ambassador_id),
            ambassador_id: cfg.ambassador_id,
            metrics: cfg.metrics,
            removals: Mutex::default(),
        };
        Driver::start(own, leadership, cfg.resync, vitals)
    }
}
