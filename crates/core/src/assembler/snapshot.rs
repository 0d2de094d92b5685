//! The snapshot document: what publishers write out.
//!
//! Deterministic by construction: every list is sorted and every map is a `BTreeMap`, so
//! equal worlds serialise to equal bytes. The `hash` covers everything except `id`, and
//! is what "only changed content is written" compares.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::model::{Endpoint, KubeEndpoint};

pub const API_VERSION: &str = "consulresolver.io/v1alpha1";
pub const KIND: &str = "Snapshot";

/// Everything a snapshot says, without its id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Content {
    pub bootstrap: Bootstrap,
    pub resolvers: Vec<ResolverEntry>,
    pub mappings: Vec<MappingEntry>,
    pub kubernetes_services: Vec<KubeServiceEntry>,
    /// Objects of the static `--watch` keys, per key.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub watched: Vec<WatchedEntry>,
    pub problems: Vec<Problem>,
}

/// The objects of one static `--watch`, sorted by namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchedEntry {
    pub watch: String,
    pub objects: Vec<serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Bootstrap {
    /// True when every watched service answered; false when the bootstrap timeout let the
    /// snapshot out with some Consul services unsynced.
    pub complete: bool,
    /// The Consul services (as `resolver-namespace/resolver-name/service`) that have not
    /// answered yet.
    pub unsynced: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResolverEntry {
    pub namespace: String,
    pub name: String,
    /// The resolver's `metadata.generation` this entry was built from, so its status can
    /// say `observedGeneration` without reading the object again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// Normalised address (`http(s)://host:port`).
    pub address: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub datacenter: Option<String>,
    /// Why the resolver cannot be queried as it stands. Its `services` then hold only the
    /// endpoints last obtained before, marked `stale`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unusable: Option<Unusable>,
    pub services: Vec<ServiceEntry>,
}

/// Why a resolver cannot be queried.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Unusable {
    pub reason: UnusableReason,
    /// Names the field or the Secret, and what is wrong with it.
    pub message: String,
}

/// The kinds of [`Unusable`]; the names are also the resolver's condition reasons.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum UnusableReason {
    /// The spec cannot be used as written (fixed by editing the resolver).
    InvalidSpec,
    /// A Secret it names is missing, unreadable or does not hold what the spec says.
    SecretUnavailable,
    /// A Secret it names has not been read yet (a moment after the resolver names it).
    WaitingForSecret,
}

impl UnusableReason {
    pub fn as_str(self) -> &'static str {
        match self {
            UnusableReason::InvalidSpec => "InvalidSpec",
            UnusableReason::SecretUnavailable => "SecretUnavailable",
            UnusableReason::WaitingForSecret => "WaitingForSecret",
        }
    }
}

/// Endpoints that are not the current answer of the resolver's current settings: they are
/// the ones last obtained, kept so a broken token or spec does not empty the upstreams.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Stale {
    /// RFC 3339 time from which they have been stale.
    pub since: String,
    /// Why they are not current.
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceEntry {
    pub name: String,
    /// Consul has answered for this service at least once.
    pub synced: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Present when `endpoints` are not current (see [`Stale`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale: Option<Stale>,
    pub endpoints: Vec<Endpoint>,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MappingEntry {
    pub kind: String,
    pub namespace: String,
    pub name: String,
    /// `spec.service` as written.
    pub service: String,
    pub target: Target,
}

/// Where a Mapping's traffic goes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum Target {
    /// A Consul service through a ConsulResolver.
    #[serde(rename_all = "camelCase")]
    Consul {
        resolver_namespace: String,
        resolver_name: String,
        service: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        port: Option<u16>,
    },
    /// A Kubernetes Service.
    #[serde(rename_all = "camelCase")]
    Kubernetes {
        namespace: String,
        service: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        port: Option<u16>,
    },
    /// A literal address; nothing is watched.
    Address { address: String },
    /// Could not be resolved; see `problems`.
    Unresolved,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeServiceEntry {
    pub namespace: String,
    pub name: String,
    /// The Service's endpoints have been listed.
    pub synced: bool,
    /// Why the API server refuses to let the operator watch them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub endpoints: Vec<KubeEndpoint>,
}

/// Something wrong with an object, reported rather than guessed around.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Problem {
    pub kind: String,
    pub namespace: String,
    pub name: String,
    pub message: String,
}

/// A published snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    pub api_version: String,
    pub kind: String,
    /// Increases with every publication of this operator process.
    pub id: u64,
    /// `sha256:` of the canonical JSON of the content.
    pub hash: String,
    #[serde(flatten)]
    pub content: Content,
}

impl Content {
    /// The content hash: equal content, equal hash.
    pub fn hash(&self) -> String {
        let bytes = serde_json::to_vec(self).expect("snapshot content always serialises");
        format!("sha256:{}", hex::encode(Sha256::digest(&bytes)))
    }

    pub fn into_snapshot(self, id: u64) -> Snapshot {
        let hash = self.hash();
        self.into_snapshot_with_hash(id, hash)
    }

    /// [`Content::into_snapshot`] for a caller that has just computed `self.hash()`: at
    /// scale, serialising the content for its hash is the costliest step of a publication,
    /// so it is done once.
    pub fn into_snapshot_with_hash(self, id: u64, hash: String) -> Snapshot {
        debug_assert_eq!(hash, self.hash());
        Snapshot { api_version: API_VERSION.into(), kind: KIND.into(), id, hash, content: self }
    }
}

impl Snapshot {
    /// The canonical bytes publishers write.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("snapshots always serialise")
    }

    /// This snapshot's part about resolver `namespace/name`, if it is in scope.
    pub fn resolver(&self, namespace: &str, name: &str) -> Option<&ResolverEntry> {
        self.content.resolvers.iter().find(|r| r.namespace == namespace && r.name == name)
    }
}
