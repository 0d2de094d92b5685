//! The snapshot document: what publishers write out.
//!
//! Deterministic by construction: every list is sorted and every map is a `BTreeMap`, so
//! equal worlds serialise to equal bytes. The `hash` covers everything except `id`, and
//! is what "only changed content is written" compares.
//!
//! The parts are shared ([`Part`]): the assembler keeps them between changes, so a content
//! is pointer copies, and each part is turned into JSON once, however many snapshots hold
//! it. A publication writes the content as pieces, mostly its parts' JSON, shared, never
//! copied into one buffer ([`super::write`]), cut into segments ([`super::segment`]): the
//! hash is a digest of the segments' digests, and the document is the same segments behind
//! a header (`apiVersion`, `kind`, `id` and `hash`).

use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::gzip::{self, Gzipped};
use super::segment::{self, Cut, Cutter, Segment};
use crate::model::{Endpoints, KubeEndpoint};

pub const API_VERSION: &str = "consulresolver.io/v1alpha1";
pub const KIND: &str = "Snapshot";

/// A part of a snapshot, shared between the snapshots that hold it, with its JSON made the
/// first time a document is written and shared after that. Between two snapshots most parts
/// are the same (one Consul answer changes one service), so this makes writing a snapshot
/// cost about what changed.
pub struct Part<T>(Arc<PartInner<T>>);

#[derive(Clone)]
struct PartInner<T> {
    value: T,
    /// The JSON, and its [`segment::hash`].
    json: OnceLock<(Bytes, u64)>,
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

    /// Where it lives: the same as another part's while both live only if they are the
    /// very same part.
    pub(crate) fn address(&self) -> usize {
        Arc::as_ptr(&self.0) as usize
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

impl<T> Part<T> {
    /// Whether its JSON has been made.
    #[cfg(test)]
    pub(crate) fn has_json(&self) -> bool {
        self.0.json.get().is_some()
    }
}

impl<T: Serialize> Part<T> {
    /// The JSON (made the first time, shared after that) and its [`segment::hash`].
    pub(crate) fn json(&self) -> (Bytes, u64) {
        self.0
            .json
            .get_or_init(|| {
                let json = serde_json::to_vec(&self.0.value).expect("snapshot parts always serialise");
                // Kept for as long as the part: without the slack of the doubling buffer
                // it was written into (up to half of it; 20 MB at the scale profile).
                let json = Bytes::from(json.into_boxed_slice());
                let hash = segment::hash(&json);
                (json, hash)
            })
            .clone()
    }
}

/// As the value: documents are written from the kept JSON ([`Part::json`]), not through
/// this.
impl<T: Serialize> Serialize for Part<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.value.serialize(s)
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Part<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        T::deserialize(d).map(Part::new)
    }
}

/// A list of parts shared between contents. The assembler keeps its list of Mappings (and
/// of Kubernetes Services) from change to change and makes it again only when one of them
/// changes, so that a content after a Consul change holds the very same list as the one
/// before: a pointer copy, and a run of segments the writer takes whole
/// ([`super::segment::Segmenter::run`]) instead of visiting each of its 100,000 elements.
/// Resolvers that follow the same services share one list of them the same way.
pub struct Parts<T>(Arc<Vec<Part<T>>>);

impl<T> Parts<T> {
    /// Whether both are the very same list (not only equal).
    pub fn ptr_eq(a: &Self, b: &Self) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }

    /// The list to change: this content's own copy if it is shared.
    pub fn to_mut(&mut self) -> &mut Vec<Part<T>> {
        Arc::make_mut(&mut self.0)
    }
}

impl<T: Send + Sync + 'static> Parts<T> {
    /// The list as what a run of segments is filed under: held, so its address is not
    /// another list's while the run is remembered.
    pub(crate) fn shared(&self) -> Arc<dyn std::any::Any + Send + Sync> {
        self.0.clone()
    }
}

impl<T> Clone for Parts<T> {
    fn clone(&self) -> Self {
        Parts(self.0.clone())
    }
}

impl<T> Default for Parts<T> {
    fn default() -> Self {
        Parts(Arc::default())
    }
}

impl<T> Deref for Parts<T> {
    type Target = [Part<T>];
    fn deref(&self) -> &[Part<T>] {
        &self.0
    }
}

impl<T> From<Vec<Part<T>>> for Parts<T> {
    fn from(parts: Vec<Part<T>>) -> Self {
        Parts(Arc::new(parts))
    }
}

impl<T> FromIterator<Part<T>> for Parts<T> {
    fn from_iter<I: IntoIterator<Item = Part<T>>>(iter: I) -> Self {
        Parts(Arc::new(iter.into_iter().collect()))
    }
}

impl<T: PartialEq> PartialEq for Parts<T> {
    fn eq(&self, other: &Self) -> bool {
        Parts::ptr_eq(self, other) || self.0 == other.0
    }
}

