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
//! 1. four rounds (`cold_start::ROUNDS`), the order alternating within them: a bare
//!    kube-runtime reflector (in this process, with the operator's kubeconfig, one per
//!    namespace like the operator) lists and watches the same Mappings; and the operator
//!    (release build, its own process, a fresh simulator on the same address) starts,
//!    timed from spawn to the first complete snapshot holding every Mapping at
//!    `GET /snapshot` (a held request, `?wait=`); its log gives milestones;
//!    the CPU our kube-apiserver, etcd and this process (the reflector; the simulator and
//!    the reader) used during each says whose work shared the two cores with it;
//! 2. with the last operator: Consul changes (one instance of one service moved to a new
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
//! `BENCH_ETCD_IN_MEMORY=1` keeps the control plane's state (etcd's data, the audit log) in
//! `/dev/shm` (tmpfs) rather than under `TMPDIR`: no write then waits for a disk's sync
//! (`setup::control_plane_storage`). The output names where.
//! `BENCH_SELF_COMPARED=<trials>` runs no operator: after the warm-up, each trial compares
//! the bare reflector with itself as a cold start is compared with it (the four rounds in
//! alternating order, the ratio of the medians), which is the comparison's own resolution.
//! `BENCH_AGAINST=<operator binary>` runs no measurement either: after the warm-up, it
//! compares the cold starts of the operator under test with those of that other build, in
//! one run (`BENCH_AGAINST_ROUNDS`, 10 of each, the order alternating, at the first of
//! `BENCH_MODES`): whether a change moved the cold start, with the load and the API
//! server shared.
//!
//! Targets (the output names the set that applies, and gives met / MISSED for each):
//! cold start / bare reflector <= 1.2x, spaced change p50 <= 50 ms and p99 <= 100 ms,
//! back-to-back p99 <= window + 100 ms, health flip p99 <= window + 250 ms, peak RSS <= 100 MiB. `BENCH_PROFILE=scale`
//! (`make bench-scale`) changes the defaults to 5,000 services x 15 instances (75,000
//! endpoints), 10 Mappings per service (50,000), 5,000 Kubernetes Services routed to (one
//! Mapping each), 5 namespaces and `BENCH_MODES=100`, and
//! the targets to cold start < 10 s, spaced and back-to-back p99 < window + 250 ms, peak
//! RSS < 400 MiB. `BENCH_PROFILE=tenants` (`make bench-tenants`) keeps the default Consul
//! side and adds 10,000 Kubernetes Services routed to (one Mapping and one Endpoints object
//! of three addresses each), 50 in each of 200 namespaces, with the operator and the bare
//! reflector over the whole cluster (no `--namespace`), and `BENCH_MODES=100`; its targets
//! are the default's, peak RSS <= 200 MiB, endpoints watches at once (audit log) <= the
//! default `--endpoints-watch-budget` (250), and connections to the API server after the
//! changes (`/proc`) <= 270. Each variable set still overrides the profile's default; the
//! targets go with the profile.
//!
//! Cost table: `BENCH_SIZES=250x1,1000x1,5000x15` (`make bench-cost`; services x instances
//! per service, Mappings = services x `BENCH_MAPPINGS_PER_SERVICE`) runs one operator per
//! size instead, each with fresh namespaces, Mappings and simulator, one cold start (no
//! reflector), in the first of `BENCH_MODES`, then prints a markdown table: Mappings,
//! services, endpoints, snapshot bytes, cold start, spaced p50 / p99, operator CPU per
//! spaced and per back-to-back change, peak RSS. It is held to no target.
//!
//! Consul over TLS: `BENCH_CONSUL_TLS=1` has the simulator serve HTTPS with a throw-away
//! CA, and every resolver trust it (`tls.caSecretRef`): the operator then reaches Consul
//! over HTTP/2, a blocking query of its own per watch within the server's stream limit,
//! and runs no change feed (docs/consul.md, "TLS and HTTP/2"). Unset, plain HTTP/1.1 with
//! `--consul-max-connections` lanes and the change feed for the rest.
//!
//! xDS: `BENCH_XDS=1` runs every operator with `--xds-listen` on a free loopback port and,
//! once the measured one has its first snapshot, a real Envoy 1.40 (delta ADS,
//! `--concurrency 1`) subscribed to every cluster; each spaced change is then also timed
//! from the Consul write's HTTP 200 to Envoy's ACK of the EDS response carrying it, with
//! the xDS bytes pushed and the operator's CPU per change: see `xds.rs`.
//!
//! Soak: `BENCH_SOAK_SECS=600` (`make bench-soak`) runs one operator under a steady stream
//! of port changes, health flips and Mapping churn instead, samples its memory, sockets,
//! threads and runtime tasks, and checks that the final snapshot holds every change: see
//! `soak.rs`.

