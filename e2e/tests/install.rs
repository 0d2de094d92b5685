//! Installing the operator as a user does, `kubectl apply -k manifests/`: the kustomization
//! renders exactly the objects docs/operations.md lists, consistent with each other and with
//! the image; it applies for real to the local API server, and a second apply changes
//! nothing; and the ServiceAccount it installs can do exactly what the operator's code does
//! and nothing more, asked of the API server as that ServiceAccount (`kubectl auth can-i`,
//! SelfSubjectRulesReview, and real requests).

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};
use e2e::harness::{Cluster, operator_binary, repo_root};
use serde::Deserialize;
use serde_json::Value;

const NS: &str = "consul-resolver-system";
const NAME: &str = "consul-resolver-operator";
const SA_USER: &str = "system:serviceaccount:consul-resolver-system:consul-resolver-operator";

/// The documents of a multi-document YAML stream, as JSON values (empty documents dropped).
fn yaml_documents(text: &str) -> anyhow::Result<Vec<Value>> {
    let mut docs = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(text) {
        let v = Value::deserialize(doc).context("parsing a rendered document")?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    Ok(docs)
}

/// `kubectl kustomize manifests/`: what `kubectl apply -k manifests/` sends.
fn render() -> Vec<Value> {
    render_dir(&repo_root().join("manifests"))
}

fn render_dir(dir: &Path) -> Vec<Value> {
    let out = Command::new("kubectl").arg("kustomize").arg(dir).output().expect("kubectl is required");
    assert!(out.status.success(), "kubectl kustomize {}: {}", dir.display(), String::from_utf8_lossy(&out.stderr));
    yaml_documents(&String::from_utf8_lossy(&out.stdout)).unwrap()
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in the kustomization's output"))
}

/// `v` with every number as a float, so `0` and `0.0` compare equal.
fn numbers_as_f64(v: Value) -> Value {
    match v {
        Value::Number(n) => n.as_f64().and_then(serde_json::Number::from_f64).map_or(Value::Null, Value::Number),
        Value::Array(a) => Value::Array(a.into_iter().map(numbers_as_f64).collect()),
        Value::Object(o) => Value::Object(o.into_iter().map(|(k, v)| (k, numbers_as_f64(v))).collect()),
        other => other,
    }
}

/// The version the operator binary reports (the crate's version).
fn operator_version() -> String {
    let out = Command::new(operator_binary().unwrap()).arg("version").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace().nth(1).unwrap_or_else(|| panic!("`version` printed {text:?}")).to_owned()
}

/// The `USER uid:gid` of the Containerfile.
fn containerfile_user() -> (u64, u64) {
    let text = std::fs::read_to_string(repo_root().join("Containerfile")).unwrap();
    let user = text.lines().find_map(|l| l.strip_prefix("USER ")).expect("the Containerfile sets USER");
    let (uid, gid) = user.trim().split_once(':').expect("USER uid:gid");
    (uid.parse().unwrap(), gid.parse().unwrap())
}

/// An object by what identifies it: (apiVersion, kind, namespace, name).
type ObjectId = (String, String, String, String);

/// What docs/operations.md lists as the install.
fn documented_objects() -> BTreeSet<ObjectId> {
    [
        ("apiextensions.k8s.io/v1", "CustomResourceDefinition", "", "consulresolvers.consulresolver.io"),
        ("apiextensions.k8s.io/v1", "CustomResourceDefinition", "", "consulservices.consulresolver.io"),
        ("v1", "Namespace", "", NS),
        ("v1", "ServiceAccount", NS, NAME),
        ("rbac.authorization.k8s.io/v1", "ClusterRole", "", NAME),
        ("rbac.authorization.k8s.io/v1", "ClusterRole", "", "consul-resolver-operator-secrets"),
        ("rbac.authorization.k8s.io/v1", "ClusterRole", "", "consul-resolver-operator-exports"),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", "", NAME),
        ("rbac.authorization.k8s.io/v1", "Role", NS, NAME),
        ("rbac.authorization.k8s.io/v1", "RoleBinding", NS, NAME),
        ("apps/v1", "Deployment", NS, NAME),
        ("v1", "Service", NS, NAME),
        ("policy/v1", "PodDisruptionBudget", NS, NAME),
    ]
    .into_iter()
    .map(|(a, b, c, d)| (a.to_owned(), b.to_owned(), c.to_owned(), d.to_owned()))
    .collect()
}

fn assert_renders_exactly_the_documented_objects(objects: &[Value]) {
    let got: BTreeSet<ObjectId> = objects
        .iter()
        .map(|o| {
            let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
            (s(&o["apiVersion"]), s(&o["kind"]), s(&o["metadata"]["namespace"]), s(&o["metadata"]["name"]))
        })
        .collect();
    let want = documented_objects();
    assert_eq!(got, want, "the objects `kubectl apply -k manifests/` installs");
    assert_eq!(objects.len(), want.len(), "no object twice");
}

/// The CRD is the generated one, unchanged (kustomize writes `0.0` as `0`).
fn assert_the_crd_is_the_generated_one(objects: &[Value]) {
    let crd_file =
        yaml_documents(&std::fs::read_to_string(repo_root().join("crds/consulresolver.yaml")).unwrap()).unwrap();
    let crd = find(objects, "CustomResourceDefinition", "consulresolvers.consulresolver.io");
    assert!(
        numbers_as_f64(crd.clone()) == numbers_as_f64(crd_file[0].clone()),
        "the CRD differs from crds/consulresolver.yaml"
    );
}

/// Two replicas of the image `make image` builds, rolled without dropping below two, run
/// as the image's non-root user, read-only, and spread over nodes and zones.
fn assert_the_deployment_runs_two_locked_down_spread_replicas(deploy: &Value) {
    let pod = &deploy["spec"]["template"];
    let labels = &pod["metadata"]["labels"];
    assert_eq!(deploy["spec"]["replicas"], 2, "two replicas on a Lease");
    assert_eq!(deploy["spec"]["selector"]["matchLabels"], *labels);
    assert_eq!(deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"], 0, "a rollout never drops below two");
    let container = &pod["spec"]["containers"][0];
    assert_eq!(
        container["image"],
        format!("consul-resolver-operator:{}", operator_version()),
        "the image `make image` builds"
    );
    assert_eq!(pod["spec"]["serviceAccountName"], NAME);

    // The pod runs as the image's non-root user, read-only, with nothing extra.
    let (uid, gid) = containerfile_user();
    let psc = &pod["spec"]["securityContext"];
    assert_eq!(
        (psc["runAsNonRoot"].as_bool(), psc["runAsUser"].as_u64(), psc["runAsGroup"].as_u64()),
        (Some(true), Some(uid), Some(gid))
    );
    let csc = &container["securityContext"];
    assert_eq!(csc["allowPrivilegeEscalation"], false);
    assert_eq!(csc["readOnlyRootFilesystem"], true);
    assert_eq!(csc["capabilities"]["drop"], serde_json::json!(["ALL"]));

    // Spread over nodes and zones, softly, selecting this Deployment's own pods.
    let spread = pod["spec"]["topologySpreadConstraints"].as_array().expect("topologySpreadConstraints");
    let keys: BTreeSet<&str> = spread.iter().filter_map(|c| c["topologyKey"].as_str()).collect();
    assert_eq!(keys, BTreeSet::from(["kubernetes.io/hostname", "topology.kubernetes.io/zone"]));
    for c in spread {
        assert_eq!(c["whenUnsatisfiable"], "ScheduleAnyway", "{c}");
        assert_eq!(c["labelSelector"]["matchLabels"], *labels, "{c}");
    }
}

/// The Service and the PodDisruptionBudget select the Deployment's pods.
fn assert_the_service_and_the_budget_select_the_pods(objects: &[Value], deploy: &Value) {
    let pod = &deploy["spec"]["template"];
    let labels = &pod["metadata"]["labels"];
    let container = &pod["spec"]["containers"][0];
    // The Service reaches the pods' HTTP port (/metrics, /snapshot).
    let svc = find(objects, "Service", NAME);
    assert_eq!(svc["spec"]["selector"], *labels);
    let port = &svc["spec"]["ports"][0];
    let container_port = container["ports"].as_array().unwrap().iter().find(|p| p["name"] == port["targetPort"]);
    assert_eq!(
        container_port.map(|p| &p["containerPort"]),
        Some(&port["port"]),
        "Service port {port} -> a container port"
    );
    assert!(container["args"].as_array().unwrap().iter().any(|a| *a == format!("--listen=0.0.0.0:{}", port["port"])));

    // One voluntary eviction at a time, of these pods.
    let pdb = find(objects, "PodDisruptionBudget", NAME);
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
    assert_eq!(pdb["spec"]["selector"]["matchLabels"], *labels);
}

/// Secrets are granted nowhere by default: the only RoleBinding binds the own-namespace
/// Role, and the secrets ClusterRole is bound by no binding here.
fn assert_no_binding_grants_secrets_or_exports(objects: &[Value]) {
    for b in objects.iter().filter(|o| o["kind"].as_str().is_some_and(|k| k.ends_with("Binding"))) {
        assert_ne!(b["roleRef"]["name"], "consul-resolver-operator-secrets", "{b}");
        assert_ne!(b["roleRef"]["name"], "consul-resolver-operator-exports", "{b}");
        assert_eq!(b["subjects"], serde_json::json!([{"kind": "ServiceAccount", "name": NAME, "namespace": NS}]));
    }
}

#[test]
fn the_kustomization_renders_the_whole_install_consistently() {
    let objects = render();
    assert_renders_exactly_the_documented_objects(&objects);
    assert_the_crd_is_the_generated_one(&objects);
    let deploy = find(&objects, "Deployment", NAME);
    assert_the_deployment_runs_two_locked_down_spread_replicas(deploy);
    assert_the_service_and_the_budget_select_the_pods(&objects, deploy);
    assert_no_binding_grants_secrets_or_exports(&objects);
}

/// `kubectl apply -k DIR`, returning its output lines.
fn apply_k(cluster: &Cluster, dir: &Path) -> Vec<String> {
    let out = cluster.kubectl(&["apply", "-k", &dir.display().to_string()]).unwrap();
    out.lines().map(str::to_owned).collect()
}

/// The directory to `kubectl apply -k`: manifests/ itself on a server from 1.25, else a
/// kustomization over it that serves the PodDisruptionBudget as policy/v1beta1 (same
/// fields) where the server lacks policy/v1 (before 1.21), and removes the CRDs' CEL rules
/// (before 1.25), for this 1.20 API server.
fn install_dir(cluster: &Cluster, tmp: &Path) -> std::path::PathBuf {
    let versions = cluster.kubectl(&["api-versions"]).unwrap();
    let mut patches = String::new();
    if !versions.lines().any(|v| v == "policy/v1") {
        assert!(versions.lines().any(|v| v == "policy/v1beta1"), "no PodDisruptionBudget API: {versions}");
        eprintln!("note: this API server has no policy/v1; applying the PodDisruptionBudget as policy/v1beta1");
        patches.push_str(PDB_AS_V1BETA1);
    }
    if server_minor(cluster) < 25 {
        // What README gives users of older servers: the CRDs without their CEL rules, as
        // crds/pre-1.25/ holds them ([`assert_the_crds_are_the_pre_1_25_set`]).
        eprintln!("note: this API server predates CRD validation rules; removing them as README says");
        patches.push_str(WITHOUT_VALIDATION_RULES);
    }
    if patches.is_empty() {
        return repo_root().join("manifests");
    }
    // kustomize takes no absolute path in `resources`: up to / from the overlay, then down.
    let manifests = repo_root().join("manifests");
    let up = "../".repeat(tmp.components().count() - 1);
    let relative = format!("{up}{}", manifests.strip_prefix("/").unwrap().display());
    let overlay = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {relative}\npatches:\n{patches}"
    );
    std::fs::write(tmp.join("kustomization.yaml"), overlay).unwrap();
    tmp.to_path_buf()
}

const PDB_AS_V1BETA1: &str = "  - target: {kind: PodDisruptionBudget}\n    patch: |-\n      - op: replace\n        path: /apiVersion\n        value: policy/v1beta1\n";

/// The kustomize patches that remove every CEL rule of the CRDs (README's recipe for
/// servers before 1.25).
const WITHOUT_VALIDATION_RULES: &str =
    "  - target: {kind: CustomResourceDefinition, name: consulresolvers.consulresolver.io}
    patch: |-
      - op: remove
        path: /spec/versions/0/schema/openAPIV3Schema/properties/spec/x-kubernetes-validations
      - op: remove
        path: /spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/tls/x-kubernetes-validations
  - target: {kind: CustomResourceDefinition, name: consulservices.consulresolver.io}
    patch: |-
      - op: remove
        path: /spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/ports/x-kubernetes-validations
";

/// The overlay for an older server installs exactly crds/pre-1.25/.
fn assert_the_crds_are_the_pre_1_25_set(dir: &Path) {
    let objects = render_dir(dir);
    for (name, file) in [
        ("consulresolvers.consulresolver.io", "consulresolver.yaml"),
        ("consulservices.consulresolver.io", "consulservice.yaml"),
    ] {
        let text = std::fs::read_to_string(repo_root().join("crds/pre-1.25").join(file)).unwrap();
        let expected = yaml_documents(&text).unwrap();
        let crd = find(&objects, "CustomResourceDefinition", name);
        assert!(
            numbers_as_f64(crd.clone()) == numbers_as_f64(expected[0].clone()),
            "{name} differs from crds/pre-1.25/{file}"
        );
    }
}

/// The API server's minor version (`1.20.2` -> 20).
fn server_minor(cluster: &Cluster) -> u32 {
    let version: Value = serde_json::from_str(&cluster.kubectl(&["version", "-o", "json"]).unwrap()).unwrap();
    let minor = version["serverVersion"]["minor"].as_str().expect("serverVersion.minor");
    minor.trim_end_matches('+').parse().expect("a number")
}

#[test]
#[cfg_attr(e2e_external_cluster, ignore = "installs the operator's Deployment: needs the suite's own control plane")]
fn apply_k_installs_everything_and_a_second_apply_changes_nothing() {
    let cluster = Cluster::shared();
    let tmp = tempfile::tempdir().unwrap();
    let dir = install_dir(cluster, tmp.path());
    if server_minor(cluster) < 25 {
        assert_the_crds_are_the_pre_1_25_set(&dir);
    }

    let first = apply_k(cluster, &dir);
    assert_eq!(first.len(), 13, "one line per object: {first:#?}");
    for line in &first {
        assert!(["created", "configured", "unchanged"].iter().any(|w| line.ends_with(w)), "{line}");
    }
    // Nothing the API server defaults or rewrites makes the next apply see a difference.
    let second = apply_k(cluster, &dir);
    assert_eq!(second.len(), first.len());
    for line in &second {
        assert!(line.ends_with(" unchanged"), "a second `kubectl apply -k` changed something: {second:#?}");
    }

    // The objects as the API server stores them.
    let get = |what: &str| -> Value {
        serde_json::from_str(&cluster.kubectl(&["-n", NS, "get", what, "-o", "json"]).unwrap()).unwrap()
    };
    let deploy = get(&format!("deployment/{NAME}"));
    assert_eq!(deploy["spec"]["replicas"], 2);
    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(pod["containers"][0]["image"], format!("consul-resolver-operator:{}", operator_version()));
    assert_eq!(pod["topologySpreadConstraints"].as_array().map(Vec::len), Some(2), "kept by the API server: {pod}");
    let svc = get(&format!("service/{NAME}"));
    assert!(svc["spec"]["clusterIP"].as_str().is_some_and(|ip| !ip.is_empty() && ip != "None"), "{svc}");
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], "http");
    let pdb = get(&format!("poddisruptionbudget/{NAME}"));
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
    get(&format!("serviceaccount/{NAME}"));
    let crd = cluster.kubectl(&[
        "wait",
        "--for",
        "condition=established",
        "--timeout=30s",
        "crd/consulresolvers.consulresolver.io",
    ]);
    assert!(crd.is_ok(), "{crd:?}");
}

