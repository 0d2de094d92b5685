//! The operator's whole loop against a real Consul agent (`consul agent -dev`, Debian
//! bullseye's 1.8.7, cached by scripts/real-parts.sh): resolve, health flips both ways, a
//! node check (the fed path), two scopes of one service, an export, and an outage with a
//! fresh agent back on the same address. The same loop runs against the simulator in the
//! other e2e tests; here nothing of Consul is ours. Consul is changed only through its HTTP
//! API.
//!
//! Compiled ignored, with the reason, when the agent is not cached (under `CI=true` the
//! build fails instead: e2e/build.rs).

use std::time::Duration;

use e2e::agent::RealAgent;
use e2e::consul::Consul;
use e2e::fixtures::{export_yaml, mapping_yaml, resolver_yaml, service, slice_addresses, slices};
use e2e::harness::{Cluster, Operator, unique, wait_for};
use serde_json::Value;

const T: Duration = Duration::from_secs(60);

/// Addresses of `svc`'s endpoints under resolver `ns/resolver`, sorted.
fn addresses(snapshot: &Value, ns: &str, resolver: &str, svc: &str) -> Option<Vec<String>> {
    let entry = service(snapshot, ns, resolver, svc)?;
    let mut all: Vec<String> =
        entry["endpoints"].as_array()?.iter().filter_map(|e| e["address"].as_str().map(str::to_owned)).collect();
    all.sort();
    Some(all)
}

/// The addresses of the export's slices, sorted.
fn exported(cluster: &Cluster, ns: &str) -> Vec<String> {
    slice_addresses(&slices(cluster, ns, "web"))
}

#[test]
#[cfg_attr(e2e_external_cluster, ignore = "starts its own Consul agent beside the cluster the tests start")]
#[cfg_attr(e2e_no_real_agent, ignore = "no real Consul agent (bash scripts/real-parts.sh consul)")]
fn the_operator_follows_a_real_agent_through_flips_a_node_check_two_scopes_an_export_and_an_outage() {
    let cluster = Cluster::shared();
    let agent = RealAgent::start().unwrap();
    let port = agent.http.port();
    let consul = Consul { base_url: agent.base_url.clone(), token: None, sim: None };
    let ns = cluster.namespace("real-consul").unwrap();
    cluster.grant_exports(&ns).unwrap();
    let svc = format!("web{}", unique());
    cluster.apply(&resolver_yaml(&ns, "consul", &agent.address(), "")).unwrap();
    let every = "  healthStatuses: [passing, warning, critical]\n";
    cluster.apply(&resolver_yaml(&ns, "any", &agent.address(), every)).unwrap();
    cluster.apply(&mapping_yaml(&ns, "m", &svc, Some("consul"))).unwrap();
    cluster.apply(&mapping_yaml(&ns, "m-any", &svc, Some("any"))).unwrap();
    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", "")).unwrap();
    // Documentation addresses (RFC 5737): data here, nothing connects to them.
    let (a, b) = ("192.0.2.1", "192.0.2.2");
    consul.register("node-a", a, &svc, &format!("{svc}-a"), 8080, "passing").unwrap();
    consul.register("node-b", b, &svc, &format!("{svc}-b"), 8080, "passing").unwrap();
    let mut op = Operator::start(cluster, &["--namespace", &ns]).unwrap();
    op.wait_ready(T).unwrap();
    let both = vec![a.to_owned(), b.to_owned()];
    let seen = |scope: &str, want: &[&str]| {
        let want: Vec<String> = want.iter().map(|s| (*s).to_owned()).collect();
        op.wait_snapshot(&format!("{scope}: {want:?}"), T, |s| addresses(s, &ns, scope, &svc).as_ref() == Some(&want))
            .unwrap_or_else(|e| {
                panic!("{e}\n{}\n{}", op.logs(), agent.logs().lines().rev().take(40).collect::<Vec<_>>().join("\n"))
            });
    };
    let slices = |want: &[&str]| {
        wait_for(&format!("the export's slices: {want:?}"), T, || (exported(cluster, &ns) == want).then_some(()))
            .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    };
    seen("consul", &[a, b]);
    seen("any", &[a, b]);
    slices(&[a, b]);

    // A service check flips, both ways: the default scope drops it and takes it back, the
    // scope admitting every status keeps it throughout.
    consul.register("node-b", b, &svc, &format!("{svc}-b"), 8080, "critical").unwrap();
    seen("consul", &[a]);
    slices(&[a]);
    seen("any", &[a, b]);
    consul.register("node-b", b, &svc, &format!("{svc}-b"), 8080, "passing").unwrap();
    seen("consul", &[a, b]);
    slices(&[a, b]);

    // A node's own check counts against every instance on it (the fed path).
    consul.node_check("node-a", a, "critical").unwrap();
    seen("consul", &[b]);
    consul.node_check("node-a", a, "passing").unwrap();
    seen("consul", &[a, b]);

    // The outage: the agent goes. The last endpoints stay published, marked stale, and the
    // export keeps them.
    drop(agent);
    let snap = op
        .wait_snapshot("the endpoints kept, stale", T, |s| {
            service(s, &ns, "consul", &svc).is_some_and(|e| e["stale"].is_object())
                && addresses(s, &ns, "consul", &svc).as_ref() == Some(&both)
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    assert!(service(&snap, &ns, "consul", &svc).unwrap()["error"].is_string());
    assert_eq!(exported(cluster, &ns), both, "the export keeps its endpoints");

    // A fresh agent on the same address, knowing only one instance: followed.
    let back = RealAgent::start_on(Some(port)).unwrap();
    let consul = Consul { base_url: back.base_url.clone(), token: None, sim: None };
    consul.register("node-a", a, &svc, &format!("{svc}-a"), 8080, "passing").unwrap();
    op.wait_snapshot("the new agent's data, current", T, |s| {
        service(s, &ns, "consul", &svc).is_some_and(|e| e.get("stale").is_none())
            && addresses(s, &ns, "consul", &svc) == Some(vec![a.to_owned()])
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    slices(&[a]);
    assert!(op.terminate(T).unwrap().success(), "{}", op.logs());
}
