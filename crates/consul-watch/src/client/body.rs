//! An answer's body as it came off the wire, inflated only when it is read: whole, for the
//! answers read into a value at once, or as a stream, for the change feed's checks answer.
//!
//! Why a stream: at 75,000 instances `/v1/health/state/any` is about 21 MB of JSON.
//! Inflated whole, it was the operator's largest transient at the scale profile: 20 MB for
//! the few milliseconds the feed took to split it (docs/benchmarks.md, "Measured
//! design choices"). Read as a stream, what is held is the gzipped answer
//! and the check being split.

use std::io::Read;

use bytes::Bytes;
use http::HeaderMap;
use http::header::CONTENT_ENCODING;

/// A successful exchange's body, not yet inflated; at most `limit` bytes once inflated.
#[derive(Debug, Clone)]
pub(crate) struct Body {
    raw: Bytes,
    gzip: bool,
    limit: usize,
}

/// Why a body cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BodyError {
    Malformed(String),
    /// Inflated, it is larger than the limit.
    TooLarge,
}

impl Body {
    /// The body `raw` of an answer with `headers`: gzipped or not, as its `Content-Encoding`
    /// says. We ask only for gzip: any other encoding is an error.
    pub(crate) fn new(headers: &HeaderMap, raw: Bytes, limit: usize) -> Result<Body, String> {
        let gzip = match headers.get(CONTENT_ENCODING).map(|v| v.as_bytes().trim_ascii()) {
            None => false,
            Some(e) if e.is_empty() || e.eq_ignore_ascii_case(b"identity") => false,
            Some(e) if e.eq_ignore_ascii_case(b"gzip") => true,
            Some(e) => {
                return Err(format!("an answer in an encoding we did not ask for ({})", String::from_utf8_lossy(e)));
            }
        };
        Ok(Body { raw, gzip, limit })
    }

    /// A body that came as it is (tests, and errors made up here).
    #[cfg(test)]
    pub(crate) fn plain(raw: impl Into<Bytes>) -> Body {
        Body { raw: raw.into(), gzip: false, limit: usize::MAX }
    }

    /// The body, inflated whole.
    pub(crate) fn whole(&self) -> Result<Bytes, BodyError> {
        if !self.gzip {
            return Ok(self.raw.clone());
        }
        gunzip(&self.raw, self.limit).map(Bytes::from)
    }

    /// The body as a stream, inflated as it is read.
    pub(crate) fn reader(&self) -> BodyReader<'_> {
        let source = if self.gzip {
            Source::Gzip(Box::new(flate2::read::GzDecoder::new(&self.raw[..])))
        } else {
            Source::Plain(&self.raw[..])
        };
        BodyReader { source, left: self.limit, too_large: false }
    }
}

/// A [`Body`] read as a stream. Reading past the limit is an error, after which
/// [`BodyReader::too_large`] says so.
pub(crate) struct BodyReader<'a> {
    source: Source<'a>,
    /// How many more bytes the limit allows.
    left: usize,
    too_large: bool,
}

enum Source<'a> {
    Plain(&'a [u8]),
    Gzip(Box<flate2::read::GzDecoder<&'a [u8]>>),
}

impl BodyReader<'_> {
    /// Whether reading failed because the inflated body is over the limit.
    pub(crate) fn too_large(&self) -> bool {
        self.too_large
    }
}

impl Read for BodyReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.too_large {
            return Err(over_limit());
        }
        // One byte more than the limit allows is asked for, to learn that there is more.
        let room = buf.len().min(self.left.saturating_add(1));
        let n = match &mut self.source {
            Source::Plain(raw) => raw.read(&mut buf[..room])?,
            Source::Gzip(gz) => gz
                .read(&mut buf[..room])
                .map_err(|e| std::io::Error::new(e.kind(), format!("a gzipped answer that does not inflate: {e}")))?,
        };
        if n > self.left {
            self.too_large = true;
            return Err(over_limit());
        }
        self.left -= n;
        Ok(n)
    }
}

fn over_limit() -> std::io::Error {
    std::io::Error::other("the answer is over the size limit")
}

