//! Cold starts: the operator from spawn to its first complete snapshot, and the bare
//! kube-runtime reflector it is compared with, each with the CPU the others used meanwhile.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail, ensure};
use consul_sim::RunningSim;
use e2e::harness::{Cluster, Operator, free_port, operator_binary, unique};
use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::{reflector, watcher};
use serde::Deserialize;
use serde::de::IgnoredAny;
use tokio::runtime::Runtime;

use crate::profile::Settings;
use crate::report::{median, min_med_max, ms};
use crate::setup::{OPERATOR_NS, Setup, fresh_sim, kube_client};
use e2e::bench::percentile;
use e2e::procfs::{cpu_time, memory_kib, minor_faults, process_exited};

const COLD_START_LIMIT: Duration = Duration::from_secs(120);

/// CPU time (user + system) of what a cold start shares the two cores with: our API server
/// and etcd (`None` on a cluster this process did not start), and this process: the bare
/// reflector, or the simulator and the reader of `GET /snapshot`. At the default profile
/// the API server alone takes 1.1 to 2 s of CPU to list the 10,000 Mappings, so a cold
/// start's time is mostly whose CPU is spent while it lists: these say whose.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Neighbours {
    apiserver: Option<Duration>,
    etcd: Option<Duration>,
    pub(crate) bench: Duration,
}

impl Neighbours {
    fn now(cluster: &Cluster) -> anyhow::Result<Self> {
        let of = |pid: Option<i32>| pid.and_then(|p| cpu_time(p as u32).ok());
        Ok(Neighbours {
            apiserver: of(cluster.apiserver_pid()),
            etcd: of(cluster.etcd_pid()),
            bench: cpu_time(std::process::id())?,
        })
    }

    /// What each used since `before`.
    fn since(self, before: Neighbours) -> Self {
        let d = |a: Option<Duration>, b: Option<Duration>| Some(a?.saturating_sub(b?));
        Neighbours {
            apiserver: d(self.apiserver, before.apiserver),
            etcd: d(self.etcd, before.etcd),
            bench: self.bench.saturating_sub(before.bench),
        }
    }

    pub(crate) fn text(&self) -> String {
        let or_na = |d: Option<Duration>| d.map_or("n/a".into(), ms);
        format!("kube-apiserver {}, etcd {}, this process {}", or_na(self.apiserver), or_na(self.etcd), ms(self.bench))
    }

    /// Medians of each.
    pub(crate) fn median(all: &[Neighbours]) -> String {
        let of = |f: &dyn Fn(&Neighbours) -> Option<Duration>| {
            let v: Vec<Duration> = all.iter().filter_map(f).collect();
            if v.is_empty() { "n/a".into() } else { ms(median(&v)) }
        };
        format!("{} / {} / {}", of(&|n| n.apiserver), of(&|n| n.etcd), of(&|n| Some(n.bench)))
    }
}

/// Right after the setup's creates the API server has spent up to 1.4 times the CPU on
/// the same list, and the first pair measured came out better or worse than the rest by
/// 0.1 to 0.25x (docs/benchmarks.md). `BENCH_WARM_UP_LISTS` lists thrown away let it
/// settle; their lines show what they cost.
pub(crate) fn warm_up(rt: &Runtime, cluster: &Cluster, setup: &Setup, s: &Settings) -> anyhow::Result<()> {
    for _ in 0..s.warm_up {
        let (t, meanwhile) = reflector_run(rt, cluster, setup, s)?;
        println!("warm-up reflector (not counted): {}; {}", ms(t), meanwhile.text());
    }
    Ok(())
}