// ---------------------------------------------------------------------------------------
// Least privilege, asked as the operator's ServiceAccount

/// Every verb an RBAC rule can grant on a resource.
const VERBS: [&str; 8] = ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"];

/// What the operator may do: (API group, resource, verb). Each is a call in src/ (see
/// manifests/rbac.yaml); anything else must be refused.
const CLUSTER_WIDE: &[(&str, &str, &str)] = &[
    ("consulresolver.io", "consulresolvers", "list"),
    ("consulresolver.io", "consulresolvers", "watch"),
    ("consulresolver.io", "consulresolvers/status", "patch"),
    ("consulresolver.io", "consulservices", "list"),
    ("consulresolver.io", "consulservices", "watch"),
    ("consulresolver.io", "consulservices/status", "patch"),
    ("getambassador.io", "mappings", "list"),
    ("getambassador.io", "mappings", "watch"),
    ("getambassador.io", "tcpmappings", "list"),
    ("getambassador.io", "tcpmappings", "watch"),
    ("discovery.k8s.io", "endpointslices", "list"),
    ("discovery.k8s.io", "endpointslices", "watch"),
    ("", "endpoints", "list"),
    ("", "endpoints", "watch"),
    ("", "namespaces", "list"),
    ("", "namespaces", "watch"),
    ("events.k8s.io", "events", "create"),
    ("events.k8s.io", "events", "patch"),
];
/// Only in consul-resolver-system: the snapshot ConfigMaps and the Lease.
const OWN_NAMESPACE: &[(&str, &str, &str)] = &[
    ("", "configmaps", "get"),
    ("", "configmaps", "list"),
    ("", "configmaps", "create"),
    ("", "configmaps", "update"),
    ("", "configmaps", "delete"),
    ("coordination.k8s.io", "leases", "get"),
    ("coordination.k8s.io", "leases", "create"),
    ("coordination.k8s.io", "leases", "update"),
];
/// Only in a namespace with the documented RoleBinding to consul-resolver-operator-secrets.
const GRANTED_NAMESPACE: &[(&str, &str, &str)] = &[("", "secrets", "list"), ("", "secrets", "watch")];
/// Only in a namespace with the documented RoleBinding to consul-resolver-operator-exports.
const EXPORTING_NAMESPACE: &[(&str, &str, &str)] = &[
    ("", "services", "get"),
    ("", "services", "create"),
    ("", "services", "patch"),
    ("", "services", "delete"),
    ("discovery.k8s.io", "endpointslices", "list"),
    ("discovery.k8s.io", "endpointslices", "create"),
    ("discovery.k8s.io", "endpointslices", "patch"),
    ("discovery.k8s.io", "endpointslices", "delete"),
    ("", "endpoints", "get"),
    ("", "endpoints", "create"),
    ("", "endpoints", "patch"),
    ("", "endpoints", "delete"),
];

