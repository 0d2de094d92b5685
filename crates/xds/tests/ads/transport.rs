//! Admission, TLS and deadlines.

use std::collections::BTreeSet;
use std::time::Duration;

use consul_resolver_xds::{ServeError, TlsConfig, XdsConfig};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

use crate::support::{CDS, Harness, Sotw, complete, names, upstream};

#[tokio::test]
async fn a_client_beyond_the_maximum_is_refused() {
    let harness = Harness::start(XdsConfig { max_clients: 1, ..Default::default() }).await;
    harness.server.update(complete(vec![upstream("a", &[("10.0.0.1", 80)])]));
    let mut first = Sotw::open(harness.channel().await, "envoy-1").await.unwrap();
    first.request(CDS, &[], "", "");
    first.recv().await;
    let refused = Sotw::open(harness.channel().await, "envoy-2").await.err().expect("refused");
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert_eq!(harness.metric("consul_resolver_xds_clients_refused_total", "max_clients"), 1.0);
    assert_eq!(harness.metric("consul_resolver_xds_clients", "sotw"), 1.0);
    // The place is given back when a client leaves.
    drop(first);
    let mut admitted = None;
    for _ in 0..50 {
        if let Ok(client) = Sotw::open(harness.channel().await, "envoy-2").await {
            admitted = Some(client);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut second = admitted.expect("admitted once the first left");
    second.request(CDS, &[], "", "");
    assert_eq!(names(&second.recv().await.resources), vec!["a"]);
    harness.stop().await;
}

#[tokio::test]
async fn a_node_id_not_allowed_is_refused() {
    let allowed = BTreeSet::from(["envoy-1".to_owned()]);
    let harness = Harness::start(XdsConfig { allowed_node_ids: Some(allowed), ..Default::default() }).await;
    harness.server.update(complete(vec![upstream("a", &[("10.0.0.1", 80)])]));
    let mut stranger = Sotw::open(harness.channel().await, "envoy-2").await.unwrap();
    stranger.request(CDS, &[], "", "");
    assert_eq!(stranger.failure().await.code(), Code::PermissionDenied);
    assert_eq!(harness.metric("consul_resolver_xds_clients_refused_total", "node_id"), 1.0);
    let mut known = Sotw::open(harness.channel().await, "envoy-1").await.unwrap();
    known.request(CDS, &[], "", "");
    assert_eq!(names(&known.recv().await.resources), vec!["a"]);
    assert_eq!(harness.server.clients().len(), 1);
    harness.stop().await;
}

/// A client that stops answering has its stream closed once the deadline passes; the
/// clock is tokio's, paused, so the deadline passes without waiting for it.
#[tokio::test(start_paused = true)]
async fn a_client_that_stops_answering_is_closed_at_the_deadline() {
    let config = XdsConfig {
        response_deadline: Duration::from_secs(20),
        keepalive_interval: Duration::from_secs(3600),
        ..Default::default()
    };
    let harness = Harness::start(config).await;
    harness.server.update(complete(vec![upstream("a", &[("10.0.0.1", 80)])]));
    let mut client = Sotw::open(harness.channel().await, "envoy-1").await.unwrap();
    client.request(CDS, &[], "", "");
    let sent = tokio::time::Instant::now();
    client.recv().await;
    let status = client.failure_within(Duration::from_secs(60)).await;
    assert_eq!(status.code(), Code::DeadlineExceeded);
    assert!(sent.elapsed() >= Duration::from_secs(20));
    assert_eq!(harness.metric("consul_resolver_xds_streams_closed_total", "slow_client"), 1.0);
    assert!(harness.server.clients().is_empty());
    harness.stop().await;
}

/// A stream that never says who it is does not hold a place past the deadline.
#[tokio::test(start_paused = true)]
async fn a_client_that_sends_no_request_is_refused_at_the_deadline() {
    let config = XdsConfig {
        response_deadline: Duration::from_secs(20),
        keepalive_interval: Duration::from_secs(3600),
        max_clients: 1,
        ..Default::default()
    };
    let harness = Harness::start(config).await;
    let mut mute = Sotw::open(harness.channel().await, "envoy-1").await.unwrap();
    let opened = tokio::time::Instant::now();
    assert_eq!(mute.failure_within(Duration::from_secs(60)).await.code(), Code::DeadlineExceeded);
    assert!(opened.elapsed() >= Duration::from_secs(20));
    assert_eq!(harness.metric("consul_resolver_xds_clients_refused_total", "no_request"), 1.0);
    harness.stop().await;
}

struct Pki {
    ca_pem: String,
    server: (String, String),
    client: (String, String),
}

fn pki() -> Pki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let leaf = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(names).unwrap().signed_by(&key, &ca).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    Pki { ca_pem: ca.pem(), server: leaf(vec!["localhost".to_owned()]), client: leaf(vec!["envoy.test".to_owned()]) }
}

async fn tls_channel(harness: &Harness, pki: &Pki, identity: bool) -> Result<Channel, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&pki.ca_pem)).domain_name("localhost");
    if identity {
        tls = tls.identity(Identity::from_pem(&pki.client.0, &pki.client.1));
    }
    Channel::from_shared(format!("https://{}", harness.addr)).unwrap().tls_config(tls)?.connect().await
}