impl<T: Eq> Eq for Parts<T> {}

impl<T: fmt::Debug> fmt::Debug for Parts<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl<T: Serialize> Serialize for Parts<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Parts<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::deserialize(d).map(Parts::from)
    }
}

/// Everything a snapshot says, without its id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Content {
    pub bootstrap: Bootstrap,
    pub resolvers: Vec<Part<ResolverEntry>>,
    pub mappings: Parts<MappingEntry>,
    pub kubernetes_services: Parts<KubeServiceEntry>,
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
    /// `problem` is a resolver that exists but cannot be used now (its spec, a Secret it
    /// names) and kept nothing: the export's live slices are held, not removed
    /// (docs/export.md, "Staleness"). Not in the document: the edge's concern.
    #[serde(skip)]
    pub resolver_unusable: bool,
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
    /// One list for every resolver whose services are the same parts (resolvers that follow
    /// the same Consul and the same services), written once per document.
    pub services: Parts<ServiceEntry>,
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

/// A published snapshot: its content, and the document: a header, then the content's
/// segments.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Increases with every publication of this operator process.
    pub id: u64,
    /// The content hash (docs/snapshot.md): a digest of the segments' sha256s.
    pub hash: String,
    pub content: Content,
    /// The document's header (`apiVersion`, `kind`, `id`, `hash`): what changes in every
    /// snapshot, gzipped as a segment of its own.
    header: Bytes,
    segments: Arc<[Arc<Segment>]>,
    /// Bytes of the whole document.
    len: usize,
    /// The document gzipped, once, by the first publisher that needs it.
    gzipped: OnceLock<Arc<Gzipped>>,
}

impl PartialEq for Snapshot {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id && self.hash == other.hash && self.content == other.content
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

impl Content {
    /// The content cut into segments by `cutter` (which reuses the last content's where
    /// they are the same), and its hash.
    pub fn cut(&self, cutter: &mut Cutter) -> Cut {
        if cutter.is_first() {
            self.write_ahead();
        }
        cutter.cut(|w| self.write(w))
    }

    /// The content hash.
    pub fn hash(&self) -> String {
        self.cut(&mut Cutter::default()).hash
    }