/// `BENCH_SELF_COMPARED`: the cold starts' comparison made `trials` times with a second
/// bare reflector in the operator's place: [`ROUNDS`] rounds in [`reflector_first`]'s
/// order, and the ratio of their medians, as [`cold_starts`] and the report make it. With
/// nothing added, what that ratio comes to is how finely the comparison can tell an
/// operator's cost from the API server's own spread on this machine. Prints every trial's
/// ratio, their spread and how many pass each bound the profiles set.
pub(crate) fn self_compared(
    rt: &Runtime,
    cluster: &Cluster,
    setup: &Setup,
    s: &Settings,
    trials: usize,
) -> anyhow::Result<()> {
    let mut ratios = Vec::with_capacity(trials);
    for trial in 1..=trials {
        let (mut reflector, mut stand_in) = (Vec::new(), Vec::new());
        for round in 0..ROUNDS {
            let (a, b) = (reflector_run(rt, cluster, setup, s)?.0, reflector_run(rt, cluster, setup, s)?.0);
            let (r, o) = if reflector_first(round, ROUNDS) { (a, b) } else { (b, a) };
            reflector.push(r);
            stand_in.push(o);
        }
        let ratio = median(&stand_in).as_secs_f64() / median(&reflector).as_secs_f64();
        let all = |v: &[Duration]| v.iter().map(|&t| ms(t)).collect::<Vec<_>>().join(", ");
        println!(
            "  trial {trial}: {ratio:.2}x (in the operator's place {}; reflector {})",
            all(&stand_in),
            all(&reflector)
        );
        ratios.push(ratio);
    }
    ratios.sort_by(f64::total_cmp);
    let at = |p: f64| percentile(&ratios, p);
    println!(
        "the reflector against itself, {trials} trials: min / quartiles / max {:.2} / {:.2} / {:.2} / {:.2} / {:.2}x",
        at(0.0),
        at(0.25),
        at(0.5),
        at(0.75),
        at(1.0)
    );
    for bound in [1.1, 1.2, 1.3] {
        let above = ratios.iter().filter(|&&r| r > bound).count();
        println!("  above {bound:.1}x: {above} of {trials}");
    }
    Ok(())
}

/// `BENCH_AGAINST`: `rounds` cold starts of the operator under test and as many of the
/// build `baseline`, in pairs whose order alternates (as [`reflector_first`] alternates a
/// reflector's), each on a fresh simulator at the first budget of `BENCH_MODES`, each
/// operator stopped once it has served its first snapshot. Two builds compared in one run
/// share its API server, its world and its load, which runs of their own do not: between
/// runs a median of four moved by more than 0.2x with nothing changed. Prints each cold
/// start, then each side's spread and the ratios of their medians: time, the operator's
/// CPU to its first snapshot, and the API server's CPU meanwhile.
pub(crate) fn against(
    rt: &Runtime,
    cluster: &Cluster,
    sim: &mut Option<RunningSim>,
    setup: &Setup,
    s: &Settings,
    baseline: &Path,
    rounds: usize,
) -> anyhow::Result<()> {
    let under_test = operator_binary()?;
    let max_connections = s.modes[0];
    println!("== this build against {}, --consul-max-connections {max_connections}", baseline.display());
    // Per side (the baseline, this build): each cold start's figures.
    let mut sides: [Vec<Started>; 2] = Default::default();
    for round in 0..rounds {
        let order = if reflector_first(round, rounds) { [0, 1] } else { [1, 0] };
        for side in order {
            let (name, bin) = if side == 0 { ("baseline", baseline) } else { ("this build", under_test.as_path()) };
            println!("  round {}, {name}:", round + 1);
            sim.take();
            let fresh = sim.insert(fresh_sim(rt, setup.sim_addr, s)?);
            let i = cold_start(bin, rt, cluster, fresh, setup, s, max_connections)?;
            sides[side].push(Started { time: i.cold_http, cpu: i.cpu_first, apiserver: i.neighbours.apiserver });
            stop(i.op, fresh)?;
        }
    }
    let [old, new] = &sides;
    for (name, side) in [("baseline", old), ("this build", new)] {
        println!(
            "  {name}: cold start min / median / max {}; operator CPU {}; kube-apiserver CPU {}",
            Started::spread(side, |c| Some(c.time)),
            Started::spread(side, |c| Some(c.cpu)),
            Started::spread(side, |c| c.apiserver),
        );
    }
    let ratio = |f: fn(&Started) -> Option<Duration>| {
        let of = |side: &[Started]| side.iter().filter_map(f).collect::<Vec<_>>();
        let (a, b) = (of(old), of(new));
        if a.is_empty() || b.is_empty() {
            return "n/a".to_string();
        }
        format!("{:.2}x", median(&b).as_secs_f64() / median(&a).as_secs_f64())
    };
    println!(
        "  this build / baseline, ratio of the medians of {rounds} each: cold start {}, operator CPU {}, kube-apiserver CPU {}",
        ratio(|c| Some(c.time)),
        ratio(|c| Some(c.cpu)),
        ratio(|c| c.apiserver),
    );
    Ok(())
}

