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
    pub server: ConsulServer,
    pub datacenter: Option<String>,
    pub namespace: Option<String>,
    pub partition: Option<String>,
    /// `?passing`: only instances whose every check passes.
    pub passing: bool,
    /// `?tag=` for each; instances must carry all of them.
    pub tags: BTreeSet<String>,
    pub service: String,
}

impl fmt::Display for ConsulKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "consul {} at {}", self.service, self.server.address)?;
        for (name, value) in [("dc", &self.datacenter), ("ns", &self.namespace), ("partition", &self.partition)] {
            if let Some(v) = value {
                write!(f, " {name}={v}")?;
            }
        }
        if self.passing {
            f.write_str(" passing")?;
        }
        for t in &self.tags {
            write!(f, " tag={t}")?;
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
        ConsulKey {
            server: ConsulServer { address: "http://127.0.0.1:8500".into(), token: token.map(Secret::new), tls: None },
            datacenter: Some("dc1".into()),
            namespace: None,
            partition: None,
            passing: true,
            tags: BTreeSet::new(),
            service: service.into(),
        }
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