    pub fn into_snapshot(self, id: u64) -> Snapshot {
        let cut = self.cut(&mut Cutter::default());
        Snapshot::new(id, self, cut)
    }
}

/// The document's header: its opening brace, `apiVersion`, `kind`, `id` and `hash`, and the
/// comma before the content's first field.
fn header(id: u64, hash: &str) -> String {
    format!(r#"{{"apiVersion":"{API_VERSION}","kind":"{KIND}","id":{id},"hash":"{hash}","#)
}

impl Snapshot {
    /// The snapshot of `content`, cut as `cut`: the document is the header, then those
    /// segments.
    pub fn new(id: u64, content: Content, cut: Cut) -> Snapshot {
        let header = Bytes::from(header(id, &cut.hash));
        Snapshot {
            id,
            hash: cut.hash,
            content,
            len: header.len() + cut.len,
            header,
            segments: cut.segments,
            gzipped: OnceLock::new(),
        }
    }

    /// Reads a published document back (tools and tests).
    pub fn parse(json: &[u8]) -> Result<Snapshot, serde_json::Error> {
        let doc: Document = serde_json::from_slice(json)?;
        let cut = doc.content.cut(&mut Cutter::default());
        let mut snapshot = Snapshot::new(doc.id, doc.content, cut);
        // As published, should it have been hashed otherwise.
        snapshot.hash = doc.hash;
        snapshot.header = Bytes::from(header(doc.id, &snapshot.hash));
        snapshot.len = snapshot.header.len() + snapshot.segments.iter().map(|s| s.len()).sum::<usize>();
        Ok(snapshot)
    }

    /// Bytes of the document.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// The document's header (`apiVersion`, `kind`, `id`, `hash`); the content's segments
    /// follow it.
    pub fn header(&self) -> &Bytes {
        &self.header
    }

    /// The content's segments, in order.
    pub fn segments(&self) -> &[Arc<Segment>] {
        &self.segments
    }

    /// The document's bytes in order: the header, then every segment's pieces.
    pub fn chunks(&self) -> impl Iterator<Item = &Bytes> {
        std::iter::once(&self.header).chain(self.segments.iter().flat_map(|s| s.pieces()))
    }

    /// The document in one buffer: a copy, for writers that need one (a small ConfigMap)
    /// and tests; large documents are read by [`Snapshot::chunks`] or gzipped.
    pub fn to_json(&self) -> Bytes {
        let mut out = Vec::with_capacity(self.len);
        for chunk in self.chunks() {
            out.extend_from_slice(chunk);
        }
        Bytes::from(out)
    }

    /// The document gzipped the first time any publisher asks, and the same segments after
    /// that: the ConfigMap writes them, the HTTP history keeps them. Only the header and the
    /// segments no earlier snapshot held are deflated: the others were, once, when first
    /// gzipped.
    pub fn gzipped(&self) -> Arc<Gzipped> {
        self.gzipped
            .get_or_init(|| {
                let mut deflated = Vec::with_capacity(self.segments.len() + 1);
                deflated.push(gzip::deflate(std::slice::from_ref(&self.header)));
                deflated.extend(self.segments.iter().map(|s| s.deflated().clone()));
                Arc::new(Gzipped::new(deflated))
            })
            .clone()
    }

    /// This snapshot's part about resolver `namespace/name`, if it is in scope.
    pub fn resolver(&self, namespace: &str, name: &str) -> Option<&ResolverEntry> {
        self.content.resolvers.iter().find(|r| r.namespace == namespace && r.name == name).map(|r| &**r)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::{Endpoint, Health, KubePort};

    #[test]
    fn a_part_serialises_as_its_value_and_keeps_its_json() {
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
        let (json, hash) = part.json();
        assert_eq!(json, plain.as_bytes());
        assert_eq!(hash, segment::hash(plain.as_bytes()));
        assert_eq!(part.json().0.as_ptr(), json.as_ptr(), "made once, shared after");
        assert_eq!(serde_json::to_value(&part).unwrap(), serde_json::to_value(&entry).unwrap());
        let back: Part<ServiceEntry> = serde_json::from_str(&plain).unwrap();
        assert_eq!(back, part);
        assert!(!Part::ptr_eq(&back, &part) && Part::ptr_eq(&part.clone(), &part));
        // A changed copy makes its JSON again.
        let mut changed = part.clone();
        Part::make_mut(&mut changed).index = Some(8);
        assert_ne!(changed.json().0, json);
        assert_eq!(part.json().0, json);
    }

    fn endpoint(i: usize) -> Endpoint {
        Endpoint {
            address: format!("10.0.{}.{}", i / 256, i % 256),
            port: 8080,
            node: format!("node-{i}"),
            service_id: format!("web-{i}"),
            tags: vec!["v1".into()],
            meta: [("build".to_owned(), format!("{i:016x}"))].into(),
            health: Health::Passing,
            zone: i.is_multiple_of(2).then(|| "zone-a".into()),
            weight: None,
        }
    }

    fn service(name: &str, n: usize) -> Part<ServiceEntry> {
        Part::new(ServiceEntry {
            name: name.into(),
            synced: true,
            index: Some(n as u64),
            error: (n == 0).then(|| "no instances".into()),
            stale: (n == 1).then(|| Stale { since: "2026-11-25T00:00:00Z".into(), reason: "token".into() }),
            endpoints: (0..n).map(endpoint).collect(),
        })
    }

    /// Every field and every optional one set somewhere.
    pub(crate) fn rich(services: usize) -> Content {
        let resolver = |name: &str, unusable: bool| {
            Part::new(ResolverEntry {
                namespace: "shop".into(),
                name: name.into(),
                generation: Some(3),
                address: "http://127.0.0.1:8500".into(),
                datacenter: Some("dc1".into()),
                unusable: unusable.then(|| Unusable {
                    reason: UnusableReason::SecretUnavailable,
                    message: "Secret shop/token: not found".into(),
                }),
                services: (0..services).map(|i| service(&format!("svc-{i:05}"), i % 17)).collect(),
            })
        };
        Content {
            bootstrap: Bootstrap { complete: false, unsynced: vec!["a/b/c".into()] },
            resolvers: vec![resolver("consul", false), resolver("other", true), resolver("empty", false)],
            mappings: (0..services)
                .map(|i| {
                    Part::new(MappingEntry {
                        kind: "Mapping".into(),
                        namespace: "shop".into(),
                        name: format!("m-{i}"),
                        service: format!("svc-{i:05}.consul"),
                        target: Target::Consul {
                            resolver_namespace: "shop".into(),
                            resolver_name: "consul".into(),
                            service: format!("svc-{i:05}"),
                            port: i.is_multiple_of(2).then_some(80),
                        },
                    })
                })
                .collect(),
            kubernetes_services: Parts::from(vec![Part::new(KubeServiceEntry {
                namespace: "shop".into(),
                name: "k".into(),
                synced: true,
                error: None,
                endpoints: vec![KubeEndpoint {
                    address: "10.1.0.1".into(),
                    ports: vec![KubePort { name: Some("http".into()), port: 80 }],
                    ready: true,
                }],
            })]),
            watched: vec![WatchedEntry {
                watch: "v1/ConfigMap".into(),
                objects: vec![Arc::new(serde_json::json!({"a": 1}))],
            }],
            problems: vec![Problem {
                kind: "Mapping".into(),
                namespace: "shop".into(),
                name: "m".into(),
                message: "x".into(),
            }],
            exports: vec![Part::new(ExportEntry {
                namespace: "shop".into(),
                name: "e".into(),
                generation: Some(1),
                service: "svc-00001".into(),
                resolver: Some("shop/consul".into()),
                problem: None,
                resolver_unusable: false,
                source: None,
            })],
        }
    }

    fn by_serde(id: u64, hash: &str, content: &Content) -> Vec<u8> {
        serde_json::to_vec(&Document {
            api_version: API_VERSION.into(),
            kind: KIND.into(),
            id,
            hash: hash.into(),
            content: content.clone(),
        })
        .unwrap()
    }

    #[test]
    fn the_document_is_what_serde_writes_in_pieces_and_parses_back() {
        let small = Content {
            bootstrap: Bootstrap { complete: true, unsynced: vec![] },
            resolvers: vec![],
            mappings: Parts::default(),
            kubernetes_services: Parts::default(),
            watched: vec![],
            problems: vec![],
            exports: vec![],
        };
        // Large enough for many segments.
        for content in [small, rich(3), rich(4_000)] {
            for id in [7, u64::MAX] {
                let s = content.clone().into_snapshot(id);
                assert_eq!(s.to_json(), by_serde(id, &s.hash, &content));
                assert_eq!(s.len(), s.to_json().len());
                assert_eq!(s.hash, content.hash(), "the hash is the content's, whatever the id");
                let back = Snapshot::parse(&s.to_json()).unwrap();
                assert_eq!(back, s);
                assert_eq!(back.to_json(), s.to_json());
                // The header is a segment of its own, up to the content's first field.
                assert!(s.header.ends_with(b",") && s.to_json()[s.header.len()..].starts_with(br#""bootstrap":"#));
                let gz = s.gzipped();
                assert_eq!(gz.segments().len(), s.segments.len() + 1);
                assert_eq!(crate::assembler::gzip::tests::gunzip(&gz.to_bytes()), s.to_json());
            }
        }
        assert!(rich(4_000).into_snapshot(1).segments.len() > 3);
    }

    /// A change to one service leaves the Mappings' list as it was: the cutter takes its
    /// run whole, and the document is still what serde writes, with a fresh cutter's hash.
    #[test]
    fn long_lists_are_runs_taken_whole_while_unchanged() {
        let a = rich(4_000);
        let mut cutter = Cutter::default();
        let first = a.cut(&mut cutter);
        let mut b = a.clone();
        Part::make_mut(&mut Part::make_mut(&mut b.resolvers[0]).services.to_mut()[3]).index = Some(1_000);
        assert!(Parts::ptr_eq(&a.mappings, &b.mappings));
        let second = b.cut(&mut cutter);
        let fresh = b.cut(&mut Cutter::default());
        assert_eq!(second.hash, fresh.hash);
        let snapshot = Snapshot::new(9, b.clone(), second);
        assert_eq!(snapshot.to_json(), by_serde(9, &snapshot.hash, &b));
        let new: Vec<&Arc<Segment>> =
            snapshot.segments.iter().filter(|s| !first.segments.iter().any(|t| Arc::ptr_eq(s, t))).collect();
        assert_eq!(new.len(), 1, "one segment new: the changed service's");
        // The Mappings' run starts a segment: a segment begins with its field.
        assert!(snapshot.segments.iter().any(|s| s.pieces()[0].starts_with(b",\"mappings\":")));
        // A list of other parts, though equal, is written again and its segments found by
        // their bytes.
        let mut c = b.clone();
        c.mappings = c.mappings.iter().map(|m| Part::new((**m).clone())).collect();
        let third = c.cut(&mut cutter);
        assert_eq!(third.hash, fresh.hash);
        // Two resolvers with one list: written once, the document still serde's.
        let mut d = b.clone();
        let services = d.resolvers[0].services.clone();
        Part::make_mut(&mut d.resolvers[2]).services = services;
        let once = d.cut(&mut cutter);
        assert_eq!(once.hash, d.cut(&mut Cutter::default()).hash);
        let snapshot = Snapshot::new(3, d.clone(), once);
        assert_eq!(snapshot.to_json(), by_serde(3, &snapshot.hash, &d));
    }

    #[test]
    fn the_hash_tells_contents_apart() {
        let a = rich(50);
        let mut b = a.clone();
        Part::make_mut(&mut Part::make_mut(&mut b.resolvers[1]).services.to_mut()[3]).index = Some(1_000);
        assert_ne!(a.hash(), b.hash());
        assert_eq!(a.hash(), a.clone().hash());
        assert!(a.hash().starts_with("sha256:") && a.hash().len() == 7 + 64);
    }
}
