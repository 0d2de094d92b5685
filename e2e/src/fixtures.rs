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
