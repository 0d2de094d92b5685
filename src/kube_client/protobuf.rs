//! ConfigMap writes with the body in the API server's protobuf encoding.
//!
//! The snapshot's gzip sits in a ConfigMap's `binaryData`. In JSON that is a base64 string
//! a third longer, which the API server decodes from a JSON document before anything else;
//! in protobuf the bytes travel as they are. For the default profile's 137 KB ConfigMap an
//! update took 7.3 instead of 10.9 ms (p50) and two thirds of the API server's CPU, and an
//! 800 KB part's 23 instead of 40 ms (docs/benchmarks.md, "A snapshot ConfigMap's write").
//! The answer stays JSON: kube reads it, and its errors, as it reads every other, and
//! encoding it costs the API server little (a protobuf answer too gained 0.2 ms).
//!
//! Only the encoder is here, for the one kind written this way. It follows Kubernetes'
//! wire format (`k8s.io/apimachinery/pkg/runtime/serializer/protobuf`): the 4 bytes
//! `k8s\0`, then a `runtime.Unknown` message whose `raw` field holds the object, its
//! fields numbered as in `core/v1` and `meta/v1` `generated.proto`. Every field of
//! `ObjectMeta` is written but `managedFields`, which an update without them leaves as the
//! API server tracks them, and which this operator never sets.

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use kube::api::PostParams;
use kube::{Api, core::Request};

/// The media type of the API server's protobuf encoding.
pub(crate) const PROTOBUF: &str = "application/vnd.kubernetes.protobuf";
/// What precedes the envelope in every protobuf body.
const MAGIC: &[u8; 4] = b"k8s\0";

/// Creates `cm` in the namespace of `api`, the body in protobuf: as [`Api::create`].
pub(crate) async fn create(api: &Api<ConfigMap>, pp: &PostParams, cm: &ConfigMap) -> kube::Result<ConfigMap> {
    let request = Request::new(api.resource_url()).create(pp, encode(cm)).map_err(kube::Error::BuildRequest)?;
    send(api, request, "create").await
}

/// Replaces `name` with `cm`, the body in protobuf: as [`Api::replace`].
pub async fn replace(api: &Api<ConfigMap>, name: &str, pp: &PostParams, cm: &ConfigMap) -> kube::Result<ConfigMap> {
    let request = Request::new(api.resource_url()).replace(name, pp, encode(cm)).map_err(kube::Error::BuildRequest)?;
    send(api, request, "replace").await
}

/// Sends `request` with a protobuf body for a JSON answer; `verb` names it in kube's
/// trace spans, as [`Api`]'s own methods do.
async fn send(
    api: &Api<ConfigMap>,
    mut request: http::Request<Vec<u8>>,
    verb: &'static str,
) -> kube::Result<ConfigMap> {
    request.extensions_mut().insert(verb);
    let headers = request.headers_mut();
    headers.insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static(PROTOBUF));
    headers.insert(http::header::ACCEPT, http::HeaderValue::from_static("application/json"));
    // A client is a handle on shared connections: cloning it opens nothing.
    api.clone().into_client().request(request).await
}

/// `cm` as a protobuf body: the magic, then the fields of the `runtime.Unknown` (the
/// envelope itself has no length prefix).
pub(crate) fn encode(cm: &ConfigMap) -> Vec<u8> {
    let mut type_meta = Message::default();
    type_meta.string(1, "v1");
    type_meta.string(2, "ConfigMap");
    let raw = config_map(cm);
    let mut body = Message(Vec::with_capacity(MAGIC.len() + 32 + raw.0.len()));
    body.0.extend_from_slice(MAGIC);
    body.message(1, type_meta);
    body.bytes(2, &raw.0);
    body.0
}

fn config_map(cm: &ConfigMap) -> Message {
    let mut m = Message::default();
    m.message(1, object_meta(&cm.metadata));
    for (k, v) in cm.data.iter().flatten() {
        m.entry(2, k, v.as_bytes());
    }
    for (k, v) in cm.binary_data.iter().flatten() {
        m.entry(3, k, &v.0);
    }
    if let Some(immutable) = cm.immutable {
        m.varint_field(4, u64::from(immutable));
    }
    m
}

