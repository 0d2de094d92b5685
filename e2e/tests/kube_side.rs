//! The Kubernetes side of the operator, black box: which Endpoints it watches (read from
//! the API server's audit log), a snapshot too big for one ConfigMap read back whole, a
//! Mapping moving between resolvers, and how a Mapping's `resolver` name is looked up
//! across namespaces. The operator runs as its own process with the ServiceAccount
//! kubeconfig bound to manifests/rbac.yaml; Consul is changed only through its HTTP API.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use consul_resolver_operator::snapshot_configmap as configmap;
use consul_sim::Outcome;
use e2e::consul::{Consul, Instance};
use e2e::fixtures::{mapping_yaml, ports, resolver_yaml};
use e2e::harness::{Cluster, Operator, base64_decode, unique, wait_for};
use serde_json::Value;

const T: Duration = Duration::from_secs(30);
/// Where `--snapshot-configmap` writes in these tests (the operator's RBAC allows it).
const CM_NAMESPACE: &str = "consul-resolver-system";
const MIB: usize = 1 << 20;

/// The snapshot's entry for Mapping `ns/name`.
fn mapping<'a>(snapshot: &'a Value, ns: &str, name: &str) -> Option<&'a Value> {
    snapshot["mappings"].as_array()?.iter().find(|m| m["namespace"] == ns && m["name"] == name)
}

/// The snapshot's problems about `kind` `ns/name`, as messages.
fn problems_of(snapshot: &Value, kind: &str, ns: &str, name: &str) -> Vec<String> {
    snapshot["problems"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["kind"] == kind && p["namespace"] == ns && p["name"] == name)
        .filter_map(|p| p["message"].as_str().map(str::to_owned))
        .collect()
}

