//! What the Consul source measures, registered here, beside the code that measures it.
//!
//! Labels are bounded: queries, modes and outcomes are fixed sets. Never an address, a
//! service name or a key (a key holds a token). Per-scope contact times are kept in memory
//! ([`Contact`]) for the embedding program to export under names it chooses (the operator
//! exports them per resolver).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use consul_resolver_core::keys::{ConsulKey, QueryOptions, QueryScope};

/// Buckets for Consul requests: a non-blocking read takes milliseconds, a blocking one up
/// to its `wait` (5 min by default, Consul's cap 10 min) and a little more.
const REQUEST_BUCKETS: &[f64] =
    &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 330.0, 600.0, 660.0];

/// Which query a request is (a bounded label).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Query {
    /// `/v1/health/service` (or `connect`): a watch's own query.
    Service,
    /// `/v1/health/state/any`: the change feed's checks.
    Checks,
    /// `/v1/catalog/services`: the change feed's registrations.
    Catalog,
    /// `/v1/health/state/critical`: the change feed's critical checks.
    Critical,
    /// `/v1/health/state/warning`: the change feed's warning checks.
    Warning,
    /// `/v1/catalog/nodes` and `/v1/catalog/node-services/<node>`: the change feed naming
    /// what a catalog move wrote when the checks do not say (`locate.rs`).
    Locate,
    /// `/v1/status/leader`: whether a server that seems gone answers (one probe per server).
    Probe,
}

impl Query {
    /// The queries that block on Consul's index: an answer without one is counted under
    /// their label (`consul_unindexed_answers_total`).
    pub(crate) const BLOCKING: [Query; 5] =
        [Query::Service, Query::Checks, Query::Catalog, Query::Critical, Query::Warning];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Query::Service => "service",
            Query::Checks => "checks",
            Query::Catalog => "catalog",
            Query::Critical => "critical",
            Query::Warning => "warning",
            Query::Locate => "locate",
            Query::Probe => "probe",
        }
    }
}

/// The Consul source's metrics. Cloning shares them.
#[derive(Clone)]
pub struct Metrics {
    /// `consul_requests_total{query,mode,outcome}`.
    pub(crate) requests: IntCounterVec,
    /// `consul_request_duration_seconds{mode}`.
    pub(crate) request_seconds: HistogramVec,
    /// The `source="consul"` children of the embedding program's `watch_errors_total` and
    /// `watch_restarts_total{source,reason}` (one family for every source).
    pub(crate) errors: IntCounterVec,
    pub(crate) restarts: IntCounterVec,
    /// `consul_watches{mode}`: watches by how they follow their service.
    pub(crate) watches: IntGaugeVec,
    /// `consul_feeds`: change feeds running, every server's ([`GaugeShare`]).
    pub(crate) feeds: IntGauge,
    /// `consul_feeds_short_of_status_lanes`: feeds that asked for the lanes of their
    /// critical and warning checks' queries and were not given them, every server's.
    pub(crate) feeds_short_of_status_lanes: IntGauge,
    /// `consul_unreachable_servers`: servers that do not answer (their watches wait).
    pub(crate) unreachable_servers: IntGauge,
    /// `consul_unindexed_answers_total{query}`: answers without `X-Consul-Index`, which no
    /// query can block on.
    pub(crate) unindexed: IntCounterVec,
    pub(crate) contact: Arc<Contact>,
    /// Where a task of the source that keeps panicking is reported (not a metric: the
    /// embedding program's health check), shared as the counters are.
    pub(crate) failing: crate::restart::Failing,
}

impl Metrics {
    /// Registers the source's own metrics in `registry`; `watch_errors` and
    /// `watch_restarts` are families `{source, reason}` the caller shares between its
    /// sources (and registers itself).
    pub fn register(
        registry: &Registry,
        watch_errors: IntCounterVec,
        watch_restarts: IntCounterVec,
    ) -> prometheus::Result<Metrics> {
        let m = Metrics { errors: watch_errors, restarts: watch_restarts, ..Metrics::unregistered() };
        registry.register(Box::new(m.requests.clone()))?;
        registry.register(Box::new(m.request_seconds.clone()))?;
        registry.register(Box::new(m.watches.clone()))?;
        registry.register(Box::new(m.feeds.clone()))?;
        registry.register(Box::new(m.feeds_short_of_status_lanes.clone()))?;
        registry.register(Box::new(m.unreachable_servers.clone()))?;
        registry.register(Box::new(m.unindexed.clone()))?;
        for mode in ["unplaced", "dedicated", "multiplexed", "fed", "swept"] {
            m.watches.with_label_values(&[mode]).set(0);
        }
        // Series that exist from the start, so a `rate()` sees 0 rather than no series.
        for mode in ["blocking", "read"] {
            m.request_seconds.with_label_values(&[mode]);
            m.requests.with_label_values(&[Query::Service.label(), mode, "ok"]);
        }
        for reason in ["error", "index_went_back"] {
            m.restarts.with_label_values(&["consul", reason]);
        }
        for query in Query::BLOCKING {
            m.unindexed.with_label_values(&[query.label()]);
        }
        Ok(m)
    }

