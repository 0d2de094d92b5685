//! Every CEL rule, evaluated in the generated CRD schema as the API server evaluates it: specs
//! that keep the rule pass, and each spec that breaks it is refused with the rule's message.

use kube::CustomResourceExt;
use kube_cel::Validator;
use proptest::prelude::*;
use serde_json::{Value, json};

use super::CelRule;
use crate::export::{self, ConsulService, ConsulServiceSpec};
use crate::resolver::{self, ConsulResolver};

/// The schema the API server evaluates a kind's objects in: its CRD's openAPIV3Schema.
fn schema<K: CustomResourceExt>() -> Value {
    let crd = K::crd();
    let version = crd.spec.versions.into_iter().next().expect("one version");
    serde_json::to_value(version.schema.expect("a schema").open_api_v3_schema.expect("openAPIV3Schema")).unwrap()
}

/// The failures of an object of `kind` with `spec`, as the API server reports them: (field
/// path, message).
fn refusals(schema: &Value, kind: &str, spec: &Value) -> Vec<(String, String)> {
    let object = json!({
        "apiVersion": "consulresolver.io/v1alpha1",
        "kind": kind,
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": spec,
    });
    match Validator::new().validate(schema, &object, None) {
        Ok(()) => Vec::new(),
        Err(errors) => errors.iter().map(|e| (e.field_path.clone(), e.message.clone())).collect(),
    }
}

/// One rule, where it sits, and specs that keep and that break it.
struct Cases {
    rule: &'static CelRule,
    at: &'static str,
    keep: Vec<Value>,
    refuse: Vec<Value>,
}

/// Checks every case of `cases` in `schema`, and that `cases` cover every rule of `rules`.
fn check(schema: &Value, kind: &str, rules: &[CelRule], cases: &[Cases]) {
    for c in cases {
        for spec in &c.keep {
            assert_eq!(refusals(schema, kind, spec), [], "{spec} keeps {:?}", c.rule.rule);
        }
        for spec in &c.refuse {
            let want = [(c.at.to_owned(), c.rule.message.to_owned())];
            assert_eq!(refusals(schema, kind, spec), want, "{spec} breaks {:?}", c.rule.rule);
        }
    }
    for r in rules {
        assert!(cases.iter().any(|c| c.rule == r && !c.refuse.is_empty()), "no case breaks {:?}", r.rule);
    }
}

/// A resolver's spec: `fields` over a plain address.
fn resolver(fields: Value) -> Value {
    let mut spec = json!({"address": "consul.example:8500"});
    spec.as_object_mut().unwrap().extend(fields.as_object().unwrap().clone());
    spec
}

fn resolver_cases() -> Vec<Cases> {
    let [statuses, tags, cached, remote, https] = &resolver::SPEC_RULES;
    let r = |fields: Vec<Value>| fields.into_iter().map(resolver).collect::<Vec<_>>();
    let tls = json!({"caSecretRef": {"name": "ca", "key": "ca.crt"}});
    let cases = [
        (
            statuses,
            r(vec![json!({"healthStatuses": ["passing", "warning"]}), json!({"onlyPassing": false})]),
            r(vec![json!({"healthStatuses": ["passing"], "onlyPassing": true})]),
        ),
        (
            // `!!a` excludes `!a`, which no required tag can be.
            tags,
            r(vec![json!({"tags": ["web", "!canary"]}), json!({"tags": ["!a", "!!a"]}), json!({"tags": ["a", "!!a"]})]),
            r(vec![json!({"tags": ["web", "!web"]}), json!({"tags": ["!Canary", "v2", "CANARY"]})]),
        ),
        (
            cached,
            r(vec![
                json!({"cached": true, "consistency": "stale"}),
                json!({"cached": false, "consistency": "consistent"}),
            ]),
            r(vec![json!({"cached": true, "consistency": "consistent"})]),
        ),
        (
            remote,
            r(vec![json!({"peer": "dc2"}), json!({"samenessGroup": "web"})]),
            r(vec![json!({"peer": "dc2", "samenessGroup": "web"})]),
        ),
        (
            // A `${VAR}` may hold the scheme, and only the operator knows its value.
            https,
            r(vec![
                json!({"address": "https://consul:8501", "tls": tls}),
                json!({"address": "HTTPS://consul", "tls": tls}),
                json!({"address": "${CONSUL_URL}", "tls": tls}),
                json!({"address": "http://consul:8500"}),
            ]),
            r(vec![json!({"address": "http://consul:8501", "tls": tls}), json!({"address": "consul:8501", "tls": {}})]),
        ),
    ];
    cases.into_iter().map(|(rule, keep, refuse)| Cases { rule, at: "spec", keep, refuse }).collect()
}

