//! Bad input, black box: what the CRD schema can refuse is refused at `kubectl apply`,
//! naming the field; what it cannot judge is reported on the object (resolver status and
//! Event, or a Mapping's problem in the snapshot) with a message naming the field, and
//! harms nobody else: a healthy resolver's service stays published and follows Consul.
//!
//! Names colliding across namespaces (two resolvers called the same, a Mapping naming one
//! that exists in several namespaces) are `kube_side::resolver_lookup_across_namespaces_and_ambiguous_names_are_reported`;
//! here, same-named resolvers and Mappings in two namespaces each keep to their own.

use std::time::Duration;

use consul_resolver_api::status::{condition, reason};
use e2e::consul::Consul;
use e2e::fixtures::{mapping_yaml, ports, resolver_yaml};
use e2e::harness::{Cluster, Operator, unique, wait_for};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(30);

fn create(cluster: &Cluster, object: &Value) -> anyhow::Result<String> {
    // `create`, not `apply`: apply keeps a copy of the object in an annotation, which the API
    // server limits to 256 KiB, and that would refuse the large objects for the wrong reason.
    // Without kubectl's own checks: the API server's schema is what is tested.
    cluster.kubectl_stdin(&["create", "--validate=false", "-f", "-"], Some(&object.to_string()))
}

fn resolver(ns: &str, name: &str, spec: Value) -> Value {
    json!({"apiVersion": "consulresolver.io/v1alpha1", "kind": "ConsulResolver",
           "metadata": {"name": name, "namespace": ns}, "spec": spec})
}

#[test]
fn the_schema_refuses_at_apply_what_it_can_naming_the_field() {
    let cluster = Cluster::shared();
    let ns = cluster.namespace("schema").unwrap();
    let ok = "127.0.0.1:8500";
    let secret = |name: &str, key: &str| json!({"name": name, "key": key});
    let many = |n: usize| (0..n).map(|i| format!("svc-{i}")).collect::<Vec<_>>();
    let mebibyte = "a".repeat(1 << 20);
    let cases: Vec<(&str, Value, &str)> = vec![
        ("an empty address", json!({"address": ""}), "spec.address"),
        ("an address with spaces", json!({"address": "not an address"}), "spec.address"),
        ("an unknown scheme", json!({"address": "ftp://127.0.0.1:8500"}), "spec.address"),
        ("an address with a path", json!({"address": "http://127.0.0.1:8500/v1"}), "spec.address"),
        ("a 1 MiB address", json!({"address": mebibyte}), "spec.address"),
        ("no address", json!({"datacenter": "dc1"}), "spec.address"),
        ("a datacenter with a space", json!({"address": ok, "datacenter": "dc 1"}), "spec.datacenter"),
        ("a Consul namespace with a slash", json!({"address": ok, "namespace": "a/b"}), "spec.namespace"),
        (
            "a Secret name no selector holds",
            json!({"address": ok, "tokenSecretRef": secret("a,b", "t")}),
            "spec.tokenSecretRef.name",
        ),
        (
            "an upper-case Secret name",
            json!({"address": ok, "tokenSecretRef": secret("Acl", "t")}),
            "spec.tokenSecretRef.name",
        ),
        (
            "a Secret key with a space",
            json!({"address": ok, "tokenSecretRef": secret("acl", "to ken")}),
            "spec.tokenSecretRef.key",
        ),
        (
            "a Secret reference without a key",
            json!({"address": ok, "tokenSecretRef": {"name": "acl"}}),
            "spec.tokenSecretRef.key",
        ),
        (
            "a CA reference with a bad name",
            json!({"address": "https://h:8501", "tls": {"caSecretRef": secret("-ca", "ca.crt")}}),
            "spec.tls.caSecretRef.name",
        ),
        (
            "a server name with a space",
            json!({"address": "https://h:8501", "tls": {"serverName": "a b"}}),
            "spec.tls.serverName",
        ),
        ("10,000 services", json!({"address": ok, "services": many(10_000)}), "spec.services"),
        ("an empty service name", json!({"address": ok, "services": [""]}), "spec.services"),
        ("65 Ambassador IDs", json!({"address": ok, "ambassadorId": many(65)}), "spec.ambassadorId"),
        ("65 tags", json!({"address": ok, "tags": many(65)}), "spec.tags"),
        ("an unknown health status", json!({"address": ok, "healthStatuses": ["up"]}), "spec.healthStatuses"),
        ("an unknown consistency", json!({"address": ok, "consistency": "eventual"}), "spec.consistency"),
        ("a boolean as a string", json!({"address": ok, "cached": "yes"}), "spec.cached"),
    ];
    for (i, (what, spec, field)) in cases.iter().enumerate() {
        let err = create(cluster, &resolver(&ns, &format!("bad-{i}"), spec.clone()))
            .expect_err(&format!("{what} was accepted"))
            .to_string();
        assert!(err.contains(field), "{what}: refused, naming {field}: {}", &err[..err.len().min(2000)]);
    }
    // No spec at all.
    let err = create(
        cluster,
        &json!({"apiVersion": "consulresolver.io/v1alpha1", "kind": "ConsulResolver",
                                      "metadata": {"name": "nospec", "namespace": ns}}),
    )
    .unwrap_err();
    assert!(err.to_string().contains("spec"), "{err}");
    // Versions and kinds nobody serves.
    for (api_version, kind) in [("consulresolver.io/v1beta9", "ConsulResolver"), ("getambassador.io/v9", "Mapping")] {
        let object =
            json!({"apiVersion": api_version, "kind": kind, "metadata": {"name": "x", "namespace": ns}, "spec": {}});
        let err = create(cluster, &object).unwrap_err().to_string();
        assert!(err.contains("no matches for kind") && err.contains(kind), "{api_version}: {err}");
    }

    // A 1 MiB spec of fields the schema does not know is pruned: what is stored is the spec.
    let mut spec = json!({"address": ok, "services": many(1000)});
    spec["notAField"] = json!(mebibyte);
    create(cluster, &resolver(&ns, "pruned", spec)).unwrap();
    let stored: Value =
        serde_json::from_str(&cluster.kubectl(&["-n", &ns, "get", "cres", "pruned", "-o", "json"]).unwrap()).unwrap();
    assert!(stored["spec"].get("notAField").is_none(), "unknown fields are pruned");
    assert_eq!(stored["spec"]["services"].as_array().map(Vec::len), Some(1000), "1,000 services are accepted");
}

