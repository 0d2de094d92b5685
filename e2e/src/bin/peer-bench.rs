//! `make bench-peers`: how soon a health flip in a real Consul agent reaches each consumer,
//! the operator beside a peer, in one run.
//!
//! A real dev agent (Debian bullseye's 1.8.7) holds service `web`, two instances. The
//! operator (release build, its defaults, plus `--xds-listen` for the traffic level) reads
//! it for a Mapping and an export; Traefik 3.7's `consulCatalog` provider reads it with
//! `strictChecks=passing` (the operator's default `healthStatuses`), once with its default
//! polling (`refreshInterval` 15 s) and once with `watch=true` (blocking queries). One
//! instance's check is flipped critical and back `BENCH_FLIPS` times (default 20, so 40
//! changes per Traefik setting); each change waits until every consumer has seen it, then
//! `BENCH_SPACING_MS` more (default 2,500, beyond Traefik's 2 s
//! `providersThrottleDuration`), so no change is folded into another.
//! With polling, a further random wait of up to one `refreshInterval` puts each change at
//! a random point of Traefik's polling cycle (a change sent right after a poll would wait
//! the whole interval every time).
//!
//! For each change and consumer: the time from the moment the write is sent to Consul until
//! the consumer-facing view shows it: Traefik's `/api/http/services/web@consulcatalog`, the
//! operator's `/snapshot` and the export's EndpointSlices read from the API server. Each
//! view is polled every `BENCH_POLL_MS` (default 10): that is each observer's resolution.
//! Printed: min / median / p90 / max per consumer, and the ratio of each median to
//! Traefik's best.
//!
//! Then the traffic level (`traffic`): the same flips seen by requests, through a real
//! Envoy fed by the operator over xDS and through Traefik, to real backends.

#[path = "peer-bench/traffic.rs"]
mod traffic;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use e2e::agent::RealAgent;
use e2e::bench::{env_usize, loadavg, percentile};
use e2e::consul::Consul;
use e2e::fixtures::{export_yaml, mapping_yaml, resolver_yaml, service};
use e2e::harness::{Cluster, Operator, cached_binary, free_port, wait_for};
use serde_json::Value;

/// Traefik's default `refreshInterval` of the consulCatalog provider.
const REFRESH: Duration = Duration::from_secs(15);

/// The two instances (RFC 5737 documentation addresses: data, never connected to).
const A: &str = "192.0.2.1";
const B: &str = "192.0.2.2";

/// A consumer's view: the instance addresses it would route to, sorted; `None` when it
/// cannot be read.
type View = Option<BTreeSet<String>>;

/// The traffic level's router (Traefik's file provider): every request on entrypoint `web`
/// to the consulCatalog provider's service `web`.
const ROUTER: &str = "http:
  routers:
    bench:
      entryPoints: [web]
      rule: \"PathPrefix(`/`)\"
      service: web@consulcatalog
";

struct Traefik {
    child: Child,
    api: u16,
    /// Entrypoint `web`.
    web: u16,
    _dir: tempfile::TempDir,
}

impl Traefik {
    /// With `router`, [`ROUTER`] too (the traffic level); without, the provider alone.
    fn start(consul: &str, watch: bool, router: bool) -> anyhow::Result<Traefik> {
        let bin = cached_binary("scripts/real-parts.sh", "traefik-path", "scripts/real-parts.sh traefik")?;
        let dir = tempfile::Builder::new().prefix("cro-traefik-").tempdir()?;
        let (api, web) = (free_port(), free_port());
        let log = std::fs::File::create(dir.path().join("traefik.log"))?;
        let mut cmd = Command::new(bin);
        if router {
            let file = dir.path().join("router.yml");
            std::fs::write(&file, ROUTER)?;
            cmd.arg(format!("--providers.file.filename={}", file.display()));
        }
        let child = cmd
            .arg("--api.insecure=true")
            .arg(format!("--entrypoints.traefik.address=127.0.0.1:{api}"))
            .arg(format!("--entrypoints.web.address=127.0.0.1:{web}"))
            .arg(format!("--providers.consulcatalog.endpoint.address={consul}"))
            .arg("--providers.consulcatalog.strictChecks=passing")
            .arg(format!("--providers.consulcatalog.watch={watch}"))
            .arg("--log.level=ERROR")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting traefik")?;
        Ok(Traefik { child, api, web, _dir: dir })
    }
}

