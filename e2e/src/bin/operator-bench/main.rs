//! Benchmark of the whole operator at scale, against the local control plane (etcd +
//! kube-apiserver from `e2e/cluster.sh`) and the in-process Consul simulator, on loopback
//! only (not a timed test): `make bench-operator`, i.e.
//! `cargo run --release -p e2e --bin operator-bench`; `make bench-scale` and
//! `make bench-cost` below. Results: docs/benchmarks.md.
//!
//! Setup, made before the operator starts (its duration is not a measure): 1,000 Consul
//! services with one instance each (registered through the simulator's catalog API);
//! 10,000 Mappings (10 per service, spread over 5 namespaces, so every service is
//! referenced from every namespace) and one ConsulResolver per namespace pointing at the
//! simulator. Then `BENCH_WARM_UP_LISTS` (2) bare reflector lists, not counted: right after
//! the creates the API server spends more on a list, which skewed the first pair. Then, once
//! per `--consul-max-connections` value (default 100 and 1200; 1200 gives every service a
//! dedicated blocking query):
//!
//! 1. three times, interleaved: a bare kube-runtime reflector (in this process, with the
//!    operator's kubeconfig, one per namespace like the operator) lists and watches the
//!    same Mappings; then the operator (release build, its own process, a fresh simulator
//!    on the same address) starts, timed from spawn to the first complete snapshot holding
//!    every Mapping at `GET /snapshot` (a held request, `?wait=`); its log gives milestones;
//!    the CPU our kube-apiserver, etcd and this process (the reflector; the simulator and
//!    the reader) used during each says whose work shared the two cores with it;
//! 2. with the third operator: Consul changes (one instance of one service moved to a new
//!    port, through the catalog API), each timed until the snapshot ConfigMap (watched,
//!    decoded with the operator's own `configmap::decode`) lists that instance (by node) on
//!    the new port: spaced (each after a quiet coalescing window: the leading edge) and
//!    back to back (each inside the window of the previous publication); the operator's
//!    CPU time (utime + stime, /proc/<pid>/stat) read right before and after each series
//!    gives its CPU per change; then health flips (`BENCH_CHANGES` of them: one instance's
//!    check critical, then passing again, each timed until the ConfigMap leaves it out or
//!    lists it again; spaced), which reach services without a blocking query of their own
//!    through the change feed;
//! 3. watches the operator opened (the audit log: verb `watch` by its ServiceAccount, read
//!    after it exits since a 1.20 API server audits a watch when it ends), the simulator's
//!    blocking queries per service and request counts;
//! 4. the operator's peak RSS (VmHWM) just before SIGTERM.
//!
//! Sizes: `BENCH_KUBE_SERVICES` (0; 5,000 at scale: Kubernetes Services, an Endpoints
//! object of three addresses and a Mapping each, spread over the namespaces),
//! `BENCH_SERVICES` (1000, at most 50,000), `BENCH_INSTANCES_PER_SERVICE` (1; instance
//! k of every service is on node `bench-k`, instance 0 on `bench`),
//! `BENCH_MAPPINGS_PER_SERVICE` (10), `BENCH_NAMESPACES` (5), `BENCH_CHANGES` (200 of each
//! kind), `BENCH_MODES` (`100,1200`), `BENCH_COALESCE_WINDOW` (`250ms`, passed as
//! `--coalesce-window`). `BENCH_SAVE_SNAPSHOTS=<dir>` writes each cold start's first
//! snapshot there (`first-<pid>.json`), to compare two builds' documents.
//! `BENCH_PIN=1` puts our kube-apiserver and etcd on one CPU, and this process and the
//! operators on the others, as a real cluster places them (the API server on nodes of its
//! own): on two shared cores a cold start's ratio measures mostly how much CPU the operator
//! takes from the API server's lists (docs/benchmarks.md). The output names the placement.
//!
//! Targets (the output names the set that applies, and gives met / MISSED for each):
//! cold start / bare reflector <= 1.2x, spaced change p50 <= 50 ms and p99 <= 100 ms,
//! back-to-back p99 <= window + 100 ms, health flip p99 <= window + 250 ms, peak RSS <= 100 MiB. `BENCH_PROFILE=scale`
//! (`make bench-scale`) changes the defaults to 5,000 services x 15 instances (75,000
//! endpoints), 10 Mappings per service (50,000), 5,000 Kubernetes Services routed to (one
//! Mapping each), 5 namespaces and `BENCH_MODES=100`, and
//! the targets to cold start < 10 s, spaced and back-to-back p99 < window + 250 ms, peak
//! RSS < 400 MiB. Each variable set still overrides the profile's default; the targets go
//! with the profile.
//!
//! Cost table: `BENCH_SIZES=250x1,1000x1,5000x15` (`make bench-cost`; services x instances
//! per service, Mappings = services x `BENCH_MAPPINGS_PER_SERVICE`) runs one operator per
//! size instead, each with fresh namespaces, Mappings and simulator, one cold start (no
//! reflector), in the first of `BENCH_MODES`, then prints a markdown table: Mappings,
//! services, endpoints, snapshot bytes, cold start, spaced p50 / p99, operator CPU per
//! spaced and per back-to-back change, peak RSS. It is held to no target.
//!
//! Soak: `BENCH_SOAK_SECS=600` (`make bench-soak`) runs one operator under a steady stream
//! of port changes, health flips and Mapping churn instead, samples its memory, sockets,
//! threads and runtime tasks, and checks that the final snapshot holds every change: see
//! `soak.rs`.

mod soak;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::io::{Read, Seek, SeekFrom};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail, ensure};
use consul_resolver_operator::snapshot_configmap as configmap;
use consul_sim::{Config as SimConfig, RunningSim, Simulator};
use e2e::bench::{env_usize, loadavg, percentile};
use e2e::harness::{Cluster, Operator, metric_sample, operator_binary, unique};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::{reflector, watcher};
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::json;
use tokio::runtime::Runtime;
use tokio::sync::mpsc;

/// The operator's identity in the test cluster (e2e/cluster.sh, manifests/rbac.yaml).
const OPERATOR_USER: &str = "system:serviceaccount:consul-resolver-system:consul-resolver-operator";
const OPERATOR_NS: &str = "consul-resolver-system";
const COLD_START_LIMIT: Duration = Duration::from_secs(120);
const CHANGE_LIMIT: Duration = Duration::from_secs(60);

#[derive(Clone)]
struct Settings {
    /// `BENCH_PROFILE=scale`: larger defaults and the scale targets (see `Targets`).
    scale: bool,
    services: usize,
    /// Consul instances per service (`BENCH_INSTANCES_PER_SERVICE`).
    instances: usize,
    per_service: usize,
    namespaces: usize,
    changes: usize,
    /// Node check flips (`BENCH_NODE_FLIPS`, 50).
    node_flips: usize,
    /// Kubernetes Services routed to (`BENCH_KUBE_SERVICES`: 5,000 at scale, else 0): each
    /// an Endpoints object with three addresses and one Mapping, spread over the namespaces.
    kube_services: usize,
    /// Consul scopes (`BENCH_SCOPES`, 1): with 2, the resolvers of every other namespace
    /// name a token (a Secret), which is another scope with a change feed of its own.
    scopes: usize,
    modes: Vec<u32>,
    /// Bare reflector lists made and thrown away after the setup (`BENCH_WARM_UP_LISTS`, 2).
    warm_up: usize,
    /// `BENCH_PIN=1`: the control plane on a CPU of its own ([`place`]).
    pin: bool,
    window: String,
    /// `BENCH_SIZES`: (services, instances per service) of each row of the cost table;
    /// empty without it.
    sizes: Vec<(usize, usize)>,
}

impl Settings {
    /// The profile gives the defaults; each variable set overrides its own.
    fn from_env() -> anyhow::Result<Settings> {
        let scale = match std::env::var("BENCH_PROFILE").as_deref() {
            Ok("scale") => true,
            Ok("" | "default") | Err(_) => false,
            Ok(other) => bail!("BENCH_PROFILE={other}: the profiles are `default` and `scale`"),
        };
        let modes = std::env::var("BENCH_MODES").unwrap_or_else(|_| (if scale { "100" } else { "100,1200" }).into());
        let modes = modes.split(',').map(|m| m.trim().parse::<u32>()).collect::<Result<Vec<_>, _>>()?;
        let s = Settings {
            scale,
            // Scale: 75,000 endpoints and 50,000 Mappings.
            services: env_usize("BENCH_SERVICES", if scale { 5000 } else { 1000 }),
            instances: env_usize("BENCH_INSTANCES_PER_SERVICE", if scale { 15 } else { 1 }),
            per_service: env_usize("BENCH_MAPPINGS_PER_SERVICE", 10),
            namespaces: env_usize("BENCH_NAMESPACES", 5),
            changes: env_usize("BENCH_CHANGES", 200),
            node_flips: env_usize("BENCH_NODE_FLIPS", 50),
            kube_services: env_usize("BENCH_KUBE_SERVICES", if scale { 5000 } else { 0 }),
            scopes: env_usize("BENCH_SCOPES", 1).max(1),
            warm_up: env_usize("BENCH_WARM_UP_LISTS", 2),
            pin: env_usize("BENCH_PIN", 0) == 1,
            modes,
            window: std::env::var("BENCH_COALESCE_WINDOW").unwrap_or_else(|_| "250ms".into()),
            sizes: match std::env::var("BENCH_SIZES") {
                Ok(sizes) if !sizes.trim().is_empty() => sizes
                    .split(',')
                    .map(|size| {
                        let (services, instances) = size
                            .trim()
                            .split_once('x')
                            .with_context(|| format!("BENCH_SIZES: {size:?} is not SERVICESxINSTANCES"))?;
                        let number =
                            |n: &str| n.trim().parse::<usize>().with_context(|| format!("BENCH_SIZES: {size:?}"));
                        Ok((number(services)?, number(instances)?))
                    })
                    .collect::<anyhow::Result<_>>()?,
                _ => Vec::new(),
            },
        };
        ensure!(!s.modes.is_empty(), "BENCH_MODES is empty");
        s.check()?;
        for &(services, instances) in &s.sizes {
            let size = Settings { services, instances, ..s.clone() };
            size.check().with_context(|| format!("BENCH_SIZES: {services}x{instances}"))?;
        }
        humantime::parse_duration(&s.window).context("BENCH_COALESCE_WINDOW")?;
        Ok(s)
    }

