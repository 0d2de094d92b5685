//! The snapshot document: what publishers write out.
//!
//! Deterministic by construction: every list is sorted and every map is a `BTreeMap`, so
//! equal worlds serialise to equal bytes. The `hash` covers everything except `id`, and
//! is what "only changed content is written" compares.
//!
//! The parts are shared ([`Part`]): the assembler keeps them between changes, so a content
//! is pointer copies, and each part is turned into JSON once, however many snapshots hold
//! it. A publication serialises the content once, mostly by copying its parts' JSON: the
//! hash is taken of those bytes, and the document's are the same bytes behind its
//! `apiVersion`, `kind`, `id` and `hash`.

use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use super::gzip::{Compressor, Gzipped};
use crate::model::{Endpoints, KubeEndpoint};

pub const API_VERSION: &str = "consulresolver.io/v1alpha1";
pub const KIND: &str = "Snapshot";

/// A part of a snapshot, shared between the snapshots that hold it, with its JSON made the
/// first time it is serialised and copied after that. Between two snapshots most parts are
/// the same (one Consul answer changes one service), so this makes serialising a
/// snapshot cost about what changed, plus a copy of the rest.
pub struct Part<T>(Arc<PartInner<T>>);

#[derive(Clone)]
struct PartInner<T> {
    value: T,
    json: OnceLock<Box<RawValue>>,
}

impl<T> Part<T> {
    pub fn new(value: T) -> Self {
        Part(Arc::new(PartInner { value, json: OnceLock::new() }))
    }

    /// The value to change: this part's own copy if it is shared, with its JSON to be
    /// made again.
    pub fn make_mut(this: &mut Self) -> &mut T
    where
        T: Clone,
    {
        let inner = Arc::make_mut(&mut this.0);
        inner.json = OnceLock::new();
        &mut inner.value
    }

    /// Whether both are the very same part (not only equal).
    pub fn ptr_eq(a: &Self, b: &Self) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }
}

impl<T> Clone for Part<T> {
    fn clone(&self) -> Self {
        Part(self.0.clone())
    }
}

impl<T> Deref for Part<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0.value
    }
}

impl<T> AsRef<T> for Part<T> {
    fn as_ref(&self) -> &T {
        &self.0.value
    }
}

impl<T: PartialEq> PartialEq for Part<T> {
    fn eq(&self, other: &Self) -> bool {
        Part::ptr_eq(self, other) || self.0.value == other.0.value
    }
}

impl<T: Eq> Eq for Part<T> {}

impl<T: fmt::Debug> fmt::Debug for Part<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.value.fmt(f)
    }
}

impl<T: Serialize> Serialize for Part<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let json = match self.0.json.get() {
            Some(json) => json,
            None => {
                let json = serde_json::value::to_raw_value(&self.0.value).map_err(serde::ser::Error::custom)?;
                self.0.json.get_or_init(|| json)
            }
        };
        json.serialize(s)
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Part<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        T::deserialize(d).map(Part::new)
    }
}

/// Everything a snapshot says, without its id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Content {
    pub bootstrap: Bootstrap,
    pub resolvers: Vec<Part<ResolverEntry>>,
    pub mappings: Vec<Part<MappingEntry>>,
    pub kubernetes_services: Vec<Part<KubeServiceEntry>>,
    /// Objects of the static `--watch` keys, per key.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub watched: Vec<WatchedEntry>,
    pub problems: Vec<Problem>,
    /// The `ConsulService` exports, sorted by namespace and name: which resolver's entry
    /// each reads (the endpoints are in that resolver's `services`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exports: Vec<Part<ExportEntry>>,
}

/// A `ConsulService` export, routed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExportEntry {
    pub namespace: String,
    pub name: String,
    /// The export's `metadata.generation`, for its status's `observedGeneration`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// The Consul service.
    pub service: String,
    /// The resolver it is read through, `namespace/name`; absent when none can be used
    /// (`problem` says why).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolver: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
    /// The service's entry in the resolver's `services` (shared with it; in the document
    /// only there).
    #[serde(skip)]
    pub source: Option<Part<ServiceEntry>>,
}

/// The objects of one static `--watch`, sorted by namespace and name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchedEntry {
    pub watch: String,
    pub objects: Vec<Arc<serde_json::Value>>,
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
    pub services: Vec<Part<ServiceEntry>>,
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
    pub endpoints: Endpoints,
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

