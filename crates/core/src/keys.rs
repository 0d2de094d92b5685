//! Watch keys: the identity of one thing to watch.
//!
//! Two consumers that want the same key share one watch, so a key must contain exactly
//! what makes two watches different, and nothing else. Keys order stably (derived `Ord`,
//! field by field) so every map keyed by them iterates deterministically.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

/// One Kubernetes list+watch stream: a kind, optionally narrowed by namespace and
/// selectors.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KubeKey {
    /// API group, `""` for the core group.
    pub group: String,
    /// API version; `""` means the version the API server prefers, found by discovery.
    pub version: String,
    pub kind: String,
    /// `None` watches every namespace in the operator's scope.
    pub namespace: Option<String>,
    pub label_selector: Option<String>,
    pub field_selector: Option<String>,
}

impl KubeKey {
    pub fn new(group: &str, version: &str, kind: &str) -> Self {
        KubeKey {
            group: group.to_owned(),
            version: version.to_owned(),
            kind: kind.to_owned(),
            namespace: None,
            label_selector: None,
            field_selector: None,
        }
    }

    pub fn in_namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    pub fn with_labels(mut self, selector: impl Into<String>) -> Self {
        self.label_selector = Some(selector.into());
        self
    }

    pub fn with_fields(mut self, selector: impl Into<String>) -> Self {
        self.field_selector = Some(selector.into());
        self
    }

    /// Whether this key is of the given group and kind, whatever the version and scope.
    pub fn is(&self, group: &str, kind: &str) -> bool {
        self.group == group && self.kind == kind
    }
}

impl fmt::Display for KubeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.kind)?;
        if !self.group.is_empty() {
            write!(f, ".{}", self.group)?;
        }
        if !self.version.is_empty() {
            write!(f, "/{}", self.version)?;
        }
        match &self.namespace {
            Some(ns) => write!(f, " in {ns}")?,
            None => f.write_str(" in all namespaces")?,
        }
        if let Some(l) = &self.label_selector {
            write!(f, " labels {l}")?;
        }
        if let Some(s) = &self.field_selector {
            write!(f, " fields {s}")?;
        }
        Ok(())
    }
}

/// A secret string (a Consul ACL token). It compares by value, so two resolvers with the
/// same token share watches and a changed token restarts them, but it never prints its
/// value: Debug and Display show a short fingerprint of its SHA-256.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Secret(Arc<str>);

impl Secret {
    pub fn new(value: impl Into<Arc<str>>) -> Self {
        Secret(value.into())
    }

    /// The value, for the one place that must send it (the `X-Consul-Token` header).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// A fingerprint safe to show: 8 hex digits of the value's SHA-256.
    pub fn fingerprint(&self) -> String {
        let digest = Sha256::digest(self.0.as_bytes());
        hex::encode(&digest[..4])
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret(sha256:{}…)", self.fingerprint())
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}…", self.fingerprint())
    }
}

/// TLS settings that make two Consul connections different.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct TlsSettings {
    /// PEM CA bundle; `None` uses the system roots.
    pub ca_pem: Option<Arc<str>>,
    pub server_name: Option<String>,
    pub insecure_skip_verify: bool,
    /// Client certificate (PEM chain) and its private key, for mutual TLS. The key is a
    /// [`Secret`]: it never prints.
    pub client_identity: Option<ClientIdentity>,
}

/// A client certificate with its key.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClientIdentity {
    pub cert_pem: Arc<str>,
    pub key_pem: Secret,
}

/// The Consul endpoint a query goes to, with what authenticates it: everything about a
/// query except what is asked. Watches of one server share its connection budget.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConsulServer {
    /// Normalised `http://host:port` or `https://host:port`.
    pub address: String,
    pub token: Option<Secret>,
    pub tls: Option<TlsSettings>,
}

/// One Consul blocking query on `/v1/health/service/<service>`: everything that makes two
/// queries different.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConsulKey {
    /// Shared by the keys of one resolver's services, and compared by value: a key is
    /// copied into the registry, the world, the watch and the endpoints kept, per service,
    /// and all but the service's name is the same for a resolver's thousands of services.
    pub scope: Arc<QueryScope>,
    pub service: String,
}

/// Everything about a [`ConsulKey`] but its service: the server, where in Consul, and the
/// query options.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct QueryScope {
    pub server: ConsulServer,
    pub datacenter: Option<String>,
    pub namespace: Option<String>,
    pub partition: Option<String>,
    /// Instances of another cluster instead of the local one: `None` for the local.
    pub remote: Option<Remote>,
    /// Which instances are kept, and how they are read.
    pub query: QueryOptions,
}

