//! Envoy reads the operator's view over xDS (docs/xds.md): a real Envoy 1.40 connects over
//! ADS, state of the world and delta side by side, and routes real requests through a
//! listener with static routes to HTTP backends registered in a real Consul agent (1.8.7).
//! A prober sends a request every 5 ms through each Envoy and records which backend
//! answered each one; a check going critical must stop traffic to its backend, and passing
//! bring it back, within the coalescing window + 100 ms of the Consul write's HTTP 200. An
//! operator restart and a Consul outage must lose no request. Over mutual TLS, a listed node
//! gets Consul and Kubernetes clusters and an unlisted one nothing.
//!
//! Compiled ignored, with the reason, when Envoy or the real agent is not cached (under
//! `CI=true` the build fails instead: e2e/build.rs).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use e2e::agent::RealAgent;
use e2e::backends::Backends;
use e2e::consul::Consul;
use e2e::envoy::{Envoy, EnvoyConfig, Route, XdsSource};
use e2e::fixtures::{mapping_yaml, resolver_yaml};
use e2e::harness::{Cluster, Operator, free_port, unique};
use e2e::probe::{ProbeConfig, Prober};

const T: Duration = Duration::from_secs(60);
/// The operator's default coalescing window (--coalesce-window), which a flip may wait out.
const WINDOW: Duration = Duration::from_millis(250);
/// What a flip may take beyond the window, from the Consul write's HTTP 200 to the first
/// request that sees it.
const BEYOND: Duration = Duration::from_millis(100);
/// Flips each way, per Envoy.
const FLIPS: usize = 3;

/// A namespace with a resolver of `agent`, a Mapping of a fresh Consul service through it,
/// and the backends `a` and `b` registered as its instances (on loopback, passing).
struct World {
    ns: String,
    svc: String,
    consul: Consul,
    backends: Backends,
}

impl World {
    fn new(cluster: &Cluster, agent: &RealAgent, prefix: &str) -> World {
        let ns = cluster.namespace(prefix).unwrap();
        let svc = format!("web{}", unique());
        cluster.apply(&resolver_yaml(&ns, "consul", &agent.address(), "")).unwrap();
        cluster.apply(&mapping_yaml(&ns, "m", &svc, Some("consul"))).unwrap();
        let consul = Consul { base_url: agent.base_url.clone(), token: None, sim: None };
        let world = World { ns, svc, consul, backends: Backends::start(&["a", "b"]).unwrap() };
        world.set("a", "passing");
        world.set("b", "passing");
        world
    }

    /// The cluster Envoy knows the service by.
    fn cluster(&self) -> String {
        format!("consul/{}/consul/{}", self.ns, self.svc)
    }

    /// Registers backend `name` with its check at `status`; returns when Consul answered
    /// 200.
    fn set(&self, name: &str, status: &str) -> Instant {
        let port = self.backends.addr(name).port();
        self.consul
            .register(&format!("node-{name}"), "127.0.0.1", &self.svc, &format!("{}-{name}", self.svc), port, status)
            .unwrap();
        Instant::now()
    }

    fn operator(&self, cluster: &Cluster, xds: SocketAddr) -> Operator {
        let xds = xds.to_string();
        let mut op = Operator::start(cluster, &["--namespace", &self.ns, "--xds-listen", &xds]).unwrap();
        op.wait_ready(T).unwrap();
        op
    }

    /// An Envoy over ADS whose listener routes everything to the service's cluster, and a
    /// prober through it, once both backends answered.
    fn envoy(&self, xds: SocketAddr, delta: bool) -> (Envoy, Prober) {
        let node = if delta { "edge-delta" } else { "edge-sotw" };
        let config = EnvoyConfig::new(node, "edge")
            .with_xds(XdsSource::new(xds, delta))
            .with_route(Route::prefix("/", &self.cluster()));
        let envoy = Envoy::start(&config).unwrap();
        envoy.wait_ready(Instant::now() + T).unwrap();
        let prober = Prober::start(ProbeConfig::new(envoy.listener_addr(), "/")).unwrap();
        let now = Instant::now();
        for name in ["a", "b"] {
            prober.wait_first_hit(name, now, now + T).unwrap_or_else(|e| panic!("{e}\n{}", envoy.log_tail(30)));
        }
        (envoy, prober)
    }
}

/// How long after `written` backend `name` stopped answering requests, through `prober`.
fn stopped_after(prober: &Prober, name: &str, written: Instant) -> Duration {
    let gone = prober.wait_gone(name, written, Duration::from_millis(500), 50, written + T).unwrap();
    gone.saturating_duration_since(written)
}

/// How long after `written` backend `name` answered a request again.
fn back_after(prober: &Prober, name: &str, written: Instant) -> Duration {
    prober.wait_first_hit(name, written, written + T).unwrap().sent.saturating_duration_since(written)
}

