//! Benchmark of the Consul source against the in-process simulator on loopback (not a
//! timed test): `cargo run --release -p e2e --bin consul-bench`.
//!
//! 1,000 watched services with the product's default options (`healthStatuses: [passing]`),
//! each on a node of its own (`BENCH_SERVICES_PER_NODE`, 1: more puts them on shared nodes,
//! as services registered through the agents of a few hosts are), over two scopes (tokens;
//! `BENCH_SCOPES`), at the default budget
//! (100 connections: a change feed per scope, dedicated queries for the rest of the lanes,
//! the other services "fed"). Reports, one change at a time:
//! - health flips (a service check critical, then passing again; `BENCH_FLIPS`, 1,000):
//!   latency from the write to the event, separately for dedicated services (the baseline of
//!   the same run) and fed ones of each scope, and Consul requests per flip;
//! - node check flips (`serfHealth` critical, then passing again; `BENCH_NODE_FLIPS`, 200):
//!   the same figures (the event awaited is the flipped service's; a shared node's other
//!   services change with it);
//! - port changes (`BENCH_CHANGES`, 100), which move the catalog without rewriting a check:
//!   the same figures;
//! - the requests per watched service per minute when nothing changes (`BENCH_IDLE_SECS`,
//!   60, extrapolated), and peak connections;
//! - an outage (`BENCH_OUTAGE_SECS`, 30; 0 skips it): Consul stopped, then a fresh cluster
//!   (lower index, every service on a new port) on the same address: the requests sent while
//!   it was down, and how long after its return every service's new port is seen.
//!
//! `BENCH_BOOTSTRAP_LATENCY_MS` adds that much to every Consul request until every service
//! has answered once: the bootstrap against a Consul a round trip away.
//!
//! `BENCH_SERVICES` sets the size. `BENCH_TLS=1` serves Consul over TLS (a certificate made
//! at start) with HTTP/2: every service then has a blocking query of its own, as a stream,
//! and the report adds the HTTP/2 connections and the most streams on one of them.
//!
//! `BENCH_REAL_AGENT=1` runs the port changes against a real agent instead (a fresh
//! `consul agent -dev`, the 1.8.7 that `scripts/real-parts.sh consul` caches): the services
//! registered through the agent's own API, each with a TTL check, all on the agent's node,
//! one scope; `BENCH_CHANGES` port changes through that API (1.8 writes the changed service
//! alone, its check as it was). Requests are counted by the source's own metrics, latency
//! from the write to the event, whichever way the watch follows its service; the changes
//! whose catalog move spans another raft write (the agent's network coordinates about every
//! 15 s, the leader's barrier every minute: indexes nothing in the catalog explains) are
//! counted apart.
//!
//! `BENCH_FED_SIZE=SERVICESxINSTANCES` (for example `5000x15`) measures the fed path at that
//! size against the simulator and then a real agent (the cached 1.8.7), each filled alike
//! through `/v1/catalog/register`: instance k of every service on node `bench-k` with a
//! passing check; every service watched at the default budget, one scope (88 dedicated,
//! 86 once the feed's status queries take two lanes, the rest fed); then `BENCH_FLIPS`
//! (here 40) health flips, one at a time (an instance's check critical, or warning with
//! `BENCH_FLIP_STATUS=warning`, then passing again, on spread services; the product's
//! default statuses leave either out), each timed from the write to the event, and the
//! source's requests until none came for a second (the sweep an hour, or no second would
//! be quiet; the first sweeps, spread over that hour, are still counted), and which
//! requests did not end `ok` meanwhile. The simulator's run is the baseline of the agent's.
//! With `BENCH_TLS=1` both serve over TLS (a certificate made at start), where HTTP/2 gives
//! every service a blocking query of its own and no feed runs.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use consul_resolver_core::keys::{ConsulKey, Secret, TlsSettings};
use consul_resolver_core::model::{ConsulEvent, Event, Health};
use consul_resolver_core::test_support::consul_key;
use consul_sim::tls::TestPki;
use consul_sim::{Config, FaultsPatch, RunningSim, Simulator, Stats};
use consul_watch::{ConsulSource, Metrics, Settings};
use e2e::bench::{env_usize, percentile};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_util::task::AbortOnDropHandle;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let k = Knobs::from_env();
    if std::env::var("BENCH_REAL_AGENT").is_ok_and(|v| v == "1") {
        return real_agent::run(&k).await;
    }
    if let Ok(size) = std::env::var("BENCH_FED_SIZE") {
        return fed_at_size::run(&size, env_usize("BENCH_FLIPS", 40)).await;
    }
    let settings = Settings::default();
    let pki = std::env::var("BENCH_TLS").is_ok_and(|v| v == "1").then(TestPki::generate).transpose()?;
    let sim_config = Config { tls: pki.as_ref().map(TestPki::server_tls), ..Config::default() };
    // Its own thread and runtime, so the simulator's work does not share ours.
    let sim = Simulator::start_background(sim_config.clone())?;
    let catalog = Catalog::new(sim.base_url(), pki.as_ref(), k.services_per_node)?;
    let names: Vec<String> = (0..k.services).map(|i| format!("svc-{i}")).collect();
    for n in &names {
        catalog.register(n, 1, Some("passing")).await?;
        catalog.node_check(n, "passing").await?;
    }
    let metrics = Metrics::unregistered();
    let source = ConsulSource::new(settings.clone(), metrics.clone());
    let (tx, mut rx) = mpsc::channel(100_000);
    let tls = pki.as_ref().map(|p| TlsSettings { ca_pem: Some(p.ca_cert_pem.as_str().into()), ..Default::default() });
    let keys = keys(&names, &sim.base_url(), tls.as_ref(), k.scopes);
    if k.bootstrap_latency_ms > 0 {
        sim.set_faults(FaultsPatch { latency_ms: Some(k.bootstrap_latency_ms), ..Default::default() });
    }
    sim.reset_stats();
    // As the operator starts: blocking queries held until every service has answered (its
    // first snapshot), so the bootstrap is the first reads' alone.
    source.hold_blocking();
    let started = Instant::now();
    let _tasks: Vec<_> =
        keys.iter().map(|key| AbortOnDropHandle::new(tokio::spawn(source.watch(key.clone(), tx.clone())))).collect();
    answered(&mut rx, k.services).await;
    let bootstrap = started.elapsed();
    source.release_blocking();
    sim.clear_faults();
    let idle = idle(&sim, &k).await;
    let mut series = changes(&sim, &catalog, &names, &idle.dedicated, &mut rx, &k).await?;
    let stats = sim.stats();
    println!(
        "services watched:           {} in {} scope(s) ({} with a blocking query of their own)",
        k.services,
        k.scopes,
        idle.dedicated.len()
    );
    println!("services per node:          {}", k.services_per_node);
    println!("connection budget:          {}", settings.max_connections);
    println!("change feeds:               {}", metrics.feeds());
    println!("bootstrap (all answered):   {bootstrap:?}");
    println!(
        "idle requests:              {} in {:?} = {:.3} per service per minute (extrapolated)",
        idle.requests, idle.over, idle.per_service_minute
    );
    for s in &mut series {
        s.print();
    }
    println!("peak connections:           {} (429s: {})", stats.peak_connections_total, stats.total_429);
    if pki.is_some() {
        println!(
            "TLS, while idle:            connections by protocol {:?}, most streams on one connection {}",
            idle.stats.open_connections_by_protocol, idle.stats.peak_streams_per_connection
        );
    }
    if k.outage_secs > 0 {
        outage(sim, sim_config, &catalog, &names, &metrics, &mut rx, k.outage_secs).await?;
    }
    Ok(())
}

