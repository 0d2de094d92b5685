//! The snapshot ConfigMap, written with server-side apply under our field manager.
//!
//! A ConfigMap holds at most 1 MiB, and snapshots of large clusters are bigger than that.
//! The encoding is chosen per snapshot, never truncating:
//!
//! - `data["snapshot.json"]` when the JSON fits the budget;
//! - else `binaryData["snapshot.json.gz"]` when the gzip of it fits;
//! - else the gzip stream split over parts `NAME-<hash>` (`binaryData["part"]`), and `NAME`
//!   holds `data["index.json"]`: the parts in order, their sha256, and the sha256 of the
//!   whole. The parts together are one gzip stream, as when it fits one ConfigMap.
//!
//! Split, a part is named by its content (the first 16 hex digits of its sha256), created
//! whole, immutable, and never written again: the stream is made of segments deflated
//! alone at places its content chooses (`consul_resolver_core::assembler::gzip`), so a
//! change to one service changes a part or two, and the other parts of the new index are
//! the previous one's, already in the cluster. A publication creates the parts the cluster
//! lacks, then writes the index naming them; a reader fetches only the parts it has not
//! read before (docs/snapshot.md).
//!
//! The switch to a new split snapshot is atomic: its parts exist before the index names
//! them, and the parts the previous index names are left alone. A reader gets the old
//! snapshot whole or the new one whole, and a writer stopped at any point (even SIGKILL)
//! leaves the old one readable. After the index, our parts that neither the new index nor
//! the previous one names are deleted (the previous one's are kept for readers still
//! reading it); our parts are found by their label, once per process or leadership term,
//! so those of a writer stopped before its index are deleted too. Only a read spanning two
//! publications can find a part gone; it reads again ([`decode`] says so).
//!
//! Writes happen only while this replica leads, each bounded by the leadership deadline
//! and none sent after it, and each is conditional on what this replica last saw of that
//! ConfigMap ([`Writer`]): a name it has not seen is created (which fails if it exists), a
//! known one is applied with the resourceVersion it last wrote or read, and a stale part is
//! deleted with the resourceVersion and uid it was just read with. A write delayed past a
//! change of leader (sent just before the deadline, applied by an API server that was
//! frozen) then fails with a conflict instead of overwriting the new leader's snapshot. What
//! was written is compared with the cluster every resync period, so a deleted or edited
//! snapshot ConfigMap is written again ([`ConfigMapPublisher::repair`]).
//!
//! Encoding and decoding are pure ([`encode`], [`decode`]); [`ConfigMapPublisher`] only
//! applies what [`encode`] returns.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use super::{PublishError, Publisher, gunzip_limited};
use crate::kube_client::{FIELD_MANAGER, status_code};
use crate::leadership::Leadership;
use consul_resolver_api::names::NamespacedName;
use consul_resolver_core::assembler::Snapshot;
use consul_resolver_core::assembler::gzip::GZIP_HEADER;
use consul_resolver_core::keys::KubeKey;

pub(crate) const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// On parts: the name of the ConfigMap whose index they belong to. Parts are found by it,
/// and only deleted when they carry it, so a user's unrelated `NAME-1` is never touched.
pub const LABEL_PART_OF: &str = "consulresolver.io/snapshot-part-of";
/// On every snapshot ConfigMap, index and parts: a `--watch` of ConfigMaps leaves them out
/// by this label ([`without_snapshots`]), so the operator never reads its own output back.
pub const LABEL_SNAPSHOT: &str = "consulresolver.io/snapshot";
pub const ANNOTATION_ID: &str = "consulresolver.io/snapshot-id";
pub const ANNOTATION_HASH: &str = "consulresolver.io/snapshot-hash";

pub const KEY_JSON: &str = "snapshot.json";
pub const KEY_GZIP: &str = "snapshot.json.gz";
pub(crate) const KEY_INDEX: &str = "index.json";
pub const KEY_PART: &str = "part";

/// Parts created at once ([`Writer::create_parts`]): a change's few new parts in one round
/// trip, while a first publication's dozens (each up to [`DATA_BUDGET`]) are not all held
/// in requests at the same time.
const PARTS_AT_ONCE: usize = 4;

/// Bytes of data per ConfigMap: well under the API server's 1 MiB, leaving room for
/// metadata (labels, annotations, managedFields).
pub const DATA_BUDGET: usize = 900 * 1024;

/// `data["index.json"]` of a split snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Index {
    /// What the concatenated parts are: always `gzip` (of the snapshot JSON).
    pub encoding: String,
    pub snapshot_id: u64,
    pub snapshot_hash: String,
    /// `sha256:` of the concatenated parts.
    pub sha256: String,
    /// Length of the concatenated parts.
    pub size: usize,
    pub parts: Vec<PartRef>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PartRef {
    /// ConfigMap name, in the index's namespace.
    pub name: String,
    /// `sha256:` of this part's `binaryData["part"]`.
    pub sha256: String,
    pub size: usize,
}

/// One part of a split snapshot: a piece of its gzip stream, named by its content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Part {
    pub name: String,
    pub bytes: Bytes,
}

/// The ConfigMaps of one snapshot, in the order they must be written.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Encoded {
    /// The parts the index names, each once (a part may be named twice: equal segments),
    /// in the order first named; empty unless split.
    pub parts: Vec<Part>,
    /// `NAME`: the snapshot itself, or the index of the parts.
    pub main: ConfigMap,
}

impl Encoded {
    /// Part `part` as the ConfigMap that holds it: created whole and immutable, labelled as
    /// a part of `main`, and annotated with the snapshot that first needed it.
    pub(crate) fn part_configmap(&self, part: &Part) -> ConfigMap {
        let main = &self.main.metadata;
        let annotations = main.annotations.iter().flatten().filter(|(k, _)| *k == ANNOTATION_ID);
        let mut labels = main.labels.clone().unwrap_or_default();
        labels.insert(LABEL_PART_OF.to_owned(), main.name.clone().unwrap_or_default());
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(part.name.clone()),
                namespace: main.namespace.clone(),
                labels: Some(labels),
                annotations: Some(annotations.map(|(k, v)| (k.clone(), v.clone())).collect()),
                ..ObjectMeta::default()
            },
            binary_data: Some(BTreeMap::from([(KEY_PART.to_owned(), ByteString(part.bytes.to_vec()))])),
            immutable: Some(true),
            ..ConfigMap::default()
        }
    }

    /// Every part as its ConfigMap.
    #[cfg(test)]
    pub(crate) fn part_configmaps(&self) -> Vec<ConfigMap> {
        self.parts.iter().map(|p| self.part_configmap(p)).collect()
    }
}

/// `sha256:` and the hex digest of `bytes`.
fn sha256(bytes: &[u8]) -> String {
    digest_text(Sha256::new_with_prefix(bytes))
}

/// `sha256:` and the hex digest of what `hasher` was given.
fn digest_text(hasher: Sha256) -> String {
    format!("sha256:{}", hex::encode(hasher.finalize()))
}

/// The name of a part of `name` whose bytes have the digest `sha256` (as [`sha256`] writes
/// it): the first 16 hex digits.
pub(crate) fn part_name(name: &str, sha256: &str) -> String {
    let hex = sha256.strip_prefix("sha256:").unwrap_or(sha256);
    format!("{name}-{}", &hex[..16])
}

/// `NAME`'s metadata (a part's is made from it: [`Encoded::part_configmap`]).
fn meta(target: &NamespacedName, id: u64, hash: &str) -> ObjectMeta {
    let labels = BTreeMap::from([
        (LABEL_MANAGED_BY.to_owned(), FIELD_MANAGER.to_owned()),
        (LABEL_SNAPSHOT.to_owned(), "true".to_owned()),
    ]);
    ObjectMeta {
        name: Some(target.name.clone()),
        namespace: Some(target.namespace.clone()),
        labels: Some(labels),
        annotations: Some(BTreeMap::from([
            (ANNOTATION_ID.to_owned(), id.to_string()),
            (ANNOTATION_HASH.to_owned(), hash.to_owned()),
        ])),
        ..ObjectMeta::default()
    }
}

/// Chooses the encoding of `snapshot` for `target`, with at most `budget` bytes of data
/// per ConfigMap, gzipped (once per snapshot, see [`Snapshot::gzipped`]) when it does not
/// fit as JSON.
pub(crate) fn encode(target: &NamespacedName, snapshot: &Snapshot, budget: usize) -> Result<Encoded, String> {
    let (id, hash) = (snapshot.id, snapshot.hash.as_str());
    let budget = budget.max(1);
    let main_meta = || meta(target, id, hash);
    if snapshot.len() <= budget {
        let json = snapshot.to_json();
        let text = std::str::from_utf8(&json).map_err(|e| format!("snapshot JSON is not UTF-8: {e}"))?;
        let main = ConfigMap {
            metadata: main_meta(),
            data: Some(BTreeMap::from([(KEY_JSON.to_owned(), text.to_owned())])),
            ..ConfigMap::default()
        };
        return Ok(Encoded { parts: Vec::new(), main });
    }
    let gz = snapshot.gzipped();
    if gz.len() <= budget {
        let main = ConfigMap {
            metadata: main_meta(),
            binary_data: Some(BTreeMap::from([(KEY_GZIP.to_owned(), ByteString(gz.to_bytes().to_vec()))])),
            ..ConfigMap::default()
        };
        return Ok(Encoded { parts: Vec::new(), main });
    }
    // The pieces whose boundaries the content chose: the gzip header with the first
    // segment (the document's own header), each other segment, and the trailer. Each is
    // cut to the budget where it exceeds it (only incompressible content does).
    let mut pieces = Vec::with_capacity(gz.segments().len() + 1);
    for (i, segment) in gz.segments().iter().enumerate() {
        pieces.push(if i == 0 {
            Bytes::from([&GZIP_HEADER[..], segment.body()].concat())
        } else {
            segment.body().clone()
        });
    }
    pieces.push(Bytes::copy_from_slice(&gz.trailer()));
    let mut whole = Sha256::new();
    let (mut refs, mut parts, mut named) = (Vec::new(), Vec::new(), BTreeSet::new());
    for piece in &pieces {
        let mut at = 0;
        while at < piece.len() {
            let bytes = piece.slice(at..piece.len().min(at + budget));
            at += bytes.len();
            whole.update(&bytes);
            let digest = sha256(&bytes);
            let name = part_name(&target.name, &digest);
            refs.push(PartRef { name: name.clone(), sha256: digest, size: bytes.len() });
            if named.insert(name.clone()) {
                parts.push(Part { name, bytes });
            }
        }
    }
    let index = Index {
        encoding: "gzip".into(),
        snapshot_id: id,
        snapshot_hash: hash.to_owned(),
        sha256: digest_text(whole),
        size: gz.len(),
        parts: refs,
    };
    let index = serde_json::to_string(&index).map_err(|e| format!("index: {e}"))?;
    let main = ConfigMap {
        metadata: main_meta(),
        data: Some(BTreeMap::from([(KEY_INDEX.to_owned(), index)])),
        ..ConfigMap::default()
    };
    Ok(Encoded { parts, main })
}