impl Drop for Traefik {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The addresses of the servers of Traefik's service `web`.
async fn traefik_view(http: &reqwest::Client, api: u16) -> View {
    let url = format!("http://127.0.0.1:{api}/api/http/services/web@consulcatalog");
    let resp = http.get(url).timeout(Duration::from_secs(2)).send().await.ok()?;
    if resp.status().as_u16() == 404 {
        return Some(BTreeSet::new());
    }
    let body: Value = resp.json().await.ok()?;
    let servers = body["loadBalancer"]["servers"].as_array()?;
    Some(
        servers
            .iter()
            .filter_map(|s| s["url"].as_str())
            .filter_map(|u| u.trim_start_matches("http://").split(':').next().map(str::to_owned))
            .collect(),
    )
}

/// The addresses of `web` under the resolver in the operator's `/snapshot`.
async fn snapshot_view(http: &reqwest::Client, url: &str, ns: &str) -> View {
    let resp = http.get(url).timeout(Duration::from_secs(2)).send().await.ok()?;
    let snap: Value = resp.json().await.ok()?;
    let entry = service(&snap, ns, "consul", "web")?;
    Some(entry["endpoints"].as_array()?.iter().filter_map(|e| e["address"].as_str().map(str::to_owned)).collect())
}

/// The addresses in the export's EndpointSlices, as the API server holds them.
async fn slices_view(slices: &kube::Api<kube::api::DynamicObject>) -> View {
    let params = kube::api::ListParams::default().labels("kubernetes.io/service-name=web");
    let list = slices.list(&params).await.ok()?;
    Some(
        list.items
            .iter()
            .flat_map(|s| s.data["endpoints"].as_array().cloned().unwrap_or_default())
            .filter_map(|e| e["addresses"][0].as_str().map(str::to_owned))
            .collect(),
    )
}

/// How long after `sent` each consumer's view first equals `want` (polled every `poll`),
/// or `None` past `deadline`.
async fn observe(
    sent: Instant,
    want: &BTreeSet<String>,
    poll: Duration,
    deadline: Duration,
    mut view: impl AsyncFnMut() -> View,
) -> Option<Duration> {
    while sent.elapsed() < deadline {
        if view().await.as_ref() == Some(want) {
            return Some(sent.elapsed());
        }
        tokio::time::sleep(poll).await; // the observer's resolution
    }
    None
}

struct Samples {
    name: String,
    taken: Vec<Duration>,
    missed: usize,
}

impl Samples {
    fn new(name: &str) -> Samples {
        Samples { name: name.into(), taken: vec![], missed: 0 }
    }
}

fn ms(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1000.0)
}

