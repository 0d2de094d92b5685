//! Leader election, black box: two operator processes on one Lease. Both serve snapshots;
//! only the holder writes the ConfigMap; a holder that stops hands over at once, and one
//! that dies is replaced after the lease duration.

use std::time::Duration;

use e2e::fixtures::{mapping_yaml, resolver_yaml};
use e2e::harness::{Cluster, Operator, free_port, unique, wait_for};
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

/// A leader stopped before its first snapshot (its resolver's Consul does not answer, so
/// the world is not complete and nothing was published) has no write in flight: it exits
/// and releases the Lease at once, so a successor takes over at once, rather than when the
/// shutdown's whole budget for writes in flight has passed.
#[test]
fn a_leader_stopped_before_its_first_snapshot_exits_and_hands_over_at_once() {
    let cluster = Cluster::shared();
    let ns = cluster.namespace("early-stop").unwrap();
    let (lease, cm) = (format!("lease-{}", unique()), format!("snap-{}", unique()));
    // Nothing listens there: every Consul request is refused, and the first snapshot
    // waits for its answer (up to the 30 s bootstrap timeout).
    let silent = format!("127.0.0.1:{}", free_port());
    cluster.apply(&resolver_yaml(&ns, "consul", &silent, "")).unwrap();
    cluster.apply(&mapping_yaml(&ns, "m", "svc-m", Some("consul"))).unwrap();
    let args = [
        "--namespace",
        &ns,
        "--snapshot-configmap",
        &format!("{SYSTEM}/{cm}"),
        "--leader-election-lease",
        &format!("{SYSTEM}/{lease}"),
        "--leader-election-identity",
        "early",
    ]
    .map(str::to_owned);
    let mut op = Operator::start(cluster, &args.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
    wait_for("the leader to hold the lease", T, || (holder(cluster, &lease)? == "early").then_some(())).unwrap();
    wait_for("the leader to ask its Consul", T, || {
        op.metric_sum("consul_resolver_consul_requests_total").filter(|&n| n > 0.0)
    })
    .unwrap();
    assert_eq!(op.get("/readyz").map(|r| r.0), Some(503), "published before the test stopped it\n{}", op.logs());

    let signalled = std::time::Instant::now();
    let status = op.terminate(T).unwrap();
    let exited = signalled.elapsed();
    let released = wait_for("the lease released", T, || holder(cluster, &lease).filter(|h| h.is_empty()).map(|_| ()))
        .map(|()| signalled.elapsed());
    assert!(status.success(), "exit status {status}\n{}", op.logs());
    assert!(
        exited < Duration::from_secs(5),
        "exited {exited:?} after SIGTERM with nothing in flight (writes in flight have 15 s of it)\n{}",
        op.logs()
    );
    assert!(
        released.as_ref().is_ok_and(|r| *r < Duration::from_secs(5)),
        "lease released after {released:?}\n{}",
        op.logs()
    );
    assert!(!op.logs().contains("in flight cut off"), "nothing was in flight to cut off\n{}", op.logs());
}