fn tls_cases() -> Vec<Cases> {
    let [pair] = &resolver::TLS_RULES;
    let (cert, key) = (json!({"name": "id", "key": "tls.crt"}), json!({"name": "id", "key": "tls.key"}));
    let tls = |t: Value| resolver(json!({"address": "https://consul:8501", "tls": t}));
    vec![Cases {
        rule: pair,
        at: "spec.tls",
        keep: vec![tls(json!({})), tls(json!({"clientCertSecretRef": cert, "clientKeySecretRef": key}))],
        refuse: vec![tls(json!({"clientCertSecretRef": cert})), tls(json!({"clientKeySecretRef": key}))],
    }]
}

#[test]
fn each_resolver_rule_refuses_what_breaks_it_with_its_message() {
    let cases: Vec<Cases> = resolver_cases().into_iter().chain(tls_cases()).collect();
    let rules: Vec<CelRule> = resolver::SPEC_RULES.iter().chain(&resolver::TLS_RULES).copied().collect();
    check(&schema::<ConsulResolver>(), "ConsulResolver", &rules, &cases);
}

fn ports(list: Value) -> Value {
    json!({"service": "web", "ports": list})
}

#[test]
fn each_export_rule_refuses_what_breaks_it_with_its_message() {
    let [names, numbers] = &export::PORTS_RULES;
    let cases = [
        Cases {
            rule: names,
            at: "spec.ports",
            keep: vec![ports(json!([{"name": "http", "port": 80}, {"name": "https", "port": 443}]))],
            refuse: vec![ports(json!([{"name": "http", "port": 80}, {"name": "http", "port": 8080}]))],
        },
        Cases {
            rule: numbers,
            at: "spec.ports",
            // The same number over two protocols: DNS on 53/TCP and 53/UDP.
            keep: vec![ports(json!([{"name": "tcp", "port": 53}, {"name": "udp", "port": 53, "protocol": "UDP"}]))],
            refuse: vec![
                ports(json!([{"name": "a", "port": 80}, {"name": "b", "port": 80}])),
                ports(json!([{"name": "a", "port": 80, "protocol": "TCP"}, {"name": "b", "port": 80}])),
                ports(
                    json!([{"name": "a", "port": 53, "protocol": "UDP"}, {"name": "b", "port": 53, "protocol": "UDP"}]),
                ),
            ],
        },
    ];
    check(&schema::<ConsulService>(), "ConsulService", &export::PORTS_RULES, &cases);
    assert_eq!(refusals(&schema::<ConsulService>(), "ConsulService", &json!({"service": "web"})), []);
}

/// A port list the operator may or may not accept: names and numbers from small sets, so
/// that duplicates are common.
fn port_lists() -> impl Strategy<Value = Vec<(u8, u16, Option<&'static str>)>> {
    let protocol = prop::option::of(prop::sample::select(vec!["TCP", "UDP", "SCTP"]));
    prop::collection::vec((0u8..4, prop::sample::select(vec![53u16, 80, 443]), protocol), 1..6)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// The API server refuses a port list exactly when the operator's own check does.
    #[test]
    fn the_port_rules_agree_with_the_operator(list in port_lists()) {
        let list: Vec<Value> = list
            .into_iter()
            .map(|(name, port, protocol)| match protocol {
                Some(p) => json!({"name": format!("p{name}"), "port": port, "protocol": p}),
                None => json!({"name": format!("p{name}"), "port": port}),
            })
            .collect();
        let spec = ports(Value::Array(list));
        let parsed: ConsulServiceSpec = serde_json::from_value(spec.clone()).unwrap();
        let refused = !refusals(&schema::<ConsulService>(), "ConsulService", &spec).is_empty();
        prop_assert_eq!(refused, parsed.validate("web").is_err(), "{}", spec);
    }
}