    fn check(&self) -> anyhow::Result<()> {
        let s = self;
        ensure!(s.services > 0 && s.services <= 50_000, "BENCH_SERVICES must be 1..50000");
        // Registered ports are 10000-19999, distinct within a service.
        ensure!(s.instances > 0 && s.instances <= 10_000, "BENCH_INSTANCES_PER_SERVICE must be 1..10000");
        ensure!(s.per_service > 0 && s.namespaces > 0, "BENCH_MAPPINGS_PER_SERVICE and BENCH_NAMESPACES must be > 0");
        // Changes take ports from 20000 up, a fresh one each, both series together.
        ensure!(s.changes > 0 && 20_000 + 2 * s.changes <= 65_535, "BENCH_CHANGES must be 1..22767");
        ensure!(s.kube_services <= 40_000, "BENCH_KUBE_SERVICES must be at most 40000");
        Ok(())
    }

    /// Every Mapping: those to Consul services and one per Kubernetes Service.
    fn mappings(&self) -> usize {
        self.services * self.per_service + self.kube_services
    }

    fn endpoints(&self) -> usize {
        self.services * self.instances
    }

    fn window(&self) -> Duration {
        humantime::parse_duration(&self.window).expect("checked in from_env")
    }
}

/// A ceiling on a measure: `<=` when `inclusive`, else `<`.
#[derive(Clone, Copy)]
struct Limit<T> {
    max: T,
    inclusive: bool,
}

impl<T: PartialOrd + Copy> Limit<T> {
    fn at_most(max: T) -> Limit<T> {
        Limit { max, inclusive: true }
    }

    fn below(max: T) -> Limit<T> {
        Limit { max, inclusive: false }
    }

    fn holds(&self, value: T) -> bool {
        if self.inclusive { value <= self.max } else { value < self.max }
    }

    fn text(&self, show: impl Fn(T) -> String) -> String {
        format!("{} {}", if self.inclusive { "<=" } else { "<" }, show(self.max))
    }
}

/// The targets a run is held to: the default profile's, or the scale profile's. They go
/// with the profile, not with the sizes: a scale run made smaller is still held to the
/// scale targets, which is why the output names the set.
struct Targets {
    name: &'static str,
    /// Median of the cold starts.
    cold_start: Option<Limit<Duration>>,
    /// Median cold start / median bare reflector.
    overhead: Option<Limit<f64>>,
    spaced_p50: Option<Limit<Duration>>,
    spaced_p99: Option<Limit<Duration>>,
    back_to_back_p99: Option<Limit<Duration>>,
    /// A health flip of any service, fed or not, to the ConfigMap.
    flip_p99: Limit<Duration>,
    /// VmHWM at the end, in KiB.
    peak_rss_kib: Limit<u64>,
}

impl Targets {
    fn of(s: &Settings) -> Targets {
        let window = s.window();
        if s.scale {
            let change = Limit::below(window + Duration::from_millis(250));
            Targets {
                name: "the scale profile's (BENCH_PROFILE=scale)",
                cold_start: Some(Limit::below(Duration::from_secs(10))),
                overhead: None,
                spaced_p50: None,
                spaced_p99: Some(change),
                back_to_back_p99: Some(change),
                flip_p99: Limit::at_most(window + Duration::from_millis(250)),
                peak_rss_kib: Limit::below(400 * 1024),
            }
        } else {
            Targets {
                name: "the default profile's (BENCH_PROFILE unset)",
                cold_start: None,
                overhead: Some(Limit::at_most(1.2)),
                spaced_p50: Some(Limit::at_most(Duration::from_millis(50))),
                spaced_p99: Some(Limit::at_most(Duration::from_millis(100))),
                back_to_back_p99: Some(Limit::at_most(window + Duration::from_millis(100))),
                flip_p99: Limit::at_most(window + Duration::from_millis(250)),
                peak_rss_kib: Limit::at_most(100 * 1024),
            }
        }
    }

    /// Every target that applies: what it is about, the target, the run's value, met.
    fn verdicts(&self, r: &Run) -> Vec<(&'static str, String, String, bool)> {
        let mut out = Vec::new();
        let mut duration = |what, limit: Option<Limit<Duration>>, value: Duration| {
            if let Some(l) = limit {
                out.push((what, l.text(ms_or_secs), ms_or_secs(value), l.holds(value)));
            }
        };
        duration("cold start (median)", self.cold_start, median(&r.cold));
        duration("spaced change p50", self.spaced_p50, r.spaced.percentile(0.5));
        duration("spaced change p99", self.spaced_p99, r.spaced.percentile(0.99));
        duration("back-to-back change p99", self.back_to_back_p99, r.back_to_back.percentile(0.99));
        duration("health flip p99", Some(self.flip_p99), r.flips.percentile(0.99));
        if !r.node_flips.0.is_empty() {
            duration("node check flip p99", Some(self.flip_p99), r.node_flips.percentile(0.99));
        }
        if let Some(l) = self.overhead {
            let ratio = median(&r.cold).as_secs_f64() / median(&r.reflector).as_secs_f64();
            out.push(("cold start / bare reflector", l.text(ratio_x), ratio_x(ratio), l.holds(ratio)));
        }
        let rss = r.memory_end.0;
        out.push(("peak RSS (VmHWM)", self.peak_rss_kib.text(mib), mib(rss), self.peak_rss_kib.holds(rss)));
        out
    }
}

fn service_name(i: usize) -> String {
    format!("svc-{i:04}")
}

/// The node of every service's instance `k`: a few nodes each holding every service, as
/// Consul agents do. Instance 0 stays on `bench`, so a run with one instance per service
/// registers exactly what earlier runs did.
fn node_name(k: usize) -> String {
    if k == 0 { "bench".into() } else { format!("bench-{k}") }
}

/// The port instance `k` of service `i` is registered on: 10000-19999, distinct within a
/// service (and 10000 + i with one instance, as before). Changes move instances to 20000
/// and up, so every change is a real catalog change.
fn registered_port(s: &Settings, i: usize, k: usize) -> u16 {
    (10_000 + (i * s.instances + k) % 10_000) as u16
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

/// Seconds from 10 s up (a cold-start target), else milliseconds.
fn ms_or_secs(d: Duration) -> String {
    if d >= Duration::from_secs(10) { secs(d) } else { ms(d) }
}

/// With thousands separators: 50,000.
fn count(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn ratio_x(r: f64) -> String {
    format!("{r:.2}x")
}

fn mib(kib: u64) -> String {
    format!("{:.0} MiB", kib as f64 / 1024.0)
}

/// CPU time, to a tenth of a millisecond (per change, it is a mean).
fn cpu_ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

async fn kube_client(kubeconfig: &Path) -> anyhow::Result<kube::Client> {
    let kc = Kubeconfig::read_from(kubeconfig).with_context(|| format!("reading {}", kubeconfig.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(kube::Client::try_from(config)?)
}

fn mapping_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("getambassador.io", "v3alpha1", "Mapping"), "mappings")
}

fn resolver_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("consulresolver.io", "v1alpha1", "ConsulResolver"),
        "consulresolvers",
    )
}

/// One catalog write through Consul's HTTP API: service `name`'s instance on `node`, on
/// `port` (the service ID is unique per node, as Consul requires).
async fn register(http: &reqwest::Client, base: &str, name: &str, node: &str, port: u16) -> anyhow::Result<()> {
    let body = json!({"Node": node, "Address": "127.0.0.1",
        "Service": {"ID": name, "Service": name, "Address": "127.0.0.1", "Port": port},
        "Check": {"CheckID": format!("service:{name}"), "Name": "c", "Status": "passing", "ServiceID": name}});
    let r = http.put(format!("{base}/v1/catalog/register")).json(&body).send().await?;
    ensure!(r.status().is_success(), "register {name} on {node}: {}", r.status());
    Ok(())
}

/// A health flip: the check of service `name`'s instance on `node` set to `status`, the
/// service itself left alone (what an agent writes when a check changes).
async fn set_check(http: &reqwest::Client, base: &str, name: &str, node: &str, status: &str) -> anyhow::Result<()> {
    let body = json!({"Node": node, "Address": "127.0.0.1",
        "Check": {"CheckID": format!("service:{name}"), "Name": "c", "Status": status, "ServiceID": name}});
    let r = http.put(format!("{base}/v1/catalog/register")).json(&body).send().await?;
    ensure!(r.status().is_success(), "check of {name} on {node}: {}", r.status());
    Ok(())
}

