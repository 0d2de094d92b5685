//! Writing a content as the pieces of its canonical JSON: serde's bytes exactly, but each
//! [`Part`]'s JSON is a piece of its own, shared with the part (and with every other
//! snapshot that holds it), never copied into one buffer. At 55 MB, serialising the whole
//! document and hashing it on every change was the largest cost of a publication
//! (docs/benchmarks.md).
//!
//! The content is written without its opening `{`: the document's header takes its place
//! (see [`super::snapshot::Snapshot`]).

use bytes::Bytes;
use serde::Serialize;

use super::segment::{self, Segmenter};
use super::snapshot::{Content, Part, Parts, ResolverEntry};

impl Content {
    /// Writes the content's JSON, from its first field on, into `w`: array elements that
    /// are parts as elements a segment may end after.
    pub(crate) fn write(&self, w: &mut Segmenter<'_>) {
        // Every field, so that a new one cannot be forgotten here; the order and names
        // are serde's (the unit tests compare with it).
        let Content { bootstrap, resolvers, mappings, kubernetes_services, watched, problems, exports } = self;
        w.literal(b"\"bootstrap\":");
        w.bytes(to_json(bootstrap));
        w.literal(b",\"resolvers\":[");
        separated(resolvers, w, |r, w| write_resolver(r, w));
        w.literal(b"]");
        list(w, b",\"mappings\":", mappings, |m| identity(&[&m.namespace, &m.name]));
        list(w, b",\"kubernetesServices\":", kubernetes_services, |k| identity(&[&k.namespace, &k.name]));
        if !watched.is_empty() {
            w.literal(b",\"watched\":");
            w.bytes(to_json(watched));
        }
        // Problems are not parts (they are made again with each content), but there can be
        // many: each is an element a segment may end after.
        w.literal(b",\"problems\":[");
        separated(problems, w, |p, w| {
            let json = to_json(p);
            let hash = segment::hash(&json);
            w.element(json, hash, identity(&[&p.kind, &p.namespace, &p.name]));
        });
        w.literal(b"]");
        if !exports.is_empty() {
            w.literal(b",\"exports\":");
            in_line(w, &[b"["], exports, |e| identity(&[&e.namespace, &e.name]));
            w.literal(b"]");
        }
        w.literal(b"}");
    }
}

/// A resolver's entry: its fields as serde writes them, then its services as elements.
fn write_resolver(r: &ResolverEntry, w: &mut Segmenter<'_>) {
    let ResolverEntry { namespace, name, generation, address, datacenter, unusable, services } = r;
    // The entry without its services: serde writes `services` last, as `[]}`.
    let head = to_json(&ResolverEntry {
        namespace: namespace.clone(),
        name: name.clone(),
        generation: *generation,
        address: address.clone(),
        datacenter: datacenter.clone(),
        unusable: unusable.clone(),
        services: Parts::default(),
    });
    const EMPTY: &[u8] = b"\"services\":[]}";
    // Fixed by the derive's field order; the unit tests compare every document with serde's.
    debug_assert!(head.ends_with(EMPTY), "serde writes a resolver entry's services last");
    w.bytes(head.slice(..head.len() - 2));
    // Resolvers that follow the same services share the list: it is written once.
    parts_of(w, &[], services, |s| identity(&[&s.name]));
    w.literal(b"]}");
}

/// Lists of at least this many elements are runs of segments of their own
/// ([`Segmenter::run`]): taken whole while the list is unchanged, and around the changed
/// elements when a few are new. Shorter ones are written in line: a run starts a segment,
/// and every segment is at least one ConfigMap part of its own, so a short list does not
/// cut the document more finely.
const RUN_FROM: usize = 1_000;

/// `field` and the list of `parts` (`[`, the parts' JSON, `]`); `identity` says what each
/// part is about.
fn list<T: Serialize + Send + Sync + 'static>(
    w: &mut Segmenter<'_>,
    field: &'static [u8],
    parts: &Parts<T>,
    identity: impl Fn(&T) -> u64,
) {
    parts_of(w, &[field, b"["], parts, identity);
    w.literal(b"]");
}

/// `head`, then the parts' JSON, comma-separated: a run when the list is long, else in
/// line. `identity` says what each part is about.
fn parts_of<T: Serialize + Send + Sync + 'static>(
    w: &mut Segmenter<'_>,
    head: &[&'static [u8]],
    parts: &Parts<T>,
    identity: impl Fn(&T) -> u64,
) {
    if parts.len() < RUN_FROM {
        in_line(w, head, parts, identity);
    } else {
        w.run(parts.shared(), head, || addresses(parts), |w, i| part(w, &parts[i], &identity));
    }
}

/// `head`, then the parts' JSON, comma-separated, in line.
fn in_line<T: Serialize>(
    w: &mut Segmenter<'_>,
    head: &[&'static [u8]],
    parts: &[Part<T>],
    identity: impl Fn(&T) -> u64,
) {
    head.iter().for_each(|h| w.literal(h));
    separated(parts, w, |p, w| part(w, p, &identity));
}

/// One part's JSON, an element about what `identity` says.
fn part<T: Serialize>(w: &mut Segmenter<'_>, p: &Part<T>, identity: impl Fn(&T) -> u64) {
    let (json, hash) = p.json();
    w.element(json, hash, identity(p));
}

/// Which parts a list holds, for [`Segmenter::run`] to tell lists apart by.
fn addresses<T>(parts: &Parts<T>) -> Vec<usize> {
    parts.iter().map(Part::address).collect()
}

/// Each of `items` written by `write`, with commas between.
fn separated<T>(items: &[T], w: &mut Segmenter<'_>, mut write: impl FnMut(&T, &mut Segmenter<'_>)) {
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            w.literal(b",");
        }
        write(item, w);
    }
}

/// A hash of the names an element is about (see [`Segmenter::element`]).
fn identity(names: &[&str]) -> u64 {
    names
        .iter()
        .fold(0u64, |h, n| (h.rotate_left(17) ^ segment::hash(n.as_bytes())).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// The JSON of `value`, without slack: segments keep it as long as they are reused.
fn to_json<T: Serialize + ?Sized>(value: &T) -> Bytes {
    Bytes::from(serde_json::to_vec(value).expect("snapshot content always serialises").into_boxed_slice())
}
