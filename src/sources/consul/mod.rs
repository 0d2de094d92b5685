//! The Consul source: one watch per [`ConsulKey`] on `/v1/health/service/<name>`, within a
//! connection budget per Consul server. See docs/consul.md for the strategy and its costs.

pub(crate) mod changes;
pub(crate) mod client;
pub(crate) mod feed;
pub(crate) mod multiplex;
pub(crate) mod observe;
pub(crate) mod parse;
pub(crate) mod pool;
pub(crate) mod timing;
pub(crate) mod tls;
pub(crate) mod watch;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

pub use watch::Settings;

use super::EventSink;
use crate::ops::metrics::Metrics;
use consul_resolver_core::keys::ConsulKey;
use pool::Pool;

pub struct ConsulSource {
    inner: Arc<Inner>,
}

struct Inner {
    settings: Settings,
    /// One budget per server, found by any of its resolved socket addresses:
    /// `http://localhost:8500` and `http://127.0.0.1:8500` are one server to Consul's
    /// per-client connection limit. Shared by every spelling, token and TLS setting that
    /// reaches it, and dropped with the last watch that uses it.
    pools: Mutex<HashMap<String, Weak<Pool>>>,
    /// Where requests, their outcomes and watch errors are counted.
    metrics: Metrics,
}

/// How long a resolution of a Consul host may take before the address's spelling is used
/// as its budget key instead (the watch's own requests then report the DNS failure).
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

impl ConsulSource {
    pub fn new(settings: Settings) -> Self {
        ConsulSource { inner: Arc::new(Inner { settings, pools: Mutex::new(HashMap::new()), metrics: Metrics::new() }) }
    }

    /// Counts into `metrics` (the operator's) instead of a registry of its own.
    pub(crate) fn with_metrics(self, metrics: Metrics) -> Self {
        let settings = self.inner.settings.clone();
        ConsulSource { inner: Arc::new(Inner { settings, pools: Mutex::new(HashMap::new()), metrics }) }
    }

    /// The watch of `key`: runs until dropped, reporting into `events`.
    pub fn watch(&self, key: ConsulKey, events: EventSink) -> impl Future<Output = ()> + Send + 'static {
        let inner = self.inner.clone();
        async move {
            let addresses = socket_addresses(&key.server.address).await;
            let pool = inner.pool(&addresses);
            watch::run(pool, key, inner.settings.clone(), events).await;
        }
    }
}

impl Inner {
    /// The pool of the server reached at any of `addresses`.
    fn pool(&self, addresses: &[String]) -> Arc<Pool> {
        let mut pools = self.pools.lock().expect("pool map poisoned");
        let found = addresses.iter().find_map(|a| pools.get(a).and_then(Weak::upgrade));
        let pool = found.unwrap_or_else(|| {
            pools.retain(|_, p| p.strong_count() > 0);
            let s = &self.settings;
            Pool::new(s.max_connections, s.wait, s.max_response_bytes, self.metrics.clone())
        });
        for a in addresses {
            pools.entry(a.clone()).or_insert_with(|| Arc::downgrade(&pool));
        }
        pool
    }
}

/// The socket addresses `address` resolves to; the address itself when it cannot be
/// resolved in time (its watches then report the failure themselves).
async fn socket_addresses(address: &str) -> Vec<String> {
    let Ok(url) = reqwest::Url::parse(address) else { return vec![address.to_owned()] };
    let (Some(host), Some(port)) = (url.host_str(), url.port_or_known_default()) else {
        return vec![address.to_owned()];
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((host, port))).await {
        Ok(Ok(addrs)) => {
            let mut addrs: Vec<_> = addrs.map(|a| a.to_string()).collect();
            addrs.sort();
            addrs.dedup();
            if addrs.is_empty() { vec![address.to_owned()] } else { addrs }
        }
        _ => vec![address.to_owned()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn spellings_of_one_server_share_a_budget() {
        let a = socket_addresses("http://127.0.0.1:8500").await;
        assert_eq!(a, ["127.0.0.1:8500"]);
        assert_eq!(socket_addresses("http://127.0.0.1:8500/").await, a);
        assert_eq!(socket_addresses("https://127.0.0.1:443").await, socket_addresses("https://127.0.0.1").await);
        assert_eq!(socket_addresses("not a url").await, ["not a url"]);
        let localhost = socket_addresses("http://localhost:8500").await;
        assert!(localhost.contains(&a[0]), "{localhost:?}");

        let source = ConsulSource::new(Settings::default());
        let p = source.inner.pool(&a);
        assert!(Arc::ptr_eq(&p, &source.inner.pool(&localhost)), "localhost reaches the same server");
        assert!(!Arc::ptr_eq(&p, &source.inner.pool(&socket_addresses("http://127.0.0.1:8501").await)));
        drop(p);
        assert_eq!(source.inner.pools.lock().unwrap().values().filter(|p| p.strong_count() > 0).count(), 0);
    }
}