/// Inflates a gzipped body, at most `limit` bytes of it.
fn gunzip(gz: &[u8], limit: usize) -> Result<Vec<u8>, BodyError> {
    // The gzip trailer's last four bytes are the inflated size (modulo 4 GiB): room for it
    // at once rather than doubling buffers. Trusted only as far as deflate can expand
    // (1,032 times), so a small answer cannot claim a large buffer.
    let announced = gz.len().checked_sub(4).map_or(0, |i| u32::from_le_bytes([gz[i], gz[i + 1], gz[i + 2], gz[i + 3]]));
    let room = (announced as usize).min(limit).min(gz.len().saturating_mul(1032));
    let mut out = Vec::with_capacity(room.saturating_add(1));
    flate2::read::GzDecoder::new(gz)
        .take(limit as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| BodyError::Malformed(format!("a gzipped answer that does not inflate: {e}")))?;
    if out.len() > limit {
        return Err(BodyError::TooLarge);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use http::HeaderValue;

    use super::*;

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn gzipped(data: &[u8], limit: usize) -> Body {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        Body::new(&headers, gzip(data).into(), limit).unwrap()
    }

    /// Everything a reader gives, read `step` bytes at a time.
    fn read_in_steps(mut r: impl Read, step: usize) -> std::io::Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut buf = vec![0; step];
        loop {
            match r.read(&mut buf)? {
                0 => return Ok(out),
                n => out.extend_from_slice(&buf[..n]),
            }
        }
    }

    #[test]
    fn whole_and_streamed_read_the_same_within_the_limit() {
        let json = br#"[{"Node":"n1","CheckID":"serfHealth","ModifyIndex":5}]"#.repeat(500);
        for step in [1, 7, 8192] {
            assert_eq!(read_in_steps(gzipped(&json, json.len()).reader(), step).unwrap(), json);
            assert_eq!(read_in_steps(Body::plain(json.clone()).reader(), step).unwrap(), json);
        }
        assert_eq!(gzipped(&json, json.len()).whole().unwrap(), json);
        // One byte over the limit, whole or streamed, is too large: never a cut answer.
        let small = gzipped(&json, json.len() - 1);
        assert_eq!(small.whole(), Err(BodyError::TooLarge));
        let mut reader = small.reader();
        assert!(read_in_steps(&mut reader, 4096).is_err());
        assert!(reader.too_large());
    }

    #[test]
    fn a_damaged_or_cut_gzip_is_an_error_never_a_shorter_body() {
        let json = br#"{"a":1}"#.repeat(1000);
        let gz = gzip(&json);
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        let cut = Body::new(&headers, Bytes::copy_from_slice(&gz[..gz.len() - 6]), 1 << 20).unwrap();
        let mut flipped = gz.clone();
        let n = flipped.len();
        flipped[n - 8] ^= 1; // the CRC
        let flipped = Body::new(&headers, flipped.into(), 1 << 20).unwrap();
        for body in [cut, flipped] {
            assert!(matches!(body.whole(), Err(BodyError::Malformed(_))));
            let mut reader = body.reader();
            let err = read_in_steps(&mut reader, 100).unwrap_err();
            assert!(err.to_string().contains("does not inflate"), "{err}");
            assert!(!reader.too_large());
        }
    }

    #[test]
    fn encodings_we_did_not_ask_for_are_refused() {
        let mut headers = HeaderMap::new();
        assert!(Body::new(&headers, Bytes::new(), 1).is_ok());
        headers.insert(CONTENT_ENCODING, HeaderValue::from_static("identity"));
        assert!(Body::new(&headers, Bytes::new(), 1).is_ok());
        headers.insert(CONTENT_ENCODING, HeaderValue::from_static("br"));
        assert!(Body::new(&headers, Bytes::new(), 1).unwrap_err().contains("(br)"));
    }

    /// The gzip trailer's size sets the buffer only as far as deflate can expand: a small
    /// answer that claims 4 GiB does not get a large buffer.
    #[test]
    fn a_forged_gzip_size_does_not_claim_memory() {
        let mut gz = gzip(b"[]");
        let n = gz.len();
        gz[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
        let (inflated, peak) = heap_peak::peak_heap(|| gunzip(&gz, 1 << 30));
        // Its checksum of the size fails, but only after the buffer was made.
        assert!(inflated.is_err());
        assert!(peak < 256 << 10, "{peak} bytes (the inflater itself about 100 KB)");
    }

    /// Streamed, a large answer holds the inflater and what the reader asks for, not the
    /// inflated answer.
    #[test]
    fn a_streamed_answer_holds_no_inflated_copy() {
        let json = br#"{"Node":"node-1234","CheckID":"service:web-1234","ModifyIndex":98765},"#.repeat(50_000);
        let body = gzipped(&json, 1 << 30);
        let (read, peak) = heap_peak::peak_heap(|| {
            let mut reader = body.reader();
            let mut buf = vec![0; 64 << 10];
            let mut total = 0;
            while let Ok(n @ 1..) = reader.read(&mut buf) {
                total += n;
            }
            total
        });
        assert_eq!(read, json.len());
        assert!(peak < 512 << 10, "{peak} bytes held to stream a {} byte answer", json.len());
    }
}