/// Kubernetes Services of namespace `ns` in a snapshot: name -> endpoint addresses.
fn kube_services(snapshot: &Value, ns: &str) -> BTreeMap<String, Vec<String>> {
    snapshot["kubernetesServices"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|k| k["namespace"] == ns && k["synced"] == true)
        .filter_map(|k| {
            let addrs = k["endpoints"].as_array()?.iter().filter_map(|e| e["address"].as_str().map(str::to_owned));
            Some((k["name"].as_str()?.to_owned(), addrs.collect()))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// 1. Endpoints watches, counted in the audit log
//
// What this API server (1.20.2) actually logs, at Metadata level without RequestReceived:
// a list as one `ResponseComplete` event (verb `list`); a watch (verb `watch`, `?watch=true`
// in requestURI) only once it ends, as a `ResponseStarted` and a `ResponseComplete` event
// written together, although `e2e/cluster.sh` says ResponseStarted comes when it begins.
// So a running watch shows in the log by the list that kube-runtime's watcher makes just
// before it, and by its own events once it stops: when its last consumer goes, or when the
// operator exits.

/// The operator's requests on `endpoints`, as the audit log tells them.
#[derive(Debug, Default)]
struct EndpointsRequests {
    /// Ended watches in the namespace, by audit ID: the fieldSelector (`None` without one).
    watches: BTreeMap<String, Option<String>>,
    /// Lists in the namespace, by fieldSelector.
    lists: BTreeMap<Option<String>, usize>,
    /// Lists or watches in the namespace without a fieldSelector: a whole namespace's worth.
    unselected: Vec<String>,
    /// Any request on endpoints outside a namespace: every namespace's worth.
    cluster_wide: Vec<String>,
    /// Watch events by (verb, stage), for the record.
    logged_as: BTreeMap<(String, String), usize>,
}

impl EndpointsRequests {
    fn read(events: &[Value], user: &str, ns: &str) -> Self {
        let mut out = EndpointsRequests::default();
        for e in events {
            if e["user"]["username"] != user || e["objectRef"]["resource"] != "endpoints" {
                continue;
            }
            let uri = e["requestURI"].as_str().unwrap_or_default();
            let Some(event_ns) = e["objectRef"]["namespace"].as_str() else {
                out.cluster_wide.push(format!("{} {uri}", e["verb"]));
                continue;
            };
            if event_ns != ns {
                continue;
            }
            let query: BTreeMap<String, String> = url::Url::parse(&format!("http://apiserver{uri}"))
                .map(|u| u.query_pairs().into_owned().collect())
                .unwrap_or_default();
            let selector = query.get("fieldSelector").cloned();
            let verb = e["verb"].as_str().unwrap_or_default();
            let stage = e["stage"].as_str().unwrap_or_default();
            let is_watch = verb == "watch" || query.get("watch").is_some_and(|w| w == "true" || w == "1");
            if is_watch {
                *out.logged_as.entry((verb.to_owned(), stage.to_owned())).or_default() += 1;
                if stage == "ResponseComplete" {
                    out.watches.insert(e["auditID"].as_str().unwrap_or_default().to_owned(), selector.clone());
                }
            } else if verb == "list" {
                *out.lists.entry(selector.clone()).or_default() += 1;
            }
            if (is_watch || verb == "list") && selector.is_none() {
                out.unselected.push(format!("{verb} {uri}"));
            }
        }
        out
    }

    /// fieldSelector -> how many (ended) watches were made with it.
    fn watches_by_selector(&self) -> BTreeMap<Option<String>, usize> {
        let mut by = BTreeMap::new();
        for s in self.watches.values() {
            *by.entry(s.clone()).or_default() += 1;
        }
        by
    }

    /// How many field-selected lists there were: one per watch of a single Service.
    fn per_service_lists(&self) -> usize {
        self.lists.iter().filter(|(s, _)| s.is_some()).map(|(_, n)| n).sum()
    }

    #[track_caller]
    fn assert_never_the_namespace(&self) {
        assert!(self.unselected.is_empty(), "never all Endpoints of the namespace: {:?}", self.unselected);
    }

    #[track_caller]
    fn assert_never_the_cluster(&self) {
        assert!(self.cluster_wide.is_empty(), "never all Endpoints of the cluster: {:?}", self.cluster_wide);
    }
}

/// The operator's requests on endpoints in one namespace, from the audit log. The cluster
/// may have none (under `E2E_KUBECONFIG`): then the counts are not checked, visibly.
struct EndpointsAudit<'a> {
    cluster: &'a Cluster,
    ns: &'a str,
    /// The operator's user name; `None` without an audit log.
    user: Option<String>,
}

impl<'a> EndpointsAudit<'a> {
    fn new(cluster: &'a Cluster, ns: &'a str) -> Self {
        let has_audit = cluster.audit_log().is_some();
        if !has_audit {
            eprintln!("no audit log (E2E_KUBECONFIG): the watch counts are not checked, only the snapshot");
        }
        let user = has_audit.then(|| cluster.operator_username().unwrap());
        EndpointsAudit { cluster, ns, user }
    }

    fn enabled(&self) -> bool {
        self.user.is_some()
    }

    fn read(&self) -> EndpointsRequests {
        let events = self.cluster.audit_events().unwrap().unwrap_or_default();
        EndpointsRequests::read(&events, self.user.as_deref().unwrap_or_default(), self.ns)
    }

    /// The requests once they satisfy `cond`; on a timeout, the last reading and the
    /// operator's log say why.
    fn wait(&self, what: &str, op: &Operator, cond: impl Fn(&EndpointsRequests) -> bool) -> EndpointsRequests {
        wait_for(what, T, || Some(self.read()).filter(|r| cond(r)))
            .unwrap_or_else(|e| panic!("{e}\nlast reading: {:#?}\n--- operator log ---\n{}", self.read(), op.logs()))
    }
}

/// `{Some("metadata.name=svc-I"): 1}` for each of `services`.
fn once_each(services: &[usize]) -> BTreeMap<Option<String>, usize> {
    services.iter().map(|i| (Some(format!("metadata.name=svc-{i}")), 1)).collect()
}

fn endpoints_yaml(ns: &str, i: usize, ip: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Endpoints\nmetadata: {{name: svc-{i}, namespace: {ns}}}\nsubsets:\n- addresses: [{{ip: {ip}}}]\n  ports: [{{port: 8080}}]\n"
    )
}

/// The address Endpoints `svc-I` starts with: TEST-NET-1, data only (the API server refuses
/// loopback).
fn address(i: usize) -> String {
    format!("192.0.2.{}", i + 1)
}

/// Endpoints `svc-0` to `svc-{n-1}`, each at its `address`.
fn numbered_endpoints(ns: &str, n: usize) -> String {
    (0..n).map(|i| endpoints_yaml(ns, i, &address(i))).collect()
}

/// Mappings `m-I` to `svc-I:8080` for each of `services`.
fn mappings_yaml(ns: &str, services: std::ops::Range<usize>) -> String {
    services.map(|i| format!("---\n{}", mapping_yaml(ns, &format!("m-{i}"), &format!("svc-{i}:8080"), None))).collect()
}

/// What the snapshot holds for Services `svc-0` to `svc-{n-1}`: each at its `address`, but
/// those `changed` to another.
fn expected_endpoints(n: usize, changed: &[(usize, &str)]) -> BTreeMap<String, Vec<String>> {
    (0..n)
        .map(|i| {
            let ip = changed.iter().find(|(c, _)| *c == i).map_or_else(|| address(i), |(_, ip)| (*ip).to_owned());
            (format!("svc-{i}"), vec![ip])
        })
        .collect()
}

/// Over the operator's life (it has exited): one watch per Service ever referenced, no
/// re-list, never a whole namespace or the cluster, and discovery of the core group once
/// for all those watches.
fn assert_one_watch_per_service_ever(cluster: &Cluster, audit: &EndpointsAudit, op: &Operator, referenced: &[usize]) {
    // The operator is gone: every watch it had has ended and is in the log.
    let reqs = audit.wait("every watch to end with the operator", op, |r| r.watches.len() >= referenced.len());
    eprintln!(
        "over the operator's life: {} endpoints watches {:?}, lists {:?}, logged as {:?}",
        reqs.watches.len(),
        reqs.watches_by_selector(),
        reqs.lists,
        reqs.logged_as
    );
    assert_eq!(reqs.watches_by_selector(), once_each(referenced), "one watch per service ever referenced: {reqs:#?}");
    assert_eq!(reqs.lists, once_each(referenced), "and no re-lists: {reqs:#?}");
    reqs.assert_never_the_namespace();
    reqs.assert_never_the_cluster();
    // Discovery of the core group once for all those watches, not once per watch (it
    // was 4 for these 4 before; at start, choosing between Endpoints and EndpointSlices
    // asks discovery.k8s.io, not /api/v1).
    let user = cluster.operator_username().unwrap();
    let events = cluster.audit_events().unwrap().unwrap_or_default();
    let discovery =
        events.iter().filter(|e| e["user"]["username"] == user.as_str() && e["requestURI"] == "/api/v1").count();
    eprintln!("core discovery requests over the operator's life: {discovery}, for {} watches", referenced.len());
    assert!(discovery <= 1, "{discovery} discoveries of /api/v1 for {} endpoints watches", referenced.len());
}

#[test]
fn endpoint_watches_are_proportional_to_referenced_services_not_to_objects() {
    let cluster = Cluster::shared();
    let ns = cluster.namespace("epw").unwrap();
    const OBJECTS: usize = 40;
    cluster.apply(&numbered_endpoints(&ns, OBJECTS)).unwrap();
    let mut referenced = vec![3, 17, 29];
    for i in &referenced {
        cluster.apply(&mapping_yaml(&ns, &format!("m-{i}"), &format!("svc-{i}:8080"), None)).unwrap();
    }
    let mut expected: BTreeMap<String, Vec<String>> =
        referenced.iter().map(|&i| (format!("svc-{i}"), vec![address(i)])).collect();

    let mut op = Operator::start(cluster, &["--namespace", &ns]).unwrap();
    op.wait_ready(T).unwrap();
    op.wait_snapshot("the three referenced services' endpoints", T, |s| kube_services(s, &ns) == expected).unwrap();

    let audit = EndpointsAudit::new(cluster, &ns);
    if audit.enabled() {
        let reqs = audit.wait("a field-selected Endpoints list per referenced service", &op, |r| r.lists.len() >= 3);
        eprintln!(
            "{OBJECTS} Endpoints objects, 3 referenced: endpoints lists by selector {:?}, watches ended {:?}",
            reqs.lists,
            reqs.watches_by_selector()
        );
        assert_eq!(reqs.lists, once_each(&referenced), "one list+watch per referenced service: {reqs:#?}");
        assert!(reqs.watches.is_empty(), "no watch has ended: {reqs:#?}");
        reqs.assert_never_the_namespace();
        reqs.assert_never_the_cluster();
    }

    // The field-selected watches deliver changes: they are watches, not one-off lists.
    cluster.apply(&endpoints_yaml(&ns, 3, "192.0.2.200")).unwrap();
    expected.insert("svc-3".into(), vec!["192.0.2.200".into()]);
    op.wait_snapshot("a referenced Endpoints change", T, |s| kube_services(s, &ns) == expected).unwrap();
    // An unreferenced one is not watched (the final counts show no watch was added for it).
    cluster.apply(&endpoints_yaml(&ns, 5, "192.0.2.201")).unwrap();

    // A fourth Mapping: a fourth watch.
    cluster.apply(&mapping_yaml(&ns, "m-35", "svc-35:8080", None)).unwrap();
    referenced.push(35);
    expected.insert("svc-35".into(), vec![address(35)]);
    op.wait_snapshot("the fourth service's endpoints", T, |s| kube_services(s, &ns) == expected).unwrap();
    if audit.enabled() {
        let reqs = audit.wait("a fourth field-selected list", &op, |r| r.lists.len() >= 4);
        eprintln!("after a fourth Mapping: endpoints lists by selector {:?}", reqs.lists);
        assert_eq!(reqs.lists, once_each(&referenced), "{reqs:#?}");
        assert!(reqs.watches.is_empty(), "no watch has ended: {reqs:#?}");
    }

    // Deleting a Mapping drops its service from the snapshot and ends its watch.
    cluster.kubectl(&["-n", &ns, "delete", "mappings.getambassador.io", "m-17"]).unwrap();
    expected.remove("svc-17");
    op.wait_snapshot("svc-17 and m-17 gone", T, |s| {
        kube_services(s, &ns) == expected && mapping(s, &ns, "m-17").is_none()
    })
    .unwrap();
    if audit.enabled() {
        let reqs = audit.wait("the svc-17 watch to end", &op, |r| !r.watches.is_empty());
        eprintln!("after deleting m-17: watches ended {:?}", reqs.watches_by_selector());
        assert_eq!(reqs.watches_by_selector(), once_each(&[17]), "only svc-17's watch ended: {reqs:#?}");
    }

    let status = op.terminate(T).unwrap();
    assert!(status.success(), "{status}\n{}", op.logs());
    if audit.enabled() {
        assert_one_watch_per_service_ever(cluster, &audit, &op, &referenced);
    }
}

/// The operator's Kubernetes watches now (its gauge): the audit log shows a watch only
/// once it ends, and a watch stopped right after its list never sends its watch request.
fn kube_watches(op: &Operator) -> i64 {
    op.metric("consul_resolver_watches{source=\"kubernetes\"}").unwrap_or(-1.0) as i64
}

/// Waits until the operator runs `n` endpoints watches besides its `fixed` other ones.
fn wait_endpoints_watches(op: &Operator, what: &str, fixed: i64, n: i64) {
    wait_for(what, T, || (kube_watches(op) == fixed + n).then_some(()))
        .unwrap_or_else(|e| panic!("{e}: {} Kubernetes watches\n{}", kube_watches(op), op.logs()));
}

/// Down to `few` Services routed to, from past a hundred: a list of its own for each, and
/// the namespace's watch ended. Returns how many per-service lists it took.
fn assert_a_list_each_after_the_namespace(audit: &EndpointsAudit, op: &Operator, few: usize) -> usize {
    let reqs = audit.wait(&format!("{few} lists of their own, the namespace's watch ended"), op, |r| {
        r.per_service_lists() >= few && r.watches_by_selector().contains_key(&None)
    });
    let down = reqs.per_service_lists();
    eprintln!("down to {few}: {down} per-service lists, watches ended {}", reqs.watches.len());
    for i in 0..few {
        let selector = Some(format!("metadata.name=svc-{i}"));
        assert_eq!(reqs.lists.get(&selector), Some(&1), "one list for svc-{i}: {reqs:#?}");
    }
    // The deletes arrive one by one: the move happens when 50 are left, and the ten
    // deleted after it had a watch of their own for a moment.
    assert!(down <= 50, "{down} per-service lists on the way down: {reqs:#?}");
    down
}

/// Past 100 Services of one namespace routed to (the default of
/// `--endpoints-namespace-watch-above`), one watch of the namespace's Endpoints serves them
/// all: the API server sees one list and one watch, not one per Service. Back at half of
/// that, one field-selected watch each again; and up again, one for the namespace. Every
/// step keeps every routed-to Service's endpoints right in the snapshot.
#[test]
fn past_a_hundred_services_one_watch_serves_the_namespace_and_back() {
    let cluster = Cluster::shared();
    let ns = cluster.namespace("epwide").unwrap();
    // 130 Endpoints, 110 routed to.
    const OBJECTS: usize = 130;
    const ROUTED: usize = 110;
    const FEW: usize = 40;
    cluster.apply(&numbered_endpoints(&ns, OBJECTS)).unwrap();
    cluster.apply(&mappings_yaml(&ns, 0..ROUTED)).unwrap();

    let mut op = Operator::start(cluster, &["--namespace", &ns]).unwrap();
    op.wait_ready(T).unwrap();
    op.wait_snapshot("110 services' endpoints", T, |s| kube_services(s, &ns) == expected_endpoints(ROUTED, &[]))
        .unwrap();
    let audit = EndpointsAudit::new(cluster, &ns);
    // Right now one of them is of endpoints (the audit below shows the one list); the
    // rest are the operator's fixed watches (resolvers, Mapping kinds).
    let fixed = kube_watches(&op) - 1;
    if audit.enabled() {
        let reqs = audit.wait("the namespace's Endpoints listed", &op, |r| !r.lists.is_empty());
        eprintln!("{ROUTED} services routed to: endpoints lists by selector {:?}", reqs.lists);
        assert_eq!(reqs.lists, BTreeMap::from([(None, 1)]), "one list of the namespace, none per service: {reqs:#?}");
        reqs.assert_never_the_cluster();
    }
    // The shared watch delivers changes.
    cluster.apply(&endpoints_yaml(&ns, 5, "192.0.2.200")).unwrap();
    op.wait_snapshot("a change through the namespace's watch", T, |s| {
        kube_services(s, &ns) == expected_endpoints(ROUTED, &[(5, "192.0.2.200")])
    })
    .unwrap();

    // Down to 40 (at most half of 100): one field-selected watch each, the shared one ends.
    let names: Vec<String> = (FEW..ROUTED).map(|i| format!("m-{i}")).collect();
    let mut delete = vec!["-n", &ns, "delete", "mappings.getambassador.io"];
    delete.extend(names.iter().map(String::as_str));
    cluster.kubectl(&delete).unwrap();
    op.wait_snapshot("the 40 left", T, |s| kube_services(s, &ns) == expected_endpoints(FEW, &[(5, "192.0.2.200")]))
        .unwrap();
    wait_endpoints_watches(&op, "40 endpoints watches", fixed, FEW as i64);
    let down = if audit.enabled() { assert_a_list_each_after_the_namespace(&audit, &op, FEW) } else { 0 };
    cluster.apply(&endpoints_yaml(&ns, 7, "192.0.2.201")).unwrap();
    let changed = [(5, "192.0.2.200"), (7, "192.0.2.201")];
    let expected = expected_endpoints(FEW, &changed);
    op.wait_snapshot("a change through a service's own watch", T, |s| kube_services(s, &ns) == expected).unwrap();

    // Up again, one by one: a watch each up to 100, then the namespace's, and theirs end.
    cluster.apply(&mappings_yaml(&ns, FEW..ROUTED)).unwrap();
    let expected = expected_endpoints(ROUTED, &changed);
    op.wait_snapshot("110 again", T, |s| kube_services(s, &ns) == expected).unwrap();
    wait_endpoints_watches(&op, "one endpoints watch", fixed, 1);
    if audit.enabled() {
        let reqs = audit.wait("the namespace's second list", &op, |r| r.lists.get(&None) == Some(&2));
        let up = reqs.per_service_lists() - down;
        eprintln!("up to {ROUTED} again: {up} more per-service lists, namespace lists {:?}", reqs.lists.get(&None));
        assert_eq!(reqs.lists.get(&None), Some(&2), "{reqs:#?}");
        assert!(up <= 100 - FEW, "{up} per-service lists on the way up, at most one each for 41..=100: {reqs:#?}");
    }
    let status = op.terminate(T).unwrap();
    assert!(status.success(), "{status}\n{}", op.logs());
    if audit.enabled() {
        let reqs = audit.read();
        eprintln!(
            "over the operator's life: {} endpoints watches, {} of them per service",
            reqs.watches.len(),
            reqs.per_service_lists()
        );
        reqs.assert_never_the_cluster();
    }
}

// ---------------------------------------------------------------------------------------
// 2. A snapshot over 1 MiB, split over ConfigMaps

/// `sha256:` of `bytes`, computed by coreutils' sha256sum (independent of the operator).
fn sha256sum(bytes: &[u8]) -> String {
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("sha256sum (coreutils) is required");
    let mut stdin = child.stdin.take().expect("piped");
    let data = bytes.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&data));
    let out = child.wait_with_output().expect("sha256sum ran");
    writer.join().expect("writer thread").expect("writing to sha256sum");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).expect("sha256sum prints ASCII");
    format!("sha256:{}", text.split_whitespace().next().expect("a digest"))
}

