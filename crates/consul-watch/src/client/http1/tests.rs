//! Against scripted servers on loopback: each accepted connection is handed to a script
//! running on a thread of its own (so its allocations are not counted as the client's).

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream as StdStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

const LIMIT: usize = 1 << 20;

/// A server whose `script` gets each accepted connection's number (from 0), a reader of
/// its requests and the connection to answer on.
struct Server {
    url: url::Url,
    accepted: Arc<AtomicUsize>,
}

fn serve(script: impl Fn(usize, BufReader<StdStream>, StdStream) + Send + Sync + 'static) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = url::Url::parse(&format!("http://{}", listener.local_addr().unwrap())).unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    let script = Arc::new(script);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            let n = counter.fetch_add(1, Ordering::SeqCst);
            let script = script.clone();
            let reader = BufReader::new(conn.try_clone().unwrap());
            std::thread::spawn(move || script(n, reader, conn));
        }
    });
    Server { url, accepted }
}

/// The next request's head, or `None` at the end of the connection.
fn request(reader: &mut BufReader<StdStream>) -> Option<String> {
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        head.push_str(&line);
        if line == "\r\n" {
            return Some(head);
        }
    }
}

/// Answers every request of the connection with `answer`.
fn answering(answer: &'static [u8]) -> impl Fn(usize, BufReader<StdStream>, StdStream) + Send + Sync + 'static {
    move |_, mut reader, mut conn| {
        while request(&mut reader).is_some() {
            conn.write_all(answer).unwrap();
        }
    }
}

/// A client of `url` as `HttpClient::new` makes one.
fn plain(url: &url::Url, max_idle: usize, max_body: usize) -> Http1 {
    let (host, port) = super::super::host_and_port(url.as_str(), url).unwrap();
    Http1::new(url.as_str(), url, host, port, None, max_idle, max_body)
}

fn client(s: &Server) -> Http1 {
    plain(&s.url, 4, LIMIT)
}

async fn get(p: &Http1) -> Result<(StatusCode, HeaderMap, bytes::Bytes), QueryError> {
    inflated(p.get("/v1/health/service/web?index=1", &HeaderMap::new()).await)
}

/// An answer with its body inflated, as `HttpClient` reads it.
fn inflated(got: Result<Response, QueryError>) -> Result<(StatusCode, HeaderMap, bytes::Bytes), QueryError> {
    use super::super::body::BodyError;
    let (status, headers, body) = got?;
    let body = body.whole().map_err(|e| match e {
        BodyError::TooLarge => QueryError::TooLarge { address: String::new(), limit: 0 },
        BodyError::Malformed(cause) => QueryError::Body { address: String::new(), cause },
    })?;
    Ok((status, headers, body))
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

#[tokio::test]
async fn a_sized_answer_is_read_and_its_connection_kept_for_the_next() {
    let s = serve(answering(b"HTTP/1.1 200 OK\r\nX-Consul-Index: 7\r\nContent-Length: 2\r\n\r\n[]"));
    let p = client(&s);
    for _ in 0..3 {
        let (status, headers, body) = get(&p).await.unwrap();
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers["x-consul-index"], "7");
        assert_eq!(&body[..], b"[]");
    }
    assert_eq!(s.accepted.load(Ordering::SeqCst), 1, "one connection for three queries");
    assert_eq!(p.idle(), 1);
}

#[tokio::test]
async fn a_chunked_answer_arriving_in_pieces_is_read_whole_and_the_connection_kept() {
    let s = serve(|_, mut reader, mut conn| {
        while request(&mut reader).is_some() {
            let parts: [&[u8]; 7] = [
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-",
                b"Encoding: chunked\r\n\r\n4;ext=1\r",
                b"\n[{\"a\r\n",
                b"3\r\n\":1\r\n1",
                b"\r\n}\r\n1\r\n]\r\n0\r\n",
                b"Trailer: x\r\n",
                b"\r\n",
            ];
            for part in parts {
                conn.write_all(part).unwrap();
                conn.flush().unwrap();
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    });
    let p = client(&s);
    for _ in 0..2 {
        let (status, _, body) = get(&p).await.unwrap();
        assert_eq!(status, StatusCode::OK);
        assert_eq!(&body[..], br#"[{"a":1}]"#);
    }
    assert_eq!(s.accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_gzipped_answer_is_inflated_within_the_limit() {
    let json = br#"[{"Service":{"ID":"web-1"}}]"#.repeat(1000);
    let gz = gzip(&json);
    let answer: &'static [u8] = Box::leak(
        [format!("HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: {}\r\n\r\n", gz.len()).as_bytes(), &gz]
            .concat()
            .into_boxed_slice(),
    );
    let s = serve(answering(answer));
    let (_, _, body) = get(&client(&s)).await.unwrap();
    assert_eq!(body, json);
    // The same answer past a smaller limit: a small gzip that inflates beyond it fails.
    let small = plain(&s.url, 4, json.len() - 1);
    assert!(gz.len() < json.len() - 1);
    assert!(matches!(get(&small).await, Err(QueryError::TooLarge { .. })));
}

#[tokio::test]
async fn answers_above_the_limit_fail_however_they_are_framed() {
    let announced = serve(answering(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"));
    let p = plain(&announced.url, 4, 99);
    assert!(matches!(get(&p).await, Err(QueryError::TooLarge { limit: 99, .. })));
    let chunked = serve(answering(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n40\r\n"));
    let p = plain(&chunked.url, 4, 63);
    assert!(matches!(get(&p).await, Err(QueryError::TooLarge { .. })));
    let huge = serve(answering(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\nffffffffffffffff\r\n"));
    assert!(matches!(get(&client(&huge)).await, Err(QueryError::TooLarge { .. })), "a size near 2^64 is too large");
}

#[tokio::test]
async fn connection_close_and_unframed_answers_are_not_reused() {
    let close = serve(answering(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"));
    let p = client(&close);
    get(&p).await.unwrap();
    get(&p).await.unwrap();
    assert_eq!(close.accepted.load(Ordering::SeqCst), 2);
    assert_eq!(p.idle(), 0);

    let to_close = serve(|_, mut reader, mut conn| {
        request(&mut reader);
        conn.write_all(b"HTTP/1.1 200 OK\r\n\r\n{\"read\":").unwrap();
        conn.write_all(b"\"to the end\"}").unwrap();
    });
    let p = client(&to_close);
    let (_, _, body) = get(&p).await.unwrap();
    assert_eq!(&body[..], br#"{"read":"to the end"}"#);
    assert_eq!(p.idle(), 0);
}

/// Go's server closes a kept-alive connection that stayed idle past its timeout; the next
/// query goes out on a new connection instead of failing.
#[tokio::test]
async fn a_connection_the_server_closed_while_idle_is_replaced_not_reported() {
    let (closed_tx, closed_rx) = std::sync::mpsc::channel();
    let s = serve(move |n, mut reader, mut conn| {
        while request(&mut reader).is_some() {
            conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]").unwrap();
            if n == 0 {
                conn.shutdown(std::net::Shutdown::Both).unwrap();
                closed_tx.send(()).unwrap();
                return;
            }
        }
    });
    let p = client(&s);
    get(&p).await.unwrap();
    assert_eq!(p.idle(), 1);
    closed_rx.recv().unwrap();
    let (status, _, _) = get(&p).await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(s.accepted.load(Ordering::SeqCst), 2);
}

/// A server that goes away mid-query: the query fails (its watch must forget its index),
/// it is not sent again behind the watch's back.
#[tokio::test]
async fn a_query_the_server_drops_is_an_error_even_on_a_reused_connection() {
    let s = serve(|_, mut reader, mut conn| {
        request(&mut reader).unwrap();
        conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]").unwrap();
        // Reads the next request, then closes without answering.
        request(&mut reader);
    });
    let p = client(&s);
    get(&p).await.unwrap();
    let err = get(&p).await.unwrap_err();
    assert!(err.unreachable(), "{err}");
    assert!(err.to_string().contains("without answering"), "{err}");
    assert_eq!(s.accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_new_connection_closed_without_an_answer_is_a_network_error() {
    let s = serve(|_, mut reader, _conn| {
        request(&mut reader);
    });
    let err = get(&client(&s)).await.unwrap_err();
    assert!(err.unreachable(), "{err}");
    assert!(err.to_string().contains("without answering"), "{err}");
    assert_eq!(s.accepted.load(Ordering::SeqCst), 1, "a new connection is not tried twice");
}

#[tokio::test]
async fn a_refused_connection_names_the_address() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = url::Url::parse(&format!("http://127.0.0.1:{port}")).unwrap();
    let err = get(&plain(&url, 4, LIMIT)).await.unwrap_err();
    assert!(err.unreachable());
    assert!(err.to_string().contains(&format!("127.0.0.1:{port}")), "{err}");
}

#[tokio::test]
async fn malformed_answers_are_body_errors_that_never_show_the_token() {
    for answer in [
        &b"SMTP ready\r\n\r\n"[..],
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n[]",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Encoding: br\r\nContent-Length: 2\r\n\r\n[]",
        b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\n[]",
    ] {
        let s = serve(answering(answer));
        let mut headers = HeaderMap::new();
        headers.insert("x-consul-token", super::super::multiplex::sensitive("s3cr3t-token").unwrap());
        let err = inflated(client(&s).get("/v1/status/leader", &headers).await).unwrap_err();
        assert!(matches!(err, QueryError::Body { .. }), "{answer:?}: {err}");
        assert!(!format!("{err} {err:?}").contains("s3cr3t"), "{err:?}");
    }
}

#[tokio::test]
async fn the_request_names_the_host_asks_for_gzip_and_carries_the_token() {
    let (tx, rx) = std::sync::mpsc::channel();
    let s = serve(move |_, mut reader, mut conn| {
        let head = request(&mut reader).unwrap();
        tx.send(head).unwrap();
        conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]").unwrap();
    });
    let mut headers = HeaderMap::new();
    headers.insert("x-consul-token", super::super::multiplex::sensitive("tok").unwrap());
    client(&s).get("/v1/health/service/a%2Fb?dc=x&index=3", &headers).await.unwrap();
    let head = rx.recv().unwrap().to_ascii_lowercase();
    assert!(head.starts_with("get /v1/health/service/a%2fb?dc=x&index=3 http/1.1\r\n"), "{head}");
    let port = s.url.port().unwrap();
    for line in
        [format!("host: 127.0.0.1:{port}\r\n"), "accept-encoding: gzip\r\n".into(), "x-consul-token: tok\r\n".into()]
    {
        assert!(head.contains(&line), "{line:?} in {head}");
    }
}

#[tokio::test]
async fn idle_connections_are_capped_and_expire() {
    let s = serve(answering(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]"));
    let p = plain(&s.url, 2, LIMIT);
    // Three at once: none finds an idle connection.
    let (a, b, c) = tokio::join!(get(&p), get(&p), get(&p));
    assert!(a.is_ok() && b.is_ok() && c.is_ok());
    assert_eq!(s.accepted.load(Ordering::SeqCst), 3);
    assert_eq!(p.idle(), 2, "at most max_idle are kept");
    tokio::time::pause();
    tokio::time::advance(IDLE_TIMEOUT).await;
    get(&p).await.unwrap();
    assert_eq!(s.accepted.load(Ordering::SeqCst), 4, "expired connections are not reused");
    assert_eq!(p.idle(), 1);
}

/// The point of this client: a query waiting for its answer holds its socket, not buffers.
/// (Through reqwest and hyper a kept-alive connection holds about 40 KB.)
#[tokio::test]
async fn a_waiting_query_holds_no_buffers() {
    let (seen_tx, seen_rx) = std::sync::mpsc::channel();
    let (answer_tx, answer_rx) = std::sync::mpsc::channel::<()>();
    let answer_rx = std::sync::Mutex::new(answer_rx);
    let s = serve(move |_, mut reader, mut conn| {
        // The first query is answered at once; the second once the test has measured.
        request(&mut reader).unwrap();
        conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]").unwrap();
        request(&mut reader).unwrap();
        seen_tx.send(()).unwrap();
        answer_rx.lock().unwrap().recv().unwrap();
        conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}").unwrap();
    });
    let p = client(&s);
    get(&p).await.unwrap();
    let before = heap_peak::live_heap();
    let mut waiting = std::pin::pin!(get(&p));
    let held = std::future::poll_fn(|cx| {
        assert!(waiting.as_mut().poll(cx).is_pending());
        match seen_rx.try_recv() {
            Ok(()) => std::task::Poll::Ready(heap_peak::live_heap() - before),
            Err(_) => {
                cx.waker().wake_by_ref();
                std::task::Poll::Pending
            }
        }
    })
    .await;
    eprintln!("a waiting query holds {held} bytes");
    assert!(held < 1024, "a waiting query holds {held} bytes");
    answer_tx.send(()).unwrap();
    assert_eq!(&waiting.await.unwrap().2[..], b"{}");
}

/// A TLS server on loopback (a certificate for 127.0.0.1 made here) whose `script` gets
/// each accepted connection, after the handshake, and its number.
fn serve_tls(
    script: impl Fn(usize, &mut rustls::StreamOwned<rustls::ServerConnection, StdStream>) + Send + Sync + 'static,
) -> (Server, Http1) {
    let rcgen::CertifiedKey { cert, signing_key } =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let key = rustls::pki_types::PrivateKeyDer::try_from(signing_key.serialize_der()).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], key)
        .unwrap();
    let config = Arc::new(config);
    let script = Arc::new(script);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = url::Url::parse(&format!("https://{}", listener.local_addr().unwrap())).unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            let n = counter.fetch_add(1, Ordering::SeqCst);
            let (config, script) = (config.clone(), script.clone());
            std::thread::spawn(move || {
                let mut tls = rustls::StreamOwned::new(rustls::ServerConnection::new(config).unwrap(), conn);
                while tls.conn.is_handshaking() {
                    if tls.conn.complete_io(&mut tls.sock).is_err() {
                        return;
                    }
                }
                script(n, &mut tls);
            });
        }
    });
    let settings = consul_resolver_core::keys::TlsSettings { ca_pem: Some(cert.pem().into()), ..Default::default() };
    let config = super::super::tls::client_config(Some(&settings), super::super::tls::Offer::Http1).unwrap();
    let connect = TlsConnect::new(url.as_str(), config, "127.0.0.1").unwrap();
    let (host, port) = super::super::host_and_port(url.as_str(), &url).unwrap();
    let client = Http1::new(url.as_str(), &url, host, port, Some(connect), 4, LIMIT);
    (Server { url, accepted }, client)
}

/// Reads one request head from a TLS connection; `None` at its end.
fn tls_request(tls: &mut impl std::io::Read) -> Option<String> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if tls.read(&mut byte).ok()? == 0 {
            return None;
        }
        head.push(byte[0]);
    }
    String::from_utf8(head).ok()
}

/// Over TLS 1.3 the server sends session tickets after the handshake: records that wait on
/// a connection nobody has read yet, as on the one that learnt the server speaks HTTP/1.1
/// only (the multiplexer's first). They are no reason to drop it.
#[tokio::test]
async fn over_tls_a_fresh_connection_with_session_tickets_waiting_is_used() {
    let (s, p) = serve_tls(|_, tls| {
        // The tickets go out as the server reads on after the handshake.
        while tls_request(tls).is_some() {
            tls.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]").unwrap();
            tls.flush().unwrap();
        }
    });
    let tcp = super::super::connect_tcp(s.url.as_str(), "127.0.0.1", s.url.port().unwrap()).await.unwrap();
    let tls = p.tls.as_ref().unwrap().handshake(s.url.as_str(), tcp).await.unwrap();
    // Until the tickets are there to be read.
    tls.get_ref().0.readable().await.unwrap();
    p.keep(Conn::Tls(Box::new(tls)));
    for _ in 0..2 {
        let (status, _, body) = get(&p).await.unwrap();
        assert_eq!((status, &body[..]), (StatusCode::OK, &b"[]"[..]));
    }
    assert_eq!(s.accepted.load(Ordering::SeqCst), 1, "the fresh connection carried both queries");
    assert_eq!(p.idle(), 1);
}

/// A TLS server closes an idle connection with an alert (`close_notify`) before its FIN:
/// the next query goes out on a new connection instead of failing, even when the runtime
/// has not yet seen the close (its reactor has not run since the connection was last read).
#[tokio::test]
async fn over_tls_a_connection_the_server_closed_while_idle_is_replaced_not_reported() {
    let (closed_tx, closed_rx) = std::sync::mpsc::channel();
    let (close_tx, close_rx) = std::sync::mpsc::channel::<()>();
    let close_rx = std::sync::Mutex::new(close_rx);
    let (s, p) = serve_tls(move |n, tls| {
        while tls_request(tls).is_some() {
            tls.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]").unwrap();
            tls.flush().unwrap();
            if n == 0 {
                close_rx.lock().unwrap().recv().unwrap();
                tls.conn.send_close_notify();
                tls.conn.complete_io(&mut tls.sock).unwrap();
                tls.sock.shutdown(std::net::Shutdown::Both).unwrap();
                closed_tx.send(()).unwrap();
                return;
            }
        }
    });
    get(&p).await.unwrap();
    assert_eq!(p.idle(), 1);
    // A read that finds nothing leaves the runtime believing the socket has nothing to
    // read, until its reactor next runs: nothing below awaits, so it does not.
    let mut conn = p.idle.lock().unwrap().pop_back().unwrap().conn;
    let mut byte = [0u8; 1];
    let polled = Pin::new(&mut conn).poll_read(&mut Context::from_waker(Waker::noop()), &mut ReadBuf::new(&mut byte));
    assert!(polled.is_pending(), "nothing to read yet");
    p.keep(conn);
    close_tx.send(()).unwrap();
    closed_rx.recv().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !close_arrived(&p) {
        assert!(std::time::Instant::now() < deadline, "the close reached the socket within 10 s");
    }
    let (status, _, body) = get(&p).await.unwrap();
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"[]"[..]));
    assert_eq!(s.accepted.load(Ordering::SeqCst), 2);
}