    /// Metrics counted but exported nowhere (tests and benchmarks that read them directly).
    pub fn unregistered() -> Metrics {
        let counter = |name: &str, help: &str, labels: &[&str]| {
            IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
        };
        Metrics {
            requests: counter(
                "consul_requests_total",
                "Consul requests by query (service, checks, catalog, probe), mode (blocking, read) and outcome",
                &["query", "mode", "outcome"],
            ),
            request_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "consul_request_duration_seconds",
                    "Duration of Consul requests, blocking queries apart from non-blocking reads",
                )
                .buckets(REQUEST_BUCKETS.to_vec()),
                &["mode"],
            )
            .expect("valid metric"),
            errors: counter("watch_errors_total", "Failed watches by source and reason", &["source", "reason"]),
            restarts: counter(
                "watch_restarts_total",
                "Watches that started over from a full read, by source and reason",
                &["source", "reason"],
            ),
            watches: IntGaugeVec::new(
                Opts::new(
                    "consul_watches",
                    "Consul watches by mode: dedicated (own blocking query), multiplexed (own HTTP/2 stream), fed (a change feed names it), swept (re-read every --consul-sweep only), unplaced (before its first answer)",
                ),
                &["mode"],
            )
            .expect("valid metric"),
            feeds: IntGauge::new(
                "consul_feeds",
                "Change feeds running (two blocking queries each, two more for the critical and the warning checks while their group is large)",
            )
            .expect("valid metric"),
            feeds_short_of_status_lanes: IntGauge::new(
                "consul_feeds_short_of_status_lanes",
                "Change feeds of large groups that the connection budget gives no lanes for their critical and warning checks' queries: their health changes wait for every check's answer",
            )
            .expect("valid metric"),
            unreachable_servers: IntGauge::new(
                "consul_unreachable_servers",
                "Consul servers that do not answer: their watches wait while one probe tries",
            )
            .expect("valid metric"),
            unindexed: counter(
                "consul_unindexed_answers_total",
                "Consul answers without X-Consul-Index (stripped on the way?), by query: nothing blocks on them, the watch reads every --consul-sweep",
                &["query"],
            ),
            contact: Arc::default(),
            failing: crate::restart::Failing::default(),
        }
    }

    /// When Consul was last reached, per scope.
    pub fn contact(&self) -> &Contact {
        &self.contact
    }

    /// Requests counted with these labels so far (tests and benchmarks).
    pub fn requests(&self, query: &str, mode: &str, outcome: &str) -> u64 {
        self.requests.with_label_values(&[query, mode, outcome]).get()
    }

    /// `consul_unindexed_answers_total{query}`.
    pub fn unindexed(&self, query: &str) -> u64 {
        self.unindexed.with_label_values(&[query]).get()
    }

    /// Change feeds running now.
    pub fn feeds(&self) -> i64 {
        self.feeds.get()
    }

    /// Change feeds short of the lanes their critical and warning checks' queries ask for,
    /// now.
    pub fn feeds_short_of_status_lanes(&self) -> i64 {
        self.feeds_short_of_status_lanes.get()
    }

    /// Watches in `mode` now (`dedicated`, `multiplexed`, `fed`, `swept`, `unplaced`).
    pub fn watches(&self, mode: &str) -> i64 {
        self.watches.with_label_values(&[mode]).get()
    }

    /// Every request counted so far, whatever its labels.
    pub fn requests_total(&self) -> u64 {
        self.request_counts().iter().map(|(_, n)| n).sum()
    }

    /// Every `consul_requests_total` series so far: its `[query, mode, outcome]` and count.
    pub fn request_counts(&self) -> Vec<([String; 3], u64)> {
        use prometheus::core::Collector;
        let label = |m: &prometheus::proto::Metric, name: &str| {
            m.get_label().iter().find(|l| l.name() == name).map(|l| l.value().to_owned()).unwrap_or_default()
        };
        self.requests
            .collect()
            .iter()
            .flat_map(|family| family.get_metric())
            .map(|m| ([label(m, "query"), label(m, "mode"), label(m, "outcome")], m.get_counter().get_value() as u64))
            .collect()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::unregistered()
    }
}

