//! Objects the e2e tests apply, and readers of the published snapshot, shared by the test
//! binaries so each does not keep its own copy.

use serde_json::Value;

/// A ConsulResolver; `extra` is more of its spec, as YAML lines indented by two spaces.
pub fn resolver_yaml(ns: &str, name: &str, address: &str, extra: &str) -> String {
    format!(
        "apiVersion: consulresolver.io/v1alpha1\nkind: ConsulResolver\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  address: \"{address}\"\n{extra}"
    )
}

/// A Mapping; `resolver: None` leaves `spec.resolver` out (a Kubernetes Service, or the
/// `--default-resolver`).
pub fn mapping_yaml(ns: &str, name: &str, service: &str, resolver: Option<&str>) -> String {
    let resolver = resolver.map(|r| format!(", resolver: \"{r}\"")).unwrap_or_default();
    format!(
        "apiVersion: getambassador.io/v3alpha1\nkind: Mapping\nmetadata: {{name: {name}, namespace: {ns}}}\nspec: {{prefix: /{name}/, service: \"{service}\"{resolver}}}\n"
    )
}

/// A Secret holding `token` under the key `token`.
pub fn secret_yaml(ns: &str, name: &str, token: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: {name}, namespace: {ns}}}\nstringData: {{token: \"{token}\"}}\n"
    )
}

/// The entry of `service` under resolver `ns/name` in a snapshot.
pub fn service<'a>(snapshot: &'a Value, ns: &str, name: &str, service: &str) -> Option<&'a Value> {
    let r = snapshot["resolvers"].as_array()?.iter().find(|r| r["namespace"] == ns && r["name"] == name)?;
    r["services"].as_array()?.iter().find(|s| s["name"] == service)
}

/// Ports of the endpoints of `service` under resolver `ns/name` in a snapshot, sorted.
pub fn ports(snapshot: &Value, ns: &str, name: &str, service: &str) -> Option<Vec<u64>> {
    let r = snapshot["resolvers"].as_array()?.iter().find(|r| r["namespace"] == ns && r["name"] == name)?;
    let s = r["services"].as_array()?.iter().find(|s| s["name"] == service)?;
    let mut p: Vec<u64> = s["endpoints"].as_array()?.iter().filter_map(|e| e["port"].as_u64()).collect();
    p.sort();
    Some(p)
}

/// A ConsulService (an export of `service` through resolver `resolver`); `extra` is more of
/// its spec, as YAML lines indented by two spaces.
pub fn export_yaml(ns: &str, name: &str, service: &str, resolver: &str, extra: &str) -> String {
    format!(
        "apiVersion: consulresolver.io/v1alpha1\nkind: ConsulService\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  service: \"{service}\"\n  resolver: \"{resolver}\"\n{extra}"
    )
}

/// The EndpointSlices of Service `service` in `ns` (found by `kubernetes.io/service-name`,
/// as every consumer finds them), by name; empty when they cannot be read. The test API
/// server (1.20) serves them as `discovery.k8s.io/v1beta1`.
pub fn slices(cluster: &crate::harness::Cluster, ns: &str, service: &str) -> std::collections::BTreeMap<String, Value> {
    let selector = format!("kubernetes.io/service-name={service}");
    let args = ["-n", ns, "get", "endpointslices.v1beta1.discovery.k8s.io", "-l", &selector, "-o", "json"];
    let list: Value = cluster.kubectl(&args).ok().and_then(|out| serde_json::from_str(&out).ok()).unwrap_or_default();
    list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| (s["metadata"]["name"].as_str().unwrap_or_default().to_owned(), s.clone()))
        .collect()
}

/// The endpoint addresses of `slices` (each endpoint's first, as kube-proxy reads), sorted.
pub fn slice_addresses(slices: &std::collections::BTreeMap<String, Value>) -> Vec<String> {
    let mut all: Vec<String> = slices
        .values()
        .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default())
        .filter_map(|e| e["addresses"][0].as_str().map(str::to_owned))
        .collect();
    all.sort();
    all
}
