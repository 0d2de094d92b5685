//! The soak (`BENCH_SOAK_SECS`, `make bench-soak`): one operator under a steady stream of
//! changes for minutes, to see whether anything grows that should not, and whether any
//! change is lost. Not a timed test: its figures go to docs/benchmarks.md.
//!
//! The world is the benchmark's (by default 1,000 Consul services, 10,000 Mappings over 5
//! namespaces, a resolver per namespace), plus `CHURN_SERVICES` more services that only
//! the churned Mappings name. One operator (release build) starts on it with
//! `--consul-max-connections` the first of `BENCH_MODES`; then, at `BENCH_SOAK_RATE`
//! changes a second for `BENCH_SOAK_SECS`, one change after another in turn:
//!
//! - a **port change**: one instance of one service re-registered on a new port (which
//!   also makes its check passing again);
//! - a **health flip**: one service's check set critical, or passing again;
//! - a **Mapping churn**: a new Mapping naming one of the churn services, in one of the
//!   namespaces, and the Mapping made `CHURN_LIVE` churns earlier deleted: a watch starts
//!   for the service the new one names, and the one the deleted one named stops.
//!
//! Every `BENCH_SOAK_SAMPLE_SECS` it samples the operator: VmRSS and VmHWM, open file
//! descriptors and sockets, threads, runtime tasks (`consul_resolver_runtime_tasks`),
//! watches by source; and the simulator's open connections. After
//! `BENCH_SOAK_WARMUP_SECS` the samples are held to bounds (see [`Bounds`]). At the end the
//! changes stop and the snapshot ConfigMap must come to hold the final state of every
//! service and every Mapping the changes touched: the model the driver kept.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use consul_resolver_operator::snapshot_configmap as configmap;
use consul_sim::RunningSim;
use e2e::bench::loadavg;
use e2e::harness::{Cluster, Operator, metric_sample, operator_binary};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use serde_json::{Value, json};
use tokio::runtime::Runtime;

use crate::cold_start::{cold_start, stop};
use crate::profile::Settings;
use crate::report::{mib, secs};
use crate::setup::{
    OPERATOR_NS, Setup, consul_http, fresh_sim, kube_client, mapping_resource, namespaces, node_name, placeholder_sim,
    register, registered_port, service_name, set_check, setup,
};
use e2e::procfs::{cpu_time, memory_kib, process_exited};

/// Services only the churned Mappings name.
const CHURN_SERVICES: usize = 100;
/// Churned Mappings alive at once: each churn creates one and deletes the one this many
/// churns older.
const CHURN_LIVE: usize = 50;
/// How long the final state may take to reach the ConfigMap once the changes stop.
const CONVERGE_LIMIT: Duration = Duration::from_secs(120);

/// The operator's count of the snapshots it published.
const PUBLISHED: &str = "consul_resolver_snapshots_published_total";

fn churn_service(j: usize) -> String {
    format!("soak-x{j:03}")
}

/// A churn service's only instance: on node `bench`, on its own port (below the
/// benchmark's 10000-19999).
fn churn_port(j: usize) -> u16 {
    9000 + j as u16
}

/// The soak's settings, from the environment; `None` without `BENCH_SOAK_SECS`.
pub(crate) struct Soak {
    duration: Duration,
    rate: f64,
    warmup: Duration,
    sample_every: Duration,
}