type Grant = (String, String, String);

/// A `kubectl auth can-i` round: the namespace (`None`: cluster-wide), the resources asked
/// about, and the grants expected there.
type Question<'a> = (Option<&'a str>, BTreeSet<(&'a str, &'a str)>, BTreeSet<Grant>);

fn grants(lists: &[&[(&str, &str, &str)]]) -> BTreeSet<Grant> {
    lists.iter().flat_map(|l| l.iter()).map(|(g, r, v)| (g.to_string(), r.to_string(), v.to_string())).collect()
}

/// kubectl as the operator's ServiceAccount: (succeeded, stdout, stderr).
fn as_operator(cluster: &Cluster, args: &[&str]) -> (bool, String, String) {
    let out = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(&cluster.operator_kubeconfig)
        .args(args)
        .output()
        .expect("kubectl is required");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `kubectl auth can-i VERB RESOURCE[.GROUP] [--subresource S] (-n NS | -A)` as the operator.
fn can_i(cluster: &Cluster, verb: &str, group: &str, resource: &str, namespace: Option<&str>) -> bool {
    let (resource, sub) = resource.split_once('/').map_or((resource, None), |(r, s)| (r, Some(s)));
    let qualified = if group.is_empty() { resource.to_owned() } else { format!("{resource}.{group}") };
    let mut args = vec!["auth", "can-i", verb, &qualified];
    let sub_flag;
    if let Some(s) = sub {
        sub_flag = format!("--subresource={s}");
        args.push(&sub_flag);
    }
    match namespace {
        Some(ns) => args.extend(["-n", ns]),
        None => args.push("-A"),
    }
    let (_, out, err) = as_operator(cluster, &args);
    match out.as_str() {
        "yes" => true,
        "no" => false,
        _ => panic!("kubectl {}: {out} {err}", args.join(" ")),
    }
}

/// The ServiceAccount's resource rules in `namespace` (SelfSubjectRulesReview), expanded to
/// (group, resource, verb), without the rules every authenticated user has (asking
/// whether one may do something).
fn rules_review(cluster: &Cluster, namespace: &str) -> anyhow::Result<BTreeSet<Grant>> {
    let review = format!(
        "{{\"apiVersion\": \"authorization.k8s.io/v1\", \"kind\": \"SelfSubjectRulesReview\", \"spec\": {{\"namespace\": \"{namespace}\"}}}}"
    );
    let path = tempfile::NamedTempFile::new()?;
    std::fs::write(path.path(), review)?;
    let (ok, out, err) = as_operator(cluster, &["create", "-o", "json", "-f", &path.path().display().to_string()]);
    if !ok {
        bail!("SelfSubjectRulesReview in {namespace}: {err}");
    }
    let status: Value = serde_json::from_str(&out)?;
    if status["status"]["incomplete"] == true {
        bail!("the rules review is incomplete: {status}");
    }
    let mut set = BTreeSet::new();
    for rule in status["status"]["resourceRules"].as_array().into_iter().flatten() {
        if rule["resourceNames"].as_array().is_some_and(|n| !n.is_empty()) {
            bail!("a rule limited to resource names, which manifests/rbac.yaml never writes: {rule}");
        }
        let strs = |v: &Value| -> Vec<String> {
            v.as_array().into_iter().flatten().filter_map(|s| s.as_str().map(str::to_owned)).collect()
        };
        for g in strs(&rule["apiGroups"]) {
            for r in strs(&rule["resources"]) {
                for v in strs(&rule["verbs"]) {
                    set.insert((g.clone(), r.clone(), v));
                }
            }
        }
    }
    // system:basic-user, bound to every authenticated user by the API server itself.
    for r in ["selfsubjectaccessreviews", "selfsubjectrulesreviews"] {
        set.remove(&("authorization.k8s.io".to_owned(), r.to_owned(), "create".to_owned()));
    }
    Ok(set)
}

/// The namespaces the least-privilege test asks about, each granted as documented.
struct Namespaces {
    /// Bound to consul-resolver-operator-secrets: the operator may read its Secrets.
    granted: String,
    /// Without any grant.
    other: String,
    /// Bound to consul-resolver-operator-exports.
    exporting: String,
}

impl Namespaces {
    fn create(cluster: &Cluster) -> Namespaces {
        let granted = cluster.namespace("install-granted").unwrap();
        let other = cluster.namespace("install-other").unwrap();
        // The documented way to let the operator read one namespace's Secrets.
        cluster.grant_secrets(&granted).unwrap();
        let exporting = cluster.namespace("install-exporting").unwrap();
        cluster.grant_exports(&exporting).unwrap();
        Namespaces { granted, other, exporting }
    }
}

/// The whole rule set, per namespace: nothing beyond what the code uses.
fn assert_the_rules_are_what_the_code_uses(cluster: &Cluster, ns: &Namespaces) {
    let Namespaces { granted, other, exporting } = ns;
    assert_eq!(rules_review(cluster, other).unwrap(), grants(&[CLUSTER_WIDE]), "rules in a namespace without a grant");
    assert_eq!(rules_review(cluster, NS).unwrap(), grants(&[CLUSTER_WIDE, OWN_NAMESPACE]), "rules in {NS}");
    assert_eq!(
        rules_review(cluster, granted).unwrap(),
        grants(&[CLUSTER_WIDE, GRANTED_NAMESPACE]),
        "rules in {granted}"
    );
    assert_eq!(
        rules_review(cluster, exporting).unwrap(),
        grants(&[CLUSTER_WIDE, EXPORTING_NAMESPACE]),
        "rules in {exporting}"
    );
}

/// One `kubectl auth can-i` question: (verb, API group, resource, namespace (`None`:
/// cluster-wide), the answer expected).
type CanI<'a> = (&'a str, &'a str, &'a str, Option<&'a str>, bool);

/// Every verb on each resource the operator touches, where it is granted (so each refused
/// verb is refused there, not just elsewhere), and the namespaced ones also where they are
/// not; and a few things an operator has no business doing anywhere.
fn can_i_questions(ns: &Namespaces) -> Vec<CanI<'_>> {
    let resources = |list: &[(&'static str, &'static str, &'static str)]| -> BTreeSet<(&'static str, &'static str)> {
        list.iter().map(|(g, r, _)| (*g, *r)).collect()
    };
    let own_and_secrets: BTreeSet<_> = resources(OWN_NAMESPACE).union(&resources(GRANTED_NAMESPACE)).copied().collect();
    let everywhere = grants(&[CLUSTER_WIDE]);
    let questions: Vec<Question> = vec![
        (None, resources(CLUSTER_WIDE), everywhere.clone()),
        (Some(NS), resources(OWN_NAMESPACE), grants(&[OWN_NAMESPACE])),
        (Some(ns.granted.as_str()), resources(GRANTED_NAMESPACE), grants(&[GRANTED_NAMESPACE])),
        // EndpointSlices are also listed and watched cluster-wide (the Mappings' targets).
        (Some(ns.exporting.as_str()), resources(EXPORTING_NAMESPACE), grants(&[EXPORTING_NAMESPACE, CLUSTER_WIDE])),
        (Some(ns.other.as_str()), resources(EXPORTING_NAMESPACE), everywhere),
        (Some(ns.other.as_str()), own_and_secrets, BTreeSet::new()),
    ];
    let mut asked: Vec<CanI> = Vec::new();
    for (scope, resources, allowed) in &questions {
        for (group, resource) in resources {
            for verb in VERBS {
                let want = allowed.contains(&(group.to_string(), resource.to_string(), verb.to_owned()));
                asked.push((verb, group, resource, *scope, want));
            }
        }
    }
    for (verb, group, resource) in [
        ("get", "", "pods"),
        ("create", "apps", "deployments"),
        ("get", "", "serviceaccounts"),
        ("create", "", "serviceaccounts/token"),
        ("bind", "rbac.authorization.k8s.io", "clusterroles"),
        ("escalate", "rbac.authorization.k8s.io", "roles"),
        ("impersonate", "", "users"),
        ("create", "", "events"),
    ] {
        asked.push((verb, group, resource, Some(NS), false));
    }
    asked
}

/// The questions `kubectl auth can-i` answers otherwise than expected, described.
fn can_i_disagreements(cluster: &Cluster, asked: &[CanI]) -> Vec<String> {
    // Four kubectl processes at a time: each answer is one request, the time is kubectl's.
    std::thread::scope(|s| {
        let workers: Vec<_> = asked
            .chunks(asked.len().div_ceil(4))
            .map(|chunk| {
                s.spawn(move || {
                    chunk
                        .iter()
                        .filter(|(verb, group, resource, scope, want)| {
                            can_i(cluster, verb, group, resource, *scope) != *want
                        })
                        .map(|(verb, group, resource, scope, want)| {
                            format!("{verb} {resource}.{group} in {}: want {want}", scope.unwrap_or("all namespaces"))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap()).collect()
    })
}

/// Real requests: reading Secrets is a list (watched by name), and only where granted.
fn assert_real_requests_stay_within_the_grants(cluster: &Cluster, ns: &Namespaces) {
    let Namespaces { granted, other, .. } = ns;
    let (ok, _, err) = as_operator(cluster, &["-n", granted, "get", "secrets"]);
    assert!(ok, "list Secrets where granted: {err}");
    for (args, what) in [
        (vec!["-n", granted.as_str(), "get", "secret", "any"], "get a Secret by name"),
        (vec!["-n", other.as_str(), "get", "secrets"], "list Secrets without a grant"),
        (vec!["get", "secrets", "-A"], "list Secrets cluster-wide"),
        (vec!["get", "configmaps", "-A"], "list ConfigMaps cluster-wide"),
        (vec!["-n", other.as_str(), "get", "configmaps"], "list ConfigMaps outside its namespace"),
    ] {
        let (ok, _, err) = as_operator(cluster, &args);
        assert!(!ok, "the operator may {what}");
        assert!(err.contains("Forbidden") && err.contains(SA_USER), "{what}: {err}");
    }
}

#[test]
#[cfg_attr(
    e2e_external_cluster,
    ignore = "with E2E_KUBECONFIG the operator's kubeconfig is that one, not the ServiceAccount's"
)]
fn the_service_account_may_do_exactly_what_the_code_does() {
    let cluster = Cluster::shared();
    let ns = Namespaces::create(cluster);
    assert_the_rules_are_what_the_code_uses(cluster, &ns);

    // The same, as `kubectl auth can-i` answers it.
    let asked = can_i_questions(&ns);
    let wrong = can_i_disagreements(cluster, &asked);
    eprintln!("asked `kubectl auth can-i` {} questions as {SA_USER}", asked.len());
    assert!(wrong.is_empty(), "`kubectl auth can-i` as the operator disagrees:\n{}", wrong.join("\n"));

    assert_real_requests_stay_within_the_grants(cluster, &ns);
}