/// One cold start's figures, for [`against`].
struct Started {
    time: Duration,
    cpu: Duration,
    apiserver: Option<Duration>,
}

impl Started {
    /// Min / median / max of one figure over `all` ("n/a" where none has it).
    fn spread(all: &[Started], f: impl Fn(&Started) -> Option<Duration>) -> String {
        let v: Vec<Duration> = all.iter().filter_map(f).collect();
        if v.is_empty() { "n/a".into() } else { min_med_max(&v, ms) }
    }
}

/// One [`reflector_once`] over the setup's Mappings (and Endpoints, where it has Kubernetes
/// Services: the objects the operator reads), checked to have seen every one: its time and
/// what the others used meanwhile.
fn reflector_run(
    rt: &Runtime,
    cluster: &Cluster,
    setup: &Setup,
    s: &Settings,
) -> anyhow::Result<(Duration, Neighbours)> {
    let before = Neighbours::now(cluster)?;
    let namespaces = s.confined().then_some(setup.namespaces.as_slice());
    let endpoints = s.kube_services > 0;
    let (t, [mappings, objects]) = rt.block_on(reflector_once(&cluster.operator_kubeconfig, namespaces, endpoints))?;
    let meanwhile = Neighbours::now(cluster)?.since(before);
    ensure!(mappings == s.mappings(), "the reflector saw {mappings} Mappings, not {}", s.mappings());
    ensure!(objects >= s.kube_services, "the reflector saw {objects} Endpoints, not {}", s.kube_services);
    Ok((t, meanwhile))
}

/// A bare kube-runtime reflector on the Mappings and, with `endpoints`, the Endpoints, as the
/// operator watches them: one per namespace of `namespaces`, or one of the cluster (`None`).
/// Time from building the client (kubeconfig, discovery) to every store ready, and the
/// Mappings and Endpoints in the stores.
async fn reflector_once(
    kubeconfig: &Path,
    namespaces: Option<&[String]>,
    endpoints: bool,
) -> anyhow::Result<(Duration, [usize; 2])> {
    let started = Instant::now();
    let client = kube_client(kubeconfig).await?;
    let group = kube::discovery::group(&client, "getambassador.io").await?;
    let (mapping, _) = group.recommended_kind("Mapping").context("Mapping is not served")?;
    let mut resources = vec![mapping];
    if endpoints {
        resources.push(ApiResource::erase::<k8s_openapi::api::core::v1::Endpoints>(&()));
    }
    let mut stores: [Vec<reflector::Store<DynamicObject>>; 2] = Default::default();
    let mut tasks = Vec::new();
    for (kind, resource) in resources.iter().enumerate() {
        let apis: Vec<Api<DynamicObject>> = match namespaces {
            Some(namespaces) => {
                namespaces.iter().map(|ns| Api::namespaced_with(client.clone(), ns, resource)).collect()
            }
            None => vec![Api::all_with(client.clone(), resource)],
        };
        for api in apis {
            let writer = reflector::store::Writer::new(resource.clone());
            stores[kind].push(writer.as_reader());
            let stream = reflector::reflector(writer, watcher(api, watcher::Config::default()));
            tasks.push(tokio_util::task::AbortOnDropHandle::new(tokio::spawn(stream.for_each(|_| async {}))));
        }
    }
    for store in stores.iter().flatten() {
        tokio::time::timeout(COLD_START_LIMIT, store.wait_until_ready()).await??;
    }
    let elapsed = started.elapsed();
    Ok((elapsed, stores.map(|kind| kind.iter().map(|s| s.len()).sum())))
}

