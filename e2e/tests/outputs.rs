//! Output isolation, black box: one publisher failing (a hook that always fails, a
//! ConfigMap the operator may not write) delays no other output. A Consul change reaches
//! `/snapshot` within the coalescing window plus 250 ms, `/readyz` is ready, and the
//! working publishers get every change; the failing one is retried on its own, seen in
//! the metrics.
//!
//! A resolver's status follows the ConfigMap: it never names a snapshot the ConfigMap does
//! not hold yet.
//!
//! The operator runs as its own process with the ServiceAccount and RBAC of manifests/.

use std::time::{Duration, Instant};

use e2e::apiserver::{ObjectRequest, object_requests};
use e2e::consul::Consul;
use e2e::fixtures::{mapping_yaml, ports, resolver_yaml};
use e2e::harness::{Cluster, Operator, unique, wait_for};
use serde_json::Value;

const T: Duration = Duration::from_secs(30);
/// The operator's default `--coalesce-window`, plus the 250 ms the issue allows.
const PROMPT: Duration = Duration::from_millis(250 + 250);

/// One team: a resolver, a Mapping, one Consul instance.
struct Team {
    ns: String,
    svc: String,
}

impl Team {
    fn new(cluster: &Cluster, consul: &Consul, prefix: &str) -> Team {
        let ns = cluster.namespace(prefix).unwrap();
        let svc = format!("{prefix}{}", unique());
        consul.register(&format!("node-{svc}"), "127.0.0.1", &svc, &format!("{svc}-1"), 22000, "passing").unwrap();
        cluster.apply(&resolver_yaml(&ns, "consul", &consul.address(), "")).unwrap();
        cluster.apply(&mapping_yaml(&ns, "m", &svc, Some("consul"))).unwrap();
        Team { ns, svc }
    }

    fn port(&self, snapshot: &Value) -> Option<Vec<u64>> {
        ports(snapshot, &self.ns, "consul", &self.svc)
    }

    /// Moves the instance to `port` and waits, at most [`PROMPT`], for `/snapshot` to say so.
    fn change_is_served_promptly(&self, op: &Operator, consul: &Consul, port: u16) {
        consul
            .register(
                &format!("node-{}", self.svc),
                "127.0.0.1",
                &self.svc,
                &format!("{}-1", self.svc),
                port,
                "passing",
            )
            .unwrap();
        let written = Instant::now();
        let want = vec![u64::from(port)];
        op.wait_snapshot("the change on /snapshot within the window + 250 ms", PROMPT, |s| {
            self.port(s).as_ref() == Some(&want)
        })
        .unwrap();
        eprintln!("port {port} served {:?} after the Consul write", written.elapsed());
    }
}

fn configmap_snapshot(cluster: &Cluster, ns: &str, name: &str) -> Option<Value> {
    let data = cluster.kubectl(&["-n", ns, "get", "configmap", name, "-o", "jsonpath={.data.snapshot\\.json}"]).ok()?;
    serde_json::from_str(&data).ok()
}

