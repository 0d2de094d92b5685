//! The Consul source over TLS, against the simulator serving a certificate made at test time
//! (`consul_sim::tls::TestPki`): HTTP/2 multiplexing within the server's stream limit, the
//! HTTP/1.1 fallback, CA verification, `serverName`, and client certificates (mTLS).
//!
//! Simulator-only (a real agent's TLS setup is not ours to change): compiled ignored when
//! `E2E_CONSUL_ADDR` names a real agent, so they show as ignored there.

use std::time::Duration;

use consul_resolver_core::keys::{ClientIdentity, ConsulKey, HealthStatuses, QueryOptions, Secret, TlsSettings};
use consul_resolver_core::model::Health;
use consul_resolver_core::test_support::consul_key;
use consul_sim::tls::{TestPki, TlsConfig};
use consul_sim::{Config, HEALTH_STATE_LABEL, RunningSim, Simulator};
use consul_watch::Settings;
use e2e::watches::{DEADLINE, NO_SWEEP, Watches};
use serde_json::json;
use tokio::time::Instant;

struct Env {
    sim: RunningSim,
    pki: TestPki,
    http: reqwest::Client,
}

impl Env {
    async fn start(tls: impl FnOnce(&TestPki) -> TlsConfig) -> Env {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let pki = TestPki::generate().expect("test certificates");
        let sim = Simulator::start(Config { tls: Some(tls(&pki)), ..Config::default() }).await.expect("simulator");
        let client = pki.client_config(true).expect("client TLS");
        // The test's own writes come from another loopback address, so that the simulator's
        // count of the watches' connections (from 127.0.0.1) is theirs alone.
        let http = reqwest::Client::builder()
            .use_preconfigured_tls(client)
            .local_address(std::net::IpAddr::from([127, 0, 0, 2]))
            .build()
            .expect("client");
        Env { sim, pki, http }
    }

    /// A key trusting the test CA, as a resolver with `tls.caSecretRef` has.
    fn key(&self, service: &str) -> ConsulKey {
        self.key_with(service, TlsSettings { ca_pem: Some(self.pki.ca_cert_pem.as_str().into()), ..Default::default() })
    }

    fn key_with(&self, service: &str, tls: TlsSettings) -> ConsulKey {
        let mut key = consul_key(&self.sim.base_url(), service);
        key.scope_mut().server.tls = Some(tls);
        key.scope_mut().query = QueryOptions { statuses: HealthStatuses::ANY, ..QueryOptions::default() };
        key
    }

    fn identity(&self) -> ClientIdentity {
        ClientIdentity {
            cert_pem: self.pki.client_cert_pem.as_str().into(),
            key_pem: Secret::new(self.pki.client_key_pem.as_str()),
        }
    }

    async fn register(&self, service: &str, port: u16, status: &str) {
        let id = format!("{service}-1");
        let body = json!({
            "Node": format!("{service}-node"), "Address": "127.0.0.1",
            "Service": {"ID": id, "Service": service, "Port": port},
            "Check": {"CheckID": format!("service:{id}"), "Name": "check", "Status": status, "ServiceID": id},
        });
        let resp = self.http.put(format!("{}/v1/catalog/register", self.sim.base_url())).json(&body).send().await;
        assert!(resp.expect("write reaches the simulator").status().is_success());
    }
}

/// Watches that never sweep ([`NO_SWEEP`]): a change seen in time was not swept up.
fn watches(max_connections: usize) -> Watches {
    Watches::new(settings(max_connections))
}

fn settings(max_connections: usize) -> Settings {
    Settings { wait: Duration::from_secs(60), max_connections, sweep: NO_SWEEP, ..Settings::default() }
}