/// The cold starts of one run.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Plan {
    /// [`ROUNDS`], each beside a bare reflector run (the overhead ratio).
    Compared,
    /// One (a row of the cost table).
    Once,
}

/// The figures of a run's cold starts and of the reflector runs before them.
pub(crate) struct ColdStarts {
    pub(crate) reflector: Vec<Duration>,
    pub(crate) cold: Vec<Duration>,
    /// The operator's CPU time to its first snapshot, each.
    pub(crate) cold_cpu: Vec<Duration>,
    /// The others' CPU during each; for the reflector, `bench` is the reflector's own (the
    /// bench process does nothing else meanwhile).
    pub(crate) reflector_neighbours: Vec<Neighbours>,
    pub(crate) cold_neighbours: Vec<Neighbours>,
}

/// Rounds of a compared run: an operator's cold start and a bare reflector run each.
pub(crate) const ROUNDS: usize = 4;

/// Whether round `round` of `rounds` runs the reflector before the operator. The order
/// alternates, so that each side runs as often first as second and, over four rounds, as
/// early as late: a list's time on the API server drifts and alternates from one list to
/// the next, and with the reflector always first the second of a pair came out 5 % slower
/// at the median with nothing else different (docs/benchmarks.md). The last round runs the
/// reflector first, so that its operator stays running for the changes.
fn reflector_first(round: usize, rounds: usize) -> bool {
    (rounds - 1 - round).is_multiple_of(2)
}

/// The cold starts of `plan`, each operator on a fresh simulator (left in `sim`); the last
/// operator is returned running, for the change measurements.
pub(crate) fn cold_starts(
    rt: &Runtime,
    cluster: &Cluster,
    sim: &mut Option<RunningSim>,
    setup: &Setup,
    s: &Settings,
    max_connections: u32,
    plan: Plan,
) -> anyhow::Result<(ColdStarts, Instance)> {
    let mut starts = ColdStarts {
        reflector: Vec::new(),
        cold: Vec::new(),
        cold_cpu: Vec::new(),
        reflector_neighbours: Vec::new(),
        cold_neighbours: Vec::new(),
    };
    let bin = operator_binary()?;
    let (compared, rounds) = match plan {
        Plan::Compared => (true, ROUNDS),
        Plan::Once => (false, 1),
    };
    for round in 0..rounds {
        if compared && reflector_first(round, rounds) {
            starts.add_reflector_run(rt, cluster, setup, s)?;
        }
        sim.take();
        let fresh = sim.insert(fresh_sim(rt, setup.sim_addr, s)?);
        let i = cold_start(&bin, rt, cluster, fresh, setup, s, max_connections)?;
        starts.cold.push(i.cold_http);
        starts.cold_cpu.push(i.cpu_first);
        starts.cold_neighbours.push(i.neighbours);
        if round + 1 == rounds {
            return Ok((starts, i));
        }
        stop(i.op, fresh)?;
        if compared && !reflector_first(round, rounds) {
            starts.add_reflector_run(rt, cluster, setup, s)?;
        }
    }
    unreachable!("the last round returns its operator")
}

impl ColdStarts {
    /// A bare reflector run, printed and recorded.
    fn add_reflector_run(
        &mut self,
        rt: &Runtime,
        cluster: &Cluster,
        setup: &Setup,
        s: &Settings,
    ) -> anyhow::Result<()> {
        let (t, meanwhile) = reflector_run(rt, cluster, setup, s)?;
        println!(
            "  bare reflector: {} ({} Mappings, {} Endpoints), CPU {}; {}",
            ms(t),
            s.mappings(),
            s.kube_services,
            ms(meanwhile.bench),
            meanwhile.text()
        );
        self.reflector.push(t);
        self.reflector_neighbours.push(meanwhile);
        Ok(())
    }
}

