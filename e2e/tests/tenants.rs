//! Many tenants: Kubernetes Services routed to across 40 namespaces, under a budget of 10
//! endpoints watches in total (`--endpoints-watch-budget`). The operator runs as its own
//! process with the ServiceAccount bound to manifests/rbac.yaml, over the whole cluster
//! (no `--namespace`), so it may watch the cluster whole when the namespaces outnumber the
//! budget. What the API server saw is read from its audit log, the operator's connections
//! to it from `/proc/<pid>/net/tcp*` (the audit log records requests, not connections).
//!
//! Its own test binary, so its own cluster: the audit log holds no other operator's
//! requests under the same ServiceAccount.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use e2e::apiserver::{self, connections, most_at_once};
use e2e::fixtures::mapping_yaml;
use e2e::harness::{Cluster, Operator, wait_for};
use serde_json::Value;

const T: Duration = Duration::from_secs(60);
const BUDGET: usize = 10;
const NAMESPACES: usize = 40;
/// Services (Endpoints objects) in each namespace.
const SERVICES: usize = 4;
/// The idle connections the operator keeps to the API server at most (`src/kube_client`):
/// 16 in its client's pool, and those of the snapshot writer's own client, which sends at
/// most 4 requests at once.
const IDLE_CONNECTIONS: usize = 16 + 4;
/// A watch that ended within this of another's start was being stopped as the other began
/// (the API server logs the end once it notices the closed connection): not counted as
/// running beside it.
const STOPPING: Duration = Duration::from_millis(100);

fn address(ns: usize, svc: usize) -> String {
    format!("10.0.{ns}.{}", svc + 1)
}

fn endpoints_yaml(ns_name: &str, ns: usize) -> String {
    (0..SERVICES)
        .map(|i| {
            format!(
                "---\napiVersion: v1\nkind: Endpoints\nmetadata: {{name: svc-{i}, namespace: {ns_name}}}\nsubsets:\n- addresses: [{{ip: {}}}]\n  ports: [{{port: 8080}}]\n",
                address(ns, i)
            )
        })
        .collect()
}

/// The tenants' namespaces and the one holding every Mapping.
struct Tenants<'a> {
    cluster: &'a Cluster,
    namespaces: Vec<String>,
    mappings: String,
}

impl<'a> Tenants<'a> {
    fn create(cluster: &'a Cluster) -> Self {
        let namespaces: Vec<String> =
            (0..NAMESPACES).map(|k| cluster.namespace(&format!("t{k:02}")).unwrap()).collect();
        let objects: String = namespaces.iter().enumerate().map(|(k, ns)| endpoints_yaml(ns, k)).collect();
        cluster.apply(&objects).unwrap();
        Tenants { cluster, mappings: cluster.namespace("routes").unwrap(), namespaces }
    }

    fn mapping_name(k: usize, i: usize) -> String {
        format!("m-{k:02}-{i}")
    }

    /// Mappings to Service `svc-I` of tenant `K`, for each (K, I) of `routes`.
    fn route(&self, routes: &[(usize, usize)]) {
        let yaml: String = routes
            .iter()
            .map(|&(k, i)| {
                let service = format!("svc-{i}.{}:8080", self.namespaces[k]);
                format!("---\n{}", mapping_yaml(&self.mappings, &Self::mapping_name(k, i), &service, None))
            })
            .collect();
        self.cluster.apply(&yaml).unwrap();
    }

    fn unroute(&self, routes: &[(usize, usize)]) {
        let names: Vec<String> = routes.iter().map(|&(k, i)| Self::mapping_name(k, i)).collect();
        let mut args = vec!["-n", &self.mappings, "delete", "mappings.getambassador.io"];
        args.extend(names.iter().map(String::as_str));
        self.cluster.kubectl(&args).unwrap();
    }

    /// What the snapshot must hold for `routes`: `ns/svc-I` -> its address.
    fn expected(&self, routes: &BTreeSet<(usize, usize)>) -> BTreeMap<String, Vec<String>> {
        routes.iter().map(|&(k, i)| (format!("{}/svc-{i}", self.namespaces[k]), vec![address(k, i)])).collect()
    }
}

/// The synced Kubernetes Services of a snapshot: `ns/name` -> endpoint addresses.
fn kube_services(snapshot: &Value) -> BTreeMap<String, Vec<String>> {
    snapshot["kubernetesServices"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|k| k["synced"] == true)
        .filter_map(|k| {
            let addrs = k["endpoints"].as_array()?.iter().filter_map(|e| e["address"].as_str().map(str::to_owned));
            Some((format!("{}/{}", k["namespace"].as_str()?, k["name"].as_str()?), addrs.collect()))
        })
        .collect()
}

/// The operator's Kubernetes watches now (its gauge).
fn kube_watches(op: &Operator) -> usize {
    op.metric("consul_resolver_watches{source=\"kubernetes\"}").unwrap_or(-1.0) as usize
}

/// How many endpoints lists the operator made (one per watch it starts).
fn endpoints_lists(cluster: &Cluster) -> usize {
    let user = cluster.operator_username().unwrap();
    let events = cluster.audit_events().unwrap().unwrap_or_default();
    events
        .iter()
        .filter(|e| e["user"]["username"] == user.as_str() && e["objectRef"]["resource"] == "endpoints")
        .filter(|e| e["verb"] == "list" && e["stage"] == "ResponseComplete")
        .count()
}

/// A step of the test: the routes it leaves, and the endpoints watches they must settle at.
struct Phase<'a> {
    what: &'a str,
    routes: &'a BTreeSet<(usize, usize)>,
    endpoints_watches: usize,
}

