//! The snapshot document cut into segments where its content says (docs/snapshot.md,
//! "Segments"), so that what did not change between two snapshots costs nothing again:
//! neither its bytes (a segment is the pieces it was written from, mostly parts' kept JSON,
//! shared, never copied into one buffer), nor its digest (the content hash is a digest of
//! the segments' digests), nor its deflated body (made once, by the first publisher that
//! gzips, and shared by every snapshot that holds the segment).
//!
//! Cuts fall after whole array elements (a service's, a Mapping's, a Kubernetes Service's
//! or an export's entry), where a hash of the element's identity (its name) says so, not
//! at positions: a change to one service changes the segment holding it, and the cuts
//! around it stay where they were. A [`Cutter`] remembers the previous document's segments and reuses one whose
//! bytes are those of the new one: recognised by being made of the very same pieces (a
//! pointer compare per piece) or, failing that, compared byte for byte, never trusted on a
//! hash.
//!
//! Pure computation: no I/O.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use sha2::{Digest, Sha256};

use super::gzip::{self, Deflated};

/// Segments are at least this long (but for the document's end) ...
const MIN_SEGMENT: usize = 256 * 1024;
/// ... about this much longer on average (an element ends its segment, once the segment is
/// past the minimum, with probability `element length / AVG_SEGMENT`) ...
const AVG_SEGMENT: u64 = 1024 * 1024;
/// ... and cut at this length whatever their content, so that a document without element
/// boundaries still is. At the compression gzip's fastest level reaches on snapshots
/// (about 15x), a segment deflates to about 85 KB on average: a change to one service
/// rewrites that much (in each copy of the service), and a 55 MB snapshot is 40 to 60 of them.
const MAX_SEGMENT: usize = 4 * 1024 * 1024;
/// Pieces longer than this are also cut inside (see [`Segmenter::push_large`]).
const INNER_CUTS_FROM: usize = 64 * 1024;

/// A run of the document's bytes, as the pieces it was written from, with what is computed
/// of it once: its sha256 and, on demand, its deflated body.
pub struct Segment {
    pieces: Box<[Bytes]>,
    len: usize,
    /// What a [`Cutter`] files it under: a hash of its pieces' hashes.
    key: u64,
    sha256: [u8; 32],
    deflated: OnceLock<Deflated>,
}

impl Segment {
    fn new(pieces: Vec<Bytes>, len: usize, key: u64) -> Segment {
        let mut sha = Sha256::new();
        for p in &pieces {
            sha.update(p);
        }
        Segment {
            pieces: pieces.into_boxed_slice(),
            len,
            key,
            sha256: sha.finalize().into(),
            deflated: OnceLock::new(),
        }
    }

    /// The bytes, in order.
    pub fn pieces(&self) -> &[Bytes] {
        &self.pieces
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Deflated alone (see [`gzip`]), the first time anyone asks.
    pub fn deflated(&self) -> &Deflated {
        self.deflated.get_or_init(|| gzip::deflate(&self.pieces))
    }

    /// Whether `pieces` are this segment's very pieces (the same bytes in memory).
    fn is(&self, pieces: &[Bytes], len: usize) -> bool {
        len == self.len
            && self.pieces.len() == pieces.len()
            && self.pieces.iter().zip(pieces).all(|(a, b)| a.len() == b.len() && a.as_ptr() == b.as_ptr())
    }

    /// Whether `pieces` (of `len` bytes in all) are this segment's bytes: the same pieces,
    /// or, where one is not, equal bytes.
    fn holds(&self, pieces: &[Bytes], len: usize) -> bool {
        if len != self.len {
            return false;
        }
        let aligned =
            self.pieces.len() == pieces.len() && self.pieces.iter().zip(pieces).all(|(a, b)| a.len() == b.len());
        if aligned {
            // The usual case: the same parts (a pointer compare each), or equal entries of
            // two resolvers that follow the same service.
            self.pieces.iter().zip(pieces).all(|(a, b)| a.as_ptr() == b.as_ptr() || a == b)
        } else {
            self.pieces.iter().flat_map(|p| p.iter()).eq(pieces.iter().flat_map(|p| p.iter()))
        }
    }
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment").field("len", &self.len).field("pieces", &self.pieces.len()).finish()
    }
}