/// One Consul server's part of a gauge every server adds to: setting it moves the gauge by
/// the difference, and dropping it takes the part back out, so one server's count never
/// overwrites another's.
pub(crate) struct GaugeShare {
    gauge: IntGauge,
    mine: i64,
}

impl GaugeShare {
    pub(crate) fn new(gauge: IntGauge) -> Self {
        GaugeShare { gauge, mine: 0 }
    }

    pub(crate) fn set(&mut self, n: usize) {
        let n = i64::try_from(n).unwrap_or(i64::MAX);
        self.gauge.add(n - self.mine);
        self.mine = n;
    }

    pub(crate) fn get(&self) -> usize {
        usize::try_from(self.mine).unwrap_or(0)
    }
}

impl Drop for GaugeShare {
    fn drop(&mut self) {
        self.gauge.sub(self.mine);
    }
}

/// The scope of a Consul query as far as reaching Consul goes: its server (address, token,
/// TLS), datacenter, namespace, partition, peer and sameness group, with the service and
/// query options left out.
/// Every query of one resolver has the same scope (the change feed's queries too).
pub fn contact_scope(key: &ConsulKey) -> ConsulKey {
    let scope = QueryScope {
        server: key.scope.server.clone(),
        datacenter: key.scope.datacenter.clone(),
        namespace: key.scope.namespace.clone(),
        partition: key.scope.partition.clone(),
        remote: key.scope.remote.clone(),
        query: QueryOptions::default(),
    };
    ConsulKey { scope: Arc::new(scope), service: String::new() }
}

/// When a request of each scope (see [`contact_scope`]) last reached Consul, and last did
/// not. The scopes hold tokens: they stay in memory.
#[derive(Default)]
pub struct Contact {
    scopes: Mutex<HashMap<ConsulKey, LastContact>>,
}

/// The last success and failure of one scope.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LastContact {
    pub success: Option<SystemTime>,
    pub failure: Option<SystemTime>,
}

impl Contact {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ConsulKey, LastContact>> {
        self.scopes.lock().expect("consul contact poisoned")
    }

    /// A request of `scope` reached Consul (`answered`) or not, at `at`.
    pub fn record(&self, scope: &ConsulKey, answered: bool, at: SystemTime) {
        let mut scopes = self.lock();
        let last = match scopes.get_mut(scope) {
            Some(c) => c,
            None => scopes.entry(scope.clone()).or_default(),
        };
        if answered {
            last.success = Some(at);
        } else {
            last.failure = Some(at);
        }
    }

    pub fn last(&self, scope: &ConsulKey) -> LastContact {
        self.lock().get(scope).copied().unwrap_or_default()
    }

    /// Forgets the scopes not in `keep` (no resolver queries them any more).
    pub fn retain(&self, keep: &HashSet<&ConsulKey>) {
        self.lock().retain(|k, _| keep.contains(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every query that blocks has its unindexed series from the start, so that an alert on
    /// its increase sees 0 before the first such answer, not no series.
    #[test]
    fn every_blocking_query_has_an_unindexed_series_from_the_start() {
        let registry = Registry::new();
        let shared = |name: &str| IntCounterVec::new(Opts::new(name, "shared"), &["source", "reason"]).unwrap();
        Metrics::register(&registry, shared("errors"), shared("restarts")).unwrap();
        let family = registry.gather().into_iter().find(|f| f.name().ends_with("consul_unindexed_answers_total"));
        let family = family.expect("the unindexed answers family");
        let mut queries: Vec<&str> =
            family.get_metric().iter().flat_map(|m| m.get_label()).map(|l| l.value()).collect();
        queries.sort_unstable();
        assert_eq!(queries, ["catalog", "checks", "critical", "service", "warning"]);
        assert!(family.get_metric().iter().all(|m| m.get_counter().get_value() == 0.0));
    }
}
