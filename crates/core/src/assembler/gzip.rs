//! The snapshot document gzipped segment by segment (docs/snapshot.md, "Segments"), so
//! that what did not change between two snapshots is neither compressed nor stored twice.
//!
//! Each segment ([`super::segment`]) is deflated alone (no back-reference into another
//! segment) and ended with a sync flush, which leaves it byte-aligned and not final. So the
//! bodies of any sequence of segments, behind a gzip header and followed by a final empty
//! block and the trailer (the CRC-32 of the whole, combined from the segments' own, and its
//! length), are one ordinary single-member gzip stream, as a reader of one stream expects
//! (RFC 1951 §3.2.3, RFC 1952 §2.3; pigz joins its blocks the same way). A segment's body is
//! made once and shared by every snapshot that holds the segment: the snapshot history and
//! the ConfigMap parts hold one copy of what several snapshots have in common.
//!
//! Pure computation: no I/O.

use bytes::Bytes;
use sha2::{Digest, Sha256};

/// The gzip member header written before the segments: deflate, no flags, no time, no
/// extra flags, operating system unknown (RFC 1952 §2.3).
pub const GZIP_HEADER: [u8; 10] = [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff];

/// A final, empty block with fixed Huffman codes: ends the deflate stream the segments
/// make (BFINAL=1, BTYPE=01, end-of-block; 10 bits).
const FINAL_BLOCK: [u8; 2] = [0x03, 0x00];

/// One segment deflated alone: a deflate body that is byte-aligned and not final.
#[derive(Debug, Clone)]
pub struct Deflated {
    body: Bytes,
    /// The body's sha256, made once with it: a publication names and indexes its parts by
    /// it, and most of a publication's parts are segments deflated before.
    sha256: [u8; 32],
    crc: u32,
    raw_len: u64,
}

impl Deflated {
    /// The deflate bytes.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The sha256 of [`Deflated::body`].
    pub fn sha256(&self) -> &[u8; 32] {
        &self.sha256
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
    /// The stream of `segments`, in order.
    pub fn new(segments: Vec<Deflated>) -> Gzipped {
        let mut crc = crc32fast::Hasher::new();
        let mut raw_len = 0;
        for s in &segments {
            crc.combine(&crc32fast::Hasher::new_with_initial_len(s.crc, s.raw_len));
            raw_len += s.raw_len;
        }
        Gzipped { segments, crc: crc.finalize(), raw_len }
    }

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

/// The deflate level of snapshots (docs/benchmarks.md, "Snapshot gzip level"). With zlib-rs (the
/// backend every part of the workspace shares), level 1 is its "quick" strategy, which
/// trades a third of the compression for speed. Level 2 made the scale profile's 58 MB
/// snapshot 3.0 MB in 49 ms, where miniz_oxide's level 1 (used before) made a 56 MB one
/// 3.4 MB in 53 ms.
pub const LEVEL: u32 = 2;

/// `pieces`, one after the other, deflated alone at [`LEVEL`] and ended by a sync flush
/// (byte-aligned, not final), with their CRC-32.
pub fn deflate(pieces: &[Bytes]) -> Deflated {
    use flate2::{Compress, Compression, FlushCompress};
    // Gathered first (a segment is at most 4 MiB): the compressor is called once, not once
    // per piece of a few hundred bytes, and each call prepares all the output room it is
    // given (a memset of it) whatever it writes: per piece, that was most of the cost.
    let bytes = pieces.concat();
    let mut c = Compress::new(Compression::new(LEVEL), false);
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
    crc.update(&bytes);
    let sha256 = Sha256::digest(&out).into();
    // Kept as long as the segment: without the slack of the output room.
    Deflated { body: Bytes::from(out.into_boxed_slice()), sha256, crc: crc.finalize(), raw_len: bytes.len() as u64 }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::Read;

    /// Inflates one gzip stream. A single-member reader stops at the first member's end, so
    /// anything but one stream comes back short.
    pub(crate) fn gunzip(gz: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(gz).read_to_end(&mut out).expect("one valid gzip stream");
        out
    }

    #[test]
    fn segments_deflated_apart_make_one_gzip_stream_whatever_their_pieces() {
        let text: Vec<u8> = (0..300_000u32).flat_map(|i| format!("{{\"n\":{i}}},").into_bytes()).collect();
        let text = Bytes::from(text);
        // Split at arbitrary places into segments, and each segment into arbitrary pieces.
        let segments: Vec<Vec<Bytes>> = [0..1, 1..70_000, 70_000..70_000, 70_000..1_500_000, 1_500_000..text.len()]
            .into_iter()
            .map(|r| {
                let seg = text.slice(r);
                let mid = seg.len() / 3;
                vec![seg.slice(..mid), seg.slice(mid..mid), seg.slice(mid..)]
            })
            .collect();
        let gz = Gzipped::new(segments.iter().map(|p| deflate(p)).collect());
        assert_eq!(gunzip(&gz.to_bytes()), text);
        assert_eq!(gz.to_bytes().len(), gz.len());
        assert!(gz.len() * 5 < text.len(), "compressed: {} of {}", gz.len(), text.len());
    }
}
