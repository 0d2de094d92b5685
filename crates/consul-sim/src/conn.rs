//! Connections: our own accept loop (for the per-client connection limit, which counts TCP
//! connections, so an HTTP/2 connection carrying many streams is one), the optional TLS
//! handshake, and hyper serving HTTP/1.1, or HTTP/2 when ALPN chose `h2` (as Consul: HTTP/2
//! only over HTTPS).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

use super::server::handle;
use super::state::{ConnGuard, Protocol, Shared};

/// How long a client may take to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepts connections until `shutdown` flips to true.
pub(crate) async fn accept_loop(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = shutdown.wait_for(|stop| *stop) => return,
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                // Typically EMFILE; back off briefly rather than spin.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let ip = peer.ip();
        if !shared.try_open_connection(ip) {
            tracing::debug!(%peer, "connection limit reached: 429");
            tokio::spawn(reject(stream, tls.clone()));
            continue;
        }
        let guard = ConnGuard { shared: shared.clone(), ip };
        let shared = shared.clone();
        let tls = tls.clone();
        let mut shutdown = shutdown.clone();
        tokio::spawn(async move {
            let _guard = guard;
            tokio::select! {
                () = serve(stream, tls, shared, peer) => {}
                // Dropping the connection closes the socket, aborting in-flight requests.
                _ = shutdown.wait_for(|stop| *stop) => {}
            }
        });
    }
}

async fn serve(stream: TcpStream, tls: Option<TlsAcceptor>, shared: Arc<Shared>, peer: SocketAddr) {
    let Some(acceptor) = tls else {
        return serve_http(TokioIo::new(stream), Protocol::H1, shared, peer).await;
    };
    let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return tracing::debug!(%peer, error = %e, "TLS handshake failed"),
        Err(_) => return tracing::debug!(%peer, "TLS handshake timed out"),
    };
    let protocol = if stream.get_ref().1.alpn_protocol() == Some(b"h2") { Protocol::H2 } else { Protocol::H1 };
    serve_http(TokioIo::new(stream), protocol, shared, peer).await;
}

async fn serve_http<I>(io: I, protocol: Protocol, shared: Arc<Shared>, peer: SocketAddr)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let _open = ProtocolGuard::new(&shared, protocol);
    // Requests in flight on this connection: one at a time on HTTP/1.1, up to the stream
    // limit on HTTP/2.
    let streams = Arc::new(AtomicUsize::new(0));
    let svc = {
        let shared = shared.clone();
        service_fn(move |req| {
            let stream = StreamGuard::new(&shared, &streams);
            let answer = handle(shared.clone(), peer, req);
            async move {
                let _stream = stream;
                answer.await
            }
        })
    };
    let served = match protocol {
        Protocol::H1 => http1::Builder::new().keep_alive(true).serve_connection(io, svc).await,
        Protocol::H2 => {
            let max = shared
                .config
                .tls
                .as_ref()
                .map_or(crate::DEFAULT_H2_MAX_CONCURRENT_STREAMS, |t| t.h2_max_concurrent_streams);
            http2::Builder::new(TokioExecutor::new()).max_concurrent_streams(max).serve_connection(io, svc).await
        }
    };
    if let Err(e) = served {
        tracing::debug!(%peer, error = %e, "connection ended");
    }
}

/// Counts a connection under its negotiated protocol while it is open.
struct ProtocolGuard {
    shared: Arc<Shared>,
    protocol: Protocol,
}

impl ProtocolGuard {
    fn new(shared: &Arc<Shared>, protocol: Protocol) -> Self {
        shared.protocol_opened(protocol);
        ProtocolGuard { shared: shared.clone(), protocol }
    }
}

impl Drop for ProtocolGuard {
    fn drop(&mut self) {
        self.shared.protocol_closed(self.protocol);
    }
}

/// Counts a request as in flight on its connection, for the streams peak.
struct StreamGuard {
    streams: Arc<AtomicUsize>,
}

impl StreamGuard {
    fn new(shared: &Shared, streams: &Arc<AtomicUsize>) -> Self {
        let now = streams.fetch_add(1, Ordering::Relaxed) + 1;
        shared.stream_count_seen(now);
        StreamGuard { streams: streams.clone() }
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.streams.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The connection-limit answer. Over TLS the handshake comes first, and the answer is the
/// same HTTP/1.1 429 inside the TLS session (an HTTP/2 client sees a protocol error: the
/// simulator does not speak HTTP/2 to a connection it refuses).
async fn reject(stream: TcpStream, tls: Option<TlsAcceptor>) {
    match tls {
        None => reject_connection(stream).await,
        Some(acceptor) => {
            if let Ok(Ok(s)) = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                reject_connection(s).await;
            }
        }
    }
}

/// Reads (and discards) the request head so that closing the socket does not turn into a
/// reset that hides our reply, writes a 429, and closes.
async fn reject_connection<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S) {
    let mut buf = [0u8; 4096];
    let mut head = Vec::new();
    let _ = tokio::time::timeout(Duration::from_millis(500), async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 64 * 1024 {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    let body = "Too Many Requests";
    let reply = format!(
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(reply.as_bytes()).await;
    let _ = stream.shutdown().await;
    // Drain briefly so the peer reads our reply before the socket goes away.
    let _ = tokio::time::timeout(Duration::from_millis(200), async {
        while let Ok(n) = stream.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
}
