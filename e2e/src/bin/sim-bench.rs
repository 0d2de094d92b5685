//! Benchmark of the Consul simulator itself (not a timed test): how fast it answers the
//! reads the operator makes, at the default size and at the scale profile's, so that the
//! operator benchmark measures the operator; and, with `BENCH_REAL_AGENT=1`, how fast a
//! real Consul agent (1.8.7, `consul agent -dev` from `scripts/real-parts.sh consul`)
//! answers the same reads over the same catalog, so that the simulator's figures can be
//! read against a real server's. `cargo run --release -p e2e --bin sim-bench`; results in
//! docs/benchmarks.md.
//!
//! Per size (`BENCH_SIZES`, services x instances per service, default `1000x1,5000x15`;
//! instance k of every service on node `bench-k`, each with a passing service check), a
//! fresh in-process simulator on loopback (then, with `BENCH_REAL_AGENT=1`, a fresh
//! agent), filled through `/v1/catalog/register`, timed, then:
//! - health reads (`/v1/health/service/<random service>?passing`, what a watch reads) from
//!   `BENCH_READERS` (8) kept-alive clients for `BENCH_SECS` (10) seconds: reads a second,
//!   and each read's latency (p50 / p99 / max);
//! - the change feed's two queries (`/v1/health/state/any`, `/v1/catalog/services`), 20
//!   each in turn: latency min / median / max and the answer's size; then the checks
//!   answer again, asked not compressed (what its gzip costs the server and the client);
//! - `/v1/health/state/critical` (no check is critical: an empty answer) 20 times in turn:
//!   what a server spends on such a query besides writing out its checks;
//! - writes (`/v1/catalog/register` of one instance with a new port), 200 in turn: latency
//!   p50 / p99.
//!
//! Every read asks for gzip, as the operator does, and is timed until its last byte; sizes
//! are the bytes received. The first size's simulator is the baseline of the health read
//! p50; each agent's change feed answer is also given over the simulator's at its size.
//! Client and server share the machine's cores, so the figures include the client's own
//! work.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use consul_sim::{Config, RunningSim, Simulator};
use e2e::agent::RealAgent;
use e2e::bench::{env_usize, percentile};
use futures::{StreamExt, TryStreamExt};
use serde_json::{Value, json};

/// Latencies, sorted on demand.
#[derive(Default)]
struct Latencies(Vec<Duration>);

impl Latencies {
    fn percentile(&mut self, p: f64) -> Duration {
        self.0.sort();
        if self.0.is_empty() { Duration::ZERO } else { percentile(&self.0, p) }
    }

    fn summary(&mut self) -> String {
        let (p50, p99, max) = (self.percentile(0.5), self.percentile(0.99), self.percentile(1.0));
        format!("{} / {} / {}", ms(p50), ms(p99), ms(max))
    }
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

fn registration(service: usize, k: usize, port: u16) -> Value {
    let (svc, id, node) = (format!("svc-{service}"), format!("svc-{service}-{k}"), format!("bench-{k}"));
    json!({
        "Node": node,
        "Address": format!("127.0.{}.{}", k / 250, k % 250 + 1),
        "Service": {"ID": id, "Service": svc, "Port": port},
        "Check": {"CheckID": format!("check-{id}"), "Name": "health", "Status": "passing", "ServiceID": id}
    })
}

/// The Consul that answers.
enum Server {
    Simulator(RunningSim),
    Agent(RealAgent),
}

impl Server {
    async fn start(real: bool) -> anyhow::Result<Server> {
        if real {
            let agent = tokio::task::spawn_blocking(RealAgent::start_quiet).await??;
            return Ok(Server::Agent(agent));
        }
        Ok(Server::Simulator(Simulator::start(Config { max_conns_per_client: 0, ..Config::default() }).await?))
    }

    fn name(&self) -> &'static str {
        match self {
            Server::Simulator(_) => "simulator",
            Server::Agent(_) => "Consul 1.8.7",
        }
    }

    fn base_url(&self) -> String {
        match self {
            Server::Simulator(sim) => sim.base_url(),
            Server::Agent(agent) => agent.base_url.clone(),
        }
    }

    async fn stop(self) {
        match self {
            Server::Simulator(sim) => sim.shutdown().await,
            Server::Agent(agent) => drop(agent),
        }
    }
}

