//! TLS, mTLS and HTTP/2 of the simulator, with a PKI made at test time (`TestPki`) and hyper's
//! own HTTP/2 client on one TLS connection, so that multiplexing is observable exactly.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use consul_sim::tls::TestPki;
use consul_sim::{Config, RunningSim, Simulator, TlsConfig};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::{http1, http2};
use hyper::{Request, StatusCode, Version};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

const LONG: Duration = Duration::from_secs(5);

fn pki() -> TestPki {
    TestPki::generate().expect("test PKI")
}

async fn start(tls: TlsConfig, max_conns_per_client: usize) -> RunningSim {
    Simulator::start(Config { tls: Some(tls), max_conns_per_client, ..Config::default() }).await.expect("start")
}

/// A TLS connection to the simulator as `localhost`.
async fn connect(addr: SocketAddr, config: rustls::ClientConfig) -> std::io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from("localhost").expect("server name");
    TlsConnector::from(Arc::new(config)).connect(name, tcp).await
}

/// An HTTP/2 connection: its request handle, driven by a task of its own.
async fn h2(addr: SocketAddr, config: rustls::ClientConfig) -> http2::SendRequest<Full<Bytes>> {
    let tls = connect(addr, config).await.expect("TLS handshake");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]), "ALPN chose h2");
    let (send, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(tls)).await.expect("h2 handshake");
    tokio::spawn(conn);
    send
}

struct Answer {
    status: StatusCode,
    version: Version,
    index: Option<u64>,
    body: Value,
}

fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> Request<Full<Bytes>> {
    let body = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
    Request::builder()
        .method(method)
        .uri(format!("https://localhost:{}{path}", addr.port()))
        .body(Full::new(body))
        .expect("request")
}

async fn answer(resp: hyper::Response<hyper::body::Incoming>) -> hyper::Result<Answer> {
    let (status, version) = (resp.status(), resp.version());
    let index = resp.headers().get("x-consul-index").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
    let bytes = resp.into_body().collect().await?.to_bytes();
    Ok(Answer { status, version, index, body: serde_json::from_slice(&bytes).unwrap_or(Value::Null) })
}

