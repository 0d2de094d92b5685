//! Benchmark of the Consul source against the in-process simulator on loopback (not a
//! timed test): `cargo run --release -p e2e --bin consul-bench`.
//!
//! 1,000 watched services with the default budget (100 connections: 88 of them get a
//! blocking query of their own, the rest are "fed"). Reports, one change at a time:
//! - health flips (a check passing <-> critical; `BENCH_FLIPS`, 1,000): latency from the
//!   write to the event, separately for dedicated and fed services (the dedicated ones are
//!   the baseline of the same run), and Consul requests per flip;
//! - port changes (`BENCH_CHANGES`, 100), which move the catalog without rewriting a check:
//!   the same figures;
//! - the requests per watched service per minute when nothing changes (`BENCH_IDLE_SECS`,
//!   60, extrapolated), and peak connections.
//!
//! `BENCH_SERVICES` sets the size. `BENCH_TLS=1` serves Consul over TLS (a certificate made
//! at start) with HTTP/2: every service then has a blocking query of its own, as a stream,
//! and the report adds the HTTP/2 connections and the most streams on one of them.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use consul_resolver_core::keys::{ConsulKey, ConsulServer, HealthStatuses, QueryOptions, TlsSettings};
use consul_resolver_core::model::{ConsulEvent, Event, Health};
use consul_sim::tls::TestPki;
use consul_sim::{Config, Simulator};
use consul_watch::{ConsulSource, Metrics, Settings};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_util::task::AbortOnDropHandle;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let services = env_usize("BENCH_SERVICES", 1000);
    let changes = env_usize("BENCH_CHANGES", 100);
    let flips = env_usize("BENCH_FLIPS", 1000);
    let idle_secs = env_usize("BENCH_IDLE_SECS", 60) as u64;
    let settings = Settings::default();
    let pki = std::env::var("BENCH_TLS").is_ok_and(|v| v == "1").then(TestPki::generate).transpose()?;
    // Its own thread and runtime, so the simulator's work does not share ours.
    let sim = Simulator::start_background(Config { tls: pki.as_ref().map(TestPki::server_tls), ..Config::default() })?;
    let base = sim.base_url();
    let http = match &pki {
        Some(pki) => reqwest::Client::builder().use_preconfigured_tls(pki.client_config(false)?).build()?,
        None => reqwest::Client::new(),
    };
    let tls = pki.as_ref().map(|p| TlsSettings { ca_pem: Some(p.ca_cert_pem.as_str().into()), ..Default::default() });
    // `status: None` writes the service alone, leaving its check as it is: a catalog move the
    // checks cannot account for (as on agents that do not rewrite an unchanged check).
    let register = |name: String, port: u16, status: Option<&'static str>| {
        let http = http.clone();
        let url = format!("{base}/v1/catalog/register");
        async move {
            let mut body = json!({"Node": "bench", "Address": "127.0.0.1",
                "Service": {"ID": name, "Service": name, "Port": port}});
            if let Some(status) = status {
                body["Check"] =
                    json!({"CheckID": format!("service:{name}"), "Name": "c", "Status": status, "ServiceID": name});
            }
            let r = http.put(url).json(&body).send().await?;
            anyhow::ensure!(r.status().is_success(), "register: {}", r.status());
            anyhow::Ok(())
        }
    };
    let names: Vec<String> = (0..services).map(|i| format!("svc-{i}")).collect();
    for n in &names {
        register(n.clone(), 1, Some("passing")).await?;
    }

    let source = ConsulSource::new(settings.clone(), Metrics::unregistered());
    let (tx, mut rx) = mpsc::channel(100_000);
    let keys: Vec<ConsulKey> = names
        .iter()
        .map(|n| ConsulKey {
            server: ConsulServer { address: base.clone(), token: None, tls: tls.clone() },
            datacenter: None,
            namespace: None,
            partition: None,
            query: QueryOptions { statuses: HealthStatuses::ANY, ..QueryOptions::default() },
            service: n.clone(),
        })
        .collect();
    sim.reset_stats();
    let started = Instant::now();
    let _tasks: Vec<_> =
        keys.iter().map(|k| AbortOnDropHandle::new(tokio::spawn(source.watch(k.clone(), tx.clone())))).collect();
    let mut answered = HashSet::new();
    while answered.len() < services {
        if let Some(Event::Consul(k, ConsulEvent::Answer { .. })) = rx.recv().await {
            answered.insert(k.service);
        }
    }
    let bootstrap = started.elapsed();

    // Idle: nothing changes; count requests.
    tokio::time::sleep(Duration::from_secs(2)).await;
    sim.clear_requests();
    let idle = Duration::from_secs(idle_secs);
    tokio::time::sleep(idle).await;
    let idle_requests = sim.requests().len();
    let per_service_minute = idle_requests as f64 / services as f64 * (60.0 / idle.as_secs_f64());
    // The services holding a blocking query of their own, and the connections they use.
    let idle_stats = sim.stats();
    let dedicated: HashSet<String> = idle_stats.blocking.keys().filter(|k| k.starts_with("svc-")).cloned().collect();

    // One change at a time, spread over the services; each timed from the write to the
    // event, and the Consul requests it caused counted (the log is cleared before each).
    let series = |label: &'static str, n: usize| Series { label, n, ..Series::default() };
    let mut flips_seen = series("health flip", flips);
    let mut moves_seen = series("port change, with its check", changes);
    let mut bare_moves_seen = series("port change, service alone", changes);
    let mut ports = vec![1u16; services];
    let mut critical = vec![false; services];
    #[derive(Clone, Copy, PartialEq)]
    enum Change {
        Flip,
        Move,
        BareMove,
    }
    let all = (0..flips).map(|i| (i, Change::Flip));
    let all =
        all.chain((0..changes).map(|i| (i, Change::Move))).chain((0..changes).map(|i| (i + changes, Change::BareMove)));
    for (i, kind) in all {
        while rx.try_recv().is_ok() {}
        let s = (i * 7919) % services;
        let name = names[s].clone();
        sim.clear_requests();
        let t0 = Instant::now();
        if kind == Change::Flip {
            critical[s] = !critical[s];
        } else {
            ports[s] = 2000 + (i % 60000) as u16;
        }
        let (port, status) = (ports[s], if critical[s] { "critical" } else { "passing" });
        register(name.clone(), port, (kind != Change::BareMove).then_some(status)).await?;
        let want = if critical[s] { Health::Critical } else { Health::Passing };
        loop {
            match rx.recv().await {
                Some(Event::Consul(k, ConsulEvent::Answer { endpoints, .. }))
                    if k.service == name && endpoints.iter().any(|e| e.port == port && e.health == want) =>
                {
                    break;
                }
                Some(_) => {}
                None => anyhow::bail!("event channel closed"),
            }
        }
        let took = t0.elapsed();
        // Requests the change caused: counted once the re-reads it set off have settled
        // (no new request for 200 ms).
        let count = || sim.requests().iter().filter(|r| !r.path.starts_with("/v1/catalog/register")).count();
        let (mut requests, mut since) = (count(), Instant::now());
        while since.elapsed() < Duration::from_millis(200) {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let now = count();
            if now != requests {
                (requests, since) = (now, Instant::now());
            }
        }
        let seen = match kind {
            Change::Flip => &mut flips_seen,
            Change::Move => &mut moves_seen,
            Change::BareMove => &mut bare_moves_seen,
        };
        seen.add(dedicated.contains(&name), took, requests);
    }
    let stats = sim.stats();
    println!("services watched:           {services} ({} with a blocking query of their own)", dedicated.len());
    println!("connection budget:          {}", settings.max_connections);
    println!("bootstrap (all answered):   {bootstrap:?}");
    println!(
        "idle requests:              {idle_requests} in {idle:?} = {per_service_minute:.3} per service per minute (extrapolated)"
    );
    flips_seen.print();
    moves_seen.print();
    bare_moves_seen.print();
    println!("peak connections:           {} (429s: {})", stats.peak_connections_total, stats.total_429);
    if pki.is_some() {
        println!(
            "TLS, while idle:            connections by protocol {:?}, most streams on one connection {}",
            idle_stats.open_connections_by_protocol, idle_stats.peak_streams_per_connection
        );
    }
    Ok(())
}