/// A published snapshot: its content, and the document's bytes (serialised once).
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Increases with every publication of this operator process.
    pub id: u64,
    /// `sha256:` of the canonical JSON of the content.
    pub hash: String,
    pub content: Content,
    json: Bytes,
    /// How many of `json`'s first bytes are the header (`apiVersion`, `kind`, `id`, `hash`):
    /// what changes in every snapshot, gzipped as a segment of its own.
    header_len: usize,
    /// The document gzipped, once, by the first publisher that needs it.
    gzipped: OnceLock<Arc<Gzipped>>,
}

impl PartialEq for Snapshot {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id && self.hash == other.hash && self.content == other.content && self.json == other.json
    }
}

impl Eq for Snapshot {}

/// The document as JSON: what readers parse.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Document {
    api_version: String,
    kind: String,
    id: u64,
    hash: String,
    #[serde(flatten)]
    content: Content,
}

/// `sha256:` and the hex digest of `bytes`.
fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// Room left before a content's JSON for the document's header (`apiVersion`, `kind`,
/// `id`, `hash`), so that the document is made in place, without copying the content.
const HEADER_ROOM: usize = 192;

/// A content's canonical JSON, laid out to become its document in place (see
/// [`Snapshot::from_serialised`]): at 55 MB, the copy into a new buffer and the reallocations
/// of a buffer grown from nothing were a tenth of the operator's CPU per change.
pub struct Serialised {
    /// [`HEADER_ROOM`] bytes, then the content's JSON.
    buf: Vec<u8>,
    hash: String,
}

impl Serialised {
    /// The content hash.
    pub fn hash(&self) -> &str {
        &self.hash
    }

    /// The content's JSON.
    pub fn json(&self) -> &[u8] {
        &self.buf[HEADER_ROOM..]
    }
}

impl Content {
    /// The canonical JSON of the content, and its hash (equal content, equal bytes, equal
    /// hash), with room for the header before them; `size_hint` (the last snapshot's size)
    /// spares the buffer's growth.
    pub fn serialised(&self, size_hint: usize) -> Serialised {
        let mut buf = Vec::with_capacity(HEADER_ROOM + size_hint + size_hint / 16);
        buf.resize(HEADER_ROOM, b' ');
        serde_json::to_writer(&mut buf, self).expect("snapshot content always serialises");
        // The document keeps this buffer: not with a doubling's worth of slack, should the
        // content have outgrown the hint.
        if buf.capacity() > buf.len() + buf.len() / 8 {
            buf.shrink_to_fit();
        }
        let hash = sha256(&buf[HEADER_ROOM..]);
        Serialised { buf, hash }
    }

    /// The content hash.
    pub fn hash(&self) -> String {
        self.serialised(0).hash
    }

    pub fn into_snapshot(self, id: u64) -> Snapshot {
        let serialised = self.serialised(0);
        Snapshot::from_serialised(id, self, serialised)
    }
}