/// Waits for the snapshot to hold exactly the routed-to Services and for the watches to
/// settle at `phase.endpoints_watches` besides `fixed`; then counts the connections.
fn settle(tenants: &Tenants, op: &Operator, fixed: usize, port: u16, phase: &Phase) {
    let expected = tenants.expected(phase.routes);
    op.wait_snapshot(phase.what, T, |s| kube_services(s) == expected).unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    let want = fixed + phase.endpoints_watches;
    wait_for(&format!("{}: {} endpoints watches", phase.what, phase.endpoints_watches), T, || {
        (kube_watches(op) == want).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}: {} Kubernetes watches, {fixed} of them fixed\n{}", kube_watches(op), op.logs()));
    let conns = connections(op.pid().unwrap(), port);
    eprintln!(
        "{}: {} Services in {} namespaces, {} endpoints watches, {conns} connections to the API server",
        phase.what,
        phase.routes.len(),
        phase.routes.iter().map(|r| r.0).collect::<BTreeSet<_>>().len(),
        phase.endpoints_watches
    );
    // A connection per watch over HTTP/1.1, and those everything else (statuses, Events,
    // discovery, the snapshot) left idle in the pool, which the client bounds. Under the
    // load of a whole `make test` a first publication's burst left 7 idle beside 13
    // watches. One watch per Service would exceed it at forty namespaces (58 Services).
    assert!(conns <= want + IDLE_CONNECTIONS, "{conns} connections for {want} watches: {}", op.logs());
}

/// 40 namespaces, a budget of 10: the biggest namespaces are watched whole first; past
/// one watch per namespace, one watch of the cluster serves all; back, one per namespace,
/// then one per Service. Every step keeps every routed-to Service's endpoints right, and at
/// no moment of the operator's life did more than the budget of endpoints watches run.
#[test]
fn endpoints_watches_stay_within_the_budget_across_forty_namespaces_both_ways() {
    let cluster = Cluster::shared();
    let Some(_) = cluster.audit_log() else {
        panic!(
            "this test reads the API server's audit log: it needs the cluster the harness starts, not E2E_KUBECONFIG"
        );
    };
    let tenants = Tenants::create(cluster);
    let port = apiserver::port(&cluster.operator_kubeconfig).unwrap();
    // Six namespaces of four Services each: 24 watches one each. Routed before the
    // operator starts, so its first layout is the settled one.
    let mut routes: BTreeSet<(usize, usize)> = (0..6).flat_map(|k| (0..SERVICES).map(move |i| (k, i))).collect();
    tenants.route(&routes.iter().copied().collect::<Vec<_>>());
    let budget = BUDGET.to_string();
    let mut op = Operator::start(cluster, &["--endpoints-watch-budget", &budget]).unwrap();
    op.wait_ready(T).unwrap();

    // The five biggest namespaces (ties by name) whole, the sixth's four one each: 9.
    let expected = tenants.expected(&routes);
    op.wait_snapshot("24 Services", T, |s| kube_services(s) == expected).unwrap();
    wait_for("nine endpoints lists", T, || (endpoints_lists(cluster) >= 9).then_some(())).unwrap();
    let fixed = kube_watches(&op) - 9;
    assert_eq!(endpoints_lists(cluster), 9, "five namespaces and four Services: {}", op.logs());
    settle(&tenants, &op, fixed, port, &Phase { what: "six namespaces", routes: &routes, endpoints_watches: 9 });

    // One more Service in each of the 34 other namespaces: 40 namespaces, more than the
    // budget even at one watch each: the cluster's.
    let spread: Vec<(usize, usize)> = (6..NAMESPACES).map(|k| (k, 0)).collect();
    tenants.route(&spread);
    routes.extend(&spread);
    settle(&tenants, &op, fixed, port, &Phase { what: "forty namespaces", routes: &routes, endpoints_watches: 1 });

    // Back to the six: one watch per namespace (6, within three quarters of the budget).
    tenants.unroute(&spread);
    for r in &spread {
        routes.remove(r);
    }
    settle(&tenants, &op, fixed, port, &Phase { what: "six again", routes: &routes, endpoints_watches: 6 });

    // Down to three Services in two namespaces: one watch each.
    let gone: Vec<(usize, usize)> =
        routes.iter().copied().filter(|&(k, i)| k > 1 || i > 1 || (k, i) == (1, 1)).collect();
    tenants.unroute(&gone);
    for r in &gone {
        routes.remove(r);
    }
    settle(&tenants, &op, fixed, port, &Phase { what: "three Services", routes: &routes, endpoints_watches: 3 });

    let status = op.terminate(T).unwrap();
    assert!(status.success(), "{status}\n{}", op.logs());
    let user = cluster.operator_username().unwrap();
    let events = cluster.audit_events().unwrap().unwrap_or_default();
    let watches = apiserver::watch_requests(&events, &user, "endpoints");
    let cluster_wide = watches.iter().filter(|w| w.namespace.is_none()).count();
    let namespaces = watches.iter().filter(|w| w.namespace.is_some() && !w.selects_one()).count();
    let services = watches.iter().filter(|w| w.selects_one()).count();
    let most = most_at_once(&watches, STOPPING);
    eprintln!(
        "over the operator's life: {} endpoints watches ({cluster_wide} of the cluster, {namespaces} of a namespace, {services} of a Service), at most {most} at once",
        watches.len()
    );
    assert!(cluster_wide >= 1 && namespaces >= 11 && services >= 7, "every breadth was used: {watches:#?}");
    assert!(most <= BUDGET, "{most} endpoints watches at once, over the budget of {BUDGET}: {watches:#?}");
}
