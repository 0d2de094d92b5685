//! The snapshot document gzipped in content-defined segments, so that what did not change
//! between two snapshots is neither compressed nor stored twice (docs/snapshot.md, "Split
//! snapshots").
//!
//! The document is cut into segments at places chosen by its content (between two JSON
//! array elements, where a hash of the element says so), not by position: a change to one
//! service's endpoints changes the segment holding them, and the cuts around it stay where
//! they were. Each segment is deflated alone (no back-reference into another segment) and
//! ended with a sync flush, which leaves it byte-aligned and not final. So the bodies of
//! any sequence of segments, behind a gzip header and followed by a final empty block and
//! the trailer (the CRC-32 of the whole, combined from the segments' own, and its length),
//! are one ordinary single-member gzip stream, as a reader of one stream expects
//! (RFC 1951 §3.2.3, RFC 1952 §2.3; pigz joins its blocks the same way).
//!
//! A [`Compressor`] remembers the previous document's segments: a segment whose bytes
//! equal one of them (compared byte for byte, never trusted on a hash) reuses its deflated
//! body, shared, not copied. The snapshot history and the ConfigMap parts then hold one copy
//! of what several snapshots have in common.
//!
//! Pure computation: no I/O.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Mutex;

use bytes::Bytes;

/// The gzip member header written before the segments: deflate, no flags, no time, no
/// extra flags, operating system unknown (RFC 1952 §2.3).
pub const GZIP_HEADER: [u8; 10] = [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff];

/// A final, empty block with fixed Huffman codes: ends the deflate stream the segments
/// make (BFINAL=1, BTYPE=01, end-of-block; 10 bits).
const FINAL_BLOCK: [u8; 2] = [0x03, 0x00];

/// Segments are at least this long (but for the document's header and its end) ...
const MIN_SEGMENT: usize = 256 * 1024;
/// ... about this much longer on average (each byte of an element past the minimum ends a
/// segment with probability 1/AVG) ...
const AVG_SEGMENT: u64 = 1024 * 1024;
/// ... and cut at this length whatever their content, so that a document without element
/// boundaries still is. At the compression gzip's fastest level reaches on snapshots
/// (about 15x), a segment deflates to about 85 KB on average: a change to one service
/// rewrites that much (in each copy of the service), and a 55 MB snapshot is 40 to 60 of them.
const MAX_SEGMENT: usize = 4 * 1024 * 1024;

/// One segment deflated alone: a deflate body that is byte-aligned and not final.
#[derive(Debug, Clone)]
pub struct Deflated {
    body: Bytes,
    crc: u32,
    raw_len: u64,
}

impl Deflated {
    /// The deflate bytes.
    pub fn body(&self) -> &Bytes {
        &self.body
    }
}

/// A document gzipped as segments: [`GZIP_HEADER`], the segments' bodies in order, then
/// [`Gzipped::trailer`], together one gzip stream.
#[derive(Debug, Clone)]
pub struct Gzipped {
    segments: Vec<Deflated>,
    crc: u32,
    raw_len: u64,
}

impl Gzipped {
    /// The segments, in order.
    pub fn segments(&self) -> &[Deflated] {
        &self.segments
    }

    /// What ends the stream: a final empty block, the CRC-32 and the length (mod 2^32) of
    /// the whole document.
    pub fn trailer(&self) -> [u8; 10] {
        let mut t = [0; 10];
        t[..2].copy_from_slice(&FINAL_BLOCK);
        t[2..6].copy_from_slice(&self.crc.to_le_bytes());
        t[6..].copy_from_slice(&(self.raw_len as u32).to_le_bytes());
        t
    }