mod changes;
mod cold_start;
mod profile;
mod report;
mod run;
mod setup;
mod soak;
mod xds;

use std::path::PathBuf;
use std::time::Instant;

use e2e::bench::loadavg;
use e2e::harness::{Cluster, operator_binary};
use tokio::runtime::Runtime;

use crate::cold_start::Plan;
use crate::profile::Settings;
use crate::report::secs;
use crate::run::{Run, run_operator};

fn main() -> anyhow::Result<()> {
    let wall = Instant::now();
    if std::env::var_os("E2E_OPERATOR_PROFILE").is_none() {
        // SAFETY: nothing else runs yet: no thread has been started.
        unsafe { std::env::set_var("E2E_OPERATOR_PROFILE", "release") };
    }
    let storage = setup::control_plane_storage()?;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let s = Settings::from_env()?;
    let soak = soak::Soak::from_env()?;
    report::targets_line(&s);
    let load_start = loadavg();
    let bin: PathBuf = operator_binary()?;
    println!("operator binary: {}", bin.display());
    let cluster = Cluster::shared();
    let placement = format!("{}; {storage}", setup::placement(cluster, &s)?);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    if let Some(soak) = soak {
        soak::run(&rt, cluster, &s, &soak, &load_start)?;
    } else if !s.sizes.is_empty() {
        cost_table(&rt, cluster, &s, &load_start)?;
    } else {
        compared(&rt, cluster, &s, &load_start, &placement)?;
    }
    println!("wall time: {}", secs(wall.elapsed()));
    Ok(())
}

/// The default run: one world, warm-up lists, then per budget of `BENCH_MODES` three cold
/// starts against the bare reflector and the changes; then the table and the verdicts.
fn compared(rt: &Runtime, cluster: &Cluster, s: &Settings, load_start: &str, placement: &str) -> anyhow::Result<()> {
    let mut sim = Some(setup::placeholder_sim(s)?);
    let namespaces = setup::namespaces(cluster, s, "bench")?;
    let setup = rt.block_on(setup::setup(cluster, sim.as_ref().expect("started"), s, namespaces))?;
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
    cold_start::warm_up(rt, cluster, &setup, s)?;
    if s.self_compared > 0 {
        cold_start::self_compared(rt, cluster, &setup, s, s.self_compared)?;
        println!("load average: {load_start} -> {}; {placement}", loadavg());
        return Ok(());
    }
    if let Some((baseline, rounds)) = &s.against {
        cold_start::against(rt, cluster, &mut sim, &setup, s, baseline, *rounds)?;
        println!("load average: {load_start} -> {}; {placement}", loadavg());
        return Ok(());
    }
    let runs = s
        .modes
        .iter()
        .map(|&max| run_operator(rt, cluster, &mut sim, &setup, s, max, Plan::Compared))
        .collect::<anyhow::Result<Vec<Run>>>()?;
    report::compared(s, &runs, load_start, &loadavg(), placement);
    Ok(())
}

/// `BENCH_SIZES`: one operator per size, in the first of `BENCH_MODES`, each with its own
/// namespaces, Mappings and simulator; then a markdown table of what each size costs.
fn cost_table(rt: &Runtime, cluster: &Cluster, s: &Settings, load_start: &str) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for &(services, instances) in &s.sizes {
        let size = s.at_size(services, instances);
        println!(
            "== size: {} services x {} instances ({} endpoints), {} Mappings",
            services,
            instances,
            size.endpoints(),
            size.mappings()
        );
        // The namespaces of earlier sizes stay until the cluster goes at exit: deleting
        // them would have the API server collecting their Mappings during this size's run.
        let mut sim = Some(setup::placeholder_sim(&size)?);
        let namespaces = setup::namespaces(cluster, &size, "bench")?;
        let setup = rt.block_on(setup::setup(cluster, sim.as_ref().expect("started"), &size, namespaces))?;
        println!("  setup: Mappings created in {}", secs(setup.mappings_created_in));
        let run = run_operator(rt, cluster, &mut sim, &setup, &size, s.modes[0], Plan::Once)?;
        rows.push((size, run));
    }
    report::cost_table(s, &rows, load_start);
    Ok(())
}
