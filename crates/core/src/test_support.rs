//! What every crate's tests build their inputs from (feature `test-support`, and the core's
//! own tests): a Consul key, an endpoint, a Kubernetes object, and a deterministic random
//! generator. Tests that need other details change the fields they care about.

use serde_json::Value;

use std::sync::Arc;

use crate::keys::{ConsulKey, ConsulServer, QueryScope};
use crate::model::{Endpoint, Health, KubeObject};

/// A watch of `service` on the plain-HTTP agent at `address`, without a token, with the
/// default query options.
pub fn consul_key(address: &str, service: &str) -> ConsulKey {
    let scope = QueryScope {
        server: ConsulServer { address: address.into(), token: None, tls: None },
        datacenter: None,
        namespace: None,
        partition: None,
        remote: None,
        query: Default::default(),
    };
    ConsulKey { scope: Arc::new(scope), service: service.into() }
}

/// A passing instance at `address:port` on node `node-1`, its id `address:port`, without
/// tags, meta or zone.
pub fn endpoint(address: &str, port: u16) -> Endpoint {
    Endpoint {
        address: address.into(),
        port,
        node: "node-1".into(),
        service_id: format!("{address}:{port}"),
        tags: vec![],
        meta: Default::default(),
        health: Health::Passing,
        zone: None,
        weight: None,
    }
}

/// A Kubernetes object from its JSON; panics on one without metadata.
pub fn kube_object(value: Value) -> KubeObject {
    KubeObject::from_value(value).expect("a Kubernetes object")
}

/// xorshift64*: deterministic, dependency-free, and incompressible enough for gzip.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number below `n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// `len` characters of the base64 alphabet.
    pub fn token(&mut self, len: usize) -> String {
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        (0..len).map(|_| ALPHABET[(self.next_u64() % 64) as usize] as char).collect()
    }
}