impl ConsulKey {
    /// The scope to change, this key's own copy if it is shared.
    pub fn scope_mut(&mut self) -> &mut QueryScope {
        Arc::make_mut(&mut self.scope)
    }

    /// This key with its scope changed by `change`.
    pub fn with_scope(mut self, change: impl FnOnce(&mut QueryScope)) -> Self {
        change(self.scope_mut());
        self
    }
}

/// Where instances come from when not the local cluster's (one or the other).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Remote {
    /// A cluster peer whose imported services are read (`?peer=`).
    Peer(String),
    /// A sameness group (`?sameness-group=`): the first of its members with healthy
    /// instances answers.
    SamenessGroup(String),
}

/// The parts of a resolver's spec that shape each of its queries besides the server and
/// the scope (docs/consul.md, "Resolver options").
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct QueryOptions {
    pub statuses: HealthStatuses,
    /// Instances must carry all of these (sent as `?tag=`, and checked again here: agents
    /// before 1.3 apply only the first).
    pub tags: BTreeSet<String>,
    /// Instances carrying any of these are dropped (`!tag` in the spec; filtered here).
    pub excluded_tags: BTreeSet<String>,
    pub consistency: Consistency,
    /// `?cached`: answered from the agent's cache.
    pub cached: bool,
    /// `/v1/health/connect/<service>`: the service's Connect sidecar proxies instead.
    pub connect: bool,
    pub address: AddressType,
    /// A Consul filter expression (`?filter=`), applied by Consul.
    pub filter: Option<Arc<str>>,
}

/// Summary of an instance's health checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Health {
    Passing,
    Warning,
    Critical,
}

/// The aggregate check statuses an instance may have to be published. Default: passing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HealthStatuses {
    pub passing: bool,
    pub warning: bool,
    pub critical: bool,
}

impl Default for HealthStatuses {
    fn default() -> Self {
        HealthStatuses::PASSING
    }
}

impl HealthStatuses {
    pub const PASSING: HealthStatuses = HealthStatuses { passing: true, warning: false, critical: false };
    pub const ANY: HealthStatuses = HealthStatuses { passing: true, warning: true, critical: true };

    /// Only passing: Consul's `?passing` filters on the server.
    pub fn only_passing(&self) -> bool {
        *self == HealthStatuses::PASSING
    }

    pub fn admits(&self, health: Health) -> bool {
        match health {
            Health::Passing => self.passing,
            Health::Warning => self.warning,
            Health::Critical => self.critical,
        }
    }
}

impl fmt::Display for HealthStatuses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = [(self.passing, "passing"), (self.warning, "warning"), (self.critical, "critical")]
            .into_iter()
            .filter_map(|(on, name)| on.then_some(name))
            .collect();
        f.write_str(&names.join(","))
    }
}

/// Consul's read consistency modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Consistency {
    #[default]
    Default,
    /// `?stale`: any server answers, possibly behind the leader.
    Stale,
    /// `?consistent`: the leader confirms its leadership first.
    Consistent,
}

/// Which address of an instance is published.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum AddressType {
    /// `Service.Address`, or the node's when empty (what Consul itself resolves).
    #[default]
    Service,
    /// `Node.Address`.
    Node,
    /// A tagged address (`lan_ipv4`, `wan`, ...): the service's (with its port), else the
    /// node's, else the default above.
    Tagged(String),
}

impl fmt::Display for ConsulKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "consul {} at {}", self.service, self.scope)
    }
}

/// The server's address, then whatever is not the default.
impl fmt::Display for QueryScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.server.address)?;
        for (name, value) in [("dc", &self.datacenter), ("ns", &self.namespace), ("partition", &self.partition)] {
            if let Some(v) = value {
                write!(f, " {name}={v}")?;
            }
        }
        match &self.remote {
            None => {}
            Some(Remote::Peer(p)) => write!(f, " peer={p}")?,
            Some(Remote::SamenessGroup(g)) => write!(f, " sameness-group={g}")?,
        }
        let q = &self.query;
        if q.connect {
            f.write_str(" connect")?;
        }
        if q.statuses.only_passing() {
            f.write_str(" passing")?;
        } else {
            write!(f, " statuses={}", q.statuses)?;
        }
        for t in &q.tags {
            write!(f, " tag={t}")?;
        }
        for t in &q.excluded_tags {
            write!(f, " tag=!{t}")?;
        }
        match q.consistency {
            Consistency::Default => {}
            Consistency::Stale => f.write_str(" stale")?,
            Consistency::Consistent => f.write_str(" consistent")?,
        }
        if q.cached {
            f.write_str(" cached")?;
        }
        if let Some(filter) = &q.filter {
            write!(f, " filter={filter:?}")?;
        }
        match &q.address {
            AddressType::Service => {}
            AddressType::Node => f.write_str(" address=node")?,
            AddressType::Tagged(t) => write!(f, " address={t}")?,
        }
        if let Some(t) = &self.server.token {
            write!(f, " token={t}")?;
        }
        if let Some(tls) = &self.server.tls {
            if tls.insecure_skip_verify {
                f.write_str(" tls=insecure")?;
            } else if let Some(sni) = &tls.server_name {
                write!(f, " tls-server-name={sni}")?;
            }
        }
        Ok(())
    }
}

