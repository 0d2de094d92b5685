//! Consul changes made to a running operator, each timed until the snapshot ConfigMap
//! (watched, decoded with the operator's own `configmap::decode`) shows it: port changes
//! spaced and back to back, health flips and node check flips; with the operator's CPU per
//! change and the Consul requests they cost.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure};
use consul_resolver_operator::snapshot_configmap as configmap;
use consul_sim::{RequestRecord, RunningSim};
use e2e::bench::percentile;
use e2e::harness::{Cluster, Operator, metric_sample};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use kube::runtime::watcher;
use serde::Deserialize;
use serde_json::json;
use tokio::runtime::Runtime;
use tokio::sync::mpsc;

use crate::cold_start::Instance;
use crate::profile::Settings;
use crate::report::{cpu_ms, ms};
use crate::setup::{OPERATOR_NS, Setup, consul_http, kube_client, node_name, register, service_name, set_check};
use crate::xds::{self, PollCost, Probe};
use e2e::procfs::{cpu_time, memory_kib};

const CHANGE_LIMIT: Duration = Duration::from_secs(60);

/// What the changes of one run measured.
pub(crate) struct Changes {
    /// How the snapshot ConfigMap holds the document.
    pub(crate) encoding: String,
    pub(crate) spaced: Latencies,
    pub(crate) back_to_back: Latencies,
    /// The operator's CPU time over each series of changes, per change.
    pub(crate) cpu_spaced: Duration,
    pub(crate) cpu_back_to_back: Duration,
    pub(crate) change_requests: SeriesRequests,
    /// Health flips (critical, then passing again), spaced, and the Consul requests of them.
    pub(crate) flips: Latencies,
    pub(crate) flip_requests: SeriesRequests,
    /// Node check flips (critical, then passing again) of a node holding one instance.
    pub(crate) node_flips: Latencies,
    /// Mean publication during the changes.
    pub(crate) publish_mean: Option<Duration>,
    /// With `BENCH_XDS=1`: each spaced series over xDS, and what the bench's polls cost.
    pub(crate) xds: Vec<xds::Series>,
    pub(crate) poll_cost: Option<PollCost>,
}

/// Every series of changes, made to the running `instance`.
pub(crate) fn measure(
    rt: &Runtime,
    cluster: &Cluster,
    sim: &RunningSim,
    setup: &Setup,
    s: &Settings,
    instance: &Instance,
    probe: Option<Probe>,
) -> anyhow::Result<Changes> {
    let admin = rt.block_on(kube_client(&cluster.admin_kubeconfig))?;
    let (tx, rx) = mpsc::unbounded_channel();
    let churn = Arc::new(Mutex::new(PartChurn::default()));
    let watch = rt.spawn(watch_configmap(admin.clone(), instance.cm.clone(), tx, churn.clone()));
    let encoding = rt.block_on(encoding(admin, &instance.cm))?;
    let http = consul_http(s, None)?;
    let poll_cost = probe.as_ref().map(|p| rt.block_on(p.poll_cost())).transpose()?;
    let mut driver = Driver {
        http,
        base: &setup.base_url,
        sim,
        marks: Vec::new(),
        rx,
        s,
        pid: instance.pid,
        etcd: cluster.env_value("ETCD_URL"),
        xds: probe,
        poll_cost,
        samples: Vec::new(),
        series: Vec::new(),
    };
    let publish_before = rt.block_on(publish_seconds(&instance.op));
    let PortChanges { spaced, back_to_back, cpu_spaced, cpu_back_to_back, change_requests } =
        driver.port_changes(rt, &instance.op)?;
    println!("  ConfigMap parts during the changes: {}", churn.lock().unwrap().summary());
    let before = driver.breakdown(rt, &instance.op);
    let (flips, flip_requests) = rt.block_on(driver.health_flip_series())?;
    print_breakdown("health flips", &flips, before, driver.breakdown(rt, &instance.op));
    let node_flips = if s.node_flips > 0 {
        let before = driver.breakdown(rt, &instance.op);
        let n = rt.block_on(driver.node_flips(31))?;
        println!("  node check flips: {}", n.summary());
        print_breakdown("node check flips", &n, before, driver.breakdown(rt, &instance.op));
        driver.close_series("node check flips");
        n
    } else {
        Latencies(Vec::new())
    };
    let publish_mean = match (publish_before, rt.block_on(publish_seconds(&instance.op))) {
        (Some((s0, n0)), Some((s1, n1))) if n1 > n0 => Some(Duration::from_secs_f64((s1 - s0) / (n1 - n0) as f64)),
        _ => None,
    };
    watch.abort();
    let xds = std::mem::take(&mut driver.series);
    Ok(Changes {
        encoding,
        spaced,
        back_to_back,
        cpu_spaced,
        cpu_back_to_back,
        change_requests,
        flips,
        flip_requests,
        node_flips,
        publish_mean,
        xds,
        poll_cost,
    })
}

