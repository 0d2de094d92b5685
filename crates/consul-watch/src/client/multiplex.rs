//! HTTP/2 to one Consul server over TLS: every query is a stream, and a connection carries
//! as many as the server allows (its `SETTINGS_MAX_CONCURRENT_STREAMS`, at most
//! [`MAX_STREAMS_PER_CONNECTION`]), so every watch keeps its own blocking query over a
//! handful of connections (docs/consul.md, "HTTP/2").
//!
//! Connections ("lanes") are opened one at a time, only when every open lane is full, and
//! each holds one permit of the server's connection budget while it is open (but the first,
//! see [`Multiplexer::stream`]). A lane that
//! empties is closed unless it is the last. Which protocol the server speaks is learnt from
//! ALPN on the first connection: a server that answers `http/1.1` is left to the HTTP/1.1
//! client for good, with that first connection.
//!
//! We use the `h2` crate directly rather than reqwest's HTTP/2 because reqwest keeps one
//! connection per host and does not say how many streams the server allows.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Request, StatusCode};
use tokio::net::TcpStream;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_rustls::client::TlsStream;
use tokio_util::task::AbortOnDropHandle;

use super::body::Body;
use super::{CONNECT_TIMEOUT, TlsConnect, USER_AGENT, connect_tcp, tls};
use crate::error::{QueryError, cause_chain};

/// Streams we put on one connection even when the server allows more (Go's HTTP/2 server,
/// which Consul uses, allows 250 by default): past this, another connection shares the
/// load of one TCP stream's losses and of one reader.
pub(crate) const MAX_STREAMS_PER_CONNECTION: usize = 250;

/// Receive windows: large enough that a big health answer is not throttled by round trips.
const STREAM_WINDOW: u32 = 4 << 20;
const CONNECTION_WINDOW: u32 = 16 << 20;

/// What a server speaks, as learnt from the first connection's ALPN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    Unknown,
    Http2,
    Http1,
}

/// An answer: status, headers and the whole body, as it came (gzipped when the server did).
pub(crate) type Response = (StatusCode, HeaderMap, Body);

/// What [`Multiplexer::get`] did.
pub(crate) enum Multiplexed {
    Answer(Response),
    /// The server speaks HTTP/1.1 only: the query goes over HTTP/1.1. To the query that
    /// learnt it, the connection that did, still unused.
    Http1(Option<Box<TlsStream<TcpStream>>>),
}

/// A query's way to the server.
enum Claim {
    Stream(Stream),
    Http1(Option<Box<TlsStream<TcpStream>>>),
}

/// What a new connection turned out to be.
enum Opened {
    Lane(Lane),
    Http1(Box<TlsStream<TcpStream>>),
}

pub(crate) struct Multiplexer {
    /// The address as configured, for messages.
    address: String,
    /// Resolved afresh at each connect (a server behind a moving DNS name is followed).
    host: String,
    port: u16,
    /// Offers `h2` and `http/1.1`.
    tls: TlsConnect,
    /// The server's connection budget: one permit per open lane.
    budget: Arc<Semaphore>,
    max_body: usize,
    state: Mutex<Lanes>,
    /// A stream came free, a lane opened or closed: waiters look again.
    freed: Notify,
    /// One connect at a time, so a thousand watches starting together open one lane.
    connecting: tokio::sync::Mutex<()>,
}

struct Lanes {
    protocol: Protocol,
    lanes: Vec<Lane>,
    next_id: u64,
}

struct Lane {
    id: u64,
    send: h2::client::SendRequest<Bytes>,
    streams: usize,
    /// Set by the connection's task when it ends (peer gone, GOAWAY, error).
    closed: Arc<AtomicBool>,
    _driver: AbortOnDropHandle<()>,
    _permit: Option<OwnedSemaphorePermit>,
}

impl Lane {
    fn room(&self) -> bool {
        !self.closed.load(Ordering::Acquire)
            && self.streams < self.send.current_max_send_streams().min(MAX_STREAMS_PER_CONNECTION)
    }
}

/// One stream's claim on a lane; dropping it gives the stream back.
struct Stream {
    mux: Arc<Multiplexer>,
    lane: u64,
    send: h2::client::SendRequest<Bytes>,
    closed: Arc<AtomicBool>,
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.mux.release(self.lane);
    }
}

impl Multiplexer {
    pub(crate) fn new(
        address: &str,
        host: &str,
        port: u16,
        tls: TlsConnect,
        budget: Arc<Semaphore>,
        max_body: usize,
    ) -> Arc<Self> {
        Arc::new(Multiplexer {
            address: address.to_owned(),
            host: host.to_owned(),
            port,
            tls,
            budget,
            max_body,
            state: Mutex::new(Lanes { protocol: Protocol::Unknown, lanes: Vec::new(), next_id: 0 }),
            freed: Notify::new(),
            connecting: tokio::sync::Mutex::new(()),
        })
    }

    pub(crate) fn protocol(&self) -> Protocol {
        self.state.lock().expect("lanes poisoned").protocol
    }