/// Anything the registry can watch. A new kind of source adds a variant here and a
/// `Source` implementation; the registry itself is generic and does not change.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WatchKey {
    Kube(KubeKey),
    Consul(ConsulKey),
}

impl fmt::Display for WatchKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WatchKey::Kube(k) => k.fmt(f),
            WatchKey::Consul(k) => k.fmt(f),
        }
    }
}

impl From<KubeKey> for WatchKey {
    fn from(k: KubeKey) -> Self {
        WatchKey::Kube(k)
    }
}

impl From<ConsulKey> for WatchKey {
    fn from(k: ConsulKey) -> Self {
        WatchKey::Consul(k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn consul(service: &str, token: Option<&str>) -> ConsulKey {
        let mut key = crate::test_support::consul_key("http://127.0.0.1:8500", service);
        key.scope_mut().server.token = token.map(Secret::new);
        key.scope_mut().datacenter = Some("dc1".into());
        key
    }

    /// A key is copied per service into the registry, the world, its watch and what is
    /// kept: its scope is shared, and a change to a copy's scope is that copy's alone.
    #[test]
    fn keys_share_their_scope_and_compare_it_by_value() {
        assert!(std::mem::size_of::<ConsulKey>() <= 32, "{} bytes", std::mem::size_of::<ConsulKey>());
        let a = consul("a", Some("t1"));
        let b = ConsulKey { service: "b".into(), ..a.clone() };
        assert!(Arc::ptr_eq(&a.scope, &b.scope));
        let mut c = b.clone();
        c.scope_mut().datacenter = Some("dc2".into());
        assert_eq!(b.scope.datacenter.as_deref(), Some("dc1"), "the others' scope is unchanged");
        assert_ne!(b, c);
        assert_eq!(c.with_scope(|s| s.datacenter = Some("dc1".into())), b, "equal by value, not by pointer");
    }

    #[test]
    fn display_never_shows_the_token() {
        let k = consul("billing", Some("b1c2d3e4-aaaa-bbbb-cccc-1234567890ab"));
        let shown = format!("{k} {k:?} {:?}", WatchKey::from(k.clone()));
        assert!(!shown.contains("b1c2d3e4-aaaa"), "{shown}");
        assert!(shown.contains("consul billing at http://127.0.0.1:8500 dc=dc1 passing token=sha256:"));
    }

    #[test]
    fn tokens_make_keys_different() {
        assert_ne!(consul("a", Some("t1")), consul("a", Some("t2")));
        assert_eq!(consul("a", Some("t1")), consul("a", Some("t1")));
        assert_ne!(consul("a", None), consul("a", Some("t1")));
    }

    #[test]
    fn ordering_is_stable_and_total() {
        let mut keys = [
            WatchKey::from(consul("b", None)),
            WatchKey::from(KubeKey::new("getambassador.io", "", "Mapping").in_namespace("z")),
            WatchKey::from(consul("a", None)),
            WatchKey::from(KubeKey::new("getambassador.io", "", "Mapping")),
        ];
        keys.sort();
        let shown: Vec<String> = keys.iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            [
                "Mapping.getambassador.io in all namespaces",
                "Mapping.getambassador.io in z",
                "consul a at http://127.0.0.1:8500 dc=dc1 passing",
                "consul b at http://127.0.0.1:8500 dc=dc1 passing",
            ]
        );
    }

    #[test]
    fn kube_key_display_names_selectors() {
        let k = KubeKey::new("discovery.k8s.io", "v1", "EndpointSlice")
            .in_namespace("shop")
            .with_labels("kubernetes.io/service-name=billing");
        assert_eq!(
            k.to_string(),
            "EndpointSlice.discovery.k8s.io/v1 in shop labels kubernetes.io/service-name=billing"
        );
        let k = KubeKey::new("", "v1", "Secret").in_namespace("shop").with_fields("metadata.name=tok");
        assert_eq!(k.to_string(), "Secret/v1 in shop fields metadata.name=tok");
    }
}
