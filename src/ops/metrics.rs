//! Prometheus metrics. Labels never carry secrets: watch keys are counted by source, not
//! named (a Consul key holds a token).

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

#[derive(Clone)]
pub(crate) struct Metrics {
    registry: Registry,
    /// Watch failures by source and reason (`forbidden`, `bad_request`, `gone`, `transport`,
    /// ...): a rejected watch is reported on its object and counted here.
    pub watch_errors: IntCounterVec,
    /// Resolver reconciles by result (`success`, `error`), as controller-runtime counts them.
    pub reconciles: IntCounterVec,
    /// Failed resolver reconciles by reason (`conflict`, `timeout`, `not_leading`, ...).
    pub reconcile_errors: IntCounterVec,
    pub reconcile_seconds: Histogram,
    /// Events that could not be written (they never fail a reconcile).
    pub event_failures: IntCounter,
    /// Cluster copies found deleted or edited and written again, by what (`configmap`).
    pub repairs: IntCounterVec,
    pub snapshots_published: IntCounter,
    pub snapshot_id: IntGauge,
    pub publish_failures: IntCounterVec,
    pub publish_seconds: Histogram,
    pub watches: IntGaugeVec,
    pub events: IntCounterVec,
    pub bootstrapped: IntGauge,
    pub problems: IntGauge,
    pub leader: IntGauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub(crate) fn new() -> Self {
        let registry = Registry::new_custom(Some("consul_resolver".into()), None).expect("valid prefix");
        let m = Metrics {
            watch_errors: IntCounterVec::new(
                Opts::new("watch_errors_total", "Failed watches by source and reason"),
                &["source", "reason"],
            )
            .unwrap(),
            reconciles: IntCounterVec::new(
                Opts::new("reconcile_total", "ConsulResolver reconciles (status and Events) by result"),
                &["result"],
            )
            .unwrap(),
            reconcile_errors: IntCounterVec::new(
                Opts::new("reconcile_errors_total", "Failed ConsulResolver reconciles by reason"),
                &["reason"],
            )
            .unwrap(),
            reconcile_seconds: Histogram::with_opts(HistogramOpts::new(
                "reconcile_duration_seconds",
                "Time to reconcile one ConsulResolver (status and Events)",
            ))
            .unwrap(),
            event_failures: IntCounter::new("event_failures_total", "Events that could not be written").unwrap(),
            repairs: IntCounterVec::new(
                Opts::new("repairs_total", "Cluster copies found deleted or edited and written again"),
                &["object"],
            )
            .unwrap(),
            snapshots_published: IntCounter::new("snapshots_published_total", "Snapshots published").unwrap(),
            snapshot_id: IntGauge::new("snapshot_id", "Id of the last published snapshot").unwrap(),
            publish_failures: IntCounterVec::new(
                Opts::new(
                    "publish_failures_total",
                    "Failed publications (and checks of the snapshot ConfigMap) by publisher and reason",
                ),
                &["publisher", "reason"],
            )
            .unwrap(),
            publish_seconds: Histogram::with_opts(HistogramOpts::new(
                "publish_duration_seconds",
                "Time to publish one snapshot to every publisher",
            ))
            .unwrap(),
            watches: IntGaugeVec::new(Opts::new("watches", "Running watches by source"), &["source"]).unwrap(),
            events: IntCounterVec::new(Opts::new("events_total", "Events received by source"), &["source"]).unwrap(),
            bootstrapped: IntGauge::new("bootstrapped", "1 once the world is complete and a snapshot was published")
                .unwrap(),
            problems: IntGauge::new("problems", "Problems reported in the last snapshot").unwrap(),
            leader: IntGauge::new(
                "leader",
                "1 while this replica writes to the cluster (holds the lease, or runs without one)",
            )
            .unwrap(),
            registry,
        };
        for c in [
            Box::new(m.watch_errors.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(m.reconciles.clone()),
            Box::new(m.reconcile_errors.clone()),
            Box::new(m.reconcile_seconds.clone()),
            Box::new(m.event_failures.clone()),
            Box::new(m.repairs.clone()),
            Box::new(m.snapshots_published.clone()),
            Box::new(m.snapshot_id.clone()),
            Box::new(m.publish_failures.clone()),
            Box::new(m.publish_seconds.clone()),
            Box::new(m.watches.clone()),
            Box::new(m.events.clone()),
            Box::new(m.bootstrapped.clone()),
            Box::new(m.problems.clone()),
            Box::new(m.leader.clone()),
        ] {
            m.registry.register(c).expect("metric names are unique");
        }
        m
    }

    /// The Prometheus text exposition.
    pub(crate) fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf).expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prefixed_metrics() {
        let m = Metrics::new();
        m.snapshots_published.inc();
        m.watches.with_label_values(&["consul"]).set(3);
        let text = m.render();
        assert!(text.contains("consul_resolver_snapshots_published_total 1"), "{text}");
        assert!(text.contains("consul_resolver_watches{source=\"consul\"} 3"), "{text}");
    }
}