/// Where a series' time went, beside how many of its changes took over each of [`SLOW`]:
/// which stage the tail is made of; and below it, etcd's disk writes meanwhile, which every
/// ConfigMap write waits for.
fn print_breakdown(what: &str, series: &Latencies, before: Breakdown, after: Breakdown) {
    if let (Some(before), Some(after)) = (before.operator, after.operator) {
        let slow = SLOW.map(|bound| {
            let limit = Duration::from_secs_f64(bound.parse().expect("a number"));
            series.0.iter().filter(|d| **d > limit).count()
        });
        println!(
            "  where the {what}' time went (of {}: {}): {}",
            series.0.len(),
            over(slow.map(|n| n as f64), SLOW),
            breakdown_means(&before, &after, SLOW)
        );
    }
    if let (Some(before), Some(after)) = (before.etcd, after.etcd) {
        println!("  etcd's disk during the {what}: {}", breakdown_means(&before, &after, ETCD_SLOW));
    }
}

/// How the snapshot ConfigMap `cm` holds the document: inline, gzipped, or split.
async fn encoding(admin: kube::Client, cm: &str) -> anyhow::Result<String> {
    let api = Api::<ConfigMap>::namespaced(admin, OPERATOR_NS);
    let main = api.get(cm).await?;
    let how = if main.data.as_ref().is_some_and(|d| d.contains_key(configmap::KEY_JSON)) {
        "data[snapshot.json]".to_owned()
    } else if main.binary_data.as_ref().is_some_and(|d| d.contains_key(configmap::KEY_GZIP)) {
        let gz = main.binary_data.as_ref().and_then(|d| d.get(configmap::KEY_GZIP)).map_or(0, |b| b.0.len());
        format!("binaryData[snapshot.json.gz], {gz} bytes")
    } else {
        let parts = configmap::index_of(&main).map_err(anyhow::Error::msg)?.map_or(0, |i| i.parts.len());
        format!("split into {parts} parts")
    };
    Ok(how)
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

/// A version of the snapshot ConfigMap: when it arrived (before decoding), and its ports.
type Seen = (Instant, anyhow::Result<Ports>);

/// Watches the operator's namespace's snapshot ConfigMaps and sends, for each version of
/// `name`, the time it arrived (before decoding) and its ports; counts in `churn` what each
/// index names anew.
async fn watch_configmap(
    client: kube::Client,
    name: String,
    tx: mpsc::UnboundedSender<Seen>,
    churn: Arc<Mutex<PartChurn>>,
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
    metrics_page(&op.url("/metrics")).await
}

/// The metrics page at `url` (the operator's, etcd's), within 5 s.
async fn metrics_page(url: &str) -> Option<String> {
    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(5)).build().ok()?;
    http.get(url).send().await.ok()?.text().await.ok()
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

/// etcd's histograms of its disk writes: the WAL's fsync, which every write waits for, and
/// the backend's commit.
const ETCD_DISK: [&str; 2] = ["etcd_disk_wal_fsync_duration_seconds", "etcd_disk_backend_commit_duration_seconds"];

/// The [`ETCD_DISK`] bucket bounds nearest [`SLOW`]'s (etcd's buckets double from 1 ms).
const ETCD_SLOW: [&str; 2] = ["0.032", "0.064"];

/// The histograms of one scrape of the operator and of etcd.
struct Breakdown {
    operator: Option<BTreeMap<String, Observed>>,
    etcd: Option<BTreeMap<String, Observed>>,
}

/// One series of a [`BREAKDOWN`] or [`ETCD_DISK`] histogram, as scraped: its sum, its
/// count, and how many observations were at most each of two bounds ([`SLOW`],
/// [`ETCD_SLOW`]: its cumulative buckets of those bounds).
#[derive(Debug, Clone, Copy, Default)]
struct Observed {
    sum: f64,
    count: f64,
    within: [f64; 2],
}

impl Observed {
    /// The observations over each of its two bounds.
    fn slow(&self) -> [f64; 2] {
        self.within.map(|w| self.count - w)
    }
}

/// What the tail of a change is compared with, in seconds: the tighter spaced p99 target's
/// 50 ms and the flips' 100 ms, bucket bounds of every [`BREAKDOWN`] histogram.
const SLOW: [&str; 2] = ["0.05", "0.1"];

/// `counts` over each of `bounds`, for the breakdown's lines: "2 over 50 ms, 1 over 100 ms".
fn over(counts: [f64; 2], bounds: [&str; 2]) -> String {
    let ms = |bound: &str| bound.parse::<f64>().expect("a number") * 1000.0;
    format!("{} over {} ms, {} over {} ms", counts[0], ms(bounds[0]), counts[1], ms(bounds[1]))
}

/// The operator's [`BREAKDOWN`] histograms and etcd's [`ETCD_DISK`] ones (from `etcd`, its
/// client URL), as they are now.
async fn breakdown(op: &Operator, etcd: Option<&str>) -> Breakdown {
    let operator = metrics_text(op).await.map(|text| histograms(&text, &BREAKDOWN, SLOW));
    let etcd = match etcd {
        Some(url) => metrics_page(&format!("{url}/metrics")).await.map(|text| histograms(&text, &ETCD_DISK, ETCD_SLOW)),
        None => None,
    };
    Breakdown { operator, etcd }
}

/// Every series of the histograms `families` in the metrics page `text`, by the series'
/// name and labels, with their buckets of `bounds`.
fn histograms(text: &str, families: &[&str], bounds: [&str; 2]) -> BTreeMap<String, Observed> {
    let mut out: BTreeMap<String, Observed> = BTreeMap::new();
    for line in text.lines() {
        let Some((series, value)) = line.rsplit_once(' ') else { continue };
        let Ok(value) = value.parse::<f64>() else { continue };
        for family in families {
            let Some(rest) = series.strip_prefix(family) else { continue };
            if let Some(labels) = rest.strip_prefix("_sum") {
                out.entry(series_name(family, labels)).or_default().sum = value;
            } else if let Some(labels) = rest.strip_prefix("_count") {
                out.entry(series_name(family, labels)).or_default().count = value;
            } else if let Some(labels) = rest.strip_prefix("_bucket") {
                for (i, bound) in bounds.iter().enumerate() {
                    if let Some(labels) = without_le(labels, bound) {
                        out.entry(series_name(family, &labels)).or_default().within[i] = value;
                    }
                }
            }
        }
    }
    out
}

fn series_name(family: &str, labels: &str) -> String {
    format!("{}{labels}", family.trim_start_matches("consul_resolver_"))
}

/// `labels` without its `le="<le>"`, if it has that one; `None` for any other bucket.
fn without_le(labels: &str, le: &str) -> Option<String> {
    let inner = labels.strip_prefix('{')?.strip_suffix('}')?;
    let wanted = format!("le=\"{le}\"");
    let rest: Vec<&str> = inner.split(',').filter(|l| *l != wanted).collect();
    if rest.len() == inner.split(',').count() {
        return None;
    }
    Some(if rest.is_empty() { String::new() } else { format!("{{{}}}", rest.join(",")) })
}

/// The mean of each histogram series observed between two scrapes, in ms, and how many of
/// its observations were over each of `bounds` (those the scrapes were read with).
fn breakdown_means(
    before: &BTreeMap<String, Observed>,
    after: &BTreeMap<String, Observed>,
    bounds: [&str; 2],
) -> String {
    after
        .iter()
        .filter_map(|(name, a)| {
            let b = before.get(name).copied().unwrap_or_default();
            let n = a.count - b.count;
            (n > 0.0).then(|| {
                let (after, before) = (a.slow(), b.slow());
                let slow = [0, 1].map(|i| after[i] - before[i]);
                format!("{name} {:.1} ms x{n} ({})", (a.sum - b.sum) / n * 1000.0, over(slow, bounds))
            })
        })
        .collect::<Vec<_>>()
        .join("; ")
}

pub(crate) struct Latencies(pub(crate) Vec<Duration>);

impl Latencies {
    pub(crate) fn summary(&self) -> String {
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

    pub(crate) fn percentile(&self, p: f64) -> Duration {
        let mut v = self.0.clone();
        v.sort();
        percentile(&v, p)
    }
}

/// The service the `i`th change or flip of a series at `offset` changes: strided by a
/// prime, so a series spreads over the services.
fn picked_service(s: &Settings, i: usize, offset: usize) -> String {
    service_name((i * 7919 + offset) % s.services)
}

/// `node`'s `serfHealth` check set to `status`.
async fn set_node_check(http: &reqwest::Client, base: &str, node: &str, status: &str) -> anyhow::Result<()> {
    let body = json!({"Node": node, "Address": "127.0.0.1",
        "Check": {"CheckID": "serfHealth", "Name": "Serf Health Status", "Status": status}});
    let r = http.put(format!("{base}/v1/catalog/register")).json(&body).send().await?;
    ensure!(r.status().is_success(), "node check of {node}: {}", r.status());
    Ok(())
}

/// Where a change begins in the simulator's request log: the service it changes, and the
/// latest request before its write.
#[derive(Debug, Clone)]
pub(crate) struct Mark {
    service: String,
    seq: u64,
}

/// The Consul requests of a series, split: those its changes caused, and the background.
/// A change caused every request of its own service from its write until the change after
/// next begins (so a re-read that lands after the ConfigMap showed the change, a second
/// scope's say, still counts), and the series caused every request that names no service
/// (the change feed's queries, the locate step's). The background is every other request:
/// of services no change touched, and of changed services outside their changes. Those are
/// the sweep (each fed service once per `--consul-sweep`, spread over it: about 16 a second
/// at 4,900 fed services and 5 minutes, 33 at 9,900) and dedicated blocking queries timing
/// out; or a wake-up of every fed service, which a rate well above the sweep's would show.
/// Counting a changed service's every request as the change's would count its sweeps too:
/// about one more request per change at 10,000 services over a 300-second series.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SeriesRequests {
    caused: u64,
    /// Of services no change of the series touched.
    others: u64,
    /// Of changed services, outside their changes.
    changed_elsewhere: u64,
    over: Duration,
}

impl SeriesRequests {
    /// The requests the changes caused, per change.
    pub(crate) fn per_change(&self, changes: usize) -> f64 {
        self.caused as f64 / changes.max(1) as f64
    }

    pub(crate) fn summary(&self, changes: usize) -> String {
        let background = self.others + self.changed_elsewhere;
        format!(
            "{:.1}; {} of other services and {} of changed services outside their changes in {:.0} s ({:.1}/s)",
            self.per_change(changes),
            self.others,
            self.changed_elsewhere,
            self.over.as_secs_f64(),
            background as f64 / self.over.as_secs_f64().max(1e-3)
        )
    }
}

/// Splits `requests` (a series' and after, in `seq` order) by the series' `marks` (in
/// order): see [`SeriesRequests`].
fn series_requests(requests: &[RequestRecord], marks: &[Mark], over: Duration) -> SeriesRequests {
    let mut r = SeriesRequests { over, ..SeriesRequests::default() };
    let Some(first) = marks.first() else { return r };
    let changed: HashSet<&str> = marks.iter().map(|m| m.service.as_str()).collect();
    for req in requests.iter().filter(|q| q.seq > first.seq) {
        let Some(name) = req.service.as_deref() else {
            r.caused += 1;
            continue;
        };
        // The change whose write came last before this request, and the one before it.
        let at = marks.partition_point(|m| m.seq < req.seq) - 1;
        let own = marks[at.saturating_sub(1)..=at].iter().any(|m| m.service == name);
        match (own, changed.contains(name)) {
            (true, _) => r.caused += 1,
            (false, true) => r.changed_elsewhere += 1,
            (false, false) => r.others += 1,
        }
    }
    r
}

/// For each change from `marks`, how long after its write (as the simulator logged it)
/// the change feed's checks query that waited at that moment was answered, its gzip not
/// included: the stand-in's share of a fed change's way to the ConfigMap. Changes no
/// waiting checks query saw are left out.
fn checks_answers(requests: &[RequestRecord], marks: &[Mark]) -> Latencies {
    let is_write = |q: &RequestRecord| q.method == "PUT" && q.path == "/v1/catalog/register";
    let checks: Vec<(u64, u64)> = requests
        .iter()
        .filter(|q| q.path == "/v1/health/state/any" && q.status == Some(200))
        .filter_map(|q| Some((q.at_ms, q.at_ms + q.duration_ms?)))
        .collect();
    let answers = marks.iter().filter_map(|m| {
        let after = requests.partition_point(|q| q.seq <= m.seq);
        let write = requests[after..].iter().find(|q| is_write(q))?;
        let answered = checks.iter().filter(|(sent, done)| *sent <= write.at_ms && *done >= write.at_ms);
        answered.map(|(_, done)| Duration::from_millis(done - write.at_ms)).min()
    });
    Latencies(answers.collect())
}

/// The port changes' figures: both series, the operator's CPU per change of each, and the
/// Consul requests of both.
struct PortChanges {
    spaced: Latencies,
    back_to_back: Latencies,
    cpu_spaced: Duration,
    cpu_back_to_back: Duration,
    change_requests: SeriesRequests,
}

/// What makes the changes and watches them reach the ConfigMap.
struct Driver<'a> {
    http: reqwest::Client,
    /// The simulator's base URL.
    base: &'a str,
    sim: &'a RunningSim,
    /// Where each change of the current series began in the simulator's request log.
    marks: Vec<Mark>,
    rx: mpsc::UnboundedReceiver<Seen>,
    s: &'a Settings,
    /// The operator's.
    pid: u32,
    /// etcd's client URL, for its disk histograms ([`ETCD_DISK`]); `None` on a cluster not
    /// our own.
    etcd: Option<String>,
    /// With `BENCH_XDS=1`: the spaced changes are timed to Envoy's ACK too, into `samples`
    /// until the series closes into `series`.
    xds: Option<Probe>,
    poll_cost: Option<PollCost>,
    samples: Vec<xds::Sample>,
    series: Vec<xds::Series>,
}