fn random_hex(bytes: usize) -> String {
    (0..bytes).map(|_| format!("{:02x}", rand::random::<u8>())).collect()
}

/// Bytes of data a ConfigMap holds (what the API server limits to 1 MiB): `data` values
/// plus decoded `binaryData` values.
fn payload_size(cm: &Value) -> usize {
    let data: usize = cm["data"].as_object().into_iter().flatten().filter_map(|(_, v)| v.as_str()).map(str::len).sum();
    let binary: usize = cm["binaryData"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(_, v)| base64_decode(v.as_str().unwrap_or_default()).expect("binaryData is base64").len())
        .sum();
    data + binary
}

/// The main ConfigMap and its parts as read by kubectl, when they form one consistent split
/// snapshot (every part's sha256 matching the index); `None` while a write is under way.
fn read_split(cluster: &Cluster, name: &str) -> Option<(Value, Value, Vec<Value>)> {
    let get = |n: &str| -> Option<Value> {
        serde_json::from_str(&cluster.kubectl(&["-n", CM_NAMESPACE, "get", "configmap", n, "-o", "json"]).ok()?).ok()
    };
    let main = get(name)?;
    let index: Value = serde_json::from_str(main["data"]["index.json"].as_str()?).ok()?;
    let parts = index["parts"].as_array()?.iter().map(|p| get(p["name"].as_str()?)).collect::<Option<Vec<_>>>()?;
    Some((main, index, parts))
}