/// A Secret with raw bytes under `key`.
fn secret(ns: &str, name: &str, key: &str, bytes: &[u8]) -> Value {
    let b64 = {
        const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::new();
        for c in bytes.chunks(3) {
            let n = c.iter().enumerate().fold(0u32, |acc, (i, b)| acc | u32::from(*b) << (16 - 8 * i));
            for i in 0..=c.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            }
        }
        while !out.len().is_multiple_of(4) {
            out.push('=');
        }
        out
    };
    json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": ns}, "data": {key: b64}})
}

/// A problem of the snapshot about `kind` `ns/name`.
fn problem(snapshot: &Value, kind: &str, ns: &str, name: &str) -> Option<String> {
    snapshot["problems"]
        .as_array()?
        .iter()
        .find(|p| p["kind"] == kind && p["namespace"] == ns && p["name"] == name)
        .and_then(|p| p["message"].as_str().map(str::to_owned))
}

/// A resolver the schema accepts and the operator cannot use: (name, address, more spec,
/// condition reason, what the message must contain).
type BadResolver = (&'static str, String, String, &'static str, &'static str);

/// The bad resolvers; the good address is `addr`, and the Secrets they name hold `acl`
/// (a token under `token`) and `binary` (bytes that are not UTF-8 under `token`).
fn bad_resolvers(addr: &str) -> [BadResolver; 9] {
    let token = |name: &str, key: &str| format!("  tokenSecretRef: {{name: {name}, key: {key}}}\n");
    let addr = addr.to_owned();
    [
        ("unset-var", "${NOT_SET_ANYWHERE}:8500".to_owned(), String::new(), reason::INVALID_SPEC, "spec.address"),
        ("port-too-big", "127.0.0.1:99999".into(), String::new(), reason::INVALID_SPEC, "spec.address"),
        ("unclosed-v6", "http://[::1".into(), String::new(), reason::INVALID_SPEC, "spec.address"),
        ("tls-on-http", addr.clone(), "  tls: {insecureSkipVerify: true}\n".into(), reason::INVALID_SPEC, "spec.tls"),
        (
            "both-statuses",
            addr.clone(),
            "  healthStatuses: [passing]\n  onlyPassing: true\n".into(),
            reason::INVALID_SPEC,
            "spec.healthStatuses and spec.onlyPassing",
        ),
        (
            "cached-consistent",
            addr.clone(),
            "  cached: true\n  consistency: consistent\n".into(),
            reason::INVALID_SPEC,
            "spec.cached",
        ),
        ("no-secret", addr.clone(), token("nope", "token"), reason::SECRET_UNAVAILABLE, "spec.tokenSecretRef: Secret"),
        ("wrong-key", addr.clone(), token("acl", "nokey"), reason::SECRET_UNAVAILABLE, "has no key \"nokey\""),
        ("not-utf8", addr, token("binary", "token"), reason::SECRET_UNAVAILABLE, "is not UTF-8"),
    ]
}

/// Mappings with a bad `service`: (name, spec, what the problem must say). The Mapping CRD
/// keeps any spec: Ambassador's own schema is not the operator's to rely on.
fn bad_mappings() -> [(&'static str, Value, &'static str); 6] {
    [
        ("no-service", json!({"prefix": "/a/", "resolver": "consul"}), "spec.service: service is empty"),
        ("a-number", json!({"prefix": "/b/", "service": 42, "resolver": "consul"}), "spec is not valid"),
        (
            "a-named-port",
            json!({"service": "web:http", "resolver": "consul"}),
            "spec.service: service \"web:http\" has an invalid port",
        ),
        (
            "a-path",
            json!({"service": "http://web/api", "resolver": "consul"}),
            "spec.service: service \"http://web/api\" has a path",
        ),
        (
            "garbage",
            json!({"service": "w$b", "resolver": "consul"}),
            "spec.service: service \"w$b\" has an invalid name",
        ),
        ("ids-not-strings", json!({"service": "web", "ambassador_id": [1, 2]}), "spec is not valid"),
    ]
}

/// In `ns`: the Secrets the bad resolvers name, each bad resolver with a Mapping of `svc`
/// through it, and the bad Mappings. In `ns` and `twin`: the healthy resolver `consul` at
/// `addr`, each with a Mapping `m` of `svc`, of the same names.
fn apply_the_bad_and_the_healthy(
    cluster: &Cluster,
    (ns, twin): (&str, &str),
    (addr, svc): (&str, &str),
    resolvers: &[BadResolver],
    mappings: &[(&str, Value, &str)],
) {
    create(cluster, &secret(ns, "acl", "token", b"anonymous-is-fine")).unwrap();
    create(cluster, &secret(ns, "binary", "token", &[0xff, 0xfe, 0x00, 0x80])).unwrap();
    for (name, address, extra, _, _) in resolvers {
        cluster.apply(&resolver_yaml(ns, name, address, extra)).unwrap();
        cluster.apply(&mapping_yaml(ns, &format!("via-{name}"), svc, Some(name))).unwrap();
    }
    for n in [ns, twin] {
        cluster.apply(&resolver_yaml(n, "consul", addr, "")).unwrap();
        cluster.apply(&mapping_yaml(n, "m", svc, Some("consul"))).unwrap();
    }
    for (name, spec, _) in mappings {
        let object = json!({"apiVersion": "getambassador.io/v3alpha1", "kind": "Mapping",
                            "metadata": {"name": name, "namespace": ns}, "spec": spec});
        create(cluster, &object).unwrap();
    }
}

/// Each bad Mapping's problem in `snap` says what is wrong, and the same-named Mappings of
/// the two namespaces each route to their own namespace's resolver.
fn assert_the_mappings_reported_and_kept_apart(
    snap: &Value,
    (ns, twin): (&str, &str),
    mappings: &[(&str, Value, &str)],
) {
    for (name, _, says) in mappings {
        let message = problem(snap, "Mapping", ns, name).unwrap();
        assert!(message.contains(says), "Mapping {name}: {message:?} should say {says:?}");
    }
    for n in [ns, twin] {
        let m = snap["mappings"].as_array().unwrap().iter().find(|m| m["namespace"] == n && m["name"] == "m");
        assert_eq!(m.map(|m| &m["target"]["resolverNamespace"]), Some(&json!(n)), "{m:?}");
    }
}

/// The resolver `ns/name` is Ready=False for `reason`, and a Warning Event says so; both
/// messages contain `says`.
fn assert_reported_on_the_resolver(
    cluster: &Cluster,
    op: &Operator,
    ns: &str,
    (name, reason, says): (&str, &str, &str),
) {
    let ready = wait_for(&format!("{name}: Ready=False/{reason}"), T, || {
        cluster
            .resolver_condition(ns, name, condition::READY)
            .filter(|c| c["status"] == "False" && c["reason"] == reason)
    })
    .unwrap_or_else(|e| panic!("{e}: {:?}\n{}", cluster.resolver_condition(ns, name, condition::READY), op.logs()));
    let message = ready["message"].as_str().unwrap_or_default();
    assert!(message.contains(says), "{name}: {message:?} should say {says:?}");
    let event = wait_for(&format!("a {reason} Event on {name}"), T, || {
        cluster.events_about(ns, name).into_iter().find(|e| e["reason"] == reason && e["type"] == "Warning")
    })
    .unwrap();
    assert!(event["message"].as_str().unwrap_or_default().contains(says), "{name}: {event}");
}

#[test]
fn what_the_schema_cannot_judge_is_reported_on_the_object_naming_the_field() {
    let cluster = Cluster::shared();
    let consul = Consul::shared();
    let ns = cluster.namespace("badin").unwrap();
    let twin = cluster.namespace("badin-twin").unwrap();
    cluster.grant_secrets(&ns).unwrap();
    let svc = format!("bi{}", unique());
    consul.register("node-bi", "127.0.0.1", &svc, &format!("{svc}-1"), 24001, "passing").unwrap();
    let addr = consul.address();
    let (resolvers, mappings) = (bad_resolvers(&addr), bad_mappings());
    apply_the_bad_and_the_healthy(cluster, (&ns, &twin), (&addr, &svc), &resolvers, &mappings);

    let mut op =
        Operator::start(cluster, &["--namespace", &ns, "--namespace", &twin, "--bootstrap-timeout", "2s"]).unwrap();
    op.wait_ready(T).unwrap();
    let snap = op
        .wait_snapshot("every Mapping and the healthy service in both namespaces", T, |s| {
            ports(s, &ns, "consul", &svc) == Some(vec![24001])
                && ports(s, &twin, "consul", &svc) == Some(vec![24001])
                && mappings.iter().all(|(name, _, _)| problem(s, "Mapping", &ns, name).is_some())
        })
        .unwrap();
    assert_the_mappings_reported_and_kept_apart(&snap, (&ns, &twin), &mappings);
    for (name, _, _, reason, says) in &resolvers {
        assert_reported_on_the_resolver(cluster, &op, &ns, (name, reason, says));
    }

    // Nobody else is harmed: the healthy resolver follows Consul, in both namespaces.
    consul.register("node-bi", "127.0.0.1", &svc, &format!("{svc}-1"), 24002, "passing").unwrap();
    op.wait_snapshot("the healthy service's change", T, |s| {
        ports(s, &ns, "consul", &svc) == Some(vec![24002]) && ports(s, &twin, "consul", &svc) == Some(vec![24002])
    })
    .unwrap();
    for n in [&ns, &twin] {
        let ready = cluster.resolver_condition(n, "consul", condition::READY).unwrap_or_default();
        assert_eq!(ready["status"], "True", "{n}/consul: {ready}");
    }
    assert!(op.terminate(T).unwrap().success(), "{}", op.logs());
}
