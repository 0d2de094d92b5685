//! Benchmark of the Consul source against the in-process simulator on loopback (not a
//! timed test): `cargo run --release -p e2e --bin consul-bench`.
//!
//! 1,000 watched services with the product's default options (`healthStatuses: [passing]`),
//! each on a node of its own, over two scopes (tokens; `BENCH_SCOPES`), at the default budget
//! (100 connections: a change feed per scope, dedicated queries for the rest of the lanes,
//! the other services "fed"). Reports, one change at a time:
//! - health flips (a service check critical, then passing again; `BENCH_FLIPS`, 1,000):
//!   latency from the write to the event, separately for dedicated services (the baseline of
//!   the same run) and fed ones of each scope, and Consul requests per flip;
//! - node check flips (`serfHealth` critical, then passing again; `BENCH_NODE_FLIPS`, 200):
//!   the same figures;
//! - port changes (`BENCH_CHANGES`, 100), which move the catalog without rewriting a check:
//!   the same figures;
//! - the requests per watched service per minute when nothing changes (`BENCH_IDLE_SECS`,
//!   60, extrapolated), and peak connections;
//! - an outage (`BENCH_OUTAGE_SECS`, 30; 0 skips it): Consul stopped, then a fresh cluster
//!   (lower index, every service on a new port) on the same address: the requests sent while
//!   it was down, and how long after its return every service's new port is seen.
//!
//! `BENCH_SERVICES` sets the size. `BENCH_TLS=1` serves Consul over TLS (a certificate made
//! at start) with HTTP/2: every service then has a blocking query of its own, as a stream,
//! and the report adds the HTTP/2 connections and the most streams on one of them.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use consul_resolver_core::keys::{ConsulKey, ConsulServer, QueryOptions, Secret, TlsSettings};
use consul_resolver_core::model::{ConsulEvent, Event, Health};
use consul_sim::tls::TestPki;
use consul_sim::{Config, Simulator};
use consul_watch::{ConsulSource, Metrics, Settings};
use e2e::bench::{env_usize, percentile};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_util::task::AbortOnDropHandle;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let services = env_usize("BENCH_SERVICES", 1000);
    let changes = env_usize("BENCH_CHANGES", 100);
    let flips = env_usize("BENCH_FLIPS", 1000);
    let node_flips = env_usize("BENCH_NODE_FLIPS", 200);
    let scopes = env_usize("BENCH_SCOPES", 2).max(1);
    let idle_secs = env_usize("BENCH_IDLE_SECS", 60) as u64;
    let outage_secs = env_usize("BENCH_OUTAGE_SECS", 30) as u64;
    let settings = Settings::default();
    let pki = std::env::var("BENCH_TLS").is_ok_and(|v| v == "1").then(TestPki::generate).transpose()?;
    let sim_config = Config { tls: pki.as_ref().map(TestPki::server_tls), ..Config::default() };
    // Its own thread and runtime, so the simulator's work does not share ours.
    let sim = Simulator::start_background(sim_config.clone())?;
    let base = sim.base_url();
    let http = match &pki {
        Some(pki) => reqwest::Client::builder().use_preconfigured_tls(pki.client_config(false)?).build()?,
        None => reqwest::Client::new(),
    };
    let tls = pki.as_ref().map(|p| TlsSettings { ca_pem: Some(p.ca_cert_pem.as_str().into()), ..Default::default() });
    let put = |path: &'static str, body: serde_json::Value| {
        let http = http.clone();
        let url = format!("{base}{path}");
        async move {
            let r = http.put(url).json(&body).send().await?;
            anyhow::ensure!(r.status().is_success(), "{path}: {}", r.status());
            anyhow::Ok(())
        }
    };
    // Each service on a node of its own, so a node check concerns one service. `status:
    // None` writes the service alone, leaving its check as it is: a catalog move the checks
    // cannot account for (as on agents that do not rewrite an unchanged check).
    let register = |name: String, port: u16, status: Option<&'static str>| {
        let mut body = json!({"Node": format!("{name}-node"), "Address": "127.0.0.1",
            "Service": {"ID": name, "Service": name, "Port": port}});
        if let Some(status) = status {
            body["Check"] =
                json!({"CheckID": format!("service:{name}"), "Name": "c", "Status": status, "ServiceID": name});
        }
        put("/v1/catalog/register", body)
    };
    let node_check = |name: &str, status: &'static str| {
        put(
            "/v1/catalog/register",
            json!({"Node": format!("{name}-node"), "Address": "127.0.0.1",
                   "Check": {"CheckID": "serfHealth", "Name": "Serf Health Status", "Status": status}}),
        )
    };
    let names: Vec<String> = (0..services).map(|i| format!("svc-{i}")).collect();
    for n in &names {
        register(n.clone(), 1, Some("passing")).await?;
        node_check(n, "passing").await?;
    }

    let metrics = Metrics::unregistered();
    let source = ConsulSource::new(settings.clone(), metrics.clone());
    let (tx, mut rx) = mpsc::channel(100_000);
    // The product's default options (healthStatuses: [passing]); services spread over
    // `scopes` tokens (no ACLs here: a token is another scope, with a feed of its own).
    let scope_of = |i: usize| i % scopes;
    let keys: Vec<ConsulKey> = names
        .iter()
        .enumerate()
        .map(|(i, n)| ConsulKey {
            server: ConsulServer {
                address: base.clone(),
                token: (scope_of(i) > 0).then(|| Secret::new(format!("team-{}", scope_of(i)))),
                tls: tls.clone(),
            },
            datacenter: None,
            namespace: None,
            partition: None,
            remote: None,
            query: QueryOptions::default(),
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
    let series = |label: &'static str, n: usize| Series { label, n, scopes, ..Series::default() };
    let mut flips_seen = series("health flip (service check, critical and back)", flips);
    let mut node_flips_seen = series("node check flip (critical and back)", node_flips);
    let mut moves_seen = series("port change, with its check", changes);
    let mut bare_moves_seen = series("port change, service alone", changes);
    let mut ports = vec![1u16; services];
    let mut critical = vec![false; services];
    let mut node_critical = vec![false; services];
    #[derive(Clone, Copy, PartialEq)]
    enum Change {
        Flip,
        NodeFlip,
        Move,
        BareMove,
    }
    let all = (0..flips).map(|i| (i, Change::Flip));
    let all = all
        .chain((0..node_flips).map(|i| (i, Change::NodeFlip)))
        .chain((0..changes).map(|i| (i, Change::Move)))
        .chain((0..changes).map(|i| (i + changes, Change::BareMove)));
    for (i, kind) in all {
        while rx.try_recv().is_ok() {}
        // Flips go critical and back on one service, two at a time.
        let s = match kind {
            Change::Flip | Change::NodeFlip => ((i / 2) * 7919) % services,
            _ => (i * 7919) % services,
        };
        let name = names[s].clone();
        sim.clear_requests();
        let t0 = Instant::now();
        match kind {
            Change::Flip => critical[s] = !critical[s],
            Change::NodeFlip => node_critical[s] = !node_critical[s],
            Change::Move | Change::BareMove => ports[s] = 2000 + (i % 60000) as u16,
        }
        let (port, status) = (ports[s], if critical[s] { "critical" } else { "passing" });
        match kind {
            Change::NodeFlip => node_check(&name, if node_critical[s] { "critical" } else { "passing" }).await?,
            _ => register(name.clone(), port, (kind != Change::BareMove).then_some(status)).await?,
        }
        // Passing only: a critical instance (or one on a critical node) is left out.
        let published = !critical[s] && !node_critical[s];
        loop {
            match rx.recv().await {
                Some(Event::Consul(k, ConsulEvent::Answer { endpoints, .. }))
                    if k.service == name
                        && (endpoints.iter().any(|e| e.port == port) == published)
                        && (!published || endpoints.iter().all(|e| e.health == Health::Passing)) =>
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
            Change::NodeFlip => &mut node_flips_seen,
            Change::Move => &mut moves_seen,
            Change::BareMove => &mut bare_moves_seen,
        };
        seen.add(dedicated.contains(&name), scope_of(s), took, requests);
    }
    let stats = sim.stats();
    println!(
        "services watched:           {services} in {scopes} scope(s) ({} with a blocking query of their own)",
        dedicated.len()
    );
    println!("connection budget:          {}", settings.max_connections);
    println!("change feeds:               {}", metrics.feeds());
    println!("bootstrap (all answered):   {bootstrap:?}");
    println!(
        "idle requests:              {idle_requests} in {idle:?} = {per_service_minute:.3} per service per minute (extrapolated)"
    );
    flips_seen.print();
    node_flips_seen.print();
    moves_seen.print();
    bare_moves_seen.print();
    println!("peak connections:           {} (429s: {})", stats.peak_connections_total, stats.total_429);
    if pki.is_some() {
        println!(
            "TLS, while idle:            connections by protocol {:?}, most streams on one connection {}",
            idle_stats.open_connections_by_protocol, idle_stats.peak_streams_per_connection
        );
    }

    // An outage: Consul stops (every connection closed, new ones refused) for a while, then
    // a fresh cluster answers on the same address, every service on a new port. Requests
    // while down, and how long until every service's new port is seen.
    if outage_secs > 0 {
        let addr = sim.addr();
        drop(sim);
        let down = Instant::now();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let before = metrics.requests_total();
        tokio::time::sleep_until((down + Duration::from_secs(outage_secs)).into()).await;
        let while_down = metrics.requests_total() - before;
        let sim = Simulator::start_background(Config { listen: addr, initial_index: 2, ..sim_config })?;
        for n in &names {
            register(n.clone(), 4000, Some("passing")).await?;
        }
        let back = Instant::now();
        let mut converged = HashSet::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        while converged.len() < services {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(Event::Consul(k, ConsulEvent::Answer { endpoints, .. })))
                    if endpoints.iter().any(|e| e.port == 4000) =>
                {
                    converged.insert(k.service);
                }
                Ok(Some(_)) => {}
                _ => anyhow::bail!("only {} of {services} converged after the outage", converged.len()),
            }
        }
        println!(
            "outage of {outage_secs} s:            {while_down} requests in its last {} s; every service converged {:?} after Consul came back (all registered again in {:?})",
            outage_secs - 2,
            back.elapsed(),
            back - down - Duration::from_secs(outage_secs),
        );
        drop(sim);
    }
    Ok(())
}

/// One series of changes: latencies by kind of watch (and, for fed ones, by scope), and
/// requests per change.
#[derive(Default)]
struct Series {
    label: &'static str,
    n: usize,
    scopes: usize,
    dedicated: Vec<Duration>,
    /// By scope.
    fed: std::collections::BTreeMap<usize, Vec<Duration>>,
    requests: Vec<usize>,
}

impl Series {
    fn add(&mut self, dedicated: bool, scope: usize, took: Duration, requests: usize) {
        if dedicated { &mut self.dedicated } else { self.fed.entry(scope).or_default() }.push(took);
        self.requests.push(requests);
    }

    fn print(&mut self) {
        println!("{} x {}:", self.label, self.n);
        let mut rows = vec![("dedicated".to_owned(), &mut self.dedicated)];
        let scopes = self.scopes;
        rows.extend(self.fed.iter_mut().map(|(scope, v)| {
            let label = if scopes > 1 { format!("fed, scope {}", scope + 1) } else { "fed".to_owned() };
            (label, v)
        }));
        for (kind, v) in rows {
            if v.is_empty() {
                continue;
            }
            v.sort();
            println!(
                "  {kind:<14} change -> event: n {}  p50 {:?}  p99 {:?}  max {:?}",
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