    /// `GET uri` with `headers`, or word that the server speaks HTTP/1.1 only. The caller
    /// bounds the whole exchange with its deadline.
    pub(crate) async fn get(self: &Arc<Self>, uri: &str, headers: &HeaderMap) -> Result<Multiplexed, QueryError> {
        // A stream refused before the server read it (a GOAWAY racing our request, or a
        // lane that died idle) is retried once on another lane: routine, not a failure.
        for attempt in 0..2 {
            let stream = match self.stream().await? {
                Claim::Stream(stream) => stream,
                Claim::Http1(probe) => return Ok(Multiplexed::Http1(probe)),
            };
            let mut request = Request::get(uri).body(()).map_err(|e| self.network(e.to_string()))?;
            *request.headers_mut() = headers.clone();
            request.headers_mut().insert(http::header::USER_AGENT, HeaderValue::from_static(USER_AGENT));
            // As over HTTP/1.1: a large answer comes as a fraction of its JSON, kept so until
            // it is read (`Body`).
            request.headers_mut().insert(http::header::ACCEPT_ENCODING, HeaderValue::from_static("gzip"));
            let sent = async {
                let mut send = stream.send.clone().ready().await?;
                let (response, _) = send.send_request(request, true)?;
                Ok::<_, h2::Error>(response)
            }
            .await;
            let response = match sent {
                Ok(r) => r,
                Err(e) => {
                    stream.closed.store(true, Ordering::Release);
                    if attempt == 0 {
                        continue;
                    }
                    return Err(self.network(cause_chain(&e)));
                }
            };
            let response = match response.await {
                Ok(r) => r,
                Err(e) if attempt == 0 && refused(&e) => {
                    stream.closed.store(true, Ordering::Release);
                    continue;
                }
                Err(e) => return Err(self.network(cause_chain(&e))),
            };
            let (parts, mut body) = response.into_parts();
            let declared = parts.headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok());
            let declared = declared.and_then(|v| v.parse::<u64>().ok());
            if declared.is_some_and(|n| n > self.max_body as u64) {
                return Err(self.too_large());
            }
            // Room for what is announced (at most the limit): no doubling copies.
            let mut buf = BytesMut::with_capacity(declared.map_or(0, |n| n as usize));
            while let Some(chunk) = body.data().await {
                let chunk = chunk.map_err(|e| self.network(cause_chain(&e)))?;
                // Give the window back as we read, or a large answer stalls.
                let _ = body.flow_control().release_capacity(chunk.len());
                if buf.len() + chunk.len() > self.max_body {
                    return Err(self.too_large());
                }
                buf.extend_from_slice(&chunk);
            }
            drop(stream);
            let body = Body::new(&parts.headers, buf.freeze(), self.max_body)
                .map_err(|cause| QueryError::Body { address: self.address.clone(), cause })?;
            return Ok(Multiplexed::Answer((parts.status, parts.headers, body)));
        }
        Err(self.network("the server refused the stream twice".into()))
    }

    fn network(&self, cause: String) -> QueryError {
        QueryError::Network { address: self.address.clone(), cause }
    }

    fn too_large(&self) -> QueryError {
        QueryError::TooLarge { address: self.address.clone(), limit: self.max_body }
    }

    /// A stream on a lane with room, opening a lane if every one is full and the budget
    /// allows, else waiting for one to come free; or word that the server speaks HTTP/1.1.
    async fn stream(self: &Arc<Self>) -> Result<Claim, QueryError> {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if let Some(found) = self.take() {
                return Ok(found);
            }
            let gate = self.connecting.lock().await;
            if let Some(found) = self.take() {
                return Ok(found);
            }
            // The first connection, which learns the protocol, is paid for by the query
            // that opens it (that query holds a permit of its own, as HTTP/1.1 queries do);
            // every further one takes a permit of the budget.
            let probe = self.protocol() == Protocol::Unknown;
            let permit = match self.budget.clone().try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) if probe => None,
                Err(_) => {
                    drop(gate);
                    freed.await;
                    continue;
                }
            };
            // Boxed: a connect's state (the TCP, TLS and HTTP/2 handshakes) is most of this
            // future's size, and every query waiting for its answer would hold it too.
            let opened = Box::pin(self.connect(permit)).await;
            drop(gate);
            match opened? {
                Opened::Lane(lane) => {
                    let mut st = self.state.lock().expect("lanes poisoned");
                    st.protocol = Protocol::Http2;
                    st.lanes.push(lane);
                }
                Opened::Http1(probe) => {
                    self.state.lock().expect("lanes poisoned").protocol = Protocol::Http1;
                    self.freed.notify_waiters();
                    return Ok(Claim::Http1(Some(probe)));
                }
            }
            self.freed.notify_waiters();
        }
    }

    /// A stream, or word of an HTTP/1.1 server; `None`: no room.
    fn take(self: &Arc<Self>) -> Option<Claim> {
        let mut st = self.state.lock().expect("lanes poisoned");
        if st.protocol == Protocol::Http1 {
            return Some(Claim::Http1(None));
        }
        st.lanes.retain(|l| !l.closed.load(Ordering::Acquire) || l.streams > 0);
        let lane = st.lanes.iter_mut().find(|l| l.room())?;
        lane.streams += 1;
        Some(Claim::Stream(Stream {
            mux: self.clone(),
            lane: lane.id,
            send: lane.send.clone(),
            closed: lane.closed.clone(),
        }))
    }

    fn release(&self, id: u64) {
        let mut st = self.state.lock().expect("lanes poisoned");
        let Some(i) = st.lanes.iter().position(|l| l.id == id) else { return };
        st.lanes[i].streams -= 1;
        let lane = &st.lanes[i];
        // An empty lane goes unless it is the last open one (which keeps the next query
        // from paying for a handshake); its budget permit goes with it.
        if lane.streams == 0 && (lane.closed.load(Ordering::Acquire) || st.lanes.len() > 1) {
            st.lanes.remove(i);
        }
        drop(st);
        self.freed.notify_one();
    }

    /// Opens a connection, a lane unless the server chose HTTP/1.1.
    async fn connect(self: &Arc<Self>, permit: Option<OwnedSemaphorePermit>) -> Result<Opened, QueryError> {
        let tcp = connect_tcp(&self.address, &self.host, self.port).await?;
        let tls = self.tls.handshake(&self.address, tcp).await?;
        if tls.get_ref().1.alpn_protocol() != Some(b"h2") {
            return Ok(Opened::Http1(Box::new(tls)));
        }
        let tls_failure = Arc::new(Mutex::new(None));
        let tls = Recorder { inner: tls, failure: tls_failure.clone() };
        let (send, mut connection) = h2::client::Builder::new()
            // Until the server's SETTINGS arrive we claim one stream; the ping below waits
            // for them.
            .initial_max_send_streams(1)
            .initial_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .handshake::<_, Bytes>(tls)
            .await
            .map_err(|e| self.network(cause_chain(&e)))?;
        let mut ping = connection.ping_pong();
        let closed = Arc::new(AtomicBool::new(false));
        let (ended_tx, ended) = tokio::sync::oneshot::channel();
        let driver = {
            let closed = closed.clone();
            let mux: Weak<Multiplexer> = Arc::downgrade(self);
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!(error = %e, "Consul HTTP/2 connection ended");
                    let _ = ended_tx.send(e);
                }
                closed.store(true, Ordering::Release);
                if let Some(m) = mux.upgrade() {
                    m.freed.notify_waiters();
                }
            })
        };
        // The server's SETTINGS come before its answer to our PING: after it, the stream
        // limit we read is the server's.
        // It is also where a server that refuses our client certificate says so (TLS 1.3
        // reports that after the handshake): the connection's own error, read side
        // included, says more than the ping's.
        if let Some(p) = ping.as_mut() {
            let pinged = tokio::time::timeout(CONNECT_TIMEOUT, p.ping(h2::Ping::opaque()))
                .await
                .map_err(|_| self.network("no answer to an HTTP/2 PING after the handshake".into()))?;
            if let Err(e) = pinged {
                // h2 passes I/O errors on as text; the recorder kept the TLS one.
                let _ = tokio::time::timeout(Duration::from_secs(1), ended).await;
                let recorded = tls_failure.lock().expect("tls failure poisoned").take();
                return Err(match recorded {
                    Some(cause) => QueryError::Tls { address: self.address.clone(), cause },
                    None => self.network(cause_chain(&e)),
                });
            }
        }
        let id = {
            let mut st = self.state.lock().expect("lanes poisoned");
            st.next_id += 1;
            st.next_id
        };
        tracing::debug!(
            address = %self.address,
            lane = id,
            max_streams = send.current_max_send_streams(),
            "Consul HTTP/2 connection open"
        );
        Ok(Opened::Lane(Lane {
            id,
            send,
            streams: 0,
            closed,
            _driver: AbortOnDropHandle::new(driver),
            _permit: permit,
        }))
    }
}

/// Passes a TLS stream through, keeping the explanation of the first TLS error read from it
/// (a server's alert refusing our certificate), which h2 would reduce to text.
struct Recorder<T> {
    inner: T,
    failure: Arc<Mutex<Option<String>>>,
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Recorder<T> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let polled = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if let std::task::Poll::Ready(Err(e)) = &polled
            && let Some(why) = tls::explain(e)
        {
            self.failure.lock().expect("tls failure poisoned").get_or_insert(why);
        }
        polled
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Recorder<T> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// A stream the server did not process (it may be retried safely).
fn refused(e: &h2::Error) -> bool {
    e.reason() == Some(h2::Reason::REFUSED_STREAM) || (e.is_go_away() && e.reason() == Some(h2::Reason::NO_ERROR))
}

/// A header value that never prints (the ACL token).
pub(crate) fn sensitive(value: &str) -> Option<HeaderValue> {
    let mut h = HeaderValue::from_str(value).ok()?;
    h.set_sensitive(true);
    Some(h)
}

#[cfg(test)]
mod tests;