/// Whether the idle connection's socket has the server's close to read (asked of the kernel).
fn close_arrived(p: &Http1) -> bool {
    let idle = p.idle.lock().unwrap();
    let mut probe = [std::mem::MaybeUninit::uninit(); 1];
    socket2::SockRef::from(idle.back().unwrap().conn.tcp()).peek(&mut probe).is_ok()
}

/// Over TLS a head longer than one read (20 KB of headers) and a body in several records are
/// read whole, and the connection kept.
#[tokio::test]
async fn over_tls_a_long_head_and_a_body_in_records_are_read_whole() {
    let (s, p) = serve_tls(|_, tls| {
        let head = format!("HTTP/1.1 200 OK\r\nX-Pad: {}\r\nContent-Length: 11\r\n\r\n", "a".repeat(20_000));
        while tls_request(tls).is_some() {
            for part in [head.as_bytes(), b"[\"a\",", b"\"bcd\"]"] {
                tls.write_all(part).unwrap();
            }
            tls.flush().unwrap();
        }
    });
    for _ in 0..3 {
        let answer = tokio::time::timeout(Duration::from_secs(20), get(&p)).await;
        let (_, headers, body) = answer.expect("an answer within 20 s").unwrap();
        assert_eq!((headers["x-pad"].len(), &body[..]), (20_000, &br#"["a","bcd"]"#[..]));
    }
    assert_eq!(s.accepted.load(Ordering::SeqCst), 1);
}
