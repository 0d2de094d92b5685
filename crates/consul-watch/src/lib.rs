//! Following Consul services: one watch per [`ConsulKey`] on `/v1/health/service/<name>`
//! (or `/v1/health/connect/<name>`), within a connection budget per Consul server, reporting
//! each answer or failure as a [`ConsulEvent`](consul_resolver_core::model::ConsulEvent) of
//! the core's model. The repository's docs/consul.md gives the strategy and its costs,
//! docs/consul-protocol.md the protocol rules every request follows.
//!
//! The layers, from the network in:
//! - `client` (with `parse`, `tls`, `multiplex`): requests and answers of one Consul address;
//! - `timing`, `changes`: the protocol's pure rules (index, pacing, backoff) and the change
//!   feed's diffing, free of I/O;
//! - `plan`: how one server's budget is shared (pure);
//! - `server`, `reach`, `feed` (with `catch_up`, `locate`), `watch`: the budget, plan and
//!   reachability of one server, the change feed of one group, and the watch of one key (`watch::machine`, pure, decides;
//!   `watch::run` performs);
//! - `observe`, `metrics`: what every request tells the metrics.

mod catch_up;
mod changes;
mod client;
mod error;
mod feed;
mod locate;
mod metrics;
mod observe;
mod plan;
mod reach;
mod reads;
mod restart;
mod server;
mod settings;
mod timing;
mod watch;
mod woken;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use consul_resolver_core::keys::ConsulKey;
use consul_resolver_core::model::Event;
use server::Server;

pub use metrics::{Contact, LastContact, Metrics, contact_scope};
pub use settings::Settings;

/// The unit tests' allocator counts heap bytes (the parsers' memory bounds are tested).
#[cfg(test)]
#[global_allocator]
static ALLOCATOR: heap_peak::Counting = heap_peak::Counting;

/// Where watches send their events: the core's event channel. Bounded, so a flood applies
/// backpressure to the watches rather than memory.
pub type EventSink = tokio::sync::mpsc::Sender<Event>;

/// The Consul source: starts watches, and keeps what they share per server. Cloning shares
/// it.
#[derive(Clone)]
pub struct ConsulSource {
    inner: Arc<Inner>,
}

struct Inner {
    settings: Settings,
    /// One budget per server, found by any of its resolved socket addresses:
    /// `http://localhost:8500` and `http://127.0.0.1:8500` are one server to Consul's
    /// per-client connection limit. Shared by every spelling, token and TLS setting that
    /// reaches it, and dropped with the last watch that uses it.
    servers: Mutex<HashMap<String, Weak<Server>>>,
    /// Where requests, their outcomes and watch errors are counted.
    metrics: Metrics,
    /// Whether dedicated watches may start their blocking queries ([`ConsulSource::hold_blocking`]).
    blocking: tokio::sync::watch::Sender<bool>,
}

/// How long a resolution of a Consul host may take before the address's spelling is used
/// as its budget key instead (the watch's own requests then report the DNS failure).
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

impl ConsulSource {
    /// Watches counting into `metrics` (see [`Metrics::register`]).
    pub fn new(settings: Settings, metrics: Metrics) -> Self {
        let (blocking, _) = tokio::sync::watch::channel(true);
        ConsulSource { inner: Arc::new(Inner { settings, servers: Mutex::new(HashMap::new()), metrics, blocking }) }
    }

    /// Where the source reports a task of its own (a server's planner, a change feed, the
    /// reachability probe) that keeps panicking although restarted: `report` gets why, once
    /// per run of failures, for the program's health check.
    pub fn on_failing(&self, report: impl Fn(String) + Send + Sync + 'static) {
        self.inner.metrics.failing.report_to(report);
    }

    /// Dedicated watches, and watches over HTTP/2, read their service, then wait for
    /// [`ConsulSource::release_blocking`] before they block on it. For a cold start: until
    /// the first snapshot, what a watch's blocking query would bring is not published
    /// anyway, and a thousand dedicated watches would open a thousand connections (over
    /// HTTP/2, send ten thousand queries at the doubled scale) while the operator, Consul
    /// and the API server share the CPU to get it out. Nothing is missed: the blocking
    /// query, when it starts, carries the index of the first read, and Consul answers at
    /// once if the service changed since (docs/consul.md, "Cold start").
    pub fn hold_blocking(&self) {
        self.inner.blocking.send_replace(false);
    }

