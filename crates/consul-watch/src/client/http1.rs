//! HTTP/1.1 to one Consul server, over plain TCP or TLS, written for how we query Consul:
//! one GET at a time per connection, the answer read whole (inflated only when the caller
//! reads it), the connection kept alive for the next.
//!
//! Why not reqwest: every dedicated watch holds a connection for the whole of its blocking
//! query, so at a large budget the connections' resting memory is most of the operator's.
//! Through reqwest and hyper one costs about 40 KB: a task of its own, a dispatch channel,
//! write and read buffers and the pool's wrappers (docs/benchmarks.md, "Measured design
//! choices": heaptrack at 1,200 connections). Here a waiting query holds its socket (over TLS, with the TLS session's
//! state) and the few hundred bytes of the request it sent (kept to send again should the
//! connection turn out closed): the read buffer is allocated when the answer starts to
//! arrive.
//!
//! And the budget is exact: a connection is opened only by a query that found none idle,
//! and goes back idle before that query's slot of the budget is given back, so open
//! connections never outnumber the slots. (hyper's pool, which served HTTPS before, races
//! a new connect against a connection coming free and pools both.) Over TLS the first
//! connection, the one that learnt from ALPN that the server speaks HTTP/1.1 only, is kept
//! rather than closed.
//!
//! What it reads is what Go's `net/http` (Consul's server) writes: a `Content-Length` or
//! `chunked` body, gzipped when asked, `Connection: close` when the server will close. A
//! response without either framing is read to the end of the connection, which is then
//! not reused. Interim `1xx` answers are skipped.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::client::TlsStream;

use super::body::Body;
use super::multiplex::Response;
use super::{TlsConnect, connect_tcp};
use crate::error::QueryError;

/// An idle connection older than this is closed rather than reused: Go's servers close
/// idle connections after their own timeout, and a connection we keep counts against the
/// agent's per-client limit.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Limits on what precedes the body: its size, and its header count.
const MAX_HEAD: usize = 64 * 1024;
const MAX_HEADERS: usize = 64;
/// How much is read at a time when the size of what comes is not known.
const READ_SIZE: usize = 8 * 1024;

/// Kept-alive connections to one server, and how to make more.
pub(crate) struct Http1 {
    /// The address as configured, for messages.
    address: String,
    /// Looked up afresh at each connect (a server behind a moving DNS name is followed).
    host: String,
    port: u16,
    /// `None`: plain TCP.
    tls: Option<TlsConnect>,
    /// The `Host` header: the URL's host and port.
    authority: String,
    max_idle: usize,
    max_body: usize,
    /// Idle connections, the most recently used last (taken first: the least likely to
    /// have been closed by the server).
    idle: Mutex<VecDeque<Idle>>,
}

struct Idle {
    conn: Conn,
    since: Instant,
}