/// The index of a split snapshot, if `main` is one.
pub fn index_of(main: &ConfigMap) -> Result<Option<Index>, String> {
    match main.data.as_ref().and_then(|d| d.get(KEY_INDEX)) {
        None => Ok(None),
        Some(text) => {
            serde_json::from_str(text).map(Some).map_err(|e| format!("{KEY_INDEX} is not a valid index: {e}"))
        }
    }
}

/// The largest snapshot [`decode`] returns. What a ConfigMap holds is data from the
/// cluster, and a few MiB of gzip can inflate to gigabytes: a reader must not. Far above the
/// largest snapshot measured (56 MB at 50,000 Mappings, docs/benchmarks.md).
pub const MAX_DECODED_BYTES: usize = 1 << 30;

/// The snapshot JSON from the main ConfigMap and (when split) its parts, looked up by
/// name in `parts`. Every sha256 is checked: a mismatch means a write raced the read.
/// At most [`MAX_DECODED_BYTES`]: see [`decode_limited`].
pub fn decode(main: &ConfigMap, parts: &[ConfigMap]) -> Result<Vec<u8>, String> {
    decode_limited(main, parts, MAX_DECODED_BYTES)
}

/// [`decode`], refusing a snapshot over `limit` bytes. Memory stays within a small multiple
/// of the input plus `limit`, whatever the ConfigMaps hold: the index's sizes are not
/// trusted for allocation, the parts are inflated where they are (a part named many times
/// is not copied many times), the stream they make is at most `limit` bytes, and gzip is
/// inflated only up to the limit.
pub fn decode_limited(main: &ConfigMap, parts: &[ConfigMap], limit: usize) -> Result<Vec<u8>, String> {
    let too_large = || format!("the snapshot is larger than {limit} bytes");
    if let Some(text) = main.data.as_ref().and_then(|d| d.get(KEY_JSON)) {
        if text.len() > limit {
            return Err(too_large());
        }
        return Ok(text.clone().into_bytes());
    }
    if let Some(gz) = main.binary_data.as_ref().and_then(|d| d.get(KEY_GZIP)) {
        return gunzip_limited(&gz.0, limit);
    }
    let index = index_of(main)?.ok_or_else(|| {
        format!("ConfigMap has none of {KEY_JSON}, {KEY_GZIP} (binaryData) or {KEY_INDEX}: not a snapshot")
    })?;
    if index.encoding != "gzip" {
        return Err(format!("unknown index encoding {:?}", index.encoding));
    }
    let mut checked = BTreeSet::new();
    let mut stream: Vec<&[u8]> = Vec::with_capacity(index.parts.len());
    let mut size = 0usize;
    let mut whole = Sha256::new();
    for r in &index.parts {
        let part = parts
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(r.name.as_str()))
            .ok_or_else(|| format!("part {} is missing (deleted by a later publication?); read again", r.name))?;
        let bytes = part
            .binary_data
            .as_ref()
            .and_then(|d| d.get(KEY_PART))
            .ok_or_else(|| format!("part {} has no binaryData[{KEY_PART:?}]", r.name))?;
        size = size.saturating_add(bytes.0.len());
        if size > limit {
            return Err(too_large());
        }
        if checked.insert(r.name.as_str()) && sha256(&bytes.0) != r.sha256 {
            return Err(format!("part {} does not match the index (written meanwhile?); read again", r.name));
        }
        whole.update(&bytes.0);
        stream.push(&bytes.0);
    }
    if digest_text(whole) != index.sha256 {
        return Err("the parts together do not match the index's sha256".into());
    }
    gunzip_pieces(stream, limit)
}

/// Inflates the one gzip stream that `pieces` make in order, refusing an output over `limit`
/// bytes, and anything after the stream's end.
fn gunzip_pieces(pieces: Vec<&[u8]>, limit: usize) -> Result<Vec<u8>, String> {
    use std::io::{BufRead, Read};
    /// The pieces read one after the other, without copying them together.
    struct Pieces<'a> {
        pieces: std::collections::VecDeque<&'a [u8]>,
    }
    impl Read for Pieces<'_> {
        fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
            let n = {
                let buf = self.fill_buf()?;
                let n = buf.len().min(out.len());
                out[..n].copy_from_slice(&buf[..n]);
                n
            };
            self.consume(n);
            Ok(n)
        }
    }
    impl BufRead for Pieces<'_> {
        fn fill_buf(&mut self) -> std::io::Result<&[u8]> {
            while self.pieces.front().is_some_and(|p| p.is_empty()) {
                self.pieces.pop_front();
            }
            Ok(self.pieces.front().copied().unwrap_or_default())
        }
        fn consume(&mut self, n: usize) {
            if let Some(front) = self.pieces.front_mut() {
                *front = &front[n.min(front.len())..];
            }
        }
    }
    let mut decoder = flate2::bufread::GzDecoder::new(Pieces { pieces: pieces.into() });
    let mut out = Vec::new();
    let cap = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
    (&mut decoder).take(cap).read_to_end(&mut out).map_err(|e| format!("gunzip: {e}"))?;
    if out.len() > limit {
        return Err(format!("gunzip: the snapshot is larger than {limit} bytes"));
    }
    if !decoder.into_inner().fill_buf().map_err(|e| format!("gunzip: {e}"))?.is_empty() {
        return Err("the parts hold bytes after the end of the gzip stream".into());
    }
    Ok(out)
}

/// Writes each snapshot to the `--snapshot-configmap`.
pub(crate) struct ConfigMapPublisher {
    api: Api<ConfigMap>,
    target: NamespacedName,
    budget: usize,
    leadership: Leadership,
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    /// Bumped by [`Publisher::forget`]: a write that started before does not record itself.
    epoch: u64,
    /// The hash and ConfigMaps of the last snapshot written completely; `None` at start,
    /// after taking over and after a failed write (which may or may not have switched the
    /// index): the next write is then never skipped as equal to what the cluster holds.
    written: Option<(String, Arc<Encoded>)>,
    /// Our parts in the cluster, as far as this replica knows; `None` when not known (as
    /// for `written`): the next write lists them first.
    parts: Option<Parts>,
    /// Each of our ConfigMaps as we last wrote or read it; a name absent is one not seen
    /// (or seen absent), written by creating it.
    versions: BTreeMap<String, Seen>,
}

/// The part ConfigMaps in the cluster.
#[derive(Debug, Clone, Default)]
struct Parts {
    /// Every part of ours there is (labelled as ours, named as ours are).
    existing: BTreeSet<String>,
    /// Those this replica created, or read and found holding the bytes their name says:
    /// a listed name alone is a claim, and the index never names a part on a claim.
    verified: BTreeSet<String>,
    /// The parts the index in the cluster names: readers may be reading them.
    named: BTreeSet<String>,
}

/// What this replica last saw of one ConfigMap: every write of it is conditional on this.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    resource_version: String,
    uid: Option<String>,
}

impl Seen {
    /// `None` for an object without a resourceVersion (nothing to be conditional on).
    fn of(meta: &ObjectMeta) -> Option<Seen> {
        Some(Seen { resource_version: meta.resource_version.clone()?, uid: meta.uid.clone() })
    }
}

impl ConfigMapPublisher {
    pub(crate) fn new(client: kube::Client, target: NamespacedName, leadership: Leadership) -> Self {
        Self::with_budget(client, target, leadership, DATA_BUDGET)
    }

    pub(crate) fn with_budget(
        client: kube::Client,
        target: NamespacedName,
        leadership: Leadership,
        budget: usize,
    ) -> Self {
        let api = Api::namespaced(client, &target.namespace);
        ConfigMapPublisher { api, target, budget, leadership, state: Arc::default() }
    }

    /// The highest snapshot id in the ConfigMaps now, whoever wrote them (`None` if there
    /// is none yet): `NAME`'s, and every part's. A leader stopped between its parts and its
    /// index has written parts of a snapshot no index names yet: a successor numbering
    /// after the index alone would give its own, other snapshot that same id.
    pub(crate) async fn published_id(&self) -> Result<Option<u64>, PublishError> {
        let name = &self.target.name;
        let main = self.api.get_opt(name).await.map_err(PublishError::kube(format!("get ConfigMap {name}")))?;
        let parts = list_parts(&self.api, &self.target).await?;
        let ids = parts.iter().filter_map(|p| snapshot_id(&p.metadata));
        Ok(main.as_ref().and_then(|m| snapshot_id(&m.metadata)).into_iter().chain(ids).max())
    }

    /// How many part ConfigMaps the last snapshot written took (0: it fit in one), if
    /// this replica has written one since it last took over.
    pub(crate) fn parts_written(&self) -> Option<usize> {
        self.state.lock().expect("configmap state lock").written.as_ref().map(|(_, e)| e.parts.len())
    }

    /// Compares what was last written with the cluster and writes again whatever was
    /// deleted or edited since. Returns the names written again.
    pub(crate) async fn repair(&self) -> Result<Vec<String>, PublishError> {
        let Some(until) = self.leadership.until() else { return Ok(Vec::new()) };
        let (epoch, written, mut versions) = {
            let st = self.state.lock().expect("configmap state lock");
            (st.epoch, st.written.clone(), st.versions.clone())
        };
        let Some((_, encoded)) = written else { return Ok(Vec::new()) };
        let repaired = tokio::time::timeout_at(until, async {
            let mut writer = Writer { api: &self.api, leadership: &self.leadership, until, seen: &mut versions };
            let mut damaged = Vec::new();
            // Parts first: the index must never name a part that is not there.
            for part in &encoded.parts {
                let expected = encoded.part_configmap(part);
                match writer.read(&part.name).await? {
                    Some(live) if same_part(&live, &expected) => continue,
                    // Immutable: replaced, not edited.
                    Some(_) => {
                        writer.delete(&part.name).await?;
                    }
                    None => {}
                }
                writer.create_part(&expected).await?;
                damaged.push(part.name.clone());
            }
            let live = writer.read(&self.target.name).await?;
            if !live.is_some_and(|live| same_content(&live, &encoded.main)) {
                writer.write(&encoded.main).await?;
                damaged.push(self.target.name.clone());
            }
            Ok::<_, PublishError>(damaged)
        })
        .await
        .map_err(|_| PublishError::LeadershipLapsed("the snapshot ConfigMap"))
        .and_then(|r| r);
        // Kept whatever happened: what a failed write left is what the next one is
        // conditional on.
        let mut st = self.state.lock().expect("configmap state lock");
        if st.epoch == epoch {
            st.versions = versions;
        }
        repaired
    }
}

/// Our parts of `target`'s snapshots in the cluster, by their label: names, versions and
/// annotations only (not their bytes).
async fn list_parts(
    api: &Api<ConfigMap>,
    target: &NamespacedName,
) -> Result<Vec<kube::core::PartialObjectMeta<ConfigMap>>, PublishError> {
    let params = ListParams::default().labels(&format!("{LABEL_PART_OF}={}", target.name));
    let list = api
        .list_metadata(&params)
        .await
        .map_err(PublishError::kube(format!("list the parts of ConfigMap {}", target.name)))?;
    // A label is only a claim: a part must also be named as ours are.
    let prefix = format!("{}-", target.name);
    Ok(list.items.into_iter().filter(|p| p.metadata.name.as_deref().is_some_and(|n| n.starts_with(&prefix))).collect())
}