#[test]
#[cfg_attr(e2e_external_cluster, ignore = "starts its own Consul agent beside the cluster the tests start")]
#[cfg_attr(e2e_no_real_agent, ignore = "no real Consul agent (bash scripts/real-parts.sh consul)")]
#[cfg_attr(e2e_no_envoy, ignore = "no Envoy (bash scripts/real-parts.sh envoy)")]
fn envoy_stops_and_resumes_traffic_to_a_backend_within_the_window_of_its_check_both_variants() {
    let cluster = Cluster::shared();
    let agent = RealAgent::start().unwrap();
    let world = World::new(cluster, &agent, "xds-flips");
    let xds: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let op = world.operator(cluster, xds);
    let sotw = world.envoy(xds, false);
    let delta = world.envoy(xds, true);
    let bound = WINDOW + BEYOND;
    let mut taken = Vec::new();
    for _ in 0..FLIPS {
        let written = world.set("b", "critical");
        for (variant, (envoy, prober)) in [("sotw", &sotw), ("delta", &delta)] {
            let stopped = stopped_after(prober, "b", written);
            taken.push(format!("{variant} stop {stopped:?}"));
            assert!(
                stopped <= bound,
                "{variant}: b still answered {stopped:?} after its check failed\n{}",
                envoy.log_tail(20)
            );
        }
        let written = world.set("b", "passing");
        for (variant, (envoy, prober)) in [("sotw", &sotw), ("delta", &delta)] {
            let back = back_after(prober, "b", written);
            taken.push(format!("{variant} back {back:?}"));
            assert!(
                back <= bound,
                "{variant}: b answered again only {back:?} after its check passed\n{}",
                envoy.log_tail(20)
            );
        }
    }
    eprintln!("flips, from the Consul write's 200: {}", taken.join(", "));
    // Neither Envoy saw a failed request: the flips moved traffic, never dropped it.
    for (variant, (_, prober)) in [("sotw", &sotw), ("delta", &delta)] {
        let counts = prober.with(|r| r.counts(r.samples().front().unwrap().sent, None));
        assert_eq!(counts.failed(), 0, "{variant}: {counts:?}");
    }
    // The ops server lists both clients, each having ACKed what it holds.
    let (code, body) = op.get("/xds/clients").unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("edge-sotw") && body.contains("edge-delta"), "{body}");
}