/// The run's sizes, from the environment (see the crate's documentation).
struct Knobs {
    services: usize,
    services_per_node: usize,
    changes: usize,
    flips: usize,
    node_flips: usize,
    scopes: usize,
    idle_secs: u64,
    outage_secs: u64,
    bootstrap_latency_ms: u64,
}

impl Knobs {
    fn from_env() -> Knobs {
        Knobs {
            services: env_usize("BENCH_SERVICES", 1000),
            services_per_node: env_usize("BENCH_SERVICES_PER_NODE", 1).max(1),
            changes: env_usize("BENCH_CHANGES", 100),
            flips: env_usize("BENCH_FLIPS", 1000),
            node_flips: env_usize("BENCH_NODE_FLIPS", 200),
            scopes: env_usize("BENCH_SCOPES", 2).max(1),
            idle_secs: env_usize("BENCH_IDLE_SECS", 60) as u64,
            outage_secs: env_usize("BENCH_OUTAGE_SECS", 30) as u64,
            bootstrap_latency_ms: env_usize("BENCH_BOOTSTRAP_LATENCY_MS", 0) as u64,
        }
    }
}

/// Catalog writes through Consul's HTTP API.
struct Catalog {
    http: reqwest::Client,
    base: String,
    /// How many services share a node: service `svc-<i>` runs on node `node-<i / this>`.
    services_per_node: usize,
}

impl Catalog {
    fn new(base: String, pki: Option<&TestPki>, services_per_node: usize) -> anyhow::Result<Catalog> {
        let http = match pki {
            Some(pki) => reqwest::Client::builder().use_preconfigured_tls(pki.client_config(false)?).build()?,
            None => reqwest::Client::new(),
        };
        Ok(Catalog { http, base, services_per_node })
    }

