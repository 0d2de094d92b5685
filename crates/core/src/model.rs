//! Plain data that flows from the sources into the world, and the events that carry it. No
//! Kubernetes or HTTP types: sources translate what they receive into these.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use consul_resolver_api::export::ConsulServiceSpec;
use consul_resolver_api::mapping::MappingKind;
use consul_resolver_api::resolver::ConsulResolverSpec;
use consul_resolver_api::service::{ServiceRef, ServiceRefError};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::keys::{ConsulKey, KubeKey};

/// Identity of a Kubernetes object within one watch.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectId {
    pub namespace: Option<String>,
    pub name: String,
}

/// A Kubernetes object as a source received it: its `metadata` read (without
/// `managedFields`, which nothing reads), and every other top-level field (`spec`,
/// `status`, `data`, ...) kept as the API server wrote it, read only by what needs it
/// ([`crate::ingest`]). A Mapping's spec is decoded straight from its text. Decoding the
/// metadata with its `managedFields`, writing it back as JSON and building each Mapping's
/// JSON before reading it made a page of 500 cost 2.2 ms instead of 0.95
/// (docs/benchmarks.md).
#[derive(Debug, Clone)]
pub struct KubeObject {
    pub id: ObjectId,
    metadata: Map<String, Value>,
    /// Field name and its JSON text, in the order received.
    fields: Vec<(String, Box<RawValue>)>,
}

impl PartialEq for KubeObject {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
            && self.metadata == other.metadata
            && self.fields.len() == other.fields.len()
            && self.fields.iter().zip(&other.fields).all(|((k, v), (l, w))| k == l && v.get() == w.get())
    }
}

impl KubeObject {
    /// Reads the id from `metadata`; `None` when the object has no name.
    pub fn from_value(value: Value) -> Option<Self> {
        let Value::Object(mut map) = value else { return None };
        let metadata = match map.remove("metadata") {
            Some(Value::Object(m)) => m,
            _ => Map::new(),
        };
        let fields =
            map.into_iter().filter_map(|(k, v)| Some((k, serde_json::value::to_raw_value(&v).ok()?))).collect();
        Self::from_parts(metadata, fields)
    }

    /// From `metadata` and the other fields' JSON text; `None` when it has no name.
    pub fn from_parts(metadata: Map<String, Value>, fields: Vec<(String, Box<RawValue>)>) -> Option<Self> {
        let text = |key: &str| metadata.get(key).and_then(Value::as_str).map(str::to_owned);
        let id = ObjectId { namespace: text("namespace"), name: text("name")? };
        Some(KubeObject { id, metadata, fields })
    }

    pub fn metadata(&self) -> &Map<String, Value> {
        &self.metadata
    }

    /// A top-level field's JSON text.
    pub fn field(&self, name: &str) -> Option<&str> {
        self.fields.iter().find(|(k, _)| k == name).map(|(_, v)| v.get())
    }

    /// The whole object as JSON.
    pub fn to_value(&self) -> Value {
        let mut map = Map::new();
        for (key, text) in &self.fields {
            // A `RawValue` is valid JSON by construction: this cannot fail.
            map.insert(key.clone(), serde_json::from_str(text.get()).unwrap_or(Value::Null));
        }
        map.insert("metadata".into(), Value::Object(self.metadata.clone()));
        Value::Object(map)
    }
}

/// A Kubernetes object as the world keeps it: decoded, once, when it arrives, into what the
/// assembler reads of its kind. The JSON itself is kept only where it is read: resolvers
/// (the status controller compares their live status) and the `--watch` keys (copied into
/// the snapshot). At scale the JSON of tens of thousands of Mappings would be most of the
/// memory, and parsing it again on every change most of the CPU.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub raw: Option<Arc<Value>>,
    pub decoded: Decoded,
}

/// What the assembler reads of an object, by its kind.
#[derive(Debug, Clone, PartialEq)]
pub enum Decoded {
    /// Boxed: a spec is several times the size of the other variants.
    Resolver(Box<ResolverObject>),
    /// A ConsulService export.
    Export(Box<ExportObject>),
    /// A Mapping or TCPMapping, or why it cannot be read (a problem on it). Boxed: the
    /// world holds every kind in one B-tree per kind, and a Mapping is four times the size
    /// of the other variants.
    Mapping(Box<Result<MappingObject, String>>),
    /// A Secret's data, base64-decoded per key (`None`: the value is not valid base64).
    Secret(BTreeMap<String, Option<Vec<u8>>>),
    /// The addresses of a Service (`service`: its name, from an EndpointSlice's
    /// `kubernetes.io/service-name` label or the Endpoints object's name), so that one
    /// watch of a namespace's endpoints can serve each of its Services.
    Endpoints { service: String, endpoints: Vec<KubeEndpoint> },
    /// A Namespace's labels: whom a resolver with `allowedNamespaces.selector` serves.
    Labels(BTreeMap<String, String>),
    /// Read as JSON (`raw`): the objects of `--watch` keys.
    Json,
}

