//! The traffic level: the same health flips, seen by requests.
//!
//! Two real HTTP backends on loopback (`e2e::backends`), `a` and `b`, each answering its
//! name, take the place of the documentation instances of `web` in the agent (nodes of
//! their own, address 127.0.0.1). Two proxies route to them at once: a real Envoy 1.40
//! whose only cluster, `consul/<ns>/consul/web`, comes from the operator over xDS (ADS,
//! state of the world), and Traefik 3.7's consulCatalog (`watch=true`,
//! `strictChecks=passing`) behind a router on its entrypoint to `web@consulcatalog`. A
//! prober (`e2e::probe`) sends a request every 5 ms through each and records who answered.
//!
//! `b`'s check is flipped critical and back `BENCH_FLIPS` times. Each flip is timed from the
//! HTTP 200 of the Consul write, per proxy, request by request: critical, until the first
//! request after the last one `b` answered (and `b` answers none for 500 ms after it);
//! passing, until the first request `b` answers. Once both proxies have it,
//! `BENCH_SPACING_MS` more before the next write (beyond Traefik's 2 s throttle).

use std::time::{Duration, Instant};

use anyhow::Context;
use e2e::backends::Backends;
use e2e::bench::{loadavg, percentile};
use e2e::envoy::{Envoy, EnvoyConfig, Route, XdsSource};
use e2e::probe::{Counts, ProbeConfig, Prober};

use super::{A, B, Bench, Samples, Traefik, ms};

/// The longest a proxy may take to show a flip; past it, the flip is counted as missed.
const DEADLINE: Duration = Duration::from_secs(60);

/// How long `b` must answer nothing before it counts as gone (100 requests at 5 ms, every
/// other one of which it answered while in the rotation).
const QUIET: Duration = Duration::from_millis(500);

/// The fewest requests those 500 ms must hold (a stalled prober proves nothing).
const QUIET_REQUESTS: usize = 50;

/// A proxy on the way: the prober through it, and what it showed of each way.
struct Proxy {
    prober: Prober,
    stop: Samples,
    back: Samples,
}

/// What the traffic level measured, per proxy: the flips each way, and the requests of the
/// whole level by outcome.
pub(crate) struct Traffic {
    proxies: Vec<(Samples, Samples, Counts)>,
    flips: usize,
    load_start: String,
    load_end: String,
}

/// The traffic level, on `bench`'s agent and operator (its view-level flips done).
pub(crate) fn run(bench: &Bench) -> anyhow::Result<Traffic> {
    let load_start = loadavg();
    let backends = Backends::start(&["a", "b"])?;
    let set = |name: &str, status: &str| -> anyhow::Result<Instant> {
        let port = backends.addr(name).port();
        bench.consul.register(&format!("node-{name}"), "127.0.0.1", "web", &format!("web-{name}"), port, status)?;
        Ok(Instant::now())
    };
    set("a", "passing")?;
    set("b", "passing")?;
    for old in [A, B] {
        bench.consul.deregister(&format!("node-{old}"), &format!("web-{old}"))?;
    }
    let cluster = format!("consul/{}/consul/web", bench.views.ns);
    let config = EnvoyConfig {
        log_level: "warning".to_owned(),
        ..EnvoyConfig::new("peer-bench", "edge")
            .with_xds(XdsSource::new(bench.xds, false))
            .with_route(Route::prefix("/", &cluster))
    };
    let envoy = Envoy::start(&config)?;
    envoy.wait_ready(Instant::now() + DEADLINE)?;
    let traefik = Traefik::start(&bench.agent_address, true, true)?;
    let mut proxies = [
        proxy("Envoy, the operator over xDS", envoy.listener_addr().port())?,
        proxy("Traefik consulCatalog, watch=true", traefik.web)?,
    ];
    println!("traffic level: {} flips each way, a request every 5 ms through each proxy", bench.knobs.flips);
    let from = Instant::now();
    for i in 0..bench.knobs.flips * 2 {
        let critical = i % 2 == 0;
        let written = set("b", if critical { "critical" } else { "passing" })?;
        for p in &mut proxies {
            let (samples, took) = if critical {
                let gone = p.prober.wait_gone("b", written, QUIET, QUIET_REQUESTS, written + DEADLINE);
                (&mut p.stop, gone.ok().map(|g| g.saturating_duration_since(written)))
            } else {
                let hit = p.prober.wait_first_hit("b", written, written + DEADLINE);
                (&mut p.back, hit.ok().map(|s| s.sent.saturating_duration_since(written)))
            };
            match took {
                Some(d) => samples.taken.push(d),
                None => samples.missed += 1,
            }
        }
        std::thread::sleep(bench.knobs.spacing); // the spacing between changes, beyond Traefik's throttle
    }
    let proxies = proxies.map(|p| {
        let counts = p.prober.stop().counts(from, None);
        (p.stop, p.back, counts)
    });
    Ok(Traffic { proxies: proxies.into(), flips: bench.knobs.flips, load_start, load_end: loadavg() })
}

/// A prober through the proxy listening on `port`, once both backends have answered.
fn proxy(name: &'static str, port: u16) -> anyhow::Result<Proxy> {
    let prober = Prober::start(ProbeConfig::new(([127, 0, 0, 1], port).into(), "/"))?;
    let now = Instant::now();
    for backend in ["a", "b"] {
        prober.wait_first_hit(backend, now, now + DEADLINE).with_context(|| format!("{name}: {backend} answering"))?;
    }
    Ok(Proxy { prober, stop: Samples::new(name), back: Samples::new(name) })
}

fn sorted(s: &Samples) -> Vec<Duration> {
    let mut t = s.taken.clone();
    t.sort();
    t
}

impl Traffic {
    /// The table (markdown), per way and proxy: min, p50, p99, max and the ratio of each
    /// of p50 and p99 to Traefik's; then the requests that reached no backend.
    pub(crate) fn report(&self) {
        println!();
        println!(
            "| flip | proxy | flips seen | min | p50 (median) | p99 | max (ms) | p50 vs Traefik | p99 vs Traefik |"
        );
        println!("|---|---|---|---|---|---|---|---|---|");
        for (way, stop) in [("critical: `b` gets no more requests", true), ("passing: `b` gets requests again", false)]
        {
            let pick = |(s, b, _): &(Samples, Samples, Counts)| sorted(if stop { s } else { b });
            let traefik = self.proxies.iter().find(|p| p.0.name.starts_with("Traefik")).map(pick);
            for p in &self.proxies {
                let (name, t) = (&p.0.name, pick(p));
                if t.is_empty() {
                    println!("| {way} | {name} | 0 of {} | | | | | | |", self.flips);
                    continue;
                }
                let ratio = |q: f64| match &traefik {
                    Some(b) if !b.is_empty() => {
                        format!("{:.2}x", percentile(&t, q).as_secs_f64() / percentile(b, q).as_secs_f64())
                    }
                    _ => String::new(),
                };
                let [min, p50, p99, max] = [t[0], percentile(&t, 0.5), percentile(&t, 0.99), t[t.len() - 1]].map(ms);
                let (r50, r99) = (ratio(0.5), ratio(0.99));
                println!(
                    "| {way} | {name} | {} of {} | {min} | {p50} | {p99} | {max} | {r50} | {r99} |",
                    t.len(),
                    self.flips
                );
            }
        }
        println!();
        for (s, _, counts) in &self.proxies {
            println!("{}: {} requests, {} reached no backend: {counts:?}", s.name, counts.total(), counts.failed());
        }
        println!(
            "traffic level: load average {} at its start, {} at its end (1, 5, 15 min)",
            self.load_start, self.load_end
        );
    }
}