impl Soak {
    pub(crate) fn from_env() -> anyhow::Result<Option<Soak>> {
        let Ok(secs) = std::env::var("BENCH_SOAK_SECS") else {
            return Ok(None);
        };
        let number = |name: &str, default: f64| -> anyhow::Result<f64> {
            match std::env::var(name) {
                Ok(v) => v.trim().parse::<f64>().with_context(|| format!("{name}={v}")),
                Err(_) => Ok(default),
            }
        };
        let duration = secs.trim().parse::<f64>().with_context(|| format!("BENCH_SOAK_SECS={secs}"))?;
        let soak = Soak {
            duration: Duration::from_secs_f64(duration),
            rate: number("BENCH_SOAK_RATE", 5.0)?,
            // Three of the Consul client's 30 s idle timeouts: the connections the cold start's
            // reads opened have closed by then (their close is not a change of the soak's).
            warmup: Duration::from_secs_f64(number("BENCH_SOAK_WARMUP_SECS", 90.0)?),
            sample_every: Duration::from_secs_f64(number("BENCH_SOAK_SAMPLE_SECS", 10.0)?),
        };
        ensure!(soak.rate > 0.0 && soak.rate <= 100.0, "BENCH_SOAK_RATE must be in (0, 100] changes a second");
        ensure!(soak.sample_every >= Duration::from_secs(1), "BENCH_SOAK_SAMPLE_SECS must be at least 1");
        ensure!(
            soak.duration >= soak.warmup + 4 * soak.sample_every,
            "BENCH_SOAK_SECS must leave at least 4 samples after the warm-up (BENCH_SOAK_WARMUP_SECS)"
        );
        Ok(Some(soak))
    }
}

/// What the changes made the world: the state the final snapshot must hold.
struct Model {
    /// Port of each service's instance on node `bench`.
    port: Vec<u16>,
    passing: Vec<bool>,
    /// Churned Mappings alive: (namespace, name) -> the churn service it names.
    live: BTreeMap<(String, String), usize>,
    /// Every churned Mapping, in order: (namespace, name).
    churned: Vec<(String, String)>,
}

impl Model {
    /// The world as the setup made it: every instance on its registered port, passing.
    fn new(s: &Settings) -> Model {
        Model {
            port: (0..s.services).map(|i| registered_port(s, i, 0)).collect(),
            passing: vec![true; s.services],
            live: BTreeMap::new(),
            churned: Vec::new(),
        }
    }
}

#[derive(Default)]
struct Counts {
    port_changes: usize,
    flips: usize,
    created: usize,
    deleted: usize,
    /// Ticks at which the previous change was still being made.
    late: usize,
}

/// One reading of the operator (and of the simulator) during the soak.
#[derive(Clone, Debug)]
struct Sample {
    at: Duration,
    rss_kib: u64,
    hwm_kib: u64,
    fds: usize,
    sockets: usize,
    threads: u64,
    tasks: Option<f64>,
    consul_watches: Option<f64>,
    kube_watches: Option<f64>,
    sim_connections: usize,
    cpu: Duration,
}

fn fds(pid: u32) -> anyhow::Result<(usize, usize)> {
    let mut all = 0;
    let mut sockets = 0;
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        // A descriptor closed between the listing and the readlink is simply not counted.
        let Ok(target) = std::fs::read_link(entry?.path()) else { continue };
        all += 1;
        if target.to_string_lossy().starts_with("socket:") {
            sockets += 1;
        }
    }
    Ok((all, sockets))
}

fn threads(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| format!("no Threads in /proc/{pid}/status"))
}

/// The bounds the samples after the warm-up are held to, fixed before the first run. A
/// task or a connection left behind by one change in a hundred (the soak makes thousands)
/// breaks the task or connection bound; memory growing by a tenth, or steadily by a
/// twentieth, breaks the RSS bounds. A slower leak needs a longer soak to show.
struct Bounds;

impl Bounds {
    /// VmRSS may vary by this much around its value at the end of the warm-up (the
    /// allocator keeps and returns pages as snapshots are built).
    const RSS_SPREAD: f64 = 0.10;
    /// The median of the last fifth of the samples over the median of the first fifth.
    const RSS_TREND: f64 = 1.05;
    /// Sockets and simulator connections: max - min.
    const CONNECTIONS: usize = 8;
    /// Runtime tasks and threads: max - min (a churn starts and stops a watch task).
    const TASKS: f64 = 10.0;
}

fn min_med_max<T: Copy + PartialOrd>(v: &[T]) -> (T, T, T) {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    (v[0], v[v.len() / 2], v[v.len() - 1])
}