fn object_meta(meta: &ObjectMeta) -> Message {
    let mut m = Message::default();
    let strings = [
        (1, &meta.name),
        (2, &meta.generate_name),
        (3, &meta.namespace),
        (4, &meta.self_link),
        (5, &meta.uid),
        (6, &meta.resource_version),
    ];
    for (field, value) in strings {
        if let Some(s) = value {
            m.string(field, s);
        }
    }
    if let Some(generation) = meta.generation {
        m.varint_field(7, generation as u64);
    }
    if let Some(t) = &meta.creation_timestamp {
        m.message(8, time(t));
    }
    if let Some(t) = &meta.deletion_timestamp {
        m.message(9, time(t));
    }
    if let Some(seconds) = meta.deletion_grace_period_seconds {
        m.varint_field(10, seconds as u64);
    }
    for (k, v) in meta.labels.iter().flatten() {
        m.entry(11, k, v.as_bytes());
    }
    for (k, v) in meta.annotations.iter().flatten() {
        m.entry(12, k, v.as_bytes());
    }
    for owner in meta.owner_references.iter().flatten() {
        m.message(13, owner_reference(owner));
    }
    for finalizer in meta.finalizers.iter().flatten() {
        m.string(14, finalizer);
    }
    m
}

fn owner_reference(owner: &OwnerReference) -> Message {
    let mut m = Message::default();
    m.string(1, &owner.kind);
    m.string(3, &owner.name);
    m.string(4, &owner.uid);
    m.string(5, &owner.api_version);
    if let Some(controller) = owner.controller {
        m.varint_field(6, u64::from(controller));
    }
    if let Some(block) = owner.block_owner_deletion {
        m.varint_field(7, u64::from(block));
    }
    m
}

fn time(t: &Time) -> Message {
    let mut m = Message::default();
    m.varint_field(1, t.0.as_second() as u64);
    let nanos = t.0.subsec_nanosecond();
    if nanos != 0 {
        m.varint_field(2, nanos as u64);
    }
    m
}

/// One protobuf message being written. Negative integers go as their two's complement
/// (protobuf's `int64` and `int32`), ten bytes long. A nested message is written whole,
/// then copied in after its length; map entries are written in place, so the snapshot's
/// bytes are copied twice (into the ConfigMap, into the body), not once per level.
#[derive(Default)]
struct Message(Vec<u8>);

impl Message {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8 & 0x7f) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    fn varint_field(&mut self, field: u32, v: u64) {
        self.varint(u64::from(field) << 3);
        self.varint(v);
    }

    fn bytes(&mut self, field: u32, b: &[u8]) {
        self.varint(u64::from(field) << 3 | 2);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
    }

    fn string(&mut self, field: u32, s: &str) {
        self.bytes(field, s.as_bytes());
    }

    fn message(&mut self, field: u32, m: Message) {
        self.bytes(field, &m.0);
    }

    /// One entry of a `map<string, string>` or `map<string, bytes>` field, written in
    /// place: its length is that of its two fields, each a one-byte key, a length and the
    /// data.
    fn entry(&mut self, field: u32, key: &str, value: &[u8]) {
        let field_len = |n: usize| 1 + varint_len(n as u64) + n;
        self.varint(u64::from(field) << 3 | 2);
        self.varint((field_len(key.len()) + field_len(value.len())) as u64);
        self.string(1, key);
        self.bytes(2, value);
    }
}

