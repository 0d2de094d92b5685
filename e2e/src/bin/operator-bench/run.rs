//! One operator run at one `--consul-max-connections` budget: its cold starts, the Consul
//! queries it holds once started, its changes, and what it leaves at the end (memory, the
//! audit log's watches, its exit).

use std::collections::{BTreeMap, HashSet};
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::time::{Duration, SystemTime};

use consul_sim::RunningSim;
use e2e::apiserver::{self, WatchRequest};
use e2e::harness::Cluster;
use tokio::runtime::Runtime;

use crate::changes::{self, Changes};
use crate::cold_start::{ColdStarts, Instance, Milestones, Plan, cold_starts, milestones, stop};
use crate::profile::Settings;
use crate::setup::{OPERATOR_USER, Setup};
use crate::xds::{self, EnvoyFigures, Follower, Probe};
use e2e::procfs::memory_kib;

pub(crate) struct Run {
    pub(crate) max_connections: u32,
    pub(crate) starts: ColdStarts,
    /// The last cold start's milestones, from its log at the end.
    pub(crate) last: Milestones,
    /// The first snapshot's document, for its size and the gzip measurement.
    pub(crate) snapshot: bytes::Bytes,
    pub(crate) bootstrap_requests: u64,
    pub(crate) bootstrap_services_queried: usize,
    pub(crate) held: Held,
    pub(crate) changes: Changes,
    pub(crate) audit: Option<Audit>,
    /// The operator's connections to the API server after the changes.
    pub(crate) api_connections: usize,
    pub(crate) peak_sim_connections: usize,
    pub(crate) memory_first: (u64, u64),
    pub(crate) memory_end: (u64, u64),
    pub(crate) exit: String,
    /// With `BENCH_XDS=1`: the Envoy that followed the operator.
    pub(crate) envoy: Option<EnvoyFigures>,
}

/// The cold starts of `plan`; the last operator then goes on to the change measurements.
pub(crate) fn run_operator(
    rt: &Runtime,
    cluster: &Cluster,
    sim: &mut Option<RunningSim>,
    setup: &Setup,
    s: &Settings,
    max_connections: u32,
    plan: Plan,
) -> anyhow::Result<Run> {
    println!("== --consul-max-connections {max_connections}");
    let (starts, instance) = cold_starts(rt, cluster, sim, setup, s, max_connections, plan)?;
    let sim = sim.as_ref().expect("started by the cold starts");
    let held = held(sim);
    let follower = instance.xds.map(|addr| xds::follow(&instance.op, addr)).transpose()?;
    let probe = follower.as_ref().map(|_| Probe::new(&instance.op, instance.pid)).transpose()?;
    let changes = changes::measure(rt, cluster, sim, setup, s, &instance, probe)?;
    let envoy = follower.map(Follower::finish).transpose()?;
    let Instance {
        op, pid, spawned_at, snapshot, bootstrap_requests, bootstrap_services_queried, memory_first, ..
    } = instance;
    let memory_end = memory_kib(pid)?;
    let api_connections = apiserver::connections(pid, apiserver::port(&cluster.operator_kubeconfig)?);
    let peak_sim_connections = sim.stats().peak_connections_total;
    let log = op.logs();
    let exit = stop(op, sim)?;
    // The API server logs a watch when it ends (the operator has exited by now).
    let audit = cluster.audit_log().map(|p| audit_since(&p, setup.audit_offset, spawned_at)).transpose()?;
    if let Some(a) = &audit {
        println!("  audit: watches {:?}; verbs {:?}", a.watches, a.verbs);
        println!("  audit: endpoints watches {}, at most {} at once", a.endpoints.len(), a.endpoints_at_once());
    }
    println!("  connections to the API server after the changes: {api_connections}");
    Ok(Run {
        max_connections,
        starts,
        last: milestones(&log, spawned_at),
        snapshot,
        bootstrap_requests,
        bootstrap_services_queried,
        held,
        changes,
        audit,
        api_connections,
        peak_sim_connections,
        memory_first,
        memory_end,
        exit,
        envoy,
    })
}

/// The Consul blocking queries the operator holds once started, and the simulator's peak
/// connections so far.
pub(crate) struct Held {
    pub(crate) services: usize,
    pub(crate) max_per_service: usize,
    pub(crate) catalog: usize,
    pub(crate) peak_sim_connections_start: usize,
}

/// What the simulator holds 2 s after the first snapshot: time for the last watches to
/// hold their blocking queries.
fn held(sim: &RunningSim) -> Held {
    std::thread::sleep(Duration::from_secs(2));
    let settled = sim.stats();
    let catalog = settled.blocking.get(consul_sim::CATALOG_SERVICES_LABEL).copied().unwrap_or(0);
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
        catalog,
        settled.requests_total
    );
    Held {
        services: per_service.len(),
        max_per_service: per_service.iter().copied().max().unwrap_or(0),
        catalog,
        peak_sim_connections_start: settled.peak_connections_total,
    }
}

/// Requests by the operator's ServiceAccount in the audit log after `offset`, received
/// at `since` or later: distinct watches per `resource namespace`, and requests per verb.
/// A watch is logged when it ends (stage ResponseComplete), so this is read after the
/// operator has exited.
#[derive(Default)]
pub(crate) struct Audit {
    pub(crate) watches: BTreeMap<String, usize>,
    pub(crate) verbs: BTreeMap<String, usize>,
    /// The endpoints watches, each with when it ran.
    pub(crate) endpoints: Vec<WatchRequest>,
}

impl Audit {
    /// The most endpoints watches running at once (the budget's measure).
    pub(crate) fn endpoints_at_once(&self) -> usize {
        // A watch the operator stopped as another began ends in the log a moment later.
        apiserver::most_at_once(&self.endpoints, Duration::from_millis(100))
    }
}

fn audit_since(path: &Path, offset: u64, since: SystemTime) -> anyhow::Result<Audit> {
    let mut f = std::fs::File::open(path)?;
    f.seek(SeekFrom::Start(offset))?;
    let mut text = String::new();
    f.read_to_string(&mut text)?;
    let mut seen = HashSet::new();
    let mut audit = Audit::default();
    let mut ours = Vec::new();
    for line in text.lines() {
        let Ok(e) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let received = e["requestReceivedTimestamp"].as_str().and_then(|t| humantime::parse_rfc3339_weak(t).ok());
        if e["user"]["username"] != OPERATOR_USER || received.is_none_or(|t| t < since) {
            continue;
        }
        if e["objectRef"]["resource"] == "endpoints" && e["verb"] == "watch" {
            ours.push(e.clone());
        }
        if !seen.insert(e["auditID"].as_str().unwrap_or_default().to_owned()) {
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
    audit.endpoints = apiserver::watch_requests(&ours, OPERATOR_USER, "endpoints");
    Ok(audit)
}
