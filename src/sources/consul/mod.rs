//! The Consul source: one watch per [`ConsulKey`] on `/v1/health/service/<name>`, within a
//! connection budget per Consul address. See docs/consul.md for the strategy and its costs.

pub(crate) mod client;
pub(crate) mod parse;
pub(crate) mod pool;
pub(crate) mod timing;
pub(crate) mod watch;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub use watch::Settings;

use super::EventSink;
use consul_resolver_core::keys::ConsulKey;
use pool::Pool;

pub struct ConsulSource {
    settings: Settings,
    /// One budget per address, shared by every token and TLS setting that talks to it.
    pools: Mutex<HashMap<String, Arc<Pool>>>,
}

impl ConsulSource {
    pub fn new(settings: Settings) -> Self {
        ConsulSource { settings, pools: Mutex::new(HashMap::new()) }
    }

    fn pool(&self, address: &str) -> Arc<Pool> {
        let mut pools = self.pools.lock().expect("pool map poisoned");
        pools
            .entry(address.to_owned())
            .or_insert_with(|| Pool::new(address, self.settings.max_connections, self.settings.wait))
            .clone()
    }
}

impl ConsulSource {
    /// The watch of `key`: runs until dropped, reporting into `events`.
    pub fn watch(&self, key: ConsulKey, events: EventSink) -> impl Future<Output = ()> + Send + 'static {
        let pool = self.pool(&key.server.address);
        watch::run(pool, key, self.settings.clone(), events)
    }
}