impl Driver<'_> {
    /// The operator's histograms and etcd's, as they are now ([`breakdown`]).
    fn breakdown(&self, rt: &Runtime, op: &Operator) -> Breakdown {
        rt.block_on(breakdown(op, self.etcd.as_deref()))
    }

    /// The spaced series, then the back-to-back one, each with the operator's CPU per
    /// change; then the Consul requests of both.
    fn port_changes(&mut self, rt: &Runtime, op: &Operator) -> anyhow::Result<PortChanges> {
        let (s, pid) = (self.s, self.pid);
        self.marks.clear();
        let changes_started = Instant::now();
        // CPU per change: the operator's whole CPU time over a series (the quiet windows of
        // the spaced one included: work a change leaves for after its publication counts
        // too), divided by the changes. Clock ticks, so 10 ms steps over the series at
        // USER_HZ 100.
        let cpu_before = cpu_time(pid)?;
        let breakdown_before = self.breakdown(rt, op);
        let spaced = rt.block_on(self.changes(20_000, 0, true))?;
        let cpu_spaced = (cpu_time(pid)? - cpu_before) / s.changes as u32;
        println!("  spaced changes: {}; operator CPU per change {}", spaced.summary(), cpu_ms(cpu_spaced));
        let answers = checks_answers(&self.sim.requests(), &self.marks);
        if !answers.0.is_empty() {
            println!(
                "  spaced changes: the simulator's checks answer after the write (not gzipped yet): {}",
                answers.summary()
            );
        }
        self.close_series("spaced port changes");
        print_breakdown("spaced changes", &spaced, breakdown_before, self.breakdown(rt, op));
        let cpu_before = cpu_time(pid)?;
        let back_to_back = rt.block_on(self.changes(20_000 + s.changes as u16, 13, false))?;
        let cpu_back_to_back = (cpu_time(pid)? - cpu_before) / s.changes as u32;
        println!(
            "  back-to-back changes: {}; operator CPU per change {}",
            back_to_back.summary(),
            cpu_ms(cpu_back_to_back)
        );
        let change_requests = self.series_requests(changes_started.elapsed());
        println!("  Consul requests during the changes: {}", change_requests.summary(2 * s.changes));
        Ok(PortChanges { spaced, back_to_back, cpu_spaced, cpu_back_to_back, change_requests })
    }

    /// Moves one instance of one service to a new port per step and times each until the
    /// ConfigMap holds it.
    /// `spaced`: wait a quiet window after each, so each change is a leading edge. The
    /// operator's VmRSS is printed every 50 changes (does memory level off?).
    async fn changes(&mut self, port_base: u16, offset: usize, spaced: bool) -> anyhow::Result<Latencies> {
        let s = self.s;
        let mut out = Vec::with_capacity(s.changes);
        let mut rss = Vec::new();
        for i in 0..s.changes {
            let svc = picked_service(s, i, offset);
            let node = node_name((i + offset) % s.instances);
            let port = port_base + i as u16;
            let http = self.http.clone();
            self.mark(&svc);
            let write = register(&http, self.base, &svc, &node, port);
            let what = || format!("change {i} ({svc} on {node} -> port {port})");
            out.push(self.one_change(write, spaced, what, |p| p.has(&svc, s.instances, &node, port)).await?);
            if (i + 1) % 50 == 0 {
                rss.push(format!("{}: {} MiB", i + 1, memory_kib(self.pid)?.1 / 1024));
            }
        }
        println!("  operator VmRSS after n changes: {}", rss.join(", "));
        Ok(Latencies(out))
    }

    /// The health flips and the Consul requests they caused.
    async fn health_flip_series(&mut self) -> anyhow::Result<(Latencies, SeriesRequests)> {
        self.marks.clear();
        let flips_started = Instant::now();
        let flips = self.health_flips(29).await?;
        self.close_series("health flips");
        let flip_requests = self.series_requests(flips_started.elapsed());
        println!("  health flips: {}; Consul requests: {}", flips.summary(), flip_requests.summary(flips.0.len()));
        Ok((flips, flip_requests))
    }

    /// Health flips, spaced: one instance's check goes critical (the resolvers publish
    /// passing instances only, so it leaves the snapshot), then passing again (it comes
    /// back), each timed until the ConfigMap shows it. Fed services included: at the
    /// default budget most services have no blocking query of their own.
    async fn health_flips(&mut self, offset: usize) -> anyhow::Result<Latencies> {
        let s = self.s;
        let mut out = Vec::with_capacity(2 * s.changes);
        for i in 0..s.changes {
            let svc = picked_service(s, i, offset);
            let node = node_name((i + offset) % s.instances);
            for (status, present) in [("critical", false), ("passing", true)] {
                let http = self.http.clone();
                self.mark(&svc);
                let write = set_check(&http, self.base, &svc, &node, status);
                let what = || format!("flip {i} ({svc} on {node} -> {status})");
                out.push(self.one_change(write, true, what, |p| p.node_is(&svc, &node, present)).await?);
            }
        }
        Ok(Latencies(out))
    }

    /// Node check flips, spaced: a service gets an instance on a node of its own (untimed),
    /// then that node's `serfHealth` goes critical (the instance leaves the snapshot: the
    /// resolvers publish passing instances only) and passing again (it must come back: a
    /// fed watch hears of the node because it asked about it, not because its last,
    /// filtered, answer showed it), each timed until the ConfigMap shows it.
    async fn node_flips(&mut self, offset: usize) -> anyhow::Result<Latencies> {
        let s = self.s;
        let mut out = Vec::with_capacity(2 * s.node_flips);
        for i in 0..s.node_flips {
            let svc = picked_service(s, i, offset);
            let node = format!("edge-{svc}");
            self.drain();
            register(&self.http, self.base, &svc, &node, 30_000 + (i % 30_000) as u16).await?;
            self.until_configmap(Instant::now(), || format!("{svc} on {node}"), |p| p.node_is(&svc, &node, true))
                .await?;
            self.quiet().await;
            for (status, present) in [("critical", false), ("passing", true)] {
                let http = self.http.clone();
                let write = set_node_check(&http, self.base, &node, status);
                let what = || format!("node flip {i} ({node} -> {status})");
                out.push(self.one_change(write, true, what, |p| p.node_is(&svc, &node, present)).await?);
            }
        }
        Ok(Latencies(out))
    }

    /// One change: `write` (a Consul write), timed from before it until the ConfigMap
    /// `shows` it; `spaced`: then a quiet window. With `BENCH_XDS=1` a spaced change is also
    /// timed from the write's HTTP 200 until Envoy ACKed the EDS response carrying it, with
    /// the xDS bytes and the operator's CPU to the window's end (`xds.rs`).
    async fn one_change(
        &mut self,
        write: impl Future<Output = anyhow::Result<()>>,
        spaced: bool,
        what: impl Fn() -> String,
        shows: impl Fn(&Ports) -> bool,
    ) -> anyhow::Result<Duration> {
        self.drain();
        let probe = self.xds.clone().filter(|_| spaced);
        let mark = match &probe {
            Some(p) => Some(p.mark().await?),
            None => None,
        };
        let t0 = Instant::now();
        write.await?;
        let written = Instant::now();
        let shown = self.until_configmap(t0, what, shows);
        let (shown, acked) = match (&probe, &mark) {
            (Some(p), Some(m)) => {
                let (shown, acked) = tokio::join!(shown, p.until_acked(m, written));
                (shown?, Some(acked?))
            }
            _ => (shown.await?, None),
        };
        if spaced {
            self.quiet().await;
        }
        if let (Some(p), Some(m), Some(acked)) = (probe, mark, acked) {
            self.samples.push(p.sample(m, acked).await?);
        }
        Ok(shown)
    }

    /// Marks where a change of `service` begins in the simulator's request log.
    fn mark(&mut self, service: &str) {
        self.marks.push(Mark { service: service.to_owned(), seq: self.sim.last_request_seq() });
    }

    /// The Consul requests of the series just made, which lasted `over`.
    fn series_requests(&self, over: Duration) -> SeriesRequests {
        series_requests(&self.sim.requests(), &self.marks, over)
    }

    /// Ends a series over xDS (nothing without `BENCH_XDS=1`).
    fn close_series(&mut self, name: &'static str) {
        if self.xds.is_some() {
            let series = xds::Series { name, samples: std::mem::take(&mut self.samples) };
            println!("  over xDS, {}", series.summary(self.poll_cost));
            self.series.push(series);
        }
    }

    /// Drops the ConfigMap versions seen so far, so the next one awaited follows the change.
    fn drain(&mut self) {
        while self.rx.try_recv().is_ok() {}
    }

    /// A quiet coalescing window, so the next change is a leading edge.
    async fn quiet(&self) {
        tokio::time::sleep(self.s.window() + Duration::from_millis(50)).await;
    }

    /// How long after `t0` the ConfigMap first satisfied `shows`; an error after
    /// `CHANGE_LIMIT` naming `what`.
    async fn until_configmap(
        &mut self,
        t0: Instant,
        what: impl Fn() -> String,
        shows: impl Fn(&Ports) -> bool,
    ) -> anyhow::Result<Duration> {
        loop {
            let left = CHANGE_LIMIT.saturating_sub(t0.elapsed());
            match tokio::time::timeout(left, self.rx.recv()).await {
                Err(_) => bail!("{} not in the ConfigMap after {CHANGE_LIMIT:?}", what()),
                Ok(None) => bail!("the ConfigMap watch ended"),
                Ok(Some((_, Err(e)))) => eprintln!("  ConfigMap not decodable (retrying): {e:#}"),
                Ok(Some((at, Ok(p)))) if shows(&p) => return Ok(at.duration_since(t0)),
                Ok(Some(_)) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slow_bucket_is_found_by_its_bound_and_the_rest_of_its_labels() {
        assert_eq!(
            without_le(r#"{publisher="configmap",le="0.1"}"#, "0.1").as_deref(),
            Some(r#"{publisher="configmap"}"#)
        );
        assert_eq!(without_le(r#"{le="0.1"}"#, "0.1").as_deref(), Some(""));
        assert_eq!(without_le(r#"{le="0.25"}"#, "0.1"), None);
        let o = Observed { sum: 3.0, count: 10.0, within: [5.0, 7.0] };
        assert_eq!(o.slow(), [5.0, 3.0]);
        assert_eq!(over(o.slow(), SLOW), "5 over 50 ms, 3 over 100 ms");
    }

    /// etcd's disk histograms are read at their own bounds, which double from 1 ms.
    #[test]
    fn etcds_fsyncs_are_counted_over_its_own_bucket_bounds() {
        let page = "# TYPE etcd_disk_wal_fsync_duration_seconds histogram\n\
            etcd_disk_wal_fsync_duration_seconds_bucket{le=\"0.016\"} 90\n\
            etcd_disk_wal_fsync_duration_seconds_bucket{le=\"0.032\"} 95\n\
            etcd_disk_wal_fsync_duration_seconds_bucket{le=\"0.064\"} 98\n\
            etcd_disk_wal_fsync_duration_seconds_bucket{le=\"+Inf\"} 100\n\
            etcd_disk_wal_fsync_duration_seconds_sum 0.5\n\
            etcd_disk_wal_fsync_duration_seconds_count 100\n\
            etcd_disk_backend_commit_duration_seconds_count 7\n";
        let after = histograms(page, &ETCD_DISK, ETCD_SLOW);
        let before = BTreeMap::new();
        let means = breakdown_means(&before, &after, ETCD_SLOW);
        assert!(
            means.contains("etcd_disk_wal_fsync_duration_seconds 5.0 ms x100 (5 over 32 ms, 2 over 64 ms)"),
            "{means}"
        );
    }

    fn request(seq: u64, service: Option<&str>) -> RequestRecord {
        RequestRecord {
            seq,
            at_ms: seq,
            peer: "127.0.0.1:1".into(),
            method: "GET".into(),
            path: service.map_or("/v1/health/state/any".into(), |s| format!("/v1/health/service/{s}")),
            query: String::new(),
            service: service.map(str::to_owned),
            namespace: None,
            partition: None,
            token: None,
            token_source: None,
            wait_ms: None,
            timeout_ms: None,
            outcome: consul_sim::Outcome::Answered,
            status: Some(200),
            index: Some(seq),
            duration_ms: Some(1),
        }
    }

    fn mark(service: &str, seq: u64) -> Mark {
        Mark { service: service.into(), seq }
    }

    #[test]
    fn a_change_causes_its_own_services_requests_and_the_feeds_not_its_sweeps() {
        let marks = [mark("a", 10), mark("b", 20), mark("c", 30), mark("d", 40)];
        let requests = [
            // Before the series: not counted at all.
            request(5, Some("a")),
            // a's change: the feed's answer and a's re-read; an unrelated sweep.
            request(11, None),
            request(12, Some("a")),
            request(13, Some("x")),
            // b's change: a's second re-read, late, still a's; b's own.
            request(21, Some("a")),
            request(22, Some("b")),
            // d's change: a swept, long after its change; b too.
            request(41, Some("a")),
            request(42, Some("b")),
            request(43, Some("d")),
        ];
        let r = series_requests(&requests, &marks, Duration::from_secs(1));
        assert_eq!((r.caused, r.others, r.changed_elsewhere), (5, 1, 2));
        assert_eq!(r.per_change(4), 1.25);
        // Counting every request of a changed service as caused would give 7.
        assert!(r.summary(4).starts_with("1.2; 1 of other services and 2 of changed services"));
    }

    #[test]
    fn a_checks_answer_is_timed_from_the_write_it_was_waiting_for() {
        let at = |seq, at_ms, path: &str, method: &str, duration_ms| RequestRecord {
            at_ms,
            path: path.into(),
            method: method.into(),
            duration_ms: Some(duration_ms),
            ..request(seq, None)
        };
        let requests = [
            // A checks query answered before the write; the one waiting at the write.
            at(1, 0, "/v1/health/state/any", "GET", 50),
            at(2, 50, "/v1/health/state/any", "GET", 300),
            at(3, 100, "/v1/health/service/a", "GET", 1),
            at(4, 200, "/v1/catalog/register", "PUT", 1),
            // A later change nothing waited for.
            at(5, 400, "/v1/catalog/register", "PUT", 1),
        ];
        let answers = checks_answers(&requests, &[mark("a", 2), mark("b", 4)]);
        assert_eq!(answers.0, [Duration::from_millis(150)]);
    }

    #[test]
    fn a_series_without_changes_causes_nothing() {
        let r = series_requests(&[request(1, None), request(2, Some("a"))], &[], Duration::from_secs(1));
        assert_eq!((r.caused, r.others, r.changed_elsewhere), (0, 0, 0));
    }
}