/// A ConsulResolver as the assembler reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolverObject {
    /// `metadata.generation`, for the status's `observedGeneration`.
    pub generation: Option<i64>,
    /// The spec, or why it cannot be read.
    pub spec: Result<ConsulResolverSpec, String>,
}

/// A ConsulService as the assembler reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportObject {
    /// `metadata.generation`, for the status's `observedGeneration`.
    pub generation: Option<i64>,
    /// The spec, or why it cannot be read.
    pub spec: Result<ConsulServiceSpec, String>,
}

/// A Mapping or TCPMapping as the assembler reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MappingObject {
    pub kind: MappingKind,
    pub namespace: String,
    pub name: String,
    /// `spec.service` as written (empty when absent).
    pub service: String,
    /// ... and parsed.
    pub target: Result<ServiceRef, ServiceRefError>,
    pub resolver: Option<String>,
    /// `ambassador_id`, absent or empty meaning `default`.
    pub ambassador_ids: Option<Vec<String>>,
}

impl MappingObject {
    /// Whether this Mapping belongs to the operator's Ambassador ID.
    pub fn serves_ambassador_id(&self, id: &str) -> bool {
        match self.ambassador_ids.as_deref() {
            None | Some([]) => id == consul_resolver_api::DEFAULT_AMBASSADOR_ID,
            Some(ids) => ids.iter().any(|i| i == id),
        }
    }
}

/// Summary of an instance's health checks (beside the keys, whose query options admit
/// health statuses).
pub use crate::keys::Health;

/// A Consul service's endpoints as last answered, shared: the world's store, each
/// resolver's snapshot entry and its last-known-good copy hold the same list (at 75,000
/// endpoints and five resolvers, cloned lists were about 100 MiB; docs/benchmarks.md).
pub type Endpoints = std::sync::Arc<[Endpoint]>;

/// One instance of a Consul service.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Endpoint {
    /// `Service.Address`, or `Node.Address` when that is empty.
    pub address: String,
    pub port: u16,
    pub node: String,
    pub service_id: String,
    /// Sorted.
    pub tags: Vec<String>,
    pub meta: BTreeMap<String, String>,
    /// The worst status among the instance's checks (node checks included).
    pub health: Health,
    /// `Service.Locality.Zone` (Consul 1.17+), when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// The instance's share of traffic at its health: `Service.Weights.Passing` while
    /// passing, `Weights.Warning` while warning; absent when it is Consul's default, 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
}

/// One address of a Kubernetes Service (from EndpointSlices or Endpoints).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeEndpoint {
    pub address: String,
    /// Named ports of the service, sorted by name.
    pub ports: Vec<KubePort>,
    pub ready: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct KubePort {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub port: u16,
}

/// What a Kubernetes source reports. Mirrors a list-then-watch stream: after a (re)list
/// starts, objects are collected and replace the key's store atomically at `ListDone`, so
/// readers never see a half-relisted store.
#[derive(Debug, Clone, PartialEq)]
pub enum KubeEvent {
    ListStarted,
    Listed(KubeObject),
    ListDone,
    Applied(KubeObject),
    Deleted(ObjectId),
    /// The watch failed; the source retries with backoff. The store keeps its objects.
    Failed(WatchFailure),
}

/// Why a Kubernetes watch failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchFailure {
    pub message: String,
    /// The API server refused the request itself (a 4xx other than 410 Gone and 429): the
    /// same request keeps failing until something else changes (RBAC, the object that
    /// implied the watch). It is reported on that object; transient failures (the API
    /// server restarting, a dropped connection) are retried without a word in the snapshot.
    pub rejected: bool,
}

impl WatchFailure {
    pub fn transient(message: impl Into<String>) -> Self {
        WatchFailure { message: message.into(), rejected: false }
    }

    pub fn rejected(message: impl Into<String>) -> Self {
        WatchFailure { message: message.into(), rejected: true }
    }
}

/// What a Consul source reports.
#[derive(Debug, Clone, PartialEq)]
pub enum ConsulEvent {
    /// Consul answered: the full current endpoint list (sorted) and its index. Shared: the
    /// watch keeps the list it reported, to tell the next answer's news, and the world
    /// holds the same one.
    Answer { index: u64, endpoints: Endpoints },
    /// A Consul agent answered a `cached` read from its cache, and its cache has been cut
    /// off from the servers since `cut_off_since` (its `Age` header): the endpoints as the
    /// agent last knew them, published marked stale since then.
    Cached { index: u64, endpoints: Endpoints, cut_off_since: SystemTime },
    /// A query failed; the last known endpoints stay in place.
    Failed(String),
    /// Consul refused the query itself (a 4xx other than 429: a `filter` it cannot parse, a
    /// token it rejects): as `Failed`, but asking again cannot help until the resolver
    /// changes, so for the first snapshot the service is known (known to be unreadable),
    /// and nobody else's endpoints wait for it.
    Refused(String),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Kube(KubeKey, KubeEvent),
    Consul(ConsulKey, ConsulEvent),
}