struct Setup {
    namespaces: Vec<String>,
    sim_addr: SocketAddr,
    base_url: String,
    mappings_created_in: Duration,
    /// Where the audit log ended once the objects were created.
    audit_offset: u64,
}

/// An empty simulator on `listen`.
fn start_sim(listen: SocketAddr) -> anyhow::Result<RunningSim> {
    Ok(Simulator::start_background(SimConfig {
        listen,
        // Room for a dedicated connection per service (real Consul: limits.http_max_conns_per_client).
        max_conns_per_client: 5000,
        request_log_capacity: 200_000,
        ..SimConfig::default()
    })?)
}

/// A simulator on `listen` holding the benchmark's services, `s.instances` each (see
/// `node_name`, `registered_port`). Each operator run gets a fresh one on the same address,
/// so no connection, blocking query or counter of an earlier run is left in its figures.
fn fresh_sim(rt: &Runtime, listen: SocketAddr, s: &Settings) -> anyhow::Result<RunningSim> {
    let sim = start_sim(listen)?;
    let base = sim.base_url();
    let started = Instant::now();
    rt.block_on(async {
        let http = reqwest::Client::builder().no_proxy().build()?;
        // Node by node (every service's instance 0, then 1...), as agents register; the
        // pairs are generated as they are sent, not held first (75,000 at scale).
        futures::stream::iter((0..s.instances).flat_map(|k| (0..s.services).map(move |i| (i, k))))
            .map(|(i, k)| {
                let (http, base) = (&http, &base);
                async move { register(http, base, &service_name(i), &node_name(k), registered_port(s, i, k)).await }
            })
            .buffer_unordered(32)
            .try_for_each(|()| futures::future::ready(Ok(())))
            .await
    })?;
    println!("  simulator: {} instances registered in {}", s.endpoints(), secs(started.elapsed()));
    sim.reset_stats();
    sim.clear_requests();
    Ok(sim)
}

/// Resolvers and Mappings, created before any operator runs.
async fn setup(cluster: &Cluster, sim: &RunningSim, s: &Settings, namespaces: Vec<String>) -> anyhow::Result<Setup> {
    let base = sim.base_url();
    let client = kube_client(&cluster.admin_kubeconfig).await?;
    let rr = resolver_resource();
    for (j, ns) in namespaces.iter().enumerate() {
        let mut r = DynamicObject::new("consul", &rr).within(ns);
        r.data = json!({"spec": {"address": sim.addr().to_string()}});
        // Another scope: a token (the simulator runs without ACLs: any token reads all).
        if j % s.scopes != 0 {
            // As manifests/rbac.yaml documents: Secrets are readable where a RoleBinding says.
            cluster.grant_secrets(ns)?;
            let secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(json!({
                "metadata": {"name": "consul-token", "namespace": ns},
                "stringData": {"token": format!("team-{}", j % s.scopes)},
            }))?;
            Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), ns)
                .create(&PostParams::default(), &secret)
                .await?;
            r.data["spec"]["tokenSecretRef"] = json!({"name": "consul-token", "key": "token"});
        }
        Api::<DynamicObject>::namespaced_with(client.clone(), ns, &rr).create(&PostParams::default(), &r).await?;
    }
    let mr = mapping_resource();
    let started = Instant::now();
    // Each object is built as it is sent rather than all held first (50,000 at scale).
    futures::stream::iter((0..s.services).flat_map(|i| (0..s.per_service).map(move |m| (i, m))))
        .map(|(i, m)| {
            let ns = &namespaces[m % namespaces.len()];
            let svc = service_name(i);
            let name = format!("{svc}-m{m}");
            let mut o = DynamicObject::new(&name, &mr).within(ns);
            o.data = json!({"spec": {"prefix": format!("/{name}/"), "service": format!("{svc}:8080"), "resolver": "consul"}});
            let api = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &mr);
            async move { api.create(&PostParams::default(), &o).await.map(|_| ()).with_context(|| format!("creating Mapping {ns}/{name}")) }
        })
        .buffer_unordered(48)
        .try_for_each(|()| futures::future::ready(Ok(())))
        .await?;
    // Kubernetes Services routed to: their Endpoints (what a 1.20 API server serves; the
    // addresses are data in the benchmarking range 198.18.0.0/15, never connected to) and a
    // Mapping each.
    futures::stream::iter(0..s.kube_services)
        .map(|i| {
            let ns = namespaces[i % namespaces.len()].clone();
            let name = format!("kube-svc-{i}");
            // 198.18.0.0/15 holds 2 x 256 x 250 of these: 40,000 Services x 3 fit.
            let ip = |n: usize| format!("198.{}.{}.{}", 18 + n / (256 * 250), (n / 250) % 256, n % 250 + 1);
            let addresses: Vec<serde_json::Value> = (0..3).map(|a| json!({"ip": ip(i * 3 + a)})).collect();
            let endpoints: k8s_openapi::api::core::v1::Endpoints = serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": ns},
                "subsets": [{"addresses": addresses, "ports": [{"port": 8080}]}],
            }))
            .expect("an Endpoints object");
            let mut mapping = DynamicObject::new(&format!("{name}-m"), &mr).within(&ns);
            mapping.data = json!({"spec": {"prefix": format!("/{name}/"), "service": format!("{name}:8080")}});
            let (client, mr) = (client.clone(), mr.clone());
            async move {
                Api::<k8s_openapi::api::core::v1::Endpoints>::namespaced(client.clone(), &ns)
                    .create(&PostParams::default(), &endpoints)
                    .await
                    .with_context(|| format!("creating Endpoints {ns}/{name}"))?;
                Api::<DynamicObject>::namespaced_with(client, &ns, &mr)
                    .create(&PostParams::default(), &mapping)
                    .await
                    .with_context(|| format!("creating Mapping {ns}/{name}-m"))
                    .map(|_| ())
            }
        })
        .buffer_unordered(48)
        .try_for_each(|()| futures::future::ready(Ok(())))
        .await?;
    let mappings_created_in = started.elapsed();
    let audit_offset = cluster.audit_log().and_then(|p| std::fs::metadata(p).ok()).map_or(0, |m| m.len());
    Ok(Setup { namespaces, sim_addr: sim.addr(), base_url: base, mappings_created_in, audit_offset })
}

/// `BENCH_PIN=1`: our kube-apiserver and etcd on the first CPU this process may use, this
/// process (its threads so far, and what they start: the operators) on the others. Says
/// where each went.
fn place(cluster: &Cluster) -> anyhow::Result<String> {
    let cpus = e2e::bench::allowed_cpus()?;
    ensure!(cpus.len() >= 2, "BENCH_PIN=1 needs two CPUs at least; this process may use {cpus:?}");
    let (control, rest) = cpus.split_at(1);
    for (name, pid) in [("kube-apiserver", cluster.apiserver_pid()), ("etcd", cluster.etcd_pid())] {
        let pid = pid.with_context(|| format!("BENCH_PIN=1: no pid of our {name} (a cluster we did not start?)"))?;
        let moved = e2e::bench::pin(pid as u32, control).with_context(|| format!("placing {name} (pid {pid})"))?;
        ensure!(moved > 0, "BENCH_PIN=1: no thread of {name} (pid {pid}) to place");
    }
    e2e::bench::pin(std::process::id(), rest).context("placing this process")?;
    Ok(format!("pinned: kube-apiserver and etcd on CPU {control:?}, this process and the operators on CPUs {rest:?}"))
}

/// One [`reflector_once`] over the setup's Mappings, checked to have seen every one: its
/// time and what the others used meanwhile.
fn reflector_run(
    rt: &Runtime,
    cluster: &Cluster,
    setup: &Setup,
    s: &Settings,
) -> anyhow::Result<(Duration, Neighbours)> {
    let before = Neighbours::now(cluster)?;
    let (t, n) = rt.block_on(reflector_once(&cluster.operator_kubeconfig, &setup.namespaces))?;
    let meanwhile = Neighbours::now(cluster)?.since(before);
    ensure!(n == s.mappings(), "the reflector saw {n} Mappings, not {}", s.mappings());
    Ok((t, meanwhile))
}

/// A bare kube-runtime reflector on the Mappings, one per namespace as the operator
/// watches them: time from building the client (kubeconfig, discovery) to every store
/// ready, and the objects in the stores.
async fn reflector_once(kubeconfig: &Path, namespaces: &[String]) -> anyhow::Result<(Duration, usize)> {
    let started = Instant::now();
    let client = kube_client(kubeconfig).await?;
    let group = kube::discovery::group(&client, "getambassador.io").await?;
    let (resource, _) = group.recommended_kind("Mapping").context("Mapping is not served")?;
    let mut stores = Vec::new();
    let mut tasks = Vec::new();
    for ns in namespaces {
        let api = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &resource);
        let writer = reflector::store::Writer::new(resource.clone());
        stores.push(writer.as_reader());
        let stream = reflector::reflector(writer, watcher(api, watcher::Config::default()));
        tasks.push(tokio_util::task::AbortOnDropHandle::new(tokio::spawn(stream.for_each(|_| async {}))));
    }
    for store in &stores {
        tokio::time::timeout(COLD_START_LIMIT, store.wait_until_ready()).await??;
    }
    let elapsed = started.elapsed();
    Ok((elapsed, stores.iter().map(|s| s.len()).sum()))
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

/// The part of a snapshot the change measurement reads.
#[derive(Deserialize)]
struct Ports {
    resolvers: Vec<PortsResolver>,
}

#[derive(Deserialize)]
struct PortsResolver {
    #[serde(default)]
    services: Vec<PortsService>,
}

