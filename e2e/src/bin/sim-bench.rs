//! Benchmark of the Consul simulator itself (not a timed test): how fast it answers the
//! reads the operator makes, at the default size and at the scale profile's, so that the
//! operator benchmark measures the operator. `cargo run --release -p e2e --bin sim-bench`;
//! results in docs/benchmarks.md.
//!
//! Per size (`BENCH_SIZES`, services x instances per service, default `1000x1,5000x15`;
//! instance k of every service on node `bench-k`, each with a passing service check), a
//! fresh in-process simulator on loopback, filled through `/v1/catalog/register` (not
//! measured), then:
//! - health reads (`/v1/health/service/<random service>?passing`, what a watch reads) from
//!   `BENCH_READERS` (8) kept-alive clients for `BENCH_SECS` (10) seconds: reads a second,
//!   and each read's latency (p50 / p99 / max);
//! - the change feed's two queries (`/v1/health/state/any`, `/v1/catalog/services`), 20
//!   each in turn: latency min / median / max and the answer's size;
//! - writes (`/v1/catalog/register` of one instance with a new port), 200 in turn: latency
//!   p50 / p99.
//!
//! The first size is the baseline: the table gives the ratio of each later size's health
//! read p50 to it. Client and simulator share the machine's cores, so the figures include
//! the client's own work.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use consul_sim::{Config, Simulator};
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
        "Address": format!("10.0.{}.{}", k / 250, k % 250 + 1),
        "Service": {"ID": id, "Service": svc, "Port": port},
        "Check": {"CheckID": format!("check-{id}"), "Name": "health", "Status": "passing", "ServiceID": id}
    })
}

struct Measured {
    size: String,
    instances: usize,
    reads_per_sec: f64,
    read: Latencies,
    state_any: (Latencies, usize),
    services: (Latencies, usize),
    write: Latencies,
}

async fn measure(services: usize, per_service: usize, readers: usize, secs: u64) -> anyhow::Result<Measured> {
    let sim = Simulator::start(Config { max_conns_per_client: 0, ..Config::default() }).await?;
    let base = sim.base_url();
    let client = reqwest::Client::builder().pool_max_idle_per_host(readers + 4).build()?;
    let url = format!("{base}/v1/catalog/register");
    let fill = Instant::now();
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
    eprintln!("{services} x {per_service}: filled in {:.1} s", fill.elapsed().as_secs_f64());

    // Health reads from several kept-alive clients at once.
    let deadline = Instant::now() + Duration::from_secs(secs);
    let started = Instant::now();
    let tasks: Vec<_> = (0..readers)
        .map(|r| {
            let (client, base) = (client.clone(), base.clone());
            tokio::spawn(async move {
                let mut lat = Vec::new();
                let mut n = r * 7919;
                while Instant::now() < deadline {
                    n = (n * 31 + 17) % services.max(1);
                    let t = Instant::now();
                    let resp = client.get(format!("{base}/v1/health/service/svc-{n}?passing")).send().await?;
                    let body = resp.bytes().await?;
                    lat.push(t.elapsed());
                    anyhow::ensure!(!body.is_empty(), "an empty answer");
                }
                anyhow::Ok(lat)
            })
        })
        .collect();
    let mut read = Latencies::default();
    for t in tasks {
        read.0.extend(t.await??);
    }
    let reads_per_sec = read.0.len() as f64 / started.elapsed().as_secs_f64();

    let timed = |path: &'static str| {
        let (client, base) = (client.clone(), base.clone());
        async move {
            let mut lat = Latencies::default();
            let mut bytes = 0;
            for _ in 0..20 {
                let t = Instant::now();
                let body = client.get(format!("{base}{path}")).send().await?.bytes().await?;
                lat.0.push(t.elapsed());
                bytes = body.len();
            }
            anyhow::Ok((lat, bytes))
        }
    };
    let state_any = timed("/v1/health/state/any").await?;
    let services_q = timed("/v1/catalog/services").await?;

    let mut write = Latencies::default();
    for i in 0..200 {
        let t = Instant::now();
        let resp = client.put(&url).json(&registration(i % services, 0, 30000 + (i % 1000) as u16)).send().await?;
        anyhow::ensure!(resp.status().is_success(), "write: {}", resp.status());
        write.0.push(t.elapsed());
    }
    sim.shutdown().await;
    Ok(Measured {
        size: format!("{services} x {per_service}"),
        instances: services * per_service,
        reads_per_sec,
        read,
        state_any,
        services: services_q,
        write,
    })
}

fn main() -> anyhow::Result<()> {
    let sizes = std::env::var("BENCH_SIZES").unwrap_or_else(|_| "1000x1,5000x15".into());
    let readers = env_usize("BENCH_READERS", 8);
    let secs = env_usize("BENCH_SECS", 10) as u64;
    let load = || std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim().to_owned();
    let load_start = load();
    // reqwest is built without a default TLS provider (plain HTTP here, but the client
    // still wants one).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut results = Vec::new();
    for size in sizes.split(',') {
        let (s, k) = size.split_once('x').context("BENCH_SIZES: SERVICESxINSTANCES,...")?;
        results.push(rt.block_on(measure(s.trim().parse()?, k.trim().parse()?, readers, secs))?);
    }
    println!("load average {load_start} at the start, {} at the end; {readers} readers for {secs} s per size", load());
    println!();
    println!(
        "| size (services x instances) | instances | health reads / s | health read p50 / p99 / max | p50 / baseline | /v1/health/state/any min / median / max (bytes) | /v1/catalog/services min / median / max (bytes) | write p50 / p99 |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let baseline = results.first_mut().map(|r| r.read.percentile(0.5)).unwrap_or_default();
    for r in &mut results {
        let p50 = r.read.percentile(0.5);
        let (sa, sa_bytes) = &mut r.state_any;
        let (cs, cs_bytes) = &mut r.services;
        println!(
            "| {} | {} | {:.0} | {} | {:.2}x | {} / {} / {} ({}) | {} / {} / {} ({}) | {} / {} |",
            r.size,
            r.instances,
            r.reads_per_sec,
            r.read.summary(),
            p50.as_secs_f64() / baseline.as_secs_f64().max(1e-9),
            ms(sa.percentile(0.0)),
            ms(sa.percentile(0.5)),
            ms(sa.percentile(1.0)),
            sa_bytes,
            ms(cs.percentile(0.0)),
            ms(cs.percentile(0.5)),
            ms(cs.percentile(1.0)),
            cs_bytes,
            ms(r.write.percentile(0.5)),
            ms(r.write.percentile(0.99)),
        );
    }
    Ok(())
}