fn median_kib(v: &[u64]) -> u64 {
    let mut v = v.to_vec();
    v.sort_unstable();
    v[v.len() / 2]
}

/// The snapshot the ConfigMap holds now (parts included), as JSON.
async fn configmap_snapshot(client: &kube::Client, name: &str) -> anyhow::Result<Value> {
    let api = Api::<ConfigMap>::namespaced(client.clone(), OPERATOR_NS);
    let all = api.list(&ListParams::default().labels("app.kubernetes.io/managed-by=consul-resolver-operator")).await?;
    let main = all.items.iter().find(|c| c.metadata.name.as_deref() == Some(name)).context("no snapshot ConfigMap")?;
    let parts: Vec<ConfigMap> =
        all.items.iter().filter(|c| c.metadata.name.as_deref() != Some(name)).cloned().collect();
    let json = configmap::decode(main, &parts).map_err(anyhow::Error::msg)?;
    Ok(serde_json::from_slice(&json)?)
}

/// How `snapshot` differs from what the model says the world is; empty when it holds the
/// final state of every service and Mapping.
fn differences(snapshot: &Value, model: &Model, s: &Settings, namespaces: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    // Every (namespace, service) the resolvers should list, with its endpoint ports.
    let mut want: BTreeMap<(String, String), Vec<u64>> = BTreeMap::new();
    for ns in namespaces {
        for i in 0..s.services {
            let ports = if model.passing[i] { vec![u64::from(model.port[i])] } else { Vec::new() };
            want.insert((ns.clone(), service_name(i)), ports);
        }
    }
    for ((ns, _), &j) in &model.live {
        want.insert((ns.clone(), churn_service(j)), vec![u64::from(churn_port(j))]);
    }
    let mut have: BTreeMap<(String, String), Vec<u64>> = BTreeMap::new();
    for r in snapshot["resolvers"].as_array().into_iter().flatten() {
        let ns = r["namespace"].as_str().unwrap_or_default();
        for svc in r["services"].as_array().into_iter().flatten() {
            let mut ports: Vec<u64> =
                svc["endpoints"].as_array().into_iter().flatten().filter_map(|e| e["port"].as_u64()).collect();
            ports.sort_unstable();
            have.insert((ns.to_owned(), svc["name"].as_str().unwrap_or_default().to_owned()), ports);
            if let Some(e) = svc["error"].as_str() {
                out.push(format!("{ns}/{}: error {e}", svc["name"]));
            }
        }
    }
    for (key, ports) in &want {
        match have.get(key) {
            Some(p) if p == ports => {}
            Some(p) => out.push(format!("{}/{}: ports {p:?}, want {ports:?}", key.0, key.1)),
            None => out.push(format!("{}/{}: missing, want ports {ports:?}", key.0, key.1)),
        }
    }
    for key in have.keys().filter(|k| !want.contains_key(*k)) {
        out.push(format!("{}/{}: listed, but no Mapping names it any more", key.0, key.1));
    }
    // The churned Mappings: the live ones listed, the deleted ones gone.
    let mappings: BTreeSet<(String, String)> = snapshot["mappings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| Some((m["namespace"].as_str()?.to_owned(), m["name"].as_str()?.to_owned())))
        .collect();
    for m in &model.churned {
        if model.live.contains_key(m) != mappings.contains(m) {
            out.push(format!(
                "Mapping {}/{}: listed {}, alive {}",
                m.0,
                m.1,
                mappings.contains(m),
                model.live.contains_key(m)
            ));
        }
    }
    let want_mappings = s.mappings() + model.live.len();
    if mappings.len() != want_mappings {
        out.push(format!("{} Mappings listed, want {want_mappings}", mappings.len()));
    }
    out
}

/// The soak, start to end; prints its figures as markdown for docs/benchmarks.md.
pub(crate) fn run(rt: &Runtime, cluster: &Cluster, s: &Settings, soak: &Soak, load_start: &str) -> anyhow::Result<()> {
    let mode = s.modes[0];
    println!(
        "== soak: {} services + {CHURN_SERVICES} churn services, {} Mappings in {} namespaces, \
         --consul-max-connections {mode}; {} changes a second for {}, warm-up {}",
        s.services,
        s.mappings(),
        s.namespaces,
        soak.rate,
        secs(soak.duration),
        secs(soak.warmup)
    );
    let rig = Rig::start(rt, cluster, s, mode)?;
    let mut model = Model::new(s);
    let requests_before = rig.sim.stats().requests_total;
    let published_before = rig.op.metric(PUBLISHED);
    let started = Instant::now();
    let (counts, samples) = rt.block_on(rig.drive(soak, started, &mut model))?;
    let changed_for = started.elapsed();
    let (converged, left) = rt.block_on(rig.converge(&model, Instant::now()));
    let end = rt.block_on(rig.sample(started.elapsed()))?;
    let requests = rig.sim.stats().requests_total - requests_before;
    let published = rig.op.metric(PUBLISHED).zip(published_before).map(|(a, b)| a - b);
    let exit = stop(rig.op, &rig.sim)?;
    let outcome = Outcome { counts, samples, end, changed_for, converged, left, requests, published, exit };
    report(s, soak, mode, load_start, &outcome)
}

/// The soak's world with its operator running: what the driver writes to and samples.
struct Rig<'a> {
    s: &'a Settings,
    setup: Setup,
    sim: RunningSim,
    http: reqwest::Client,
    admin: kube::Client,
    op: Operator,
    pid: u32,
    /// The snapshot ConfigMap's name.
    cm: String,
    metrics_url: String,
}