#[test]
#[cfg_attr(e2e_external_cluster, ignore = "starts its own Consul agent beside the cluster the tests start")]
#[cfg_attr(e2e_no_real_agent, ignore = "no real Consul agent (bash scripts/real-parts.sh consul)")]
#[cfg_attr(e2e_no_envoy, ignore = "no Envoy (bash scripts/real-parts.sh envoy)")]
fn an_operator_restart_and_a_consul_outage_lose_no_request() {
    let cluster = Cluster::shared();
    let agent = RealAgent::start().unwrap();
    let world = World::new(cluster, &agent, "xds-restart");
    let xds: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut op = world.operator(cluster, xds);
    let (sotw, sotw_probe) = world.envoy(xds, false);
    let (delta, delta_probe) = world.envoy(xds, true);
    let from = Instant::now();
    let connected = |envoy: &Envoy, want: u64| {
        envoy
            .wait_until(Instant::now() + T, &format!("control_plane.connected_state {want}"), |e| {
                Ok((e.stat("control_plane.connected_state")? == Some(want)).then_some(()))
            })
            .unwrap();
    };

    // The operator goes: both Envoys lose their xDS stream and keep routing.
    assert!(op.terminate(T).unwrap().success(), "{}", op.logs());
    connected(&sotw, 0);
    connected(&delta, 0);
    // It comes back: before its first snapshot it sends nothing, after it the same view.
    let op = world.operator(cluster, xds);
    connected(&sotw, 1);
    connected(&delta, 1);
    // And it is followed: a flip goes through the new process.
    let written = world.set("b", "critical");
    for prober in [&sotw_probe, &delta_probe] {
        assert!(stopped_after(prober, "b", written) <= WINDOW + BEYOND);
    }
    // Back in the rotation before Consul goes: what is kept then is both.
    let written = world.set("b", "passing");
    for prober in [&sotw_probe, &delta_probe] {
        back_after(prober, "b", written);
    }

    // Consul goes: the operator keeps the last endpoints (stale), and so do the Envoys.
    drop(agent);
    op.wait_snapshot("the endpoints kept, stale", T, |s| {
        e2e::fixtures::service(s, &world.ns, "consul", &world.svc).is_some_and(|e| e["stale"].is_object())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    let stale = Instant::now();
    for prober in [&sotw_probe, &delta_probe] {
        for name in ["a", "b"] {
            prober.wait_first_hit(name, stale, stale + T).unwrap();
        }
    }
    for (variant, prober) in [("sotw", &sotw_probe), ("delta", &delta_probe)] {
        let counts = prober.with(|r| r.counts(from, None));
        assert_eq!(counts.failed(), 0, "{variant}: requests failed across the restart or the outage: {counts:?}");
        assert!(counts.of("a") > 0 && counts.of("b") > 0, "{variant}: {counts:?}");
        eprintln!("{variant}: over {:?}: {counts:?}", from.elapsed());
    }
}

#[test]
#[cfg_attr(e2e_external_cluster, ignore = "starts its own Consul agent beside the cluster the tests start")]
#[cfg_attr(e2e_no_real_agent, ignore = "no real Consul agent (bash scripts/real-parts.sh consul)")]
#[cfg_attr(e2e_no_envoy, ignore = "no Envoy (bash scripts/real-parts.sh envoy)")]
fn over_mutual_tls_a_listed_envoy_gets_consul_and_kubernetes_clusters_and_an_unlisted_one_nothing() {
    use consul_sim::tls::TestPki;
    use e2e::envoy::{Pem, XdsTls};

    let cluster = Cluster::shared();
    let agent = RealAgent::start().unwrap();
    let world = World::new(cluster, &agent, "xds-tls");
    // A Kubernetes Service routed to, with one named port (documentation addresses: Envoy
    // holds them, nothing connects to them).
    cluster
        .apply(&format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: api, namespace: {ns}}}\nspec: {{ports: [{{name: http, port: 80}}]}}\n---\napiVersion: v1\nkind: Endpoints\nmetadata: {{name: api, namespace: {ns}}}\nsubsets:\n- addresses: [{{ip: 192.0.2.10}}]\n  ports: [{{name: http, port: 8080}}]\n",
            ns = world.ns
        ))
        .unwrap();
    cluster.apply(&mapping_yaml(&world.ns, "api", "api:80", None)).unwrap();
    let pki = TestPki::generate().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, pem: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, pem).unwrap();
        path.to_string_lossy().into_owned()
    };
    let (cert, key, ca) = (
        file("cert.pem", &pki.server_cert_pem),
        file("key.pem", &pki.server_key_pem),
        file("ca.pem", &pki.ca_cert_pem),
    );
    let xds: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let xds_arg = xds.to_string();
    let args = ["--namespace", &world.ns, "--xds-listen", &xds_arg, "--xds-tls-cert", &cert, "--xds-tls-key", &key];
    let more = ["--xds-tls-client-ca", &ca, "--xds-allow-node", "edge-tls"];
    let mut op = Operator::start(cluster, &[&args[..], &more[..]].concat()).unwrap();
    op.wait_ready(T).unwrap();
    let tls = XdsTls {
        ca: Pem::Inline(pki.ca_cert_pem.clone()),
        client_cert: Some((Pem::Inline(pki.client_cert_pem.clone()), Pem::Inline(pki.client_key_pem.clone()))),
        sni: Some("localhost".to_owned()),
        subject_alt_name: Some("localhost".to_owned()),
    };
    let source =
        XdsSource { tls: Some(tls), initial_fetch_timeout: Some(Duration::from_secs(2)), ..XdsSource::new(xds, true) };
    let start = |node: &str| {
        let config =
            EnvoyConfig::new(node, "edge").with_xds(source.clone()).with_route(Route::prefix("/", &world.cluster()));
        let envoy = Envoy::start(&config).unwrap();
        envoy.wait_ready(Instant::now() + T).unwrap();
        envoy
    };
    let listed = start("edge-tls");
    let kube_cluster = format!("kubernetes/{}/api/http", world.ns);
    let want: Vec<SocketAddr> = vec!["192.0.2.10:8080".parse().unwrap()];
    listed
        .wait_until(Instant::now() + T, "the Kubernetes Service's cluster", |e| {
            Ok((e.cluster_hosts(&kube_cluster)?.as_ref() == Some(&want)).then_some(()))
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    let prober = Prober::start(ProbeConfig::new(listed.listener_addr(), "/")).unwrap();
    let now = Instant::now();
    for name in ["a", "b"] {
        prober.wait_first_hit(name, now, now + T).unwrap_or_else(|e| panic!("{e}\n{}", listed.log_tail(30)));
    }

    // The same certificate, a node id not listed: refused, so it never learns a cluster.
    let stranger = start("edge-stranger");
    wait_metric(&op, "consul_resolver_xds_clients_refused_total{reason=\"node_id\"}");
    assert_eq!(stranger.cluster_hosts(&world.cluster()).unwrap(), None, "an unlisted node got the cluster");
    let (_, clients) = op.get("/xds/clients").unwrap();
    assert!(clients.contains("edge-tls") && !clients.contains("edge-stranger"), "{clients}");
    assert!(op.terminate(T).unwrap().success(), "{}", op.logs());
}

/// Waits until the operator's metric `series` is at least 1.
fn wait_metric(op: &Operator, series: &str) {
    e2e::harness::wait_for(series, T, || op.metric(series).filter(|v| *v >= 1.0))
        .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
}