/// One operator process, from spawn to its first complete snapshot.
pub(crate) struct Instance {
    pub(crate) op: Operator,
    pub(crate) pid: u32,
    pub(crate) spawned_at: SystemTime,
    pub(crate) cm: String,
    /// Where it serves xDS (`BENCH_XDS=1`).
    pub(crate) xds: Option<SocketAddr>,
    cold_http: Duration,
    pub(crate) snapshot: bytes::Bytes,
    pub(crate) bootstrap_requests: u64,
    pub(crate) bootstrap_services_queried: usize,
    /// VmHWM, VmRSS (KiB) right after the first snapshot.
    pub(crate) memory_first: (u64, u64),
    /// The operator's CPU time (user + system) from spawn to the first snapshot.
    cpu_first: Duration,
    /// The CPU of the others meanwhile.
    neighbours: Neighbours,
}

/// The operator's arguments: the setup's namespaces (where [`Settings::confined`]), a snapshot ConfigMap `cm` of its own,
/// the profile's window and the budget; `--xds-listen` with `xds`.
fn operator_args(setup: &Setup, s: &Settings, cm: &str, max_connections: u32, xds: Option<SocketAddr>) -> Vec<String> {
    let mut args: Vec<String> = Vec::new();
    for ns in setup.namespaces.iter().filter(|_| s.confined()) {
        args.extend(["--namespace".into(), ns.clone()]);
    }
    args.extend([
        "--snapshot-configmap".into(),
        format!("{OPERATOR_NS}/{cm}"),
        "--coalesce-window".into(),
        s.window.clone(),
        "--consul-max-connections".into(),
        max_connections.to_string(),
    ]);
    if let Some(addr) = xds {
        args.extend(["--xds-listen".into(), addr.to_string()]);
    }
    args
}

/// Spawns the operator binary `bin` and times it to its first complete snapshot.
pub(crate) fn cold_start(
    bin: &Path,
    rt: &Runtime,
    cluster: &Cluster,
    sim: &RunningSim,
    setup: &Setup,
    s: &Settings,
    max_connections: u32,
) -> anyhow::Result<Instance> {
    let cm = format!("bench-snap-{}", unique());
    let xds = s.xds.then(|| SocketAddr::from(([127, 0, 0, 1], free_port())));
    let args = operator_args(setup, s, &cm, max_connections, xds);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let spawned_at = SystemTime::now();
    let spawned = Instant::now();
    let before = Neighbours::now(cluster)?;
    let op = Operator::start_binary(bin, cluster, &args, &[])?;
    let pid = op.pid().context("the operator is not running")?;
    let (cold_http, first_id, snapshot) = rt.block_on(first_snapshot(&op, pid, spawned, s.mappings()))?;
    let neighbours = Neighbours::now(cluster)?.since(before);
    let snapshot_bytes = snapshot.len();
    let cpu_first = cpu_time(pid)?;
    let faults_first = minor_faults(pid)?;
    if let Some(dir) = std::env::var_os("BENCH_SAVE_SNAPSHOTS") {
        std::fs::write(Path::new(&dir).join(format!("first-{pid}.json")), &snapshot)?;
    }
    let memory_first = memory_kib(pid)?;
    let (bootstrap_requests, bootstrap_services_queried) = sent_before(sim, spawned + cold_http);
    let milestones = published_milestones(&op, pid, spawned_at, s)?;
    println!(
        "  operator pid {pid}: first complete snapshot (id {first_id}, {snapshot_bytes} bytes) at GET /snapshot after {}, CPU {}, {faults_first} page faults; meanwhile {}; {milestones:?}",
        ms(cold_http),
        ms(cpu_first),
        neighbours.text()
    );
    Ok(Instance {
        op,
        pid,
        spawned_at,
        cm,
        xds,
        cold_http,
        snapshot,
        bootstrap_requests,
        bootstrap_services_queried,
        memory_first,
        cpu_first,
        neighbours,
    })
}

/// The Consul requests sent before `published` (when `GET /snapshot` answered with the
/// first snapshot), and the services they asked about. Counted by the simulator's log, not
/// when the bench gets to look: by then, the blocking queries the operator held until its
/// first snapshot have been sent too.
fn sent_before(sim: &RunningSim, published: Instant) -> (u64, usize) {
    let cut = published.saturating_duration_since(sim.started()).as_millis() as u64;
    let sent: Vec<_> = sim.requests().into_iter().filter(|r| r.at_ms <= cut).collect();
    let services = sent.iter().filter_map(|r| r.service.as_deref()).collect::<HashSet<_>>().len();
    (sent.len() as u64, services)
}