/// A read asking for its answer in `encoding`: `gzip` as the operator asks, whose bytes
/// reqwest (built without it here) leaves as they came, or `identity`, not compressed.
fn read(client: &reqwest::Client, url: String, encoding: &str) -> reqwest::RequestBuilder {
    client.get(url).header("Accept-Encoding", encoding).timeout(Duration::from_secs(60))
}

struct Measured {
    server: &'static str,
    size: String,
    fill: Duration,
    reads_per_sec: f64,
    read: Latencies,
    state_any: (Latencies, String),
    state_any_identity: (Latencies, String),
    services: (Latencies, String),
    critical: Latencies,
    write: Latencies,
}

async fn measure(
    server: Server,
    services: usize,
    per_service: usize,
    readers: usize,
    secs: u64,
) -> anyhow::Result<Measured> {
    let base = server.base_url();
    let client = reqwest::Client::builder().pool_max_idle_per_host(readers + 4).build()?;
    let fill = Instant::now();
    fill_catalog(&client, &base, services, per_service).await?;
    let fill = fill.elapsed();
    eprintln!("{} {services} x {per_service}: filled in {:.1} s", server.name(), fill.as_secs_f64());
    let (reads_per_sec, health) = health_reads(&client, &base, services, readers, secs).await?;
    let state_any = timed(&client, &base, "/v1/health/state/any", "gzip").await?;
    let state_any_identity = timed(&client, &base, "/v1/health/state/any", "identity").await?;
    let services_q = timed(&client, &base, "/v1/catalog/services", "gzip").await?;
    let (critical, _) = timed(&client, &base, "/v1/health/state/critical", "gzip").await?;
    let write = writes(&client, &base, services).await?;
    let name = server.name();
    server.stop().await;
    Ok(Measured {
        server: name,
        fill,
        size: format!("{services} x {per_service}"),
        reads_per_sec,
        read: health,
        state_any,
        state_any_identity,
        services: services_q,
        critical,
        write,
    })
}

