//! The operator's main job end to end, black box: kubectl on one side, Consul's HTTP API on
//! the other, and the published snapshot (HTTP) in between. The operator runs as its own
//! process with the ServiceAccount kubeconfig bound to manifests/rbac.yaml.

use std::time::Duration;

use consul_resolver_api::status::{condition, reason};
use e2e::consul::Consul;
use e2e::fixtures::{mapping_yaml, ports, resolver_yaml};
use e2e::harness::{Cluster, Operator, free_port, unique, wait_for};
use serde_json::Value;

const T: Duration = Duration::from_secs(30);

/// In-flight blocking queries the simulator holds for `service` (simulator only).
fn blocking(consul: &Consul, service: &str) -> Option<usize> {
    consul.sim.as_ref().map(|s| s.stats().blocking.get(service).copied().unwrap_or(0))
}

/// The same snapshot reaches the ConfigMap `cm` and the resolver's status in `ns`
/// (`kubectl get cres`).
fn assert_published_to_the_configmap_and_the_status(cluster: &Cluster, ns: &str, cm: &str, snap: &Value) {
    wait_for("the snapshot in the ConfigMap", T, || {
        let data = cluster
            .kubectl(&[
                "-n",
                "consul-resolver-system",
                "get",
                "configmap",
                cm,
                "-o",
                "jsonpath={.data.snapshot\\.json}",
            ])
            .ok()?;
        let published: Value = serde_json::from_str(&data).ok()?;
        (published["id"].as_u64()? >= snap["id"].as_u64()?).then_some(())
    })
    .unwrap();
    let row = wait_for("Ready=True with counts in kubectl get cres", T, || {
        let out = cluster.kubectl(&["-n", ns, "get", "cres", "consul", "--no-headers"]).ok()?;
        let cols: Vec<String> = out.split_whitespace().map(str::to_owned).collect();
        (cols.get(1).map(String::as_str) == Some("True") && cols.get(2).map(String::as_str) == Some("1"))
            .then_some(cols)
    })
    .unwrap();
    assert_eq!(row[3], "1", "one endpoint: {row:?}");
}

/// The service's instances come, turn critical, pass again and go: the snapshot of `ns`
/// follows each step.
fn assert_the_catalog_is_followed(consul: &Consul, op: &Operator, ns: &str, svc: &str) {
    consul.register("node-2", "127.0.0.1", svc, &format!("{svc}-2"), 21002, "passing").unwrap();
    op.wait_snapshot("a second instance", T, |s| ports(s, ns, "consul", svc) == Some(vec![21001, 21002])).unwrap();
    consul.register("node-2", "127.0.0.1", svc, &format!("{svc}-2"), 21002, "critical").unwrap();
    op.wait_snapshot("the critical instance filtered out", T, |s| ports(s, ns, "consul", svc) == Some(vec![21001]))
        .unwrap();
    consul.register("node-2", "127.0.0.1", svc, &format!("{svc}-2"), 21002, "passing").unwrap();
    op.wait_snapshot("the instance back once passing", T, |s| ports(s, ns, "consul", svc) == Some(vec![21001, 21002]))
        .unwrap();
    consul.deregister("node-1", &format!("{svc}-1")).unwrap();
    op.wait_snapshot("the deregistered instance gone", T, |s| ports(s, ns, "consul", svc) == Some(vec![21002]))
        .unwrap();
}