/// One connection to the server.
pub(crate) enum Conn {
    Tcp(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

/// Why an exchange failed.
#[derive(Debug)]
enum Failure {
    /// The request could not be sent: on a reused connection, the server had closed it
    /// while idle, and the request goes again on a new one. Once a request is sent, a
    /// connection that closes without an answer is an error, as in hyper: the server may
    /// have gone away mid-query, and the watch must hear of it (it forgets its index).
    Unsent(String),
    Network(String),
    Malformed(String),
    TooLarge,
}

impl Http1 {
    /// The client of `url`, which connects to `host` and `port`, over TLS when `tls` is
    /// given (the `Host` header is the URL's: `serverName` when that is set). Keeps at most
    /// `max_idle` idle connections; answers above `max_body` bytes (before or after
    /// decompression) fail.
    pub(crate) fn new(
        address: &str,
        url: &url::Url,
        host: String,
        port: u16,
        tls: Option<TlsConnect>,
        max_idle: usize,
        max_body: usize,
    ) -> Self {
        // As the URL writes it: an IPv6 host in brackets, a default port left out.
        let shown = url.host_str().unwrap_or(&host);
        let authority = match url.port() {
            Some(p) => format!("{shown}:{p}"),
            None => shown.to_owned(),
        };
        Http1 {
            address: address.to_owned(),
            host,
            port,
            tls,
            authority,
            max_idle,
            max_body,
            idle: Mutex::new(VecDeque::new()),
        }
    }

    /// `GET target` (a path and query) with `headers` added (the token, as a sensitive value
    /// that never prints). The caller bounds the whole exchange in time.
    pub(crate) async fn get(&self, target: &str, headers: &HeaderMap) -> Result<Response, QueryError> {
        let request = self.request(target, headers);
        loop {
            let (conn, reused) = match self.take_idle() {
                Some(conn) => (conn, true),
                // Boxed: a connect (DNS, TCP, TLS) is most of this future's size, and a
                // blocking query waiting on a kept connection would hold it all along.
                None => (Box::pin(self.connect()).await?, false),
            };
            match exchange(conn, &request, self.max_body).await {
                Ok((response, keep)) => {
                    if let Some(conn) = keep {
                        self.keep(conn);
                    }
                    return Ok(response);
                }
                // Each idle connection is tried at most once, so this ends with a new one.
                Err(Failure::Unsent(_)) if reused => continue,
                Err(Failure::Unsent(cause) | Failure::Network(cause)) => return Err(self.network(cause)),
                Err(Failure::Malformed(cause)) => {
                    return Err(QueryError::Body { address: self.address.clone(), cause });
                }
                Err(Failure::TooLarge) => {
                    return Err(QueryError::TooLarge { address: self.address.clone(), limit: self.max_body });
                }
            }
        }
    }

    /// Keeps `conn` idle for the next query (if fewer than `max_idle` are): a connection an
    /// answer left reusable, or the TLS connection that found the server speaks HTTP/1.1.
    pub(crate) fn keep(&self, conn: Conn) {
        let mut idle = self.idle.lock().expect("idle connections poisoned");
        expire(&mut idle);
        if idle.len() < self.max_idle {
            idle.push_back(Idle { conn, since: Instant::now() });
        }
    }

    fn request(&self, target: &str, headers: &HeaderMap) -> Vec<u8> {
        let mut r = Vec::with_capacity(256 + target.len());
        r.extend_from_slice(b"GET ");
        r.extend_from_slice(target.as_bytes());
        r.extend_from_slice(b" HTTP/1.1\r\nHost: ");
        r.extend_from_slice(self.authority.as_bytes());
        r.extend_from_slice(b"\r\nUser-Agent: ");
        r.extend_from_slice(super::USER_AGENT.as_bytes());
        r.extend_from_slice(b"\r\nAccept-Encoding: gzip\r\n");
        for (name, value) in headers {
            r.extend_from_slice(name.as_str().as_bytes());
            r.extend_from_slice(b": ");
            r.extend_from_slice(value.as_bytes());
            r.extend_from_slice(b"\r\n");
        }
        r.extend_from_slice(b"\r\n");
        r
    }

    async fn connect(&self) -> Result<Conn, QueryError> {
        let tcp = connect_tcp(&self.address, &self.host, self.port).await?;
        Ok(match &self.tls {
            None => Conn::Tcp(tcp),
            Some(tls) => Conn::Tls(Box::new(tls.handshake(&self.address, tcp).await?)),
        })
    }

    /// The most recently used idle connection that is still open, closing the expired ones.
    fn take_idle(&self) -> Option<Conn> {
        let mut idle = self.idle.lock().expect("idle connections poisoned");
        expire(&mut idle);
        while let Some(Idle { mut conn, .. }) = idle.pop_back() {
            if conn.reusable() {
                return Some(conn);
            }
        }
        None
    }

    fn network(&self, cause: String) -> QueryError {
        QueryError::Network { address: self.address.clone(), cause }
    }

    /// Idle connections now kept (for tests).
    #[cfg(test)]
    pub(crate) fn idle(&self) -> usize {
        self.idle.lock().unwrap().len()
    }
}

impl Conn {
    fn tcp(&self) -> &TcpStream {
        match self {
            Conn::Tcp(tcp) => tcp,
            Conn::Tls(tls) => tls.get_ref().0,
        }
    }

    /// Whether an idle connection can carry a request: it has nothing to read. An end of
    /// stream (the server closed it) or stray bytes make it unusable. Asked of the kernel
    /// (a peek that does not wait), not of the runtime's readiness, which may not have seen
    /// the close yet. Over TLS, what waits may be records that are no answer (TLS 1.3 session
    /// tickets, which come after the handshake) or an alert closing the connection: TLS reads
    /// them, and the connection is usable if that leaves nothing to read.
    fn reusable(&mut self) -> bool {
        let mut probe = [std::mem::MaybeUninit::uninit(); 1];
        match socket2::SockRef::from(self.tcp()).peek(&mut probe) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => true,
            Ok(0) | Err(_) => false,
            Ok(_) => match self {
                Conn::Tcp(_) => false,
                Conn::Tls(tls) => {
                    let (tcp, session) = tls.get_mut();
                    tls_idle(tcp, session)
                }
            },
        }
    }

    /// Reads what has arrived into `buf`'s spare room without waiting: `WouldBlock` when
    /// nothing has (over TLS, also when what arrived is no whole record yet).
    fn try_read_buf(&mut self, buf: &mut BytesMut) -> std::io::Result<usize> {
        match self {
            Conn::Tcp(tcp) => tcp.try_read_buf(buf),
            Conn::Tls(tls) => {
                let mut cx = Context::from_waker(Waker::noop());
                match tokio_util::io::poll_read_buf(Pin::new(tls.as_mut()), &mut cx, buf) {
                    Poll::Ready(read) => read,
                    Poll::Pending => Err(std::io::ErrorKind::WouldBlock.into()),
                }
            }
        }
    }

    /// Waits until the socket has something to read.
    async fn readable(&self) -> std::io::Result<()> {
        self.tcp().readable().await
    }
}

impl AsyncRead for Conn {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Tcp(tcp) => Pin::new(tcp).poll_read(cx, buf),
            Conn::Tls(tls) => Pin::new(tls.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Conn::Tcp(tcp) => Pin::new(tcp).poll_write(cx, data),
            Conn::Tls(tls) => Pin::new(tls.as_mut()).poll_write(cx, data),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Tcp(tcp) => Pin::new(tcp).poll_flush(cx),
            Conn::Tls(tls) => Pin::new(tls.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Conn::Tcp(tcp) => Pin::new(tcp).poll_shutdown(cx),
            Conn::Tls(tls) => Pin::new(tls.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Whether a TLS session has nothing to read once the records waiting on its socket are
/// taken in. They are read from the socket itself: through the runtime, a read returns
/// `Pending` while its reactor has not yet seen them arrive, and a closed connection would
/// pass for an idle one. Whatever is read stays in the session, as a read through the
/// runtime would leave it.
fn tls_idle(tcp: &TcpStream, session: &mut rustls::ClientConnection) -> bool {
    let socket = socket2::SockRef::from(tcp);
    let mut from_socket: &socket2::Socket = &socket;
    loop {
        match session.read_tls(&mut from_socket) {
            // The end of the stream: no answer can come on it.
            Ok(0) => return false,
            Ok(_) => {
                if session.process_new_packets().is_err() {
                    return false;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(_) => return false,
        }
    }
    // Nothing to read: `WouldBlock`. A `close_notify` reads as the end (`Ok(0)`), an answer
    // nobody asked for as bytes.
    let mut byte = [0u8; 1];
    matches!(std::io::Read::read(&mut session.reader(), &mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

/// Closes the connections idle for longer than [`IDLE_TIMEOUT`] (the oldest are first).
fn expire(idle: &mut VecDeque<Idle>) {
    while idle.front().is_some_and(|i| i.since.elapsed() >= IDLE_TIMEOUT) {
        idle.pop_front();
    }
}

/// Sends `request` and reads its answer whole. Returns the connection too when it can carry
/// the next request.
async fn exchange(mut conn: Conn, request: &[u8], max_body: usize) -> Result<(Response, Option<Conn>), Failure> {
    // (A flush sends what TLS still holds; over TCP it does nothing.)
    if let Err(e) = async {
        conn.write_all(request).await?;
        conn.flush().await
    }
    .await
    {
        return Err(Failure::Unsent(format!("cannot send the request: {e}")));
    }
    let (head, mut rest) = read_head(&mut conn).await?;
    let framing = framing(&head)?;
    let (body, clean) = match framing {
        Framing::Empty => (BytesMut::new(), rest.is_empty()),
        Framing::Length(n) if n > max_body as u64 => return Err(Failure::TooLarge),
        Framing::Length(n) => {
            let n = n as usize;
            let clean = rest.len() <= n;
            rest.truncate(n);
            // Room for what is announced (checked against the limit above), so that a large
            // answer is read in place rather than through doubling buffers.
            rest.reserve(n - rest.len());
            while rest.len() < n {
                if read_more(&mut conn, &mut rest).await? == 0 {
                    return Err(Failure::Network("the connection closed in the middle of the answer".into()));
                }
            }
            (rest, clean)
        }
        Framing::Chunked => read_chunked(&mut conn, rest, max_body).await?,
        Framing::ToClose => {
            loop {
                if rest.len() > max_body {
                    return Err(Failure::TooLarge);
                }
                rest.reserve(READ_SIZE);
                if read_more(&mut conn, &mut rest).await? == 0 {
                    break;
                }
            }
            (rest, false)
        }
    };
    // Inflated when it is read (see `body`): the change feed streams its largest answer.
    let body = Body::new(&head.headers, body.freeze(), max_body).map_err(Failure::Malformed)?;
    let keep = (clean && head.keep_alive && framing != Framing::ToClose).then_some(conn);
    Ok(((head.status, head.headers, body), keep))
}

struct Head {
    status: StatusCode,
    headers: HeaderMap,
    /// HTTP/1.1 without `Connection: close`.
    keep_alive: bool,
}

/// Reads up to the end of the final (non-1xx) response head; returns it and what followed.
/// Holds no buffer while nothing has arrived: a blocking query waits here.
async fn read_head(conn: &mut Conn) -> Result<(Head, BytesMut), Failure> {
    let mut buf = BytesMut::new();
    let mut answered = false;
    loop {
        if buf.capacity() - buf.len() < READ_SIZE / 2 {
            buf.reserve(READ_SIZE);
        }
        // What has arrived is read first: TLS may hold the rest of an answer it already
        // took from the socket, which no readiness of the socket would announce.
        match conn.try_read_buf(&mut buf) {
            Ok(0) if !answered => {
                return Err(Failure::Network("the server closed the connection without answering".into()));
            }
            Ok(0) => return Err(Failure::Network("the connection closed in the middle of the answer".into())),
            Ok(_) => answered = true,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                // Nothing yet: a query waits here holding no buffer.
                if buf.is_empty() {
                    buf = BytesMut::new();
                }
                if let Err(e) = conn.readable().await {
                    return Err(Failure::Network(e.to_string()));
                }
                continue;
            }
            Err(e) => return Err(Failure::Network(e.to_string())),
        }
        while let Some((head, used)) = parse_head(&buf)? {
            buf.advance(used);
            if let Some(head) = head {
                return Ok((head, buf));
            }
        }
        if buf.len() > MAX_HEAD {
            return Err(Failure::Malformed(format!("a response head over {MAX_HEAD} bytes")));
        }
    }
}

/// One response head from the start of `buf`, and its length; `Some((None, n))` for an
/// interim (1xx) one, `None` when more is needed.
fn parse_head(buf: &[u8]) -> Result<Option<(Option<Head>, usize)>, Failure> {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut r = httparse::Response::new(&mut slots);
    let used = match r.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(Failure::Malformed(format!("not an HTTP/1.1 answer: {e}"))),
    };
    let code = r.code.unwrap_or(0);
    let status = StatusCode::from_u16(code).map_err(|_| Failure::Malformed(format!("status {code}")))?;
    if status.is_informational() {
        return Ok(Some((None, used)));
    }
    let mut headers = HeaderMap::with_capacity(r.headers.len());
    for h in r.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes());
        let value = HeaderValue::from_bytes(h.value);
        match (name, value) {
            (Ok(name), Ok(value)) => {
                headers.append(name, value);
            }
            _ => return Err(Failure::Malformed(format!("a malformed header {:?}", h.name))),
        }
    }
    let close = headers
        .get_all(CONNECTION)
        .iter()
        .any(|v| v.as_bytes().split(|&b| b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(b"close")));
    let keep_alive = r.version == Some(1) && !close;
    Ok(Some((Some(Head { status, headers, keep_alive }), used)))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Empty,
    Length(u64),
    Chunked,
    ToClose,
}

/// How the body's end is known (RFC 9112 section 6.3, for answers to a GET).
fn framing(head: &Head) -> Result<Framing, Failure> {
    if head.status == StatusCode::NO_CONTENT || head.status == StatusCode::NOT_MODIFIED {
        return Ok(Framing::Empty);
    }
    if let Some(last) = head.headers.get_all(TRANSFER_ENCODING).iter().next_back() {
        let chunked = last
            .as_bytes()
            .rsplit(|&b| b == b',')
            .next()
            .is_some_and(|t| t.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        return Ok(if chunked { Framing::Chunked } else { Framing::ToClose });
    }
    let mut lengths = head.headers.get_all(CONTENT_LENGTH).iter();
    let Some(first) = lengths.next() else { return Ok(Framing::ToClose) };
    let parse = |v: &HeaderValue| v.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok());
    let n = parse(first).ok_or_else(|| Failure::Malformed("an unreadable Content-Length".into()))?;
    if lengths.any(|v| parse(v) != Some(n)) {
        return Err(Failure::Malformed("conflicting Content-Length headers".into()));
    }
    Ok(Framing::Length(n))
}

/// Reads into `buf`'s spare room (making some if there is none); 0 at the end of stream.
async fn read_more(conn: &mut Conn, buf: &mut BytesMut) -> Result<usize, Failure> {
    if buf.capacity() == buf.len() {
        buf.reserve(READ_SIZE);
    }
    conn.read_buf(buf).await.map_err(|e| Failure::Network(e.to_string()))
}

/// A `chunked` body, from `raw` (what followed the head) and the connection. Returns the
/// body, and whether nothing followed it (the connection can be reused).
async fn read_chunked(conn: &mut Conn, mut raw: BytesMut, max_body: usize) -> Result<(BytesMut, bool), Failure> {
    let mut body = BytesMut::new();
    loop {
        match next_chunk(&raw)? {
            Chunk::Data { start, len } => {
                // (`len` may be any 64-bit size a server writes: compared, never added.)
                if len > max_body - body.len() {
                    return Err(Failure::TooLarge);
                }
                if raw.len() >= start + len + 2 {
                    if &raw[start + len..start + len + 2] != b"\r\n" {
                        return Err(Failure::Malformed("a chunk not followed by CRLF".into()));
                    }
                    body.extend_from_slice(&raw[start..start + len]);
                    raw.advance(start + len + 2);
                    continue;
                }
                // Room for the rest of this chunk, read in place.
                raw.reserve(start + len + 2 - raw.len());
            }
            Chunk::Last { end } => return Ok((body, raw.len() == end)),
            Chunk::More => {}
        }
        if read_more(conn, &mut raw).await? == 0 {
            return Err(Failure::Network("the connection closed in the middle of the answer".into()));
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Chunk {
    /// A chunk whose data starts at `start` (complete or not).
    Data { start: usize, len: usize },
    /// The last chunk and its trailers end at `end`.
    Last { end: usize },
    /// Its size line (or trailers) are not all here yet.
    More,
}

fn next_chunk(raw: &[u8]) -> Result<Chunk, Failure> {
    let bad = || Failure::Malformed("a malformed chunk size".into());
    let (start, len) = match httparse::parse_chunk_size(raw) {
        Ok(httparse::Status::Complete((start, len))) => (start, usize::try_from(len).map_err(|_| bad())?),
        Ok(httparse::Status::Partial) if raw.len() > MAX_HEAD => return Err(bad()),
        Ok(httparse::Status::Partial) => return Ok(Chunk::More),
        Err(_) => return Err(bad()),
    };
    if len > 0 {
        return Ok(Chunk::Data { start, len });
    }
    // Trailers (ignored) end with an empty line.
    let after = &raw[start..];
    if after.starts_with(b"\r\n") {
        return Ok(Chunk::Last { end: start + 2 });
    }
    match memchr::memmem::find(after, b"\r\n\r\n") {
        Some(i) => Ok(Chunk::Last { end: start + i + 4 }),
        None if after.len() > MAX_HEAD => Err(Failure::Malformed("trailers over 64 KiB".into())),
        None => Ok(Chunk::More),
    }
}

#[cfg(test)]
mod tests;
