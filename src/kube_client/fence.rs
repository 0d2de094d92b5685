//! The snapshot writer's client: a request body goes out only while this replica leads.
//!
//! The ConfigMap publisher checks its leadership deadline before each request
//! (`Writer::may_write` in publishers/configmap/mod.rs). For a large body that is not enough: a
//! part of a split snapshot is up to 900 KiB, and while the API server reads it slowly the
//! rest waits in this process. A process stopped then (SIGSTOP, a paused VM, a starved CPU)
//! sends the rest when it resumes, past its deadline, and the API server creates the part
//! although another replica may lead by then: a part creation has no precondition to fail
//! on. (The likely cause of a failure of e2e/tests/takeover.rs in CI: a part of the frozen
//! replica's appeared in etcd after the new leader's snapshot, just after it was woken.)
//!
//! This client hands a body to hyper in chunks of [`CHUNK`] bytes, each only while
//! [`Leadership::is_leading`], and lets hyper buffer at most [`MAX_BUFFERED`] bytes ahead of
//! the socket. A body cut by a lapse ends in an error: hyper closes the connection, and the
//! API server, short of the Content-Length, applies nothing. What can still leave after the
//! deadline is what was handed over before it: the kernel's socket buffer, hyper's buffer and
//! the last chunk (at most [`MAX_BUFFERED`] + [`CHUNK`]), and over TLS rustls's buffer of
//! encrypted records (64 KiB by default). docs/reliability.md, "Leadership".
//!
//! hyper's limit bounds its read buffer too, and costs: about 1 ms more per 1.2 MB create
//! on loopback (`bench_creates_with_and_without_the_fence`, docs/benchmarks.md), against
//! the tens of milliseconds the API server takes to store one.
//!
//! Requests without a body (reads, watches) are not affected. The client is built as kube's
//! default one is (the kubeconfig's server, TLS and credentials, our User-Agent, the
//! [`DeadlineLayer`](super::DeadlineLayer)), without kube's retries of 429/503/504 (a failed
//! publication is retried by the publisher) and without a proxy: a kubeconfig that names one
//! gets the unfenced client ([`fenced`]).

use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http::Request;
use http_body::{Body, Frame, SizeHint};
use hyper_util::rt::TokioExecutor;
use kube::client::{ClientBuilder, ConfigExt};
use tower::ServiceBuilder;
use tower_service::Service;

use super::{BoxError, DeadlineLayer};
use crate::leadership::Leadership;

/// The most of a body handed to hyper at once.
const CHUNK: usize = 16 * 1024;
/// hyper's buffer limit on these connections (its floor is 8 KiB; its default about 400 KiB).
const MAX_BUFFERED: usize = 64 * 1024;

/// A body's next chunk was due after this replica stopped leading.
#[derive(Debug, thiserror::Error)]
#[error("leadership lapsed while the request body was being sent; the rest was not sent")]
struct Lapsed;

/// A client whose request bodies are sent only while `leadership` holds, from `config` (see
/// [`super::config`]). A kubeconfig naming a proxy gets the ordinary client instead, and a
/// warning: the fence is built on a direct connection.
pub(crate) fn fenced(config: kube::Config, timeout: Duration, leadership: Leadership) -> anyhow::Result<kube::Client> {
    if let Some(proxy) = &config.proxy_url {
        tracing::warn!(
            proxy = %proxy,
            "the kubeconfig names a proxy: snapshot writes are checked against the leadership deadline \
             before they are sent, not while their bodies are"
        );
        return super::client(config, timeout);
    }
    // Bodies go out in small writes, each of which would wait for the previous one's ACK
    // without TCP_NODELAY.
    let connector = config.rustls_https_connector_with_connector(super::connector())?;
    let hyper = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .http1_max_buf_size(MAX_BUFFERED)
        .build(connector);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(Fence { inner: hyper, leadership });
    Ok(ClientBuilder::new(service, config.default_namespace).with_layer(&DeadlineLayer { timeout }).build())
}

/// Wraps every request body in a [`FencedBody`].
#[derive(Clone)]
struct Fence<S> {
    inner: S,
    leadership: Leadership,
}

