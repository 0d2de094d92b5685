//! What the sources measure: the watches each source runs, starts, stops, restarts and
//! fails, the events they report, the watches still waiting for their first list or
//! answer, and, per resolver, when its Consul was last reached.
//!
//! The Consul source registers its own metrics (`consul_*`, [`consul_watch::Metrics`]) and
//! counts into the `watch_errors_total` and `watch_restarts_total` families defined here
//! (one family for every source). `events_total` and the unsynced gauges are counted by
//! the event loop, where the sources' events arrive and the world knows which watches
//! have synced.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use prometheus::core::Collector;
use prometheus::{GaugeVec, IntCounterVec, IntGaugeVec, Registry};

use crate::measure::{counter_vec, gauge_vec, int_gauge_vec, register_all, unix_seconds};
use consul_resolver_core::keys::ConsulKey;

/// The sources' metrics. Cloning shares them.
#[derive(Clone)]
pub(crate) struct SourceMetrics {
    /// The Consul source's own metrics (`consul_requests_total`, ...), registered by it.
    pub consul: consul_watch::Metrics,
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
    /// Per resolver: when its Consul was last reached, exported at each scrape.
    pub consul_contact: Arc<ConsulContact>,
    consul_last_success: GaugeVec,
    consul_last_failure: GaugeVec,
}

impl SourceMetrics {
    /// Metrics counted but exported nowhere (tests). The Consul source's count apart.
    pub(crate) fn unregistered() -> SourceMetrics {
        let resolver = &["resolver_namespace", "resolver_name"];
        SourceMetrics {
            consul: consul_watch::Metrics::unregistered(),
            watch_errors: counter_vec(
                "watch_errors_total",
                "Failed watches by source and reason",
                &["source", "reason"],
            ),
            watch_starts: counter_vec("watch_starts_total", "Watches started by source", &["source"]),
            watch_stops: counter_vec("watch_stops_total", "Watches stopped by source", &["source"]),
            watch_restarts: counter_vec(
                "watch_restarts_total",
                "Watches that started over from a full read (a relist, a Consul read without index), by source and reason",
                &["source", "reason"],
            ),
            watches: int_gauge_vec("watches", "Running watches by source", &["source"]),
            events: counter_vec("events_total", "Events received by source", &["source"]),
            unsynced_watches: int_gauge_vec(
                "unsynced_watches",
                "Running watches without a first list or answer yet, by source",
                &["source"],
            ),
            unsynced_oldest_seconds: gauge_vec(
                "unsynced_watch_oldest_seconds",
                "How long the oldest unsynced watch has waited for its first list or answer (0: none), by source",
                &["source"],
            ),
            consul_contact: Arc::default(),
            consul_last_success: gauge_vec(
                "consul_last_success_timestamp_seconds",
                "Unix time Consul last answered a request of the resolver's scope (2xx, or a 4xx: it is there and decided)",
                resolver,
            ),
            consul_last_failure: gauge_vec(
                "consul_last_failure_timestamp_seconds",
                "Unix time a request of the resolver's scope last got no answer from Consul (transport, timeout, 5xx)",
                resolver,
            ),
        }
    }

    /// Registers the sources' metrics, the Consul source's included, in `registry`.
    pub(crate) fn register(registry: &Registry) -> prometheus::Result<SourceMetrics> {
        let mut m = SourceMetrics::unregistered();
        register_all(registry, m.collectors())?;
        m.consul = consul_watch::Metrics::register(registry, m.watch_errors.clone(), m.watch_restarts.clone())?;
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
        Ok(m)
    }

    /// What [`SourceMetrics::register`] registers of its own (the Consul source's apart).
    pub(crate) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.consul_last_success.clone()),
            Box::new(self.consul_last_failure.clone()),
            Box::new(self.watch_errors.clone()),
            Box::new(self.watch_starts.clone()),
            Box::new(self.watch_stops.clone()),
            Box::new(self.watch_restarts.clone()),
            Box::new(self.watches.clone()),
            Box::new(self.events.clone()),
            Box::new(self.unsynced_watches.clone()),
            Box::new(self.unsynced_oldest_seconds.clone()),
        ]
    }

    /// Brings the per-resolver contact times up to date, before a scrape.
    pub(crate) fn refresh(&self) {
        self.consul_contact.export(self.consul.contact(), &self.consul_last_success, &self.consul_last_failure);
    }
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
    use consul_resolver_core::keys::{QueryOptions, Secret};
    use consul_watch::contact_scope;
    use std::time::{Duration, UNIX_EPOCH};

    fn key(token: &str, service: &str) -> ConsulKey {
        let mut key = consul_resolver_core::test_support::consul_key("http://127.0.0.1:8500", service);
        key.scope_mut().server.token = Some(Secret::new(token));
        key.scope_mut().query = QueryOptions { cached: true, ..QueryOptions::default() };
        key.scope_mut().datacenter = Some("dc1".into());
        key
    }

    /// The exposition of `registry` after a refresh, as a scrape sees it.
    fn scrape(m: &SourceMetrics, registry: &Registry) -> String {
        use prometheus::Encoder;
        m.refresh();
        let mut buf = Vec::new();
        prometheus::TextEncoder::new().encode(&registry.gather(), &mut buf).unwrap();
        String::from_utf8(buf).unwrap()
    }

    #[test]
    fn contact_is_per_resolver_and_never_shows_the_token() {
        let registry = Registry::new_custom(Some("consul_resolver".into()), None).unwrap();
        let m = SourceMetrics::register(&registry).unwrap();
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
        let text = scrape(&m, &registry);
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
        assert!(!scrape(&m, &registry).contains("resolver_namespace=\"shop\""));
        assert_eq!(m.consul.contact().last(&scope), Default::default(), "the scope's record is forgotten");
    }
}