/// `n` instances of `svc` with 1 KiB of random hex meta each, which defeats gzip (about 4
/// bits of entropy per character). Meta values stay within Consul's 512 characters.
fn incompressible_instances(svc: &str, n: usize) -> Vec<Instance> {
    (0..n)
        .map(|i| Instance {
            node: format!("{svc}-node-{}", i % 50),
            address: "127.0.0.1".into(),
            service: svc.to_owned(),
            id: format!("{svc}-{i}"),
            port: 20_000 + i as u16,
            status: "passing".into(),
            tags: vec!["big".into()],
            meta: BTreeMap::from([("build".into(), random_hex(256)), ("commit".into(), random_hex(256))]),
            zone: None,
        })
        .collect()
}

/// The gzip the parts of split snapshot `cm` hold, and the JSON it unzips to, decoded
/// independently of the operator's code: base64, sha256 per part and of the whole, gunzip.
/// Checks each part against its entry in the index on the way.
fn decode_independently(cm: &str, index: &Value, parts: &[Value]) -> (Vec<u8>, Vec<u8>) {
    let mut gz = Vec::new();
    for (r, part) in index["parts"].as_array().unwrap().iter().zip(parts) {
        assert_eq!(part["metadata"]["name"], r["name"]);
        assert_eq!(part["metadata"]["labels"][configmap::LABEL_PART_OF], cm);
        let bytes = base64_decode(part["binaryData"][configmap::KEY_PART].as_str().expect("binaryData part")).unwrap();
        assert_eq!(sha256sum(&bytes), r["sha256"].as_str().unwrap(), "part {}", r["name"]);
        // Named by its content, and never written again.
        let hex = sha256sum(&bytes).trim_start_matches("sha256:").to_owned();
        assert_eq!(r["name"].as_str().unwrap(), format!("{cm}-{}", &hex[..16]));
        assert_eq!(part["immutable"], true, "part {}", r["name"]);
        assert_eq!(Some(bytes.len() as u64), r["size"].as_u64(), "part {}", r["name"]);
        gz.extend_from_slice(&bytes);
    }
    assert_eq!(sha256sum(&gz), index["sha256"].as_str().unwrap(), "sha256 of the whole");
    assert_eq!(Some(gz.len() as u64), index["size"].as_u64());
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(gz.as_slice()).read_to_end(&mut json).expect("the parts are one gzip stream");
    (gz, json)
}