fn main() -> anyhow::Result<()> {
    if std::env::var_os("E2E_OPERATOR_PROFILE").is_none() {
        // SAFETY: nothing else runs yet: no thread has been started.
        unsafe { std::env::set_var("E2E_OPERATOR_PROFILE", "release") };
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let knobs = Knobs::from_env();
    let load_start = loadavg();
    let cluster = Cluster::shared();
    let agent = RealAgent::start()?;
    let consul = Consul { base_url: agent.base_url.clone(), token: None, sim: None };
    let ns = cluster.namespace("peers")?;
    let xds: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut op = start_operator(cluster, &agent, &consul, &ns, xds)?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let slices = rt.block_on(slices_api(cluster, &ns))?;
    let views = Views { http: reqwest::Client::new(), snapshot_url: op.url("/snapshot"), ns, slices };
    let profile = std::env::var("E2E_OPERATOR_PROFILE").unwrap_or_default();
    println!(
        "peer bench: Consul 1.8.7 (real agent), Traefik 3.7.15 consulCatalog, Envoy 1.40.0, the operator ({profile} build, defaults)"
    );
    let Knobs { flips, poll, spacing } = knobs;
    println!(
        "{flips} flips (critical and back) per Traefik setting, {spacing:?} apart after all have seen each; poll {poll:?}"
    );
    let bench = Bench { rt, consul, agent_address: agent.address(), views, knobs, xds };
    let mut results: Vec<Samples> = Vec::new();
    let mut ours = [Samples::new("operator /snapshot"), Samples::new("operator EndpointSlice")];
    for (watch, label) in
        [(false, "Traefik consulCatalog, polling (15 s)"), (true, "Traefik consulCatalog, watch=true")]
    {
        results.push(bench.traefik_round(watch, label, &mut ours)?);
    }
    results.extend(ours);
    let load_views = loadavg();
    let traffic = traffic::run(&bench)?;
    report(&results, poll, &load_start, &load_views);
    traffic.report();
    println!();
    println!("load average: {load_start} at the start, {} at the end (1, 5, 15 min)", loadavg());
    op.terminate(Duration::from_secs(30))?;
    Ok(())
}

/// The run's knobs, from the environment (see the crate's documentation).
#[derive(Clone, Copy)]
struct Knobs {
    flips: usize,
    poll: Duration,
    spacing: Duration,
}

impl Knobs {
    fn from_env() -> Knobs {
        Knobs {
            flips: env_usize("BENCH_FLIPS", 20),
            poll: Duration::from_millis(env_usize("BENCH_POLL_MS", 10) as u64),
            spacing: Duration::from_millis(env_usize("BENCH_SPACING_MS", 2_500) as u64),
        }
    }
}

/// Instance `address` of `web`, on a node of its own, with its check at `status`.
fn register(consul: &Consul, address: &str, status: &str) -> anyhow::Result<()> {
    let node = format!("node-{address}");
    consul.register(&node, address, "web", &format!("web-{address}"), 8080, status)
}

/// A resolver on the agent, a Mapping and an export of `web` in `ns`, both instances
/// passing; then the operator, ready, serving xDS on `xds` (for the traffic level).
fn start_operator(
    cluster: &Cluster,
    agent: &RealAgent,
    consul: &Consul,
    ns: &str,
    xds: SocketAddr,
) -> anyhow::Result<Operator> {
    cluster.grant_exports(ns)?;
    cluster.apply(&resolver_yaml(ns, "consul", &agent.address(), ""))?;
    cluster.apply(&mapping_yaml(ns, "m", "web", Some("consul")))?;
    cluster.apply(&export_yaml(ns, "web", "web", "consul", ""))?;
    register(consul, A, "passing")?;
    register(consul, B, "passing")?;
    let mut op = Operator::start(cluster, &["--namespace", ns, "--xds-listen", &xds.to_string()])?;
    op.wait_ready(Duration::from_secs(120))?;
    Ok(op)
}

/// The EndpointSlices of `ns`, as the API server serves them.
async fn slices_api(cluster: &Cluster, ns: &str) -> anyhow::Result<kube::Api<kube::api::DynamicObject>> {
    let kc = kube::config::Kubeconfig::read_from(&cluster.admin_kubeconfig)?;
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
    let kube = kube::Client::try_from(config)?;
    let resource = kube::api::ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk("discovery.k8s.io", "v1beta1", "EndpointSlice"),
        "endpointslices",
    );
    Ok(kube::Api::namespaced_with(kube, ns, &resource))
}

/// How the consumers' views of `web` are read: Traefik's API and the operator's `/snapshot`
/// over `http`, the export's EndpointSlices from the API server.
struct Views {
    http: reqwest::Client,
    snapshot_url: String,
    ns: String,
    slices: kube::Api<kube::api::DynamicObject>,
}

/// The run once the agent and the operator are up: what each Traefik round uses.
struct Bench {
    rt: tokio::runtime::Runtime,
    consul: Consul,
    agent_address: String,
    views: Views,
    knobs: Knobs,
    /// Where the operator serves xDS.
    xds: SocketAddr,
}