    /// The node service `name` (`svc-<i>`) runs on.
    fn node(&self, name: &str) -> String {
        let i: usize = name.trim_start_matches("svc-").parse().unwrap_or_default();
        format!("node-{}", i / self.services_per_node)
    }

    async fn put(&self, path: &'static str, body: serde_json::Value) -> anyhow::Result<()> {
        let r = self.http.put(format!("{}{path}", self.base)).json(&body).send().await?;
        anyhow::ensure!(r.status().is_success(), "{path}: {}", r.status());
        Ok(())
    }

    /// Each service on its node (by default a node of its own, so a node check concerns one
    /// service). `status: None` writes the service alone, leaving its check as it is: a catalog move the checks
    /// cannot account for (as on agents that do not rewrite an unchanged check).
    async fn register(&self, name: &str, port: u16, status: Option<&'static str>) -> anyhow::Result<()> {
        let mut body = json!({"Node": self.node(name), "Address": "127.0.0.1",
            "Service": {"ID": name, "Service": name, "Port": port}});
        if let Some(status) = status {
            body["Check"] =
                json!({"CheckID": format!("service:{name}"), "Name": "c", "Status": status, "ServiceID": name});
        }
        self.put("/v1/catalog/register", body).await
    }

    async fn node_check(&self, name: &str, status: &'static str) -> anyhow::Result<()> {
        self.put(
            "/v1/catalog/register",
            json!({"Node": self.node(name), "Address": "127.0.0.1",
                   "Check": {"CheckID": "serfHealth", "Name": "Serf Health Status", "Status": status}}),
        )
        .await
    }
}

/// The scope (token) of service `i`: services spread over `scopes` tokens (no ACLs here: a
/// token is another scope, with a feed of its own).
fn scope_of(i: usize, scopes: usize) -> usize {
    i % scopes
}

/// A watch key per service, with the product's default options (healthStatuses: [passing]).
fn keys(names: &[String], base: &str, tls: Option<&TlsSettings>, scopes: usize) -> Vec<ConsulKey> {
    names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let mut key = consul_key(base, n);
            key.scope_mut().server.token =
                (scope_of(i, scopes) > 0).then(|| Secret::new(format!("team-{}", scope_of(i, scopes))));
            key.scope_mut().server.tls = tls.cloned();
            key
        })
        .collect()
}

/// Waits until every one of `services` watches has answered once.
async fn answered(rx: &mut mpsc::Receiver<Event>, services: usize) {
    let mut answered = HashSet::new();
    while answered.len() < services {
        if let Some(Event::Consul(k, ConsulEvent::Answer { .. })) = rx.recv().await {
            answered.insert(k.service);
        }
    }
}

/// What the watches cost while nothing changes.
struct Idle {
    requests: usize,
    over: Duration,
    per_service_minute: f64,
    stats: Stats,
    /// The services holding a blocking query of their own.
    dedicated: HashSet<String>,
}

/// Nothing changes for `BENCH_IDLE_SECS`: the requests meanwhile, and the services holding
/// a blocking query of their own and the connections they use.
async fn idle(sim: &RunningSim, k: &Knobs) -> Idle {
    tokio::time::sleep(Duration::from_secs(2)).await;
    sim.clear_requests();
    let over = Duration::from_secs(k.idle_secs);
    tokio::time::sleep(over).await;
    let requests = sim.requests().len();
    let per_service_minute = requests as f64 / k.services as f64 * (60.0 / over.as_secs_f64());
    let stats = sim.stats();
    let dedicated = stats.blocking.keys().filter(|k| k.starts_with("svc-")).cloned().collect();
    Idle { requests, over, per_service_minute, stats, dedicated }
}

#[derive(Clone, Copy, PartialEq)]
enum Change {
    Flip,
    NodeFlip,
    Move,
    BareMove,
}

/// What the changes have made of each service so far.
struct State {
    ports: Vec<u16>,
    critical: Vec<bool>,
    node_critical: Vec<bool>,
}

