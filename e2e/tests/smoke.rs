//! Smoke: the CRDs apply, the operator starts with its real RBAC, becomes ready, publishes
//! a snapshot that follows Kubernetes, and exits cleanly on SIGTERM.

use std::time::Duration;

use e2e::harness::{Cluster, Operator};

#[test]
fn operator_starts_publishes_and_stops_cleanly() {
    let cluster = Cluster::shared();
    let ns = cluster.namespace("smoke").unwrap();
    let mut op = Operator::start(cluster, &["--namespace", &ns, "--bootstrap-timeout", "5s"]).unwrap();
    op.wait_ready(Duration::from_secs(60)).unwrap();
    let first = op.snapshot().expect("a snapshot is served once ready");
    assert_eq!(first["apiVersion"], "consulresolver.io/v1alpha1");
    assert_eq!(first["kind"], "Snapshot");
    assert!(first["hash"].as_str().unwrap().starts_with("sha256:"));

    // A Mapping to a Kubernetes Service: its endpoints (and only its) are watched. The
    // endpoint address is TEST-NET-1 documentation data (the API server refuses loopback
    // there); nothing ever sends traffic to it.
    cluster
        .apply(&format!(
            "apiVersion: getambassador.io/v3alpha1\nkind: Mapping\nmetadata: {{name: web, namespace: {ns}}}\nspec: {{prefix: /web/, service: 'web:8080'}}\n"
        ))
        .unwrap();
    cluster
        .apply(&format!(
            "apiVersion: v1\nkind: Endpoints\nmetadata: {{name: web, namespace: {ns}}}\nsubsets:\n- addresses: [{{ip: 192.0.2.10}}]\n  ports: [{{port: 8080}}]\n"
        ))
        .unwrap();
    let snap = op
        .wait_snapshot("the Mapping and its endpoints in the snapshot", Duration::from_secs(30), |s| {
            s["kubernetesServices"]
                .as_array()
                .is_some_and(|a| a.iter().any(|k| k["name"] == "web" && k["endpoints"][0]["address"] == "192.0.2.10"))
        })
        .unwrap();
    assert!(snap["id"].as_u64().unwrap() > first["id"].as_u64().unwrap());
    let m = &snap["mappings"][0];
    assert_eq!((m["name"].as_str(), m["target"]["type"].as_str()), (Some("web"), Some("kubernetes")));

    let metrics = op.get("/metrics").unwrap().1;
    assert!(metrics.contains("consul_resolver_snapshots_published_total"), "{metrics}");
    assert!(metrics.contains("consul_resolver_leader 1"), "without a lease the one process writes: {metrics}");

    let status = op.terminate(Duration::from_secs(20)).unwrap();
    assert!(status.success(), "exit status after SIGTERM: {status}\n{}", op.logs());
}
