//! The snapshot ConfigMap's format, pure: what [`encode`] makes of a snapshot and what
//! [`decode`] reads back (docs/snapshot.md). The writer (`super`) only applies it.
//!
//! A ConfigMap holds at most 1 MiB, and snapshots of large clusters are bigger than that.
//! The encoding is chosen per snapshot, never truncating:
//!
//! - `data["snapshot.json"]` when the JSON is at most [`WHOLE_LIMIT`];
//! - else `binaryData["snapshot.json.gz"]` when the gzip of it is;
//! - else the gzip stream split over parts `NAME-<hash>` (`binaryData["part"]`), and `NAME`
//!   holds `data["index.json"]`: the parts in order, their sha256, and the sha256 of the
//!   whole. The parts together are one gzip stream, as when it fits one ConfigMap.
//!
//! Split, a part is named by its content (the first 16 hex digits of its sha256), created
//! whole, immutable, and never written again: the stream is made of segments deflated
//! alone at places its content chooses (`consul_resolver_core::assembler::gzip`), so a
//! change to one service changes a part or two, and the other parts of the new index are
//! the previous one's, already in the cluster. Only a read spanning two publications can
//! find a part gone; it reads again ([`decode`] says so).

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::kube_client::FIELD_MANAGER;
use crate::publishers::gunzip_limited;
use consul_resolver_api::names::NamespacedName;
use consul_resolver_core::assembler::Snapshot;
use consul_resolver_core::assembler::gzip::GZIP_HEADER;

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

/// Bytes of data per ConfigMap: well under the API server's 1 MiB, leaving room for
/// metadata (labels, annotations, managedFields).
pub const DATA_BUDGET: usize = 900 * 1024;

/// The most a snapshot written whole in `NAME` (its JSON, or its gzip) holds; a larger one
/// is split even where it would fit one ConfigMap. A write of a ConfigMap costs the API
/// server and etcd its whole size, and every watcher of ConfigMaps in its namespace gets it
/// whole; split, a change writes the few parts it changed and a small index. At many
/// tenants (a gzip of 455 KB) each change's whole rewrite took the publisher 40 ms, twice
/// its time at 139 KB (docs/benchmarks.md).
pub(crate) const WHOLE_LIMIT: usize = 256 * 1024;

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
/// per ConfigMap and at most [`WHOLE_LIMIT`] written whole: gzipped (once per snapshot,
/// see [`Snapshot::gzipped`]) when its JSON is over that, split when its gzip is too.
pub(crate) fn encode(target: &NamespacedName, snapshot: &Snapshot, budget: usize) -> Result<Encoded, String> {
    let (id, hash) = (snapshot.id, snapshot.hash.as_str());
    let budget = budget.max(1);
    let whole = budget.min(WHOLE_LIMIT);
    let main_meta = || meta(target, id, hash);
    if snapshot.len() <= whole {
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
    if gz.len() <= whole {
        let main = ConfigMap {
            metadata: main_meta(),
            binary_data: Some(BTreeMap::from([(KEY_GZIP.to_owned(), ByteString(gz.to_bytes().to_vec()))])),
            ..ConfigMap::default()
        };
        return Ok(Encoded { parts: Vec::new(), main });
    }
    // The pieces whose boundaries the content chose: the gzip header with the first
    // segment (the document's own header), each other segment, and the trailer. Each is
    // cut to the budget where it exceeds it (only incompressible content does). A whole
    // segment comes with the sha256 made when it was deflated: most of a change's parts
    // are segments of earlier snapshots, and are not hashed again.
    let mut pieces = Vec::with_capacity(gz.segments().len() + 1);
    for (i, segment) in gz.segments().iter().enumerate() {
        pieces.push(if i == 0 {
            (Bytes::from([&GZIP_HEADER[..], segment.body()].concat()), None)
        } else {
            (segment.body().clone(), Some(segment.sha256()))
        });
    }
    pieces.push((Bytes::copy_from_slice(&gz.trailer()), None));
    let mut whole = Sha256::new();
    let (mut refs, mut parts, mut named) = (Vec::new(), Vec::new(), BTreeSet::new());
    for (piece, digest) in &pieces {
        let mut at = 0;
        while at < piece.len() {
            let bytes = piece.slice(at..piece.len().min(at + budget));
            at += bytes.len();
            whole.update(&bytes);
            let digest = match digest {
                Some(digest) if bytes.len() == piece.len() => format!("sha256:{}", hex::encode(digest)),
                _ => sha256(&bytes),
            };
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

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    use consul_resolver_core::assembler::snapshot::{Bootstrap, Content, Part, ResolverEntry, ServiceEntry};
    use consul_resolver_core::model::{Endpoint, Health};

    pub(crate) fn target() -> NamespacedName {
        NamespacedName { namespace: "ops".into(), name: "snap".into() }
    }

    use consul_resolver_core::test_support::Rng;

    /// A snapshot with `n` endpoints, each with `meta_len` random bytes of meta.
    pub(crate) fn snapshot(n: usize, meta_len: usize) -> Snapshot {
        snapshot_with(n, meta_len, &[])
    }

    /// [`snapshot`], with the endpoints `moved` on another port.
    pub(crate) fn snapshot_with(n: usize, meta_len: usize, moved: &[usize]) -> Snapshot {
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
                weight: None,
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
                })]
                .into(),
            })],
            mappings: Default::default(),
            kubernetes_services: Default::default(),
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

    pub(crate) fn encoded(s: &Snapshot, budget: usize) -> Encoded {
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
        assert!(s.gzipped().len() <= WHOLE_LIMIT, "{}", s.gzipped().len());
        let e = roundtrip(&s);
        assert!(e.parts.is_empty());
        assert!(e.main.data.is_none());
        let gz = &e.main.binary_data.as_ref().unwrap()[KEY_GZIP].0;
        // One gzip stream for any reader, though made of segments.
        let mut json = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut json).unwrap();
        assert!(json == s.to_json());
    }

    /// What fits one ConfigMap but is over [`WHOLE_LIMIT`] is not written whole: JSON goes
    /// gzipped, a gzip is split.
    #[test]
    fn past_the_whole_limit_json_is_gzipped_and_gzip_is_split() {
        let s = snapshot(4_000, 0);
        let json = s.to_json().len();
        assert!(WHOLE_LIMIT < json && json <= DATA_BUDGET, "{json} bytes of JSON");
        let e = roundtrip(&s);
        assert!(e.parts.is_empty() && e.main.data.is_none());
        assert!(e.main.binary_data.as_ref().unwrap().contains_key(KEY_GZIP));

        let s = snapshot(5_000, 128);
        let gz = s.gzipped().len();
        assert!(WHOLE_LIMIT < gz && gz <= DATA_BUDGET, "{gz} bytes of gzip");
        let e = roundtrip(&s);
        assert!(e.parts.len() >= 2, "{} parts", e.parts.len());
        assert!(index_of(&e.main).unwrap().is_some());
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
            serde_json::from_str(include_str!("../../../docs/snapshot-index.schema.json")).unwrap();
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