#[test]
fn consul_endpoints_follow_the_catalog_and_shared_services_are_queried_once() {
    let cluster = Cluster::shared();
    let consul = Consul::shared();
    let (a, b) = (cluster.namespace("loop-a").unwrap(), cluster.namespace("loop-b").unwrap());
    let svc = format!("pay{}", unique());
    let svc2 = format!("{svc}-next");
    consul.register("node-1", "127.0.0.1", &svc, &format!("{svc}-1"), 21001, "passing").unwrap();

    let addr = consul.address();
    cluster.apply(&resolver_yaml(&a, "consul", &addr, "  datacenter: dc1\n")).unwrap();
    // Same settings in another namespace: its queries are the same queries.
    cluster.apply(&resolver_yaml(&b, "consul", &format!("http://{addr}"), "  datacenter: dc1\n")).unwrap();
    cluster.apply(&mapping_yaml(&a, "m1", &format!("{svc}:8080"), Some("consul"))).unwrap();
    cluster.apply(&mapping_yaml(&a, "m2", &format!("http://{svc}"), Some("consul"))).unwrap();
    cluster.apply(&mapping_yaml(&b, "m3", &svc, Some("consul"))).unwrap();

    let cm = format!("snap-{}", unique());
    let cm_arg = format!("consul-resolver-system/{cm}");
    let mut op =
        Operator::start(cluster, &["--namespace", &a, "--namespace", &b, "--snapshot-configmap", &cm_arg]).unwrap();
    op.wait_ready(T).unwrap();
    let snap = op
        .wait_snapshot("the first instance under both resolvers", T, |s| {
            ports(s, &a, "consul", &svc) == Some(vec![21001]) && ports(s, &b, "consul", &svc) == Some(vec![21001])
        })
        .unwrap();
    assert_published_to_the_configmap_and_the_status(cluster, &a, &cm, &snap);
    if let Some(sim) = &consul.sim {
        // Three Mappings, two resolvers: one blocking query for the service.
        wait_for("exactly one blocking query for the shared service", T, || {
            (blocking(consul, &svc) == Some(1)).then_some(())
        })
        .unwrap();
        let dc_sent =
            sim.requests().iter().any(|r| r.service.as_deref() == Some(svc.as_str()) && r.query.contains("dc=dc1"));
        assert!(dc_sent, "the datacenter is sent as ?dc=");
    }
    assert_the_catalog_is_followed(consul, &op, &a, &svc);

    // Every Mapping moves to another service: the old watch stops, the new one starts.
    consul.register("node-3", "127.0.0.1", &svc2, &format!("{svc2}-1"), 21003, "passing").unwrap();
    for (ns, m) in [(&a, "m1"), (&a, "m2"), (&b, "m3")] {
        cluster.apply(&mapping_yaml(ns, m, &svc2, Some("consul"))).unwrap();
    }
    let snap = op
        .wait_snapshot("the Mappings on the new service", T, |s| {
            [&a, &b]
                .iter()
                .all(|ns| ports(s, ns, "consul", &svc2) == Some(vec![21003]) && ports(s, ns, "consul", &svc).is_none())
        })
        .unwrap();
    assert!(snap["mappings"].as_array().unwrap().iter().all(|m| m["target"]["service"] == svc2.as_str()));
    if consul.sim.is_some() {
        wait_for("the old watch to stop and the new one to run", T, || {
            (blocking(consul, &svc) == Some(0) && blocking(consul, &svc2) == Some(1)).then_some(())
        })
        .unwrap();
    }
    let status = op.terminate(T).unwrap();
    assert!(status.success(), "{status}\n{}", op.logs());
}

