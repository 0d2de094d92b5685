//! What the publishers that can fail (the hook, the ConfigMap) measure: each attempt to
//! deliver a snapshot, by publisher (its duration, failures, whether it is failing now and
//! what it delivered last, counted by the runtime's outlet that drives it), the hook's
//! command runs, and the ConfigMap's repairs and part count.

use prometheus::core::Collector;
use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry};

use crate::measure::{
    WORK_BUCKETS, counter, counter_vec, histogram, histogram_vec, int_gauge, int_gauge_vec, register_all,
};

/// The publishers' metrics. Cloning shares them.
#[derive(Clone)]
pub(crate) struct PublisherMetrics {
    pub publish_failures: IntCounterVec,
    pub publisher_seconds: HistogramVec,
    /// 1 while a publisher's last attempt failed (it retries on its own), by publisher.
    pub publisher_failing: IntGaugeVec,
    /// The id of the last snapshot a publisher delivered, by publisher.
    pub publisher_snapshot_id: IntGaugeVec,
    pub hook_runs: IntCounter,
    pub hook_failures: IntCounterVec,
    pub hook_seconds: Histogram,
    /// Cluster copies found deleted or edited and written again, by what (`configmap`).
    pub repairs: IntCounterVec,
    pub configmap_parts: IntGauge,
}

impl PublisherMetrics {
    /// Metrics counted but exported nowhere (tests).
    pub(crate) fn unregistered() -> PublisherMetrics {
        PublisherMetrics {
            publish_failures: counter_vec(
                "publish_failures_total",
                "Failed publications (and checks of the snapshot ConfigMap) by publisher and reason",
                &["publisher", "reason"],
            ),
            publisher_seconds: histogram_vec(
                "publisher_duration_seconds",
                "Time one attempt of one publisher to deliver a snapshot took, by publisher",
                &["publisher"],
                WORK_BUCKETS,
            ),
            publisher_failing: int_gauge_vec(
                "publisher_failing",
                "1 while a publisher's last attempt failed (it retries on its own)",
                &["publisher"],
            ),
            publisher_snapshot_id: int_gauge_vec(
                "publisher_snapshot_id",
                "Id of the last snapshot a publisher delivered",
                &["publisher"],
            ),
            hook_runs: counter("hook_runs_total", "--on-snapshot commands run"),
            hook_failures: counter_vec(
                "hook_failures_total",
                "--on-snapshot commands that failed, by reason (hook_exit, hook_timeout, hook_start, io)",
                &["reason"],
            ),
            hook_seconds: histogram(
                "hook_duration_seconds",
                "Time an --on-snapshot command ran (writing its file included)",
                WORK_BUCKETS,
            ),
            repairs: counter_vec(
                "repairs_total",
                "Cluster copies found deleted or edited and written again",
                &["object"],
            ),
            configmap_parts: int_gauge(
                "snapshot_configmap_parts",
                "Part ConfigMaps of the last snapshot this replica wrote (0: it fit in one ConfigMap)",
            ),
        }
    }

    pub(crate) fn register(registry: &Registry) -> prometheus::Result<PublisherMetrics> {
        let m = PublisherMetrics::unregistered();
        register_all(registry, m.collectors())?;
        Ok(m)
    }

    /// What [`PublisherMetrics::register`] registers.
    pub(crate) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.publish_failures.clone()),
            Box::new(self.publisher_seconds.clone()),
            Box::new(self.publisher_failing.clone()),
            Box::new(self.publisher_snapshot_id.clone()),
            Box::new(self.hook_runs.clone()),
            Box::new(self.hook_failures.clone()),
            Box::new(self.hook_seconds.clone()),
            Box::new(self.repairs.clone()),
            Box::new(self.configmap_parts.clone()),
        ]
    }
}