/// `--on-snapshot false`: the hook fails on every snapshot. The operator is ready, every
/// change is served at once and written to the ConfigMap; the hook is retried on its own.
#[test]
fn a_failing_hook_holds_back_neither_http_nor_the_configmap() {
    let cluster = Cluster::shared();
    let consul = Consul::shared();
    let team = Team::new(cluster, consul, "out-hook");
    let cm = format!("snap-{}", unique());
    let cm_arg = format!("consul-resolver-system/{cm}");
    let mut op =
        Operator::start(cluster, &["--namespace", &team.ns, "--on-snapshot", "false", "--snapshot-configmap", &cm_arg])
            .unwrap();
    op.wait_ready(T).unwrap();
    op.wait_snapshot("the instance", T, |s| team.port(s) == Some(vec![22000])).unwrap();
    for port in [22001, 22002, 22003] {
        team.change_is_served_promptly(&op, consul, port);
        wait_for("the change in the ConfigMap, within the window + 1 s", PROMPT + Duration::from_secs(1), || {
            let published = configmap_snapshot(cluster, "consul-resolver-system", &cm)?;
            (team.port(&published) == Some(vec![u64::from(port)])).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    }
    let failures = op.metric_sum("consul_resolver_publish_failures_total").unwrap_or(0.0);
    assert!(failures >= 1.0, "the hook's failures are counted");
    assert_eq!(op.metric("consul_resolver_publisher_failing{publisher=\"hook\"}"), Some(1.0));
    assert_eq!(op.metric("consul_resolver_publisher_failing{publisher=\"configmap\"}"), Some(0.0));
    assert!(op.terminate(T).unwrap().success(), "{}", op.logs());
}

/// A snapshot ConfigMap in a namespace the operator may not write (RBAC refuses it): the
/// operator is ready, and every change is served at once and given to the hook.
#[test]
fn a_refused_configmap_holds_back_neither_http_nor_the_hook() {
    let cluster = Cluster::shared();
    let consul = Consul::shared();
    let team = Team::new(cluster, consul, "out-cm");
    let dir = tempfile::tempdir().unwrap();
    let latest = dir.path().join("latest.json");
    // The hook (run as `CMD ID FILE`) keeps a copy of the snapshot it is given.
    let hook = dir.path().join("keep.sh");
    std::fs::write(&hook, format!("#!/bin/sh\ncp \"$2\" {0}.tmp && mv {0}.tmp {0}\n", latest.display())).unwrap();
    std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let target = format!("{}/snap", team.ns);
    let mut op = Operator::start(
        cluster,
        &["--namespace", &team.ns, "--on-snapshot", hook.to_str().unwrap(), "--snapshot-configmap", &target],
    )
    .unwrap();
    op.wait_ready(T).unwrap();
    // The file the hook is given is in a directory of the operator's own: the other tests'
    // operators, running beside it, write theirs (a shared file once gave this hook another
    // operator's snapshot).
    let hook_dir = std::env::temp_dir().join(format!("consul-resolver-operator-{}", op.pid().unwrap()));
    op.wait_snapshot("the instance", T, |s| team.port(s) == Some(vec![22000])).unwrap();
    for port in [22011, 22012, 22013] {
        team.change_is_served_promptly(&op, consul, port);
        wait_for("the change given to the hook, within the window + 1 s", PROMPT + Duration::from_secs(1), || {
            let given: Value = serde_json::from_slice(&std::fs::read(&latest).ok()?).ok()?;
            (team.port(&given) == Some(vec![u64::from(port)])).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    }
    assert_eq!(op.metric("consul_resolver_publisher_failing{publisher=\"configmap\"}"), Some(1.0));
    assert!(op.logs().contains("forbidden") || op.logs().contains("Forbidden"), "the refusal is logged with its cause");
    // A Warning Event where the ConfigMap lives, once for the streak, not per retry.
    let reasons = |type_: &str, reason: &str| {
        cluster
            .events_about(&team.ns, "snap")
            .iter()
            .filter(|e| e["type"] == type_ && e["reason"] == reason)
            .map(|e| e["message"].as_str().unwrap_or_default().to_owned())
            .collect::<Vec<_>>()
    };
    let failed = wait_for("a PublishFailed Event on the ConfigMap", T, || {
        Some(reasons("Warning", "PublishFailed")).filter(|v| !v.is_empty())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(failed[0].starts_with("configmap: ") && failed[0].contains("forbidden"), "{failed:?}");

    // Granted: the ConfigMap publisher recovers on its own, with the latest snapshot.
    cluster
        .apply(&format!(
            "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {{name: snapshot, namespace: {ns}}}\n\
             rules: [{{apiGroups: [\"\"], resources: [configmaps], verbs: [get, list, create, update, delete]}}]\n---\n\
             apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: snapshot, namespace: {ns}}}\n\
             roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: snapshot}}\n\
             subjects: [{{kind: ServiceAccount, name: consul-resolver-operator, namespace: consul-resolver-system}}]\n",
            ns = team.ns
        ))
        .unwrap();
    wait_for("the ConfigMap publisher delivering again", Duration::from_secs(60), || {
        (op.metric("consul_resolver_publisher_failing{publisher=\"configmap\"}") == Some(0.0)).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    let data = cluster
        .kubectl(&["-n", &team.ns, "get", "configmap", "snap", "-o", "jsonpath={.data.snapshot\\.json}"])
        .unwrap();
    let written: Value = serde_json::from_str(&data).unwrap();
    assert_eq!(team.port(&written), Some(vec![22013]), "the latest snapshot, not the first refused one");
    wait_for("a PublishRecovered Event on the ConfigMap", T, || {
        Some(reasons("Normal", "PublishRecovered")).filter(|v| !v.is_empty())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    assert!(hook_dir.join("snapshot.json").exists(), "the hook's file is in {}", hook_dir.display());
    assert!(op.terminate(T).unwrap().success(), "{}", op.logs());
    assert!(!hook_dir.exists(), "{} removed at exit", hook_dir.display());
}

/// Each change of a resolver's status (an instance more, so its endpoint count) is written
/// after the ConfigMap holds the snapshot the status names: the API server receives the
/// status write after it answered the ConfigMap write (the audit log, one change at a time,
/// on its one clock). Written at once, the status often came first, and a reader that
/// followed `status.lastSnapshot` to the ConfigMap found an older snapshot.
#[test]
#[cfg_attr(e2e_external_cluster, ignore = "reads the audit log: needs the suite's own control plane")]
fn a_resolver_status_is_written_after_the_configmap_holds_its_snapshot() {
    let cluster = Cluster::shared();
    let consul = Consul::shared();
    let team = Team::new(cluster, consul, "out-order");
    let (ops, cm) = ("consul-resolver-system", format!("order-{}", unique()));
    let mut op =
        Operator::start(cluster, &["--namespace", &team.ns, "--snapshot-configmap", &format!("{ops}/{cm}")]).unwrap();
    op.wait_ready(T).unwrap();
    let user = cluster.operator_username().unwrap();
    let status = || -> Option<(u64, u64)> {
        let out = cluster.kubectl(&["-n", &team.ns, "get", "consulresolver", "consul", "-o", "json"]).ok()?;
        let status = &serde_json::from_str::<Value>(&out).ok()?["status"];
        Some((status["endpoints"].as_u64()?, status["lastSnapshot"]["id"].as_u64()?))
    };
    wait_for("the resolver's status with its one instance", T, || status().filter(|(n, _)| *n == 1)).unwrap();
    for n in 2..=5u16 {
        let from = cluster.audit_events().unwrap().expect("our own cluster has an audit log").len();
        let (node, instance) = (format!("node-{}", team.svc), format!("{}-{n}", team.svc));
        consul.register(&node, "127.0.0.1", &team.svc, &instance, 22000 + n, "passing").unwrap();
        let (_, id) = wait_for("the status counting the new instance", T, || {
            status().filter(|(count, _)| *count == u64::from(n))
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
        wait_for("the ConfigMap holding that snapshot", T, || {
            configmap_snapshot(cluster, ops, &cm)?["id"].as_u64().filter(|held| *held >= id)
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
        let events = cluster.audit_events().unwrap().unwrap();
        let requests = object_requests(&events[from..], &user);
        // Other tests' operators run as the same user, with resolvers of the same name.
        let ours = |r: &&ObjectRequest| (r.namespace == ops && r.name == cm) || r.namespace == team.ns;
        let ours: Vec<&ObjectRequest> = requests.iter().filter(ours).collect();
        let written = |resource: &str| ours.iter().find(|r| r.wrote() && r.resource == resource);
        let configmap = written("configmaps").expect("the ConfigMap written");
        let status_write = written("consulresolvers").expect("the status written");
        assert!(
            status_write.received >= configmap.answered,
            "snapshot {id}: the status write was received before the ConfigMap write was answered: {ours:#?}"
        );
    }
    assert!(op.terminate(T).unwrap().success(), "{}", op.logs());
}

/// `--watch ConfigMap/NS` where the snapshot ConfigMap lives: the operator's own output
/// (index and parts) is excluded from the watch, so a publication never comes back into the
/// next snapshot (each publication would carry the previous one, growing without bound:
/// from 43 KB to 368 KB in 15 s). Other ConfigMaps there are still watched, and the
/// exclusion is logged.
#[test]
fn the_operator_never_reads_its_own_snapshot_configmaps() {
    let cluster = Cluster::shared();
    let consul = Consul::shared();
    let team = Team::new(cluster, consul, "out-self");
    let ops = "consul-resolver-system";
    // Let the operator list and watch ConfigMaps in its namespace, as a user adding that
    // `--watch` would.
    cluster
        .apply(&format!(
            "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {{name: watch-configmaps, namespace: {ops}}}\n\
             rules: [{{apiGroups: [\"\"], resources: [configmaps], verbs: [list, watch]}}]\n---\n\
             apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: watch-configmaps, namespace: {ops}}}\n\
             roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: watch-configmaps}}\n\
             subjects: [{{kind: ServiceAccount, name: consul-resolver-operator, namespace: {ops}}}]\n"
        ))
        .unwrap();
    let app = format!("app-{}", unique());
    cluster.kubectl(&["-n", ops, "create", "configmap", &app, "--from-literal=k=v"]).unwrap();
    let cm = format!("snap-{}", unique());
    let mut op = Operator::start(
        cluster,
        &[
            "--namespace",
            &team.ns,
            "--snapshot-configmap",
            &format!("{ops}/{cm}"),
            "--watch",
            &format!("ConfigMap/{ops}"),
        ],
    )
    .unwrap();
    op.wait_ready(T).unwrap();
    let names = |s: &Value| -> Vec<String> {
        s["watched"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|w| w["objects"].as_array().cloned().unwrap_or_default())
            .filter_map(|o| o["metadata"]["name"].as_str().map(str::to_owned))
            .collect()
    };
    op.wait_snapshot("the other ConfigMap, watched", T, |s| names(s).contains(&app)).unwrap();
    for port in [22021, 22022, 22023, 22024, 22025] {
        team.change_is_served_promptly(&op, consul, port);
        wait_for("the change in the ConfigMap", T, || {
            let published = configmap_snapshot(cluster, ops, &cm)?;
            (team.port(&published) == Some(vec![u64::from(port)])).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    }
    let snap = op.snapshot().unwrap();
    let own: Vec<String> = names(&snap).into_iter().filter(|n| n.starts_with("snap-")).collect();
    assert!(own.is_empty(), "snapshot ConfigMaps came back into the snapshot: {own:?}");
    assert!(op.logs().contains("consulresolver.io/snapshot"), "the exclusion is logged");
    assert!(op.terminate(T).unwrap().success(), "{}", op.logs());
}

/// The snapshot ConfigMap's writes carry their body in protobuf, which the API server reads
/// as the operator means it: each write after someone else set a label, an annotation, an
/// owner reference and a finalizer on the ConfigMap holds the new snapshot under the
/// operator's labels and annotations, and keeps theirs.
#[test]
fn what_others_set_on_the_snapshot_configmap_is_kept_by_each_write() {
    use consul_resolver_operator::snapshot_configmap::{ANNOTATION_ID, LABEL_SNAPSHOT};
    let cluster = Cluster::shared();
    let consul = Consul::shared();
    let team = Team::new(cluster, consul, "out-meta");
    let (ops, cm) = ("consul-resolver-system", format!("meta-{}", unique()));
    let mut op =
        Operator::start(cluster, &["--namespace", &team.ns, "--snapshot-configmap", &format!("{ops}/{cm}")]).unwrap();
    op.wait_ready(T).unwrap();
    let published = |port: u64| {
        wait_for("the ConfigMap holding the instance's port", T, || {
            let s = configmap_snapshot(cluster, ops, &cm)?;
            (team.port(&s) == Some(vec![port])).then_some(s)
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()))
    };
    published(22000);
    let theirs = serde_json::json!({"metadata": {
        "labels": {"team": "payments"}, "annotations": {"note": "kept ü"}, "finalizers": ["example.com/keep"],
        "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": "6c7a2b1e-0d4f-4e55-9a0b-5f3c2d1e0a9b"}]}});
    cluster.kubectl(&["-n", ops, "patch", "configmap", &cm, "--type", "merge", "-p", &theirs.to_string()]).unwrap();
    for port in [22001u16, 22002] {
        let (node, instance) = (format!("node-{}", team.svc), format!("{}-1", team.svc));
        consul.register(&node, "127.0.0.1", &team.svc, &instance, port, "passing").unwrap();
        let snapshot = published(u64::from(port));
        let live: Value =
            serde_json::from_str(&cluster.kubectl(&["-n", ops, "get", "configmap", &cm, "-o", "json"]).unwrap())
                .unwrap();
        let meta = &live["metadata"];
        assert_eq!(meta["annotations"][ANNOTATION_ID], snapshot["id"].to_string(), "{meta:#}");
        assert_eq!(meta["labels"][LABEL_SNAPSHOT], "true", "{meta:#}");
        assert_eq!(meta["labels"]["team"], "payments", "{meta:#}");
        assert_eq!(meta["annotations"]["note"], "kept ü", "{meta:#}");
        assert_eq!(meta["finalizers"], serde_json::json!(["example.com/keep"]), "{meta:#}");
        assert_eq!(meta["ownerReferences"], theirs["metadata"]["ownerReferences"], "{meta:#}");
    }
    let release = r#"[{"op": "remove", "path": "/metadata/finalizers"}]"#;
    cluster.kubectl(&["-n", ops, "patch", "configmap", &cm, "--type", "json", "-p", release]).unwrap();
    assert!(op.terminate(T).unwrap().success(), "{}", op.logs());
}
