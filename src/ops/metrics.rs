//! Prometheus metrics, every one listed in docs/metrics.md (a unit test checks the list).
//!
//! Names are `consul_resolver_*` in base units (`_seconds`, `_bytes`, `_total` for
//! counters), plus the standard `process_*` of this process. Labels are bounded: sources,
//! reasons and outcomes are fixed sets, and the only names are a resolver's namespace and
//! name (bounded by the objects). Never a Consul service name or a watch key (a Consul key
//! holds a token), never a token.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus::core::Collector;
use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

use consul_resolver_core::keys::ConsulKey;

/// Buckets for work done in memory (assembly, one publisher, a reconcile): 1 ms to 1 min.
const WORK_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// Buckets for change -> publication: the coalescing window (250 ms by default) plus the
/// publication, up to retries with backoff.
const LATENCY_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];

#[derive(Clone)]
pub(crate) struct Metrics {
    registry: Registry,
    /// The standard `process_*` metrics, unprefixed (dashboards expect these names).
    process: Registry,
    /// The Consul source's own metrics (`consul_requests_total`, ...), registered by it.
    pub consul: consul_watch::Metrics,
    /// The ops server's connections, registered by it.
    pub ops_server: super::server::ServerMetrics,
    /// Per resolver: when its Consul was last reached, exported at each scrape.
    pub consul_contact: Arc<ConsulContact>,
    consul_last_success: GaugeVec,
    consul_last_failure: GaugeVec,

    // Sources.
    /// Failed watches by source and reason (`forbidden`, `bad_request`, `gone`, `transport`,
    /// `403`, `5xx`, ...): a rejected watch is reported on its object and counted here.
    pub watch_errors: IntCounterVec,
    pub watch_starts: IntCounterVec,
    pub watch_stops: IntCounterVec,
    /// Watches that started over from a full read, by source and why.
    pub watch_restarts: IntCounterVec,
    pub watches: IntGaugeVec,
    pub events: IntCounterVec,
    /// Watches without a first list (Kubernetes) or answer (Consul) yet.
    pub unsynced_watches: IntGaugeVec,
    pub unsynced_oldest_seconds: GaugeVec,

    // Pipeline and publication.
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
    pub configmap_parts: IntGauge,
    pub problems: IntGauge,
    pub publish_failures: IntCounterVec,
    pub publish_seconds: Histogram,
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

    // Status controller.
    /// Resolver reconciles by result (`success`, `error`), as controller-runtime counts them.
    pub reconciles: IntCounterVec,
    /// Failed resolver reconciles by reason (`conflict`, `timeout`, `not_leading`, ...).
    pub reconcile_errors: IntCounterVec,
    pub reconcile_seconds: Histogram,
    /// Events that could not be written (they never fail a reconcile).
    pub event_failures: IntCounter,

    // Leadership and liveness.
    pub leader: IntGauge,
    pub leader_transitions: IntCounterVec,
    pub heartbeat_timestamp: Gauge,
    /// Tasks alive in the async runtime, read at each scrape: a task that outlives its
    /// watch (a leak) shows as steady growth (the soak benchmark follows it).
    runtime_tasks: IntGauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
}

fn histogram(name: &str, help: &str, buckets: &[f64]) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec())).expect("valid metric")
}

fn histogram_vec(name: &str, help: &str, labels: &[&str], buckets: &[f64]) -> HistogramVec {
    HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets.to_vec()), labels).expect("valid metric")
}

fn gauge(name: &str, help: &str) -> Gauge {
    Gauge::new(name, help).expect("valid metric")
}

fn int_gauge(name: &str, help: &str) -> IntGauge {
    IntGauge::new(name, help).expect("valid metric")
}