/// One change at a time, spread over the services; each timed from the write to the
/// event, and the Consul requests it caused counted (the log is cleared before each).
/// Returns the series: health flips, node check flips, port changes with their check, and
/// port changes of the service alone.
async fn changes(
    sim: &RunningSim,
    catalog: &Catalog,
    names: &[String],
    dedicated: &HashSet<String>,
    rx: &mut mpsc::Receiver<Event>,
    k: &Knobs,
) -> anyhow::Result<[Series; 4]> {
    let series = |label: &'static str, n: usize| Series { label, n, scopes: k.scopes, ..Series::default() };
    let mut all = [
        series("health flip (service check, critical and back)", k.flips),
        series("node check flip (critical and back)", k.node_flips),
        series("port change, with its check", k.changes),
        series("port change, service alone", k.changes),
    ];
    let mut state = State {
        ports: vec![1u16; k.services],
        critical: vec![false; k.services],
        node_critical: vec![false; k.services],
    };
    let order = (0..k.flips)
        .map(|i| (i, Change::Flip))
        .chain((0..k.node_flips).map(|i| (i, Change::NodeFlip)))
        .chain((0..k.changes).map(|i| (i, Change::Move)))
        .chain((0..k.changes).map(|i| (i + k.changes, Change::BareMove)));
    for (i, kind) in order {
        while rx.try_recv().is_ok() {}
        // Flips go critical and back on one service, two at a time.
        let s = match kind {
            Change::Flip | Change::NodeFlip => ((i / 2) * 7919) % k.services,
            _ => (i * 7919) % k.services,
        };
        sim.clear_requests();
        let t0 = Instant::now();
        change(catalog, &names[s], s, i, kind, &mut state, rx).await?;
        let took = t0.elapsed();
        let requests = settled_requests(sim).await;
        let [flips, node_flips, moves, bare_moves] = &mut all;
        let seen = match kind {
            Change::Flip => flips,
            Change::NodeFlip => node_flips,
            Change::Move => moves,
            Change::BareMove => bare_moves,
        };
        seen.add(dedicated.contains(&names[s]), scope_of(s, k.scopes), took, requests);
    }
    Ok(all)
}

/// Makes change `i` of `kind` to service `s` (`name`) and waits for its event.
async fn change(
    catalog: &Catalog,
    name: &str,
    s: usize,
    i: usize,
    kind: Change,
    state: &mut State,
    rx: &mut mpsc::Receiver<Event>,
) -> anyhow::Result<()> {
    match kind {
        Change::Flip => state.critical[s] = !state.critical[s],
        Change::NodeFlip => state.node_critical[s] = !state.node_critical[s],
        Change::Move | Change::BareMove => state.ports[s] = 2000 + (i % 60000) as u16,
    }
    let (port, status) = (state.ports[s], if state.critical[s] { "critical" } else { "passing" });
    match kind {
        Change::NodeFlip => {
            catalog.node_check(name, if state.node_critical[s] { "critical" } else { "passing" }).await?;
        }
        _ => catalog.register(name, port, (kind != Change::BareMove).then_some(status)).await?,
    }
    // Passing only: a critical instance (or one on a critical node) is left out.
    let published = !state.critical[s] && !state.node_critical[s];
    loop {
        match rx.recv().await {
            Some(Event::Consul(k, ConsulEvent::Answer { endpoints, .. }))
                if k.service == name
                    && (endpoints.iter().any(|e| e.port == port) == published)
                    && (!published || endpoints.iter().all(|e| e.health == Health::Passing)) =>
            {
                return Ok(());
            }
            Some(_) => {}
            None => anyhow::bail!("event channel closed"),
        }
    }
}

/// Requests a change caused: counted once the re-reads it set off have settled (no new
/// request for 200 ms).
async fn settled_requests(sim: &RunningSim) -> usize {
    let count = || sim.requests().iter().filter(|r| !r.path.starts_with("/v1/catalog/register")).count();
    let (mut requests, mut since) = (count(), Instant::now());
    while since.elapsed() < Duration::from_millis(200) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = count();
        if now != requests {
            (requests, since) = (now, Instant::now());
        }
    }
    requests
}

/// An outage: Consul stops (every connection closed, new ones refused) for `secs`, then a
/// fresh cluster answers on the same address, every service on a new port. Requests while
/// down, and how long until every service's new port is seen.
async fn outage(
    sim: RunningSim,
    sim_config: Config,
    catalog: &Catalog,
    names: &[String],
    metrics: &Metrics,
    rx: &mut mpsc::Receiver<Event>,
    secs: u64,
) -> anyhow::Result<()> {
    let addr = sim.addr();
    drop(sim);
    let down = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = metrics.requests_total();
    tokio::time::sleep_until((down + Duration::from_secs(secs)).into()).await;
    let while_down = metrics.requests_total() - before;
    let sim = Simulator::start_background(Config { listen: addr, initial_index: 2, ..sim_config })?;
    for n in names {
        catalog.register(n, 4000, Some("passing")).await?;
    }
    let back = Instant::now();
    let mut converged = HashSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while converged.len() < names.len() {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(Event::Consul(k, ConsulEvent::Answer { endpoints, .. })))
                if endpoints.iter().any(|e| e.port == 4000) =>
            {
                converged.insert(k.service);
            }
            Ok(Some(_)) => {}
            _ => anyhow::bail!("only {} of {} converged after the outage", converged.len(), names.len()),
        }
    }
    println!(
        "outage of {secs} s:            {while_down} requests in its last {} s; every service converged {:?} after Consul came back (all registered again in {:?})",
        secs - 2,
        back.elapsed(),
        back - down - Duration::from_secs(secs),
    );
    drop(sim);
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