async fn h2_call(
    send: &mut http2::SendRequest<Full<Bytes>>,
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> hyper::Result<Answer> {
    answer(send.send_request(request(addr, method, path, body)).await?).await
}

fn registration(id: &str, status: &str) -> Value {
    json!({
        "Node": "n1", "Address": "10.0.0.1",
        "Service": {"ID": id, "Service": "web", "Port": 8080},
        "Check": {"CheckID": format!("service:{id}"), "Status": status, "ServiceID": id},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_multiplexes_blocking_queries_on_one_connection() {
    let pki = pki();
    // A limit of 2 connections: 20 queries at once fit because they share one.
    let sim = start(pki.server_tls(), 2).await;
    let a = sim.addr();
    assert_eq!(sim.base_url(), format!("https://{a}"));
    let mut send = h2(a, pki.client_config(false).unwrap()).await;
    let r =
        h2_call(&mut send, a, "PUT", "/v1/catalog/register", Some(&registration("web-1", "passing"))).await.unwrap();
    assert_eq!((r.status, r.version, r.body), (StatusCode::OK, Version::HTTP_2, json!(true)));
    let i = h2_call(&mut send, a, "GET", "/v1/health/service/web", None).await.unwrap().index.unwrap();

    let n = 20;
    let mut waiting = Vec::new();
    for _ in 0..n {
        let mut send = send.clone();
        waiting.push(tokio::spawn(async move {
            h2_call(&mut send, a, "GET", &format!("/v1/health/service/web?index={i}&wait=5s"), None).await
        }));
    }
    let (s, ok) = sim.wait_for_stats(LONG, |s| s.blocking.get("web") == Some(&n)).await;
    assert!(ok, "{s:?}");
    assert_eq!(s.open_connections_total, 1, "{s:?}");
    assert_eq!(s.open_connections_by_protocol.get("h2"), Some(&1), "{s:?}");
    assert!(s.peak_streams_per_connection >= n, "{s:?}");
    assert_eq!(s.rejected_connections, 0);

    let r =
        h2_call(&mut send, a, "PUT", "/v1/catalog/register", Some(&registration("web-1", "critical"))).await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    for w in waiting {
        let r = tokio::time::timeout(LONG, w).await.expect("woken").unwrap().unwrap();
        assert_eq!((r.status, r.version), (StatusCode::OK, Version::HTTP_2));
        assert!(r.index.unwrap() > i);
        assert_eq!(r.body[0]["Checks"][0]["Status"], "critical");
    }
    assert_eq!(sim.stats().peak_connections_total, 1);
}

/// What a client sees beyond `SETTINGS_MAX_CONCURRENT_STREAMS`: hyper's HTTP/2 client holds
/// the extra requests back until a stream closes, so the server never has more than the
/// limit in flight on the connection; nothing fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_streams_beyond_the_limit_wait_in_the_client() {
    let pki = pki();
    let sim = start(pki.server_tls().with_h2_max_concurrent_streams(4), 200).await;
    let a = sim.addr();
    let mut send = h2(a, pki.client_config(false).unwrap()).await;
    h2_call(&mut send, a, "PUT", "/v1/catalog/register", Some(&registration("web-1", "passing"))).await.unwrap();
    let i = h2_call(&mut send, a, "GET", "/v1/health/service/web", None).await.unwrap().index.unwrap();
    sim.reset_stats();

    let mut waiting = Vec::new();
    for _ in 0..6 {
        let mut send = send.clone();
        waiting.push(tokio::spawn(async move {
            h2_call(&mut send, a, "GET", &format!("/v1/health/service/web?index={i}&wait=5s"), None).await
        }));
    }
    let (s, ok) = sim.wait_for_stats(LONG, |s| s.blocking.get("web") == Some(&4)).await;
    assert!(ok, "{s:?}");
    // The other two are held by the client: the server does not see a fifth stream.
    let (s, fifth) = sim.wait_for_stats(Duration::from_millis(300), |s| s.blocking_total > 4).await;
    assert!(!fifth, "{s:?}");
    assert_eq!(s.peak_streams_per_connection, 4);
    assert_eq!(s.requests_total, 4);

    // A write answers the four; the two held back go out then, and answer at once (their
    // index is now behind).
    let mut writer = h2(a, pki.client_config(false).unwrap()).await;
    h2_call(&mut writer, a, "PUT", "/v1/catalog/register", Some(&registration("web-1", "critical"))).await.unwrap();
    for w in waiting {
        let r = tokio::time::timeout(LONG, w).await.expect("answered").unwrap().expect("no stream error");
        assert_eq!(r.status, StatusCode::OK);
        assert!(r.index.unwrap() > i);
    }
    assert_eq!(sim.stats().peak_streams_per_connection, 4);
}

#[tokio::test]
async fn http1_over_tls_when_the_client_offers_only_http1() {
    let pki = pki();
    let sim = start(pki.server_tls(), 200).await;
    let a = sim.addr();
    let mut config = pki.client_config(false).unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tls = connect(a, config).await.expect("TLS handshake");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let (mut send, conn) = http1::handshake(TokioIo::new(tls)).await.unwrap();
    tokio::spawn(conn);
    let req = Request::builder().uri("/v1/status/leader").header("host", "localhost").body(Full::new(Bytes::new()));
    let r = answer(send.send_request(req.unwrap()).await.unwrap()).await.unwrap();
    assert_eq!((r.status, r.version, r.body), (StatusCode::OK, Version::HTTP_11, json!("127.0.0.1:8300")));
    let s = sim.stats();
    assert_eq!(s.open_connections_by_protocol.get("h1"), Some(&1), "{s:?}");
    assert_eq!(s.peak_streams_per_connection, 1);

    // Plain HTTP to a TLS port gets no answer.
    let mut plain = TcpStream::connect(a).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    plain.write_all(b"GET /v1/status/leader HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(LONG, plain.read_to_end(&mut buf)).await.expect("closed in time");
    assert!(!buf.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf));
}

#[tokio::test]
async fn a_client_trusting_another_ca_fails_the_handshake() {
    let pki = pki();
    let sim = start(pki.server_tls(), 200).await;
    let stranger = TestPki::generate().unwrap();
    let err = connect(sim.addr(), stranger.client_config(false).unwrap()).await.expect_err("unknown issuer");
    assert!(err.to_string().contains("UnknownIssuer") || err.to_string().contains("invalid peer certificate"), "{err}");
    assert_eq!(sim.stats().requests_total, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_requires_a_client_certificate_from_the_ca() {
    let pki = pki();
    let sim = start(pki.mtls(), 200).await;
    let a = sim.addr();

    // With the client certificate: served.
    let mut send = h2(a, pki.client_config(true).unwrap()).await;
    let r = h2_call(&mut send, a, "GET", "/v1/status/leader", None).await.unwrap();
    assert_eq!((r.status, r.body), (StatusCode::OK, json!("127.0.0.1:8300")));

    // Without one, or with one from another CA: with TLS 1.3 the client may finish its side
    // of the handshake, but the server's alert ends the connection before any answer.
    let stranger = TestPki::generate().unwrap();
    let foreign = trusting_with_identity(&pki, &stranger);
    for (what, config) in [("no certificate", pki.client_config(false).unwrap()), ("foreign certificate", foreign)] {
        let refused = async {
            let tls = connect(a, config).await?;
            let (mut send, conn) =
                http2::handshake(TokioExecutor::new(), TokioIo::new(tls)).await.map_err(std::io::Error::other)?;
            tokio::spawn(conn);
            h2_call(&mut send, a, "GET", "/v1/status/leader", None).await.map_err(std::io::Error::other)
        };
        let r = tokio::time::timeout(LONG, refused).await.expect("refused in time");
        assert!(r.is_err(), "{what}: served");
    }
    assert_eq!(sim.stats().requests_total, 1, "only the client with a certificate got through");
}

/// A client trusting `pki`'s CA (so the server passes) that presents `stranger`'s client
/// certificate (which the server must refuse).
fn trusting_with_identity(pki: &TestPki, stranger: &TestPki) -> rustls::ClientConfig {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(pki.ca_cert_pem.as_bytes()).unwrap()).unwrap();
    let chain = vec![CertificateDer::from_pem_slice(stranger.client_cert_pem.as_bytes()).unwrap()];
    let key = PrivateKeyDer::from_pem_slice(stranger.client_key_pem.as_bytes()).unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    config
}

#[tokio::test]
async fn bad_pem_is_a_start_error() {
    let pki = pki();
    let bad = TlsConfig::new("not a certificate", pki.server_key_pem.clone());
    let err = Simulator::start(Config { tls: Some(bad), ..Config::default() }).await.expect_err("refused");
    assert!(err.to_string().starts_with("TLS: certificate chain"), "{err}");
    let mismatched = TlsConfig::new(pki.server_cert_pem.clone(), pki.client_key_pem.clone());
    assert!(Simulator::start(Config { tls: Some(mismatched), ..Config::default() }).await.is_err());
}

#[cfg(unix)]
#[tokio::test]
async fn binary_serves_tls_from_files() {
    let pki = pki();
    let dir = std::env::temp_dir().join(format!("consul-sim-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let files = [("cert.pem", &pki.server_cert_pem), ("key.pem", &pki.server_key_pem), ("ca.pem", &pki.ca_cert_pem)];
    for (name, pem) in files {
        std::fs::write(dir.join(name), pem).unwrap();
    }
    let path = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let (cert, key, ca) = (path("cert.pem"), path("key.pem"), path("ca.pem"));
    let args = ["--tls-cert", &cert, "--tls-key", &key, "--tls-client-ca", &ca, "--h2-max-streams", "8"];
    let (mut child, a) = common::spawn_binary(&args, LONG).await;
    let _ = std::fs::remove_dir_all(&dir);
    let mut send = h2(a, pki.client_config(true).unwrap()).await;
    let r = h2_call(&mut send, a, "GET", "/v1/status/leader", None).await.unwrap();
    assert_eq!((r.status, r.version), (StatusCode::OK, Version::HTTP_2));
    child.kill().await.unwrap();
}