impl Metrics {
    pub(crate) fn new() -> Self {
        let registry = Registry::new_custom(Some("consul_resolver".into()), None).expect("valid prefix");
        let resolver = &["resolver_namespace", "resolver_name"];
        let mut m = Metrics {
            consul: consul_watch::Metrics::unregistered(),
            ops_server: super::server::ServerMetrics::unregistered(),
            consul_contact: Arc::default(),
            consul_last_success: GaugeVec::new(
                Opts::new(
                    "consul_last_success_timestamp_seconds",
                    "Unix time Consul last answered a request of the resolver's scope (2xx, or a 4xx: it is there and decided)",
                ),
                resolver,
            )
            .expect("valid metric"),
            consul_last_failure: GaugeVec::new(
                Opts::new(
                    "consul_last_failure_timestamp_seconds",
                    "Unix time a request of the resolver's scope last got no answer from Consul (transport, timeout, 5xx)",
                ),
                resolver,
            )
            .expect("valid metric"),
            watch_errors: counter_vec("watch_errors_total", "Failed watches by source and reason", &["source", "reason"]),
            watch_starts: counter_vec("watch_starts_total", "Watches started by source", &["source"]),
            watch_stops: counter_vec("watch_stops_total", "Watches stopped by source", &["source"]),
            watch_restarts: counter_vec(
                "watch_restarts_total",
                "Watches that started over from a full read (a relist, a Consul read without index), by source and reason",
                &["source", "reason"],
            ),
            watches: IntGaugeVec::new(Opts::new("watches", "Running watches by source"), &["source"])
                .expect("valid metric"),
            events: counter_vec("events_total", "Events received by source", &["source"]),
            unsynced_watches: IntGaugeVec::new(
                Opts::new("unsynced_watches", "Running watches without a first list or answer yet, by source"),
                &["source"],
            )
            .expect("valid metric"),
            unsynced_oldest_seconds: GaugeVec::new(
                Opts::new(
                    "unsynced_watch_oldest_seconds",
                    "How long the oldest unsynced watch has waited for its first list or answer (0: none), by source",
                ),
                &["source"],
            )
            .expect("valid metric"),
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
            events_coalesced: IntCounter::new(
                "events_coalesced_total",
                "Events published together with an earlier one (a publication carrying N events counts N-1)",
            )
            .expect("valid metric"),
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
            snapshots_published: IntCounter::new("snapshots_published_total", "Snapshots published")
                .expect("valid metric"),
            snapshot_id: int_gauge("snapshot_id", "Id of the last published snapshot"),
            snapshot_bytes: int_gauge("snapshot_bytes", "Size of the last published snapshot's JSON"),
            configmap_parts: int_gauge(
                "snapshot_configmap_parts",
                "Part ConfigMaps of the last snapshot this replica wrote (0: it fit in one ConfigMap)",
            ),
            problems: int_gauge("problems", "Problems reported in the last snapshot"),
            publish_failures: counter_vec(
                "publish_failures_total",
                "Failed publications (and checks of the snapshot ConfigMap) by publisher and reason",
                &["publisher", "reason"],
            ),
            publish_seconds: histogram(
                "publish_duration_seconds",
                "Time to serve a new snapshot over HTTP and hand it to the other publishers",
                WORK_BUCKETS,
            ),
            publisher_seconds: histogram_vec(
                "publisher_duration_seconds",
                "Time one attempt of one publisher to deliver a snapshot took, by publisher",
                &["publisher"],
                WORK_BUCKETS,
            ),
            publisher_failing: IntGaugeVec::new(
                Opts::new("publisher_failing", "1 while a publisher's last attempt failed (it retries on its own)"),
                &["publisher"],
            )
            .expect("valid metric"),
            publisher_snapshot_id: IntGaugeVec::new(
                Opts::new("publisher_snapshot_id", "Id of the last snapshot a publisher delivered"),
                &["publisher"],
            )
            .expect("valid metric"),
            hook_runs: IntCounter::new("hook_runs_total", "--on-snapshot commands run").expect("valid metric"),
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
            reconciles: counter_vec(
                "reconcile_total",
                "ConsulResolver reconciles (status and Events) by result",
                &["result"],
            ),
            reconcile_errors: counter_vec("reconcile_errors_total", "Failed ConsulResolver reconciles by reason", &["reason"]),
            reconcile_seconds: histogram(
                "reconcile_duration_seconds",
                "Time to reconcile one ConsulResolver (status and Events)",
                WORK_BUCKETS,
            ),
            event_failures: IntCounter::new("event_failures_total", "Events that could not be written")
                .expect("valid metric"),
            leader: int_gauge(
                "leader",
                "1 while this replica writes to the cluster (holds the lease, or runs without one)",
            ),
            leader_transitions: counter_vec(
                "leader_transitions_total",
                "This replica's leadership changes (transition=acquired, lost)",
                &["transition"],
            ),
            heartbeat_timestamp: gauge(
                "heartbeat_timestamp_seconds",
                "Unix time the event loop last turned (it turns at least every second; /healthz fails when it stops)",
            ),
            runtime_tasks: int_gauge(
                "runtime_tasks",
                "Tasks alive in the operator's async runtime, read at each scrape (steady growth is a leak)",
            ),
            process: Registry::new(),
            registry,
        };
        let build_info = IntGaugeVec::new(
            Opts::new("build_info", "Always 1; the labels say which build runs"),
            &["version", "revision"],
        )
        .expect("valid metric");
        build_info.with_label_values(&[env!("CARGO_PKG_VERSION"), option_env!("BUILD_REVISION").unwrap_or("")]).set(1);
        let collectors: Vec<Box<dyn Collector>> = vec![
            Box::new(build_info),
            Box::new(m.consul_last_success.clone()),
            Box::new(m.consul_last_failure.clone()),
            Box::new(m.watch_errors.clone()),
            Box::new(m.watch_starts.clone()),
            Box::new(m.watch_stops.clone()),
            Box::new(m.watch_restarts.clone()),
            Box::new(m.watches.clone()),
            Box::new(m.events.clone()),
            Box::new(m.unsynced_watches.clone()),
            Box::new(m.unsynced_oldest_seconds.clone()),
            Box::new(m.bootstrapped.clone()),
            Box::new(m.bootstrap_seconds.clone()),
            Box::new(m.assemble_seconds.clone()),
            Box::new(m.events_coalesced.clone()),
            Box::new(m.publication_latency_seconds.clone()),
            Box::new(m.last_publication_timestamp.clone()),
            Box::new(m.unpublished_change_timestamp.clone()),
            Box::new(m.snapshots_published.clone()),
            Box::new(m.snapshot_id.clone()),
            Box::new(m.snapshot_bytes.clone()),
            Box::new(m.configmap_parts.clone()),
            Box::new(m.problems.clone()),
            Box::new(m.publish_failures.clone()),
            Box::new(m.publish_seconds.clone()),
            Box::new(m.publisher_seconds.clone()),
            Box::new(m.publisher_failing.clone()),
            Box::new(m.publisher_snapshot_id.clone()),
            Box::new(m.hook_runs.clone()),
            Box::new(m.hook_failures.clone()),
            Box::new(m.hook_seconds.clone()),
            Box::new(m.repairs.clone()),
            Box::new(m.reconciles.clone()),
            Box::new(m.reconcile_errors.clone()),
            Box::new(m.reconcile_seconds.clone()),
            Box::new(m.event_failures.clone()),
            Box::new(m.leader.clone()),
            Box::new(m.leader_transitions.clone()),
            Box::new(m.heartbeat_timestamp.clone()),
            Box::new(m.runtime_tasks.clone()),
        ];
        for c in collectors {
            m.registry.register(c).expect("metric names are unique");
        }
        m.consul = consul_watch::Metrics::register(&m.registry, m.watch_errors.clone(), m.watch_restarts.clone())
            .expect("metric names are unique");
        m.ops_server = super::server::ServerMetrics::register(&m.registry).expect("metric names are unique");
        // Label values that exist from the start, so a dashboard or alert sees 0 rather
        // than no series (a `rate()` over a counter that appears at 1 misses that 1).
        for source in ["kubernetes", "consul"] {
            m.watches.with_label_values(&[source]).set(0);
            m.watch_starts.with_label_values(&[source]);
            m.watch_stops.with_label_values(&[source]);
            m.events.with_label_values(&[source]);
            m.unsynced_watches.with_label_values(&[source]).set(0);
            m.unsynced_oldest_seconds.with_label_values(&[source]).set(0.0);
        }
        for stage in ["apply", "snapshot"] {
            m.assemble_seconds.with_label_values(&[stage]);
        }
        for result in ["success", "error"] {
            m.reconciles.with_label_values(&[result]);
        }
        #[cfg(target_os = "linux")]
        m.process
            .register(Box::new(prometheus::process_collector::ProcessCollector::for_self()))
            .expect("one process collector");
        m
    }