/// The port changes against a real agent (`BENCH_REAL_AGENT=1`; see the crate's doc).
mod real_agent {
    use super::*;
    use e2e::agent::RealAgent;

    /// How long no request may come before a change's requests are counted: past the
    /// change feed's wait for its checks (250 ms at this size), so that what the feed does
    /// about a dedicated watch's change is counted with it.
    const QUIET: Duration = Duration::from_millis(600);

    pub(super) async fn run(k: &Knobs) -> anyhow::Result<()> {
        let agent = tokio::task::spawn_blocking(RealAgent::start).await??;
        let http = reqwest::Client::new();
        let names: Vec<String> = (0..k.services).map(|i| format!("svc-{i}")).collect();
        for n in &names {
            register(&http, &agent.base_url, n, 1).await?;
        }
        synced(&http, &agent.base_url, k.services).await?;
        let mut raft = raft_index(&http, &agent.base_url).await?;
        let metrics = Metrics::unregistered();
        let source = ConsulSource::new(Settings::default(), metrics.clone());
        let (tx, mut rx) = mpsc::channel(100_000);
        let keys = keys(&names, &agent.base_url, None, 1);
        let _tasks: Vec<_> = keys
            .iter()
            .map(|key| AbortOnDropHandle::new(tokio::spawn(source.watch(key.clone(), tx.clone()))))
            .collect();
        answered(&mut rx, k.services).await;
        settled(&metrics, Duration::from_secs(2)).await;
        println!("real agent:                 {} services through its agent API, one node, one scope", k.services);
        println!(
            "watches:                    {} dedicated, {} fed",
            metrics.watches("dedicated"),
            metrics.watches("fed")
        );
        let (mut took, mut requests) = (Vec::new(), Vec::new());
        for i in 0..k.changes {
            let (name, port) = (&names[(i * 7919) % k.services], 2000 + i as u16);
            let before = metrics.requests_total();
            let t0 = Instant::now();
            register(&http, &agent.base_url, name, port).await?;
            seen(&mut rx, name, port).await?;
            took.push(t0.elapsed());
            // Another raft write since the previous change: within this change's move. (Read
            // once the change is seen: the agent writes it after its API has answered.)
            let since = std::mem::replace(&mut raft, raft_index(&http, &agent.base_url).await?);
            settled(&metrics, QUIET).await;
            requests.push((metrics.requests_total() - before, raft != since + 1));
        }
        report(&mut took, &requests);
        Ok(())
    }

    /// The last raft index the agent (a server: `-dev`) applied.
    async fn raft_index(http: &reqwest::Client, base: &str) -> anyhow::Result<u64> {
        let agent: serde_json::Value = http.get(format!("{base}/v1/agent/self")).send().await?.json().await?;
        let index = agent["Stats"]["raft"]["applied_index"].as_str().and_then(|i| i.parse().ok());
        index.ok_or_else(|| anyhow::anyhow!("the agent says no raft applied_index"))
    }

    /// Registers `name` on the agent, with a TTL check that passes for a day.
    async fn register(http: &reqwest::Client, base: &str, name: &str, port: u16) -> anyhow::Result<()> {
        let body = json!({"ID": name, "Name": name, "Port": port,
            "Check": {"CheckID": format!("service:{name}"), "TTL": "24h", "Status": "passing"}});
        let r = http.put(format!("{base}/v1/agent/service/register")).json(&body).send().await?;
        anyhow::ensure!(r.status().is_success(), "registering {name}: {}", r.status());
        Ok(())
    }

    /// Waits until the catalog holds the `services` (and the agent's own `consul`).
    async fn synced(http: &reqwest::Client, base: &str, services: usize) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let listed: serde_json::Map<String, serde_json::Value> =
                http.get(format!("{base}/v1/catalog/services")).send().await?.json().await?;
            if listed.len() > services {
                return Ok(());
            }
            anyhow::ensure!(Instant::now() < deadline, "only {} services in the catalog", listed.len());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits for an answer of `name` with `port`.
    async fn seen(rx: &mut mpsc::Receiver<Event>, name: &str, port: u16) -> anyhow::Result<()> {
        loop {
            match tokio::time::timeout(Duration::from_secs(30), rx.recv()).await {
                Ok(Some(Event::Consul(k, ConsulEvent::Answer { endpoints, .. })))
                    if k.service == name && endpoints.iter().any(|e| e.port == port) =>
                {
                    return Ok(());
                }
                Ok(Some(_)) => {}
                _ => anyhow::bail!("the new port of {name} was not seen within 30 s"),
            }
        }
    }