#[derive(Deserialize)]
struct PortsService {
    name: String,
    #[serde(default)]
    endpoints: Vec<PortsEndpoint>,
}

#[derive(Deserialize)]
struct PortsEndpoint {
    port: u16,
    #[serde(default)]
    node: String,
}

impl Ports {
    /// Whether every resolver listing `service` lists its `instances` endpoints, the one on
    /// `node` on `port` (the instance that moved, not just any of them).
    fn has(&self, service: &str, instances: usize, node: &str, port: u16) -> bool {
        let mut seen = false;
        for r in &self.resolvers {
            if let Some(s) = r.services.iter().find(|s| s.name == service) {
                seen = true;
                if s.endpoints.len() != instances || !s.endpoints.iter().any(|e| e.node == node && e.port == port) {
                    return false;
                }
            }
        }
        seen
    }

    /// Whether every resolver listing `service` lists (`present`) or leaves out an endpoint
    /// on `node`.
    fn node_is(&self, service: &str, node: &str, present: bool) -> bool {
        let mut seen = false;
        for r in &self.resolvers {
            if let Some(s) = r.services.iter().find(|s| s.name == service) {
                seen = true;
                if s.endpoints.iter().any(|e| e.node == node) != present {
                    return false;
                }
            }
        }
        seen
    }
}

fn process_exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/status")) {
        Ok(status) => status.lines().any(|l| l.starts_with("State:") && l.contains('Z')),
        Err(_) => true,
    }
}

/// `VmHWM` and `VmRSS` of a process, in KiB.
fn memory_kib(pid: u32) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .with_context(|| format!("no {name} in /proc/{pid}/status"))
    };
    Ok((field("VmHWM:")?, field("VmRSS:")?))
}

/// CPU time (user + system) of what a cold start shares the two cores with: our API server
/// and etcd (`None` on a cluster this process did not start), and this process: the bare
/// reflector, or the simulator and the reader of `GET /snapshot`. At the default profile
/// the API server alone takes 1.1 to 2 s of CPU to list the 10,000 Mappings, so a cold
/// start's time is mostly whose CPU is spent while it lists: these say whose.
#[derive(Clone, Copy, Debug, Default)]
struct Neighbours {
    apiserver: Option<Duration>,
    etcd: Option<Duration>,
    bench: Duration,
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

    fn text(&self) -> String {
        let or_na = |d: Option<Duration>| d.map_or("n/a".into(), ms);
        format!("kube-apiserver {}, etcd {}, this process {}", or_na(self.apiserver), or_na(self.etcd), ms(self.bench))
    }

    /// Medians of each.
    fn median(all: &[Neighbours]) -> String {
        let of = |f: &dyn Fn(&Neighbours) -> Option<Duration>| {
            let v: Vec<Duration> = all.iter().filter_map(f).collect();
            if v.is_empty() { "n/a".into() } else { ms(median(&v)) }
        };
        format!("{} / {} / {}", of(&|n| n.apiserver), of(&|n| n.etcd), of(&|n| Some(n.bench)))
    }
}

/// The CPU time (user + system) a process has used so far: utime + stime of
/// /proc/<pid>/stat, in clock ticks.
fn cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command (field 2) is in parentheses and may hold spaces: count from the last `)`.
    // What follows starts at field 3, so utime (14) and stime (15) are its 12th and 13th.
    let rest = stat.rsplit_once(')').with_context(|| format!("/proc/{pid}/stat: {stat}"))?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields.get(i).and_then(|v| v.parse::<u64>().ok()).with_context(|| format!("/proc/{pid}/stat: {stat}"))
    };
    let ticks = ticks(11)? + ticks(12)?;
    // SAFETY: sysconf only reads a system constant.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    ensure!(per_second > 0, "sysconf(_SC_CLK_TCK) = {per_second}");
    Ok(Duration::from_secs_f64(ticks as f64 / per_second as f64))
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
struct Milestones {
    first_line: Option<Duration>,
    starting: Option<Duration>,
    first_consul_watch: Option<Duration>,
    last_consul_watch: Option<Duration>,
    consul_watches: usize,
    kube_watches: usize,
    watches_stopped: usize,
    published: Option<Duration>,
    warnings: usize,
}

fn milestones(log: &str, spawned_at: SystemTime) -> Milestones {
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
            }
        } else if line.contains(": watch stopped ") {
            m.watches_stopped += 1;
        } else if line.contains(": snapshot published ") && m.published.is_none() {
            m.published = Some(at);
        }
    }
    m
}

/// Requests by the operator's ServiceAccount in the audit log after `offset`, received
/// at `since` or later: distinct watches per `resource namespace`, and requests per verb.
/// A watch is logged when it ends (stage ResponseComplete), so this is read after the
/// operator has exited.
#[derive(Default)]
struct Audit {
    watches: BTreeMap<String, usize>,
    verbs: BTreeMap<String, usize>,
}

fn audit_since(path: &Path, offset: u64, since: SystemTime) -> anyhow::Result<Audit> {
    let mut f = std::fs::File::open(path)?;
    f.seek(SeekFrom::Start(offset))?;
    let mut text = String::new();
    f.read_to_string(&mut text)?;
    let mut seen = HashSet::new();
    let mut audit = Audit::default();
    for line in text.lines() {
        let Ok(e) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let received = e["requestReceivedTimestamp"].as_str().and_then(|t| humantime::parse_rfc3339_weak(t).ok());
        if e["user"]["username"] != OPERATOR_USER
            || received.is_none_or(|t| t < since)
            || !seen.insert(e["auditID"].as_str().unwrap_or_default().to_owned())
        {
            continue;
        }
        let verb = e["verb"].as_str().unwrap_or_default();
        *audit.verbs.entry(verb.to_owned()).or_default() += 1;
        if verb == "watch" {
            let o = &e["objectRef"];
            let key = format!("{} {}", o["resource"].as_str().unwrap_or("?"), o["namespace"].as_str().unwrap_or("*"));
            *audit.watches.entry(key).or_default() += 1;
        }
    }
    Ok(audit)
}

/// What the split snapshot's indexes named anew, from the second index seen on: the bytes
/// a reader that keeps the parts it has read must fetch (and the operator wrote).
#[derive(Default)]
struct PartChurn {
    /// The names of the last index seen.
    last: Option<BTreeSet<String>>,
    indexes: u64,
    new_parts: u64,
    new_bytes: u64,
    parts: u64,
    bytes: u64,
}

impl PartChurn {
    fn saw(&mut self, index: &configmap::Index) {
        let names: BTreeSet<String> = index.parts.iter().map(|p| p.name.clone()).collect();
        if let Some(last) = &self.last {
            let new: BTreeMap<&str, usize> =
                index.parts.iter().filter(|p| !last.contains(&p.name)).map(|p| (p.name.as_str(), p.size)).collect();
            self.indexes += 1;
            self.new_parts += new.len() as u64;
            self.new_bytes += new.values().sum::<usize>() as u64;
            self.parts += names.len() as u64;
            self.bytes += index.size as u64;
        }
        self.last = Some(names);
    }

    fn summary(&self) -> String {
        if self.indexes == 0 {
            return "not split".into();
        }
        let n = self.indexes as f64;
        format!(
            "{:.1} new parts of {:.1}, {:.0} KB of {:.0} KB, per index ({} indexes)",
            self.new_parts as f64 / n,
            self.parts as f64 / n,
            self.new_bytes as f64 / n / 1000.0,
            self.bytes as f64 / n / 1000.0,
            self.indexes
        )
    }
}

/// Watches the operator's namespace's snapshot ConfigMaps and sends, for each version of
/// `name`, the time it arrived (before decoding) and its ports; counts in `churn` what each
/// index names anew.
async fn watch_configmap(
    client: kube::Client,
    name: String,
    tx: mpsc::UnboundedSender<(Instant, anyhow::Result<Ports>)>,
    churn: std::sync::Arc<std::sync::Mutex<PartChurn>>,
) {
    let api = Api::<ConfigMap>::namespaced(client, OPERATOR_NS);
    let config = watcher::Config::default().labels("app.kubernetes.io/managed-by=consul-resolver-operator");
    let mut parts: BTreeMap<String, ConfigMap> = BTreeMap::new();
    let mut stream = watcher(api, config).boxed();
    while let Some(ev) = stream.next().await {
        let at = Instant::now();
        let cm = match ev {
            Ok(watcher::Event::Apply(cm) | watcher::Event::InitApply(cm)) => cm,
            // Parts are named by their content and never change: the ones kept are a cache
            // a reader only adds the new ones to; deleted ones leave it.
            Ok(watcher::Event::Delete(cm)) => {
                parts.remove(cm.metadata.name.as_deref().unwrap_or_default());
                continue;
            }
            Ok(_) => continue,
            Err(e) => {
                eprintln!("  ConfigMap watch: {e}");
                continue;
            }
        };
        let cm_name = cm.metadata.name.clone().unwrap_or_default();
        if cm_name != name {
            parts.insert(cm_name, cm);
            continue;
        }
        if let Ok(Some(index)) = configmap::index_of(&cm) {
            churn.lock().unwrap().saw(&index);
        }
        let parts: Vec<ConfigMap> = parts.values().cloned().collect();
        let decoded = configmap::decode(&cm, &parts)
            .map_err(anyhow::Error::msg)
            .and_then(|json| Ok(serde_json::from_slice::<Ports>(&json)?));
        if tx.send((at, decoded)).is_err() {
            return;
        }
    }
}

