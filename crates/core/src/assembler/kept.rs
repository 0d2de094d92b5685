//! Last known good: per resolver service, the endpoints last obtained.
//!
//! When a resolver's settings change (token rotated, CA, address), when its spec becomes
//! unusable, or when a Secret it names disappears, its services' current queries stop or
//! have not answered yet. Publishing them empty would black-hole the traffic of a team whose
//! only fault is a typo or a rotation in progress, so the assembler keeps serving what was
//! obtained last, marked stale (since when, and why), until the new query answers. Only
//! deleting the resolver, or the Mappings that reference the service, removes them.
//!
//! This is the assembler's memory between two readings of the world.

use std::collections::BTreeMap;
use std::time::SystemTime;

use consul_resolver_api::names::NamespacedName;

use crate::keys::ConsulKey;
use crate::model::Endpoints;

/// A service as one resolver sees it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServiceOf {
    pub resolver: NamespacedName,
    pub service: String,
}

impl ServiceOf {
    pub fn new(resolver: &NamespacedName, service: &str) -> Self {
        ServiceOf { resolver: resolver.clone(), service: service.to_owned() }
    }
}

/// The endpoints last obtained for one [`ServiceOf`].
#[derive(Debug, Clone, PartialEq)]
pub struct KeptService {
    /// The query that obtained them.
    pub key: ConsulKey,
    pub index: Option<u64>,
    pub endpoints: Endpoints,
    /// When they stopped being current; `None` while they are.
    pub stale_since: Option<SystemTime>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Kept {
    services: BTreeMap<ServiceOf, KeptService>,
}

impl Kept {
    pub fn get(&self, of: &ServiceOf) -> Option<&KeptService> {
        self.services.get(of)
    }

    pub(super) fn insert(&mut self, of: ServiceOf, kept: KeptService) {
        self.services.insert(of, kept);
    }

    pub(super) fn remove(&mut self, of: &ServiceOf) {
        self.services.remove(of);
    }

    /// Keeps only what `keep` says is still a resolver's service.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&ServiceOf) -> bool) {
        self.services.retain(|of, _| keep(of));
    }
}

/// The settings that differ between two queries of one service, for messages.
pub fn changed_settings(old: &ConsulKey, new: &ConsulKey) -> Vec<&'static str> {
    let mut out = Vec::new();
    let mut differs = |changed: bool, what| {
        if changed {
            out.push(what);
        }
    };
    differs(old.scope.server.address != new.scope.server.address, "address");
    differs(old.scope.server.token != new.scope.server.token, "token");
    differs(old.scope.server.tls != new.scope.server.tls, "TLS settings");
    differs(old.scope.datacenter != new.scope.datacenter, "datacenter");
    differs(old.scope.namespace != new.scope.namespace, "Consul namespace");
    differs(old.scope.partition != new.scope.partition, "partition");
    differs(old.scope.remote != new.scope.remote, "peer or samenessGroup");
    let (o, n) = (&old.scope.query, &new.scope.query);
    differs(o.statuses != n.statuses, "healthStatuses");
    differs(o.tags != n.tags || o.excluded_tags != n.excluded_tags, "tags");
    differs(o.consistency != n.consistency, "consistency");
    differs(o.cached != n.cached, "cached");
    differs(o.connect != n.connect, "connect");
    differs(o.filter != n.filter, "filter");
    differs(o.address != n.address, "addressType");
    out
}

/// RFC 3339, to the second, UTC: how times appear in snapshots and statuses.
pub fn rfc3339(t: SystemTime) -> String {
    chrono::DateTime::<chrono::Utc>::from(t).to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::Secret;
    use std::time::Duration;

    #[test]
    fn names_what_changed() {
        let key = |token: &str, dc: Option<&str>| {
            let mut key = crate::test_support::consul_key("http://127.0.0.1:8500", "web");
            key.scope_mut().server.token = Some(Secret::new(token));
            key.scope_mut().datacenter = dc.map(str::to_owned);
            key
        };
        assert_eq!(changed_settings(&key("a", None), &key("b", Some("dc2"))), ["token", "datacenter"]);
        assert!(changed_settings(&key("a", None), &key("a", None)).is_empty());
    }

    #[test]
    fn times_are_rfc3339_seconds() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_250);
        assert_eq!(rfc3339(t), "2023-11-14T22:13:20Z");
    }
}