/// A `--watch` key with the operator's snapshot ConfigMaps left out, when it watches
/// ConfigMaps: `!consulresolver.io/snapshot` is added to its label selector, so the API
/// server never sends them. Otherwise each publication would come back through the watch
/// into the next snapshot, which would grow without end. Other keys are returned as they are.
pub(crate) fn without_snapshots(key: KubeKey) -> KubeKey {
    if !key.is("", "ConfigMap") {
        return key;
    }
    let exclude = format!("!{LABEL_SNAPSHOT}");
    let selector = match &key.label_selector {
        Some(s) if s.split(',').any(|term| term.trim() == exclude) => return key,
        Some(s) if !s.trim().is_empty() => format!("{s},{exclude}"),
        _ => exclude,
    };
    key.with_labels(selector)
}

/// Whether part `live` holds what we wrote as `expected`: its bytes, under our labels. (Its
/// annotation names the snapshot that first needed it, not the latest.)
fn same_part(live: &ConfigMap, expected: &ConfigMap) -> bool {
    let labels = expected.metadata.labels.iter().flatten();
    live.binary_data == expected.binary_data
        && labels.into_iter().all(|(k, v)| live.metadata.labels.as_ref().and_then(|l| l.get(k)) == Some(v))
}

/// Whether `live` holds what we wrote as `expected` (data, labels and annotations ours).
fn same_content(live: &ConfigMap, expected: &ConfigMap) -> bool {
    let ours = |m: &Option<BTreeMap<String, String>>, keys: &Option<BTreeMap<String, String>>| {
        keys.iter().flatten().all(|(k, v)| m.as_ref().and_then(|m| m.get(k)) == Some(v))
    };
    live.data == expected.data
        && live.binary_data == expected.binary_data
        && ours(&live.metadata.labels, &expected.metadata.labels)
        && ours(&live.metadata.annotations, &expected.metadata.annotations)
}

/// The snapshot id a ConfigMap of ours carries.
fn snapshot_id(meta: &ObjectMeta) -> Option<u64> {
    meta.annotations.as_ref()?.get(ANNOTATION_ID)?.parse().ok()
}

/// Whether the API server refused a request with 409: the object exists (a create), or is
/// no longer the version the request was conditional on.
fn is_conflict(e: &PublishError) -> bool {
    matches!(e, PublishError::Kube { source, .. } if status_code(source) == Some(409))
}

/// The requests of one publication or repair. Every write is conditional on what this
/// replica last saw of that ConfigMap (`seen`, updated by every answer), and none is sent
/// once the deadline has passed or leadership is gone.
struct Writer<'a> {
    api: &'a Api<ConfigMap>,
    leadership: &'a Leadership,
    /// The leadership deadline the publication started with; the whole is bounded by it.
    until: Instant,
    seen: &'a mut BTreeMap<String, Seen>,
}

impl Writer<'_> {
    /// Whether a write may still be sent. The whole publication is bounded by
    /// `timeout_at(until)`, but a task resumed after a pause (a stopped process, a starved
    /// CPU) is polled with the answer to its last request before that timer fires: without
    /// this check it would send its next write after its deadline, when another replica may
    /// lead.
    fn may_write(&self) -> Result<(), PublishError> {
        if Instant::now() < self.until && self.leadership.is_leading() {
            Ok(())
        } else {
            Err(PublishError::LeadershipLapsed("the snapshot ConfigMap"))
        }
    }

    /// Remembers the API server's answer about `name` (`None`: it does not exist).
    fn saw(&mut self, name: &str, cm: Option<&ConfigMap>) {
        match cm.and_then(|cm| Seen::of(&cm.metadata)) {
            Some(seen) => self.seen.insert(name.to_owned(), seen),
            None => self.seen.remove(name),
        };
    }

    /// Reads `name`, and remembers it.
    async fn read(&mut self, name: &str) -> Result<Option<ConfigMap>, PublishError> {
        let cm = self.api.get_opt(name).await.map_err(PublishError::kube(format!("get ConfigMap {name}")))?;
        self.saw(name, cm.as_ref());
        Ok(cm)
    }

    /// Writes `cm`: created when its name was not seen, applied conditional on the version
    /// seen otherwise. A 409 (someone else created it, or wrote it since) is read and
    /// written over once: we lead, and the leadership deadline bounds the whole. Any other
    /// error leaves what was seen as it was: a write that timed out may have landed, and the
    /// next one, conditional on the version before it, then conflicts and reads first
    /// instead of writing blind.
    async fn write(&mut self, cm: &ConfigMap) -> Result<(), PublishError> {
        let name = cm.metadata.name.clone().unwrap_or_default();
        let mut conflicts = 0;
        loop {
            let step = match self.seen.get(&name).cloned() {
                None => self.create_empty(cm).await.map(|()| false),
                Some(seen) => self.apply(cm, &seen).await.map(|()| true),
            };
            match step {
                Ok(true) => return Ok(()),
                // Created: applied next, conditional on the creation.
                Ok(false) => {}
                Err(e) if is_conflict(&e) && conflicts == 0 => {
                    conflicts += 1;
                    tracing::info!(configmap = %name, "the snapshot ConfigMap was written by someone else; reading it and writing ours");
                    self.read(&name).await?;
                }
                Err(e) if is_conflict(&e) => return Err(PublishError::Conflict(name)),
                Err(e) => return Err(e),
            }
        }
    }

    /// Creates `parts` of `encoded`, [`PARTS_AT_ONCE`] at a time: they are distinct objects,
    /// each written in a round trip of its own, and one after the other they were most of a
    /// publication's time at the scale profile (docs/benchmarks.md). Each creation sees and
    /// records only its own name. Each part is tried (none is sent once leadership is gone:
    /// [`Writer::may_write`]), and the first error is returned at the end, with what each
    /// creation saw recorded. Dropped at the publication's deadline, the names they held are
    /// forgotten; a failed publication lists and reads the parts again anyway.
    async fn create_parts(&mut self, encoded: &Encoded, parts: &[&Part]) -> Result<(), PublishError> {
        use futures::StreamExt as _;
        let mut own: Vec<BTreeMap<String, Seen>> =
            parts.iter().map(|p| self.seen.remove_entry(&p.name).into_iter().collect()).collect();
        let (api, leadership, until) = (self.api, self.leadership, self.until);
        // Futures made in a loop, not by a closure: a closure over these borrows makes the
        // publication's boxed future not `Send` ("FnOnce is not general enough").
        let mut creations = Vec::with_capacity(parts.len());
        for (part, seen) in parts.iter().zip(own.iter_mut()) {
            creations.push(async move {
                Writer { api, leadership, until, seen }.create_part(&encoded.part_configmap(part)).await
            });
        }
        let results: Vec<Result<(), PublishError>> =
            futures::stream::iter(creations).buffer_unordered(PARTS_AT_ONCE).collect().await;
        for seen in own {
            self.seen.extend(seen);
        }
        results.into_iter().collect()
    }

    /// Creates part `cm` whole (parts are immutable). One that exists already is used as it is
    /// when it holds these bytes under our labels (a part's name is its content's hash: an
    /// earlier publication or leader wrote it). Anything else of that name is read first,
    /// then replaced (deleted as read, created again) once: we lead, and the name is ours.
    async fn create_part(&mut self, cm: &ConfigMap) -> Result<(), PublishError> {
        let name = cm.metadata.name.clone().unwrap_or_default();
        let params = PostParams { field_manager: Some(FIELD_MANAGER.to_owned()), ..PostParams::default() };
        for attempt in 0..2 {
            self.may_write()?;
            match self.api.create(&params, cm).await {
                Ok(created) => {
                    self.saw(&name, Some(&created));
                    return Ok(());
                }
                Err(e) if status_code(&e) == Some(409) && attempt == 0 => match self.read(&name).await? {
                    Some(live) if same_part(&live, cm) => return Ok(()),
                    Some(_) => {
                        tracing::info!(configmap = %name, "a snapshot part's name holds something else; replacing it");
                        self.delete(&name).await?;
                    }
                    None => {}
                },
                Err(e) if status_code(&e) == Some(409) => return Err(PublishError::Conflict(name)),
                Err(e) => return Err(PublishError::Kube { what: format!("create ConfigMap {name}"), source: e }),
            }
        }
        Err(PublishError::Conflict(name))
    }

    /// Creates `cm`'s name with our labels and nothing else; a 409 if it exists. Empty, not
    /// whole: what a create sets belongs to an `Update` entry of our field manager, and our
    /// later applies would not remove it when they leave it out (a `snapshot.json` would
    /// stay beside a later `snapshot.json.gz`, and be read instead of it).
    async fn create_empty(&mut self, cm: &ConfigMap) -> Result<(), PublishError> {
        self.may_write()?;
        let name = cm.metadata.name.clone().unwrap_or_default();
        let empty = ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: cm.metadata.namespace.clone(),
                labels: cm.metadata.labels.clone(),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        };
        let params = PostParams { field_manager: Some(FIELD_MANAGER.to_owned()), ..PostParams::default() };
        let created =
            self.api.create(&params, &empty).await.map_err(PublishError::kube(format!("create ConfigMap {name}")))?;
        self.saw(&name, Some(&created));
        Ok(())
    }

    /// Server-side apply of `cm` (only ever `NAME`; parts are created, never applied),
    /// conditional on `seen`: a 409 if the object is no longer that version. (One deleted
    /// since is created again: the API server's apply creates a missing object whatever
    /// resourceVersion it names.)
    async fn apply(&mut self, cm: &ConfigMap, seen: &Seen) -> Result<(), PublishError> {
        self.may_write()?;
        let name = cm.metadata.name.clone().unwrap_or_default();
        let mut cm = cm.clone();
        cm.metadata.resource_version = Some(seen.resource_version.clone());
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let written = self
            .api
            .patch(&name, &params, &Patch::Apply(&cm))
            .await
            .map_err(PublishError::kube(format!("apply ConfigMap {name}")))?;
        self.saw(&name, Some(&written));
        Ok(())
    }

    /// Deletes `name` only while it is still the object last seen, at that version: a 409
    /// otherwise (someone wrote it since; it is theirs now). Returns whether it was deleted
    /// by us; a name not seen is not deleted.
    async fn delete(&mut self, name: &str) -> Result<bool, PublishError> {
        let Some(seen) = self.seen.get(name).cloned() else { return Ok(false) };
        self.may_write()?;
        let preconditions = Preconditions { resource_version: Some(seen.resource_version), uid: seen.uid };
        let params = DeleteParams { preconditions: Some(preconditions), ..DeleteParams::default() };
        match self.api.delete(name, &params).await {
            Ok(_) => {
                self.seen.remove(name);
                Ok(true)
            }
            Err(e) if status_code(&e) == Some(404) => {
                self.seen.remove(name);
                Ok(false)
            }
            Err(e) => Err(PublishError::Kube { what: format!("delete part ConfigMap {name}"), source: e }),
        }
    }
}

/// Our parts in the cluster, and those the index there names now. Read once per process or
/// leadership term (and after a failed write); known from our own writes after that.
async fn live_parts(writer: &mut Writer<'_>, target: &NamespacedName) -> Result<Parts, PublishError> {
    let main = writer.read(&target.name).await?;
    let index = main.as_ref().and_then(|m| index_of(m).ok().flatten());
    let named = index.iter().flat_map(|i| &i.parts).map(|p| p.name.clone()).collect();
    let mut existing = BTreeSet::new();
    for part in list_parts(writer.api, target).await? {
        let Some(name) = part.metadata.name.clone() else { continue };
        if let Some(seen) = Seen::of(&part.metadata) {
            writer.seen.insert(name.clone(), seen);
        }
        existing.insert(name);
    }
    Ok(Parts { existing, verified: BTreeSet::new(), named })
}