#[test]
fn a_snapshot_well_over_one_mebibyte_reaches_the_configmap_whole() {
    let cluster = Cluster::shared();
    let consul = Consul::shared();
    let ns = cluster.namespace("bigsnap").unwrap();
    let svc = format!("big{}", unique());

    // 3000 instances with 1 KiB of random meta each make ~3.6 MiB of JSON whose gzip is
    // well over the 900 KiB budget of one ConfigMap.
    const INSTANCES: usize = 3000;
    let instances = incompressible_instances(&svc, INSTANCES);
    let started = Instant::now();
    consul.register_many(&instances, 16).unwrap();
    eprintln!("registered {INSTANCES} instances over Consul's HTTP API in {:?}", started.elapsed());

    cluster.apply(&resolver_yaml(&ns, "consul", &consul.address(), "")).unwrap();
    cluster.apply(&mapping_yaml(&ns, "big", &format!("{svc}:8080"), Some("consul"))).unwrap();
    let cm = format!("bigsnap-{}", unique());
    let cm_arg = format!("{CM_NAMESPACE}/{cm}");
    // Built first, so that the times below are the operator's, not cargo's.
    e2e::harness::operator_binary().unwrap();
    let started = Instant::now();
    let mut op = Operator::start(cluster, &["--namespace", &ns, "--snapshot-configmap", &cm_arg]).unwrap();
    op.wait_ready(2 * T).unwrap();
    op.wait_snapshot("every instance in the snapshot", T, |s| {
        ports(s, &ns, "consul", &svc).is_some_and(|p| p.len() == INSTANCES)
    })
    .unwrap();
    eprintln!("operator ready with {INSTANCES} endpoints in {:?}", started.elapsed());

    let (main, index, parts) = wait_for("a split snapshot in the ConfigMaps", 2 * T, || read_split(cluster, &cm))
        .unwrap_or_else(|e| panic!("{e}\n--- operator log ---\n{}", op.logs()));
    eprintln!("ConfigMap written {:?} after start", started.elapsed());
    let id = index["snapshotId"].as_u64().expect("the index names its snapshot id");
    assert_eq!(main["metadata"]["annotations"][configmap::ANNOTATION_ID], id.to_string());
    assert_eq!(main["metadata"]["annotations"][configmap::ANNOTATION_HASH], index["snapshotHash"]);
    let (gz, json) = decode_independently(&cm, &index, &parts);

    // The crate's own reader agrees.
    let main_cm = serde_json::from_value(main.clone()).unwrap();
    let part_cms = parts.iter().cloned().map(serde_json::from_value).collect::<Result<Vec<_>, _>>().unwrap();
    let decoded = configmap::decode(&main_cm, part_cms.as_slice()).expect("the crate decodes what it wrote");
    assert!(decoded == json, "configmap::decode and the independent decoding differ");

    // The same bytes as served over HTTP under that id.
    let (code, body) = op.get(&format!("/snapshots/{id}")).expect("the operator answers");
    assert_eq!(code, 200, "snapshot {id} is still served: {body}");
    let served: Value = serde_json::from_str(&body).unwrap();
    let published: Value = serde_json::from_slice(&json).expect("the ConfigMap holds JSON");
    assert_eq!((published["id"].as_u64(), &published["hash"]), (Some(id), &index["snapshotHash"]));
    assert_eq!((&served["id"], &served["hash"]), (&published["id"], &published["hash"]));
    assert!(served == published, "the ConfigMap's snapshot differs from GET /snapshots/{id}");
    assert!(body.as_bytes() == json.as_slice(), "the same bytes are published to HTTP and the ConfigMap");
    assert_eq!(ports(&published, &ns, "consul", &svc).map(|p| p.len()), Some(INSTANCES));

    let sizes: Vec<usize> = std::iter::once(&main).chain(&parts).map(payload_size).collect();
    let objects: Vec<usize> =
        std::iter::once(&main).chain(&parts).map(|c| serde_json::to_vec(c).unwrap().len()).collect();
    eprintln!(
        "snapshot {id}: {} bytes of JSON, {} bytes gzip, {} parts; data per ConfigMap {sizes:?}, \
         JSON objects as read {objects:?}",
        json.len(),
        gz.len(),
        parts.len()
    );
    assert!(json.len() > MIB, "the snapshot is over 1 MiB: {}", json.len());
    assert!(gz.len() > configmap::DATA_BUDGET, "its gzip is over one ConfigMap's budget: {}", gz.len());
    assert!(parts.len() > 1, "split over several ConfigMaps: {}", parts.len());
    assert!(sizes.iter().all(|&s| s <= MIB), "no ConfigMap holds over 1 MiB: {sizes:?}");
    op.terminate(T).unwrap();
}