/// One series of changes: latencies by kind of watch, and requests per change.
#[derive(Default)]
struct Series {
    label: &'static str,
    n: usize,
    dedicated: Vec<Duration>,
    fed: Vec<Duration>,
    requests: Vec<usize>,
}

impl Series {
    fn add(&mut self, dedicated: bool, took: Duration, requests: usize) {
        if dedicated { &mut self.dedicated } else { &mut self.fed }.push(took);
        self.requests.push(requests);
    }

    fn print(&mut self) {
        println!("{} x {}:", self.label, self.n);
        for (kind, v) in [("dedicated", &mut self.dedicated), ("fed", &mut self.fed)] {
            if v.is_empty() {
                continue;
            }
            v.sort();
            println!(
                "  {kind:<9} change -> event: n {}  p50 {:?}  p99 {:?}  max {:?}",
                v.len(),
                percentile(v, 0.5),
                percentile(v, 0.99),
                v.last().copied().unwrap_or_default()
            );
        }
        self.requests.sort();
        let mean = self.requests.iter().sum::<usize>() as f64 / self.requests.len().max(1) as f64;
        println!(
            "  Consul requests per change: mean {mean:.1}  p50 {}  max {}",
            self.requests[self.requests.len() / 2],
            self.requests.last().copied().unwrap_or_default()
        );
    }
}