/// A content cut into segments, and its hash.
#[derive(Debug, Clone)]
pub struct Cut {
    pub segments: Arc<[Arc<Segment>]>,
    /// `sha256:` and the hex digest of the segments' digests, in order (docs/snapshot.md).
    pub hash: String,
    /// Bytes in all.
    pub len: usize,
}

/// Segments by key, for reuse.
type Index = HashMap<u64, Vec<Arc<Segment>>>;

/// The segments written from one shared list ([`Segmenter::run`]), and the list, held so
/// that no other list takes its address while the run is remembered (nor any of its
/// elements theirs: `elements` are compared by address).
#[derive(Clone)]
struct Run {
    list: Arc<dyn Any + Send + Sync>,
    /// Its elements' addresses, in order.
    elements: Arc<[usize]>,
    segments: Arc<[Arc<Segment>]>,
    /// Where a segment of the run starts right before an element (before its comma): the
    /// element's index and the segment's, in order. The first is always `(0, 0)`.
    starts: Arc<[(usize, usize)]>,
    /// The run's last segment, not ended: what follows the list continues it.
    open: Open,
}

/// A segment under way: its pieces so far, their length and its key so far.
#[derive(Clone)]
struct Open {
    pieces: Arc<[Bytes]>,
    len: usize,
    key: u64,
}

impl Run {
    fn of(&self, list: &Arc<dyn Any + Send + Sync>) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.list), Arc::as_ptr(list))
    }

    /// The elements of `elements` that are not this run's, by index, if the two lists are
    /// as long and differ in at most `limit` places.
    fn differences(&self, elements: &[usize], limit: usize) -> Option<Vec<usize>> {
        if self.elements.len() != elements.len() {
            return None;
        }
        let mut out = Vec::new();
        for (i, (a, b)) in self.elements.iter().zip(elements).enumerate() {
            if a != b {
                if out.len() == limit {
                    return None;
                }
                out.push(i);
            }
        }
        Some(out)
    }

    /// The last start at or before element `i`.
    fn start_before(&self, i: usize) -> (usize, usize) {
        let at = self.starts.partition_point(|&(e, _)| e <= i);
        self.starts[at - 1]
    }

    /// The segment that starts right before element `i`, if one does.
    fn segment_at(&self, i: usize) -> Option<usize> {
        self.starts.binary_search_by_key(&i, |&(e, _)| e).ok().map(|at| self.starts[at].1)
    }
}

/// Cuts documents one after the other, reusing the previous one's segments where the bytes
/// are the same.
#[derive(Default)]
pub struct Cutter {
    previous: Index,
    /// The previous document's runs.
    runs: Vec<Run>,
}

impl Cutter {
    /// Whether no document has been cut yet: the next one reuses nothing.
    pub(crate) fn is_first(&self) -> bool {
        self.previous.is_empty()
    }

    /// What `write` writes, cut into segments.
    pub fn cut(&mut self, write: impl FnOnce(&mut Segmenter<'_>)) -> Cut {
        let mut segmenter = Segmenter {
            previous: &self.previous,
            previous_runs: &self.runs,
            made: Index::new(),
            pieces: Vec::new(),
            len: 0,
            key: 0,
            segments: Vec::new(),
            runs: Vec::new(),
        };
        write(&mut segmenter);
        segmenter.end();
        let Segmenter { segments, made, runs, .. } = segmenter;
        self.runs = runs;
        let mut digests = Sha256::new();
        let mut len = 0;
        for s in &segments {
            digests.update(s.sha256);
            len += s.len;
        }
        // The next document is compared with this one: every segment it holds, once.
        let mut next = made;
        for s in &segments {
            let candidates = next.entry(s.key).or_default();
            if !candidates.iter().any(|c| Arc::ptr_eq(c, s)) {
                candidates.push(s.clone());
            }
        }
        self.previous = next;
        Cut { segments: segments.into(), hash: format!("sha256:{}", hex::encode(digests.finalize())), len }
    }
}

/// Receives a document's bytes in order and cuts them into segments.
pub struct Segmenter<'a> {
    previous: &'a Index,
    previous_runs: &'a [Run],
    /// The segments made new in this document, so that equal ones (the same service changed
    /// in every resolver that follows it) are digested and deflated once.
    made: Index,
    pieces: Vec<Bytes>,
    len: usize,
    key: u64,
    segments: Vec<Arc<Segment>>,
    runs: Vec<Run>,
}