/// The ConfigMap publisher's name in metrics, logs and Events.
pub(crate) const NAME: &str = "configmap";

impl Publisher for ConfigMapPublisher {
    fn name(&self) -> &'static str {
        NAME
    }

    fn forget(&self) {
        let mut st = self.state.lock().expect("configmap state lock");
        st.epoch += 1;
        st.written = None;
        st.parts = None;
        st.versions.clear();
    }

    fn publish(&self, snapshot: Arc<Snapshot>) -> BoxFuture<'static, Result<(), PublishError>> {
        let (epoch, mut versions, known) = {
            let st = self.state.lock().expect("configmap state lock");
            if st.written.as_ref().is_some_and(|(hash, _)| *hash == snapshot.hash) {
                return futures::future::ready(Ok(())).boxed();
            }
            (st.epoch, st.versions.clone(), st.parts.clone())
        };
        let (api, target, budget, leadership, state) =
            (self.api.clone(), self.target.clone(), self.budget, self.leadership.clone(), self.state.clone());
        async move {
            let until = leadership.until().ok_or(PublishError::NotLeading("the snapshot ConfigMap"))?;
            let written = tokio::time::timeout_at(until, async {
                let mut writer = Writer { api: &api, leadership: &leadership, until, seen: &mut versions };
                let known = match known {
                    Some(known) => known,
                    None => live_parts(&mut writer, &target).await?,
                };
                let encoded = Arc::new(encode(&target, &snapshot, budget).map_err(PublishError::Encode)?);
                // The parts not known to be there as they should be, then the index naming
                // them.
                let Parts { mut existing, mut verified, named: previous } = known;
                let missing: Vec<&Part> = encoded.parts.iter().filter(|p| !verified.contains(&p.name)).collect();
                writer.create_parts(&encoded, &missing).await?;
                for part in &missing {
                    existing.insert(part.name.clone());
                    verified.insert(part.name.clone());
                }
                let created = missing.len();
                writer.write(&encoded.main).await?;
                // Switched. Our parts named by neither this index nor the one before it are
                // read by nobody now.
                let named: BTreeSet<String> = encoded.parts.iter().map(|p| p.name.clone()).collect();
                let stale: Vec<String> =
                    existing.iter().filter(|n| !named.contains(*n) && !previous.contains(*n)).cloned().collect();
                for name in &stale {
                    writer.delete(name).await?;
                    existing.remove(name);
                    verified.remove(name);
                }
                Ok::<_, PublishError>((encoded, Parts { existing, verified, named }, created, stale.len()))
            })
            .await
            .map_err(|_| PublishError::LeadershipLapsed("the snapshot ConfigMap"))
            .and_then(|r| r);
            let mut st = state.lock().expect("configmap state lock");
            if st.epoch == epoch {
                st.versions = versions;
                if written.is_err() {
                    // The index may or may not have switched: known again after a write.
                    st.written = None;
                    st.parts = None;
                }
            }
            let (encoded, parts, created, deleted) = written?;
            tracing::debug!(
                configmap = %target,
                id = snapshot.id,
                bytes = snapshot.len(),
                parts = encoded.parts.len(),
                parts_created = created,
                stale_parts_deleted = deleted,
                "snapshot ConfigMap written"
            );
            if st.epoch == epoch {
                st.written = Some((snapshot.hash.clone(), encoded));
                st.parts = Some(parts);
            }
            Ok(())
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_of_configmaps_leaves_the_snapshot_out() {
        let cm = KubeKey::new("", "", "ConfigMap").in_namespace("ops");
        assert_eq!(without_snapshots(cm.clone()).label_selector.as_deref(), Some("!consulresolver.io/snapshot"));
        let selected = without_snapshots(cm.clone().with_labels("app=web"));
        assert_eq!(selected.label_selector.as_deref(), Some("app=web,!consulresolver.io/snapshot"));
        assert_eq!(without_snapshots(selected.clone()), selected, "once");
        let svc = KubeKey::new("", "", "Service");
        assert_eq!(without_snapshots(svc.clone()), svc, "other kinds unchanged");
        let e = encoded(&snapshot(8_000, 200), DATA_BUDGET);
        assert!(!e.parts.is_empty());
        for cm in e.part_configmaps().iter().chain([&e.main]) {
            assert_eq!(cm.metadata.labels.as_ref().unwrap()[LABEL_SNAPSHOT], "true", "parts carry it too");
        }
    }
    use consul_resolver_core::assembler::snapshot::{Bootstrap, Content, Part, ResolverEntry, ServiceEntry};
    use consul_resolver_core::model::{Endpoint, Health};

    pub(super) fn target() -> NamespacedName {
        NamespacedName { namespace: "ops".into(), name: "snap".into() }
    }

    /// xorshift64*: deterministic, dependency-free, and incompressible enough for gzip.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn token(&mut self, len: usize) -> String {
            const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
            (0..len).map(|_| ALPHABET[(self.next() % 64) as usize] as char).collect()
        }
    }

    /// A snapshot with `n` endpoints, each with `meta_len` random bytes of meta.
    pub(super) fn snapshot(n: usize, meta_len: usize) -> Snapshot {
        snapshot_with(n, meta_len, &[])
    }

    /// [`snapshot`], with the endpoints `moved` on another port.
    pub(super) fn snapshot_with(n: usize, meta_len: usize, moved: &[usize]) -> Snapshot {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let endpoints = (0..n)
            .map(|i| Endpoint {
                address: format!("10.{}.{}.{}", i / 65536 % 256, i / 256 % 256, i % 256),
                port: if moved.contains(&i) { 9090 } else { 8080 },
                node: format!("node-{}", i % 97),
                service_id: format!("web-{i}"),
                tags: vec!["v1".into()],
                meta: BTreeMap::from([("build".to_owned(), rng.token(meta_len))]),
                health: Health::Passing,
                zone: None,
            })
            .collect();
        Content {
            bootstrap: Bootstrap { complete: true, unsynced: vec![] },
            resolvers: vec![Part::new(ResolverEntry {
                namespace: "shop".into(),
                name: "consul".into(),
                generation: Some(1),
                address: "http://127.0.0.1:8500".into(),
                datacenter: None,
                unusable: None,
                services: vec![Part::new(ServiceEntry {
                    name: "web".into(),
                    synced: true,
                    index: Some(4),
                    error: None,
                    stale: None,
                    endpoints,
                })],
            })],
            mappings: vec![],
            kubernetes_services: vec![],
            watched: vec![],
            problems: vec![],
            exports: vec![],
        }
        .into_snapshot(42)
    }

    fn check_metadata(cm: &ConfigMap, s: &Snapshot) {
        let labels = cm.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[LABEL_MANAGED_BY], FIELD_MANAGER);
        let ann = cm.metadata.annotations.as_ref().unwrap();
        assert_eq!(ann[ANNOTATION_ID], s.id.to_string());
        assert_eq!(cm.metadata.namespace.as_deref(), Some("ops"));
    }

    fn encoded(s: &Snapshot, budget: usize) -> Encoded {
        encode(&target(), s, budget).unwrap()
    }

    fn roundtrip(s: &Snapshot) -> Encoded {
        let json = s.to_json();
        let e = encoded(s, DATA_BUDGET);
        let parts = e.part_configmaps();
        assert_eq!(decode(&e.main, &parts).unwrap(), json, "decode(encode(x)) == x");
        assert_eq!(Snapshot::parse(&decode(&e.main, &parts).unwrap()).unwrap(), *s);
        assert_eq!(e.main.metadata.name.as_deref(), Some("snap"));
        assert_eq!(e.main.metadata.annotations.as_ref().unwrap()[ANNOTATION_HASH], s.hash);
        for cm in parts.iter().chain([&e.main]) {
            check_metadata(cm, s);
            let size: usize = cm.data.iter().flatten().map(|(_, v)| v.len()).sum::<usize>()
                + cm.binary_data.iter().flatten().map(|(_, v)| v.0.len()).sum::<usize>();
            assert!(size <= DATA_BUDGET, "{size} bytes in one ConfigMap");
        }
        e
    }

    #[test]
    fn a_small_snapshot_is_plain_json() {
        let s = snapshot(3, 16);
        let e = roundtrip(&s);
        assert!(e.parts.is_empty());
        assert_eq!(e.main.data.as_ref().unwrap()[KEY_JSON].as_bytes(), s.to_json());
        assert!(e.main.binary_data.is_none());
    }

    #[test]
    fn a_compressible_large_snapshot_is_gzipped_in_one_configmap() {
        let s = snapshot(20_000, 0);
        assert!(s.to_json().len() > 2 * 1024 * 1024, "{}", s.to_json().len());
        let e = roundtrip(&s);
        assert!(e.parts.is_empty());
        assert!(e.main.data.is_none());
        let gz = &e.main.binary_data.as_ref().unwrap()[KEY_GZIP].0;
        // One gzip stream for any reader, though made of segments.
        let mut json = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut json).unwrap();
        assert!(json == s.to_json());
    }

    #[test]
    fn an_incompressible_snapshot_over_a_mebibyte_is_split_into_parts_named_by_their_content() {
        let s = snapshot(8_000, 200);
        assert!(s.gzipped().len() > 1024 * 1024, "over 1 MiB even compressed");
        let e = roundtrip(&s);
        assert!(e.parts.len() >= 2, "{} parts", e.parts.len());
        let index = index_of(&e.main).unwrap().unwrap();
        assert_eq!(index.snapshot_id, 42);
        assert_eq!(index.snapshot_hash, s.hash);
        let names: Vec<_> = index.parts.iter().map(|p| p.name.clone()).collect();
        assert_eq!(names, e.parts.iter().map(|p| p.name.clone()).collect::<Vec<_>>());
        for (part, cm) in e.parts.iter().zip(e.part_configmaps()) {
            assert_eq!(part.name, part_name("snap", &sha256(&part.bytes)));
            assert!(part.name.starts_with("snap-") && part.name.len() == "snap-".len() + 16, "{}", part.name);
            assert_eq!(cm.metadata.labels.as_ref().unwrap()[LABEL_PART_OF], "snap");
            assert_eq!(cm.immutable, Some(true), "a part is never written again");
        }
        // The parts together are the one gzip stream, byte for byte.
        let whole: Vec<u8> = e.parts.iter().flat_map(|p| p.bytes.to_vec()).collect();
        assert!(whole == s.gzipped().to_bytes());
        assert_eq!(index.size, whole.len());
        assert_eq!(index.sha256, sha256(&whole));
        // Deterministic: the same snapshot, the same parts, whoever encodes it.
        assert_eq!(encoded(&s, DATA_BUDGET).parts, e.parts);
        // As docs/snapshot-index.schema.json describes it.
        let schema: serde_json::Value =
            serde_json::from_str(include_str!("../../docs/snapshot-index.schema.json")).unwrap();
        let validator = jsonschema::validator_for(&schema).unwrap();
        let index: serde_json::Value = serde_json::from_str(&e.main.data.as_ref().unwrap()[KEY_INDEX]).unwrap();
        let errors: Vec<String> =
            validator.iter_errors(&index).map(|e| format!("{e} at {}", e.instance_path())).collect();
        assert!(errors.is_empty(), "{errors:?}");
        let mut wrong = index.clone();
        wrong["parts"][0]["name"] = serde_json::json!("snap-a-1");
        assert!(!validator.is_valid(&wrong), "the schema tells a slot name from a content name");
    }

    /// The point of naming parts by content: after a change to one endpoint, the new index
    /// names the previous one's parts but for the header, the trailer and the segment
    /// that changed.
    #[test]
    fn a_change_to_one_endpoint_changes_a_few_parts_and_the_rest_are_the_previous_ones() {
        let before = snapshot(30_000, 32);
        let after = snapshot_with(30_000, 32, &[15_000]).content.into_snapshot(43);
        let first = encode(&target(), &before, DATA_BUDGET).unwrap();
        let second = encode(&target(), &after, DATA_BUDGET).unwrap();
        assert!(first.parts.len() >= 5, "{} parts", first.parts.len());
        let new: Vec<&super::Part> = second.parts.iter().filter(|p| !first.parts.contains(p)).collect();
        let new_bytes: usize = new.iter().map(|p| p.bytes.len()).sum();
        let all_bytes: usize = second.parts.iter().map(|p| p.bytes.len()).sum();
        eprintln!("{} of {} parts new: {new_bytes} of {all_bytes} bytes", new.len(), second.parts.len());
        assert_eq!(new.len(), 3, "the header, the trailer and the changed segment");
        assert!(new_bytes * 2 < all_bytes, "{new_bytes} of {all_bytes} bytes new");
        assert_eq!(decode(&second.main, &second.part_configmaps()).unwrap(), after.to_json());
    }

    #[test]
    fn a_part_from_another_write_or_a_missing_part_is_an_error_not_garbage() {
        let s = snapshot(8_000, 200);
        let e = encoded(&s, DATA_BUDGET);
        let parts = e.part_configmaps();
        let err = decode(&e.main, &parts[..1]).unwrap_err();
        assert!(err.contains(&format!("{} is missing", e.parts[1].name)), "{err}");

        // A part of that name holding other bytes (the next snapshot's: not its first
        // segment, which both have).
        let other = encoded(&snapshot(8_001, 200), DATA_BUDGET).part_configmaps();
        let mut mixed = parts.clone();
        let differs = other.iter().find(|o| o.binary_data != parts[1].binary_data).unwrap();
        mixed[1].binary_data = differs.binary_data.clone();
        let err = decode(&e.main, &mixed).unwrap_err();
        assert!(err.contains(&format!("{} does not match the index", e.parts[1].name)), "{err}");
    }

    #[test]
    fn not_a_snapshot_is_an_error() {
        assert!(decode(&ConfigMap::default(), &[]).unwrap_err().contains("not a snapshot"));
        let bad = ConfigMap { data: Some(BTreeMap::from([(KEY_INDEX.into(), "{".into())])), ..ConfigMap::default() };
        assert!(decode(&bad, &[]).unwrap_err().contains("not a valid index"));
    }

    /// A 409 `Status`, with the API server's reason.
    fn conflict(reason: &str) -> (u16, serde_json::Value) {
        let status = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": reason, "code": 409, "message": "the object has been modified"});
        (409, status)
    }

    /// ConfigMaps held by a loopback API server that answers as a real one does: each write
    /// gets a new resourceVersion (and a created object a uid); a create of an existing name,
    /// an apply naming another resourceVersion than the stored one, and a delete whose
    /// preconditions do not match are 409s; an apply of a missing object creates it, whatever
    /// resourceVersion it names.
    #[derive(Default)]
    struct Stored {
        objects: BTreeMap<String, serde_json::Value>,
        version: u64,
        /// DELETEs answer 500.
        fail_deletes: bool,
        /// Writes sent with no condition: applies without a resourceVersion, deletes
        /// without preconditions. A writer that sends one may overwrite what it never saw.
        blind: Vec<String>,
        /// An apply of this name is carried out, and answered 500: as a timeout leaves it,
        /// written without the writer knowing.
        lost_answer: Option<String>,
        /// Right after a GET of this name, another writer changes it (once).
        written_after_read: Option<String>,
        /// When this name is applied, leadership is taken away (the sender is told `None`).
        lose_leadership_at: Option<(String, tokio::sync::watch::Sender<Option<Instant>>)>,
    }

    impl Stored {
        /// Stores `cm` as written now, with a new resourceVersion (and a uid when new).
        fn put(&mut self, name: &str, mut cm: serde_json::Value) -> serde_json::Value {
            self.version += 1;
            let uid = self.objects.get(name).map(|o| o["metadata"]["uid"].clone());
            cm["metadata"]["name"] = serde_json::json!(name);
            cm["metadata"]["resourceVersion"] = serde_json::json!(self.version.to_string());
            cm["metadata"]["uid"] = uid.unwrap_or_else(|| serde_json::json!(format!("uid-{}", self.version)));
            self.objects.insert(name.to_owned(), cm.clone());
            cm
        }

        /// Another writer's ConfigMap `name`, labelled as a part of ours when `ours`.
        fn someone_elses(&mut self, name: &str, ours: bool, id: u64) {
            let labels = if ours { serde_json::json!({LABEL_PART_OF: "snap"}) } else { serde_json::json!({}) };
            let cm = serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"namespace": "ops", "labels": labels, "annotations": {ANNOTATION_ID: id.to_string()}},
                "binaryData": {KEY_PART: "b3RoZXI="}});
            self.put(name, cm);
        }

        fn version_of(&self, name: &str) -> Option<serde_json::Value> {
            self.objects.get(name).map(|o| o["metadata"]["resourceVersion"].clone())
        }

        fn create(&mut self, body: &[u8]) -> (u16, serde_json::Value) {
            let cm: serde_json::Value = serde_json::from_slice(body).unwrap();
            let name = cm["metadata"]["name"].as_str().unwrap().to_owned();
            if self.objects.contains_key(&name) {
                return conflict("AlreadyExists");
            }
            self.wrote(&name);
            (201, self.put(&name, cm))
        }

        /// A list of the ConfigMaps labelled as parts of `snap`, as metadata only (what
        /// `list_metadata` asks for).
        fn list(&self) -> (u16, serde_json::Value) {
            let items: Vec<serde_json::Value> = self
                .objects
                .values()
                .filter(|o| o["metadata"]["labels"][LABEL_PART_OF] == "snap")
                .map(|o| {
                    serde_json::json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                    "metadata": o["metadata"]})
                })
                .collect();
            let list = serde_json::json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList",
                "metadata": {"resourceVersion": self.version.to_string()}, "items": items});
            (200, list)
        }

        fn apply(&mut self, name: &str, body: &[u8]) -> (u16, serde_json::Value) {
            let cm: serde_json::Value = serde_json::from_slice(body).unwrap();
            match cm["metadata"].get("resourceVersion") {
                None => self.blind.push(format!("PATCH {name}")),
                Some(sent) if self.objects.contains_key(name) && self.version_of(name).as_ref() != Some(sent) => {
                    return conflict("Conflict");
                }
                Some(_) => {}
            }
            if self.objects.get(name).is_some_and(|o| o["immutable"] == true) {
                return (
                    422,
                    serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "reason": "Invalid", "code": 422, "message": "field is immutable when `immutable` is set"}),
                );
            }
            self.wrote(name);
            let written = self.put(name, cm);
            if self.lost_answer.as_deref() == Some(name) {
                return (
                    500,
                    serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "reason": "InternalError", "code": 500, "message": "the answer was lost"}),
                );
            }
            (200, written)
        }

        fn delete(&mut self, name: &str, body: &[u8]) -> (u16, serde_json::Value) {
            let options: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
            let pre = &options["preconditions"];
            if pre.get("resourceVersion").is_none() && pre.get("uid").is_none() {
                self.blind.push(format!("DELETE {name}"));
            }
            if self.fail_deletes {
                return (
                    500,
                    serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "reason": "InternalError", "code": 500, "message": "etcd is away"}),
                );
            }
            let Some(current) = self.objects.get(name) else { return crate::test_fixtures::not_found(name) };
            for key in ["resourceVersion", "uid"] {
                if pre.get(key).is_some_and(|v| *v != current["metadata"][key]) {
                    return conflict("Conflict");
                }
            }
            (200, self.objects.remove(name).unwrap())
        }

        fn get(&mut self, name: &str) -> (u16, serde_json::Value) {
            if name == "configmaps" {
                return self.list();
            }
            let Some(cm) = self.objects.get(name).cloned() else { return crate::test_fixtures::not_found(name) };
            if self.written_after_read.as_deref() == Some(name) {
                self.written_after_read = None;
                let mut edited = cm.clone();
                edited["metadata"]["annotations"]["edited-by"] = serde_json::json!("someone else");
                self.put(name, edited);
            }
            (200, cm)
        }

        /// A create or an apply of `name` is being carried out.
        fn wrote(&mut self, name: &str) {
            if self.lose_leadership_at.as_ref().is_some_and(|(at, _)| at == name) {
                self.lose_leadership_at.take().unwrap().1.send_replace(None);
            }
        }
    }

    async fn stored_api(stored: Arc<Mutex<Stored>>) -> crate::test_fixtures::FakeApi {
        crate::test_fixtures::serve(Arc::new(move |method: &str, path: &str, body: &[u8]| {
            answer(&stored, method, path, body)
        }))
        .await
    }

    /// What the API server holding `stored` answers.
    fn answer(stored: &Mutex<Stored>, method: &str, path: &str, body: &[u8]) -> (u16, serde_json::Value) {
        let name = path.rsplit('/').next().unwrap_or_default().to_owned();
        let mut st = stored.lock().unwrap();
        match method {
            "POST" => st.create(body),
            "PATCH" => st.apply(&name, body),
            "DELETE" => st.delete(&name, body),
            "GET" => st.get(&name),
            _ => (405, serde_json::json!({})),
        }
    }

    /// Parts are created several at once, up to the bound: each part's creation is held
    /// until `PARTS_AT_ONCE` of them are in flight (or two seconds pass), which one after
    /// the other never happens.
    #[tokio::test(flavor = "multi_thread", worker_threads = 8)]
    async fn parts_are_created_several_at_once() {
        let s = Arc::new(snapshot(200, 64));
        let names = part_names(&s);
        assert!(names.len() > PARTS_AT_ONCE, "the budget splits this snapshot into {} parts", names.len());
        let stored = Arc::new(Mutex::new(Stored::default()));
        // (in flight now, most in flight at once)
        let gate = Arc::new((Mutex::new((0usize, 0usize)), std::sync::Condvar::new()));
        let (stored2, gate2) = (stored.clone(), gate.clone());
        let api = crate::test_fixtures::serve(Arc::new(move |method: &str, path: &str, body: &[u8]| {
            let is_part = method == "POST" && body.windows(LABEL_PART_OF.len()).any(|w| w == LABEL_PART_OF.as_bytes());
            if is_part {
                let (lock, ready) = &*gate2;
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
                let mut g = lock.lock().unwrap();
                g.0 += 1;
                g.1 = g.1.max(g.0);
                ready.notify_all();
                while g.1 < PARTS_AT_ONCE {
                    let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) else { break };
                    g = ready.wait_timeout(g, left).unwrap().0;
                }
                g.0 -= 1;
            }
            answer(&stored2, method, path, body)
        }))
        .await;
        let publisher = small_budget(&api, Leadership::always());
        publisher.publish(s.clone()).await.unwrap();
        assert_eq!(gate.0.lock().unwrap().1, PARTS_AT_ONCE, "parts in flight at once");
        assert_eq!(stored_parts(&stored), names.iter().cloned().collect::<BTreeSet<_>>(), "every part written");
        let requests = api.take();
        let index = requests.iter().position(|r| r == "PATCH snap").expect("the index is applied");
        assert_eq!(
            requests[..index].iter().filter(|r| *r == "POST configmaps").count(),
            names.len() + 1,
            "parts first"
        );
    }

    /// A loopback API server holding `stored`, and a publisher (always leading) writing to it
    /// with a budget of 1000 bytes.
    async fn publisher_of(stored: &Arc<Mutex<Stored>>) -> (crate::test_fixtures::FakeApi, ConfigMapPublisher) {
        let api = stored_api(stored.clone()).await;
        let publisher = small_budget(&api, Leadership::always());
        (api, publisher)
    }

    fn small_budget(api: &crate::test_fixtures::FakeApi, leadership: Leadership) -> ConfigMapPublisher {
        ConfigMapPublisher::with_budget(api.client.clone(), target(), leadership, 1000)
    }

    /// The part names of `s` split with a budget of 1000 bytes.
    fn part_names(s: &Snapshot) -> Vec<String> {
        encoded(s, 1000).parts.into_iter().map(|p| p.name).collect()
    }

    /// The part ConfigMaps `stored` holds.
    fn stored_parts(stored: &Arc<Mutex<Stored>>) -> BTreeSet<String> {
        let st = stored.lock().unwrap();
        st.objects.keys().filter(|k| k.as_str() != "snap").cloned().collect()
    }

    #[tokio::test]
    async fn parts_are_created_before_the_index_then_stale_parts_go_and_equal_content_is_skipped() {
        let s = Arc::new(snapshot(40, 64));
        let names = part_names(&s);
        assert!(names.len() >= 2, "the budget below splits this snapshot ({} parts)", names.len());
        // Stale parts of ours: of an earlier version (slotted and unslotted names) and of a
        // writer stopped before its index; and someone else's, not labelled as ours.
        let stored = Arc::new(Mutex::new(Stored::default()));
        {
            let mut st = stored.lock().unwrap();
            for stale in ["snap-0123456789abcdef", "snap-1", "snap-a-1"] {
                st.someone_elses(stale, true, 1);
            }
            st.someone_elses("snap-fedcba9876543210", false, 1);
        }
        let (api, publisher) = publisher_of(&stored).await;

        publisher.publish(s.clone()).await.unwrap();
        // The index is read (none yet) and our parts listed; the parts created whole, then
        // the index (created empty, then applied), then the stale parts deleted.
        let mut expected = vec!["GET snap".to_owned(), "GET configmaps".to_owned()];
        expected.extend(names.iter().map(|_| "POST configmaps".to_owned()));
        expected.extend(["POST configmaps".into(), "PATCH snap".into()]);
        expected.extend(["DELETE snap-0123456789abcdef", "DELETE snap-1", "DELETE snap-a-1"].map(String::from));
        assert_eq!(api.take(), expected);
        let mut left: BTreeSet<String> = names.iter().cloned().collect();
        left.insert("snap-fedcba9876543210".into());
        assert_eq!(stored_parts(&stored), left, "ours written, someone else's kept");
        assert!(stored.lock().unwrap().blind.is_empty(), "{:?}", stored.lock().unwrap().blind);

        let same_content = Arc::new(s.content.clone().into_snapshot(s.id + 1));
        publisher.publish(same_content).await.unwrap();
        assert!(api.take().is_empty(), "equal hash: nothing written");
    }

    #[tokio::test]
    async fn a_configmap_that_is_not_ours_is_never_deleted() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        {
            let mut st = stored.lock().unwrap();
            st.someone_elses("snap-1", false, 1);
            // Labelled as a part of snap, but not named as ours are.
            st.someone_elses("other-1", true, 1);
        }
        let (api, publisher) = publisher_of(&stored).await;
        publisher.publish(Arc::new(snapshot(2, 8))).await.unwrap();
        assert_eq!(api.take(), ["GET snap", "GET configmaps", "POST configmaps", "PATCH snap"]);
        assert_eq!(stored_parts(&stored), BTreeSet::from(["other-1".to_owned(), "snap-1".to_owned()]));
    }

    #[test]
    fn a_tiny_budget_splits_into_many_parts_found_by_name() {
        let s = snapshot(50, 64);
        let json = s.to_json();
        let e = encoded(&s, 1000);
        assert!(e.parts.len() > 2);
        let mut parts = e.part_configmaps();
        assert_eq!(decode(&e.main, &parts).unwrap(), json);
        parts.reverse();
        assert_eq!(decode(&e.main, &parts).unwrap(), json, "parts are found by name, not position");
    }

    /// A part name that exists already is used as it is when it holds our bytes under our
    /// labels (as a previous leader leaves it). Anything else of that name is read, then
    /// replaced conditional on that read: never written over blind. Written over by yet
    /// someone else in between, it is left to them and the index is not switched.
    #[tokio::test]
    async fn an_existing_part_is_used_when_it_holds_our_bytes_and_replaced_as_read_otherwise() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let (api, publisher) = publisher_of(&stored).await;
        let (s1, s2) = (snapshot(40, 64), snapshot(41, 64));
        publisher.publish(Arc::new(s1.clone())).await.unwrap();
        let index1 = stored.lock().unwrap().objects["snap"].clone();
        let new = part_names(&s2).into_iter().find(|n| !part_names(&s1).contains(n)).unwrap();
        {
            let mut st = stored.lock().unwrap();
            st.someone_elses(&new, true, 99);
            st.written_after_read = Some(new.clone());
        }
        api.take();
        let err = publisher.publish(Arc::new(s2.clone())).await.unwrap_err();
        assert_eq!(err.reason(), "conflict", "{err}");
        let calls = api.take();
        // Refused, read, deleted as read (other parts' creations run beside it).
        let at = calls.iter().position(|c| *c == format!("GET {new}")).unwrap();
        assert!(calls[..at].contains(&"POST configmaps".to_owned()), "{calls:?}");
        assert!(calls[at..].contains(&format!("DELETE {new}")), "{calls:?}");
        assert!(calls.iter().all(|c| c != "PATCH snap"), "the index is not switched: {calls:?}");
        assert_eq!(read_with(&stored.lock().unwrap(), &index1).unwrap(), s1.to_json());
        assert!(stored.lock().unwrap().objects[&new]["metadata"]["annotations"]["edited-by"] == "someone else");

        // Someone else's, read and not written since: replaced.
        let e = encoded(&s2, 1000);
        publisher.publish(Arc::new(s2.clone())).await.unwrap();
        {
            let st = stored.lock().unwrap();
            let ours = e.part_configmap(e.parts.iter().find(|p| p.name == new).unwrap());
            let live: ConfigMap = serde_json::from_value(st.objects[&new].clone()).unwrap();
            assert!(same_part(&live, &ours), "replaced by our part");
            assert_eq!(read_with(&st, &st.objects["snap"]).unwrap(), s2.to_json());
        }

        // A part the next snapshot needs, left by another leader: our bytes, our labels.
        // Used as it is.
        let s3 = snapshot(42, 64);
        let e3 = encoded(&s3, 1000);
        let left = e3.parts.iter().find(|p| !part_names(&s2).contains(&p.name)).unwrap();
        stored.lock().unwrap().put(&left.name, serde_json::to_value(e3.part_configmap(left)).unwrap());
        api.take();
        publisher.publish(Arc::new(s3.clone())).await.unwrap();
        let calls = api.take();
        assert!(calls.contains(&format!("GET {}", left.name)), "refused, then read: {calls:?}");
        assert!(!calls.contains(&format!("DELETE {}", left.name)), "used as it is: {calls:?}");
        let st = stored.lock().unwrap();
        assert!(st.blind.is_empty(), "written without a condition: {:?}", st.blind);
        assert_eq!(read_with(&st, &st.objects["snap"]).unwrap(), s3.to_json());
    }

    /// A write whose answer is lost (a timeout) may have landed: the next publication reads
    /// the index again, so its write stays conditional on what is there, never blind.
    #[tokio::test]
    async fn after_a_lost_answer_the_next_write_is_still_conditional() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let (api, publisher) = publisher_of(&stored).await;
        publisher.publish(Arc::new(snapshot(40, 64))).await.unwrap();
        stored.lock().unwrap().lost_answer = Some("snap".into());
        let err = publisher.publish(Arc::new(snapshot(41, 64))).await.unwrap_err();
        assert_eq!(err.reason(), "server_error", "{err}");
        // Someone else writes it meanwhile.
        {
            let mut st = stored.lock().unwrap();
            st.lost_answer = None;
            let mut cm = st.objects["snap"].clone();
            cm["metadata"]["annotations"]["edited-by"] = serde_json::json!("someone else");
            st.put("snap", cm);
        }
        api.take();
        let s3 = snapshot(42, 64);
        publisher.publish(Arc::new(s3.clone())).await.unwrap();
        let calls = api.take();
        assert_eq!(calls[..2], ["GET snap", "GET configmaps"], "read again first: {calls:?}");
        let st = stored.lock().unwrap();
        assert!(st.blind.is_empty(), "written without a condition: {:?}", st.blind);
        assert_eq!(read_with(&st, &st.objects["snap"]).unwrap(), s3.to_json());
    }

    /// A stale part is deleted only as it was last seen: one written by someone else since
    /// is left to them, and the publication fails.
    #[tokio::test]
    async fn a_stale_part_written_since_it_was_seen_is_not_deleted() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let (api, publisher) = publisher_of(&stored).await;
        let (s1, s2, s3) = (snapshot(40, 64), snapshot(41, 64), snapshot(42, 64));
        publisher.publish(Arc::new(s1.clone())).await.unwrap();
        publisher.publish(Arc::new(s2.clone())).await.unwrap();
        // The third makes s1's parts stale: one of them is written by someone else first.
        let (p1, p2, p3) = (part_names(&s1), part_names(&s2), part_names(&s3));
        let stale = p1.iter().find(|n| !p2.contains(n) && !p3.contains(n)).unwrap().clone();
        {
            let mut st = stored.lock().unwrap();
            let mut cm = st.objects[&stale].clone();
            cm["metadata"]["annotations"]["edited-by"] = serde_json::json!("someone else");
            st.put(&stale, cm);
        }
        api.take();
        let err = publisher.publish(Arc::new(s3)).await.unwrap_err();
        assert_eq!(err.reason(), "conflict", "{err}");
        let st = stored.lock().unwrap();
        assert!(st.objects.contains_key(&stale), "deleted after someone else wrote it");
        assert!(st.blind.is_empty(), "written without a condition: {:?}", st.blind);
    }

    /// Once leadership is gone no write is sent, even between two writes of one
    /// publication whose deadline has not passed.
    #[tokio::test]
    async fn no_write_is_sent_once_leadership_is_gone() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let api = stored_api(stored.clone()).await;
        let (lead, leadership) = Leadership::manual();
        lead.send_replace(Some(Instant::now() + std::time::Duration::from_secs(3600)));
        let s = snapshot(200, 64);
        assert!(part_names(&s).len() > PARTS_AT_ONCE);
        stored.lock().unwrap().lose_leadership_at = Some((part_names(&s)[0].clone(), lead));
        let publisher = small_budget(&api, leadership);
        let err = publisher.publish(Arc::new(s)).await.unwrap_err();
        assert_eq!(err.reason(), "leadership_lapsed", "{err}");
        // The creations already on their way when the first answer said so, and nothing
        // after: no further part, no index.
        let calls = api.take();
        let posts = calls.len() - 2;
        assert_eq!(calls[..2], ["GET snap", "GET configmaps"]);
        assert!((1..=PARTS_AT_ONCE).contains(&posts), "{calls:?}");
        assert!(calls[2..].iter().all(|c| c == "POST configmaps"), "nothing written after: {calls:?}");
    }

    /// A new leader numbers its snapshots above every id in the ConfigMaps: the index's,
    /// and those of parts a previous leader wrote before it stopped, that no index names.
    #[tokio::test]
    async fn the_published_id_counts_parts_no_index_names_yet() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let (_api, publisher) = publisher_of(&stored).await;
        assert_eq!(publisher.published_id().await.unwrap(), None);
        publisher.publish(Arc::new(snapshot(40, 64))).await.unwrap();
        assert_eq!(publisher.published_id().await.unwrap(), Some(42));
        {
            let mut st = stored.lock().unwrap();
            st.someone_elses("snap-0123456789abcdef", true, 57);
            // Not ours: not labelled, or not named as ours are.
            st.someone_elses("snap-fedcba9876543210", false, 90);
            st.someone_elses("other-0123456789abcdef", true, 90);
        }
        assert_eq!(publisher.published_id().await.unwrap(), Some(57));
    }

    #[tokio::test]
    async fn a_deleted_or_edited_configmap_is_written_again_by_repair() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let api = stored_api(stored.clone()).await;
        let publisher = ConfigMapPublisher::new(api.client.clone(), target(), Leadership::always());
        publisher.publish(Arc::new(snapshot(2, 8))).await.unwrap();
        api.take();
        assert!(publisher.repair().await.unwrap().is_empty(), "intact: nothing to repair");
        assert_eq!(api.take(), ["GET snap"], "one read, no write");

        stored.lock().unwrap().objects.remove("snap");
        assert_eq!(publisher.repair().await.unwrap(), ["snap"]);
        assert_eq!(api.take(), ["GET snap", "POST configmaps", "PATCH snap"], "gone: created again");

        let edited = {
            let mut st = stored.lock().unwrap();
            let cm = st.objects.get_mut("snap").unwrap();
            cm["data"][KEY_JSON] = serde_json::json!("{}");
            cm["metadata"]["resourceVersion"] = serde_json::json!("edited");
            cm.clone()
        };
        assert_eq!(publisher.repair().await.unwrap(), ["snap"], "an edit is repaired too");
        let back = stored.lock().unwrap().objects["snap"].clone();
        assert_ne!(back["data"], edited["data"]);
        assert_eq!(back["data"][KEY_JSON].as_str().unwrap().as_bytes(), snapshot(2, 8).to_json());
    }

    #[tokio::test]
    async fn a_deleted_or_replaced_part_is_created_again_by_repair() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let (api, publisher) = publisher_of(&stored).await;
        let s = snapshot(40, 64);
        publisher.publish(Arc::new(s.clone())).await.unwrap();
        let names = part_names(&s);
        {
            let mut st = stored.lock().unwrap();
            st.objects.remove(&names[0]);
            st.objects.remove(&names[1]);
            st.someone_elses(&names[1], true, 7);
        }
        api.take();
        assert_eq!(publisher.repair().await.unwrap(), names[..2]);
        let calls = api.take();
        let expected = [format!("GET {}", names[0]), "POST configmaps".into(), format!("GET {}", names[1])];
        assert_eq!(calls[..3], expected, "{calls:?}");
        assert!(calls.contains(&format!("DELETE {}", names[1])), "replaced: deleted, then created: {calls:?}");
        let st = stored.lock().unwrap();
        assert_eq!(read_with(&st, &st.objects["snap"]).unwrap(), s.to_json());
        assert!(st.blind.is_empty(), "{:?}", st.blind);
    }

    #[tokio::test]
    async fn writes_are_conditional_and_a_conflict_is_read_and_written_over() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let api = stored_api(stored.clone()).await;
        let publisher = ConfigMapPublisher::new(api.client.clone(), target(), Leadership::always());
        publisher.publish(Arc::new(snapshot(2, 8))).await.unwrap();
        // Someone else writes it in between.
        stored.lock().unwrap().objects.get_mut("snap").unwrap()["metadata"]["resourceVersion"] =
            serde_json::json!("other");
        api.take();
        publisher.publish(Arc::new(snapshot(3, 8))).await.unwrap();
        assert_eq!(api.take(), ["PATCH snap", "GET snap", "PATCH snap"], "not split before or now: no parts");
        let back = stored.lock().unwrap().objects["snap"].clone();
        assert_eq!(back["data"][KEY_JSON].as_str().unwrap().as_bytes(), snapshot(3, 8).to_json());
    }

    /// The objects `stored` holds, decoded as a reader would from `main` (an index read
    /// earlier, say).
    fn read_with(stored: &Stored, main: &serde_json::Value) -> Result<Vec<u8>, String> {
        let main: ConfigMap = serde_json::from_value(main.clone()).unwrap();
        let parts: Vec<ConfigMap> =
            stored.objects.values().map(|o| serde_json::from_value(o.clone()).unwrap()).collect();
        decode(&main, &parts)
    }

    /// A new index reuses the parts the cluster holds; a reader of the previous index still
    /// reads its snapshot whole, until the next publication after that.
    #[tokio::test]
    async fn a_new_index_reuses_unchanged_parts_and_the_previous_one_stays_readable() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let api = stored_api(stored.clone()).await;
        let publisher = ConfigMapPublisher::new(api.client.clone(), target(), Leadership::always());
        let s1 = snapshot(30_000, 32);
        let s2 = snapshot_with(30_000, 32, &[10_000]).content.into_snapshot(43);
        let s3 = snapshot_with(30_000, 32, &[10_000, 20_000]).content.into_snapshot(44);

        publisher.publish(Arc::new(s1.clone())).await.unwrap();
        let index1 = stored.lock().unwrap().objects["snap"].clone();
        let n = index_of(&serde_json::from_value(index1.clone()).unwrap()).unwrap().unwrap().parts.len();
        api.take();
        publisher.publish(Arc::new(s2.clone())).await.unwrap();
        let calls = api.take();
        let created = calls.iter().filter(|c| *c == "POST configmaps").count();
        assert_eq!(created, 3, "the header, the changed segment and the trailer, of {n}: {calls:?}");
        assert_eq!(calls.last().map(String::as_str), Some("PATCH snap"), "nothing deleted yet: {calls:?}");
        // A reader holding the first index still reads the first snapshot, whole.
        assert_eq!(read_with(&stored.lock().unwrap(), &index1).unwrap(), s1.to_json());
        let index2 = stored.lock().unwrap().objects["snap"].clone();
        assert_eq!(read_with(&stored.lock().unwrap(), &index2).unwrap(), s2.to_json());

        // The third: the first's own parts go, the second's stay for its readers.
        publisher.publish(Arc::new(s3.clone())).await.unwrap();
        let calls = api.take();
        assert_eq!(calls.iter().filter(|c| c.starts_with("DELETE")).count(), 3, "{calls:?}");
        assert_eq!(read_with(&stored.lock().unwrap(), &index2).unwrap(), s2.to_json());
        assert!(read_with(&stored.lock().unwrap(), &index1).unwrap_err().contains("is missing"));

        // A new process (or leader) reads the index and lists the parts first. A part listed
        // is only a claim: each one it needs is read once (its create refused) and used as
        // it is, nothing written again.
        let next = ConfigMapPublisher::new(api.client.clone(), target(), Leadership::always());
        next.publish(Arc::new(s2.clone())).await.unwrap();
        let calls = api.take();
        assert_eq!(calls[..2], ["GET snap", "GET configmaps"]);
        assert_eq!(calls.iter().filter(|c| c.starts_with("GET snap-")).count(), n, "{calls:?}");
        assert!(calls.iter().all(|c| !c.starts_with("DELETE")), "{calls:?}");
        assert_eq!(calls.last().map(String::as_str), Some("PATCH snap"));

        // Snapshots that fit in one ConfigMap: the parts go, the last index's one
        // publication later.
        next.publish(Arc::new(snapshot(2, 8))).await.unwrap();
        assert!(!stored_parts(&stored).is_empty(), "the previous index's parts are kept for its readers");
        next.publish(Arc::new(snapshot(3, 8))).await.unwrap();
        assert_eq!(stored_parts(&stored), BTreeSet::new(), "no part left once none is needed");
        assert!(stored.lock().unwrap().blind.is_empty(), "{:?}", stored.lock().unwrap().blind);
    }

    /// A write that fails after switching the index (here: deleting stale parts) leaves the
    /// cluster holding a snapshot this publisher did not record: the next one is written
    /// even when it equals the one written before, and the index is read again first.
    #[tokio::test]
    async fn after_a_failed_write_nothing_is_skipped_as_already_written() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let (api, publisher) = publisher_of(&stored).await;
        let (s1, s2, small) = (snapshot(40, 64), snapshot(41, 64), snapshot(2, 8));
        publisher.publish(Arc::new(s1)).await.unwrap();
        publisher.publish(Arc::new(s2.clone())).await.unwrap();
        stored.lock().unwrap().fail_deletes = true;
        publisher.publish(Arc::new(small.clone())).await.unwrap_err();
        let main = stored.lock().unwrap().objects["snap"].clone();
        assert_eq!(read_with(&stored.lock().unwrap(), &main).unwrap(), small.to_json(), "the index had switched");
        stored.lock().unwrap().fail_deletes = false;
        api.take();

        publisher.publish(Arc::new(s2.clone())).await.unwrap();
        assert_eq!(api.take()[0], "GET snap", "the index is read again");
        let main = stored.lock().unwrap().objects["snap"].clone();
        assert_eq!(read_with(&stored.lock().unwrap(), &main).unwrap(), s2.to_json(), "written, not skipped");
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_is_written_without_leadership_and_writing_stops_at_its_deadline() {
        let stored = Arc::new(Mutex::new(Stored::default()));
        let api = stored_api(stored.clone()).await;
        let (lead, leadership) = Leadership::manual();
        let publisher = ConfigMapPublisher::new(api.client.clone(), target(), leadership);
        let err = publisher.publish(Arc::new(snapshot(2, 8))).await.unwrap_err();
        assert!(matches!(err, PublishError::NotLeading(_)), "{err}");
        assert_eq!(err.reason(), "not_leading");
        assert!(api.take().is_empty());
        // Leading until a deadline already passed: nothing is sent either.
        lead.send_replace(Some(tokio::time::Instant::now()));
        let err = publisher.publish(Arc::new(snapshot(2, 8))).await.unwrap_err();
        assert!(matches!(err, PublishError::NotLeading(_)), "a lapsed deadline is no leadership: {err}");
        assert!(publisher.repair().await.unwrap().is_empty());
        assert!(api.take().is_empty());
    }
}

