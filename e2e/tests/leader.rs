//! Leader election, black box: two operator processes on one Lease. Both serve snapshots;
//! only the holder writes the ConfigMap; a holder that stops hands over at once, and one
//! that dies is replaced after the lease duration.

use std::time::Duration;

use e2e::fixtures::mapping_yaml;
use e2e::harness::{Cluster, Operator, unique, wait_for};
use serde_json::Value;

const T: Duration = Duration::from_secs(40);
const SYSTEM: &str = "consul-resolver-system";

fn holder(cluster: &Cluster, lease: &str) -> Option<String> {
    cluster.kubectl(&["-n", SYSTEM, "get", "lease", lease, "-o", "jsonpath={.spec.holderIdentity}"]).ok()
}

/// The snapshot id in the ConfigMap, and the Mapping names in it.
fn configmap(cluster: &Cluster, name: &str) -> Option<(u64, Vec<String>)> {
    let data =
        cluster.kubectl(&["-n", SYSTEM, "get", "configmap", name, "-o", "jsonpath={.data.snapshot\\.json}"]).ok()?;
    let s: Value = serde_json::from_str(&data).ok()?;
    let names = s["mappings"].as_array()?.iter().filter_map(|m| m["name"].as_str().map(str::to_owned)).collect();
    Some((s["id"].as_u64()?, names))
}

fn mapping(cluster: &Cluster, ns: &str, name: &str) {
    cluster.apply(&mapping_yaml(ns, name, &format!("svc-{name}:80"), None)).unwrap();
}

fn has(op: &Operator, name: &str) -> bool {
    op.snapshot().is_some_and(|s| s["mappings"].as_array().is_some_and(|a| a.iter().any(|m| m["name"] == name)))
}

#[test]
fn only_the_lease_holder_writes_and_a_successor_takes_over() {
    let cluster = Cluster::shared();
    let ns = cluster.namespace("leader").unwrap();
    let (lease, cm) = (format!("lease-{}", unique()), format!("snap-{}", unique()));
    let args = |identity: &'static str| {
        vec![
            "--namespace".to_owned(),
            ns.clone(),
            "--snapshot-configmap".to_owned(),
            format!("{SYSTEM}/{cm}"),
            "--leader-election-lease".to_owned(),
            format!("{SYSTEM}/{lease}"),
            "--leader-election-identity".to_owned(),
            identity.to_owned(),
            "--leader-election-duration".to_owned(),
            "3s".to_owned(),
        ]
    };
    let start = |identity| {
        let a = args(identity);
        Operator::start(cluster, &a.iter().map(String::as_str).collect::<Vec<_>>()).unwrap()
    };

    mapping(cluster, &ns, "m0");
    let mut a = start("replica-a");
    a.wait_ready(T).unwrap();
    wait_for("replica-a to hold the lease", T, || (holder(cluster, &lease)? == "replica-a").then_some(())).unwrap();
    // Push a's ids ahead so the two replicas' numbering differs.
    for m in ["m1", "m2", "m3"] {
        mapping(cluster, &ns, m);
        wait_for("a to publish the Mapping", T, || has(&a, m).then_some(())).unwrap();
    }
    let mut b = start("replica-b");
    b.wait_ready(T).unwrap();
    assert!(has(&b, "m3"), "the follower serves the same world over HTTP");
    assert_eq!(a.metric("consul_resolver_leader"), Some(1.0));
    assert_eq!(b.metric("consul_resolver_leader"), Some(0.0), "{}", b.logs());

    // A change: both replicas see it; the ConfigMap carries the leader's numbering.
    mapping(cluster, &ns, "m4");
    let a_id =
        wait_for("a to publish m4", T, || has(&a, "m4").then(|| a.snapshot()?["id"].as_u64()).flatten()).unwrap();
    let b_id = wait_for("b to see m4", T, || has(&b, "m4").then(|| b.snapshot()?["id"].as_u64()).flatten()).unwrap();
    assert_ne!(a_id, b_id, "the replicas number snapshots independently");
    let (cm_id, names) =
        wait_for("m4 in the ConfigMap", T, || configmap(cluster, &cm).filter(|(_, n)| n.len() == 5)).unwrap();
    // The leader may have published again since (a later id of its own numbering, as the
    // ConfigMap shows it); never the follower's numbering.
    let a_now = a.snapshot().and_then(|s| s["id"].as_u64()).expect("a's snapshot");
    assert!(
        (a_id..=a_now).contains(&cm_id) && cm_id != b_id,
        "only the leader wrote the ConfigMap: id {cm_id}, a's {a_id}..={a_now}, b's {b_id}: {names:?}"
    );
    assert_eq!(holder(cluster, &lease).as_deref(), Some("replica-a"));

    // The leader stops: it releases the lease and the follower takes over at once (well
    // before the 3 s lease would have expired), continuing the ConfigMap's ids.
    assert!(a.terminate(T).unwrap().success(), "{}", a.logs());
    wait_for("replica-b to hold the lease", T, || (holder(cluster, &lease)? == "replica-b").then_some(())).unwrap();
    let (taken_over, _) =
        wait_for("b's republication in the ConfigMap", T, || configmap(cluster, &cm).filter(|(id, _)| *id > cm_id))
            .unwrap();
    assert!(taken_over > a_id, "ids continue above the previous leader's");
    assert!(b.logs().contains("leadership changed"), "{}", b.logs());
    mapping(cluster, &ns, "m5");
    wait_for("m5 in the ConfigMap, written by b", T, || configmap(cluster, &cm).filter(|(_, n)| n.len() == 6)).unwrap();

    // A leader that dies without releasing: the new replica waits out the lease.
    let mut c = start("replica-c");
    c.wait_ready(T).unwrap();
    assert_eq!(c.metric("consul_resolver_leader"), Some(0.0));
    let pid = b.pid().unwrap();
    // SAFETY: kill(2) on the pid of a child we started and have not reaped.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    wait_for("replica-c to take over the expired lease", T, || (holder(cluster, &lease)? == "replica-c").then_some(()))
        .unwrap();
    mapping(cluster, &ns, "m6");
    wait_for("m6 in the ConfigMap, written by c", T, || configmap(cluster, &cm).filter(|(_, n)| n.len() == 7)).unwrap();
    assert!(c.terminate(T).unwrap().success(), "{}", c.logs());
}
