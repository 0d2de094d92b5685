//! What the status controller measures: its reconciles (how many, how long, why they
//! failed), and the Events that could not be written (the resolvers' Warnings, and the
//! publishers' Events the runtime writes with the same counter).

use prometheus::core::Collector;
use prometheus::{Histogram, IntCounter, IntCounterVec, Registry};

use crate::measure::{WORK_BUCKETS, counter, counter_vec, histogram, register_all};

/// The status controller's metrics. Cloning shares them.
#[derive(Clone)]
pub(crate) struct ControllerMetrics {
    /// Resolver reconciles by result (`success`, `error`), as controller-runtime counts them.
    pub reconciles: IntCounterVec,
    /// Failed resolver reconciles by reason (`conflict`, `timeout`, `not_leading`, ...).
    pub reconcile_errors: IntCounterVec,
    pub reconcile_seconds: Histogram,
    /// Events that could not be written (they never fail a reconcile).
    pub event_failures: IntCounter,
}

impl ControllerMetrics {
    /// Metrics counted but exported nowhere (tests).
    pub(crate) fn unregistered() -> ControllerMetrics {
        ControllerMetrics {
            reconciles: counter_vec(
                "reconcile_total",
                "ConsulResolver reconciles (status and Events) by result",
                &["result"],
            ),
            reconcile_errors: counter_vec(
                "reconcile_errors_total",
                "Failed ConsulResolver reconciles by reason",
                &["reason"],
            ),
            reconcile_seconds: histogram(
                "reconcile_duration_seconds",
                "Time to reconcile one ConsulResolver (status and Events)",
                WORK_BUCKETS,
            ),
            event_failures: counter("event_failures_total", "Events that could not be written"),
        }
    }

    pub(crate) fn register(registry: &Registry) -> prometheus::Result<ControllerMetrics> {
        let m = ControllerMetrics::unregistered();
        register_all(registry, m.collectors())?;
        // Series that exist from the start, so a `rate()` sees 0 rather than no series.
        for result in ["success", "error"] {
            m.reconciles.with_label_values(&[result]);
        }
        Ok(m)
    }

    /// What [`ControllerMetrics::register`] registers.
    pub(crate) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.reconciles.clone()),
            Box::new(self.reconcile_errors.clone()),
            Box::new(self.reconcile_seconds.clone()),
            Box::new(self.event_failures.clone()),
        ]
    }
}