impl<'a> Segmenter<'a> {
    /// A list written as a run of segments of its own, filed under `list` (the shared list
    /// it writes, [`super::snapshot::Parts`]): `head`, then its elements, comma-separated
    /// (`addresses` says which parts they are, `element` writes the `i`th).
    ///
    /// When this document or the previous one wrote the very same list, its segments are
    /// taken whole and nothing is written: an unchanged list of 100,000 Mappings costs one
    /// pointer compare instead of a visit of each, and five resolvers that follow the same
    /// services write them once. When the previous document wrote a list as long that
    /// differs in a few elements (a Consul change: one service's entry is new), its
    /// segments are taken up to the one that holds the first new element, the list is
    /// written from there, and once past the last new element, its segments are taken again
    /// from the first cut that falls where one fell before: from there on, the same
    /// elements from the same state make the same segments. A change then costs a segment
    /// or two of the list, not a visit of its 10,000 elements, each a cache miss or two.
    ///
    /// The run's last segment is left open, so what follows continues it (no short segment
    /// after each list). The segments are those a fresh cutter makes (each run starts a
    /// segment), so the hash does not depend on history.
    pub fn run(
        &mut self,
        list: Arc<dyn Any + Send + Sync>,
        head: &[&'static [u8]],
        addresses: impl FnOnce() -> Vec<usize>,
        element: impl FnMut(&mut Self, usize),
    ) {
        self.end();
        if let Some(r) = self.previous_runs.iter().chain(&self.runs).find(|r| r.of(&list)) {
            let r = Run { list, ..r.clone() };
            self.segments.extend(r.segments.iter().cloned());
            self.resume(&r.open);
            self.runs.push(r);
            return;
        }
        let elements: Arc<[usize]> = addresses().into();
        let first = self.segments.len();
        let (starts, open) = self.write_run(&elements, head, element);
        let segments: Arc<[Arc<Segment>]> = self.segments[first..].into();
        self.runs.push(Run { list, elements, segments, starts: starts.into(), open });
    }

    /// The previous document's run of a list as long as `elements` that differs from it in
    /// the fewest places (a few at most), and those places.
    fn base(&self, elements: &[usize]) -> Option<(&'a Run, Vec<usize>)> {
        let limit = 16 + elements.len() / 64;
        let runs = self.previous_runs.iter();
        runs.filter_map(|r| Some((r, r.differences(elements, limit)?))).min_by_key(|(_, d)| d.len())
    }

    /// Writes the run of `elements` (see [`Segmenter::run`]), from a base's segments where
    /// it can; returns where its segments start and its open segment.
    fn write_run(
        &mut self,
        elements: &[usize],
        head: &[&'static [u8]],
        mut element: impl FnMut(&mut Self, usize),
    ) -> (Vec<(usize, usize)>, Open) {
        let first = self.segments.len();
        let mut starts = Vec::new();
        // From the base's last start before its first new element (its segments before
        // that taken), or from the top; the rest of it taken again once past its last.
        let (from, resync) = match self.base(elements) {
            Some((r, new)) => match (new.first(), new.last()) {
                (Some(&new_first), last) => {
                    let (i, k) = r.start_before(new_first);
                    self.segments.extend(r.segments[..k].iter().cloned());
                    starts.extend(r.starts.iter().copied().take_while(|&(e, _)| e < i));
                    (i, Some((r, last.copied())))
                }
                (None, _) => (0, Some((r, None))),
            },
            None => (0, None),
        };
        for i in from..elements.len() {
            if self.pieces.is_empty() {
                let k = self.segments.len() - first;
                let past = |&(_, last): &(&Run, Option<usize>)| last.is_none_or(|last| i > last);
                if let Some((r, _)) = resync.filter(past)
                    && let Some(at) = r.segment_at(i)
                {
                    self.segments.extend(r.segments[at..].iter().cloned());
                    starts.extend(r.starts.iter().filter(|&&(e, _)| e >= i).map(|&(e, s)| (e, s - at + k)));
                    self.resume(&r.open);
                    return (starts, r.open.clone());
                }
                starts.push((i, k));
            }
            if i == 0 {
                head.iter().for_each(|h| self.literal(h));
            } else {
                self.literal(b",");
            }
            element(self, i);
        }
        if elements.is_empty() {
            starts.push((0, 0));
            head.iter().for_each(|h| self.literal(h));
        }
        (starts, Open { pieces: self.pieces.as_slice().into(), len: self.len, key: self.key })
    }

    /// Continues the open segment a run left.
    fn resume(&mut self, open: &Open) {
        self.pieces.extend(open.pieces.iter().cloned());
        (self.len, self.key) = (open.len, open.key);
    }

    /// Bytes that no cut may follow.
    pub fn bytes(&mut self, bytes: Bytes) {
        let h = hash(&bytes);
        self.push(bytes, h);
    }

    /// Literal bytes (punctuation, field names).
    pub fn literal(&mut self, bytes: &'static [u8]) {
        self.bytes(Bytes::from_static(bytes));
    }

    /// A whole array element, `hash` being [`hash`] of its bytes, after which the segment
    /// may end. Whether it does is decided by `identity`, a hash of what the element is
    /// about (a service's name, a Mapping's namespace and name), not of its bytes: a change
    /// to a service's endpoints then never moves a cut, and changes only its own segment.
    pub fn element(&mut self, bytes: Bytes, hash: u64, identity: u64) {
        let len = bytes.len();
        self.push(bytes, hash);
        if self.len >= MIN_SEGMENT && identity % AVG_SEGMENT < len as u64 {
            self.end();
        }
    }

    fn push(&mut self, bytes: Bytes, hash: u64) {
        if bytes.len() > INNER_CUTS_FROM {
            return self.push_large(bytes);
        }
        // Past the maximum: cut before the piece (between elements, or before one).
        if self.len + bytes.len() > MAX_SEGMENT {
            self.end();
        }
        self.add(bytes, hash);
    }

    /// A piece that may hold segments of its own (a service of thousands of instances, a
    /// long list of problems): cut inside it too, between its own array elements (`},{`),
    /// by the same rule, with the element's bytes for its identity.
    fn push_large(&mut self, bytes: Bytes) {
        let (mut start, mut element) = (0, 0);
        for at in memchr::memmem::find_iter(&bytes, b"},{") {
            // After the `,`: the next element starts the next segment.
            let end = at + 2;
            let this = element..end;
            element = end;
            let len = self.len + (end - start);
            if len >= MAX_SEGMENT
                || (len >= MIN_SEGMENT && hash(&bytes[this.clone()]) % AVG_SEGMENT < this.len() as u64)
            {
                self.add_bounded(bytes.slice(start..end));
                self.end();
                start = end;
            }
        }
        self.add_bounded(bytes.slice(start..));
    }

    /// Adds `bytes`, ending the segment wherever it reaches the maximum.
    fn add_bounded(&mut self, mut bytes: Bytes) {
        while self.len + bytes.len() > MAX_SEGMENT {
            let rest = bytes.split_off(MAX_SEGMENT - self.len);
            let h = hash(&bytes);
            self.add(bytes, h);
            self.end();
            bytes = rest;
        }
        let h = hash(&bytes);
        self.add(bytes, h);
    }

    fn add(&mut self, bytes: Bytes, hash: u64) {
        if bytes.is_empty() {
            return;
        }
        self.len += bytes.len();
        self.key = (self.key.rotate_left(5) ^ hash ^ bytes.len() as u64).wrapping_mul(0x517c_c1b7_2722_0a95);
        self.pieces.push(bytes);
    }

    /// Ends the segment under way, if any.
    fn end(&mut self) {
        if self.pieces.is_empty() {
            return;
        }
        let (pieces, len, key) =
            (std::mem::take(&mut self.pieces), std::mem::take(&mut self.len), std::mem::take(&mut self.key));
        let candidates = || [self.previous.get(&key), self.made.get(&key)].into_iter().flatten().flatten();
        // The very same pieces first (a resolver's unchanged run of services), then equal
        // bytes (another resolver's equal run): comparing bytes first would compare every
        // resolver's run with the first one's, tens of megabytes per publication.
        let found =
            candidates().find(|s| s.is(&pieces, len)).or_else(|| candidates().find(|s| s.holds(&pieces, len))).cloned();
        let segment = found.unwrap_or_else(|| {
            let s = Arc::new(Segment::new(pieces, len, key));
            self.made.entry(key).or_default().push(s.clone());
            s
        });
        self.segments.push(segment);
    }
}

/// A fast, non-cryptographic hash (word-wise multiply-rotate, then a murmur3 finaliser):
/// it only chooses cuts and files segments, both verified or harmless when they collide.
pub(crate) fn hash(bytes: &[u8]) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let mut h = bytes.len() as u64;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        h = (h.rotate_left(5) ^ u64::from_le_bytes(w.try_into().expect("8 bytes"))).wrapping_mul(K);
    }
    for &b in words.remainder() {
        h = (h.rotate_left(5) ^ u64::from(b)).wrapping_mul(K);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` elements of about 250 bytes, element `changed` (if any) with another port, in a
    /// document written the way [`super::super::write`] does.
    fn elements(n: usize, changed: Option<usize>) -> Vec<Bytes> {
        (0..n)
            .map(|i| {
                let port = if Some(i) == changed { 9999 } else { 8080 };
                Bytes::from(format!(
                    r#"{{"address":"10.{}.{}.{}","port":{port},"node":"node-{}","serviceId":"web-{i}","tags":["v1"],"meta":{{"build":"{:016x}"}},"health":"passing"}}"#,
                    i / 65536 % 256,
                    i / 256 % 256,
                    i % 256,
                    i % 97,
                    hash(&i.to_le_bytes())
                ))
            })
            .collect()
    }

    fn write(w: &mut Segmenter<'_>, elements: &[Bytes]) {
        w.literal(b"\"items\":[");
        for (i, e) in elements.iter().enumerate() {
            if i > 0 {
                w.literal(b",");
            }
            w.element(e.clone(), hash(e), hash(&i.to_le_bytes()));
        }
        w.literal(b"]}");
    }

    fn bytes(cut: &Cut) -> Vec<u8> {
        cut.segments.iter().flat_map(|s| s.pieces()).flat_map(|p| p.iter().copied()).collect()
    }

    fn shared(a: &Cut, b: &Cut) -> usize {
        b.segments.iter().filter(|s| a.segments.iter().any(|t| Arc::ptr_eq(s, t))).count()
    }

    #[test]
    fn segments_cover_the_document_and_end_after_elements_within_their_bounds() {
        let items = elements(40_000, None);
        let cut = Cutter::default().cut(|w| write(w, &items));
        let expected = joined(b"\"items\":[", &items, b"]}");
        assert_eq!(bytes(&cut), expected);
        assert_eq!(cut.len, expected.len());
        assert!(cut.segments.len() > 2, "{} segments of {} bytes", cut.segments.len(), cut.len);
        for s in &cut.segments[..cut.segments.len() - 1] {
            assert!((MIN_SEGMENT..=MAX_SEGMENT).contains(&s.len()), "{s:?}");
            let last = s.pieces().last().unwrap().last();
            assert!(last == Some(&b'}') || last == Some(&b','), "ends after an element or before one: {last:?}");
        }
        // A piece past the maximum (no element boundary) is cut at it.
        let big = Bytes::from(vec![b'a'; 2 * MAX_SEGMENT + 5]);
        let cut = Cutter::default().cut(|w| {
            w.literal(b"[");
            w.bytes(big.clone());
        });
        let lens: Vec<usize> = cut.segments.iter().map(|s| s.len()).collect();
        assert_eq!(lens, [MAX_SEGMENT, MAX_SEGMENT, 6], "cut at the maximum");
        assert_eq!(bytes(&cut)[1..], big);
    }

    #[test]
    fn a_change_makes_only_its_own_segment_again_and_shares_the_rest() {
        let mut cutter = Cutter::default();
        let before = elements(40_000, None);
        let first = cutter.cut(|w| write(w, &before));
        // One element changes its length, which moves every byte after it; the others are
        // the same pieces (as a part's kept JSON is).
        let mut after = before.clone();
        after[20_000] = elements(20_001, Some(20_000)).pop().unwrap();
        let second = cutter.cut(|w| write(w, &after));
        let n = second.segments.len();
        assert_eq!(n, first.segments.len(), "the same cuts around the change");
        assert_eq!(shared(&first, &second), n - 1, "all but the changed segment, shared");
        assert_ne!(first.hash, second.hash);
        // The same document again: every segment shared, the same hash.
        let again = cutter.cut(|w| write(w, &after));
        assert_eq!(shared(&second, &again), n);
        assert_eq!(again.hash, second.hash);
        // Equal bytes in other pieces (another resolver's equal entries) are the same
        // segments too, compared byte for byte.
        let copies: Vec<Bytes> = after.iter().map(|e| Bytes::copy_from_slice(e)).collect();
        let copied = cutter.cut(|w| write(w, &copies));
        assert_eq!(shared(&again, &copied), n);
        // A fresh cutter agrees on the hash: it is the content's, not the history's.
        assert_eq!(Cutter::default().cut(|w| write(w, &after)).hash, second.hash);
    }

    /// A document of a head, `list` as a run, and a tail, as [`super::super::write`] writes
    /// one; counts the elements written.
    fn with_run(w: &mut Segmenter<'_>, list: &Arc<Vec<Bytes>>, writes: &mut usize) {
        w.literal(b"\"head\":1,");
        let addresses = || list.iter().map(|e| e.as_ptr() as usize).collect();
        w.run(list.clone(), &[b"\"items\":["], addresses, |w, i| {
            *writes += 1;
            w.element(list[i].clone(), hash(&list[i]), hash(&i.to_le_bytes()));
        });
        w.literal(b"]}");
        w.literal(b",\"tail\":2}");
    }

    /// The same document, written element by element without a run.
    fn without_run(list: &[Bytes]) -> Vec<u8> {
        joined(b"\"head\":1,\"items\":[", list, b"]},\"tail\":2}")
    }

    /// `head`, the elements comma-separated, `tail`: a document's bytes, written out.
    fn joined(head: &[u8], elements: &[Bytes], tail: &[u8]) -> Vec<u8> {
        let mut out = head.to_vec();
        for (i, e) in elements.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(e);
        }
        out.extend_from_slice(tail);
        out
    }

    #[test]
    fn an_unchanged_run_is_taken_whole_and_cut_as_a_fresh_cutter_cuts_it() {
        let items = Arc::new(elements(40_000, None));
        let mut cutter = Cutter::default();
        let mut writes = 0;
        let first = cutter.cut(|w| with_run(w, &items, &mut writes));
        assert_eq!(bytes(&first), without_run(&items));
        let second = cutter.cut(|w| with_run(w, &items, &mut writes));
        assert_eq!(writes, 40_000, "the very same list is not written again");
        assert_eq!(shared(&first, &second), second.segments.len());
        assert_eq!(second.hash, first.hash);
        // A run starts a segment; what follows it continues its last one.
        let head = second.segments.first().unwrap();
        assert_eq!(head.pieces().concat(), b"\"head\":1,");
        let last = second.segments.last().unwrap().pieces().concat();
        assert!(last.len() > 20 && last.ends_with(b"]},\"tail\":2}"), "{}", last.len());
        // A fresh cutter writes it, and agrees on every byte and on the hash.
        let fresh = Cutter::default().cut(|w| with_run(w, &items, &mut writes));
        assert_eq!((writes, &fresh.hash, bytes(&fresh)), (80_000, &second.hash, bytes(&second)));
        // Another list of the same elements: taken whole, nothing written.
        let copy = Arc::new((*items).clone());
        let again = cutter.cut(|w| with_run(w, &copy, &mut writes));
        assert_eq!((writes, &again.hash), (80_000, &second.hash));
    }

    #[test]
    fn a_list_with_a_few_new_elements_writes_only_the_segments_around_them() {
        let items = Arc::new(elements(40_000, None));
        let mut cutter = Cutter::default();
        let mut writes = 0;
        let before = cutter.cut(|w| with_run(w, &items, &mut writes));
        let n = before.segments.len();
        // One element changed, in the middle: a segment or two of it written.
        let mut changed = (*items).clone();
        changed[20_000] = elements(20_001, Some(20_000)).pop().unwrap();
        let changed = Arc::new(changed);
        writes = 0;
        let after = cutter.cut(|w| with_run(w, &changed, &mut writes));
        assert_eq!(shared(&before, &after), n - 1, "all but the changed segment, shared");
        let new = after.segments.iter().find(|s| !before.segments.iter().any(|t| Arc::ptr_eq(s, t))).unwrap();
        let in_it = new.pieces().iter().filter(|p| p.as_ref() != b",").count();
        assert_eq!(writes, in_it, "the elements of the changed segment, and no more");
        assert!(writes < 40_000 / 2, "{writes}");
        assert_eq!(bytes(&after), without_run(&changed));
        assert_eq!(after.hash, Cutter::default().cut(|w| with_run(w, &changed, &mut 0)).hash);
        // And back: the list before, one element different from the one remembered now.
        writes = 0;
        let back = cutter.cut(|w| with_run(w, &items, &mut writes));
        assert_eq!(writes, in_it);
        assert_eq!((&back.hash, shared(&after, &back)), (&before.hash, n - 1));
    }

    /// Lists changed at random places, a few elements at a time, some much longer or
    /// shorter than before (moving cuts, or cut inside), written one after the other: each
    /// document is the bytes of its list, cut as a fresh cutter cuts it.
    #[test]
    fn lists_changed_anywhere_are_cut_as_a_fresh_cutter_cuts_them() {
        let mut list = elements(40_000, None);
        let mut cutter = Cutter::default();
        let mut seed = 7u64;
        let mut next = |bound: usize| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as usize % bound
        };
        let (mut written, mut rounds) = (0, 0);
        for round in 0..30 {
            for _ in 0..1 + next(2) {
                let i = match next(4) {
                    0 => 0,
                    1 => list.len() - 1,
                    _ => next(list.len()),
                };
                list[i] = match next(5) {
                    0 => Bytes::from(vec![b'x'; 300 * 1024 + next(1000)]),
                    1 => Bytes::from(format!("{{\"round\":{round}}}")),
                    _ => Bytes::from(format!("{{\"round\":{round},\"pad\":\"{}\"}}", "p".repeat(next(3000)))),
                };
            }
            let shared_list = Arc::new(list.clone());
            let mut writes = 0;
            let cut = cutter.cut(|w| with_run(w, &shared_list, &mut writes));
            assert_eq!(bytes(&cut), without_run(&list), "round {round}");
            let fresh = Cutter::default().cut(|w| with_run(w, &shared_list, &mut 0));
            let lens = |c: &Cut| c.segments.iter().map(|s| s.len()).collect::<Vec<_>>();
            assert_eq!((lens(&cut), &cut.hash), (lens(&fresh), &fresh.hash), "round {round}");
            if round > 0 {
                written += writes;
                rounds += 1;
            }
        }
        assert!(written / rounds < 40_000 / 2, "{} elements written per round of 40,000", written / rounds);
    }

    #[test]
    fn an_empty_or_resized_list_is_written_whole() {
        let mut cutter = Cutter::default();
        let empty = Arc::new(Vec::new());
        let cut = cutter.cut(|w| with_run(w, &empty, &mut 0));
        assert_eq!(bytes(&cut), without_run(&[]));
        let items = Arc::new(elements(5_000, None));
        let mut writes = 0;
        cutter.cut(|w| with_run(w, &items, &mut writes));
        let longer = Arc::new(elements(5_001, None));
        let cut = cutter.cut(|w| with_run(w, &longer, &mut writes));
        assert_eq!(writes, 10_001);
        assert_eq!(bytes(&cut), without_run(&longer));
    }

    #[test]
    fn equal_runs_in_one_document_are_one_segment() {
        let items = elements(80_000, None);
        let cut = Cutter::default().cut(|w| {
            write(w, &items);
            write(w, &items);
        });
        let distinct: Vec<&Arc<Segment>> = cut.segments.iter().fold(Vec::new(), |mut v, s| {
            if !v.iter().any(|t| Arc::ptr_eq(t, s)) {
                v.push(s);
            }
            v
        });
        assert!(distinct.len() < cut.segments.len(), "{} of {}", distinct.len(), cut.segments.len());
    }

    #[test]
    fn a_segment_holds_only_its_own_bytes() {
        let a = Segment::new(vec![Bytes::from_static(b"aaaa-"), Bytes::from_static(b"one")], 8, 1);
        assert!(a.holds(&[Bytes::from_static(b"aaaa-"), Bytes::from_static(b"one")], 8));
        assert!(a.holds(&[Bytes::from_static(b"aaaa"), Bytes::from_static(b"-one")], 8), "other piece bounds");
        assert!(!a.holds(&[Bytes::from_static(b"aaaa-"), Bytes::from_static(b"two")], 8));
        assert!(!a.holds(&[Bytes::from_static(b"aaaa"), Bytes::from_static(b"-two")], 8));
        assert!(!a.holds(&[Bytes::from_static(b"aaaa-on")], 7));
    }
}
