//! The Consul source: one watch per [`ConsulKey`] on `/v1/health/service/<name>`, within a
//! connection budget per Consul address. See docs/consul.md for the strategy and its costs.

pub mod client;
pub mod parse;
pub mod pool;
pub mod timing;
pub mod watch;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use futures::future::BoxFuture;

pub use watch::Settings;

use super::{EventSink, Source};
use crate::core::keys::WatchKey;
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

impl Source for ConsulSource {
    fn name(&self) -> &'static str {
        "consul"
    }

    fn accepts(&self, key: &WatchKey) -> bool {
        matches!(key, WatchKey::Consul(_))
    }

    fn watch(&self, key: WatchKey, events: EventSink) -> BoxFuture<'static, ()> {
        let WatchKey::Consul(key) = key else {
            return futures::future::ready(()).boxed();
        };
        let pool = self.pool(&key.server.address);
        watch::run(pool, key, self.settings.clone(), events).boxed()
    }
}