// ---------------------------------------------------------------------------------------
// 3. A Mapping moving between resolvers

/// Blocking queries for `service` in flight at the simulator: their query strings.
fn in_flight(consul: &Consul, service: &str) -> Option<Vec<String>> {
    let sim = consul.sim.as_ref()?;
    Some(
        sim.requests()
            .into_iter()
            .filter(|r| r.service.as_deref() == Some(service) && r.outcome == Outcome::InFlight && r.wait_ms.is_some())
            .map(|r| r.query)
            .collect(),
    )
}

fn with_tag(queries: &[String], tag: &str) -> usize {
    let param = format!("tag={tag}");
    queries.iter().filter(|q| q.split('&').any(|p| p == param)).count()
}

#[test]
fn changing_a_mappings_resolver_moves_its_watch() {
    let cluster = Cluster::shared();
    let consul = Consul::shared();
    let ns = cluster.namespace("move").unwrap();
    let svc = format!("mv{}", unique());
    let instance = |n: u16, tag: &str| Instance {
        node: format!("{svc}-node"),
        address: "127.0.0.1".into(),
        service: svc.clone(),
        id: format!("{svc}-{tag}"),
        port: 22_000 + n,
        status: "passing".into(),
        tags: vec![tag.into()],
        meta: BTreeMap::new(),
        zone: None,
    };
    consul.register_many(&[instance(1, "blue"), instance(2, "green")], 2).unwrap();

    // Same Consul, different tag filters: different queries for the same service.
    let addr = consul.address();
    cluster.apply(&resolver_yaml(&ns, "a", &addr, "  tags: [blue]\n")).unwrap();
    cluster.apply(&resolver_yaml(&ns, "b", &addr, "  tags: [green]\n")).unwrap();
    cluster.apply(&mapping_yaml(&ns, "m", &format!("{svc}:8080"), Some("a"))).unwrap();
    let mut op = Operator::start(cluster, &["--namespace", &ns]).unwrap();
    op.wait_ready(T).unwrap();
    let target = |s: &Value| mapping(s, &ns, "m").map(|m| m["target"].clone()).unwrap_or_default();
    op.wait_snapshot("the Mapping under resolver a, with a's instances", T, |s| {
        ports(s, &ns, "a", &svc) == Some(vec![22_001]) && target(s)["resolverName"] == "a"
    })
    .unwrap();
    if consul.sim.is_some() {
        let q = wait_for("one blocking query with a's tag", T, || {
            in_flight(consul, &svc).filter(|q| q.len() == 1 && with_tag(q, "blue") == 1)
        })
        .unwrap_or_else(|e| panic!("{e}: {:?}\n{}", in_flight(consul, &svc), op.logs()));
        eprintln!("on resolver a: in flight for {svc}: {q:?}");
        assert_eq!(with_tag(&q, "green"), 0);
    }

    cluster.apply(&mapping_yaml(&ns, "m", &format!("{svc}:8080"), Some("b"))).unwrap();
    let snap = op
        .wait_snapshot("the Mapping under resolver b, with b's instances", T, |s| {
            ports(s, &ns, "b", &svc) == Some(vec![22_002])
                && ports(s, &ns, "a", &svc).is_none()
                && target(s)["resolverName"] == "b"
        })
        .unwrap();
    let t = target(&snap);
    assert_eq!((t["type"].as_str(), t["resolverNamespace"].as_str()), (Some("consul"), Some(ns.as_str())), "{t}");
    assert_eq!((t["service"].as_str(), t["port"].as_u64()), (Some(svc.as_str()), Some(8080)), "{t}");
    if consul.sim.is_some() {
        let q = wait_for("a's query to stop and b's to run", T, || {
            in_flight(consul, &svc).filter(|q| q.len() == 1 && with_tag(q, "green") == 1)
        })
        .unwrap_or_else(|e| panic!("{e}: {:?}\n{}", in_flight(consul, &svc), op.logs()));
        eprintln!("on resolver b: in flight for {svc}: {q:?}");
        assert_eq!(with_tag(&q, "blue"), 0);
    }
    let status = op.terminate(T).unwrap();
    assert!(status.success(), "{status}\n{}", op.logs());
}