/// Forty services, a budget of ten connections and a server allowing ten streams per
/// connection: every service holds its own blocking query (no change feed), over four
/// HTTP/2 connections (forty streams), and a health flip arrives at once.
#[tokio::test]
#[cfg_attr(e2e_real_consul, ignore = "needs the simulator's TLS")]
async fn every_service_blocks_on_its_own_stream() {
    let env = Env::start(|pki| pki.server_tls().with_h2_max_concurrent_streams(10)).await;
    let services: Vec<String> = (0..40).map(|i| format!("h2svc{i}")).collect();
    for (i, s) in services.iter().enumerate() {
        env.register(s, 8000 + i as u16, "passing").await;
    }
    let mut w = watches(10);
    let keys: Vec<ConsulKey> = services.iter().map(|s| env.key(s)).collect();
    for k in &keys {
        w.start(k);
    }
    for k in &keys {
        w.answer(k, "the first answer", |e| e.len() == 1).await;
    }
    let (stats, all_blocking) =
        env.sim.wait_for_stats(DEADLINE, |s| services.iter().all(|svc| s.blocking.get(svc.as_str()) == Some(&1))).await;
    assert!(all_blocking, "every service blocks on its own query: {:?}", stats.blocking);
    assert_eq!(stats.blocking.get(HEALTH_STATE_LABEL), None, "no change feed is needed");
    let h2 = stats.open_connections_by_protocol.get("h2").copied().unwrap_or(0);
    assert_eq!(stats.open_connections_by_protocol.get("h1"), None, "{stats:?}");
    assert!((4..=5).contains(&h2), "40 streams at 10 per connection: {h2} connections");
    assert!(stats.peak_streams_per_connection <= 10, "the server's limit holds: {stats:?}");

    let started = Instant::now();
    env.register(&services[17], 8017, "critical").await;
    w.answer(&keys[17], "the critical instance", |e| e.len() == 1 && e[0].health == Health::Critical).await;
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
}

/// Over HTTP/2, as on a dedicated lane, a watch held for the operator's cold start reads
/// its service and blocks only once released; a change made meanwhile is seen then, since
/// the blocking query carries the first read's index. A watch not held blocks at once.
#[tokio::test]
#[cfg_attr(e2e_real_consul, ignore = "needs the simulator's TLS")]
async fn a_held_stream_reads_blocks_only_once_released_and_misses_nothing() {
    let env = Env::start(|pki| pki.server_tls()).await;
    let (held_svc, free_svc) = ("h2held", "h2free");
    env.register(held_svc, 8200, "passing").await;
    env.register(free_svc, 8300, "passing").await;
    let blocking = |s: &consul_sim::Stats, svc: &str| s.blocking.get(svc).copied().unwrap_or(0);
    // No pacing: a watch not held blocks the moment it has its first answer.
    let unpaced = Settings { min_interval: Duration::ZERO, ..settings(10) };
    let mut held = Watches::new(unpaced.clone());
    held.hold_blocking();
    let key = env.key(held_svc);
    held.start(&key);
    held.answer(&key, "the held watch's first read", |e| e.len() == 1 && e[0].port == 8200).await;
    // A watch not held, started after that answer: by the time its blocking query waits
    // in Consul, the held watch's would have been there long before.
    let mut free = Watches::new(unpaced);
    let free_key = env.key(free_svc);
    free.start(&free_key);
    free.answer(&free_key, "the free watch's first read", |e| e.len() == 1).await;
    let (stats, ok) = env.sim.wait_for_stats(DEADLINE, |s| blocking(s, free_svc) == 1).await;
    assert!(ok, "the free watch blocks: {stats:?}");
    assert!(stats.open_connections_by_protocol.contains_key("h2"), "over HTTP/2: {stats:?}");
    assert_eq!(blocking(&env.sim.stats(), held_svc), 0, "the held watch read, and waits to block");
    env.register(held_svc, 8201, "passing").await;
    held.release_blocking();
    held.answer(&key, "the change made while held, once released", |e| e.len() == 1 && e[0].port == 8201).await;
    let (stats, ok) = env.sim.wait_for_stats(DEADLINE, |s| blocking(s, held_svc) == 1).await;
    assert!(ok, "blocking once released: {stats:?}");
}

