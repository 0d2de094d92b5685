//! Benchmark of the Consul source against the in-process simulator on loopback (not a
//! timed test): `cargo run --release -p e2e --bin consul-bench`.
//!
//! 1,000 watched services with the default budget (100 connections). Reports the latency
//! from a catalog write to the endpoint update arriving as an event (p50/p99 over 1,000
//! changes, one at a time), the requests per watched service per minute when nothing
//! changes (measured over a shorter period and extrapolated), and peak connections.
//! `BENCH_SERVICES`, `BENCH_CHANGES` and `BENCH_IDLE_SECS` override the sizes.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use consul_resolver_core::keys::{ConsulKey, ConsulServer, HealthStatuses, QueryOptions};
use consul_resolver_core::model::{ConsulEvent, Event};
use consul_resolver_operator::consul::{ConsulSource, Settings};
use consul_sim::{Config, Simulator};
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
    let changes = env_usize("BENCH_CHANGES", 1000);
    let idle_secs = env_usize("BENCH_IDLE_SECS", 60) as u64;
    let settings = Settings::default();
    // Its own thread and runtime, so the simulator's work does not share ours.
    let sim = Simulator::start_background(Config::default())?;
    let base = sim.base_url();
    let http = reqwest::Client::new();
    let register = |name: String, port: u16| {
        let http = http.clone();
        let url = format!("{base}/v1/catalog/register");
        async move {
            let body = json!({"Node": "bench", "Address": "127.0.0.1",
                "Service": {"ID": name, "Service": name, "Port": port},
                "Check": {"CheckID": format!("service:{name}"), "Name": "c", "Status": "passing", "ServiceID": name}});
            let r = http.put(url).json(&body).send().await?;
            anyhow::ensure!(r.status().is_success(), "register: {}", r.status());
            anyhow::Ok(())
        }
    };
    let names: Vec<String> = (0..services).map(|i| format!("svc-{i}")).collect();
    for n in &names {
        register(n.clone(), 1).await?;
    }

    let source = ConsulSource::new(settings.clone());
    let (tx, mut rx) = mpsc::channel(100_000);
    let keys: Vec<ConsulKey> = names
        .iter()
        .map(|n| ConsulKey {
            server: ConsulServer { address: base.clone(), token: None, tls: None },
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

    // Latency: one change at a time, spread over the services.
    while rx.try_recv().is_ok() {}
    let mut latencies = Vec::with_capacity(changes);
    for i in 0..changes {
        let s = (i * 7919) % services;
        let port = 2000 + (i % 60000) as u16;
        let t0 = Instant::now();
        register(names[s].clone(), port).await?;
        loop {
            match rx.recv().await {
                Some(Event::Consul(k, ConsulEvent::Answer { endpoints, .. }))
                    if k.service == names[s] && endpoints.iter().any(|e| e.port == port) =>
                {
                    break;
                }
                Some(_) => {}
                None => anyhow::bail!("event channel closed"),
            }
        }
        latencies.push(t0.elapsed());
    }
    latencies.sort();
    let stats = sim.stats();
    println!("services watched:           {services}");
    println!("connection budget:          {}", settings.max_connections);
    println!("bootstrap (all answered):   {bootstrap:?}");
    println!(
        "idle requests:              {idle_requests} in {idle:?} = {per_service_minute:.3} per service per minute (extrapolated)"
    );
    println!(
        "change -> event latency:    p50 {:?}  p99 {:?}  max {:?}  over {changes} changes",
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies.last().copied().unwrap_or_default()
    );
    println!("peak connections:           {} (429s: {})", stats.peak_connections_total, stats.total_429);
    Ok(())
}