impl<'a> Rig<'a> {
    /// The benchmark's world plus the churn services, and an operator started on it with
    /// budget `mode`.
    fn start(rt: &Runtime, cluster: &Cluster, s: &'a Settings, mode: u32) -> anyhow::Result<Rig<'a>> {
        let placeholder = placeholder_sim(s)?;
        let namespaces = namespaces(cluster, s, "soak")?;
        let setup = rt.block_on(setup(cluster, &placeholder, s, namespaces))?;
        drop(placeholder);
        println!("  setup: Mappings created in {}", secs(setup.mappings_created_in));
        let sim = fresh_sim(rt, setup.sim_addr, s)?;
        let http = consul_http(s, Some(Duration::from_secs(10)))?;
        rt.block_on(async {
            for j in 0..CHURN_SERVICES {
                register(&http, &setup.base_url, &churn_service(j), &node_name(0), churn_port(j)).await?;
            }
            anyhow::Ok(())
        })?;
        let instance = cold_start(&operator_binary()?, rt, cluster, &sim, &setup, s, mode)?;
        let admin = rt.block_on(kube_client(&cluster.admin_kubeconfig))?;
        let metrics_url = instance.op.url("/metrics");
        Ok(Rig { s, setup, sim, http, admin, op: instance.op, pid: instance.pid, cm: instance.cm, metrics_url })
    }

    /// `soak.rate` changes a second for `soak.duration`, recorded in `model`, sampling the
    /// operator every `soak.sample_every`.
    async fn drive(&self, soak: &Soak, started: Instant, model: &mut Model) -> anyhow::Result<(Counts, Vec<Sample>)> {
        let mut counts = Counts::default();
        let mut samples = Vec::new();
        let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / soak.rate));
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut next_sample = Duration::ZERO;
        let target = (soak.duration.as_secs_f64() * soak.rate) as usize;
        for k in 0..target {
            let tick = ticks.tick().await;
            if tick.elapsed() > Duration::from_secs_f64(1.0 / soak.rate) {
                counts.late += 1;
            }
            self.change(k, model, &mut counts).await?;
            let at = started.elapsed();
            if at >= next_sample {
                let one = self.sample(at).await?;
                if samples.len() % 6 == 0 {
                    println!(
                        "  {:>5}: VmRSS {}, fds {} ({} sockets), threads {}, tasks {:?}, watches consul {:?} kube {:?}, sim connections {}",
                        secs(at),
                        mib(one.rss_kib),
                        one.fds,
                        one.sockets,
                        one.threads,
                        one.tasks,
                        one.consul_watches,
                        one.kube_watches,
                        one.sim_connections
                    );
                }
                samples.push(one);
                next_sample += soak.sample_every;
            }
        }
        Ok((counts, samples))
    }

    /// Makes change `k` (of the kind `k % 3`) and records it in the model.
    async fn change(&self, k: usize, model: &mut Model, counts: &mut Counts) -> anyhow::Result<()> {
        let (s, base) = (self.s, &self.setup.base_url);
        let round = k / 3;
        match k % 3 {
            0 => {
                let i = (round * 7919) % s.services;
                let port = 20_000 + (round % 40_000) as u16;
                register(&self.http, base, &service_name(i), &node_name(0), port).await?;
                model.port[i] = port;
                model.passing[i] = true; // registration writes the check passing
                counts.port_changes += 1;
            }
            1 => {
                let i = (round * 104_729 + 17) % s.services;
                let passing = !model.passing[i];
                let status = if passing { "passing" } else { "critical" };
                set_check(&self.http, base, &service_name(i), &node_name(0), status).await?;
                model.passing[i] = passing;
                counts.flips += 1;
            }
            _ => self.churn(round, model, counts).await?,
        }
        Ok(())
    }

    /// A Mapping churn: a new Mapping naming a churn service, and the one made
    /// `CHURN_LIVE` churns earlier deleted.
    async fn churn(&self, round: usize, model: &mut Model, counts: &mut Counts) -> anyhow::Result<()> {
        let namespaces = &self.setup.namespaces;
        let mr = mapping_resource();
        let ns = &namespaces[round % namespaces.len()];
        let name = format!("soak-{round}");
        let j = round % CHURN_SERVICES;
        let mut o = DynamicObject::new(&name, &mr).within(ns);
        o.data = json!({"spec": {"prefix": format!("/{name}/"), "service": format!("{}:8080", churn_service(j)), "resolver": "consul"}});
        Api::<DynamicObject>::namespaced_with(self.admin.clone(), ns, &mr)
            .create(&PostParams::default(), &o)
            .await
            .with_context(|| format!("creating Mapping {ns}/{name}"))?;
        model.live.insert((ns.clone(), name.clone()), j);
        model.churned.push((ns.clone(), name));
        counts.created += 1;
        if round >= CHURN_LIVE {
            let (ns, name) = model.churned[round - CHURN_LIVE].clone();
            Api::<DynamicObject>::namespaced_with(self.admin.clone(), &ns, &mr)
                .delete(&name, &DeleteParams::default())
                .await
                .with_context(|| format!("deleting Mapping {ns}/{name}"))?;
            model.live.remove(&(ns, name));
            counts.deleted += 1;
        }
        Ok(())
    }

    async fn sample(&self, at: Duration) -> anyhow::Result<Sample> {
        let pid = self.pid;
        ensure!(!process_exited(pid), "the operator exited {} into the soak", secs(at));
        let text = self.http.get(&self.metrics_url).send().await?.text().await?;
        let (hwm_kib, rss_kib) = memory_kib(pid)?;
        let (fds, sockets) = fds(pid)?;
        Ok(Sample {
            at,
            rss_kib,
            hwm_kib,
            fds,
            sockets,
            threads: threads(pid)?,
            tasks: metric_sample(&text, "consul_resolver_runtime_tasks"),
            consul_watches: metric_sample(&text, "consul_resolver_watches{source=\"consul\"}"),
            kube_watches: metric_sample(&text, "consul_resolver_watches{source=\"kubernetes\"}"),
            sim_connections: self.sim.stats().open_connections_total,
            cpu: cpu_time(pid)?,
        })
    }

    /// Waits for the ConfigMap to hold the model's final state, every change reflected:
    /// how long after `last_change` it did (`None` past `CONVERGE_LIMIT`), and the
    /// differences left.
    async fn converge(&self, model: &Model, last_change: Instant) -> (Option<Duration>, Vec<String>) {
        loop {
            let left = match configmap_snapshot(&self.admin, &self.cm).await {
                Ok(snapshot) => differences(&snapshot, model, self.s, &self.setup.namespaces),
                Err(e) => vec![format!("ConfigMap not readable: {e:#}")],
            };
            if left.is_empty() || last_change.elapsed() > CONVERGE_LIMIT {
                return (left.is_empty().then(|| last_change.elapsed()), left);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

/// What the soak found, for the report.
struct Outcome {
    counts: Counts,
    samples: Vec<Sample>,
    /// The sample after the final state was reached (or given up on).
    end: Sample,
    /// How long the changes went on.
    changed_for: Duration,
    /// How long after the last change the ConfigMap held every change.
    converged: Option<Duration>,
    /// The differences left between the final snapshot and the model.
    left: Vec<String>,
    requests: u64,
    published: Option<f64>,
    exit: String,
}

fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "MISSED" }
}

/// The soak's figures as markdown; an error when the final snapshot missed a change.
fn report(s: &Settings, soak: &Soak, mode: u32, load_start: &str, o: &Outcome) -> anyhow::Result<()> {
    let after: Vec<&Sample> = o.samples.iter().filter(|x| x.at >= soak.warmup).collect();
    ensure!(after.len() >= 4, "only {} samples after the warm-up", after.len());
    let tasks: Vec<f64> = after.iter().filter_map(|x| x.tasks).collect();
    ensure!(tasks.len() == after.len(), "consul_resolver_runtime_tasks missing from /metrics");
    println!();
    println!(
        "Soak: {} Consul services + {CHURN_SERVICES} churn services, {} Mappings in {} namespaces, --consul-max-connections {mode}, \
         --coalesce-window {}; {} changes a second for {} ({:.2} a second achieved, {} ticks late); warm-up {}, \
         a sample every {}; load average {load_start} at start, {} at end",
        s.services,
        s.mappings(),
        s.namespaces,
        s.window,
        soak.rate,
        secs(o.changed_for),
        (o.counts.port_changes + o.counts.flips + o.counts.created) as f64 / o.changed_for.as_secs_f64(),
        o.counts.late,
        secs(soak.warmup),
        secs(soak.sample_every),
        loadavg()
    );
    println!();
    println!(
        "| measure (after the warm-up: {} samples) | bound | first / min / median / max / end | verdict |",
        after.len()
    );
    println!("|---|---|---|---|");
    memory_rows(&after, &o.end);
    resource_rows(&after, &o.end, &tasks);
    println!(
        "| every change in the final snapshot ConfigMap | within {} of the last change | {} | {} |",
        secs(CONVERGE_LIMIT),
        o.converged.map_or_else(|| format!("{} differences left", o.left.len()), |d| format!("after {}", secs(d))),
        verdict(o.converged.is_some())
    );
    println!();
    changes_line(o, after[0]);
    for d in o.left.iter().take(10) {
        println!("  not in the final snapshot: {d}");
    }
    if o.converged.is_none() {
        bail!("{} differences between the final snapshot and the changes made", o.left.len());
    }
    Ok(())
}

/// VmRSS against its bounds, and VmHWM.
fn memory_rows(after: &[&Sample], end: &Sample) {
    let first = after[0];
    let rss: Vec<u64> = after.iter().map(|x| x.rss_kib).collect();
    let fifth = (after.len() / 5).max(1);
    let trend = median_kib(&rss[rss.len() - fifth..]) as f64 / median_kib(&rss[..fifth]) as f64;
    let (rss_min, rss_med, rss_max) = min_med_max(&rss);
    let spread_ok = (rss_max as f64) <= first.rss_kib as f64 * (1.0 + Bounds::RSS_SPREAD)
        && (rss_min as f64) >= first.rss_kib as f64 * (1.0 - Bounds::RSS_SPREAD);
    println!(
        "| VmRSS | within ±{:.0}% of the first | {} / {} / {} / {} / {} | {} |",
        Bounds::RSS_SPREAD * 100.0,
        mib(first.rss_kib),
        mib(rss_min),
        mib(rss_med),
        mib(rss_max),
        mib(end.rss_kib),
        verdict(spread_ok)
    );
    println!(
        "| VmRSS trend: median of the last fifth / of the first fifth | <= {:.2}x | {trend:.3}x | {} |",
        Bounds::RSS_TREND,
        verdict(trend <= Bounds::RSS_TREND)
    );
    println!("| VmHWM (peak) | | {} at the first sample, {} at the end | |", mib(first.hwm_kib), mib(end.hwm_kib));
}

/// Sockets, connections, descriptors, tasks, threads and watches against their bounds.
fn resource_rows(after: &[&Sample], end: &Sample, tasks: &[f64]) {
    let row = |name: &str, bound: usize, v: &[usize], end: usize| {
        let m = min_med_max(v);
        println!(
            "| {name} | max - min <= {bound} | {} / {} / {} / {} / {end} | {} |",
            v[0],
            m.0,
            m.1,
            m.2,
            verdict(m.2 - m.0 <= bound)
        );
    };
    let socks: Vec<usize> = after.iter().map(|x| x.sockets).collect();
    let conns: Vec<usize> = after.iter().map(|x| x.sim_connections).collect();
    row("operator sockets (open socket fds)", Bounds::CONNECTIONS, &socks, end.sockets);
    row("simulator's open connections", Bounds::CONNECTIONS, &conns, end.sim_connections);
    let fdv: Vec<usize> = after.iter().map(|x| x.fds).collect();
    let fd_m = min_med_max(&fdv);
    println!("| operator fds, all | | {} / {} / {} / {} / {} | |", fdv[0], fd_m.0, fd_m.1, fd_m.2, end.fds);
    let t = min_med_max(tasks);
    println!(
        "| runtime tasks (`consul_resolver_runtime_tasks`) | max - min <= {} | {} / {} / {} / {} / {} | {} |",
        Bounds::TASKS,
        tasks[0],
        t.0,
        t.1,
        t.2,
        end.tasks.unwrap_or(f64::NAN),
        verdict(t.2 - t.0 <= Bounds::TASKS)
    );
    let thr: Vec<u64> = after.iter().map(|x| x.threads).collect();
    let th = min_med_max(&thr);
    println!(
        "| OS threads | max - min <= {} | {} / {} / {} / {} / {} | {} |",
        Bounds::TASKS,
        thr[0],
        th.0,
        th.1,
        th.2,
        end.threads,
        verdict((th.2 - th.0) as f64 <= Bounds::TASKS)
    );
    let cw: Vec<f64> = after.iter().filter_map(|x| x.consul_watches).collect();
    if !cw.is_empty() {
        let w = min_med_max(&cw);
        let end = end.consul_watches.map_or_else(|| "n/a".to_owned(), |n| n.to_string());
        println!("| Consul watches | | {} / {} / {} / {} / {end} | |", cw[0], w.0, w.1, w.2);
    }
}

/// The changes made, publications, Consul requests and the operator's CPU after the
/// warm-up (from the `first` sample after it).
fn changes_line(o: &Outcome, first: &Sample) {
    let c = &o.counts;
    let total = c.port_changes + c.flips + c.created + c.deleted;
    let cpu = o.end.cpu.saturating_sub(first.cpu);
    let cpu_share = cpu.as_secs_f64() / o.end.at.saturating_sub(first.at).as_secs_f64();
    println!(
        "Changes: {total} ({} port changes, {} health flips, {} Mappings created and {} deleted); {} publications; \
         {} Consul requests ({:.1} a change); operator CPU after the warm-up {} ({:.1}% of a core); {}",
        c.port_changes,
        c.flips,
        c.created,
        c.deleted,
        o.published.map_or_else(|| "n/a".to_owned(), |n| n.to_string()),
        o.requests,
        o.requests as f64 / total.max(1) as f64,
        secs(cpu),
        cpu_share * 100.0,
        o.exit
    );
}