/// The bytes of `v` as a varint.
fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use k8s_openapi::ByteString;
    use serde_json::{Value, json};
    use std::collections::BTreeMap;

    /// A field as read: a varint, or length-delimited bytes (no other wire types are
    /// written here).
    enum Field<'a> {
        Varint(u64),
        Bytes(&'a [u8]),
    }

    fn read_varint(b: &mut &[u8]) -> u64 {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (byte, rest) = b.split_first().expect("a varint cut short");
            *b = rest;
            v |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return v;
            }
        }
        panic!("a varint longer than ten bytes")
    }

    fn fields(mut b: &[u8]) -> Vec<(u64, Field<'_>)> {
        let mut out = Vec::new();
        while !b.is_empty() {
            let key = read_varint(&mut b);
            let field = match key & 7 {
                0 => Field::Varint(read_varint(&mut b)),
                2 => {
                    let len = read_varint(&mut b) as usize;
                    let (data, rest) = b.split_at(len);
                    b = rest;
                    Field::Bytes(data)
                }
                wire => panic!("wire type {wire} is never written"),
            };
            out.push((key >> 3, field));
        }
        out
    }

    fn bytes<'a>(f: &Field<'a>) -> &'a [u8] {
        match f {
            Field::Bytes(b) => b,
            Field::Varint(_) => panic!("a varint where bytes belong"),
        }
    }

    fn text(f: &Field<'_>) -> Value {
        json!(std::str::from_utf8(bytes(f)).expect("UTF-8"))
    }

    fn varint(f: &Field<'_>) -> u64 {
        match f {
            Field::Varint(v) => *v,
            Field::Bytes(_) => panic!("bytes where a varint belongs"),
        }
    }

    /// A map entry's key and value bytes.
    fn entry(f: &Field<'_>) -> (String, Vec<u8>) {
        let mut kv = (String::new(), Vec::new());
        for (n, f) in fields(bytes(f)) {
            match n {
                1 => kv.0 = String::from_utf8(bytes(&f).to_vec()).expect("UTF-8"),
                2 => kv.1 = bytes(&f).to_vec(),
                _ => panic!("map entry field {n}"),
            }
        }
        kv
    }

    fn time_json(f: &Field<'_>) -> Value {
        let (mut seconds, mut nanos) = (0, 0);
        for (n, f) in fields(bytes(f)) {
            match n {
                1 => seconds = varint(&f) as i64,
                2 => nanos = varint(&f) as i32,
                _ => panic!("Time field {n}"),
            }
        }
        json!(Time(k8s_openapi::jiff::Timestamp::new(seconds, nanos).expect("a time")))
    }

    fn owner_json(f: &Field<'_>) -> Value {
        let mut o = json!({});
        for (n, f) in fields(bytes(f)) {
            let (name, value) = match n {
                1 => ("kind", text(&f)),
                3 => ("name", text(&f)),
                4 => ("uid", text(&f)),
                5 => ("apiVersion", text(&f)),
                6 => ("controller", json!(varint(&f) != 0)),
                7 => ("blockOwnerDeletion", json!(varint(&f) != 0)),
                _ => panic!("OwnerReference field {n}"),
            };
            o[name] = value;
        }
        o
    }

    fn meta_json(b: &[u8]) -> Value {
        let mut m = json!({});
        for (n, f) in fields(b) {
            let name = match n {
                1 => "name",
                2 => "generateName",
                3 => "namespace",
                4 => "selfLink",
                5 => "uid",
                6 => "resourceVersion",
                7 => "generation",
                8 => "creationTimestamp",
                9 => "deletionTimestamp",
                10 => "deletionGracePeriodSeconds",
                11 => "labels",
                12 => "annotations",
                13 => "ownerReferences",
                14 => "finalizers",
                _ => panic!("ObjectMeta field {n}"),
            };
            match n {
                7 | 10 => m[name] = json!(varint(&f) as i64),
                8 | 9 => m[name] = time_json(&f),
                11 | 12 => {
                    let (k, v) = entry(&f);
                    m[name][k] = json!(String::from_utf8(v).expect("UTF-8"));
                }
                13 => push(&mut m[name], owner_json(&f)),
                14 => push(&mut m[name], text(&f)),
                _ => m[name] = text(&f),
            }
        }
        m
    }

    fn push(list: &mut Value, item: Value) {
        if list.is_null() {
            *list = json!([]);
        }
        list.as_array_mut().expect("a list").push(item);
    }

    /// A protobuf ConfigMap body as the JSON the same object has: what the API server reads
    /// from it. Panics on anything [`encode`] does not write.
    pub(crate) fn decoded(body: &[u8]) -> Value {
        let envelope = body.strip_prefix(MAGIC).expect("the protobuf magic");
        let mut cm = json!({});
        for (n, f) in fields(envelope) {
            match n {
                1 => {
                    for (n, f) in fields(bytes(&f)) {
                        cm[if n == 1 { "apiVersion" } else { "kind" }] = text(&f);
                    }
                }
                2 => {
                    for (n, f) in fields(bytes(&f)) {
                        match n {
                            1 => cm["metadata"] = meta_json(bytes(&f)),
                            2 => {
                                let (k, v) = entry(&f);
                                cm["data"][k] = json!(String::from_utf8(v).expect("UTF-8"));
                            }
                            3 => {
                                let (k, v) = entry(&f);
                                cm["binaryData"][k] = json!(ByteString(v));
                            }
                            4 => cm["immutable"] = json!(varint(&f) != 0),
                            _ => panic!("ConfigMap field {n}"),
                        }
                    }
                }
                _ => panic!("Unknown field {n} (encode writes no content type or encoding)"),
            }
        }
        cm
    }

    #[test]
    fn every_field_written_reads_back_as_the_same_config_map() {
        let at = |s| Some(Time(k8s_openapi::jiff::Timestamp::from_second(s).unwrap()));
        let owner = |controller| OwnerReference {
            api_version: "consulresolver.io/v1alpha1".into(),
            kind: "ConsulResolver".into(),
            name: "consul".into(),
            uid: "3f0c".into(),
            controller,
            block_owner_deletion: Some(true),
        };
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some("snapshot".into()),
                generate_name: Some("snap-".into()),
                namespace: Some("ops".into()),
                self_link: Some("/api/v1/namespaces/ops/configmaps/snapshot".into()),
                uid: Some("9d2e".into()),
                resource_version: Some("184467".into()),
                generation: Some(-3),
                creation_timestamp: at(1_700_000_000),
                deletion_timestamp: at(1_800_000_000),
                deletion_grace_period_seconds: Some(30),
                labels: Some(BTreeMap::from([("a".into(), "1".into()), ("b".into(), String::new())])),
                annotations: Some(BTreeMap::from([("note".into(), "ü ∞".into())])),
                owner_references: Some(vec![owner(Some(true)), owner(None)]),
                finalizers: Some(vec!["x/y".into(), "z".into()]),
                managed_fields: None,
            },
            data: Some(BTreeMap::from([("plain".into(), "{\"a\": 1}".into())])),
            binary_data: Some(BTreeMap::from([("gz".into(), ByteString((0..=255).collect()))])),
            immutable: Some(false),
        };
        let read: ConfigMap = serde_json::from_value(decoded(&encode(&cm))).unwrap();
        assert_eq!(read, cm);
        let bare = ConfigMap {
            metadata: ObjectMeta { name: Some("s".into()), ..ObjectMeta::default() },
            ..ConfigMap::default()
        };
        assert_eq!(serde_json::from_value::<ConfigMap>(decoded(&encode(&bare))).unwrap(), bare);
    }

    #[test]
    fn varints_are_little_endian_groups_of_seven_bits() {
        let mut m = Message::default();
        for v in [0, 1, 127, 128, 300, u64::MAX] {
            let before = m.0.len();
            m.varint(v);
            assert_eq!(m.0.len() - before, varint_len(v), "{v}");
        }
        let expected: &[u8] = &[0, 1, 127, 0x80, 1, 0xac, 2, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 1];
        assert_eq!(m.0, expected);
    }

    /// The bytes protoc writes for this ConfigMap (fields in number order, map entries in
    /// key order), worked out by hand from the .proto field numbers.
    #[test]
    fn a_config_map_is_the_magic_then_an_unknown_holding_its_fields() {
        let cm = ConfigMap {
            metadata: ObjectMeta {
                name: Some("s".into()),
                namespace: Some("n".into()),
                resource_version: Some("7".into()),
                labels: Some(BTreeMap::from([("a".into(), "b".into())])),
                ..ObjectMeta::default()
            },
            binary_data: Some(BTreeMap::from([("k".into(), ByteString(vec![0, 255]))])),
            immutable: Some(true),
            ..ConfigMap::default()
        };
        let meta: &[u8] = &[
            0x0a, 1, b's', // name = 1
            0x1a, 1, b'n', // namespace = 3
            0x32, 1, b'7', // resourceVersion = 6
            0x5a, 6, 0x0a, 1, b'a', 0x12, 1, b'b', // labels = 11 {a: b}
        ];
        let mut raw = vec![0x0a, meta.len() as u8];
        raw.extend_from_slice(meta);
        raw.extend_from_slice(&[0x1a, 7, 0x0a, 1, b'k', 0x12, 2, 0, 255]); // binaryData = 3 {k: 00ff}
        raw.extend_from_slice(&[0x20, 1]); // immutable = 4
        let mut expected = b"k8s\0".to_vec();
        expected.extend_from_slice(&[0x0a, 15, 0x0a, 2, b'v', b'1', 0x12, 9]); // typeMeta = 1
        expected.extend_from_slice(b"ConfigMap");
        expected.extend_from_slice(&[0x12, raw.len() as u8]); // raw = 2
        expected.extend_from_slice(&raw);
        assert_eq!(encode(&cm), expected);
    }

    #[test]
    fn times_are_seconds_and_nanoseconds_and_negatives_two_s_complement() {
        let t = Time(k8s_openapi::jiff::Timestamp::new(1_700_000_000, 5).unwrap());
        assert_eq!(time(&t).0, [0x08, 0x80, 0xe2, 0xcf, 0xaa, 0x06, 0x10, 5]);
        let mut m = Message::default();
        m.varint_field(10, -1i64 as u64);
        assert_eq!(m.0, [0x50, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 1]);
    }
}