impl<S> Service<Request<kube::client::Body>> for Fence<S>
where
    S: Service<Request<FencedBody>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<kube::client::Body>) -> S::Future {
        let leadership = self.leadership.clone();
        self.inner.call(req.map(|body| FencedBody { body, pending: Bytes::new(), leadership }))
    }
}

pin_project_lite::pin_project! {
    /// A request body given out [`CHUNK`] bytes at a time, each while leading.
    struct FencedBody {
        #[pin]
        body: kube::client::Body,
        // Taken from `body`, not yet given out.
        pending: Bytes,
        leadership: Leadership,
    }
}

impl Body for FencedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        while this.pending.is_empty() {
            match ready!(this.body.as_mut().poll_frame(cx)) {
                None => return Poll::Ready(None),
                Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => *this.pending = data,
                    // Trailers: no bytes of a write's content.
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
            }
        }
        if !this.leadership.is_leading() {
            return Poll::Ready(Some(Err(Box::new(Lapsed))));
        }
        let n = this.pending.len().min(CHUNK);
        let chunk = this.pending.split_to(n);
        Poll::Ready(Some(Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        !self.pending.has_remaining() && self.body.is_end_stream()
    }

    /// Exact when the body's is: hyper sends it as the Content-Length the API server counts.
    fn size_hint(&self) -> SizeHint {
        let inner = self.body.size_hint();
        let pending = self.pending.len() as u64;
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + pending);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + pending);
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
    use tokio::net::TcpSocket;

    /// What an API server that reads slowly received of one request: its Content-Length and
    /// the bytes of body that arrived before the connection ended.
    struct Received {
        content_length: usize,
        body: usize,
    }

    /// Reads a request's head and returns its Content-Length (0 without one); `None` when
    /// the connection ends first.
    async fn read_head(conn: &mut BufReader<tokio::net::TcpStream>) -> Option<usize> {
        let mut content_length = 0;
        loop {
            let mut line = String::new();
            if conn.read_line(&mut line).await.unwrap_or(0) == 0 {
                return None;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                content_length = v.trim().parse().unwrap();
            }
            if line == "\r\n" {
                return Some(content_length);
            }
        }
    }

    /// A create whose body is still being sent when leadership lapses: the rest of it is
    /// never sent, and the server sees the connection end short of the Content-Length.
    /// The server reads the first MiB, then nothing until the lapse: what the client could
    /// hand to the kernel by then is bounded by the socket buffers (a few MiB), far short of
    /// the 24 MiB body, so the cut is not a matter of timing.
    #[tokio::test]
    async fn a_body_in_transit_when_leadership_lapses_is_cut_short() {
        let socket = TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(64 * 1024).unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(1).unwrap();
        let addr = listener.local_addr().unwrap();
        let (read_first, first_read) = tokio::sync::oneshot::channel::<()>();
        let (lapsed_tx, lapsed) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let (conn, _) = listener.accept().await.unwrap();
            let mut conn = BufReader::new(conn);
            let content_length = read_head(&mut conn).await.expect("a request");
            let mut first = vec![0; 1 << 20];
            conn.read_exact(&mut first).await.unwrap();
            read_first.send(()).unwrap();
            lapsed.await.unwrap();
            let mut rest = Vec::new();
            // Up to the Content-Length, or until the connection ends (the client closed it)
            // or fails (reset): short, either way.
            let _ = conn.take((content_length - first.len()) as u64).read_to_end(&mut rest).await;
            Received { content_length, body: first.len() + rest.len() }
        });

        let (lead, leadership) = Leadership::manual();
        lead.send_replace(Some(tokio::time::Instant::now() + Duration::from_secs(3600)));
        let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
        let client = fenced(config, Duration::from_secs(60), leadership).unwrap();
        let api: kube::Api<ConfigMap> = kube::Api::namespaced(client, "ops");
        let cm = ConfigMap {
            metadata: kube::api::ObjectMeta { name: Some("snap-part".into()), ..Default::default() },
            data: Some([("part".to_owned(), "x".repeat(24 << 20))].into()),
            ..ConfigMap::default()
        };
        let create = tokio::spawn(async move { api.create(&Default::default(), &cm).await });
        first_read.await.unwrap();
        lead.send_replace(None);
        lapsed_tx.send(()).unwrap();
        let received = server.await.unwrap();
        assert!(received.content_length > 24 << 20, "the whole body was announced: {}", received.content_length);
        assert!(
            received.body < received.content_length,
            "the server got the whole body ({} bytes) after the lapse",
            received.body
        );
        let err = create.await.unwrap().expect_err("a cut request fails");
        assert!(format!("{err:?}").contains("Lapsed"), "the fence cut it: {err:?}");
    }

    /// A server that reads each request whole and answers it with its body (as the API
    /// server answers a create with the object), on one kept-alive connection.
    async fn echo_server() -> std::net::SocketAddr {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (conn, _) = listener.accept().await.unwrap();
            let mut conn = BufReader::new(conn);
            while let Some(content_length) = read_head(&mut conn).await {
                let mut body = vec![0; content_length];
                conn.read_exact(&mut body).await.unwrap();
                let head = format!(
                    "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: {content_length}\r\n\r\n"
                );
                conn.get_mut().write_all(head.as_bytes()).await.unwrap();
                conn.get_mut().write_all(&body).await.unwrap();
            }
        });
        addr
    }

    /// What the fence costs: 40 creates of a 1.2 MB ConfigMap (a part's size as sent) on
    /// loopback, with the fenced client and with kube's own, alternately, 7 rounds. A
    /// benchmark, not a test (docs/benchmarks.md): `cargo test --release -p
    /// consul-resolver-operator --lib fence::tests::bench -- --ignored --nocapture`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a benchmark: run it with --ignored --nocapture (figures in docs/benchmarks.md)"]
    async fn bench_creates_with_and_without_the_fence() {
        let cm = ConfigMap {
            metadata: kube::api::ObjectMeta { name: Some("snap-part".into()), ..Default::default() },
            data: Some([("part".to_owned(), "x".repeat(1200 << 10))].into()),
            ..ConfigMap::default()
        };
        let mut ratios = Vec::new();
        for round in 0..7 {
            let mut took = [Duration::ZERO; 2];
            for (i, fenced_client) in [false, true].into_iter().enumerate() {
                let config = kube::Config::new(format!("http://{}", echo_server().await).parse().unwrap());
                let client = if fenced_client {
                    fenced(config, Duration::from_secs(60), Leadership::always()).unwrap()
                } else {
                    super::super::client(config, Duration::from_secs(60)).unwrap()
                };
                let api: kube::Api<ConfigMap> = kube::Api::namespaced(client, "ops");
                let started = std::time::Instant::now();
                for _ in 0..40 {
                    api.create(&Default::default(), &cm).await.unwrap();
                }
                took[i] = started.elapsed();
            }
            eprintln!("round {round}: kube's client {:?}, fenced {:?}", took[0], took[1]);
            ratios.push(took[1].as_secs_f64() / took[0].as_secs_f64());
        }
        ratios.sort_by(f64::total_cmp);
        eprintln!("fenced / kube's: min {:.2} median {:.2} max {:.2}", ratios[0], ratios[3], ratios[6]);
    }

    /// While leading, a body bigger than a chunk arrives whole, as announced.
    #[tokio::test]
    async fn a_body_sent_while_leading_arrives_whole() {
        let mut body = FencedBody {
            body: kube::client::Body::from(vec![7u8; 3 * CHUNK + 5]),
            pending: Bytes::new(),
            leadership: Leadership::always(),
        };
        assert_eq!(body.size_hint().exact(), Some(3 * CHUNK as u64 + 5));
        let mut got = Vec::new();
        while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
            let data = frame.unwrap().into_data().unwrap();
            assert!(data.len() <= CHUNK);
            got.extend_from_slice(&data);
            assert_eq!(
                body.size_hint().exact(),
                Some((3 * CHUNK + 5 - got.len()) as u64),
                "the hint counts what is left"
            );
        }
        assert_eq!(got, vec![7u8; 3 * CHUNK + 5]);
        assert!(body.is_end_stream());
    }
}