    /// Lets held watches block ([`ConsulSource::hold_blocking`]), and watches started
    /// from now on block at once.
    pub fn release_blocking(&self) {
        self.inner.blocking.send_replace(true);
    }

    /// The watch of `key`: runs until dropped, reporting into `events`.
    pub fn watch(&self, key: ConsulKey, events: EventSink) -> impl Future<Output = ()> + Send + use<> {
        let inner = self.inner.clone();
        async move {
            let addresses = socket_addresses(&key.scope.server.address).await;
            let server = inner.server(&addresses);
            watch::run(server, key, events).await;
        }
    }
}

impl Inner {
    /// The server reached at any of `addresses`.
    fn server(&self, addresses: &[String]) -> Arc<Server> {
        let mut servers = self.servers.lock().expect("server map poisoned");
        let found = addresses.iter().find_map(|a| servers.get(a).and_then(Weak::upgrade));
        let server = found.unwrap_or_else(|| {
            servers.retain(|_, p| p.strong_count() > 0);
            let s = &self.settings;
            Server::new(s.clone(), self.metrics.clone(), self.blocking.subscribe())
        });
        for a in addresses {
            servers.entry(a.clone()).or_insert_with(|| Arc::downgrade(&server));
        }
        server
    }
}

/// The socket addresses `address` resolves to; the address itself when it cannot be
/// resolved in time (its watches then report the failure themselves).
async fn socket_addresses(address: &str) -> Vec<String> {
    let Ok(url) = url::Url::parse(address) else { return vec![address.to_owned()] };
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

/// What the crate's unit tests share.
#[cfg(test)]
mod test_support {
    use consul_resolver_core::keys::{ConsulKey, Secret};

    /// A watch of `service` on a plain-HTTP agent at 127.0.0.1:8500 (nothing is expected
    /// to listen there), with `token` if any and the default query options.
    pub(crate) fn key(service: &str, token: Option<&str>) -> ConsulKey {
        let mut key = consul_resolver_core::test_support::consul_key("http://127.0.0.1:8500", service);
        key.scope_mut().server.token = token.map(Secret::new);
        key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A watch that is not querying (a fed one, most of the time) holds little memory: its
    /// request's state is allocated only while it queries, and an event's send only while
    /// it sends. Every byte here is paid once per watched service (10,000 at the doubled
    /// profile).
    #[test]
    fn an_idle_watch_is_small() {
        let source = ConsulSource::new(Settings::default(), Metrics::unregistered());
        let (tx, _rx) = tokio::sync::mpsc::channel(1);
        let size = std::mem::size_of_val(&source.watch(test_support::key("web", None), tx));
        eprintln!("a watch's future: {size} bytes");
        assert!(size <= 1536, "a watch's future is {size} bytes");
    }

    #[tokio::test]
    async fn spellings_of_one_server_share_a_budget() {
        let a = socket_addresses("http://127.0.0.1:8500").await;
        assert_eq!(a, ["127.0.0.1:8500"]);
        assert_eq!(socket_addresses("http://127.0.0.1:8500/").await, a);
        assert_eq!(socket_addresses("https://127.0.0.1:443").await, socket_addresses("https://127.0.0.1").await);
        assert_eq!(socket_addresses("not a url").await, ["not a url"]);
        let localhost = socket_addresses("http://localhost:8500").await;
        assert!(localhost.contains(&a[0]), "{localhost:?}");

        let source = ConsulSource::new(Settings::default(), Metrics::unregistered());
        let p = source.inner.server(&a);
        assert!(Arc::ptr_eq(&p, &source.inner.server(&localhost)), "localhost reaches the same server");
        assert!(!Arc::ptr_eq(&p, &source.inner.server(&socket_addresses("http://127.0.0.1:8501").await)));
        drop(p);
        assert_eq!(source.inner.servers.lock().unwrap().values().filter(|p| p.strong_count() > 0).count(), 0);
    }
}