/// The document's header: its opening brace, `apiVersion`, `kind`, `id` and `hash`, and the
/// comma before the content's first field.
fn header(id: u64, hash: &str) -> String {
    format!(r#"{{"apiVersion":"{API_VERSION}","kind":"{KIND}","id":{id},"hash":"{hash}","#)
}

impl Snapshot {
    /// The snapshot of `content`, whose canonical JSON is `content_json` with hash `hash`:
    /// the document is those bytes behind the header, not a second serialisation.
    pub fn new(id: u64, hash: String, content: Content, content_json: &[u8]) -> Snapshot {
        debug_assert_eq!(content_json.first(), Some(&b'{'));
        let header = header(id, &hash);
        let mut json = Vec::with_capacity(header.len() + content_json.len());
        json.extend_from_slice(header.as_bytes());
        json.extend_from_slice(&content_json[1..]);
        Snapshot { id, hash, content, json: Bytes::from(json), header_len: header.len(), gzipped: OnceLock::new() }
    }

    /// The snapshot of `content`, serialised as `serialised`: the header is written into
    /// the room left for it, and the document is the same buffer from there on.
    pub fn from_serialised(id: u64, content: Content, serialised: Serialised) -> Snapshot {
        let Serialised { mut buf, hash } = serialised;
        let header = header(id, &hash);
        debug_assert_eq!(buf.get(HEADER_ROOM), Some(&b'{'));
        // The header's last byte, its comma, takes the place of the content's `{`.
        let Some(start) = (HEADER_ROOM + 1).checked_sub(header.len()) else {
            return Snapshot::new(id, hash, content, &buf[HEADER_ROOM..]);
        };
        buf[start..=HEADER_ROOM].copy_from_slice(header.as_bytes());
        let json = Bytes::from(buf).slice(start..);
        Snapshot { id, hash, content, json, header_len: header.len(), gzipped: OnceLock::new() }
    }

    /// Reads a published document back (tools and tests).
    pub fn parse(json: &[u8]) -> Result<Snapshot, serde_json::Error> {
        let doc: Document = serde_json::from_slice(json)?;
        let header = header(doc.id, &doc.hash);
        Ok(Snapshot {
            id: doc.id,
            hash: doc.hash,
            content: doc.content,
            json: Bytes::copy_from_slice(json),
            header_len: if json.starts_with(header.as_bytes()) { header.len() } else { 0 },
            gzipped: OnceLock::new(),
        })
    }

    /// The document's bytes, shared: every publisher writes these.
    pub fn to_json(&self) -> Bytes {
        self.json.clone()
    }

    /// The document gzipped by `compressor` the first time any publisher asks, and the same
    /// segments after that: the ConfigMap writes them, the HTTP history keeps them. Every
    /// caller passes the operator's one compressor, which remembers the previous snapshot's
    /// segments: only what changed is compressed again.
    pub fn gzipped(&self, compressor: &Compressor) -> Arc<Gzipped> {
        self.gzipped.get_or_init(|| Arc::new(compressor.gzip(&self.json, self.header_len))).clone()
    }

    /// This snapshot's part about resolver `namespace/name`, if it is in scope.
    pub fn resolver(&self, namespace: &str, name: &str) -> Option<&ResolverEntry> {
        self.content.resolvers.iter().find(|r| r.namespace == namespace && r.name == name).map(|r| &**r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_part_serialises_as_its_value_would_every_time_and_into_any_json_form() {
        let entry = ServiceEntry {
            name: "web \"quoted\" é".into(),
            synced: true,
            index: Some(7),
            error: None,
            stale: None,
            endpoints: vec![].into(),
        };
        let plain = serde_json::to_string(&entry).unwrap();
        let part = Part::new(entry.clone());
        assert_eq!(serde_json::to_string(&part).unwrap(), plain);
        assert_eq!(serde_json::to_string(&part).unwrap(), plain, "the second time, from its kept JSON");
        assert_eq!(serde_json::to_value(&part).unwrap(), serde_json::to_value(&entry).unwrap());
        let back: Part<ServiceEntry> = serde_json::from_str(&plain).unwrap();
        assert_eq!(back, part);
        assert!(!Part::ptr_eq(&back, &part) && Part::ptr_eq(&part.clone(), &part));
    }

    #[test]
    fn the_document_is_the_content_bytes_behind_a_header_as_serde_writes_it() {
        let content = Content {
            bootstrap: Bootstrap { complete: false, unsynced: vec!["a/b/c".into()] },
            resolvers: vec![],
            mappings: vec![Part::new(MappingEntry {
                kind: "Mapping".into(),
                namespace: "shop".into(),
                name: "m".into(),
                service: "web:80".into(),
                target: Target::Unresolved,
            })],
            kubernetes_services: vec![],
            watched: vec![],
            problems: vec![],
            exports: vec![],
        };
        let s = content.clone().into_snapshot(7);
        let by_serde = serde_json::to_vec(&Document {
            api_version: API_VERSION.into(),
            kind: KIND.into(),
            id: 7,
            hash: s.hash.clone(),
            content: content.clone(),
        })
        .unwrap();
        assert_eq!(s.to_json(), by_serde);
        assert_eq!(s.hash, content.hash());
        assert_eq!(Snapshot::parse(&s.to_json()).unwrap(), s);
        // The header, gzipped apart from the content: exactly up to the content's first field.
        assert!(s.to_json()[s.header_len..].starts_with(br#""bootstrap":"#), "{}", s.header_len);
        assert_eq!(Snapshot::parse(&s.to_json()).unwrap().header_len, s.header_len);
        // Made in place, for any id and whatever the size hint: the document serde writes.
        for (id, hint) in [(7, 0), (7, 1 << 20), (u64::MAX, 3)] {
            let serialised = content.serialised(hint);
            assert_eq!(serialised.hash(), s.hash);
            let in_place = Snapshot::from_serialised(id, content.clone(), serialised);
            let by_serde = serde_json::to_vec(&Document {
                api_version: API_VERSION.into(),
                kind: KIND.into(),
                id,
                hash: s.hash.clone(),
                content: content.clone(),
            })
            .unwrap();
            assert_eq!(in_place.to_json(), by_serde, "id {id}, hint {hint}");
            assert!(in_place.to_json()[in_place.header_len..].starts_with(br#""bootstrap":"#));
        }
    }
}