impl Bench {
    /// A Traefik with `watch` reading the agent, and the flips, each timed at Traefik (the
    /// samples returned) and at the operator's two views (added to `ours`).
    fn traefik_round(&self, watch: bool, label: &str, ours: &mut [Samples; 2]) -> anyhow::Result<Samples> {
        let both: BTreeSet<String> = [A, B].map(str::to_owned).into();
        let one: BTreeSet<String> = [A].map(str::to_owned).into();
        let traefik = Traefik::start(&self.agent_address, watch, false)?;
        wait_for(&format!("{label}: both instances"), Duration::from_secs(60), || {
            self.rt.block_on(traefik_view(&self.views.http, traefik.api)).filter(|v| *v == both).map(|_| ())
        })?;
        let mut theirs = Samples::new(label);
        for i in 0..self.knobs.flips * 2 {
            let (status, want) = if i % 2 == 0 { ("critical", &one) } else { ("passing", &both) };
            let [snapshot, slices_seen] = ours;
            let seen = self.flip(&traefik, status, want)?;
            for (samples, took) in [&mut theirs, snapshot, slices_seen].into_iter().zip(seen) {
                match took {
                    Some(d) => samples.taken.push(d),
                    None => samples.missed += 1,
                }
            }
            // The spacing between changes, beyond Traefik's throttle; polling, plus a random
            // phase of its cycle.
            let phase = if watch { Duration::ZERO } else { REFRESH.mul_f64(rand::random::<f64>()) };
            std::thread::sleep(self.knobs.spacing + phase);
        }
        Ok(theirs)
    }

    /// Instance B's check set to `status`: how long until Traefik, the operator's
    /// `/snapshot` and its EndpointSlices show `want`.
    fn flip(&self, traefik: &Traefik, status: &str, want: &BTreeSet<String>) -> anyhow::Result<[Option<Duration>; 3]> {
        let (http, poll) = (&self.views.http, self.knobs.poll);
        let (url, ns, slices) = (&self.views.snapshot_url, &self.views.ns, &self.views.slices);
        let sent = Instant::now();
        register(&self.consul, B, status)?;
        let deadline = Duration::from_secs(60);
        let (t, s, e) = self.rt.block_on(async {
            tokio::join!(
                observe(sent, want, poll, deadline, async || traefik_view(http, traefik.api).await),
                observe(sent, want, poll, deadline, async || snapshot_view(http, url, ns).await),
                observe(sent, want, poll, deadline, async || slices_view(slices).await),
            )
        });
        Ok([t, s, e])
    }
}

fn report(results: &[Samples], poll: Duration, load_start: &str, load_end: &str) {
    let best = results
        .iter()
        .filter(|s| s.name.starts_with("Traefik") && !s.taken.is_empty())
        .map(|s| {
            let mut t = s.taken.clone();
            t.sort();
            percentile(&t, 0.5)
        })
        .min();
    println!();
    println!("| consumer | changes seen | min | median | p90 | max (ms) | resolution | median vs Traefik's best |");
    println!("|---|---|---|---|---|---|---|---|");
    for s in results {
        let mut t = s.taken.clone();
        t.sort();
        if t.is_empty() {
            println!("| {} | 0 of {} | | | | | | |", s.name, s.missed);
            continue;
        }
        let median = percentile(&t, 0.5);
        let ratio = best.map(|b| format!("{:.2}x", median.as_secs_f64() / b.as_secs_f64())).unwrap_or_default();
        println!(
            "| {} | {} of {} | {} | {} | {} | {} | {} ms | {ratio} |",
            s.name,
            t.len(),
            t.len() + s.missed,
            ms(t[0]),
            ms(median),
            ms(percentile(&t, 0.9)),
            ms(t[t.len() - 1]),
            poll.as_millis(),
        );
    }
    println!();
    println!("view level: load average {load_start} at its start, {load_end} at its end (1, 5, 15 min)");
}
