//! What a snapshot ConfigMap write costs the API server: the operator's way (an update
//! conditional on the version last seen, its body in protobuf) against the same update in
//! JSON and a server-side apply of the same object.
//! A benchmark, not part of `make test` (docs/benchmarks.md, "A snapshot ConfigMap's write"):
//!
//!     cargo test --release -p e2e --test configmap_writes -- --ignored --nocapture

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use consul_resolver_operator::snapshot_configmap::replace_protobuf;
use e2e::harness::{Cluster, unique};
use e2e::procfs::cpu_time;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};

const NAMESPACE: &str = "consul-resolver-system";
/// The default profile's gzipped snapshot is 137 to 139 KB: random bytes, as incompressible.
const SIZE: usize = 137_000;
const ROUNDS: usize = 15;
const WRITES_PER_ROUND: usize = 20;

#[derive(Clone, Copy, Debug)]
enum Way {
    /// The operator's: an update, the body in protobuf.
    Protobuf,
    /// The same update in JSON (kube's `Api::replace`).
    Update,
    Apply,
}

const WAYS: [Way; 3] = [Way::Protobuf, Way::Update, Way::Apply];

#[test]
#[ignore = "a benchmark: cargo test --release -p e2e --test configmap_writes -- --ignored --nocapture"]
fn bench_an_update_in_protobuf_against_one_in_json_and_a_server_side_apply() {
    let cluster = Cluster::shared();
    let pid = cluster.apiserver_pid().expect("our own control plane: its kube-apiserver's pid") as u32;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(run(cluster, pid)).unwrap();
}

async fn run(cluster: &Cluster, apiserver: u32) -> anyhow::Result<()> {
    let _ = e2e::harness::http_client(); // installs the TLS provider
    let kc = kube::config::Kubeconfig::read_from(&cluster.admin_kubeconfig)?;
    let config = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default()).await?;
    let api = Api::<ConfigMap>::namespaced(kube::Client::try_from(config)?, NAMESPACE);
    let load_start = std::fs::read_to_string("/proc/loadavg")?;
    let mut writers = Vec::new();
    for way in WAYS {
        writers.push(Writer::create(&api, way).await?);
    }
    // A round each way first, not counted: the API server's first writes of an object
    // cost more.
    for writer in &mut writers {
        writer.round(&api, apiserver).await?;
    }
    // (latency p50, API server CPU per write) of each way, round by round.
    let mut rounds: Vec<[(Duration, Duration); WAYS.len()]> = Vec::new();
    for r in 0..ROUNDS {
        let mut round = [(Duration::ZERO, Duration::ZERO); WAYS.len()];
        // Each way as often early in a round as late.
        let mut order: Vec<usize> = (0..WAYS.len()).collect();
        order.rotate_left(r % WAYS.len());
        for i in order {
            round[i] = writers[i].round(&api, apiserver).await?;
        }
        let each = WAYS.iter().zip(&round);
        let shown: Vec<String> = each
            .map(|(w, (p50, cpu))| format!("{w:?} p50 {:.1} ms, {:.1} ms CPU a write", ms(*p50), ms(*cpu)))
            .collect();
        println!("round: {}", shown.join("; "));
        rounds.push(round);
    }
    // The operator's way against way `i`, round by round.
    let ratios = |i: usize, f: fn(&(Duration, Duration)) -> Duration| {
        let mut r: Vec<f64> = rounds.iter().map(|w| f(&w[0]).as_secs_f64() / f(&w[i]).as_secs_f64()).collect();
        r.sort_by(f64::total_cmp);
        format!("{:.2} / {:.2} / {:.2}x", r[0], r[r.len() / 2], r[r.len() - 1])
    };
    println!(
        "{ROUNDS} rounds of {WRITES_PER_ROUND} writes of {SIZE} bytes each way; load average {} at start, {} at end",
        load_start.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
        std::fs::read_to_string("/proc/loadavg")?.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );
    let median = |i: usize, f: fn(&(Duration, Duration)) -> Duration| {
        let mut v: Vec<Duration> = rounds.iter().map(|r| f(&r[i])).collect();
        v.sort();
        ms(v[v.len() / 2])
    };
    for (i, way) in WAYS.iter().enumerate() {
        println!(
            "median over rounds, {way:?}: p50 {:.1} ms, {:.1} ms CPU a write",
            median(i, |r| r.0),
            median(i, |r| r.1)
        );
    }
    for (i, way) in WAYS.iter().enumerate().skip(1) {
        println!("Protobuf / {way:?}, min / median / max over rounds: latency p50 {}", ratios(i, |r| r.0));
        println!("Protobuf / {way:?}, min / median / max over rounds: API server CPU a write {}", ratios(i, |r| r.1));
    }
    for writer in writers {
        api.delete(&writer.name, &Default::default()).await?;
    }
    Ok(())
}

/// One ConfigMap written one way, as the operator writes its snapshot: labels, an
/// annotation, one binaryData key, every write conditional on the version it last wrote.
struct Writer {
    way: Way,
    name: String,
    resource_version: String,
}

impl Writer {
    async fn create(api: &Api<ConfigMap>, way: Way) -> anyhow::Result<Writer> {
        let name = format!("bench-{way:?}-{}", unique()).to_lowercase();
        let created = api.create(&PostParams::default(), &configmap(&name, None)).await?;
        let resource_version = created.metadata.resource_version.context("created without a resourceVersion")?;
        Ok(Writer { way, name, resource_version })
    }

    /// [`WRITES_PER_ROUND`] writes: their median latency and the API server's CPU a write.
    async fn round(&mut self, api: &Api<ConfigMap>, apiserver: u32) -> anyhow::Result<(Duration, Duration)> {
        let mut latencies = Vec::with_capacity(WRITES_PER_ROUND);
        let cpu_before = cpu_time(apiserver)?;
        for _ in 0..WRITES_PER_ROUND {
            let cm = configmap(&self.name, Some(self.resource_version.clone()));
            let started = Instant::now();
            let written = match self.way {
                Way::Protobuf => replace_protobuf(api, &self.name, &PostParams::default(), &cm).await?,
                Way::Update => api.replace(&self.name, &PostParams::default(), &cm).await?,
                Way::Apply => {
                    let params = PatchParams::apply("bench").force();
                    api.patch(&self.name, &params, &Patch::Apply(&cm)).await?
                }
            };
            latencies.push(started.elapsed());
            self.resource_version = written.metadata.resource_version.context("written without a resourceVersion")?;
        }
        let cpu = (cpu_time(apiserver)? - cpu_before) / WRITES_PER_ROUND as u32;
        latencies.sort();
        Ok((latencies[latencies.len() / 2], cpu))
    }
}

fn configmap(name: &str, resource_version: Option<String>) -> ConfigMap {
    let bytes: Vec<u8> = (0..SIZE).map(|_| rand::random::<u8>()).collect();
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(NAMESPACE.to_owned()),
            labels: Some(BTreeMap::from([("app.kubernetes.io/managed-by".to_owned(), "bench".to_owned())])),
            annotations: Some(BTreeMap::from([("consulresolver.io/snapshot-id".to_owned(), "1".to_owned())])),
            resource_version,
            ..ObjectMeta::default()
        },
        binary_data: Some(BTreeMap::from([("snapshot.json.gz".to_owned(), ByteString(bytes))])),
        ..ConfigMap::default()
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