    /// Bytes of the whole stream.
    pub fn len(&self) -> usize {
        GZIP_HEADER.len() + self.segments.iter().map(|s| s.body.len()).sum::<usize>() + FINAL_BLOCK.len() + 8
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// The whole stream in one buffer (a copy).
    pub fn to_bytes(&self) -> Bytes {
        let mut out = Vec::with_capacity(self.len());
        out.extend_from_slice(&GZIP_HEADER);
        for s in &self.segments {
            out.extend_from_slice(&s.body);
        }
        out.extend_from_slice(&self.trailer());
        Bytes::from(out)
    }
}

/// The previous document and its segments, for [`Compressor::gzip`] to reuse.
#[derive(Default)]
struct Previous {
    json: Bytes,
    /// By [`key`] of the segment's bytes: where in `json`, and its deflated body.
    segments: HashMap<u64, Vec<(Range<usize>, Deflated)>>,
}

/// Gzips documents one after the other, deflating only the segments that differ from
/// the previous document's.
#[derive(Default)]
pub struct Compressor {
    previous: Mutex<Previous>,
}

impl Compressor {
    /// `json` gzipped in segments; its first `header_len` bytes (the part of a document that
    /// changes with every snapshot: its id and hash) are a segment of their own.
    pub fn gzip(&self, json: &Bytes, header_len: usize) -> Gzipped {
        let mut previous = self.previous.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut segments = Vec::new();
        let mut table: HashMap<u64, Vec<(Range<usize>, Deflated)>> = HashMap::new();
        let mut crc = crc32fast::Hasher::new();
        for range in cuts(json, header_len) {
            let bytes = &json[range.clone()];
            let key = key(bytes);
            let reused = previous.segments.get(&key).and_then(|candidates| {
                candidates.iter().find(|(r, _)| &previous.json[r.clone()] == bytes).map(|(_, d)| d.clone())
            });
            let deflated = reused.unwrap_or_else(|| deflate(bytes));
            crc.combine(&crc32fast::Hasher::new_with_initial_len(deflated.crc, deflated.raw_len));
            table.entry(key).or_default().push((range, deflated.clone()));
            segments.push(deflated);
        }
        *previous = Previous { json: json.clone(), segments: table };
        Gzipped { segments, crc: crc.finalize(), raw_len: json.len() as u64 }
    }
}

/// `bytes` deflated alone at the fastest level, ended by a sync flush (byte-aligned, not
/// final), with its CRC-32. The level measured for snapshots (docs/benchmarks.md, "gzip
/// level"): level 1 compresses the 3 MB snapshot of 10,000 Mappings to 167 KB in 2.7 ms,
/// where the default level takes 17 ms for 115 KB.
fn deflate(bytes: &[u8]) -> Deflated {
    use flate2::{Compress, Compression, FlushCompress};
    let mut c = Compress::new(Compression::fast(), false);
    let mut out = Vec::with_capacity(bytes.len() / 8 + 64);
    loop {
        if out.capacity() - out.len() < 64 {
            out.reserve(out.capacity().max(4096));
        }
        let consumed = c.total_in() as usize;
        c.compress_vec(&bytes[consumed..], &mut out, FlushCompress::Sync).expect("deflate into memory cannot fail");
        // Flushed when all input is in and the output did not fill what it was given.
        if c.total_in() as usize == bytes.len() && out.len() < out.capacity() {
            break;
        }
    }
    let mut crc = crc32fast::Hasher::new();
    crc.update(bytes);
    Deflated { body: Bytes::from(out), crc: crc.finalize(), raw_len: bytes.len() as u64 }
}

/// Where `json` is cut: the header, then segments ending between two array elements
/// (`},{`) where [`ends_segment`] says so, between [`MIN_SEGMENT`] and [`MAX_SEGMENT`].
fn cuts(json: &[u8], header_len: usize) -> Vec<Range<usize>> {
    let header_len = header_len.min(json.len());
    let mut cuts = Vec::new();
    if header_len > 0 {
        cuts.push(0..header_len);
    }
    let (mut start, mut element) = (header_len, header_len);
    for at in memchr::memmem::find_iter(&json[header_len..], b"},{") {
        // Between the `,` and the `{`: the next element starts the next segment.
        let end = header_len + at + 2;
        let this = element..end;
        element = end;
        let len = end - start;
        if len >= MAX_SEGMENT || (len >= MIN_SEGMENT && ends_segment(&json[this])) {
            push_bounded(&mut cuts, start..end);
            start = end;
        }
    }
    if start < json.len() {
        push_bounded(&mut cuts, start..json.len());
    }
    cuts
}

/// Pushes `range`, cut into pieces of at most [`MAX_SEGMENT`].
fn push_bounded(cuts: &mut Vec<Range<usize>>, range: Range<usize>) {
    let mut start = range.start;
    while start < range.end {
        let end = range.end.min(start + MAX_SEGMENT);
        cuts.push(start..end);
        start = end;
    }
}

/// Whether the segment ends after `element`: with probability `len / AVG_SEGMENT`, decided
/// by its bytes, so the same element ends a segment in every document that holds it.
fn ends_segment(element: &[u8]) -> bool {
    hash(element) % AVG_SEGMENT < element.len() as u64
}

/// What [`Previous`] files a segment under: its length and its first and last 64 bytes.
/// Candidates are compared whole, so a collision costs a comparison, never a wrong body.
fn key(segment: &[u8]) -> u64 {
    let head = &segment[..segment.len().min(64)];
    let tail = &segment[segment.len().saturating_sub(64)..];
    hash(head) ^ hash(tail).rotate_left(17) ^ (segment.len() as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// A fast, non-cryptographic hash (word-wise multiply-rotate, then a murmur3 finaliser):
/// it only chooses cuts and files candidates, both verified or harmless when they collide.
fn hash(bytes: &[u8]) -> u64 {
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
    use std::io::Read;

    fn gunzip(gz: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        // A single-member reader: it stops at the first member's end, so anything but one
        // stream would come back short.
        flate2::read::GzDecoder::new(gz).read_to_end(&mut out).expect("one valid gzip stream");
        out
    }

    /// A document like a snapshot: a header, then `n` array elements of about 250 bytes.
    fn document(n: usize, id: u64, changed: Option<usize>) -> Bytes {
        let mut doc = format!(r#"{{"id":{id},"hash":"h{id}","resolvers":["#);
        for i in 0..n {
            let port = if Some(i) == changed { 9999 } else { 8080 };
            if i > 0 {
                doc.push(',');
            }
            doc.push_str(&format!(
                r#"{{"address":"10.{}.{}.{}","port":{port},"node":"node-{}","serviceId":"web-{i}","tags":["v1"],"meta":{{"build":"{:016x}"}},"health":"passing"}}"#,
                i / 65536 % 256,
                i / 256 % 256,
                i % 256,
                i % 97,
                hash(&i.to_le_bytes())
            ));
        }
        doc.push_str("]}");
        Bytes::from(doc)
    }

    fn header_len(doc: &[u8]) -> usize {
        memchr::memmem::find(doc, b"\"resolvers\"").unwrap()
    }

    #[test]
    fn the_segments_make_one_gzip_stream_of_the_document() {
        for n in [0, 1, 3, 40_000] {
            let doc = document(n, 1, None);
            let gz = Compressor::default().gzip(&doc, header_len(&doc));
            assert_eq!(gunzip(&gz.to_bytes()), doc, "{n} elements");
            assert_eq!(gz.to_bytes().len(), gz.len());
        }
        let doc = document(40_000, 1, None);
        let gz = Compressor::default().gzip(&doc, header_len(&doc));
        assert!(gz.segments().len() > 2, "{} segments of {} bytes", gz.segments().len(), doc.len());
        // Bytes with no element boundaries, and no header.
        let noise: Vec<u8> = (0..3 * MAX_SEGMENT as u64).map(|i| b'a' + (hash(&i.to_le_bytes()) % 26) as u8).collect();
        let noise = Bytes::from(noise);
        let gz = Compressor::default().gzip(&noise, 0);
        assert_eq!(gz.segments().len(), 3, "cut at the maximum");
        assert!(gunzip(&gz.to_bytes()) == noise);
    }

    #[test]
    fn cuts_cover_the_document_within_their_bounds() {
        let doc = document(40_000, 1, None);
        let h = header_len(&doc);
        let cuts = cuts(&doc, h);
        assert_eq!(cuts[0], 0..h, "the header alone");
        assert_eq!(cuts.last().unwrap().end, doc.len());
        for pair in cuts.windows(2) {
            assert_eq!(pair[0].end, pair[1].start, "contiguous");
        }
        for c in &cuts[1..cuts.len() - 1] {
            assert!((MIN_SEGMENT..=MAX_SEGMENT).contains(&c.len()), "{c:?}");
            assert_eq!(&doc[c.end - 2..c.end + 1], b"},{", "between elements");
        }
    }

    #[test]
    fn a_change_deflates_only_its_own_segment_and_shares_the_rest() {
        let compressor = Compressor::default();
        let before = document(40_000, 1, None);
        let first = compressor.gzip(&before, header_len(&before));
        // One element changes its length, which moves every byte after it.
        let after = document(40_000, 2, Some(20_000));
        let second = compressor.gzip(&after, header_len(&after));
        assert_eq!(gunzip(&second.to_bytes()), after);
        let shared = |a: &Gzipped, b: &Gzipped| {
            b.segments().iter().filter(|s| a.segments().iter().any(|t| t.body().as_ptr() == s.body().as_ptr())).count()
        };
        let n = second.segments().len();
        assert_eq!(n, first.segments().len(), "the same cuts around the change");
        assert_eq!(shared(&first, &second), n - 2, "all but the header and the changed segment, shared");
        // The same document again: everything but nothing is deflated again.
        let again = compressor.gzip(&after, header_len(&after));
        assert_eq!(shared(&second, &again), n);
        assert_eq!(again.to_bytes(), second.to_bytes());
    }

    #[test]
    fn a_segment_is_reused_only_when_its_bytes_are_equal() {
        let compressor = Compressor::default();
        let a = Bytes::from_static(b"aaaaaaaaaa-one");
        let b = Bytes::from_static(b"aaaaaaaaaa-two");
        compressor.gzip(&a, 0);
        // Same length, same key window: a candidate, refused on its bytes.
        assert_eq!(key(&a), key(&a.clone()));
        let gz = compressor.gzip(&b, 0);
        assert_eq!(gunzip(&gz.to_bytes()), b);
    }
}
