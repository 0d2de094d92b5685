//! The world the operator is measured on, made before it starts (its making is not a
//! measure): the Consul services in a simulator, one ConsulResolver per namespace, the
//! Mappings and the Kubernetes Services they route to; and where the processes run.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use consul_sim::{Config as SimConfig, RunningSim, Simulator, TlsConfig};
use e2e::bench::env_usize;
use e2e::harness::Cluster;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Endpoints, Secret};
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::json;
use tokio::runtime::Runtime;

use crate::profile::Settings;
use crate::report::secs;

/// The operator's identity in the test cluster (e2e/cluster.sh, manifests/rbac.yaml).
pub(crate) const OPERATOR_USER: &str = "system:serviceaccount:consul-resolver-system:consul-resolver-operator";
pub(crate) const OPERATOR_NS: &str = "consul-resolver-system";

pub(crate) struct Setup {
    pub(crate) namespaces: Vec<String>,
    pub(crate) sim_addr: SocketAddr,
    pub(crate) base_url: String,
    pub(crate) mappings_created_in: Duration,
    /// Where the audit log ended once the objects were created.
    pub(crate) audit_offset: u64,
}

pub(crate) fn service_name(i: usize) -> String {
    format!("svc-{i:04}")
}

/// The node of every service's instance `k`: a few nodes each holding every service, as
/// Consul agents do. Instance 0 is on `bench` whatever the number of instances, so that
/// one-instance worlds stay comparable with the figures in docs/benchmarks.md.
pub(crate) fn node_name(k: usize) -> String {
    if k == 0 { "bench".into() } else { format!("bench-{k}") }
}

/// The port instance `k` of service `i` is registered on: 10000-19999, distinct within a
/// service (10000 + i with one instance). Changes move instances to 20000 and up, so every
/// change is a real catalog change.
pub(crate) fn registered_port(s: &Settings, i: usize, k: usize) -> u16 {
    (10_000 + (i * s.instances + k) % 10_000) as u16
}

