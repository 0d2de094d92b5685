//! Sources: the edge that watches things and reports events into the pipeline.
//!
//! One source per kind of [`WatchKey`]: Kubernetes (kube-runtime watchers) and Consul
//! (blocking queries). [`Watches`] applies the registry's diffs: it starts a task per new key
//! on the source of its kind, chosen by a `match` the compiler checks for exhaustiveness,
//! and aborts the task (cancelling any request in flight) when the key is stopped. A new
//! kind of source is a new `WatchKey` variant, its events in the core's model and its
//! store in the world, and a new arm here.

pub(crate) mod kube;
pub(crate) mod metrics;
mod supervise;

use std::collections::BTreeMap;

use consul_resolver_core::delta::Delta;
use consul_resolver_core::keys::{ConsulKey, WatchKey};
use tokio_util::task::AbortOnDropHandle;

use consul_watch::ConsulSource;
use kube::KubeSource;
use metrics::SourceMetrics;
use supervise::{Supervision, supervise};

/// Where sources send events (the Consul source's type: the core's bounded event channel).
pub(crate) use consul_watch::EventSink;

/// The running watches, one supervised task per key.
pub(crate) struct Watches {
    kube: KubeSource,
    consul: ConsulSource,
    running: BTreeMap<WatchKey, AbortOnDropHandle<()>>,
    metrics: SourceMetrics,
    supervision: Supervision,
}

/// A source's name, for logs and metrics.
fn source(key: &WatchKey) -> &'static str {
    match key {
        WatchKey::Kube(_) => "kubernetes",
        WatchKey::Consul(_) => "consul",
    }
}

impl Watches {
    /// `vitals`: where a watch that keeps ending is reported (`/healthz`).
    pub(crate) fn new(
        kube: KubeSource,
        consul: ConsulSource,
        events: EventSink,
        metrics: SourceMetrics,
        vitals: std::sync::Arc<crate::vitals::Vitals>,
    ) -> Self {
        let supervision = Supervision { events, restarts: metrics.watch_restarts.clone(), vitals };
        Watches { kube, consul, running: BTreeMap::new(), metrics, supervision }
    }

    /// The first snapshot is out: Consul watches held at their first answer since the start
    /// ([`ConsulSource::hold_blocking`]) may block now.
    pub(crate) fn first_snapshot_out(&self) {
        self.consul.release_blocking();
    }

    /// Starts and stops watches as `diff` says; `consul_resolver_watches{source}` follows,
    /// down to 0 when the last one stops.
    pub(crate) fn apply(&mut self, diff: &Delta<WatchKey>) {
        for key in &diff.removed {
            if self.running.remove(key).is_some() {
                tracing::info!(watch = %key, "watch stopped");
                self.metrics.watch_stops.with_label_values(&[source(key)]).inc();
            }
        }
        for key in &diff.added {
            tracing::info!(watch = %key, source = source(key), "watch started");
            self.metrics.watch_starts.with_label_values(&[source(key)]).inc();
            let (s, events) = (self.supervision.clone(), self.supervision.events.clone());
            let task = match key {
                WatchKey::Kube(k) => {
                    let (source, k) = (self.kube.clone(), k.clone());
                    tokio::spawn(supervise(key.clone(), move || source.watch(k.clone(), events.clone()), s))
                }
                WatchKey::Consul(k) => tokio::spawn(consul_watch(&self.consul, k, events, s)),
            };
            self.running.insert(key.clone(), AbortOnDropHandle::new(task));
        }
        if !diff.is_empty() {
            for (source, n) in self.counts() {
                self.metrics.watches.with_label_values(&[source]).set(n as i64);
            }
        }
    }

    /// Running watches per source name, every source named (zero included).
    pub(crate) fn counts(&self) -> [(&'static str, usize); 2] {
        let mut counts = [("kubernetes", 0), ("consul", 0)];
        for key in self.running.keys() {
            let i = usize::from(matches!(key, WatchKey::Consul(_)));
            counts[i].1 += 1;
        }
        counts
    }
}

/// The supervised watch of one Consul service. Every watched service holds one, idle
/// most of the time, so its size counts (see the size test).
fn consul_watch(
    source: &ConsulSource,
    k: &ConsulKey,
    events: EventSink,
    s: Supervision,
) -> impl Future<Output = ()> + Send + use<> {
    let (source, k) = (source.clone(), k.clone());
    supervise(WatchKey::Consul(k.clone()), move || source.watch(k.clone(), events.clone()), s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::{consul_key, not_found, serve};
    use consul_resolver_core::keys::KubeKey;
    use std::sync::Arc;
    use tokio::sync::mpsc;

    /// A supervised Consul watch, not counting the watch's own task (consul-watch tests
    /// that one): a few hundred bytes per watched service, where an `async fn`'s copies of
    /// its arguments and the state of an event's send made it 2,496.
    #[test]
    fn a_consul_watchs_supervisor_is_small() {
        let metrics = SourceMetrics::unregistered();
        let (tx, _rx) = mpsc::channel(1);
        let vitals = crate::vitals::Vitals::new(tokio_util::sync::CancellationToken::new());
        let s = Supervision { events: tx.clone(), restarts: metrics.watch_restarts.clone(), vitals };
        let consul = ConsulSource::new(Default::default(), metrics.consul.clone());
        let size = std::mem::size_of_val(&consul_watch(&consul, &consul_key("http://127.0.0.1:1"), tx, s));
        assert!(size <= 768, "a supervised watch is {size} bytes");
    }

    /// `consul_resolver_watches{source}` follows starts and stops, down to 0.
    #[tokio::test]
    async fn the_watches_gauge_follows_starts_and_stops_to_zero() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let api = serve(Arc::new(|_: &str, path: &str, _: &[u8]| not_found(path))).await;
        let metrics = SourceMetrics::unregistered();
        let (tx, _rx) = mpsc::channel(16);
        let consul = ConsulSource::new(Default::default(), metrics.consul.clone());
        let mut w = Watches::new(
            KubeSource::new(api.client.clone(), metrics.clone(), Default::default()),
            consul,
            tx,
            metrics.clone(),
            crate::vitals::Vitals::new(tokio_util::sync::CancellationToken::new()),
        );
        let kube = WatchKey::Kube(KubeKey::new("", "v1", "Secret").in_namespace("a"));
        // Nothing listens there: the watch only fails, which does not matter here.
        let consul = WatchKey::Consul(consul_key("http://127.0.0.1:1"));
        let gauge = |source: &str| metrics.watches.with_label_values(&[source]).get();
        w.apply(&Delta { added: vec![kube.clone(), consul.clone()], removed: vec![] });
        assert_eq!((gauge("kubernetes"), gauge("consul")), (1, 1));
        w.apply(&Delta { added: vec![], removed: vec![consul] });
        assert_eq!((gauge("kubernetes"), gauge("consul")), (1, 0));
        w.apply(&Delta { added: vec![], removed: vec![kube] });
        assert_eq!((gauge("kubernetes"), gauge("consul")), (0, 0));
        for source in ["kubernetes", "consul"] {
            assert_eq!(metrics.watch_starts.with_label_values(&[source]).get(), 1);
            assert_eq!(metrics.watch_stops.with_label_values(&[source]).get(), 1);
        }
    }
}
