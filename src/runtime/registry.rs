//! Prometheus metrics, every one listed in docs/metrics.md (a unit test checks the list).
//!
//! Names are `consul_resolver_*` in base units (`_seconds`, `_bytes`, `_total` for
//! counters), plus the standard `process_*` of this process. Labels are bounded: sources,
//! reasons and outcomes are fixed sets, and the only names are a resolver's namespace and
//! name (bounded by the objects). Never a Consul service name or a watch key (a Consul key
//! holds a token), never a token.
//!
//! Each subsystem defines and registers its own group, beside the code that measures it
//! (`sources::metrics`, `runtime::metrics`, `publishers::metrics`, `controller::metrics`,
//! `leadership::LeadershipMetrics`, `health::LivenessMetrics`, `server::ServerMetrics`);
//! [`Metrics`] holds one of each in one registry, and renders them for `/metrics` (the ops
//! server gets only the rendering, so `ops` depends on no subsystem). It lives with the
//! runtime, which builds every subsystem: the groups are below it, never the other way.

use prometheus::{Encoder, Registry, TextEncoder};

use super::metrics::PipelineMetrics;
use crate::controller::export::metrics::ExportMetrics;
use crate::controller::resolver::metrics::ControllerMetrics;
use crate::leadership::LeadershipMetrics;
use crate::measure::int_gauge_vec;
use crate::ops::health::LivenessMetrics;
use crate::ops::server::ServerMetrics;
use crate::publishers::metrics::PublisherMetrics;
use crate::sources::metrics::SourceMetrics;

/// Every group of metrics, registered in one registry. Cloning shares them.
#[derive(Clone)]
pub(crate) struct Metrics {
    registry: Registry,
    /// The standard `process_*` metrics, unprefixed (dashboards expect these names), and
    /// those of the crates that name their own in full (`consul_resolver_xds_*`).
    process: Registry,
    pub sources: SourceMetrics,
    pub pipeline: PipelineMetrics,
    pub publishers: PublisherMetrics,
    pub controller: ControllerMetrics,
    pub exports: ExportMetrics,
    pub leadership: LeadershipMetrics,
    pub liveness: LivenessMetrics,
    /// The ops server's connections.
    pub ops_server: ServerMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub(crate) fn new() -> Self {
        let registry = Registry::new_custom(Some("consul_resolver".into()), None).expect("valid prefix");
        let unique = "metric names are unique";
        let build_info =
            int_gauge_vec("build_info", "Always 1; the labels say which build runs", &["version", "revision"]);
        build_info.with_label_values(&[env!("CARGO_PKG_VERSION"), option_env!("BUILD_REVISION").unwrap_or("")]).set(1);
        registry.register(Box::new(build_info)).expect(unique);
        let process = Registry::new();
        #[cfg(target_os = "linux")]
        process
            .register(Box::new(prometheus::process_collector::ProcessCollector::for_self()))
            .expect("one process collector");
        Metrics {
            sources: SourceMetrics::register(&registry).expect(unique),
            pipeline: PipelineMetrics::register(&registry).expect(unique),
            publishers: PublisherMetrics::register(&registry).expect(unique),
            controller: ControllerMetrics::register(&registry).expect(unique),
            exports: ExportMetrics::register(&registry).expect(unique),
            leadership: LeadershipMetrics::register(&registry).expect(unique),
            liveness: LivenessMetrics::register(&registry).expect(unique),
            ops_server: ServerMetrics::register(&registry).expect(unique),
            process,
            registry,
        }
    }

    /// Where a crate registers metrics it names in full.
    pub(crate) fn unprefixed(&self) -> &Registry {
        &self.process
    }

    /// The Prometheus text exposition.
    pub(crate) fn render(&self) -> String {
        self.sources.refresh();
        self.liveness.refresh();
        let mut families = self.registry.gather();
        families.extend(self.process.gather());
        let mut buf = Vec::new();
        TextEncoder::new().encode(&families, &mut buf).expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::core::Collector;

    #[test]
    fn renders_prefixed_metrics_and_process_ones() {
        let m = Metrics::new();
        m.pipeline.snapshots_published.inc();
        m.sources.watches.with_label_values(&["consul"]).set(3);
        let text = m.render();
        assert!(text.contains("consul_resolver_snapshots_published_total 1"), "{text}");
        assert!(text.contains("consul_resolver_watches{source=\"consul\"} 3"), "{text}");
        assert!(text.contains("consul_resolver_watches{source=\"kubernetes\"} 0"), "{text}");
        assert!(text.contains("consul_resolver_build_info{revision="), "{text}");
        #[cfg(target_os = "linux")]
        assert!(text.contains("\nprocess_resident_memory_bytes "), "{text}");
    }

    #[tokio::test]
    async fn runtime_tasks_count_the_tasks_alive_at_the_scrape() {
        let m = Metrics::new();
        let tasks = |text: &str| -> i64 {
            let line = text.lines().find(|l| l.starts_with("consul_resolver_runtime_tasks ")).expect("the gauge");
            line.rsplit(' ').next().and_then(|v| v.parse().ok()).expect("a number")
        };
        let before = tasks(&m.render());
        // Three tasks parked until the sender goes.
        let (stop, stopped) = tokio::sync::watch::channel(());
        let parked: Vec<_> = (0..3)
            .map(|_| {
                let mut stopped = stopped.clone();
                tokio::spawn(async move { while stopped.changed().await.is_ok() {} })
            })
            .collect();
        assert_eq!(tasks(&m.render()), before + 3);
        drop(stop);
        for task in parked {
            task.await.unwrap();
        }
        assert_eq!(tasks(&m.render()), before);
    }

    /// The collectors each group registers of its own (the Consul source's are gathered:
    /// every one of its vectors has label values from the start).
    fn collectors(m: &Metrics) -> Vec<Box<dyn Collector>> {
        [
            m.sources.collectors(),
            m.pipeline.collectors(),
            m.publishers.collectors(),
            m.controller.collectors(),
            m.exports.collectors(),
            m.leadership.collectors(),
            m.liveness.collectors(),
            m.ops_server.collectors(),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    /// docs/metrics.md lists every metric this process exposes, and nothing else.
    #[test]
    fn docs_list_every_metric() {
        let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/metrics.md")).unwrap();
        let documented: std::collections::BTreeSet<&str> = docs
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .filter_map(|l| l.split('`').next())
            .map(|name| name.split('{').next().unwrap_or(name))
            .filter(|name| name.starts_with("consul_resolver_") || name.starts_with("process_"))
            .collect();
        let m = Metrics::new();
        let mut exposed: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
        for f in m.registry.gather().iter().chain(m.process.gather().iter()) {
            exposed.insert(f.name().to_owned());
        }
        // Vectors without any label value yet are not gathered: name them from their
        // collectors' descriptions.
        for c in collectors(&m) {
            for d in c.desc() {
                exposed.insert(format!("consul_resolver_{}", d.fq_name));
            }
        }
        // With --xds-listen, the xDS server's own, named in full.
        exposed.extend(consul_resolver_xds::XdsServer::new().metric_names());
        let exposed: std::collections::BTreeSet<&str> = exposed.iter().map(String::as_str).collect();
        let missing: Vec<_> = exposed.difference(&documented).collect();
        let extra: Vec<_> = documented.difference(&exposed).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "not in docs/metrics.md: {missing:?}; documented but not exposed: {extra:?}"
        );
    }
}