#[test]
fn problems_are_reported_not_guessed() {
    let cluster = Cluster::shared();
    let consul = Consul::shared();
    let ns = cluster.namespace("problems").unwrap();
    // The API server itself rejects a resolver without an address (schema validation).
    let err = cluster.apply(&format!("apiVersion: consulresolver.io/v1alpha1\nkind: ConsulResolver\nmetadata: {{name: bad, namespace: {ns}}}\nspec: {{datacenter: dc1}}\n")).unwrap_err();
    assert!(err.to_string().contains("address"), "{err}");

    cluster.apply(&resolver_yaml(&ns, "broken", "${NOT_SET_ANYWHERE}:8500", "")).unwrap();
    cluster.apply(&resolver_yaml(&ns, "good", &consul.address(), "")).unwrap();
    cluster.apply(&mapping_yaml(&ns, "via-broken", "web", Some("broken"))).unwrap();
    cluster.apply(&mapping_yaml(&ns, "nowhere", "web", Some("no-such-resolver"))).unwrap();
    cluster.apply(&mapping_yaml(&ns, "bad-port", "web:99999", Some("good"))).unwrap();

    let mut op = Operator::start(cluster, &["--namespace", &ns]).unwrap();
    op.wait_ready(T).unwrap();
    let snap = op.snapshot().unwrap();
    let broken = snap["resolvers"].as_array().unwrap().iter().find(|r| r["name"] == "broken").unwrap();
    let ready_reason = wait_for("InvalidSpec on the broken resolver's status", T, || {
        let jp = format!("jsonpath={{.status.conditions[?(@.type==\"{}\")].reason}}", condition::READY);
        cluster.kubectl(&["-n", &ns, "get", "cres", "broken", "-o", &jp]).ok().filter(|r| r == reason::INVALID_SPEC)
    });
    assert!(ready_reason.is_ok(), "{ready_reason:?}\n{}", op.logs());
    // ... and a Warning Event on it that `kubectl describe cres broken` shows.
    let event = wait_for("an InvalidSpec Event on the broken resolver", T, || {
        let out = cluster.kubectl(&["-n", &ns, "get", "events", "-o", "json"]).ok()?;
        let list: Value = serde_json::from_str(&out).ok()?;
        list["items"]
            .as_array()?
            .iter()
            .find(|e| e["reason"] == reason::INVALID_SPEC && e["involvedObject"]["name"] == "broken")
            .cloned()
    });
    let event = event.unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    assert_eq!(event["type"], "Warning");
    assert!(event["message"].as_str().unwrap_or_default().contains("NOT_SET_ANYWHERE"), "{event}");
    let described = cluster.kubectl(&["-n", &ns, "describe", "cres", "broken"]).unwrap();
    assert!(described.contains(reason::INVALID_SPEC), "{described}");
    assert_eq!(broken["unusable"]["reason"], reason::INVALID_SPEC, "{broken}");
    assert!(broken["unusable"]["message"].as_str().unwrap().contains("NOT_SET_ANYWHERE is not set"), "{broken}");
    let problems: Vec<String> = snap["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| format!("{}: {}", p["name"].as_str().unwrap(), p["message"].as_str().unwrap()))
        .collect();
    for (who, what) in [
        ("via-broken", "cannot be used"),
        ("nowhere", "no ConsulResolver"),
        ("bad-port", "out of range"),
        ("broken", "NOT_SET_ANYWHERE"),
    ] {
        assert!(problems.iter().any(|p| p.starts_with(who) && p.contains(what)), "{who}: {problems:?}");
    }
    op.terminate(T).unwrap();
}

#[test]
fn unreachable_consul_publishes_after_the_bootstrap_timeout() {
    let cluster = Cluster::shared();
    let ns = cluster.namespace("dead").unwrap();
    // A loopback port nothing listens on.
    let dead = format!("127.0.0.1:{}", free_port());
    cluster.apply(&resolver_yaml(&ns, "dead", &dead, "")).unwrap();
    cluster.apply(&mapping_yaml(&ns, "m", "ghost", Some("dead"))).unwrap();
    let mut op = Operator::start(cluster, &["--namespace", &ns, "--bootstrap-timeout", "3s"]).unwrap();
    op.wait_ready(T).unwrap();
    let snap = op.snapshot().unwrap();
    assert_eq!(snap["bootstrap"]["complete"], false, "{snap}");
    assert_eq!(snap["bootstrap"]["unsynced"][0], format!("{ns}/dead/ghost"));
    let svc = &snap["resolvers"][0]["services"][0];
    assert_eq!(svc["synced"], false);
    assert!(svc["error"].as_str().unwrap_or_default().contains(&dead), "the error names the address: {svc}");
    op.terminate(T).unwrap();
}