pub(crate) async fn kube_client(kubeconfig: &Path) -> anyhow::Result<kube::Client> {
    let kc = Kubeconfig::read_from(kubeconfig).with_context(|| format!("reading {}", kubeconfig.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(kube::Client::try_from(config)?)
}

pub(crate) fn mapping_resource() -> ApiResource {
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
pub(crate) async fn register(
    http: &reqwest::Client,
    base: &str,
    name: &str,
    node: &str,
    port: u16,
) -> anyhow::Result<()> {
    let body = json!({"Node": node, "Address": "127.0.0.1",
        "Service": {"ID": name, "Service": name, "Address": "127.0.0.1", "Port": port},
        "Check": {"CheckID": format!("service:{name}"), "Name": "c", "Status": "passing", "ServiceID": name}});
    let r = http.put(format!("{base}/v1/catalog/register")).json(&body).send().await?;
    ensure!(r.status().is_success(), "register {name} on {node}: {}", r.status());
    Ok(())
}

/// A health flip: the check of service `name`'s instance on `node` set to `status`, the
/// service itself left alone (what an agent writes when a check changes).
pub(crate) async fn set_check(
    http: &reqwest::Client,
    base: &str,
    name: &str,
    node: &str,
    status: &str,
) -> anyhow::Result<()> {
    let body = json!({"Node": node, "Address": "127.0.0.1",
        "Check": {"CheckID": format!("service:{name}"), "Name": "c", "Status": status, "ServiceID": name}});
    let r = http.put(format!("{base}/v1/catalog/register")).json(&body).send().await?;
    ensure!(r.status().is_success(), "check of {name} on {node}: {}", r.status());
    Ok(())
}

/// An empty simulator on `listen`: over HTTPS (HTTP/2 by ALPN) with `BENCH_CONSUL_TLS=1`.
pub(crate) fn start_sim(listen: SocketAddr, s: &Settings) -> anyhow::Result<RunningSim> {
    let tls = s.consul_tls.as_ref().map(|pki| TlsConfig::new(&pki.server_cert_pem, &pki.server_key_pem));
    Ok(Simulator::start_background(SimConfig {
        listen,
        // Room for a dedicated connection per service (real Consul: limits.http_max_conns_per_client).
        max_conns_per_client: 5000,
        request_log_capacity: 200_000,
        tls,
        ..SimConfig::default()
    })?)
}

/// An empty simulator on a free loopback port: until an operator run registers the
/// services in a fresh one, only its address is used.
pub(crate) fn placeholder_sim(s: &Settings) -> anyhow::Result<RunningSim> {
    start_sim(SocketAddr::from(([127, 0, 0, 1], 0)), s)
}

/// The bench's own client of the simulator (its writes), trusting its CA over HTTPS.
pub(crate) fn consul_http(s: &Settings, timeout: Option<Duration>) -> anyhow::Result<reqwest::Client> {
    let mut http = reqwest::Client::builder().no_proxy();
    if let Some(pki) = &s.consul_tls {
        http = http.add_root_certificate(reqwest::Certificate::from_pem(pki.ca_cert_pem.as_bytes())?);
    }
    if let Some(timeout) = timeout {
        http = http.timeout(timeout);
    }
    Ok(http.build()?)
}

/// A simulator on `listen` holding the benchmark's services, `s.instances` each (see
/// `node_name`, `registered_port`). Each operator run gets a fresh one on the same address,
/// so no connection, blocking query or counter of an earlier run is left in its figures.
pub(crate) fn fresh_sim(rt: &Runtime, listen: SocketAddr, s: &Settings) -> anyhow::Result<RunningSim> {
    let sim = start_sim(listen, s)?;
    let base = sim.base_url();
    let started = Instant::now();
    rt.block_on(async {
        let http = consul_http(s, None)?;
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

/// `s.namespaces` fresh namespaces named from `prefix`.
pub(crate) fn namespaces(cluster: &Cluster, s: &Settings, prefix: &str) -> anyhow::Result<Vec<String>> {
    (0..s.namespaces).map(|_| cluster.namespace(prefix)).collect()
}

/// Resolvers and Mappings, created before any operator runs.
pub(crate) async fn setup(
    cluster: &Cluster,
    sim: &RunningSim,
    s: &Settings,
    namespaces: Vec<String>,
) -> anyhow::Result<Setup> {
    let client = kube_client(&cluster.admin_kubeconfig).await?;
    create_resolvers(cluster, &client, &sim.base_url(), s, &namespaces).await?;
    let started = Instant::now();
    create_mappings(&client, s, &namespaces).await?;
    create_kube_services(&client, s, &namespaces).await?;
    let mappings_created_in = started.elapsed();
    let audit_offset = cluster.audit_log().and_then(|p| std::fs::metadata(p).ok()).map_or(0, |m| m.len());
    Ok(Setup { namespaces, sim_addr: sim.addr(), base_url: sim.base_url(), mappings_created_in, audit_offset })
}

/// One ConsulResolver per namespace, pointing at the simulator at `base`; with
/// `BENCH_SCOPES` > 1, those of every other namespace name a token; with
/// `BENCH_CONSUL_TLS=1`, every one trusts the simulator's CA.
async fn create_resolvers(
    cluster: &Cluster,
    client: &kube::Client,
    base: &str,
    s: &Settings,
    namespaces: &[String],
) -> anyhow::Result<()> {
    let rr = resolver_resource();
    for (j, ns) in namespaces.iter().enumerate() {
        let mut r = DynamicObject::new("consul", &rr).within(ns);
        // Plain HTTP as `host:port`, as users write it; HTTPS needs its scheme.
        let address = if s.consul_tls.is_some() { base } else { base.trim_start_matches("http://") };
        r.data = json!({"spec": {"address": address}});
        let token = j % s.scopes != 0;
        if token || s.consul_tls.is_some() {
            // As manifests/rbac.yaml documents: Secrets are readable where a RoleBinding says.
            cluster.grant_secrets(ns)?;
        }
        let secrets = Api::<Secret>::namespaced(client.clone(), ns);
        // Another scope: a token (the simulator runs without ACLs: any token reads all).
        if token {
            let secret: Secret = serde_json::from_value(json!({
                "metadata": {"name": "consul-token", "namespace": ns},
                "stringData": {"token": format!("team-{}", j % s.scopes)},
            }))?;
            secrets.create(&PostParams::default(), &secret).await?;
            r.data["spec"]["tokenSecretRef"] = json!({"name": "consul-token", "key": "token"});
        }
        if let Some(pki) = &s.consul_tls {
            let secret: Secret = serde_json::from_value(json!({
                "metadata": {"name": "consul-ca", "namespace": ns},
                "stringData": {"ca.crt": pki.ca_cert_pem},
            }))?;
            secrets.create(&PostParams::default(), &secret).await?;
            r.data["spec"]["tls"] = json!({"caSecretRef": {"name": "consul-ca", "key": "ca.crt"}});
        }
        Api::<DynamicObject>::namespaced_with(client.clone(), ns, &rr).create(&PostParams::default(), &r).await?;
    }
    Ok(())
}

/// `s.per_service` Mappings per Consul service, spread so that every namespace references
/// every service.
async fn create_mappings(client: &kube::Client, s: &Settings, namespaces: &[String]) -> anyhow::Result<()> {
    let mr = mapping_resource();
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
        .await
}

/// Kubernetes Services routed to: their Endpoints (what a 1.20 API server serves; the
/// addresses are data in the benchmarking range 198.18.0.0/15, never connected to) and a
/// Mapping each.
async fn create_kube_services(client: &kube::Client, s: &Settings, namespaces: &[String]) -> anyhow::Result<()> {
    let mr = mapping_resource();
    futures::stream::iter(0..s.kube_services)
        .map(|i| {
            let ns = namespaces[i % namespaces.len()].clone();
            let name = format!("kube-svc-{i}");
            let endpoints = kube_service_endpoints(&ns, &name, i);
            let mut mapping = DynamicObject::new(&format!("{name}-m"), &mr).within(&ns);
            mapping.data = json!({"spec": {"prefix": format!("/{name}/"), "service": format!("{name}:8080")}});
            let (client, mr) = (client.clone(), mr.clone());
            async move {
                Api::<Endpoints>::namespaced(client.clone(), &ns)
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
        .await
}

/// The Endpoints of Kubernetes Service `i`: three addresses of its own.
fn kube_service_endpoints(ns: &str, name: &str, i: usize) -> Endpoints {
    // 198.18.0.0/15 holds 2 x 256 x 250 of these: 40,000 Services x 3 fit.
    let ip = |n: usize| format!("198.{}.{}.{}", 18 + n / (256 * 250), (n / 250) % 256, n % 250 + 1);
    let addresses: Vec<serde_json::Value> = (0..3).map(|a| json!({"ip": ip(i * 3 + a)})).collect();
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": ns},
        "subsets": [{"addresses": addresses, "ports": [{"port": 8080}]}],
    }))
    .expect("an Endpoints object")
}

/// Where the control plane we start keeps its state (etcd's data, the API server's audit
/// log): in `TMPDIR`, which the cluster's directory is made in; with
/// `BENCH_ETCD_IN_MEMORY=1` (and `TMPDIR` unset) in `/dev/shm`, tmpfs. etcd answers a write
/// once its log is synced to disk, so a disk that stalls its syncs stalls every ConfigMap
/// write; in memory a series shows what is left without them (docs/benchmarks.md, "etcd's
/// disk does not decide the tails either"). Called before anything starts a thread;
/// returns where, for the report.
pub(crate) fn control_plane_storage() -> anyhow::Result<String> {
    let shm = Path::new("/dev/shm");
    if env_usize("BENCH_ETCD_IN_MEMORY", 0) == 1 && std::env::var_os("TMPDIR").is_none() {
        ensure!(shm.is_dir(), "BENCH_ETCD_IN_MEMORY=1: no {}", shm.display());
        // SAFETY: called first in main, before any thread is started.
        unsafe { std::env::set_var("TMPDIR", shm) };
    }
    let storage = format!("the control plane's state in {}", std::env::temp_dir().display());
    println!("storage: {storage}");
    Ok(storage)
}

/// Where the processes run, said in the output: with `BENCH_PIN=1` see [`place`]; else
/// nothing is pinned. Must run before the runtime's threads start, so that they are
/// placed too.
pub(crate) fn placement(cluster: &Cluster, s: &Settings) -> anyhow::Result<String> {
    let placement = if s.pin { place(cluster)? } else { "shared: the bench pins nothing".to_owned() };
    println!("placement: {placement}");
    Ok(placement)
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
