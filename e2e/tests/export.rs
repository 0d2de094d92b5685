//! Exports (ConsulService), black box against the real API server: the operator runs as
//! its own process with the ServiceAccount and RBAC of manifests/ (exports granted per
//! namespace), Consul is changed only through its HTTP API. What consumers depend on
//! (docs/export.md): a Service without a selector, slices found by
//! `kubernetes.io/service-name` and managed by us, owned by the Service, at most 100
//! endpoints each, grouped by port set, canonical IPv4 addresses only, ready from Consul
//! health; few writes; a conflict, a lost resolver and a deleted export handled; and, asked
//! for, an Endpoints object that kube-controller-manager's mirroring controller leaves alone.
//!
//! Addresses are from the documentation ranges (RFC 5737), and from 10.42.0.0/16 where
//! more than 254 are needed: they are data here, nothing connects to them
//! (e2e/tests/kube_proxy.rs routes real traffic, inside a namespace).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use e2e::consul::{Consul, Instance};
use e2e::fixtures::{export_yaml, mapping_yaml, resolver_yaml, secret_yaml, slice_addresses as addresses, slices};
use e2e::harness::{Cluster, ControllerManager, Operator, unique, wait_for};
use serde_json::Value;

const T: Duration = Duration::from_secs(60);

fn get_json(cluster: &Cluster, args: &[&str]) -> Option<Value> {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    serde_json::from_str(&cluster.kubectl(&all).ok()?).ok()
}

fn export_status(cluster: &Cluster, ns: &str, name: &str) -> Option<Value> {
    get_json(cluster, &["-n", ns, "get", "consulservice", name]).map(|o| o["status"].clone())
}

fn condition(status: &Value, type_: &str) -> Option<(String, String)> {
    let c = status["conditions"].as_array()?.iter().find(|c| c["type"] == type_)?;
    Some((c["status"].as_str()?.to_owned(), c["reason"].as_str()?.to_owned()))
}

fn versions(slices: &BTreeMap<String, Value>) -> BTreeMap<String, String> {
    slices
        .iter()
        .map(|(n, s)| (n.clone(), s["metadata"]["resourceVersion"].as_str().unwrap_or_default().to_owned()))
        .collect()
}

fn instance(svc: &str, i: usize, port: u16, status: &str) -> Instance {
    Instance {
        node: format!("node-{svc}-{i}"),
        address: format!("192.0.2.{}", i + 1),
        service: svc.to_owned(),
        id: format!("{svc}-{i}"),
        port,
        status: status.to_owned(),
        ..Instance::default()
    }
}

/// A namespace where exports are granted, with a resolver `consul` of the shared Consul.
fn team(cluster: &Cluster, consul: &Consul, prefix: &str) -> String {
    let ns = cluster.namespace(prefix).unwrap();
    cluster.grant_exports(&ns).unwrap();
    cluster.apply(&resolver_yaml(&ns, "consul", &consul.address(), "")).unwrap();
    ns
}

/// The slices of `after` whose resourceVersion is not the one in `before`: written since.
fn written_since(before: &BTreeMap<String, String>, after: &BTreeMap<String, Value>) -> Vec<(String, String)> {
    versions(after).into_iter().filter(|(n, v)| before.get(n) != Some(v)).collect()
}

/// 250 passing instances of `svc`, the first with a Consul locality, then the bad input:
/// a loopback node (agentless Consul), a hostname, an IPv6 address. Returns the 250.
fn register_250_and_three_unusable(consul: &Consul, svc: &str) -> Vec<Instance> {
    let mut all: Vec<Instance> = (0..250).map(|i| instance(svc, i, 8080, "passing")).collect();
    // One with a Consul locality: its endpoint carries the zone.
    all[0].zone = Some("zone-a".into());
    consul.register_many(&all, 16).unwrap();
    for (id, address) in [("lo", "127.0.0.1"), ("host", "db.node.consul"), ("v6", "2001:db8::5")] {
        consul.register(&format!("node-{svc}-{id}"), address, svc, &format!("{svc}-{id}"), 8080, "passing").unwrap();
    }
    all
}

/// As OpenShift and OKD enforce owner references: every write the operator makes passes
/// it with the shipped RBAC.
fn assert_the_apiserver_enforces_owner_references(cluster: &Cluster) {
    if let Some(pid) = cluster.apiserver_pid() {
        let cmdline = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        assert!(cmdline.contains("OwnerReferencesPermissionEnforcement"), "the API server enforces owner references");
    }
}

