//! The Envoy harness's own tests: the bootstraps it writes are ones Envoy 1.40 accepts,
//! Envoy routes by path prefix and by header to the right backends, it dials its xDS server
//! over HTTP/2, and the prober sees a stopped backend's traffic stop and come back, request
//! by request, with the failures in between counted as failures.
//!
//! Compiled ignored, with the reason, when Envoy is not cached (under `CI=true` the build
//! fails instead: e2e/build.rs).

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use consul_sim::tls::TestPki;
use e2e::backends::Backends;
use e2e::envoy::{Envoy, EnvoyConfig, Pem, Route, XdsSource, XdsTls};
use e2e::probe::{Outcome, ProbeConfig, Prober};

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

#[test]
#[cfg_attr(e2e_no_envoy, ignore = "no Envoy (bash scripts/real-parts.sh envoy)")]
fn envoy_accepts_every_kind_of_bootstrap_the_harness_writes() {
    let a = "127.0.0.1:1".parse().unwrap();
    let plain = EnvoyConfig::new("node", "edge")
        .with_cluster("one", &[a])
        .with_route(Route::header("x-cluster", "one", "one"))
        .with_route(Route::prefix("/consul/shop/web", "from-cds"));
    Envoy::validate(&plain).unwrap();
    for delta in [false, true] {
        Envoy::validate(&plain.clone().with_xds(XdsSource::new(a, delta))).unwrap();
    }
    let pki = TestPki::generate().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &pki.ca_cert_pem).unwrap();
    let tls = XdsTls {
        ca: Pem::File(ca),
        client_cert: Some((Pem::Inline(pki.client_cert_pem.clone()), Pem::Inline(pki.client_key_pem.clone()))),
        sni: Some("consul.test".to_owned()),
        subject_alt_name: Some("127.0.0.1".to_owned()),
    };
    let xds =
        XdsSource { tls: Some(tls), initial_fetch_timeout: Some(Duration::from_secs(2)), ..XdsSource::new(a, true) };
    Envoy::validate(&plain.with_xds(xds)).unwrap();
}

#[test]
#[cfg_attr(e2e_no_envoy, ignore = "no Envoy (bash scripts/real-parts.sh envoy)")]
fn envoy_routes_by_prefix_and_by_header_to_the_right_backends() {
    let backends = Backends::start(&["a", "b", "c"]).unwrap();
    let config = EnvoyConfig::new("harness", "edge")
        .with_cluster("one", &[backends.addr("a")])
        .with_cluster("two", &[backends.addr("b"), backends.addr("c")])
        .with_route(Route::header("x-cluster", "one", "one"))
        .with_route(Route::prefix("/one", "one"))
        .with_route(Route::prefix("/two", "two"))
        .with_route(Route::prefix("/later", "from-cds"));
    let envoy = Envoy::start(&config).unwrap();
    envoy.wait_ready(deadline()).unwrap();
    let start = Instant::now();
    let probe = |path: &str| Prober::start(ProbeConfig::new(envoy.listener_addr(), path)).unwrap();
    let (one, two, later) = (probe("/one"), probe("/two"), probe("/later"));
    let by_header =
        Prober::start(ProbeConfig::new(envoy.listener_addr(), "/two").with_header("x-cluster", "one")).unwrap();
    two.wait_until(deadline(), "b and c 10 times each", |r| {
        let c = r.counts(start, None);
        (c.of("b") >= 10 && c.of("c") >= 10).then_some(())
    })
    .unwrap();
    for (prober, name) in [(&one, "a"), (&by_header, "a")] {
        prober.wait_until(deadline(), "10 answers", |r| (r.counts(start, None).of(name) >= 10).then_some(())).unwrap();
    }
    later.wait_until(deadline(), "10 answers", |r| (r.len() >= 10).then_some(())).unwrap();
    let (one, two, later, by_header) = (one.stop(), two.stop(), later.stop(), by_header.stop());
    for (record, only) in [(&one, &["a"][..]), (&by_header, &["a"]), (&two, &["b", "c"])] {
        let counts = record.counts(start, None);
        assert_eq!(counts.backends.keys().map(String::as_str).collect::<Vec<_>>(), only, "{counts:?}");
        assert_eq!(counts.failed(), 0, "{counts:?}");
    }
    // A route to a cluster Envoy does not have (yet) answers 503.
    assert!(later.samples().iter().all(|s| s.outcome == Outcome::Status(503)), "{:?}", later.counts(start, None));
    let mut pair = vec![backends.addr("b"), backends.addr("c")];
    pair.sort();
    assert_eq!(envoy.cluster_hosts("two").unwrap(), Some(pair));
    assert_eq!(envoy.cluster_hosts("from-cds").unwrap(), None);
    let two_ok = envoy.stat("cluster.two.upstream_rq_200").unwrap().unwrap_or(0);
    assert!(two_ok >= 20, "cluster.two.upstream_rq_200 = {two_ok}");
    let dump = envoy.config_dump().unwrap();
    assert!(dump.to_string().contains("\"harness\""), "the node id is in the config dump");
}