/// The fields a rule reads the value of (`self.x`, `p.x`), leaving out those it only asks
/// the presence of (`has(self.x)`), which cost nothing whatever their size.
fn fields_read(rule: &str) -> Vec<String> {
    let mut rest = rule.to_owned();
    while let Some(start) = rest.find("has(") {
        let end = start + rest[start..].find(')').expect("has(...) closes");
        rest.replace_range(start..=end, "");
    }
    let mut fields = Vec::new();
    for (i, _) in rest.match_indices('.') {
        let name: String = rest[i + 1..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        let called = rest[i + 1 + name.len()..].starts_with('(');
        if !name.is_empty() && !called && !name.starts_with(|c: char| c.is_ascii_digit()) {
            fields.push(name);
        }
    }
    fields
}

/// Every node of `schema` that holds rules, with its path.
fn nodes_with_rules<'a>(schema: &'a Value, path: &str, found: &mut Vec<(String, &'a Value)>) {
    if schema.get("x-kubernetes-validations").is_some() {
        found.push((path.to_owned(), schema));
    }
    for (name, child) in schema.get("properties").and_then(Value::as_object).into_iter().flatten() {
        nodes_with_rules(child, &format!("{path}.{name}"), found);
    }
    if let Some(items) = schema.get("items") {
        nodes_with_rules(items, &format!("{path}[]"), found);
    }
}

/// Whether the API server can bound the cost of reading `field`: a string with
/// `maxLength`, a list with `maxItems` (of bounded strings), or a scalar.
fn bounded(field: &Value) -> bool {
    match field["type"].as_str() {
        Some("string") => field.get("maxLength").is_some(),
        Some("array") => field.get("maxItems").is_some() && bounded(&field["items"]),
        Some("object") => false,
        _ => true,
    }
}

#[test]
fn every_list_and_string_a_rule_reads_is_bounded() {
    for schema in [schema::<ConsulResolver>(), schema::<ConsulService>()] {
        let mut nodes = Vec::new();
        nodes_with_rules(&schema, "", &mut nodes);
        assert!(!nodes.is_empty());
        for (path, node) in nodes {
            // A rule on a list reads the list itself, and its items' fields.
            let (holder, fields_of) = match node["type"].as_str() {
                Some("array") => {
                    assert!(node.get("maxItems").is_some(), "{path} holds rules: it needs maxItems");
                    (&node["items"], "items of ")
                }
                _ => (node, ""),
            };
            for rule in node["x-kubernetes-validations"].as_array().unwrap() {
                let rule = rule["rule"].as_str().unwrap();
                for field in fields_read(rule) {
                    let schema = &holder["properties"][&field];
                    assert!(!schema.is_null(), "{rule:?} reads {field}, not a field of the {fields_of}{path}");
                    assert!(bounded(schema), "{rule:?} reads {fields_of}{path}.{field}, which has no bound");
                }
            }
        }
    }
}

#[test]
fn the_rules_that_read_values_find_them() {
    assert_eq!(fields_read("!has(self.tls) || self.address.lowerAscii().startsWith('https://')"), ["address"]);
    assert_eq!(fields_read("self.all(p, self.exists_one(q, q.port == 1.5))"), ["port"]);
}

#[test]
fn the_generated_schemas_hold_exactly_these_rules() {
    let mut generated = Vec::new();
    for schema in [schema::<ConsulResolver>(), schema::<ConsulService>()] {
        let mut nodes = Vec::new();
        nodes_with_rules(&schema, "", &mut nodes);
        for (_, node) in nodes {
            for r in node["x-kubernetes-validations"].as_array().unwrap() {
                // Only `rule` and `message`: see the module's comment on `fieldPath` and `reason`.
                let keys: Vec<&str> = r.as_object().unwrap().keys().map(String::as_str).collect();
                assert_eq!(keys, ["message", "rule"], "{r}");
                generated.push((r["rule"].as_str().unwrap().to_owned(), r["message"].as_str().unwrap().to_owned()));
            }
        }
    }
    let ours = resolver::SPEC_RULES.iter().chain(&resolver::TLS_RULES).chain(&export::PORTS_RULES);
    let mut ours: Vec<(String, String)> = ours.map(|r| (r.rule.to_owned(), r.message.to_owned())).collect();
    generated.sort();
    ours.sort();
    assert_eq!(generated, ours);
}

#[test]
fn a_spec_using_every_field_at_once_is_refused_by_no_rule() {
    let secret = |key: &str| json!({"name": "consul", "key": key});
    let spec = json!({
        "address": "https://consul.example:8501", "datacenter": "dc1", "namespace": "team",
        "partition": "shop", "peer": "dc2", "filter": "Service.Meta.version == \"2\"",
        "tokenSecretRef": secret("token"),
        "tls": {"caSecretRef": secret("ca.crt"), "serverName": "consul", "insecureSkipVerify": false,
                "clientCertSecretRef": secret("tls.crt"), "clientKeySecretRef": secret("tls.key")},
        "healthStatuses": ["passing", "warning"], "tags": ["web", "!canary", "V2"], "consistency": "stale",
        "cached": true, "connect": false, "addressType": "lan_ipv4", "services": ["web", "db"],
        "ambassadorId": ["default"], "allowedNamespaces": {"from": "All"},
    });
    assert_eq!(refusals(&schema::<ConsulResolver>(), "ConsulResolver", &spec), []);
    let export = json!({
        "resolver": "consul", "service": "web", "headless": false, "ipFamily": "IPv4", "ambassadorId": ["default"],
        "ports": [{"name": "http", "port": 80, "appProtocol": "http"}, {"name": "metrics", "port": 9100, "targetPort": 9100},
                  {"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "dns-tcp", "port": 53, "protocol": "TCP"}],
    });
    assert_eq!(refusals(&schema::<ConsulService>(), "ConsulService", &export), []);
}