/// The export `web` Ready with the 250 in 3 slices, the three unusable ones excluded with
/// their reasons, as its status and `kubectl get csvc -A` show.
fn assert_exported_with_the_unusable_excluded(cluster: &Cluster, op: &Operator, ns: &str, svc: &str) {
    let status = wait_for("the export Ready with 250 endpoints in 3 slices", T, || {
        let s = export_status(cluster, ns, "web")?;
        (condition(&s, "Ready")? == ("True".into(), "Exported".into()) && s["endpoints"] == 250 && s["slices"] == 3)
            .then_some(s)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    assert_eq!(status["excluded"], 3, "{status}");
    let reasons: Vec<&str> =
        status["excludedInstances"].as_array().unwrap().iter().map(|x| x["reason"].as_str().unwrap()).collect();
    for want in ["loopback address", "not an IP address", "not an IPv4 address"] {
        assert!(reasons.iter().any(|r| r.starts_with(want)), "{want:?} in {reasons:?}");
    }
    assert_eq!(condition(&status, "Conflict").unwrap().0, "False");
    // What `kubectl get csvc -A` shows (the CRD's printer columns).
    let table = cluster.kubectl(&["get", "csvc", "-A"]).unwrap();
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["NAMESPACE", "NAME", "READY", "CONSUL", "ENDPOINTS", "EXCLUDED", "SLICES", "AGE"], "{table}");
    let row = table.lines().find(|l| l.starts_with(&format!("{ns} "))).unwrap_or_else(|| panic!("{table}"));
    let row: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(row[1..7], ["web", "True", svc, "250", "3", "3"], "{table}");
}

/// The Service: ours, without a selector, owned by the export. Returns it.
fn assert_a_selectorless_service_owned_by_the_export(cluster: &Cluster, ns: &str) -> Value {
    let export = get_json(cluster, &["-n", ns, "get", "consulservice", "web"]).unwrap();
    let service = get_json(cluster, &["-n", ns, "get", "service", "web"]).unwrap();
    assert!(service["spec"].get("selector").is_none(), "{service}");
    assert_eq!(service["spec"]["ports"][0]["name"], "http");
    assert_eq!(service["spec"]["ports"][0]["port"], 80);
    let owner = &service["metadata"]["ownerReferences"][0];
    assert_eq!(
        (owner["kind"].as_str(), owner["uid"].as_str()),
        (Some("ConsulService"), export["metadata"]["uid"].as_str())
    );
    service
}

/// The slices: the rules consumers depend on. At most 100 endpoints each, ours, owned by
/// `service`, one IPv4 address an endpoint, ready, the zone only where Consul has one.
fn assert_the_slices_keep_the_rules(found: &BTreeMap<String, Value>, service: &Value) {
    let mut sizes: Vec<usize> = found.values().map(|s| s["endpoints"].as_array().unwrap().len()).collect();
    sizes.sort();
    assert_eq!(sizes, [50, 100, 100]);
    for s in found.values() {
        assert_eq!(s["addressType"], "IPv4");
        assert_eq!(
            s["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"],
            "consul-resolver-operator.consulresolver.io"
        );
        assert_eq!(
            s["ports"],
            serde_json::json!([{"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"}])
        );
        let owner = &s["metadata"]["ownerReferences"][0];
        assert_eq!(
            (owner["kind"].as_str(), owner["uid"].as_str()),
            (Some("Service"), service["metadata"]["uid"].as_str())
        );
        assert_eq!(owner["controller"], true);
        for e in s["endpoints"].as_array().unwrap() {
            assert_eq!(e["addresses"].as_array().unwrap().len(), 1);
            // v1beta1 (this API server) keeps the zone in `topology`.
            let zone = e["topology"]["topology.kubernetes.io/zone"].as_str();
            assert_eq!(zone.is_some(), e["addresses"][0] == "192.0.2.1", "only the instance with a locality: {e}");
            assert_eq!(e["conditions"]["ready"], true);
            // kube-proxy would follow hints on its own once every endpoint had one.
            assert!(e.get("hints").is_none(), "no zone hints unless the export asks: {e}");
            assert!(
                e.get("nodeName").is_none()
                    && e.get("topology").is_none_or(|t| t.get("kubernetes.io/hostname").is_none())
            );
        }
    }
    assert_eq!(addresses(found).len(), 250);
}

/// One instance turns critical: out, and only its slice of `found` is written. Then back,
/// writing only that slice again.
fn flip_one_instance_and_back(
    cluster: &Cluster,
    consul: &Consul,
    ns: &str,
    found: &BTreeMap<String, Value>,
    all: &mut [Instance],
) {
    let before = versions(found);
    let flipped = "192.0.2.8".to_owned();
    all[7].status = "critical".into();
    consul.register_many(&all[7..8], 1).unwrap();
    let after = wait_for("the critical instance out of the slices", T, || {
        let now = slices(cluster, ns, "web");
        (addresses(&now).len() == 249 && !addresses(&now).contains(&flipped)).then_some(now)
    })
    .unwrap();
    let changed = written_since(&before, &after);
    assert_eq!(changed.len(), 1, "one slice written for one instance: {changed:?}");
    all[7].status = "passing".into();
    consul.register_many(&all[7..8], 1).unwrap();
    let back = wait_for("the instance back", T, || {
        let now = slices(cluster, ns, "web");
        addresses(&now).contains(&flipped).then_some(now)
    })
    .unwrap();
    let changed = written_since(&versions(&after), &back);
    assert_eq!(changed.len(), 1, "one slice written for one instance: {changed:?}");
}

/// Ten instances move to another port: a slice of their own (all of a slice's endpoints
/// share its ports), under the same Service port name. And back.
fn move_ten_to_another_port_and_back(cluster: &Cluster, consul: &Consul, ns: &str, all: &mut [Instance]) {
    for i in all.iter_mut().take(10) {
        i.port = 9090;
    }
    consul.register_many(&all[..10], 4).unwrap();
    wait_for("a slice of the ten on port 9090", T, || {
        let now = slices(cluster, ns, "web");
        let moved = now.values().find(|s| s["ports"][0]["port"] == 9090)?;
        (moved["endpoints"].as_array()?.len() == 10
            && moved["ports"][0]["name"] == "http"
            && addresses(&now).len() == 250)
            .then_some(())
    })
    .unwrap();
    for i in all.iter_mut().take(10) {
        i.port = 8080;
    }
    consul.register_many(&all[..10], 4).unwrap();
    wait_for("the ten back among the others, their slice gone", T, || {
        let now = slices(cluster, ns, "web");
        (now.values().all(|s| s["ports"][0]["port"] == 8080) && addresses(&now).len() == 250).then_some(())
    })
    .unwrap();
}

/// What the operator sent for the export: only the verbs of the export role, never a
/// watch of Services or slices, and never an update (writes are server-side apply).
fn assert_only_the_export_roles_verbs_were_sent(cluster: &Cluster, ns: &str) {
    let (Some(events), Ok(user)) = (cluster.audit_events().unwrap(), cluster.operator_username()) else { return };
    let verbs: std::collections::BTreeSet<(String, String)> = events
        .iter()
        .filter(|e| e["user"]["username"] == user.as_str() && e["objectRef"]["namespace"] == ns)
        .filter(|e| matches!(e["objectRef"]["resource"].as_str(), Some("services" | "endpointslices")))
        .map(|e| (e["objectRef"]["resource"].as_str().unwrap().to_owned(), e["verb"].as_str().unwrap().to_owned()))
        .collect();
    let allowed = [
        ("services", "get"),
        ("services", "patch"),
        ("services", "delete"),
        ("endpointslices", "list"),
        ("endpointslices", "patch"),
        ("endpointslices", "delete"),
    ];
    for (resource, verb) in &verbs {
        assert!(
            allowed.contains(&(resource.as_str(), verb.as_str())),
            "the operator sent {verb} {resource}: {verbs:?}"
        );
    }
    assert!(verbs.contains(&("endpointslices".into(), "patch".into())), "{verbs:?}");
}

#[test]
fn an_export_is_a_selectorless_service_and_slices_that_follow_consul_with_few_writes() {
    let (cluster, consul) = (Cluster::shared(), Consul::shared());
    let ns = team(cluster, consul, "export");
    let svc = format!("web{}", unique());
    let mut all = register_250_and_three_unusable(consul, &svc);
    let ports = "  ports: [{name: http, port: 80, appProtocol: http}]\n";
    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", ports)).unwrap();
    let mut op = Operator::start(cluster, &["--namespace", &ns]).unwrap();
    op.wait_ready(T).unwrap();
    assert_the_apiserver_enforces_owner_references(cluster);

    assert_exported_with_the_unusable_excluded(cluster, &op, &ns, &svc);
    let service = assert_a_selectorless_service_owned_by_the_export(cluster, &ns);
    let found = slices(cluster, &ns, "web");
    assert_the_slices_keep_the_rules(&found, &service);
    flip_one_instance_and_back(cluster, consul, &ns, &found, &mut all);
    move_ten_to_another_port_and_back(cluster, consul, &ns, &mut all);

    // The export deleted: its Service and slices go (this test cluster runs no garbage
    // collector; the operator removes them itself).
    cluster.kubectl(&["-n", &ns, "delete", "consulservice", "web"]).unwrap();
    wait_for("the Service and slices removed", T, || {
        let gone = cluster.kubectl(&["-n", &ns, "get", "service", "web"]).is_err();
        (gone && slices(cluster, &ns, "web").is_empty()).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    op.terminate(T).unwrap();
    assert_only_the_export_roles_verbs_were_sent(cluster, &ns);
}

#[test]
fn endpoints_kept_while_consul_cannot_be_read_are_marked_stale_and_back() {
    let (cluster, consul) = (Cluster::shared(), Consul::shared());
    let ns = team(cluster, consul, "export-stale");
    let svc = format!("web{}", unique());
    consul.register_many(&[instance(&svc, 0, 8080, "passing"), instance(&svc, 1, 8080, "passing")], 2).unwrap();
    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", "")).unwrap();
    let mut op = Operator::start(cluster, &["--namespace", &ns]).unwrap();
    wait_for("exported", T, || (addresses(&slices(cluster, &ns, "web")).len() == 2).then_some(()))
        .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));

    // The resolver now points where nothing answers: the endpoints last obtained are kept
    // (the Service does not go empty), and say so.
    let dead = format!("127.0.0.1:{}", e2e::harness::free_port());
    cluster.apply(&resolver_yaml(&ns, "consul", &dead, "")).unwrap();
    let status = wait_for("the slices marked stale", T, || {
        let s = export_status(cluster, &ns, "web")?;
        let found = slices(cluster, &ns, "web");
        let marked = found.values().all(|s| s["metadata"]["annotations"]["consulresolver.io/stale-since"].is_string());
        (marked && condition(&s, "Ready")? == ("False".into(), "Stale".into())).then_some(s)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    assert_eq!(addresses(&slices(cluster, &ns, "web")).len(), 2, "kept, not emptied");
    assert!(status["stale"]["reason"].as_str().is_some_and(|r| r.contains("address")), "{status}");
    let since =
        op.metric(&format!("consul_resolver_export_stale_since_timestamp_seconds{{name=\"web\",namespace=\"{ns}\"}}"));
    assert!(since.is_some_and(|t| t > 1.7e9), "the stale metric: {since:?}");

    // Back: current again, the marks gone, the metric too.
    cluster.apply(&resolver_yaml(&ns, "consul", &consul.address(), "")).unwrap();
    wait_for("current again", T, || {
        let s = export_status(cluster, &ns, "web")?;
        let found = slices(cluster, &ns, "web");
        let clean = found.values().all(|s| s["metadata"]["annotations"].get("consulresolver.io/stale-since").is_none());
        (clean && condition(&s, "Ready")?.0 == "True").then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    assert!(op.metric_sum("consul_resolver_export_stale_since_timestamp_seconds").is_some_and(|v| v == 0.0));
    op.terminate(T).unwrap();
}

#[test]
fn a_service_that_is_not_ours_is_left_alone_until_it_goes() {
    let (cluster, consul) = (Cluster::shared(), Consul::shared());
    let ns = team(cluster, consul, "export-conflict");
    let svc = format!("web{}", unique());
    consul.register_many(&[instance(&svc, 0, 8080, "passing")], 1).unwrap();
    let theirs = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: taken, namespace: {ns}}}\nspec: {{selector: {{app: taken}}, ports: [{{port: 80}}]}}\n"
    );
    cluster.apply(&theirs).unwrap();
    let rv = get_json(cluster, &["-n", &ns, "get", "service", "taken"]).unwrap()["metadata"]["resourceVersion"].clone();
    cluster.apply(&export_yaml(&ns, "taken", &svc, "consul", "")).unwrap();
    let mut op = Operator::start(cluster, &["--namespace", &ns]).unwrap();
    wait_for("Conflict=True", T, || {
        let s = export_status(cluster, &ns, "taken")?;
        (condition(&s, "Conflict")? == ("True".into(), "ServiceExists".into())).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    let now = get_json(cluster, &["-n", &ns, "get", "service", "taken"]).unwrap();
    assert_eq!(now["metadata"]["resourceVersion"], rv, "their Service was written");
    assert!(slices(cluster, &ns, "taken").is_empty(), "slices written for someone else's Service");

    // Their Service goes: the export takes the name.
    cluster.kubectl(&["-n", &ns, "delete", "service", "taken"]).unwrap();
    // A resync would notice too; a change of the export itself is the prompt way.
    cluster.kubectl(&["-n", &ns, "annotate", "consulservice", "taken", "poke=1"]).unwrap();
    wait_for("exported, without conflict", T, || {
        let s = export_status(cluster, &ns, "taken")?;
        (condition(&s, "Conflict")?.0 == "False" && condition(&s, "Ready")?.0 == "True").then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    assert_eq!(addresses(&slices(cluster, &ns, "taken")), ["192.0.2.1"]);
    op.terminate(T).unwrap();
}

#[test]
fn an_export_where_the_operator_may_not_write_says_forbidden_and_recovers_with_the_grant() {
    let (cluster, consul) = (Cluster::shared(), Consul::shared());
    let ns = cluster.namespace("export-denied").unwrap();
    cluster.apply(&resolver_yaml(&ns, "consul", &consul.address(), "")).unwrap();
    let svc = format!("web{}", unique());
    consul.register_many(&[instance(&svc, 0, 8080, "passing")], 1).unwrap();
    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", "")).unwrap();
    let mut op = Operator::start(cluster, &["--namespace", &ns]).unwrap();
    let status = wait_for("Exported=False, forbidden", T, || {
        let s = export_status(cluster, &ns, "web")?;
        (condition(&s, "Exported")? == ("False".into(), "WriteFailed".into())).then_some(s)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    assert!(status.to_string().contains("forbidden"), "{status}");
    // The documented grant: exported at the next retry.
    cluster.grant_exports(&ns).unwrap();
    wait_for("exported once granted", T, || {
        let s = export_status(cluster, &ns, "web")?;
        (condition(&s, "Ready")?.0 == "True" && addresses(&slices(cluster, &ns, "web")).len() == 1).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    op.terminate(T).unwrap();
}

#[test]
fn a_resolver_deleted_empties_the_export_and_back() {
    let (cluster, consul) = (Cluster::shared(), Consul::shared());
    let ns = team(cluster, consul, "export-resolver");
    let svc = format!("web{}", unique());
    consul.register_many(&[instance(&svc, 0, 8080, "passing"), instance(&svc, 1, 8080, "passing")], 2).unwrap();
    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", "")).unwrap();
    // A Mapping reads the same Consul service: still one watch.
    cluster.apply(&mapping_yaml(&ns, "m", &svc, Some("consul"))).unwrap();
    let mut op = Operator::start(cluster, &["--namespace", &ns]).unwrap();
    wait_for("two endpoints exported", T, || (addresses(&slices(cluster, &ns, "web")).len() == 2).then_some(()))
        .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    let service = get_json(cluster, &["-n", &ns, "get", "service", "web"]).unwrap();
    assert_eq!(service["spec"]["ports"][0]["name"], "tcp-8080", "without spec.ports, one port per instance port");
    let watches = op.metric_sum("consul_resolver_consul_watches").unwrap();
    assert_eq!(watches, 1.0, "the Mapping and the export share one Consul watch");

    cluster.kubectl(&["-n", &ns, "delete", "consulresolver", "consul"]).unwrap();
    wait_for("the slices removed, and the status saying why", T, || {
        let s = export_status(cluster, &ns, "web")?;
        (slices(cluster, &ns, "web").is_empty() && condition(&s, "Ready")?.1 == "ResolverUnavailable").then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    assert!(cluster.kubectl(&["-n", &ns, "get", "service", "web"]).is_ok(), "the Service stays with its export");

    cluster.apply(&resolver_yaml(&ns, "consul", &consul.address(), "")).unwrap();
    wait_for("exported again", T, || {
        let s = export_status(cluster, &ns, "web")?;
        (addresses(&slices(cluster, &ns, "web")).len() == 2 && condition(&s, "Ready")?.0 == "True").then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    op.terminate(T).unwrap();
}

#[test]
fn two_operators_with_different_ambassador_ids_never_touch_each_others_exports() {
    let (cluster, consul) = (Cluster::shared(), Consul::shared());
    let ns = cluster.namespace("export-two").unwrap();
    cluster.grant_exports(&ns).unwrap();
    let svc = format!("web{}", unique());
    consul.register_many(&[instance(&svc, 0, 8080, "passing")], 1).unwrap();
    for id in ["a", "b"] {
        let ids = format!("  ambassadorId: [{id}]\n");
        cluster.apply(&resolver_yaml(&ns, &format!("consul-{id}"), &consul.address(), &ids)).unwrap();
        let spec = format!("  ambassadorId: [{id}]\n");
        cluster.apply(&export_yaml(&ns, &format!("web-{id}"), &svc, &format!("consul-{id}"), &spec)).unwrap();
    }
    let mut a = Operator::start(cluster, &["--namespace", &ns, "--ambassador-id", "a"]).unwrap();
    let mut b = Operator::start(cluster, &["--namespace", &ns, "--ambassador-id", "b"]).unwrap();
    for id in ["a", "b"] {
        wait_for("both exported", T, || (slices(cluster, &ns, &format!("web-{id}")).len() == 1).then_some(()))
            .unwrap_or_else(|e| panic!("{e}\n{}\n{}", a.logs(), b.logs()));
        let s = slices(cluster, &ns, &format!("web-{id}"));
        let labels = &s.values().next().unwrap()["metadata"]["labels"];
        assert_eq!(labels["consulresolver.io/ambassador-id"], id);
    }
    let b_before = versions(&slices(cluster, &ns, "web-b"));
    cluster.kubectl(&["-n", &ns, "delete", "consulservice", "web-a"]).unwrap();
    wait_for("web-a removed by its operator", T, || slices(cluster, &ns, "web-a").is_empty().then_some(())).unwrap();
    assert_eq!(versions(&slices(cluster, &ns, "web-b")), b_before, "operator a touched b's slices");
    assert!(cluster.kubectl(&["-n", &ns, "get", "service", "web-b"]).is_ok());
    a.terminate(T).unwrap();
    b.terminate(T).unwrap();
}

/// All of `slices` carry the stale marks.
fn all_marked_stale(slices: &BTreeMap<String, Value>) -> bool {
    !slices.is_empty()
        && slices.values().all(|s| s["metadata"]["annotations"]["consulresolver.io/stale-since"].is_string())
}

fn none_marked_stale(slices: &BTreeMap<String, Value>) -> bool {
    slices.values().all(|s| s["metadata"]["annotations"].get("consulresolver.io/stale-since").is_none())
}

/// After a restart without an answer of its own: the export held (`addresses` kept, marked
/// stale, `Ready=False` `Stale` naming `reason`) until `--bootstrap-timeout` (5 s) has long
/// passed. Checked every half second for 15 s from the restart: holding is a duration, not
/// a condition to wait for.
fn held_past_the_bootstrap_timeout(cluster: &Cluster, op: &Operator, ns: &str, want: &[String], reason: &str) {
    let restarted = Instant::now();
    let status = wait_for("the export held, marked stale", T, || {
        let s = export_status(cluster, ns, "web")?;
        let found = slices(cluster, ns, "web");
        (all_marked_stale(&found) && condition(&s, "Ready")? == ("False".into(), "Stale".into())).then_some(s)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    assert!(status["stale"]["reason"].as_str().is_some_and(|r| r.contains(reason)), "{status}");
    assert_eq!(status["endpoints"], want.len(), "{status}");
    while restarted.elapsed() < Duration::from_secs(15) {
        let found = slices(cluster, ns, "web");
        assert_eq!(addresses(&found), want, "{:?} after the restart\n{}", restarted.elapsed(), op.logs());
        assert!(all_marked_stale(&found), "{:?} after the restart: {found:?}", restarted.elapsed());
        std::thread::sleep(Duration::from_millis(500)); // the hold's own length, sampled
    }
}

/// The export Ready with exactly `want`, unmarked.
fn wait_current(cluster: &Cluster, op: &Operator, ns: &str, want: &[String]) {
    wait_for("the export current, following Consul", T, || {
        let s = export_status(cluster, ns, "web")?;
        let found = slices(cluster, ns, "web");
        (addresses(&found) == want && none_marked_stale(&found) && condition(&s, "Ready")?.0 == "True").then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{:?}\n{}", export_status(cluster, ns, "web"), op.logs()));
}

/// The operator restarted while Consul is down (a rolling update, a drain or an upgrade
/// during an incident): the new process has no answer of its own, and the cluster's slices
/// are the last known good. They are held, marked stale, well past `--bootstrap-timeout`,
/// and followed again once Consul answers.
#[test]
#[cfg_attr(e2e_real_consul, ignore = "stops and replaces Consul: needs the simulator")]
fn an_operator_restarted_while_consul_is_down_keeps_the_export_then_follows_consul() {
    let cluster = Cluster::shared();
    let sim = consul_sim::Simulator::start_background(consul_sim::Config::default()).unwrap();
    let addr = sim.addr();
    let mut consul = Consul { base_url: sim.base_url(), token: None, sim: Some(sim) };
    let ns = team(cluster, &consul, "export-restart");
    let svc = format!("web{}", unique());
    let all: Vec<Instance> = (0..4).map(|i| instance(&svc, i, 8080, "passing")).collect();
    consul.register_many(&all, 4).unwrap();
    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", "")).unwrap();
    let mut op = Operator::start(cluster, &["--namespace", &ns]).unwrap();
    let four: Vec<String> = (1..=4).map(|i| format!("192.0.2.{i}")).collect();
    wait_current(cluster, &op, &ns, &four);
    op.terminate(T).unwrap();

    drop(consul.sim.take());
    let mut op = Operator::start(cluster, &["--namespace", &ns, "--bootstrap-timeout", "5s"]).unwrap();
    held_past_the_bootstrap_timeout(cluster, &op, &ns, &four, "");

    // Back on the same address, with one instance fewer: followed, the marks gone.
    let back = wait_for("the address to be free again", Duration::from_secs(10), || {
        consul_sim::Simulator::start_background(consul_sim::Config { listen: addr, ..consul_sim::Config::default() })
            .ok()
    })
    .unwrap();
    consul.sim = Some(back);
    consul.register_many(&all[..3], 3).unwrap();
    wait_current(cluster, &op, &ns, &four[..3]);
    op.terminate(T).unwrap();
}

/// The same when Consul answers but refuses the token (revoked, rotated wrongly): a 403 is
/// a problem of the resolver, not an answer that the service has no instances.
#[test]
#[cfg_attr(e2e_consul_without_acls, ignore = "needs a Consul that enforces ACLs (E2E_CONSUL_TOKEN)")]
fn an_operator_restarted_while_its_token_is_refused_keeps_the_export_then_follows_consul() {
    let cluster = Cluster::shared();
    let (consul, reader) = Consul::with_acls().unwrap();
    let ns = cluster.namespace("export-token").unwrap();
    cluster.grant_exports(&ns).unwrap();
    cluster.grant_secrets(&ns).unwrap();
    cluster.apply(&secret_yaml(&ns, "acl", &reader)).unwrap();
    let token_ref = "  tokenSecretRef: {name: acl, key: token}\n";
    cluster.apply(&resolver_yaml(&ns, "consul", &consul.address(), token_ref)).unwrap();
    let svc = format!("web{}", unique());
    let all: Vec<Instance> = (0..4).map(|i| instance(&svc, i, 8080, "passing")).collect();
    consul.register_many(&all, 4).unwrap();
    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", "")).unwrap();
    let mut op = Operator::start(cluster, &["--namespace", &ns]).unwrap();
    let four: Vec<String> = (1..=4).map(|i| format!("192.0.2.{i}")).collect();
    wait_current(cluster, &op, &ns, &four);
    op.terminate(T).unwrap();

    cluster.apply(&secret_yaml(&ns, "acl", &format!("revoked-{}", unique()))).unwrap();
    let mut op = Operator::start(cluster, &["--namespace", &ns, "--bootstrap-timeout", "5s"]).unwrap();
    held_past_the_bootstrap_timeout(cluster, &op, &ns, &four, "ACL token rejected");

    // Meanwhile one instance left; the token fixed: followed.
    consul.deregister(&all[3].node, &all[3].id).unwrap();
    cluster.apply(&secret_yaml(&ns, "acl", &reader)).unwrap();
    wait_current(cluster, &op, &ns, &four[..3]);
    op.terminate(T).unwrap();
}

/// An export moved to another operator (`spec.ambassadorId`): the one that served it
/// removes its Service and slices, so the new one can take the name (it would otherwise
/// find a Service that is not its own and leave it alone, frozen).
#[test]
fn an_export_moved_to_another_ambassador_id_is_released_and_taken_over() {
    let (cluster, consul) = (Cluster::shared(), Consul::shared());
    let ns = cluster.namespace("export-move").unwrap();
    cluster.grant_exports(&ns).unwrap();
    let both = "  ambassadorId: [default, b]\n";
    cluster.apply(&resolver_yaml(&ns, "consul", &consul.address(), both)).unwrap();
    let svc = format!("web{}", unique());
    consul.register_many(&[instance(&svc, 0, 8080, "passing"), instance(&svc, 1, 8080, "passing")], 2).unwrap();
    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", "")).unwrap();
    let mut a = Operator::start(cluster, &["--namespace", &ns]).unwrap();
    let mut b = Operator::start(cluster, &["--namespace", &ns, "--ambassador-id", "b"]).unwrap();
    let two = ["192.0.2.1".to_owned(), "192.0.2.2".to_owned()];
    wait_current(cluster, &a, &ns, &two);
    let instance_of =
        |o: &Value| o["metadata"]["labels"]["consulresolver.io/ambassador-id"].as_str().map(str::to_owned);
    let service = get_json(cluster, &["-n", &ns, "get", "service", "web"]).unwrap();
    assert_eq!(instance_of(&service).as_deref(), Some("default"));

    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", "  ambassadorId: [b]\n")).unwrap();
    wait_for("the export taken over by operator b", T, || {
        let service = get_json(cluster, &["-n", &ns, "get", "service", "web"])?;
        let found = slices(cluster, &ns, "web");
        let all_b = !found.is_empty() && found.values().all(|s| instance_of(s).as_deref() == Some("b"));
        (instance_of(&service).as_deref() == Some("b") && all_b && addresses(&found) == two).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{:?}\n{}\n{}", export_status(cluster, &ns, "web"), a.logs(), b.logs()));
    a.terminate(T).unwrap();
    b.terminate(T).unwrap();
}

/// An edit that makes the spec unusable (here two ports of one name, which the schema
/// cannot catch) does not take the traffic away: the status says `InvalidSpec`, the slices
/// are held and marked stale; fixed, the export follows Consul again.
#[test]
fn an_export_whose_spec_becomes_invalid_holds_its_endpoints_marked_stale_and_back() {
    let (cluster, consul) = (Cluster::shared(), Consul::shared());
    let ns = team(cluster, consul, "export-invalid");
    let svc = format!("web{}", unique());
    consul.register_many(&[instance(&svc, 0, 8080, "passing"), instance(&svc, 1, 8080, "passing")], 2).unwrap();
    let good = "  ports: [{name: http, port: 80}]\n";
    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", good)).unwrap();
    let mut op = Operator::start(cluster, &["--namespace", &ns]).unwrap();
    let two = ["192.0.2.1".to_owned(), "192.0.2.2".to_owned()];
    wait_current(cluster, &op, &ns, &two);

    let bad = "  ports: [{name: http, port: 80}, {name: http, port: 81}]\n";
    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", bad)).unwrap();
    let status = wait_for("InvalidSpec, the slices held and marked stale", T, || {
        let s = export_status(cluster, &ns, "web")?;
        let found = slices(cluster, &ns, "web");
        (condition(&s, "Ready")?.1 == "InvalidSpec" && all_marked_stale(&found)).then_some(s)
    })
    .unwrap_or_else(|e| panic!("{e}\n{:?}\n{}", export_status(cluster, &ns, "web"), op.logs()));
    assert_eq!(addresses(&slices(cluster, &ns, "web")), two, "held, not emptied");
    assert!(status["stale"]["reason"].as_str().is_some_and(|r| r.contains("spec.ports[1].name")), "{status}");

    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", good)).unwrap();
    wait_current(cluster, &op, &ns, &two);
    op.terminate(T).unwrap();
}

/// The export's `serviceLabels` and `serviceAnnotations` are on its Service (what a
/// ServiceMonitor selects by, what external-dns reads), follow a change, and go when dropped
/// from the export, while a label someone else put on the Service stays. A key of the
/// operator's own is refused (`InvalidSpec`, naming it), and the Service keeps the
/// operator's value.
#[test]
fn an_exports_labels_and_annotations_are_on_its_service_follow_it_and_go() {
    let (cluster, consul) = (Cluster::shared(), Consul::shared());
    let ns = team(cluster, consul, "export-meta");
    let svc = format!("web{}", unique());
    consul.register_many(&[instance(&svc, 0, 8080, "passing")], 1).unwrap();
    let hostname = "external-dns.alpha.kubernetes.io/hostname";
    let with = |team: &str| {
        format!("  serviceLabels: {{team: {team}}}\n  serviceAnnotations: {{{hostname}: {team}.example.com}}\n")
    };
    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", &with("shop"))).unwrap();
    let mut op = Operator::start(cluster, &["--namespace", &ns]).unwrap();
    let service = || get_json(cluster, &["-n", &ns, "get", "service", "web"]);
    let has = |team: Option<&str>| {
        let s = service()?;
        let (labels, annotations) = (&s["metadata"]["labels"], &s["metadata"]["annotations"]);
        let host = team.map(|t| format!("{t}.example.com"));
        (labels["team"].as_str() == team && annotations[hostname].as_str() == host.as_deref()).then_some(s)
    };
    let fail = |e: anyhow::Error, op: &Operator| {
        panic!("{e}\n{:?}\n{:?}\n{}", service(), export_status(cluster, &ns, "web"), op.logs())
    };
    wait_for("the label and annotation on the Service", T, || has(Some("shop"))).unwrap_or_else(|e| fail(e, &op));
    cluster.kubectl(&["-n", &ns, "label", "service", "web", "added-by=hand"]).unwrap();

    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", &with("cart"))).unwrap();
    wait_for("the label and annotation changed", T, || has(Some("cart"))).unwrap_or_else(|e| fail(e, &op));

    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", "")).unwrap();
    let gone = wait_for("the label and annotation gone", T, || has(None)).unwrap_or_else(|e| fail(e, &op));
    let labels = &gone["metadata"]["labels"];
    assert_eq!(labels["consulresolver.io/export"], "web", "{gone}");
    assert_eq!(labels["added-by"], "hand", "someone else's label stays: {gone}");

    let own = "  serviceLabels: {consulresolver.io/export: other}\n";
    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", own)).unwrap();
    let status = wait_for("InvalidSpec naming the key", T, || {
        let s = export_status(cluster, &ns, "web")?;
        (condition(&s, "Ready")?.1 == "InvalidSpec").then_some(s)
    })
    .unwrap_or_else(|e| fail(e, &op));
    let ready = status["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Ready").unwrap();
    let message = ready["message"].as_str().unwrap_or_default();
    assert!(message.contains(r#"spec.serviceLabels: key "consulresolver.io/export""#), "{status}");
    assert_eq!(service().unwrap()["metadata"]["labels"]["consulresolver.io/export"], "web");
    op.terminate(T).unwrap();
}

/// An instance registered without a port (a DNS-only or external service) would put port 0
/// into the Service, which the API server refuses: the whole export would freeze. It is
/// left out with a reason, and the rest is exported.
#[test]
fn an_instance_without_a_port_is_excluded_and_the_rest_exported() {
    let (cluster, consul) = (Cluster::shared(), Consul::shared());
    let ns = team(cluster, consul, "export-portless");
    let svc = format!("web{}", unique());
    let all = [instance(&svc, 0, 8080, "passing"), instance(&svc, 1, 8080, "passing"), instance(&svc, 2, 0, "passing")];
    consul.register_many(&all, 3).unwrap();
    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", "")).unwrap();
    let mut op = Operator::start(cluster, &["--namespace", &ns]).unwrap();
    let status = wait_for("exported, one instance excluded", T, || {
        let s = export_status(cluster, &ns, "web")?;
        (condition(&s, "Ready")?.0 == "True" && s["excluded"] == 1).then_some(s)
    })
    .unwrap_or_else(|e| panic!("{e}\n{:?}\n{}", export_status(cluster, &ns, "web"), op.logs()));
    let excluded = &status["excludedInstances"][0];
    assert_eq!(excluded["address"], "192.0.2.3", "{status}");
    assert!(excluded["reason"].as_str().is_some_and(|r| r.starts_with("no port")), "{status}");
    let service = get_json(cluster, &["-n", &ns, "get", "service", "web"]).unwrap();
    let ports: Vec<&Value> = service["spec"]["ports"].as_array().unwrap().iter().map(|p| &p["port"]).collect();
    assert_eq!(ports, [8080], "{service}");
    assert_eq!(addresses(&slices(cluster, &ns, "web")), ["192.0.2.1", "192.0.2.2"]);
    op.terminate(T).unwrap();
}

#[test]
fn an_export_asking_for_zone_hints_gets_none_on_1_20_and_is_not_rewritten() {
    let (cluster, consul) = (Cluster::shared(), Consul::shared());
    let ns = team(cluster, consul, "export-hints");
    let svc = format!("web{}", unique());
    let zoned = |i: usize, zone: &str| Instance { zone: Some(zone.into()), ..instance(&svc, i, 8080, "passing") };
    consul.register_many(&[zoned(0, "zone-a"), zoned(1, "zone-b")], 2).unwrap();
    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", "  trafficDistribution: PreferClose\n")).unwrap();
    // Reconciled every second: a plan that differed from what the server keeps would be
    // written again on each pass.
    let mut op = Operator::start(cluster, &["--namespace", &ns, "--resync-period", "1s"]).unwrap();
    wait_for("exported", T, || {
        let s = export_status(cluster, &ns, "web")?;
        (condition(&s, "Ready")?.0 == "True" && s["endpoints"] == 2).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{:?}\n{}", export_status(cluster, &ns, "web"), op.logs()));
    let found = slices(cluster, &ns, "web");
    // v1beta1 is served alone here (1.20), which has no `hints` field: none are sent.
    for s in found.values() {
        assert!(s["metadata"]["annotations"].get("consulresolver.io/zone-hints").is_none(), "{s}");
        for e in s["endpoints"].as_array().unwrap() {
            assert!(e.get("hints").is_none(), "{e}");
            assert!(e["topology"]["topology.kubernetes.io/zone"].is_string(), "{e}");
        }
    }
    // Planned without hints too, so nothing differs on the next passes.
    std::thread::sleep(Duration::from_secs(4));
    assert!(written_since(&versions(&found), &slices(cluster, &ns, "web")).is_empty(), "{}", op.logs());
    op.terminate(T).unwrap();
}

/// The export's Endpoints (`None`: absent).
fn endpoints_of(cluster: &Cluster, ns: &str, name: &str) -> Option<Value> {
    get_json(cluster, &["-n", ns, "get", "endpoints", name])
}

/// The addresses of `endpoints` under `field` (`addresses` or `notReadyAddresses`), over
/// all subsets, sorted.
fn endpoint_ips(endpoints: &Value, field: &str) -> Vec<String> {
    let mut ips: Vec<String> = endpoints["subsets"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s[field].as_array().cloned().unwrap_or_default())
        .filter_map(|a| a["ip"].as_str().map(str::to_owned))
        .collect();
    ips.sort();
    ips
}

fn over_capacity(endpoints: &Value) -> Option<&str> {
    endpoints["metadata"]["annotations"]["endpoints.kubernetes.io/over-capacity"].as_str()
}

/// Waits until the export's Endpoints hold exactly `ready` (sorted) as ready addresses;
/// returns them.
fn wait_endpoints(cluster: &Cluster, op: &Operator, ns: &str, what: &str, ready: &[String]) -> Value {
    wait_for(what, T, || {
        let e = endpoints_of(cluster, ns, "web")?;
        (endpoint_ips(&e, "addresses") == ready).then_some(e)
    })
    .unwrap_or_else(|e| panic!("{e}\n{:?}\n{}", endpoints_of(cluster, ns, "web"), op.logs()))
}

/// The Endpoints as consumers and the control plane need them: owned by the export as its
/// Service is, ours, not to be mirrored, with the Service's port names.
fn assert_the_endpoints_keep_the_rules(cluster: &Cluster, ns: &str, endpoints: &Value) {
    let export = get_json(cluster, &["-n", ns, "get", "consulservice", "web"]).unwrap();
    let owner = &endpoints["metadata"]["ownerReferences"][0];
    assert_eq!(
        (owner["kind"].as_str(), owner["uid"].as_str(), owner["controller"].as_bool()),
        (Some("ConsulService"), export["metadata"]["uid"].as_str(), Some(true)),
        "{endpoints}"
    );
    let labels = &endpoints["metadata"]["labels"];
    assert_eq!(labels["endpointslice.kubernetes.io/skip-mirror"], "true", "{endpoints}");
    assert_eq!(labels["consulresolver.io/export"], "web", "{endpoints}");
    assert_eq!(labels["app.kubernetes.io/managed-by"], "consul-resolver-operator", "{endpoints}");
    assert_eq!(
        endpoints["subsets"][0]["ports"],
        serde_json::json!([{"name": "http", "port": 8080, "protocol": "TCP"}]),
        "{endpoints}"
    );
    assert!(over_capacity(endpoints).is_none(), "{endpoints}");
    assert!(endpoint_ips(endpoints, "notReadyAddresses").is_empty(), "{endpoints}");
}

/// No slice of the Service `web` is anyone's but the export's: the mirroring controller
/// (running) left its Endpoints alone. Checked for a few seconds: it acts on its own time.
fn assert_nothing_mirrored(cluster: &Cluster, kcm: &ControllerManager, ns: &str) {
    for _ in 0..10 {
        let found = slices(cluster, ns, "web");
        let foreign: Vec<&String> = found
            .iter()
            .filter(|(_, s)| {
                s["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"]
                    != "consul-resolver-operator.consulresolver.io"
            })
            .map(|(n, _)| n)
            .collect();
        assert!(foreign.is_empty(), "slices of web not ours (mirrored?): {foreign:?}\n{}", kcm.logs());
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// `n` passing instances of `svc` on port 8080 at 10.42.0.1 upwards (below 192.0.2.x in
/// numeric order, so the cap cuts the 192.0.2.x ones first).
fn many(svc: &str, n: usize) -> Vec<Instance> {
    (0..n)
        .map(|i| Instance {
            address: format!("10.42.{}.{}", i / 250, i % 250 + 1),
            node: format!("node-{svc}-many-{i}"),
            id: format!("{svc}-many-{i}"),
            ..instance(svc, 0, 8080, "passing")
        })
        .collect()
}

/// `spec.endpoints: true`: an Endpoints object of the Service's name follows the instances
/// and their health, is cut to 1,000 addresses (annotated, and not when back under), is not
/// mirrored by kube-controller-manager's mirroring controller, and goes when turned off.
#[test]
#[cfg_attr(e2e_external_cluster, ignore = "starts a kube-controller-manager: needs the cluster the tests start")]
fn an_export_asked_for_endpoints_writes_them_capped_unmirrored_and_deletes_them_when_off() {
    let (cluster, consul) = (Cluster::shared(), Consul::shared());
    // Only the mirroring controller: a garbage collector would hide the operator's own
    // deletions, which the other tests here check.
    let kcm = ControllerManager::start(cluster, "endpointslicemirroring").unwrap();
    let ns = team(cluster, consul, "export-endpoints");
    let svc = format!("web{}", unique());
    let mut three: Vec<Instance> = (0..3).map(|i| instance(&svc, i, 8080, "passing")).collect();
    consul.register_many(&three, 3).unwrap();
    let on = "  ports: [{name: http, port: 80}]\n  endpoints: true\n";
    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", on)).unwrap();
    let mut op = Operator::start(cluster, &["--namespace", &ns]).unwrap();
    let first: Vec<String> = (1..=3).map(|i| format!("192.0.2.{i}")).collect();
    let found = wait_endpoints(cluster, &op, &ns, "the Endpoints with the three", &first);
    assert_the_endpoints_keep_the_rules(cluster, &ns, &found);

    // A health flip, both ways: the critical instance leaves (the query admits passing
    // only), and comes back.
    three[1].status = "critical".into();
    consul.register_many(&three[1..2], 1).unwrap();
    let two = [first[0].clone(), first[2].clone()];
    wait_endpoints(cluster, &op, &ns, "the critical instance out of the Endpoints", &two);
    three[1].status = "passing".into();
    consul.register_many(&three[1..2], 1).unwrap();
    wait_endpoints(cluster, &op, &ns, "the instance back in the Endpoints", &first);
    assert_nothing_mirrored(cluster, &kcm, &ns);

    // 1,001 instances: 1,000 addresses, the highest cut, annotated; the slices hold all.
    let more = many(&svc, 998);
    consul.register_many(&more, 16).unwrap();
    let mut kept: Vec<String> = more.iter().map(|i| i.address.clone()).chain(first[..2].iter().cloned()).collect();
    kept.sort();
    let cut = wait_endpoints(cluster, &op, &ns, "1,000 of 1,001 in the Endpoints", &kept);
    assert_eq!(over_capacity(&cut), Some("truncated"));
    wait_for("all 1,001 in the slices", T, || (addresses(&slices(cluster, &ns, "web")).len() == 1001).then_some(()))
        .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    // Back to 1,000: all of them, and the annotation gone.
    consul.deregister(&more[997].node, &more[997].id).unwrap();
    let mut all: Vec<String> = more[..997].iter().map(|i| i.address.clone()).chain(first.iter().cloned()).collect();
    all.sort();
    let whole = wait_endpoints(cluster, &op, &ns, "all 1,000 in the Endpoints", &all);
    assert!(over_capacity(&whole).is_none(), "{:?}", whole["metadata"]["annotations"]);
    assert_nothing_mirrored(cluster, &kcm, &ns);

    // Off: the Endpoints go; the Service and slices stay.
    let off = "  ports: [{name: http, port: 80}]\n";
    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", off)).unwrap();
    wait_for("the Endpoints deleted", T, || endpoints_of(cluster, &ns, "web").is_none().then_some(()))
        .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    assert_eq!(addresses(&slices(cluster, &ns, "web")).len(), 1000);
    op.terminate(T).unwrap();
}