    /// Waits until the source has finished no request for `quiet`.
    pub(super) async fn settled(metrics: &Metrics, quiet: Duration) {
        let (mut seen, mut since) = (metrics.requests_total(), Instant::now());
        while since.elapsed() < quiet {
            tokio::time::sleep(Duration::from_millis(20)).await;
            if metrics.requests_total() != seen {
                (seen, since) = (metrics.requests_total(), Instant::now());
            }
        }
    }

    /// Latencies, and requests per change: of all, and of those with and without another
    /// raft write within their move.
    fn report(took: &mut [Duration], requests: &[(u64, bool)]) {
        took.sort();
        println!(
            "port change x {}:  change -> event p50 {:?}  p99 {:?}  max {:?}",
            took.len(),
            percentile(took, 0.5),
            percentile(took, 0.99),
            took.last().copied().unwrap_or_default()
        );
        let print = |label: &str, keep: &dyn Fn(bool) -> bool| {
            let mut r: Vec<u64> = requests.iter().filter(|(_, c)| keep(*c)).map(|(r, _)| *r).collect();
            r.sort();
            let mean = r.iter().sum::<u64>() as f64 / r.len().max(1) as f64;
            let (p50, max) = (r.get(r.len() / 2).copied().unwrap_or_default(), r.last().copied().unwrap_or_default());
            println!("  Consul requests per change, {label}: n {}  mean {mean:.1}  p50 {p50}  max {max}", r.len());
        };
        print("all", &|_| true);
        print("the change alone in its move", &|c| !c);
        print("another raft write within the move", &|c| c);
    }
}

/// The fed path at a size, against the simulator and a real agent (`BENCH_FED_SIZE`; see
/// the crate's doc).
mod fed_at_size {
    use super::*;
    use anyhow::Context;
    use e2e::agent::RealAgent;
    use futures::{StreamExt, TryStreamExt};
    use std::collections::BTreeMap;

    /// The port of every service's instance 0, the one whose check flips.
    const FLIPPED_PORT: u16 = 20000;

    /// One server's figures.
    struct Measured {
        server: &'static str,
        fill: Duration,
        dedicated: i64,
        fed: i64,
        took: Vec<Duration>,
        requests: Vec<u64>,
        /// Requests that did not end `ok` during the flips, by query, mode and outcome.
        failed: Vec<String>,
    }

    pub(super) async fn run(size: &str, flips: usize) -> anyhow::Result<()> {
        let (services, instances) = size.split_once('x').context("BENCH_FED_SIZE: SERVICESxINSTANCES")?;
        let (services, instances): (usize, usize) = (services.trim().parse()?, instances.trim().parse()?);
        anyhow::ensure!(services > 0 && (1..=250).contains(&instances), "BENCH_FED_SIZE: 1.. x 1..250");
        anyhow::ensure!(flips > 0, "BENCH_FLIPS: at least 1");
        let load = || std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim().to_owned();
        let load_start = load();
        let pki = std::env::var("BENCH_TLS").is_ok_and(|v| v == "1").then(TestPki::generate).transpose()?;
        let status = std::env::var("BENCH_FLIP_STATUS").unwrap_or_else(|_| "critical".into());
        anyhow::ensure!(["critical", "warning"].contains(&status.as_str()), "BENCH_FLIP_STATUS: critical or warning");
        let size = Size { services, instances, flips, status };
        let simulated = against_simulator(pki.as_ref(), &size).await?;
        let real = against_agent(pki.as_ref(), &size).await?;
        let over = if pki.is_some() { "TLS (HTTP/2 where the server offers it)" } else { "plain HTTP" };
        println!(
            "{services} services x {instances} instances over {over}, flips to {}; load average {load_start} at the start, {} at the end",
            size.status,
            load()
        );
        print(&mut [simulated, real]);
        Ok(())
    }

    async fn against_simulator(pki: Option<&TestPki>, size: &Size) -> anyhow::Result<Measured> {
        let config = Config { max_conns_per_client: 0, tls: pki.map(TestPki::server_tls), ..Config::default() };
        let sim = Simulator::start_background(config)?;
        let base = sim.base_url();
        let measured = measure("simulator", Endpoints { watch: &base, write: &base }, pki, size).await;
        sim.shutdown().await;
        measured
    }

