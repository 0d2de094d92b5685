//! Against an HTTP/2 server over TLS on loopback (`h2`'s own server, a certificate for
//! 127.0.0.1 made here), on a runtime and thread of its own.

use std::io::Write;
use std::sync::atomic::AtomicUsize;

use super::super::HttpClient;
use super::*;
use crate::client::tests::key;

/// A Consul that answers every request with `json`, gzipped only when the request asks for
/// it as agents do; counts the body bytes it sent.
struct Server {
    url: String,
    ca_pem: String,
    sent: Arc<AtomicUsize>,
}

fn serve_h2(json: Vec<u8>) -> Server {
    let rcgen::CertifiedKey { cert, signing_key } =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let key = rustls::pki_types::PrivateKeyDer::try_from(signing_key.serialize_der()).unwrap();
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], key)
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&json).unwrap();
    let (plain, gzipped) = (Bytes::from(json), Bytes::from(gz.finish().unwrap()));
    let sent = Arc::new(AtomicUsize::new(0));
    let counted = sent.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, plain, gzipped, sent) =
                    (acceptor.clone(), plain.clone(), gzipped.clone(), counted.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else { return };
                    let Ok(mut conn) = h2::server::handshake(tls).await else { return };
                    while let Some(Ok((request, mut respond))) = conn.accept().await {
                        let gzip = request
                            .headers()
                            .get_all(http::header::ACCEPT_ENCODING)
                            .iter()
                            .any(|v| v.to_str().is_ok_and(|v| v.split(',').any(|e| e.trim() == "gzip")));
                        let mut response = http::Response::builder().status(200).header("x-consul-index", "7");
                        if gzip {
                            response = response.header(http::header::CONTENT_ENCODING, "gzip");
                        }
                        let body = if gzip { gzipped.clone() } else { plain.clone() };
                        sent.fetch_add(body.len(), Ordering::SeqCst);
                        let Ok(mut stream) = respond.send_response(response.body(()).unwrap(), false) else { return };
                        let _ = stream.send_data(body, true);
                    }
                });
            }
        });
    });
    Server { url, ca_pem: cert.pem(), sent }
}

/// Over HTTP/2 answers are asked gzipped, as over HTTP/1.1 (and as Go's client, and so
/// Consul's own tools, asks): a service of 2,000 instances comes as a fraction of its JSON
/// (37 KB for 474 KB).
#[tokio::test]
async fn over_http2_answers_come_gzipped() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let instances: Vec<_> = (0..2_000)
        .map(|i| {
            serde_json::json!({"Node": {"Node": format!("node-{i}"), "Address": format!("10.0.{}.{}", i / 250, i % 250)},
                "Service": {"ID": format!("web-{i}"), "Service": "web", "Port": 8080, "Tags": ["primary"]},
                "Checks": [{"Node": format!("node-{i}"), "CheckID": "serfHealth", "Status": "passing",
                            "Output": "Agent alive and reachable"}]})
        })
        .collect();
    let json = serde_json::to_vec(&instances).unwrap();
    let server = serve_h2(json.clone());
    let tls =
        consul_resolver_core::keys::TlsSettings { ca_pem: Some(server.ca_pem.as_str().into()), ..Default::default() };
    let budget = Arc::new(Semaphore::new(4));
    let client = HttpClient::new(&server.url, Some(&tls), 4, 64 << 20, budget).unwrap();
    let read = client.health(&key(&server.url, &[]), None).await.unwrap();
    assert!(client.multiplexed(), "the server speaks HTTP/2");
    assert_eq!(read.value.endpoints.len(), 2_000);
    let sent = server.sent.load(Ordering::SeqCst);
    assert!(sent < json.len() / 4, "{sent} bytes sent for a {} byte answer", json.len());
}

/// Over HTTP/2 every watch's blocking query is an exchange in flight, all the time: 10,000
/// of them at the doubled scale profile. Opening a lane (the TCP, TLS and HTTP/2 handshakes)
/// is boxed where it happens, so a waiting exchange does not carry that state: it did, 6.9
/// KB an exchange, about 66 MiB at 10,000 services.
#[tokio::test]
async fn a_waiting_exchange_is_small() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let tls = consul_resolver_core::keys::TlsSettings { insecure_skip_verify: true, ..Default::default() };
    let budget = Arc::new(Semaphore::new(4));
    let client = HttpClient::new("https://127.0.0.1:1", Some(&tls), 4, 1 << 20, budget).unwrap();
    let crate::client::Transport::Tls { multiplexer, .. } = &client.transport else {
        panic!("an https:// address is served over TLS")
    };
    let headers = HeaderMap::new();
    let exchange = multiplexer.get("/v1/health/service/web?index=7&wait=300000ms", &headers);
    let size = std::mem::size_of_val(&exchange);
    assert!(size <= 1024, "a waiting HTTP/2 exchange is {size} bytes");
}
