//! Writing a content as the pieces of its canonical JSON: serde's bytes exactly, but each
//! [`Part`]'s JSON is a piece of its own, shared with the part (and with every other
//! snapshot that holds it), never copied into one buffer. At 55 MB, serialising the whole
//! document and hashing it on every change was the largest cost of a publication
//! (docs/benchmarks.md).
//!
//! The content is written without its opening `{`: the document's header takes its place
//! (see [`super::snapshot::Snapshot`]).

use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use serde::Serialize;

use super::segment::{self, Segmenter};
use super::snapshot::{Content, Part, Parts, ResolverEntry, ServiceEntry};

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

impl Content {
    /// Makes the JSON of the long lists' parts on every core the process may use, before a
    /// document that has no earlier one to reuse writes them one by one. The first
    /// document at a cold start writes every part (116 MB at the doubled scale profile,
    /// docs/benchmarks.md), after the last list, when the API server has gone quiet and a
    /// core would otherwise sit idle.
    pub(crate) fn write_ahead(&self) {
        self.write_ahead_on(std::thread::available_parallelism().map_or(1, std::num::NonZero::get));
    }

    /// [`Content::write_ahead`] on `workers` threads, this one among them.
    fn write_ahead_on(&self, workers: usize) {
        let mut services: Vec<&Parts<ServiceEntry>> = Vec::new();
        for r in &self.resolvers {
            // Resolvers that follow the same services share the list.
            if !services.iter().any(|s| Parts::ptr_eq(s, &r.services)) {
                services.push(&r.services);
            }
        }
        let parts = services.iter().map(|s| s.len()).sum::<usize>()
            + self.mappings.len()
            + self.kubernetes_services.len()
            + self.exports.len();
        if workers < 2 || parts < AHEAD_FROM {
            return;
        }
        // Slices of each list, taken in turn by the workers as each finishes one.
        let mut jobs: Vec<Slice<'_>> = services.into_iter().flat_map(|s| slices(s)).collect();
        jobs.extend(slices(&self.mappings));
        jobs.extend(slices(&self.kubernetes_services));
        jobs.extend(slices(&self.exports));
        let next = AtomicUsize::new(0);
        let work = || {
            while let Some(write) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                write();
            }
        };
        std::thread::scope(|s| {
            for _ in 1..workers {
                s.spawn(work);
            }
            work();
        });
    }
}

/// Lists of fewer parts in all are written one by one: a thread costs more than it saves.
const AHEAD_FROM: usize = 4_096;

/// Parts a worker takes at a time.
const AHEAD_SLICE: usize = 512;

/// Makes the JSON of a slice of parts, of any type.
type Slice<'a> = Box<dyn Fn() + Sync + 'a>;

/// `parts` in slices of [`AHEAD_SLICE`].
fn slices<T: Serialize + Send + Sync>(parts: &[Part<T>]) -> impl Iterator<Item = Slice<'_>> {
    parts.chunks(AHEAD_SLICE).map(|slice| Box::new(move || slice.iter().for_each(|p| drop(p.json()))) as Slice<'_>)
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

#[cfg(test)]
mod tests {
    use super::super::snapshot::tests::rich;

    #[test]
    fn a_first_document_has_its_long_lists_written_ahead_by_every_worker() {
        let content = rich(2_000);
        content.write_ahead_on(2);
        let services = content.resolvers.iter().flat_map(|r| r.services.iter().map(|p| p.has_json()));
        let mappings = content.mappings.iter().map(|p| p.has_json());
        assert!(services.chain(mappings).all(|written| written));
        // The resolvers' entries themselves are written with the document.
        assert!(!content.resolvers[0].has_json());
        // A small content is written as the document goes.
        let small = rich(100);
        small.write_ahead_on(2);
        assert!(!small.mappings[0].has_json());
        // One worker writes as the document goes.
        let one = rich(2_000);
        one.write_ahead_on(1);
        assert!(!one.mappings[0].has_json());
    }
}
