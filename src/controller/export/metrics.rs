//! What the export controller measures: its reconciles, its writes (few writes is a
//! promise to every node's kube-proxy), how long each export's endpoints have been stale,
//! and which exports cannot be written.

use prometheus::core::Collector;
use prometheus::{GaugeVec, IntCounterVec, Opts, Registry};

use crate::measure::{counter_vec, register_all};

#[derive(Clone)]
pub(crate) struct ExportMetrics {
    /// Reconciles by result (`success`, `error`).
    pub reconciles: IntCounterVec,
    /// Writes to the API server by object (`service`, `endpointslice`) and verb (`apply`,
    /// `delete`).
    pub writes: IntCounterVec,
    /// Per export holding endpoints last obtained: since when (Unix seconds). Its age is
    /// `time() - consul_resolver_export_stale_since_timestamp_seconds`.
    pub stale_since: GaugeVec,
    /// Per export whose last reconcile could not read or write its objects (its status says
    /// `Exported=False`, `WriteFailed`): 1, absent otherwise. Nothing else says which export
    /// fails: the reconcile counter has no export label, and the status is not scraped.
    pub write_failing: GaugeVec,
}

impl ExportMetrics {
    pub(crate) fn unregistered() -> ExportMetrics {
        ExportMetrics {
            reconciles: counter_vec("export_reconcile_total", "ConsulService reconciles by result", &["result"]),
            writes: counter_vec(
                "export_writes_total",
                "Services and EndpointSlices written or deleted for exports",
                &["object", "verb"],
            ),
            stale_since: GaugeVec::new(
                Opts::new(
                    "export_stale_since_timestamp_seconds",
                    "Since when an export's endpoints have been the ones last obtained (absent when current)",
                ),
                &["namespace", "name"],
            )
            .expect("a valid metric"),
            write_failing: GaugeVec::new(
                Opts::new(
                    "export_write_failing",
                    "1 while an export's objects could not be read or written (status WriteFailed; absent otherwise)",
                ),
                &["namespace", "name"],
            )
            .expect("a valid metric"),
        }
    }

    pub(crate) fn register(registry: &Registry) -> prometheus::Result<ExportMetrics> {
        let m = ExportMetrics::unregistered();
        register_all(registry, m.collectors())?;
        for result in ["success", "error"] {
            m.reconciles.with_label_values(&[result]);
        }
        Ok(m)
    }

    pub(crate) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.reconciles.clone()),
            Box::new(self.writes.clone()),
            Box::new(self.stale_since.clone()),
            Box::new(self.write_failing.clone()),
        ]
    }
}