/// The operator's `/metrics` page.
async fn metrics_text(op: &Operator) -> Option<String> {
    let resp = reqwest::Client::builder().no_proxy().build().ok()?.get(op.url("/metrics")).send().await.ok()?;
    resp.text().await.ok()
}

/// The operator's `publish_duration_seconds` histogram: (sum, count).
async fn publish_seconds(op: &Operator) -> Option<(f64, u64)> {
    let text = metrics_text(op).await?;
    Some((
        metric_sample(&text, "consul_resolver_publish_duration_seconds_sum")?,
        metric_sample(&text, "consul_resolver_publish_duration_seconds_count")? as u64,
    ))
}

/// The histograms that say where a change's time goes: the publication's latency from its
/// first event, the assembler's stages, each publisher, and the feed's Consul requests.
const BREAKDOWN: [&str; 4] = [
    "consul_resolver_publication_latency_seconds",
    "consul_resolver_assemble_duration_seconds",
    "consul_resolver_publisher_duration_seconds",
    "consul_resolver_consul_request_duration_seconds",
];

/// The `_sum` and `_count` of every series of the [`BREAKDOWN`] histograms, by the series'
/// name and labels.
async fn breakdown(op: &Operator) -> Option<BTreeMap<String, (f64, f64)>> {
    let text = metrics_text(op).await?;
    let mut out: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for line in text.lines() {
        let Some((series, value)) = line.rsplit_once(' ') else { continue };
        let Ok(value) = value.parse::<f64>() else { continue };
        for family in BREAKDOWN {
            let Some(rest) = series.strip_prefix(family) else { continue };
            let (sum, labels) = match (rest.strip_prefix("_sum"), rest.strip_prefix("_count")) {
                (Some(labels), _) => (true, labels),
                (_, Some(labels)) => (false, labels),
                _ => continue,
            };
            let name = format!("{}{labels}", family.trim_start_matches("consul_resolver_"));
            let entry = out.entry(name).or_default();
            if sum {
                entry.0 = value;
            } else {
                entry.1 = value;
            }
        }
    }
    Some(out)
}