#[test]
#[cfg_attr(e2e_no_envoy, ignore = "no Envoy (bash scripts/real-parts.sh envoy)")]
fn the_prober_sees_a_stopped_backend_go_and_come_back_with_the_failures_in_between() {
    let mut backends = Backends::start(&["a", "b"]).unwrap();
    let config = EnvoyConfig::new("harness", "edge")
        .with_cluster("pair", &backends.addrs())
        .with_route(Route::prefix("/", "pair"));
    let envoy = Envoy::start(&config).unwrap();
    envoy.wait_ready(deadline()).unwrap();
    let prober = Prober::start(ProbeConfig::new(envoy.listener_addr(), "/web")).unwrap();
    let start = Instant::now();
    prober.wait_first_hit("a", start, deadline()).unwrap();
    prober.wait_first_hit("b", start, deadline()).unwrap();

    let stopping = Instant::now();
    backends.stop("b").unwrap();
    let stopped = Instant::now();
    let gone = prober.wait_gone("b", start, Duration::from_millis(200), 20, deadline()).unwrap();
    // Nothing sent once its sockets were closed reached it.
    let first_after = prober.with(|r| r.window(stopped, None).next().map(|s| s.sent)).unwrap();
    assert!(gone <= first_after, "b answered a request sent after it stopped");
    let restarting = Instant::now();
    backends.restart("b").unwrap();
    let back = prober.wait_first_hit("b", restarting, deadline()).unwrap();
    let record = prober.stop();

    // Between the two, b's share failed: Envoy's 503s, counted as failures, not as b.
    let between = record.counts(stopped, Some(restarting));
    assert_eq!(between.of("b"), 0, "{between:?}");
    assert!(between.of("a") > 0 && between.statuses.get(&503).copied().unwrap_or(0) > 0, "{between:?}");
    assert_eq!(between.backends.len() + between.statuses.len() + between.errors.len(), 2, "{between:?}");
    assert_eq!(record.gone_since("b", start, Some(restarting)), Some(gone));
    assert_eq!(record.first_hit("b", restarting), Some(&back));
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    eprintln!(
        "b stopped in {:.1} ms; gone {:.1} ms after the stop began; back {:.1} ms after the restart; {} requests in between, {:?}",
        ms(stopped - stopping),
        ms(gone.saturating_duration_since(stopping)),
        ms(back.done - restarting),
        between.total(),
        between,
    );
}

#[test]
#[cfg_attr(e2e_no_envoy, ignore = "no Envoy (bash scripts/real-parts.sh envoy)")]
fn envoy_dials_its_xds_server_over_http2_and_goes_live_without_an_answer_after_the_fetch_timeout() {
    let xds_server = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut xds = XdsSource::new(xds_server.local_addr().unwrap(), true);
    xds.initial_fetch_timeout = Some(Duration::from_secs(2));
    let first = first_bytes(xds_server, |conn| {
        let mut preface = vec![0; 24];
        conn.read_exact(&mut preface).map(|()| preface)
    });
    let envoy =
        Envoy::start(&EnvoyConfig::new("harness", "edge").with_xds(xds).with_route(Route::prefix("/", "web"))).unwrap();
    let (preface, _held_open) =
        first.recv_timeout(Duration::from_secs(20)).expect("Envoy dials its xDS server").unwrap();
    assert_eq!(preface, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "gRPC over HTTP/2, without TLS");
    let (status, state) = envoy.admin_get("/ready").unwrap();
    assert_eq!((status, state.trim()), (503, "PRE_INITIALIZING"), "waiting for its first CDS answer");
    envoy.wait_ready(deadline()).unwrap();
    let prober = Prober::start(ProbeConfig::new(envoy.listener_addr(), "/")).unwrap();
    let first = prober.wait_until(deadline(), "an answer", |r| r.samples().front().cloned()).unwrap();
    assert_eq!(first.outcome, Outcome::Status(503), "no cluster from CDS yet");
}

#[test]
#[cfg_attr(e2e_no_envoy, ignore = "no Envoy (bash scripts/real-parts.sh envoy)")]
fn envoy_asks_a_tls_xds_server_for_its_name_and_h2() {
    let xds_server = TcpListener::bind("127.0.0.1:0").unwrap();
    let pki = TestPki::generate().unwrap();
    let tls = XdsTls {
        ca: Pem::Inline(pki.ca_cert_pem.clone()),
        client_cert: None,
        sni: Some("xds.consul.test".to_owned()),
        subject_alt_name: None,
    };
    let xds = XdsSource { tls: Some(tls), ..XdsSource::new(xds_server.local_addr().unwrap(), false) };
    // The first TLS record: the ClientHello.
    let first = first_bytes(xds_server, |conn| {
        let mut header = [0; 5];
        conn.read_exact(&mut header)?;
        let mut hello = vec![0; usize::from(u16::from_be_bytes([header[3], header[4]]))];
        conn.read_exact(&mut hello).map(|()| [&header[..], &hello].concat())
    });
    let _envoy = Envoy::start(&EnvoyConfig::new("harness", "edge").with_xds(xds)).unwrap();
    let (hello, _held_open) = first.recv_timeout(Duration::from_secs(20)).expect("Envoy dials its xDS server").unwrap();
    assert_eq!(hello[0], 22, "a TLS handshake record");
    let has = |needle: &[u8]| hello.windows(needle.len()).any(|w| w == needle);
    assert!(has(b"xds.consul.test"), "the SNI is in the ClientHello");
    assert!(has(b"\x02h2"), "ALPN offers h2");
}

/// What `read` reads from the first connection to `listener`, with the connection (held
/// open by the caller), on a thread: a test waits for it with a deadline, even if nothing
/// ever connects.
fn first_bytes(
    listener: TcpListener,
    read: impl FnOnce(&mut TcpStream) -> std::io::Result<Vec<u8>> + Send + 'static,
) -> Receiver<std::io::Result<(Vec<u8>, TcpStream)>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let got = listener.accept().and_then(|(mut conn, _)| {
            conn.set_read_timeout(Some(Duration::from_secs(10)))?;
            read(&mut conn).map(|bytes| (bytes, conn))
        });
        let _ = tx.send(got);
    });
    rx
}