// ---------------------------------------------------------------------------------------
// 4. Resolver lookup across namespaces

/// What a Mapping whose resolver was not found (or refused it) targets.
fn unresolved() -> Value {
    serde_json::json!({"type": "unresolved"})
}

/// The target of Mapping `ns/name` in `snapshot`.
fn target_of(snapshot: &Value, ns: &str, name: &str) -> Option<Value> {
    mapping(snapshot, ns, name).map(|m| m["target"].clone())
}

/// The namespaces of the lookup test: Mappings in `home`, resolvers named alike in the
/// watched `x` and `y` and in `unwatched`; all for one Consul service.
struct Lookup {
    home: String,
    x: String,
    y: String,
    svc: String,
}

impl Lookup {
    /// `shared` in x and y, none in home; `solo` in y only among the watched namespaces; all
    /// shared with every namespace. `private` in y is not shared (the default). A Mapping for
    /// each way a name is looked up.
    fn create(cluster: &Cluster, addr: &str) -> Lookup {
        let home = cluster.namespace("lookup-home").unwrap();
        let (x, y) = (cluster.namespace("lookup-x").unwrap(), cluster.namespace("lookup-y").unwrap());
        // Not watched: its resolvers must not count.
        let unwatched = cluster.namespace("lookup-z").unwrap();
        let svc = format!("lk{}", unique());
        let all = "  allowedNamespaces: {from: All}\n";
        for (ns, name) in [(&x, "shared"), (&y, "shared"), (&y, "solo"), (&unwatched, "solo"), (&unwatched, "only-z")] {
            cluster.apply(&resolver_yaml(ns, name, addr, all)).unwrap();
        }
        cluster.apply(&resolver_yaml(&y, "private", addr, "")).unwrap();
        cluster.apply(&mapping_yaml(&home, "private", &svc, Some("private"))).unwrap();
        cluster.apply(&mapping_yaml(&home, "amb", &svc, Some("shared"))).unwrap();
        cluster.apply(&mapping_yaml(&home, "solo", &svc, Some("solo"))).unwrap();
        cluster.apply(&mapping_yaml(&home, "unwatched", &svc, Some("only-z"))).unwrap();
        // The same name from a namespace that has one: that one, however many exist elsewhere.
        cluster.apply(&mapping_yaml(&y, "local", &svc, Some("shared"))).unwrap();
        // No resolver named: `--default-resolver x/shared`, the explicit NAMESPACE/NAME form.
        cluster.apply(&mapping_yaml(&home, "default", &svc, None)).unwrap();
        // NAMESPACE/NAME in a Mapping's `resolver` is not a documented form: whatever it does,
        // it never silently picks another resolver.
        cluster.apply(&mapping_yaml(&home, "qualified", &svc, Some(&format!("{y}/shared")))).unwrap();
        Lookup { home, x, y, svc }
    }

    /// The target of a Mapping resolved through resolver `resolver_ns/resolver`.
    fn consul(&self, resolver_ns: &str, resolver: &str) -> Value {
        serde_json::json!({"type": "consul", "resolverNamespace": resolver_ns, "resolverName": resolver, "service": self.svc})
    }

    /// The target of Mapping `home/name`.
    fn home_target(&self, snapshot: &Value, name: &str) -> Option<Value> {
        target_of(snapshot, &self.home, name)
    }

    /// Each Mapping's lookup, as first published.
    fn assert_first_lookups(&self, snap: &Value) {
        let (home, x, y, svc) = (&self.home, &self.x, &self.y, &self.svc);
        // Ambiguous: reported with both candidates, not resolved to either.
        assert_eq!(self.home_target(snap, "amb"), Some(unresolved()));
        let amb = problems_of(snap, "Mapping", home, "amb");
        assert!(
            amb.iter().any(|p| p.contains("ambiguous")
                && p.contains(&format!("{x}/shared"))
                && p.contains(&format!("{y}/shared"))),
            "the problem names the ambiguity and both candidates: {amb:?}"
        );
        // The single one of that name in another watched namespace.
        assert_eq!(self.home_target(snap, "solo"), Some(self.consul(y, "solo")), "{snap}");
        assert!(problems_of(snap, "Mapping", home, "solo").is_empty());
        // Resolvers in namespaces that are not watched do not exist for the lookup.
        assert_eq!(self.home_target(snap, "unwatched"), Some(unresolved()));
        let missing = problems_of(snap, "Mapping", home, "unwatched");
        assert!(missing.iter().any(|p| p.contains("no ConsulResolver")), "{missing:?}");
        // Same namespace first.
        assert_eq!(target_of(snap, y, "local"), Some(self.consul(y, "shared")), "{snap}");
        // The explicit NAMESPACE/NAME of --default-resolver.
        assert_eq!(self.home_target(snap, "default"), Some(self.consul(x, "shared")), "{snap}");
        // Reported or resolved to exactly the resolver it names, never guessed.
        let qualified = self.home_target(snap, "qualified").unwrap();
        let qualified_problems = problems_of(snap, "Mapping", home, "qualified");
        eprintln!("Mapping resolver \"{y}/shared\": target {qualified}, problems {qualified_problems:?}");
        if qualified["type"] == "unresolved" {
            assert!(!qualified_problems.is_empty(), "an unresolved Mapping has a problem");
        } else {
            assert_eq!(qualified, self.consul(y, "shared"));
        }
        // Only resolvers that some Mapping uses have services watched.
        assert_eq!(ports(snap, x, "shared", svc), Some(vec![]));
        assert_eq!(ports(snap, y, "solo", svc), Some(vec![]));
        // A resolver that does not share itself: a problem naming why, and no watch for it.
        assert_eq!(self.home_target(snap, "private"), Some(unresolved()));
        let refused = problems_of(snap, "Mapping", home, "private");
        assert!(
            refused.iter().any(|p| p.contains(&format!("{y}/private does not serve Mappings from namespace {home}"))
                && p.contains("allowedNamespaces")),
            "{refused:?}"
        );
        assert_eq!(ports(snap, y, "private", svc), None, "nothing watched through it: {snap}");
    }