/// The mean of each [`BREAKDOWN`] series observed between two scrapes, in ms.
fn breakdown_means(before: &BTreeMap<String, (f64, f64)>, after: &BTreeMap<String, (f64, f64)>) -> String {
    after
        .iter()
        .filter_map(|(name, (sum, count))| {
            let (s0, n0) = before.get(name).copied().unwrap_or_default();
            (count > &n0).then(|| format!("{name} {:.1} ms x{}", (sum - s0) / (count - n0) * 1000.0, count - n0))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

struct Latencies(Vec<Duration>);

impl Latencies {
    fn summary(&self) -> String {
        let mut v = self.0.clone();
        v.sort();
        if v.is_empty() {
            return "n/a".into();
        }
        format!(
            "p50 {}, p99 {}, max {}",
            ms(percentile(&v, 0.5)),
            ms(percentile(&v, 0.99)),
            ms(*v.last().expect("not empty"))
        )
    }

    fn percentile(&self, p: f64) -> Duration {
        let mut v = self.0.clone();
        v.sort();
        percentile(&v, p)
    }
}

/// Moves one instance of one service to a new port per step and times each until the
/// ConfigMap holds it.
/// `spaced`: wait a quiet window after each, so each change is a leading edge. The
/// operator's VmRSS is printed every 50 changes (does memory level off?).
#[allow(clippy::too_many_arguments)]
async fn changes(
    pid: u32,
    http: &reqwest::Client,
    base: &str,
    rx: &mut mpsc::UnboundedReceiver<(Instant, anyhow::Result<Ports>)>,
    s: &Settings,
    port_base: u16,
    offset: usize,
    spaced: bool,
) -> anyhow::Result<Latencies> {
    let mut out = Vec::with_capacity(s.changes);
    let mut rss = Vec::new();
    for i in 0..s.changes {
        let svc = picked_service(s, i, offset);
        let node = node_name((i + offset) % s.instances);
        let port = port_base + i as u16;
        while rx.try_recv().is_ok() {}
        let t0 = Instant::now();
        register(http, base, &svc, &node, port).await?;
        let what = || format!("change {i} ({svc} on {node} -> port {port})");
        out.push(until_configmap(rx, t0, what, |p| p.has(&svc, s.instances, &node, port)).await?);
        if spaced {
            tokio::time::sleep(s.window() + Duration::from_millis(50)).await;
        }
        if (i + 1) % 50 == 0 {
            rss.push(format!("{}: {} MiB", i + 1, memory_kib(pid)?.1 / 1024));
        }
    }
    println!("  operator VmRSS after n changes: {}", rss.join(", "));
    Ok(Latencies(out))
}

/// The service the `i`th change or flip of a series at `offset` changes: strided by a
/// prime, so a series spreads over the services.
fn picked_service(s: &Settings, i: usize, offset: usize) -> String {
    service_name((i * 7919 + offset) % s.services)
}

/// The services a series of changes or flips at `offset` changes.
fn changed_services(s: &Settings, offset: usize) -> impl Iterator<Item = String> + '_ {
    (0..s.changes).map(move |i| picked_service(s, i, offset))
}

/// The simulator's latest request, to count a series' requests from.
fn last_request(sim: &RunningSim) -> u64 {
    sim.requests().last().map_or(0, |r| r.seq)
}

/// The Consul requests of a series, split: those it caused (queries of the services it
/// changed, and the change feed's own queries), and queries of every other service. The
/// latter are the background: the sweep (each fed service once per `--consul-sweep`,
/// spread over it: about 16 a second at 4,900 fed services and 5 minutes) and dedicated
/// blocking queries timing out; or a wake-up of every fed service, which a rate well
/// above the sweep's would show.
#[derive(Debug, Clone, Copy, Default)]
struct SeriesRequests {
    caused: u64,
    others: u64,
    over: Duration,
}

impl SeriesRequests {
    fn summary(&self, changes: usize) -> String {
        format!(
            "{:.1}; {} of other services in {:.0} s ({:.1}/s)",
            self.caused as f64 / changes.max(1) as f64,
            self.others,
            self.over.as_secs_f64(),
            self.others as f64 / self.over.as_secs_f64().max(1e-3)
        )
    }
}

fn series_requests(sim: &RunningSim, after: u64, changed: &HashSet<String>, over: Duration) -> SeriesRequests {
    let mut r = SeriesRequests { over, ..SeriesRequests::default() };
    for req in sim.requests().iter().filter(|q| q.seq > after) {
        match &req.service {
            Some(name) if !changed.contains(name) => r.others += 1,
            _ => r.caused += 1,
        }
    }
    r
}

/// How long after `t0` the ConfigMap first satisfied `shows`; an error after
/// `CHANGE_LIMIT` naming `what`.
async fn until_configmap(
    rx: &mut mpsc::UnboundedReceiver<(Instant, anyhow::Result<Ports>)>,
    t0: Instant,
    what: impl Fn() -> String,
    shows: impl Fn(&Ports) -> bool,
) -> anyhow::Result<Duration> {
    loop {
        let left = CHANGE_LIMIT.saturating_sub(t0.elapsed());
        match tokio::time::timeout(left, rx.recv()).await {
            Err(_) => bail!("{} not in the ConfigMap after {CHANGE_LIMIT:?}", what()),
            Ok(None) => bail!("the ConfigMap watch ended"),
            Ok(Some((_, Err(e)))) => eprintln!("  ConfigMap not decodable (retrying): {e:#}"),
            Ok(Some((at, Ok(p)))) if shows(&p) => return Ok(at.duration_since(t0)),
            Ok(Some(_)) => {}
        }
    }
}

/// Health flips, spaced: one instance's check goes critical (the resolvers publish passing
/// instances only, so it leaves the snapshot), then passing again (it comes back), each
/// timed until the ConfigMap shows it. Fed services included: at the default budget most
/// services have no blocking query of their own.
async fn health_flips(
    http: &reqwest::Client,
    base: &str,
    rx: &mut mpsc::UnboundedReceiver<(Instant, anyhow::Result<Ports>)>,
    s: &Settings,
    offset: usize,
) -> anyhow::Result<Latencies> {
    let mut out = Vec::with_capacity(2 * s.changes);
    for i in 0..s.changes {
        let svc = picked_service(s, i, offset);
        let node = node_name((i + offset) % s.instances);
        for (status, present) in [("critical", false), ("passing", true)] {
            while rx.try_recv().is_ok() {}
            let t0 = Instant::now();
            set_check(http, base, &svc, &node, status).await?;
            let what = || format!("flip {i} ({svc} on {node} -> {status})");
            out.push(until_configmap(rx, t0, what, |p| p.node_is(&svc, &node, present)).await?);
            tokio::time::sleep(s.window() + Duration::from_millis(50)).await;
        }
    }
    Ok(Latencies(out))
}

/// Node check flips, spaced: a service gets an instance on a node of its own (untimed),
/// then that node's `serfHealth` goes critical (the instance leaves the snapshot: the
/// resolvers publish passing instances only) and passing again (it must come back: a fed
/// watch hears of the node because it asked about it, not because its last, filtered,
/// answer showed it), each timed until the ConfigMap shows it.
async fn node_flips(
    http: &reqwest::Client,
    base: &str,
    rx: &mut mpsc::UnboundedReceiver<(Instant, anyhow::Result<Ports>)>,
    s: &Settings,
    offset: usize,
) -> anyhow::Result<Latencies> {
    let mut out = Vec::with_capacity(2 * s.node_flips);
    for i in 0..s.node_flips {
        let svc = picked_service(s, i, offset);
        let node = format!("edge-{svc}");
        while rx.try_recv().is_ok() {}
        register(http, base, &svc, &node, 30_000 + (i % 30_000) as u16).await?;
        until_configmap(rx, Instant::now(), || format!("{svc} on {node}"), |p| p.node_is(&svc, &node, true)).await?;
        tokio::time::sleep(s.window() + Duration::from_millis(50)).await;
        for (status, present) in [("critical", false), ("passing", true)] {
            while rx.try_recv().is_ok() {}
            let t0 = Instant::now();
            let body = json!({"Node": node, "Address": "127.0.0.1",
                "Check": {"CheckID": "serfHealth", "Name": "Serf Health Status", "Status": status}});
            let r = http.put(format!("{base}/v1/catalog/register")).json(&body).send().await?;
            ensure!(r.status().is_success(), "node check of {node}: {}", r.status());
            let what = || format!("node flip {i} ({node} -> {status})");
            out.push(until_configmap(rx, t0, what, |p| p.node_is(&svc, &node, present)).await?);
            tokio::time::sleep(s.window() + Duration::from_millis(50)).await;
        }
    }
    Ok(Latencies(out))
}

/// One operator process, from spawn to its first complete snapshot.
struct Instance {
    op: Operator,
    pid: u32,
    spawned_at: SystemTime,
    cm: String,
    cold_http: Duration,
    snapshot: bytes::Bytes,
    bootstrap_requests: u64,
    bootstrap_services_queried: usize,
    /// VmHWM, VmRSS (KiB) right after the first snapshot.
    memory_first: (u64, u64),
    /// The operator's CPU time (user + system) from spawn to the first snapshot.
    cpu_first: Duration,
    /// The CPU of the others meanwhile.
    neighbours: Neighbours,
}

fn cold_start(
    rt: &Runtime,
    cluster: &Cluster,
    sim: &RunningSim,
    setup: &Setup,
    s: &Settings,
    max_connections: u32,
) -> anyhow::Result<Instance> {
    let cm = format!("bench-snap-{}", unique());
    let mut args: Vec<String> = Vec::new();
    for ns in &setup.namespaces {
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
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let spawned_at = SystemTime::now();
    let spawned = Instant::now();
    let before = Neighbours::now(cluster)?;
    let op = Operator::start(cluster, &args)?;
    let pid = op.pid().context("the operator is not running")?;
    let (cold_http, first_id, snapshot) = rt.block_on(first_snapshot(&op, pid, spawned, s.mappings()))?;
    let neighbours = Neighbours::now(cluster)?.since(before);
    let snapshot_bytes = snapshot.len();
    let cpu_first = cpu_time(pid)?;
    if let Some(dir) = std::env::var_os("BENCH_SAVE_SNAPSHOTS") {
        std::fs::write(Path::new(&dir).join(format!("first-{pid}.json")), &snapshot)?;
    }
    let memory_first = memory_kib(pid)?;
    let bootstrap_requests = sim.stats().requests_total;
    let bootstrap_services_queried: usize =
        sim.requests().iter().filter_map(|r| r.service.clone()).collect::<HashSet<_>>().len();
    // The "snapshot published" line follows the ConfigMap and status writes.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut milestones = milestones(&op.logs(), spawned_at);
    while milestones.published.is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        milestones = self::milestones(&op.logs(), spawned_at);
    }
    if milestones.watches_stopped > 0 || milestones.consul_watches != s.services {
        let copy = std::env::temp_dir().join(format!("operator-bench-{pid}.log"));
        std::fs::copy(&op.log, &copy)?;
        println!("  note: watches restarted during the cold start; log kept at {}", copy.display());
    }
    println!(
        "  operator pid {pid}: first complete snapshot (id {first_id}, {snapshot_bytes} bytes) at GET /snapshot after {}, CPU {}; meanwhile {}; {milestones:?}",
        ms(cold_http),
        ms(cpu_first),
        neighbours.text()
    );
    Ok(Instance {
        op,
        pid,
        spawned_at,
        cm,
        cold_http,
        snapshot,
        bootstrap_requests,
        bootstrap_services_queried,
        memory_first,
        cpu_first,
        neighbours,
    })
}

/// SIGTERM, and what the simulator still counts once the operator is gone.
fn stop(mut op: Operator, sim: &RunningSim) -> anyhow::Result<String> {
    let status = op.terminate(Duration::from_secs(30))?;
    std::thread::sleep(Duration::from_secs(2));
    let after = sim.stats();
    println!(
        "  operator exited ({status}); 2 s later the simulator counts {} open connections, {} blocking queries",
        after.open_connections_total, after.blocking_total
    );
    Ok(status.to_string())
}

struct Run {
    max_connections: u32,
    reflector: Vec<Duration>,
    cold: Vec<Duration>,
    /// The operator's CPU time to its first snapshot, each.
    cold_cpu: Vec<Duration>,
    /// The others' CPU during each; for the reflector, `bench` is the reflector's own (the
    /// bench process does nothing else meanwhile).
    reflector_neighbours: Vec<Neighbours>,
    cold_neighbours: Vec<Neighbours>,
    last: Milestones,
    snapshot_bytes: usize,
    /// The first snapshot's document, for the gzip measurement.
    snapshot: bytes::Bytes,
    encoding: String,
    spaced: Latencies,
    back_to_back: Latencies,
    /// Health flips (critical, then passing again), spaced, and the Consul requests of them.
    flips: Latencies,
    flip_requests: SeriesRequests,
    /// Node check flips (critical, then passing again) of a node holding one instance.
    node_flips: Latencies,
    /// The operator's CPU time over each series of changes, per change.
    cpu_spaced: Duration,
    cpu_back_to_back: Duration,
    audit: Option<Audit>,
    blocking_services: usize,
    blocking_max_per_service: usize,
    blocking_catalog: usize,
    peak_sim_connections_start: usize,
    peak_sim_connections: usize,
    publish_mean: Option<Duration>,
    bootstrap_requests: u64,
    bootstrap_services_queried: usize,
    change_requests: SeriesRequests,
    memory_first: (u64, u64),
    memory_end: (u64, u64),
    exit: String,
}

fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v[v.len() / 2]
}

fn min_med_max(v: &[Duration], f: fn(Duration) -> String) -> String {
    let mut v = v.to_vec();
    v.sort();
    format!("{} / {} / {}", f(v[0]), f(v[v.len() / 2]), f(v[v.len() - 1]))
}

/// The cold starts of one run.
#[derive(Clone, Copy, PartialEq)]
enum Plan {
    /// Three, each after a bare reflector run (the overhead ratio).
    Compared,
    /// One (a row of the cost table).
    Once,
}

/// The cold starts of `plan`; the last operator then goes on to the change measurements.
fn run_operator(
    rt: &Runtime,
    cluster: &Cluster,
    sim: &mut Option<RunningSim>,
    setup: &Setup,
    s: &Settings,
    max_connections: u32,
    plan: Plan,
) -> anyhow::Result<Run> {
    println!("== --consul-max-connections {max_connections}");
    let mut reflector = Vec::new();
    let mut cold = Vec::new();
    let mut cold_cpu = Vec::new();
    let (mut reflector_neighbours, mut cold_neighbours) = (Vec::new(), Vec::new());
    let mut instance = None;
    let rounds = if plan == Plan::Compared { 3 } else { 1 };
    for k in 0..rounds {
        if plan == Plan::Compared {
            let (t, meanwhile) = reflector_run(rt, cluster, setup, s)?;
            println!(
                "  bare reflector: {} ({} Mappings), CPU {}; {}",
                ms(t),
                s.mappings(),
                ms(meanwhile.bench),
                meanwhile.text()
            );
            reflector.push(t);
            reflector_neighbours.push(meanwhile);
        }
        sim.take();
        let fresh = sim.insert(fresh_sim(rt, setup.sim_addr, s)?);
        let i = cold_start(rt, cluster, fresh, setup, s, max_connections)?;
        cold.push(i.cold_http);
        cold_cpu.push(i.cpu_first);
        cold_neighbours.push(i.neighbours);
        if k + 1 < rounds {
            stop(i.op, fresh)?;
        } else {
            instance = Some(i);
        }
    }
    let Instance {
        op,
        pid,
        spawned_at,
        cm,
        snapshot,
        bootstrap_requests,
        bootstrap_services_queried,
        memory_first,
        ..
    } = instance.expect("at least one round");
    let snapshot_bytes = snapshot.len();
    let sim = sim.as_ref().expect("started above");

    std::thread::sleep(Duration::from_secs(2));
    let settled = sim.stats();
    let blocking_catalog = settled.blocking.get(consul_sim::CATALOG_SERVICES_LABEL).copied().unwrap_or(0);
    let per_service: Vec<usize> = settled
        .blocking
        .iter()
        .filter(|(k, _)| k.as_str() != consul_sim::CATALOG_SERVICES_LABEL)
        .map(|(_, v)| *v)
        .collect();
    println!(
        "  blocking queries: {} services, max {} per service, {} on the catalog; requests so far {}",
        per_service.len(),
        per_service.iter().max().unwrap_or(&0),
        blocking_catalog,
        settled.requests_total
    );
    let peak_sim_connections_start = settled.peak_connections_total;

    // Changes, timed at the ConfigMap.
    let admin = rt.block_on(kube_client(&cluster.admin_kubeconfig))?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let churn = std::sync::Arc::new(std::sync::Mutex::new(PartChurn::default()));
    let watch = rt.spawn(watch_configmap(admin.clone(), cm.clone(), tx, churn.clone()));
    let encoding = rt.block_on(async {
        let api = Api::<ConfigMap>::namespaced(admin.clone(), OPERATOR_NS);
        let main = api.get(&cm).await?;
        let how = if main.data.as_ref().is_some_and(|d| d.contains_key(configmap::KEY_JSON)) {
            "data[snapshot.json]".to_owned()
        } else if main.binary_data.as_ref().is_some_and(|d| d.contains_key(configmap::KEY_GZIP)) {
            let gz = main.binary_data.as_ref().and_then(|d| d.get(configmap::KEY_GZIP)).map_or(0, |b| b.0.len());
            format!("binaryData[snapshot.json.gz], {gz} bytes")
        } else {
            let parts = configmap::index_of(&main).map_err(anyhow::Error::msg)?.map_or(0, |i| i.parts.len());
            format!("split into {parts} parts")
        };
        anyhow::Ok(how)
    })?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let before_changes = last_request(sim);
    let changes_started = Instant::now();
    let publish_before = rt.block_on(publish_seconds(&op));
    // CPU per change: the operator's whole CPU time over a series (the quiet windows of the
    // spaced one included: work a change leaves for after its publication counts too),
    // divided by the changes. Clock ticks, so 10 ms steps over the series at USER_HZ 100.
    let cpu_before = cpu_time(pid)?;
    let breakdown_before = rt.block_on(breakdown(&op));
    let spaced = rt.block_on(changes(pid, &http, &setup.base_url, &mut rx, s, 20_000, 0, true))?;
    let cpu_spaced = (cpu_time(pid)? - cpu_before) / s.changes as u32;
    println!("  spaced changes: {}; operator CPU per change {}", spaced.summary(), cpu_ms(cpu_spaced));
    if let (Some(before), Some(after)) = (breakdown_before, rt.block_on(breakdown(&op))) {
        println!("  where the spaced changes' time went (mean per observation): {}", breakdown_means(&before, &after));
    }
    let cpu_before = cpu_time(pid)?;
    let back_to_back =
        rt.block_on(changes(pid, &http, &setup.base_url, &mut rx, s, 20_000 + s.changes as u16, 13, false))?;
    let cpu_back_to_back = (cpu_time(pid)? - cpu_before) / s.changes as u32;
    println!(
        "  back-to-back changes: {}; operator CPU per change {}",
        back_to_back.summary(),
        cpu_ms(cpu_back_to_back)
    );
    let changed: HashSet<String> = [0, 13].iter().flat_map(|&offset| changed_services(s, offset)).collect();
    let change_requests = series_requests(sim, before_changes, &changed, changes_started.elapsed());
    println!("  Consul requests during the changes: {}", change_requests.summary(2 * s.changes));
    println!("  ConfigMap parts during the changes: {}", churn.lock().unwrap().summary());
    let (before_flips, flips_started) = (last_request(sim), Instant::now());
    let flips = rt.block_on(health_flips(&http, &setup.base_url, &mut rx, s, 29))?;
    let flipped: HashSet<String> = changed_services(s, 29).collect();
    let flip_requests = series_requests(sim, before_flips, &flipped, flips_started.elapsed());
    println!("  health flips: {}; Consul requests: {}", flips.summary(), flip_requests.summary(flips.0.len()));
    let node_flips = if s.node_flips > 0 {
        let n = rt.block_on(node_flips(&http, &setup.base_url, &mut rx, s, 31))?;
        println!("  node check flips: {}", n.summary());
        n
    } else {
        Latencies(Vec::new())
    };
    let publish_mean = match (publish_before, rt.block_on(publish_seconds(&op))) {
        (Some((s0, n0)), Some((s1, n1))) if n1 > n0 => Some(Duration::from_secs_f64((s1 - s0) / (n1 - n0) as f64)),
        _ => None,
    };
    watch.abort();

    let memory_end = memory_kib(pid)?;
    let peak_sim_connections = sim.stats().peak_connections_total;
    let log = op.logs();
    let exit = stop(op, sim)?;
    // The API server logs a watch when it ends (the operator has exited by now).
    let audit = cluster.audit_log().map(|p| audit_since(&p, setup.audit_offset, spawned_at)).transpose()?;
    if let Some(a) = &audit {
        println!("  audit: watches {:?}; verbs {:?}", a.watches, a.verbs);
    }
    Ok(Run {
        max_connections,
        reflector,
        cold,
        cold_cpu,
        reflector_neighbours,
        cold_neighbours,
        last: milestones(&log, spawned_at),
        snapshot_bytes,
        snapshot,
        encoding,
        spaced,
        back_to_back,
        flips,
        flip_requests,
        node_flips,
        cpu_spaced,
        cpu_back_to_back,
        audit,
        blocking_services: per_service.len(),
        blocking_max_per_service: per_service.iter().copied().max().unwrap_or(0),
        blocking_catalog,
        peak_sim_connections_start,
        peak_sim_connections,
        publish_mean,
        bootstrap_requests,
        bootstrap_services_queried,
        change_requests,
        memory_first,
        memory_end,
        exit,
    })
}

/// `BENCH_SIZES`: one operator per size, in the first of `BENCH_MODES`, each with its own
/// namespaces, Mappings and simulator; then a markdown table of what each size costs.
fn cost_table(rt: &Runtime, cluster: &Cluster, s: &Settings, load_start: &str) -> anyhow::Result<()> {
    let mode = s.modes[0];
    let mut rows = Vec::new();
    for &(services, instances) in &s.sizes {
        let size = Settings { services, instances, sizes: Vec::new(), ..s.clone() };
        println!(
            "== size: {} services x {} instances ({} endpoints), {} Mappings",
            services,
            instances,
            size.endpoints(),
            size.mappings()
        );
        // The namespaces of earlier sizes stay until the cluster goes at exit: deleting
        // them would have the API server collecting their Mappings during this size's run.
        let mut sim = Some(start_sim(SocketAddr::from(([127, 0, 0, 1], 0)))?);
        let namespaces =
            (0..size.namespaces).map(|_| cluster.namespace("bench")).collect::<anyhow::Result<Vec<_>>>()?;
        let setup = rt.block_on(setup(cluster, sim.as_ref().expect("started"), &size, namespaces))?;
        println!("  setup: Mappings created in {}", secs(setup.mappings_created_in));
        let run = run_operator(rt, cluster, &mut sim, &setup, &size, mode, Plan::Once)?;
        rows.push((size, run));
    }
    println!();
    println!(
        "Cost by size: --consul-max-connections {mode} (the first of BENCH_MODES); {} Mappings per service over \
         {} namespaces, a ConsulResolver per namespace; --coalesce-window {}; {} changes of each kind; one operator \
         (one cold start) per size, each with fresh namespaces and simulator; load average {} at start, {} at end",
        s.per_service,
        s.namespaces,
        s.window,
        s.changes,
        load_start,
        loadavg()
    );
    println!();
    println!(
        "| Mappings | services | endpoints | snapshot bytes | cold start | spaced p50 / p99 | \
         CPU per spaced change | CPU per back-to-back change | peak RSS (VmHWM) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (size, r) in &rows {
        println!(
            "| {} | {} | {} | {} | {} | {} / {} | {} | {} | {} |",
            count(size.mappings()),
            count(size.services),
            count(size.endpoints()),
            count(r.snapshot_bytes),
            secs(r.cold[0]),
            ms(r.spaced.percentile(0.5)),
            ms(r.spaced.percentile(0.99)),
            cpu_ms(r.cpu_spaced),
            cpu_ms(r.cpu_back_to_back),
            mib(r.memory_end.0)
        );
    }
    println!();
    for (size, r) in &rows {
        println!("{} Mappings: {}", count(size.mappings()), gzip_levels(&r.snapshot));
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let wall = Instant::now();
    if std::env::var_os("E2E_OPERATOR_PROFILE").is_none() {
        // SAFETY: nothing else runs yet: no thread has been started.
        unsafe { std::env::set_var("E2E_OPERATOR_PROFILE", "release") };
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let s = Settings::from_env()?;
    if s.sizes.is_empty() {
        println!("Targets: {}.", Targets::of(&s).name);
    } else {
        println!("Targets: none (BENCH_SIZES: the cost table).");
    }
    let load_start = loadavg();
    let bin: PathBuf = operator_binary()?;
    println!("operator binary: {}", bin.display());
    let cluster = Cluster::shared();
    // Before the runtime's threads start, so that they are placed too.
    let placement = if s.pin { place(cluster)? } else { "shared: the bench pins nothing".to_owned() };
    println!("placement: {placement}");
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    if let Some(soak) = soak::Soak::from_env()? {
        soak::run(&rt, cluster, &s, &soak, &load_start)?;
        println!("wall time: {}", secs(wall.elapsed()));
        return Ok(());
    }
    if !s.sizes.is_empty() {
        cost_table(&rt, cluster, &s, &load_start)?;
        println!("wall time: {}", secs(wall.elapsed()));
        return Ok(());
    }
    // Only its address is used until the first operator run registers the services in a
    // fresh one.
    let mut sim = Some(start_sim(SocketAddr::from(([127, 0, 0, 1], 0)))?);
    let namespaces = (0..s.namespaces).map(|_| cluster.namespace("bench")).collect::<anyhow::Result<Vec<_>>>()?;
    let setup = rt.block_on(setup(cluster, sim.as_ref().expect("started"), &s, namespaces))?;
    println!(
        "setup: {} services x {} instances ({} endpoints), {} Kubernetes Services (3 endpoints each), {} Mappings in {} namespaces (created in {})",
        s.services,
        s.instances,
        s.endpoints(),
        s.kube_services,
        s.mappings(),
        s.namespaces,
        secs(setup.mappings_created_in)
    );

    // Right after the setup's creates the API server has spent up to 1.4 times the CPU on
    // the same list, and the first pair measured came out better or worse than the rest by
    // 0.1 to 0.25x (docs/benchmarks.md). Lists thrown away let it settle; their lines show
    // what they cost.
    for _ in 0..s.warm_up {
        let (t, meanwhile) = reflector_run(&rt, cluster, &setup, &s)?;
        println!("warm-up reflector (not counted): {}; {}", ms(t), meanwhile.text());
    }
    let mut runs = Vec::new();
    for &max in &s.modes {
        runs.push(run_operator(&rt, cluster, &mut sim, &setup, &s, max, Plan::Compared)?);
    }
    let load_end = loadavg();
    let targets = Targets::of(&s);

    println!();
    println!(
        "{} Consul services x {} instances ({} endpoints), {} Mappings ({} per service) in {} namespaces, \
         {} Kubernetes Services routed to, a ConsulResolver per namespace; --coalesce-window {}; {} changes of each kind; \
         load average {} at start, {} at end; placement: {placement}",
        s.services,
        s.instances,
        s.endpoints(),
        s.mappings(),
        s.per_service,
        s.namespaces,
        s.kube_services,
        s.window,
        s.changes,
        load_start,
        load_end
    );
    println!("Targets: {}.", targets.name);
    println!();
    let mut header = "| measure | target |".to_owned();
    let mut sep = "|---|---|".to_owned();
    for r in &runs {
        header += &format!(" --consul-max-connections {} |", r.max_connections);
        sep += "---|";
    }
    println!("{header}\n{sep}");
    let row = |name: &str, target: &str, f: &dyn Fn(&Run) -> String| {
        let mut line = format!("| {name} | {target} |");
        for r in &runs {
            line += &format!(" {} |", f(r));
        }
        println!("{line}");
    };
    let target = |parts: &[Option<String>]| parts.iter().flatten().cloned().collect::<Vec<_>>().join(", ");
    let median_of = |l: Limit<Duration>| format!("median {}", l.text(ms_or_secs));
    row(
        "cold start: spawn -> complete snapshot at GET /snapshot (min / median / max of 3)",
        &target(&[targets.cold_start.map(median_of)]),
        &|r| min_med_max(&r.cold, secs),
    );
    row("bare reflector on the same Mappings (min / median / max of 3)", "", &|r| min_med_max(&r.reflector, secs));
    row("CPU (user + system) to the end: operator to its first snapshot / bare reflector (medians)", "", &|r| {
        format!(
            "{} / {}",
            ms(median(&r.cold_cpu)),
            ms(median(&r.reflector_neighbours.iter().map(|n| n.bench).collect::<Vec<_>>()))
        )
    });
    row(
        "CPU meanwhile, kube-apiserver / etcd / this process (medians): cold start (simulator, reader); bare reflector",
        "",
        &|r| format!("{}; {}", Neighbours::median(&r.cold_neighbours), Neighbours::median(&r.reflector_neighbours)),
    );
    row("cold start / bare reflector (medians)", &target(&[targets.overhead.map(|l| l.text(ratio_x))]), &|r| {
        ratio_x(median(&r.cold).as_secs_f64() / median(&r.reflector).as_secs_f64())
    });
    row("last cold start: spawn -> `starting` (client, discovery)", "", &|r| r.last.starting.map_or("n/a".into(), ms));
    row("last cold start: spawn -> first / last Consul watch started (Mappings listed)", "", &|r| {
        format!(
            "{} / {}",
            r.last.first_consul_watch.map_or("n/a".into(), ms),
            r.last.last_consul_watch.map_or("n/a".into(), ms)
        )
    });
    row("last cold start: spawn -> `snapshot published` (HTTP + ConfigMap + statuses)", "", &|r| {
        r.last.published.map_or("n/a".into(), ms)
    });
    row("snapshot size; ConfigMap encoding", "", &|r| format!("{} bytes; {}", r.snapshot_bytes, r.encoding));
    let p = |name: &str, l: Limit<Duration>| format!("{name} {}", l.text(ms));
    row(
        "Consul change -> ConfigMap, spaced (leading edge)",
        &target(&[targets.spaced_p50.map(|l| p("p50", l)), targets.spaced_p99.map(|l| p("p99", l))]),
        &|r| r.spaced.summary(),
    );
    row(
        "Consul change -> ConfigMap, back to back (inside the window)",
        &target(&[targets.back_to_back_p99.map(|l| p("p99", l))]),
        &|r| r.back_to_back.summary(),
    );
    row(
        "Consul health flip -> ConfigMap, spaced (critical and back; fed services included)",
        &p("p99", targets.flip_p99),
        &|r| format!("{}; Consul requests per flip {}", r.flips.summary(), r.flip_requests.summary(r.flips.0.len())),
    );
    row(
        "Consul node check flip -> ConfigMap, spaced (critical and back; fed services included)",
        &p("p99", targets.flip_p99),
        &|r| if r.node_flips.0.is_empty() { "not run (BENCH_NODE_FLIPS=0)".into() } else { r.node_flips.summary() },
    );
    row("Kubernetes watches opened (audit log, verb watch)", "one per key", &|r| match &r.audit {
        Some(a) => format!(
            "{} for {} keys (max {} per key)",
            a.watches.values().sum::<usize>(),
            a.watches.len(),
            a.watches.values().max().unwrap_or(&0)
        ),
        None => "n/a (no audit log)".into(),
    });
    row("Kubernetes requests by the operator, by verb", "", &|r| match &r.audit {
        Some(a) => a.verbs.iter().map(|(v, n)| format!("{v} {n}")).collect::<Vec<_>>().join(", "),
        None => "n/a".into(),
    });
    row("Consul blocking queries held after start", "one per key", &|r| {
        format!(
            "{} services (max {} per service) + {} on /v1/catalog/services",
            r.blocking_services, r.blocking_max_per_service, r.blocking_catalog
        )
    });
    row("Consul requests to the first snapshot (services queried)", "", &|r| {
        format!("{} ({})", r.bootstrap_requests, r.bootstrap_services_queried)
    });
    row(
        "Consul requests per change (of the changed services, and the feed's); of other services (the sweep)",
        "",
        &|r| r.change_requests.summary(2 * s.changes),
    );
    row("operator CPU per change (utime + stime over the series / changes): spaced; back to back", "", &|r| {
        format!("{}; {}", cpu_ms(r.cpu_spaced), cpu_ms(r.cpu_back_to_back))
    });
    row("mean publication (HTTP + ConfigMap + statuses) during the changes", "", &|r| {
        r.publish_mean.map_or("n/a".into(), ms)
    });
    row("peak connections to the simulator: to the first snapshot + 2 s; whole run", "", &|r| {
        format!("{}; {}", r.peak_sim_connections_start, r.peak_sim_connections)
    });
    row("operator peak RSS (VmHWM) at the end", &targets.peak_rss_kib.text(mib), &|r| mib(r.memory_end.0));
    row("operator VmHWM / VmRSS at the first snapshot; VmRSS at the end", "", &|r| {
        format!("{} / {}; {}", mib(r.memory_first.0), mib(r.memory_first.1), mib(r.memory_end.1))
    });
    row("warnings in the operator log; exit", "", &|r| format!("{}; {}", r.last.warnings, r.exit));
    println!();
    println!("Against {} targets:", targets.name);
    for r in &runs {
        let verdicts = targets
            .verdicts(r)
            .into_iter()
            .map(|(what, target, value, met)| {
                format!("{what} {value} ({target}) {}", if met { "met" } else { "MISSED" })
            })
            .collect::<Vec<_>>();
        println!("--consul-max-connections {}: {}", r.max_connections, verdicts.join(", "));
    }
    if let Some(r) = runs.first() {
        println!();
        println!("{}", gzip_levels(&r.snapshot));
    }
    println!("wall time: {}", secs(wall.elapsed()));
    Ok(())
}

/// What gzip costs on the real snapshot at the level the operator uses, at level 1 and at
/// the library's default (6): size, and min / median / max time of 20 runs in this process
/// (the operator is stopped by now, so the machine's other load is what the run records).
fn gzip_levels(json: &[u8]) -> String {
    use consul_resolver_core::assembler::gzip::LEVEL;
    use std::io::Write;
    let mut out = format!("gzip of the first snapshot ({} bytes), 20 runs each:", count(json.len()));
    let mut levels = vec![(LEVEL, format!("level {LEVEL} (the operator's)")), (6, "level 6 (the default)".to_owned())];
    if LEVEL != 1 {
        levels.insert(0, (1, "level 1".to_owned()));
    }
    for (level, what) in levels {
        let mut times = Vec::new();
        let mut size = 0;
        for _ in 0..20 {
            let started = Instant::now();
            let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(level));
            enc.write_all(json).expect("gzip into memory");
            size = enc.finish().expect("gzip into memory").len();
            times.push(started.elapsed());
        }
        out += &format!(" {what}: {} bytes in {};", count(size), min_med_max(&times, ms_f));
    }
    out
}

fn ms_f(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}
