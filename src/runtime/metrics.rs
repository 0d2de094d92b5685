//! What the event loop measures of the pipeline: the bootstrap, the time to fold events in
//! and assemble, how events coalesce into publications and how long a change takes to be
//! published, and the last published snapshot (its id, size and problems). Each publisher's
//! own delivery is the publishers' (`crate::publishers::metrics`).

use prometheus::core::Collector;
use prometheus::{Gauge, Histogram, HistogramVec, IntCounter, IntGauge, Registry};

use crate::measure::{WORK_BUCKETS, counter, gauge, histogram, histogram_vec, int_gauge, register_all};

/// Buckets for change -> publication: the coalescing window (250 ms by default) plus the
/// publication, up to retries with backoff.
const LATENCY_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];

/// The pipeline's metrics. Cloning shares them.
#[derive(Clone)]
pub(crate) struct PipelineMetrics {
    pub bootstrapped: IntGauge,
    pub bootstrap_seconds: Gauge,
    pub assemble_seconds: HistogramVec,
    pub events_coalesced: IntCounter,
    pub publication_latency_seconds: Histogram,
    pub last_publication_timestamp: Gauge,
    pub unpublished_change_timestamp: Gauge,
    pub snapshots_published: IntCounter,
    pub snapshot_id: IntGauge,
    pub snapshot_bytes: IntGauge,
    pub problems: IntGauge,
    pub publish_seconds: Histogram,
    pub endpoints_over_budget: IntGauge,
}

impl PipelineMetrics {
    /// Metrics counted but exported nowhere (tests).
    pub(crate) fn unregistered() -> PipelineMetrics {
        PipelineMetrics {
            bootstrapped: int_gauge(
                "bootstrapped",
                "1 once the first snapshot was published (the world was complete, or past --bootstrap-timeout)",
            ),
            bootstrap_seconds: gauge(
                "bootstrap_duration_seconds",
                "Time from the start of the process to its first published snapshot",
            ),
            assemble_seconds: histogram_vec(
                "assemble_duration_seconds",
                "Time to fold a batch of events in and assemble (stage=apply), and to make a snapshot of it (stage=snapshot)",
                &["stage"],
                WORK_BUCKETS,
            ),
            events_coalesced: counter(
                "events_coalesced_total",
                "Events published together with an earlier one (a publication carrying N events counts N-1)",
            ),
            publication_latency_seconds: histogram(
                "publication_latency_seconds",
                "From the first event a publication carries to the end of that publication",
                LATENCY_BUCKETS,
            ),
            last_publication_timestamp: gauge(
                "last_publication_timestamp_seconds",
                "Unix time the last successful publication ended",
            ),
            unpublished_change_timestamp: gauge(
                "unpublished_change_timestamp_seconds",
                "Unix time of the oldest event not yet published (0: everything received is published)",
            ),
            snapshots_published: counter("snapshots_published_total", "Snapshots published"),
            snapshot_id: int_gauge("snapshot_id", "Id of the last published snapshot"),
            snapshot_bytes: int_gauge("snapshot_bytes", "Size of the last published snapshot's JSON"),
            problems: int_gauge("problems", "Problems reported in the last snapshot"),
            publish_seconds: histogram(
                "publish_duration_seconds",
                "Time to serve a new snapshot over HTTP and hand it to the other publishers",
                WORK_BUCKETS,
            ),
            endpoints_over_budget: int_gauge(
                "endpoints_watch_budget_exceeded",
                "1 while --namespace confines the operator and the namespaces of the Services routed to need more endpoints watches than --endpoints-watch-budget",
            ),
        }
    }

    pub(crate) fn register(registry: &Registry) -> prometheus::Result<PipelineMetrics> {
        let m = PipelineMetrics::unregistered();
        register_all(registry, m.collectors())?;
        // Series that exist from the start, so a `rate()` sees 0 rather than no series.
        for stage in ["apply", "snapshot"] {
            m.assemble_seconds.with_label_values(&[stage]);
        }
        Ok(m)
    }

    /// What [`PipelineMetrics::register`] registers.
    pub(crate) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.bootstrapped.clone()),
            Box::new(self.bootstrap_seconds.clone()),
            Box::new(self.assemble_seconds.clone()),
            Box::new(self.events_coalesced.clone()),
            Box::new(self.publication_latency_seconds.clone()),
            Box::new(self.last_publication_timestamp.clone()),
            Box::new(self.unpublished_change_timestamp.clone()),
            Box::new(self.snapshots_published.clone()),
            Box::new(self.snapshot_id.clone()),
            Box::new(self.snapshot_bytes.clone()),
            Box::new(self.problems.clone()),
            Box::new(self.publish_seconds.clone()),
            Box::new(self.endpoints_over_budget.clone()),
        ]
    }
}