    /// `private` shared, then private again, then shared by a namespace selector: Mapping
    /// `home/private` follows each way.
    fn private_follows_its_sharing(&self, cluster: &Cluster, op: &Operator) {
        let (home, y) = (&self.home, &self.y);
        let patch_private = |patch: &str| {
            cluster.kubectl(&["-n", y, "patch", "cres", "private", "--type", "merge", "-p", patch]).unwrap();
        };
        let share =
            |from: &str| patch_private(&format!("{{\"spec\":{{\"allowedNamespaces\":{{\"from\":\"{from}\"}}}}}}"));
        let served = |s: &Value| self.home_target(s, "private") == Some(self.consul(y, "private"));
        let refused = |s: &Value| self.home_target(s, "private") == Some(unresolved());
        share("All");
        op.wait_snapshot("the shared resolver used", T, served).unwrap();
        share("Same");
        let snap = op.wait_snapshot("the resolver private again", T, refused).unwrap();
        assert_eq!(ports(&snap, y, "private", &self.svc), None, "its watch stopped: {snap}");
        // Shared by a namespace selector: the Mapping follows its namespace's labels.
        patch_private(
            "{\"spec\":{\"allowedNamespaces\":{\"from\":\"Selector\",\"selector\":{\"matchLabels\":{\"consul-access\":\"lookup\"}}}}}",
        );
        cluster.kubectl(&["label", "namespace", home, "consul-access=lookup"]).unwrap();
        op.wait_snapshot("served once the namespace is labelled", T, served).unwrap();
        cluster.kubectl(&["label", "namespace", home, "consul-access-"]).unwrap();
        op.wait_snapshot("refused once the label is gone", T, refused).unwrap();
    }
}

#[test]
fn resolver_lookup_across_namespaces_and_ambiguous_names_are_reported() {
    let cluster = Cluster::shared();
    let consul = Consul::shared();
    let lookup = Lookup::create(cluster, &consul.address());
    let Lookup { home, x, y, .. } = &lookup;

    let default_resolver = format!("{x}/shared");
    let mut op = Operator::start(
        cluster,
        &["--namespace", home, "--namespace", x, "--namespace", y, "--default-resolver", &default_resolver],
    )
    .unwrap();
    op.wait_ready(T).unwrap();
    let snap = op
        .wait_snapshot("all six Mappings", T, |s| {
            ["amb", "solo", "unwatched", "default", "qualified", "private"]
                .iter()
                .all(|m| mapping(s, home, m).is_some())
                && mapping(s, y, "local").is_some()
        })
        .unwrap();
    lookup.assert_first_lookups(&snap);
    lookup.private_follows_its_sharing(cluster, &op);

    // Once only one `shared` is left, the ambiguous Mapping resolves to it.
    cluster.kubectl(&["-n", x, "delete", "consulresolvers.consulresolver.io", "shared"]).unwrap();
    let snap = op
        .wait_snapshot("the ambiguity gone with one `shared` left", T, |s| {
            lookup.home_target(s, "amb") == Some(lookup.consul(y, "shared"))
        })
        .unwrap();
    assert!(problems_of(&snap, "Mapping", home, "amb").is_empty(), "{snap}");
    // And the default resolver is gone: reported, not replaced by the other `shared`.
    assert_eq!(lookup.home_target(&snap, "default"), Some(unresolved()), "{snap}");
    assert!(!problems_of(&snap, "Mapping", home, "default").is_empty(), "{snap}");
    let status = op.terminate(T).unwrap();
    assert!(status.success(), "{status}\n{}", op.logs());
}

/// The CRD schema refuses at `kubectl apply` what it can say about the query options, naming
/// the field; what it accepts, the API server stores as written.
#[test]
fn the_schema_refuses_bad_query_options_at_apply() {
    let cluster = Cluster::shared();
    let ns = cluster.namespace("options").unwrap();
    for (extra, field) in [
        ("  consistency: eventual\n", "spec.consistency"),
        ("  healthStatuses: [passing, unknown]\n", "spec.healthStatuses"),
        ("  healthStatuses: [passing, passing]\n", "spec.healthStatuses"),
        ("  healthStatuses: []\n", "spec.healthStatuses"),
        ("  addressType: \"Lan IPv4\"\n", "spec.addressType"),
        ("  tags: [\"\"]\n", "spec.tags"),
        ("  allowedNamespaces: {from: Some}\n", "spec.allowedNamespaces.from"),
        (
            "  allowedNamespaces: {from: Selector, selector: {matchExpressions: [{key: a, operator: Equals}]}}\n",
            "spec.allowedNamespaces.selector.matchExpressions",
        ),
    ] {
        let err = cluster.apply(&resolver_yaml(&ns, "bad", "127.0.0.1:8500", extra)).unwrap_err().to_string();
        assert!(err.contains(field), "{extra:?} refused naming {field}: {err}");
    }
    let good = "  healthStatuses: [passing, warning]\n  consistency: stale\n  cached: true\n  connect: false\n  \
                addressType: lan_ipv4\n  tags: [v2, \"!canary\"]\n";
    cluster.apply(&resolver_yaml(&ns, "good", "127.0.0.1:8500", good)).unwrap();
    let stored: Value =
        serde_json::from_str(&cluster.kubectl(&["-n", &ns, "get", "cres", "good", "-o", "json"]).unwrap()).unwrap();
    assert_eq!(stored["spec"]["healthStatuses"], serde_json::json!(["passing", "warning"]));
    assert_eq!(stored["spec"]["tags"], serde_json::json!(["v2", "!canary"]));
}
