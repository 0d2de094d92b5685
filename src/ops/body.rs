//! The ops server's response bodies: small ones whole, a snapshot streamed from its
//! segments, so that serving a 55 MB document costs no copy of it (the document exists
//! only as its parts' JSON, see docs/snapshot.md), and an older snapshot, kept gzipped,
//! inflated as it is sent to a reader that does not take gzip.

use std::io::Read;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Frame, SizeHint};
use tokio::sync::{OwnedSemaphorePermit, mpsc};

use consul_resolver_core::assembler::Snapshot;

/// Small pieces are gathered into frames of about this much; larger ones go as they are.
const FRAME: usize = 64 * 1024;

pub(crate) enum ResponseBody {
    Whole(Option<Bytes>),
    Document(Document),
    Inflating(Inflating),
}

impl ResponseBody {
    pub(crate) fn document(snapshot: Arc<Snapshot>) -> Self {
        let remaining = snapshot.len();
        ResponseBody::Document(Document { snapshot, segment: 0, piece: 0, remaining })
    }

    /// `gzip` inflated a frame at a time on a blocking thread, at most two frames ahead of
    /// the reader: a reader that does not take gzip never makes the process hold the whole
    /// document (tens of megabytes at scale, once per request). `permit` is one of the few
    /// inflations allowed at once, held until the body is sent or dropped.
    pub(crate) fn inflating(gzip: Bytes, permit: OwnedSemaphorePermit) -> Self {
        let (tx, chunks) = mpsc::channel(2);
        tokio::task::spawn_blocking(move || {
            let mut decoder = flate2::read::GzDecoder::new(&gzip[..]);
            let mut frame = vec![0u8; FRAME];
            loop {
                let next = match decoder.read(&mut frame) {
                    Ok(0) => return,
                    Ok(n) => Ok(Bytes::copy_from_slice(&frame[..n])),
                    Err(e) => Err(e),
                };
                let failed = next.is_err();
                // The reader gone (the receiver dropped): nothing more to inflate.
                if tx.blocking_send(next).is_err() || failed {
                    return;
                }
            }
        });
        ResponseBody::Inflating(Inflating { chunks, _permit: permit })
    }
}

/// An older snapshot being inflated as it is sent ([`ResponseBody::inflating`]).
pub(crate) struct Inflating {
    chunks: mpsc::Receiver<std::io::Result<Bytes>>,
    _permit: OwnedSemaphorePermit,
}

impl From<Bytes> for ResponseBody {
    fn from(bytes: Bytes) -> Self {
        ResponseBody::Whole(Some(bytes))
    }
}

/// Where a snapshot's document is being read: segment 0 is the header.
pub(crate) struct Document {
    snapshot: Arc<Snapshot>,
    segment: usize,
    piece: usize,
    remaining: usize,
}

impl Document {
    /// The next piece, not yet taken.
    fn peek(&mut self) -> Option<Bytes> {
        loop {
            let pieces = match self.segment {
                0 => std::slice::from_ref(self.snapshot.header()),
                n => self.snapshot.segments().get(n - 1)?.pieces(),
            };
            if let Some(p) = pieces.get(self.piece) {
                return Some(p.clone());
            }
            (self.segment, self.piece) = (self.segment + 1, 0);
        }
    }

    fn next_frame(&mut self) -> Option<Bytes> {
        let mut frame = BytesMut::new();
        while let Some(piece) = self.peek() {
            if frame.is_empty() && piece.len() >= FRAME {
                self.piece += 1;
                self.remaining -= piece.len();
                return Some(piece);
            }
            if frame.len() + piece.len() > FRAME && !frame.is_empty() {
                break;
            }
            frame.extend_from_slice(&piece);
            self.piece += 1;
            self.remaining -= piece.len();
        }
        (!frame.is_empty()).then(|| frame.freeze())
    }
}

impl http_body::Body for ResponseBody {
    type Data = Bytes;
    /// Only an inflation can fail (a stored gzip that does not inflate): the connection is
    /// then cut, so the reader sees a broken response, never a short document as whole.
    type Error = std::io::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let next = match self.get_mut() {
            ResponseBody::Whole(bytes) => bytes.take(),
            ResponseBody::Document(d) => d.next_frame(),
            ResponseBody::Inflating(i) => {
                return i.chunks.poll_recv(cx).map(|next| next.map(|chunk| chunk.map(Frame::data)));
            }
        };
        Poll::Ready(next.map(|b| Ok(Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Whole(bytes) => bytes.is_none(),
            ResponseBody::Document(d) => d.remaining == 0,
            ResponseBody::Inflating(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Whole(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, Bytes::len) as u64),
            ResponseBody::Document(d) => SizeHint::with_exact(d.remaining as u64),
            ResponseBody::Inflating(_) => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::Body as _;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn a_document_is_streamed_whole_in_bounded_frames() {
        let mut c = crate::test_fixtures::content(vec![]);
        c.problems = (0..20_000)
            .map(|i| consul_resolver_core::assembler::snapshot::Problem {
                kind: "Mapping".into(),
                namespace: "shop".into(),
                name: format!("m{i:05}"),
                message: format!("problem {i}"),
            })
            .collect();
        let snapshot = Arc::new(c.into_snapshot(3));
        let mut body = ResponseBody::document(snapshot.clone());
        assert_eq!(body.size_hint().exact(), Some(snapshot.len() as u64));
        let mut got = Vec::new();
        let mut frames = 0;
        while let Some(frame) = body.frame().await {
            let data = frame.unwrap().into_data().unwrap();
            assert!(data.len() <= FRAME, "{}", data.len());
            got.extend_from_slice(&data);
            frames += 1;
        }
        assert!(body.is_end_stream());
        assert_eq!(got, snapshot.to_json());
        assert!(frames > 10, "{frames} frames");
    }
}