    /// A fresh agent, watched over TLS with `pki`, else over plain HTTP.
    async fn against_agent(pki: Option<&TestPki>, size: &Size) -> anyhow::Result<Measured> {
        let start = {
            let pki = pki.cloned();
            move || match &pki {
                Some(pki) => RealAgent::start_tls(pki),
                None => RealAgent::start_quiet(),
            }
        };
        let agent = tokio::task::spawn_blocking(start).await??;
        // Written through its plain HTTP API either way: over HTTP/2, 150,000 registrations
        // 32 at a time ran into the h2 crate's guard against reset streams.
        let watch = agent.https_url.as_deref().unwrap_or(&agent.base_url);
        measure("Consul 1.8.7", Endpoints { watch, write: &agent.base_url }, pki, size).await
    }

    /// What to fill and flip.
    struct Size {
        services: usize,
        instances: usize,
        flips: usize,
        /// The status a flip takes the check to, before passing again.
        status: String,
    }

    /// Where a server is watched, and where the bench writes to it.
    struct Endpoints<'a> {
        watch: &'a str,
        write: &'a str,
    }

    async fn measure(
        server: &'static str,
        at: Endpoints<'_>,
        pki: Option<&TestPki>,
        size: &Size,
    ) -> anyhow::Result<Measured> {
        let (services, instances, flips) = (size.services, size.instances, size.flips);
        let http = match pki.filter(|_| at.write.starts_with("https:")) {
            Some(pki) => reqwest::Client::builder().use_preconfigured_tls(pki.client_config(false)?).build()?,
            None => reqwest::Client::new(),
        };
        let base = at.write;
        let tls = pki.map(|p| TlsSettings { ca_pem: Some(p.ca_cert_pem.as_str().into()), ..Default::default() });
        let t0 = Instant::now();
        fill(&http, base, services, instances).await?;
        let fill = t0.elapsed();
        eprintln!("{server}: filled in {fill:?}");
        let names: Vec<String> = (0..services).map(|i| format!("svc-{i}")).collect();
        let metrics = Metrics::unregistered();
        // The sweep, a request every 5 min per fed service, would leave no quiet second to
        // count a flip's requests by at these sizes; an hour's leaves the rest as it is
        // (its first pass, spread over the hour, is still a request or two a second).
        let settings = Settings { sweep: Duration::from_secs(3600), ..Settings::default() };
        let source = ConsulSource::new(settings, metrics.clone());
        let (tx, mut rx) = mpsc::channel(100_000);
        let _tasks: Vec<_> = keys(&names, at.watch, tls.as_ref(), 1)
            .into_iter()
            .map(|key| AbortOnDropHandle::new(tokio::spawn(source.watch(key, tx.clone()))))
            .collect();
        tokio::time::timeout(Duration::from_secs(300), answered(&mut rx, services))
            .await
            .map_err(|_| anyhow::anyhow!("{server}: not every service answered within 300 s"))?;
        // The first sweeps, spread over the hour, are a read every few hundred milliseconds
        // at these sizes: a longer quiet may never come.
        real_agent::settled(&metrics, Duration::from_millis(500)).await;
        // Over HTTP/2 every watch is a stream of its own: counted with the dedicated.
        let dedicated = metrics.watches("dedicated") + metrics.watches("multiplexed");
        let fed = metrics.watches("fed");
        eprintln!("{server}: every service answered; {dedicated} with a blocking query of its own, {fed} fed");
        let failed_before = failed_counts(&metrics);
        let mut flipper =
            Flipper { http: &http, base, names: &names, metrics: &metrics, rx: &mut rx, status: &size.status };
        let (mut took, mut requests) = (Vec::new(), Vec::new());
        for i in 0..flips {
            let (t, r) = flipper.flip(((i / 2) * 7919) % services, i % 2 == 0).await?;
            eprintln!("{server}: flip {i} seen after {t:?}");
            took.push(t);
            requests.push(r);
        }
        Ok(Measured { server, fill, dedicated, fed, took, requests, failed: failed(&metrics, &failed_before) })
    }

    /// Every count of requests that did not end `ok`, by query, mode and outcome.
    fn failed_counts(metrics: &Metrics) -> BTreeMap<String, u64> {
        let counts = metrics.request_counts().into_iter();
        counts.filter(|([.., outcome], _)| outcome != "ok").map(|([q, m, o], n)| (format!("{q} {m} {o}"), n)).collect()
    }

    /// What failed since `before`, said as "query mode outcome: count".
    fn failed(metrics: &Metrics, before: &BTreeMap<String, u64>) -> Vec<String> {
        let since = |(what, n): (String, u64)| {
            let more = n - before.get(&what).copied().unwrap_or(0);
            (more > 0).then(|| format!("{what}: {more}"))
        };
        failed_counts(metrics).into_iter().filter_map(since).collect()
    }

    /// Flips instance 0's check of one service at a time.
    struct Flipper<'a> {
        http: &'a reqwest::Client,
        base: &'a str,
        names: &'a [String],
        metrics: &'a Metrics,
        rx: &'a mut mpsc::Receiver<Event>,
        status: &'a str,
    }

    impl Flipper<'_> {
        /// Service `s`'s instance 0 out of passing (or passing again): how long until the
        /// source showed it, and the requests until none came for a second.
        async fn flip(&mut self, s: usize, out: bool) -> anyhow::Result<(Duration, u64)> {
            while self.rx.try_recv().is_ok() {}
            let before = self.metrics.requests_total();
            let t0 = Instant::now();
            let write = self.http.put(format!("{}/v1/catalog/register", self.base));
            let status = if out { self.status } else { "passing" };
            http_ok(write.json(&registration(s, 0, status))).await?;
            flipped(self.rx, &self.names[s], out).await?;
            let took = t0.elapsed();
            real_agent::settled(self.metrics, Duration::from_secs(1)).await;
            Ok((took, self.metrics.requests_total() - before))
        }
    }

    /// Instance `k` of service `s`, on node `bench-k`, its check in `status`.
    fn registration(s: usize, k: usize, status: &str) -> serde_json::Value {
        let id = format!("svc-{s}-{k}");
        json!({
            "Node": format!("bench-{k}"),
            "Address": format!("127.0.{}.{}", k / 250, k % 250 + 1),
            "Service": {"ID": id, "Service": format!("svc-{s}"), "Port": FLIPPED_PORT as usize + k},
            "Check": {"CheckID": format!("check-{id}"), "Name": "health",
                      "Status": status, "ServiceID": id}
        })
    }

    async fn fill(http: &reqwest::Client, base: &str, services: usize, instances: usize) -> anyhow::Result<()> {
        let url = format!("{base}/v1/catalog/register");
        futures::stream::iter((0..services).flat_map(|s| (0..instances).map(move |k| (s, k))))
            .map(|(s, k)| http_ok(http.put(&url).json(&registration(s, k, "passing"))))
            .buffer_unordered(32)
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    }

    async fn http_ok(req: reqwest::RequestBuilder) -> anyhow::Result<()> {
        let r = req.timeout(Duration::from_secs(30)).send().await?;
        anyhow::ensure!(r.status().is_success(), "register: {}", r.status());
        Ok(())
    }

    /// Waits for an answer of `name` without its instance 0 (`out` of passing: the product's
    /// `healthStatuses: [passing]` leaves it out) or with it again.
    async fn flipped(rx: &mut mpsc::Receiver<Event>, name: &str, out: bool) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(Event::Consul(k, ConsulEvent::Answer { endpoints, .. })))
                    if k.service == name && endpoints.iter().any(|e| e.port == FLIPPED_PORT) != out =>
                {
                    return Ok(());
                }
                Ok(Some(_)) => {}
                _ => anyhow::bail!("the flip of {name} was not seen within 30 s"),
            }
        }
    }

    fn print(results: &mut [Measured]) {
        println!(
            "| server | filled in | watches with a blocking query of their own / fed | health flip -> event min / p50 / p99 / max | p50 / simulator's | Consul requests per flip, mean / max |"
        );
        println!("|---|---|---|---|---|---|");
        let mut baseline = Duration::ZERO;
        for r in results.iter_mut() {
            r.took.sort();
            let p50 = percentile(&r.took, 0.5);
            if r.server == "simulator" {
                baseline = p50;
            }
            let mean = r.requests.iter().sum::<u64>() as f64 / r.requests.len().max(1) as f64;
            println!(
                "| {} | {:.1} s | {} / {} | {:?} / {:?} / {:?} / {:?} | {:.2}x | {mean:.1} / {} |",
                r.server,
                r.fill.as_secs_f64(),
                r.dedicated,
                r.fed,
                r.took.first().copied().unwrap_or_default(),
                p50,
                percentile(&r.took, 0.99),
                r.took.last().copied().unwrap_or_default(),
                p50.as_secs_f64() / baseline.as_secs_f64().max(1e-9),
                r.requests.iter().max().copied().unwrap_or_default(),
            );
        }
        for r in results.iter() {
            let failed = if r.failed.is_empty() { "none".to_owned() } else { r.failed.join(", ") };
            println!("{}: requests that did not end ok during the flips: {failed}", r.server);
        }
    }
}
