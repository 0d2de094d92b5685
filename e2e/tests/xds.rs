//! Envoy reads the operator's view over xDS (docs/xds.md): a real Envoy 1.40 connects over
//! ADS, state of the world and delta side by side, and routes real requests through a
//! listener with static routes to HTTP backends registered in a real Consul agent (1.8.7).
//! A prober sends a request every 5 ms through each Envoy and records which backend
//! answered each one; a check going critical must stop traffic to its backend, and passing
//! bring it back, within the coalescing window + 100 ms of the Consul write's HTTP 200. An
//! operator restart and a Consul outage must lose no request.
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
    world.set("b", "passing");

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