async fn served(channel: Channel) -> bool {
    let Ok(mut client) = Sotw::open(channel, "envoy-1").await else { return false };
    client.request(CDS, &[], "", "");
    names(&client.recv().await.resources) == vec!["a"]
}

#[tokio::test]
async fn tls_serves_a_client_that_trusts_the_server() {
    let pki = pki();
    let tls =
        TlsConfig { cert_pem: pki.server.0.clone().into(), key_pem: pki.server.1.clone().into(), client_ca_pem: None };
    let harness = Harness::start(XdsConfig { tls: Some(tls), ..Default::default() }).await;
    harness.server.update(complete(vec![upstream("a", &[("10.0.0.1", 80)])]));
    assert!(served(tls_channel(&harness, &pki, false).await.unwrap()).await);
    // A plaintext client is not served.
    let plaintext = Channel::from_shared(format!("http://{}", harness.addr)).unwrap().connect().await.unwrap();
    assert!(Sotw::open(plaintext, "envoy-1").await.is_err());
    harness.stop().await;
}

#[tokio::test]
async fn mutual_tls_refuses_a_client_without_a_certificate() {
    let pki = pki();
    let tls = TlsConfig {
        cert_pem: pki.server.0.clone().into(),
        key_pem: pki.server.1.clone().into(),
        client_ca_pem: Some(pki.ca_pem.clone().into()),
    };
    let harness = Harness::start(XdsConfig { tls: Some(tls), ..Default::default() }).await;
    harness.server.update(complete(vec![upstream("a", &[("10.0.0.1", 80)])]));
    assert!(served(tls_channel(&harness, &pki, true).await.unwrap()).await);
    // TLS 1.3 reports the missing certificate after the handshake: at connect or at the call.
    let anonymous = tls_channel(&harness, &pki, false).await;
    match anonymous {
        Err(_) => {}
        Ok(channel) => assert!(Sotw::open(channel, "envoy-1").await.is_err(), "served without a certificate"),
    }
    assert_eq!(harness.server.clients().len(), 0);
    harness.stop().await;
}

#[tokio::test]
async fn an_unusable_certificate_fails_serving_at_once() {
    let tls =
        TlsConfig { cert_pem: b"not a certificate".to_vec(), key_pem: b"nor a key".to_vec(), client_ca_pem: None };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = consul_resolver_xds::XdsServer::new();
    let config = XdsConfig { tls: Some(tls), ..Default::default() };
    let served = tokio::time::timeout(Duration::from_secs(5), server.serve(listener, config, std::future::pending()));
    assert!(matches!(served.await.expect("returns at once"), Err(ServeError::Tls(_))));
}