/// Property tests of the decoder, the reader's side of docs/snapshot.md: what the operator
/// encodes reads back byte for byte in any part order; a changed byte or a part of another
/// snapshot is refused (never a mix); and any ConfigMaps at all (garbage, a lying index,
/// gzip bombs) decode or fail within a memory bound, never panic.
#[cfg(test)]
mod proptests {
    use super::tests::{snapshot, target};
    use super::*;
    use crate::test_fixtures::peak_heap;
    use proptest::prelude::*;

    /// The decoder's limit in these tests: small, so that bombs are worth their name.
    const LIMIT: usize = 64 * 1024;

    fn config() -> ProptestConfig {
        ProptestConfig { cases: 128, ..ProptestConfig::default() }
    }

    fn cm(name: &str, data: Option<BTreeMap<String, String>>, binary: Option<BTreeMap<String, Vec<u8>>>) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta { name: Some(name.to_owned()), ..ObjectMeta::default() },
            data,
            binary_data: binary.map(|b| b.into_iter().map(|(k, v)| (k, ByteString(v))).collect()),
            ..ConfigMap::default()
        }
    }

    /// Bytes the ConfigMaps hold: data values and binaryData values.
    fn input_size(cms: &[&ConfigMap]) -> usize {
        cms.iter()
            .map(|c| {
                c.data.iter().flatten().map(|(_, v)| v.len()).sum::<usize>()
                    + c.binary_data.iter().flatten().map(|(_, v)| v.0.len()).sum::<usize>()
            })
            .sum()
    }

    /// The gzip of `n` zero bytes: about a thousandth of `n`.
    fn bomb(n: usize) -> Vec<u8> {
        use std::io::Write;
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let zeros = vec![0u8; 64 * 1024];
        for _ in 0..n / zeros.len() {
            enc.write_all(&zeros).unwrap();
        }
        enc.finish().unwrap()
    }

    /// Part payloads: random bytes, a gzip bomb's pieces, or nothing.
    fn payload() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            prop::collection::vec(any::<u8>(), 0..256),
            (1usize..16).prop_map(|mib| bomb(mib << 20)),
            Just(Vec::new()),
        ]
    }

    /// An index whose fields are anything, over parts named from a small set (so names
    /// repeat), each with its true sha256 or not.
    fn arbitrary_split() -> impl Strategy<Value = (ConfigMap, Vec<ConfigMap>)> {
        let part = (prop::sample::select(vec!["snap-1", "snap-2", "snap-3", "other"]), payload(), any::<bool>());
        (
            prop::collection::vec(part, 0..5),
            prop_oneof![Just("gzip".to_owned()), ".{0,6}"],
            any::<usize>(),
            any::<u64>(),
            any::<bool>(),
        )
            .prop_map(|(parts, encoding, size, id, whole_sha_true)| {
                let refs: Vec<PartRef> = parts
                    .iter()
                    .map(|(name, bytes, sha_true)| PartRef {
                        name: (*name).to_owned(),
                        sha256: if *sha_true { sha256(bytes) } else { "sha256:00".into() },
                        size: bytes.len(),
                    })
                    .collect();
                let whole: Vec<u8> = parts.iter().flat_map(|(_, b, _)| b.clone()).collect();
                let index = Index {
                    encoding,
                    snapshot_id: id,
                    snapshot_hash: "sha256:x".into(),
                    sha256: if whole_sha_true { sha256(&whole) } else { "sha256:00".into() },
                    size,
                    parts: refs,
                };
                let main = cm(
                    "snap",
                    Some(BTreeMap::from([(KEY_INDEX.to_owned(), serde_json::to_string(&index).unwrap())])),
                    None,
                );
                let parts = parts
                    .into_iter()
                    .map(|(name, bytes, _)| cm(name, None, Some(BTreeMap::from([(KEY_PART.to_owned(), bytes)]))))
                    .collect();
                (main, parts)
            })
    }

    /// A main ConfigMap of any of the three encodings, or none, with any content.
    fn arbitrary_configmaps() -> impl Strategy<Value = (ConfigMap, Vec<ConfigMap>)> {
        prop_oneof![
            ".{0,64}".prop_map(|t| (cm("snap", Some(BTreeMap::from([(KEY_JSON.to_owned(), t)])), None), vec![])),
            (1usize..2048).prop_map(|k| (
                cm("snap", Some(BTreeMap::from([(KEY_JSON.to_owned(), "x".repeat(k * 64))])), None),
                vec![]
            )),
            payload().prop_map(|b| (cm("snap", None, Some(BTreeMap::from([(KEY_GZIP.to_owned(), b)]))), vec![])),
            ".{0,64}".prop_map(|t| (cm("snap", Some(BTreeMap::from([(KEY_INDEX.to_owned(), t)])), None), vec![])),
            arbitrary_split(),
            Just((cm("snap", None, None), vec![])),
        ]
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn what_is_encoded_decodes_to_its_bytes_in_any_part_order(
            endpoints in 0usize..60,
            meta_len in 0usize..48,
            budget in 16usize..4096,
            rotate in any::<usize>(),
        ) {
            let s = snapshot(endpoints, meta_len);
            let json = s.to_json();
            let e = encode(&target(), &s, budget).unwrap();
            let mut parts = e.part_configmaps();
            if !parts.is_empty() {
                let n = rotate % parts.len();
                parts.rotate_left(n);
                parts.reverse();
            }
            let decoded = decode(&e.main, &parts).unwrap();
            prop_assert!(decoded == json, "decode(encode(x)) != x");
            // The document reads back to the same content, hash included.
            let back = Snapshot::parse(&decoded).unwrap();
            prop_assert_eq!(&back.hash, &s.hash);
            prop_assert_eq!(back.content.hash(), s.hash.clone());
            // Each part, and a snapshot kept whole, within the budget (an index grows with
            // its parts: a few hundred bytes at the real budget).
            let whole = e.parts.is_empty().then_some(&e.main);
            for c in e.part_configmaps().iter().chain(whole) {
                prop_assert!(input_size(&[c]) <= budget, "{} bytes in one ConfigMap", input_size(&[c]));
            }
        }

        #[test]
        fn a_changed_byte_or_another_snapshots_part_is_refused_never_mixed(
            endpoints in 20usize..60,
            budget in 64usize..1024,
            which in any::<usize>(),
            at in any::<usize>(),
            flip in 1u8..=255,
        ) {
            let s = snapshot(endpoints, 32);
            let e = encode(&target(), &s, budget).unwrap();
            prop_assume!(e.parts.len() >= 2);
            let i = which % e.parts.len();
            let mut changed = e.part_configmaps();
            let bytes = &mut changed[i].binary_data.as_mut().unwrap().get_mut(KEY_PART).unwrap().0;
            let j = at % bytes.len();
            bytes[j] ^= flip;
            prop_assert!(decode(&e.main, &changed).is_err(), "part {} byte {} changed, and decoded", i, j);

            // The next snapshot's parts, as a reader racing a write sees them, under the names
            // of this one's: refused, or (when the bytes happen to be the same) the
            // original, never a mix.
            let next = encode(&target(), &snapshot(endpoints + 1, 32), budget).unwrap();
            let mut mixed = e.part_configmaps();
            if let Some(p) = next.part_configmaps().get(i) {
                mixed[i].binary_data = p.binary_data.clone();
            }
            if let Ok(bytes) = decode(&e.main, &mixed) {
                prop_assert!(bytes == s.to_json(), "a mix of two snapshots decoded");
            }
        }

        #[test]
        fn any_configmaps_decode_or_fail_within_a_memory_bound((main, parts) in arbitrary_configmaps()) {
            let (decoded, peak) = peak_heap(|| decode_limited(&main, &parts, LIMIT));
            let input = input_size(&[&main]) + input_size(&parts.iter().collect::<Vec<_>>());
            prop_assert!(peak <= 4 * (input + LIMIT) + 256 * 1024, "{} bytes held for {} bytes of input", peak, input);
            if let Ok(bytes) = decoded {
                prop_assert!(bytes.len() <= LIMIT);
            }
        }
    }

    #[test]
    fn a_gzip_bomb_and_an_index_naming_one_part_many_times_are_refused() {
        let gz = bomb(16 << 20);
        let main = cm("snap", None, Some(BTreeMap::from([(KEY_GZIP.to_owned(), gz.clone())])));
        let (err, peak) = peak_heap(|| decode_limited(&main, &[], LIMIT).unwrap_err());
        assert!(err.contains("larger than 65536 bytes"), "{err}");
        assert!(peak < 1 << 20, "{peak} bytes held to refuse a bomb");

        // The same part, a thousand times over: never a thousand copies; refused at the limit.
        let part = cm("snap-1", None, Some(BTreeMap::from([(KEY_PART.to_owned(), gz.clone())])));
        let refs = vec![PartRef { name: "snap-1".into(), sha256: sha256(&gz), size: gz.len() }; 1000];
        let whole: Vec<u8> = refs.iter().flat_map(|_| gz.clone()).collect();
        let index = Index {
            encoding: "gzip".into(),
            snapshot_id: 1,
            snapshot_hash: "sha256:x".into(),
            sha256: sha256(&whole),
            size: usize::MAX,
            parts: refs,
        };
        let main =
            cm("snap", Some(BTreeMap::from([(KEY_INDEX.to_owned(), serde_json::to_string(&index).unwrap())])), None);
        let (err, peak) = peak_heap(|| decode_limited(&main, std::slice::from_ref(&part), LIMIT).unwrap_err());
        assert!(err.contains("larger than 65536 bytes"), "{err}");
        assert!(peak < 1 << 20, "{peak} bytes held");
    }

    /// The parts make one gzip stream and nothing else: bytes after its end are refused,
    /// not ignored (a reader would otherwise take half of what the index names).
    #[test]
    fn bytes_after_the_end_of_the_stream_are_refused() {
        let s = snapshot(40, 64);
        let e = encode(&target(), &s, 1000).unwrap();
        let mut index = index_of(&e.main).unwrap().unwrap();
        let mut parts = e.part_configmaps();
        // The whole stream named twice over: each part checks, the whole checks.
        let once = index.parts.clone();
        index.parts.extend(once);
        let whole: Vec<u8> = index
            .parts
            .iter()
            .flat_map(|r| e.parts.iter().find(|p| p.name == r.name).unwrap().bytes.to_vec())
            .collect();
        index.sha256 = sha256(&whole);
        let main =
            cm("snap", Some(BTreeMap::from([(KEY_INDEX.to_owned(), serde_json::to_string(&index).unwrap())])), None);
        let err = decode(&main, &parts).unwrap_err();
        assert!(err.contains("after the end of the gzip stream"), "{err}");
        parts.reverse();
        assert_eq!(decode(&e.main, &parts).unwrap(), s.to_json(), "the true index reads");
    }
}