/// The milestones of the operator's log once it holds the "snapshot published" line
/// (which follows the ConfigMap and status writes, so comes after `GET /snapshot` serves
/// the snapshot), or after 30 s. A log with restarted watches is kept for a look.
fn published_milestones(op: &Operator, pid: u32, spawned_at: SystemTime, s: &Settings) -> anyhow::Result<Milestones> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut m = milestones(&op.logs(), spawned_at);
    while m.published.is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        m = milestones(&op.logs(), spawned_at);
    }
    if m.watches_stopped > 0 || m.consul_watches != s.services {
        let copy = std::env::temp_dir().join(format!("operator-bench-{pid}.log"));
        std::fs::copy(&op.log, &copy)?;
        println!("  note: watches restarted during the cold start; log kept at {}", copy.display());
    }
    Ok(m)
}

#[derive(Deserialize)]
struct Head {
    id: u64,
    bootstrap: Boot,
    mappings: Vec<IgnoredAny>,
}

#[derive(Deserialize)]
struct Boot {
    complete: bool,
}

/// Waits at `GET /snapshot?wait=` (held until there is a snapshot it does not have, see
/// docs/snapshot.md) until it serves a complete snapshot with `mappings` Mappings; returns
/// the time since `spawned`, its id and bytes. A held request answers as the snapshot is
/// published: no polling interval in the figure, and no polls for the operator to answer.
async fn first_snapshot(
    op: &Operator,
    pid: u32,
    spawned: Instant,
    mappings: usize,
) -> anyhow::Result<(Duration, u64, bytes::Bytes)> {
    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build()?;
    let url = op.url("/snapshot?wait=5s");
    // The tag of an incomplete snapshot already seen: held until another.
    let mut seen: Option<reqwest::header::HeaderValue> = None;
    loop {
        if spawned.elapsed() > COLD_START_LIMIT {
            bail!("no complete snapshot after {COLD_START_LIMIT:?}\n--- operator log ---\n{}", op.logs());
        }
        if process_exited(pid) {
            bail!("the operator exited\n--- operator log ---\n{}", op.logs());
        }
        let mut request = http.get(&url);
        if let Some(tag) = &seen {
            request = request.header(reqwest::header::IF_NONE_MATCH, tag.clone());
        }
        let asked = Instant::now();
        let resp = match request.send().await {
            Ok(resp) => resp,
            // Not listening yet (the first few milliseconds).
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
        };
        // An older build given as E2E_OPERATOR_BIN may answer at once, without waiting, or
        // without an ETag: it is polled every 10 ms.
        let polled = Duration::from_millis(10);
        if !resp.status().is_success() {
            // 503 (no snapshot yet) or 304 (nothing new) at the wait's end: ask again.
            if asked.elapsed() < Duration::from_secs(1) {
                tokio::time::sleep(polled).await;
            }
            continue;
        }
        let at = spawned.elapsed();
        seen = resp.headers().get(reqwest::header::ETAG).cloned();
        let body = resp.bytes().await?;
        let head: Head = serde_json::from_slice(&body)?;
        if head.bootstrap.complete && head.mappings.len() == mappings {
            return Ok((at, head.id, body));
        }
        println!(
            "  (snapshot {} at {}: complete={} mappings={}; waiting)",
            head.id,
            ms(at),
            head.bootstrap.complete,
            head.mappings.len()
        );
        if seen.is_none() {
            tokio::time::sleep(polled).await;
        }
    }
}

/// SIGTERM, and what the simulator still counts once the operator is gone.
pub(crate) fn stop(mut op: Operator, sim: &RunningSim) -> anyhow::Result<String> {
    let status = op.terminate(Duration::from_secs(30))?;
    std::thread::sleep(Duration::from_secs(2));
    let after = sim.stats();
    println!(
        "  operator exited ({status}); 2 s later the simulator counts {} open connections, {} blocking queries",
        after.open_connections_total, after.blocking_total
    );
    Ok(status.to_string())
}

fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A `key=value` field of a text log line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let at = line.find(&format!(" {key}="))? + key.len() + 2;
    line[at..].split_whitespace().next().map(|v| v.trim_matches('"'))
}

/// Milestones of the operator's log, as offsets from `spawned_at`.
#[derive(Default, Debug)]
pub(crate) struct Milestones {
    first_line: Option<Duration>,
    pub(crate) starting: Option<Duration>,
    pub(crate) first_consul_watch: Option<Duration>,
    pub(crate) last_consul_watch: Option<Duration>,
    consul_watches: usize,
    kube_watches: usize,
    /// The last Kubernetes watch started (a cold start's endpoints watches are among the last).
    last_kube_watch: Option<Duration>,
    watches_stopped: usize,
    pub(crate) published: Option<Duration>,
    pub(crate) warnings: usize,
}

pub(crate) fn milestones(log: &str, spawned_at: SystemTime) -> Milestones {
    let mut m = Milestones::default();
    for line in log.lines().map(strip_ansi) {
        let Some(at) = line
            .split_whitespace()
            .next()
            .and_then(|t| humantime::parse_rfc3339_weak(t).ok())
            .map(|t| t.duration_since(spawned_at).unwrap_or_default())
        else {
            continue;
        };
        m.first_line.get_or_insert(at);
        if line.contains(" WARN ") || line.contains(" ERROR ") {
            m.warnings += 1;
        }
        if line.contains(": starting ") {
            m.starting.get_or_insert(at);
        } else if line.contains(": watch started ") {
            if field(&line, "source") == Some("consul") {
                m.consul_watches += 1;
                m.first_consul_watch.get_or_insert(at);
                m.last_consul_watch = Some(at);
            } else {
                m.kube_watches += 1;
                m.last_kube_watch = Some(at);
            }
        } else if line.contains(": watch stopped ") {
            m.watches_stopped += 1;
        } else if line.contains(": snapshot published ") && m.published.is_none() {
            m.published = Some(at);
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Over a compared run each side runs as often first as second, as early as late (its
    /// places sum alike), and the last round leaves the operator running, last.
    #[test]
    fn compared_rounds_alternate_and_end_with_the_operator() {
        let (mut reflector, mut operator) = (Vec::new(), Vec::new());
        for round in 0..ROUNDS {
            let (r, o) =
                if reflector_first(round, ROUNDS) { (2 * round, 2 * round + 1) } else { (2 * round + 1, 2 * round) };
            reflector.push(r);
            operator.push(o);
        }
        assert_eq!(reflector.iter().filter(|&&p| p % 2 == 0).count(), ROUNDS / 2, "{reflector:?}");
        assert_eq!(reflector.iter().sum::<usize>(), operator.iter().sum::<usize>(), "{reflector:?} {operator:?}");
        assert_eq!(operator.last(), Some(&(2 * ROUNDS - 1)));
    }

    /// A side's spread is min / median / max of the figure its cold starts have, whatever
    /// their order; none at all (the API server of a cluster this process did not start)
    /// is said, not made up.
    #[test]
    fn a_sides_spread_is_min_median_max_of_what_it_has() {
        let ms = Duration::from_millis;
        let started = |t: u64, api: Option<u64>| Started {
            time: ms(t),
            cpu: ms(t / 4),
            apiserver: api.map(Duration::from_millis),
        };
        let side = [started(1200, None), started(900, None), started(1000, None), started(1500, None)];
        assert_eq!(Started::spread(&side, |c| Some(c.time)), "900 ms / 1100 ms / 1500 ms");
        assert_eq!(Started::spread(&side, |c| Some(c.cpu)), "225 ms / 275 ms / 375 ms");
        assert_eq!(Started::spread(&side, |c| c.apiserver), "n/a");
    }

    #[test]
    fn a_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        let ms = Duration::from_millis;
        assert_eq!(median(&[ms(4), ms(1), ms(3), ms(2)]), Duration::from_micros(2500));
        assert_eq!(median(&[ms(3), ms(1), ms(2)]), ms(2));
    }
}