/// A server that offers only HTTP/1.1 is served as before: a connection per query within
/// the budget, the rest fed: the simulator never counts more than four connections from the
/// watches' address.
#[tokio::test]
#[cfg_attr(e2e_real_consul, ignore = "needs the simulator's TLS")]
async fn an_http1_server_gets_http1() {
    let env = Env::start(|pki| pki.server_tls().http1_only()).await;
    let services: Vec<String> = (0..6).map(|i| format!("h1svc{i}")).collect();
    for (i, s) in services.iter().enumerate() {
        env.register(s, 8100 + i as u16, "passing").await;
    }
    // A budget of 4: one read, the feed's two queries, one dedicated slot.
    let mut w = watches(4);
    let keys: Vec<ConsulKey> = services.iter().map(|s| env.key(s)).collect();
    for k in &keys {
        w.start(k);
    }
    for k in &keys {
        w.answer(k, "the first answer", |e| e.len() == 1).await;
    }
    let (stats, fed) =
        env.sim.wait_for_stats(DEADLINE, |s| s.blocking.get(HEALTH_STATE_LABEL).copied() == Some(1)).await;
    assert!(fed, "beyond the budget, watches are fed: {:?}", stats.blocking);
    assert_eq!(stats.open_connections_by_protocol.get("h2"), None, "{stats:?}");
    let watches_peak = stats.peak_connections.get("127.0.0.1").copied().unwrap_or(0);
    assert!((1..=4).contains(&watches_peak), "within the budget: {stats:?}");
    env.register(&services[5], 8105, "critical").await;
    w.answer(&keys[5], "the critical instance", |e| e.len() == 1 && e[0].health == Health::Critical).await;
}

/// Certificate verification: a CA that did not sign the server's certificate, and a
/// `serverName` the certificate does not carry, fail with a message that says which setting
/// to check; the right `serverName` works against an address the certificate lacks.
#[tokio::test]
#[cfg_attr(e2e_real_consul, ignore = "needs the simulator's TLS")]
async fn verification_failures_name_the_setting() {
    let env = Env::start(|pki| pki.server_tls()).await;
    env.register("verified", 8200, "passing").await;
    let other_ca = TestPki::generate().unwrap().ca_cert_pem;
    let mut w = watches(10);

    let wrong_ca = env.key_with("verified", TlsSettings { ca_pem: Some(other_ca.into()), ..Default::default() });
    w.start(&wrong_ca);
    let said = w.failure(&wrong_ca, "the wrong CA's failure").await;
    assert!(said.contains("tls.caSecretRef"), "{said}");

    let ca = Some(env.pki.ca_cert_pem.as_str().into());
    let wrong_name = env.key_with(
        "verified",
        TlsSettings { ca_pem: ca.clone(), server_name: Some("elsewhere.test".into()), ..Default::default() },
    );
    w.start(&wrong_name);
    let said = w.failure(&wrong_name, "the wrong name's failure").await;
    assert!(said.contains("tls.serverName"), "{said}");

    // The certificate names consul.test; reach it by IP with that serverName.
    let named = env.key_with(
        "verified",
        TlsSettings { ca_pem: ca, server_name: Some("consul.test".into()), ..Default::default() },
    );
    w.start(&named);
    w.answer(&named, "the answer through serverName", |e| e.len() == 1).await;
}

/// Mutual TLS: without a client certificate the server refuses us, with a message about the
/// client certificate; with the one its CA signed, answers flow.
#[tokio::test]
#[cfg_attr(e2e_real_consul, ignore = "needs the simulator's TLS")]
async fn client_certificates_for_mutual_tls() {
    let env = Env::start(|pki| pki.mtls()).await;
    env.register("mutual", 8300, "passing").await;
    let mut w = watches(10);
    let without = env.key("mutual");
    w.start(&without);
    let said = w.failure(&without, "the refusal").await;
    assert!(said.contains("tls.clientCertSecretRef"), "{said}");
    assert!(!said.contains("PRIVATE KEY"), "{said}");

    let with = env.key_with(
        "mutual",
        TlsSettings {
            ca_pem: Some(env.pki.ca_cert_pem.as_str().into()),
            client_identity: Some(env.identity()),
            ..Default::default()
        },
    );
    w.start(&with);
    w.answer(&with, "the answer with a client certificate", |e| e.len() == 1).await;
}