/// Every service's instances, 32 registrations at a time.
async fn fill_catalog(client: &reqwest::Client, base: &str, services: usize, per_service: usize) -> anyhow::Result<()> {
    let url = format!("{base}/v1/catalog/register");
    futures::stream::iter((0..services).flat_map(|s| (0..per_service).map(move |k| (s, k))))
        .map(|(s, k)| {
            let req = client.put(&url).json(&registration(s, k, 20000 + k as u16)).timeout(Duration::from_secs(30));
            async move {
                let resp = req.send().await.context("register")?;
                if !resp.status().is_success() {
                    bail!("register: {}", resp.status());
                }
                Ok(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Health reads from `readers` kept-alive clients at once for `secs`: reads a second and
/// their latencies.
async fn health_reads(
    client: &reqwest::Client,
    base: &str,
    services: usize,
    readers: usize,
    secs: u64,
) -> anyhow::Result<(f64, Latencies)> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let started = Instant::now();
    let tasks: Vec<_> = (0..readers)
        .map(|r| {
            let (client, base) = (client.clone(), base.to_owned());
            tokio::spawn(async move {
                let mut lat = Vec::new();
                let mut n = r * 7919;
                while Instant::now() < deadline {
                    n = (n * 31 + 17) % services.max(1);
                    let t = Instant::now();
                    let resp =
                        read(&client, format!("{base}/v1/health/service/svc-{n}?passing"), "gzip").send().await?;
                    let body = resp.bytes().await?;
                    lat.push(t.elapsed());
                    anyhow::ensure!(!body.is_empty(), "an empty answer");
                }
                anyhow::Ok(lat)
            })
        })
        .collect();
    let mut health = Latencies::default();
    for t in tasks {
        health.0.extend(t.await??);
    }
    Ok((health.0.len() as f64 / started.elapsed().as_secs_f64(), health))
}

/// `path` read 20 times in turn, in `encoding`: the latencies, and the last answer's size as
/// received.
async fn timed(
    client: &reqwest::Client,
    base: &str,
    path: &str,
    encoding: &str,
) -> anyhow::Result<(Latencies, String)> {
    let mut lat = Latencies::default();
    let mut bytes = String::new();
    for _ in 0..20 {
        let t = Instant::now();
        let resp = read(client, format!("{base}{path}"), encoding).send().await?;
        anyhow::ensure!(resp.status().is_success(), "{path}: {}", resp.status());
        let gzip = resp.headers().get("content-encoding").is_some_and(|e| e == "gzip");
        let body = resp.bytes().await?;
        lat.0.push(t.elapsed());
        bytes = format!("{} bytes{}", body.len(), if gzip { " gzipped" } else { "" });
    }
    Ok((lat, bytes))
}

/// 200 registrations in turn, each of an instance 0 with a new port.
async fn writes(client: &reqwest::Client, base: &str, services: usize) -> anyhow::Result<Latencies> {
    let url = format!("{base}/v1/catalog/register");
    let mut write = Latencies::default();
    for i in 0..200 {
        let t = Instant::now();
        let resp = client.put(&url).json(&registration(i % services, 0, 30000 + (i % 1000) as u16)).send().await?;
        anyhow::ensure!(resp.status().is_success(), "write: {}", resp.status());
        write.0.push(t.elapsed());
    }
    Ok(write)
}

fn main() -> anyhow::Result<()> {
    let sizes = std::env::var("BENCH_SIZES").unwrap_or_else(|_| "1000x1,5000x15".into());
    let readers = env_usize("BENCH_READERS", 8);
    let secs = env_usize("BENCH_SECS", 10) as u64;
    let real = std::env::var("BENCH_REAL_AGENT").is_ok_and(|v| v == "1");
    let load = || std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim().to_owned();
    let load_start = load();
    // reqwest is built without a default TLS provider (plain HTTP here, but the client
    // still wants one).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut results = Vec::new();
    for size in sizes.split(',') {
        let (s, k) = size.split_once('x').context("BENCH_SIZES: SERVICESxINSTANCES,...")?;
        let (s, k) = (s.trim().parse()?, k.trim().parse()?);
        for agent in [false, true].into_iter().filter(|&a| !a || real) {
            results.push(rt.block_on(async { measure(Server::start(agent).await?, s, k, readers, secs).await })?);
        }
    }
    println!("load average {load_start} at the start, {} at the end; {readers} readers for {secs} s per size", load());
    println!();
    print_table(&mut results);
    Ok(())
}

fn print_table(results: &mut [Measured]) {
    println!(
        "| server | size (services x instances) | filled in | health reads / s | health read p50 / p99 / max | p50 / baseline | /v1/health/state/any min / median / max (bytes) | / simulator's median | the same, not compressed (bytes) | /v1/catalog/services min / median / max (bytes) | /v1/health/state/critical (none) min / median / max | write p50 / p99 |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let baseline = results.first_mut().map(|r| r.read.percentile(0.5)).unwrap_or_default();
    let mut simulator_median = Duration::ZERO;
    for r in results {
        let p50 = r.read.percentile(0.5);
        let (sa, sa_bytes) = &mut r.state_any;
        let (cs, cs_bytes) = &mut r.services;
        let (si, si_bytes) = &mut r.state_any_identity;
        if r.server == "simulator" {
            simulator_median = sa.percentile(0.5);
        }
        println!(
            "| {} | {} | {:.1} s | {:.0} | {} | {:.2}x | {} / {} / {} ({}) | {:.2}x | {} / {} / {} ({}) | {} / {} / {} ({}) | {} / {} / {} | {} / {} |",
            r.server,
            r.size,
            r.fill.as_secs_f64(),
            r.reads_per_sec,
            r.read.summary(),
            p50.as_secs_f64() / baseline.as_secs_f64().max(1e-9),
            ms(sa.percentile(0.0)),
            ms(sa.percentile(0.5)),
            ms(sa.percentile(1.0)),
            sa_bytes,
            sa.percentile(0.5).as_secs_f64() / simulator_median.as_secs_f64().max(1e-9),
            ms(si.percentile(0.0)),
            ms(si.percentile(0.5)),
            ms(si.percentile(1.0)),
            si_bytes,
            ms(cs.percentile(0.0)),
            ms(cs.percentile(0.5)),
            ms(cs.percentile(1.0)),
            cs_bytes,
            ms(r.critical.percentile(0.0)),
            ms(r.critical.percentile(0.5)),
            ms(r.critical.percentile(1.0)),
            ms(r.write.percentile(0.5)),
            ms(r.write.percentile(0.99)),
        );
    }
}