    /// The Prometheus text exposition.
    pub(crate) fn render(&self) -> String {
        self.consul_contact.export(self.consul.contact(), &self.consul_last_success, &self.consul_last_failure);
        // Scrapes are served on the runtime; outside one (a unit test) the gauge stays as is.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let alive = runtime.metrics().num_alive_tasks();
            self.runtime_tasks.set(i64::try_from(alive).unwrap_or(i64::MAX));
        }
        let mut families = self.registry.gather();
        families.extend(self.process.gather());
        let mut buf = Vec::new();
        TextEncoder::new().encode(&families, &mut buf).expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }
}

/// Seconds since the Unix epoch, for `_timestamp_seconds` gauges.
pub(crate) fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// Which Consul scope (see [`consul_watch::contact_scope`]) each resolver queries, as the
/// runtime reads the resolvers: joined at each scrape with the Consul source's contact
/// times into per-resolver timestamps. The scopes hold tokens: they stay in memory, only
/// the resolvers' names are exported.
#[derive(Default)]
pub(crate) struct ConsulContact {
    resolvers: Mutex<BTreeMap<(String, String), ConsulKey>>,
}

impl ConsulContact {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, String), ConsulKey>> {
        self.resolvers.lock().expect("consul contact poisoned")
    }

    /// The resolvers in scope and the Consul scope of each (usable ones only). Scopes no
    /// resolver names any more are forgotten by `contact`.
    pub(crate) fn set_resolvers(
        &self,
        contact: &consul_watch::Contact,
        resolvers: BTreeMap<(String, String), ConsulKey>,
    ) {
        contact.retain(&resolvers.values().collect());
        *self.lock() = resolvers;
    }

    fn export(&self, contact: &consul_watch::Contact, success: &GaugeVec, failure: &GaugeVec) {
        success.reset();
        failure.reset();
        for ((ns, name), scope) in self.lock().iter() {
            let last = contact.last(scope);
            if let Some(t) = last.success {
                success.with_label_values(&[ns, name]).set(unix_seconds(t));
            }
            if let Some(t) = last.failure {
                failure.with_label_values(&[ns, name]).set(unix_seconds(t));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use consul_resolver_core::keys::{ConsulServer, QueryOptions, Secret};
    use consul_watch::contact_scope;
    use std::time::Duration;

    #[test]
    fn renders_prefixed_metrics_and_process_ones() {
        let m = Metrics::new();
        m.snapshots_published.inc();
        m.watches.with_label_values(&["consul"]).set(3);
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

    fn key(token: &str, service: &str) -> ConsulKey {
        ConsulKey {
            server: ConsulServer {
                address: "http://127.0.0.1:8500".into(),
                token: Some(Secret::new(token)),
                tls: None,
            },
            datacenter: Some("dc1".into()),
            namespace: None,
            partition: None,
            remote: None,
            query: QueryOptions { cached: true, ..QueryOptions::default() },
            service: service.into(),
        }
    }

    #[test]
    fn contact_is_per_resolver_and_never_shows_the_token() {
        let m = Metrics::new();
        let t0 = UNIX_EPOCH + Duration::from_secs(1_000);
        let scope = contact_scope(&key("s3cret-token", "web"));
        assert_eq!(scope, contact_scope(&key("s3cret-token", "api")), "one scope for every service");
        assert_ne!(scope, contact_scope(&key("other", "web")), "a token is another scope (ACLs)");
        m.consul_contact.set_resolvers(
            m.consul.contact(),
            BTreeMap::from([
                (("shop".into(), "consul".into()), scope.clone()),
                (("pay".into(), "consul".into()), contact_scope(&key("other", "x"))),
            ]),
        );
        m.consul.contact().record(&scope, true, t0);
        m.consul.contact().record(&scope, false, t0 + Duration::from_secs(5));
        let text = m.render();
        assert!(
            text.contains(
                "consul_resolver_consul_last_success_timestamp_seconds{resolver_name=\"consul\",resolver_namespace=\"shop\"} 1000"
            ),
            "{text}"
        );
        assert!(text.contains(
            "consul_last_failure_timestamp_seconds{resolver_name=\"consul\",resolver_namespace=\"shop\"} 1005"
        ));
        assert!(!text.contains("resolver_namespace=\"pay\""), "no contact yet, no series: {text}");
        assert!(!text.contains("s3cret"), "{text}");
        // A resolver that goes takes its series, and its scope's record, with it.
        m.consul_contact.set_resolvers(m.consul.contact(), BTreeMap::new());
        assert!(!m.render().contains("resolver_namespace=\"shop\""));
        assert_eq!(m.consul.contact().last(&scope), Default::default(), "the scope's record is forgotten");
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
        for c in [&m.consul_last_success as &dyn Collector, &m.consul_last_failure, &m.watch_errors, &m.watch_restarts]
            .into_iter()
            .chain([&m.publish_failures as &dyn Collector, &m.publisher_seconds, &m.hook_failures])
            .chain([&m.repairs as &dyn Collector, &m.reconcile_errors, &m.leader_transitions])
            .chain([&m.publisher_failing as &dyn Collector, &m.publisher_snapshot_id])
        {
            for d in c.desc() {
                exposed.insert(format!("consul_resolver_{}", d.fq_name));
            }
        }
        let exposed: std::collections::BTreeSet<&str> = exposed.iter().map(String::as_str).collect();
        let missing: Vec<_> = exposed.difference(&documented).collect();
        let extra: Vec<_> = documented.difference(&exposed).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "not in docs/metrics.md: {missing:?}; documented but not exposed: {extra:?}"
        );
    }
}
