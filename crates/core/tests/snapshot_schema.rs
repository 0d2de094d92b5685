//! docs/snapshot.schema.json describes what the operator really publishes: a snapshot
//! assembled by the core from a realistic world (every kind of target, problems, an
//! invalid resolver, a Consul service that never answered, a service whose endpoints are
//! stale, a Kubernetes Service the operator may not watch) validates against it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use consul_resolver_core::assembler::{Config, EndpointsApi, Snapshot};
use consul_resolver_core::keys::{KubeKey, WatchKey};
use consul_resolver_core::model::{ConsulEvent, Event, KubeEvent, WatchFailure};
use consul_resolver_core::model::{Endpoint, Health, KubeObject};
use consul_resolver_core::pipeline::{Pipeline, Step, WallClock};
use serde_json::{Value, json};
use tokio::time::Instant;

const BOOTSTRAP: Duration = Duration::from_secs(30);

fn schema() -> jsonschema::Validator {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/snapshot.schema.json");
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    jsonschema::draft202012::new(&schema).expect("the schema itself is valid draft 2020-12")
}

fn errors(validator: &jsonschema::Validator, doc: &Value) -> Vec<String> {
    validator.iter_errors(doc).map(|e| format!("{} at {}", e, e.instance_path())).collect()
}

fn object(v: Value) -> KubeObject {
    KubeObject::from_value(v).unwrap()
}

fn listed(key: &KubeKey, objects: Vec<KubeObject>) -> Vec<Event> {
    let mut out = vec![Event::Kube(key.clone(), KubeEvent::ListStarted)];
    out.extend(objects.into_iter().map(|o| Event::Kube(key.clone(), KubeEvent::Listed(o))));
    out.push(Event::Kube(key.clone(), KubeEvent::ListDone));
    out
}

/// The watches every world here starts with.
struct Fixed {
    resolvers: KubeKey,
    mappings: KubeKey,
    configmaps: KubeKey,
    exports: KubeKey,
}

impl Fixed {
    fn new() -> Self {
        Fixed {
            resolvers: KubeKey::new("consulresolver.io", "v1alpha1", "ConsulResolver"),
            mappings: KubeKey::new("getambassador.io", "v3alpha1", "Mapping"),
            configmaps: KubeKey::new("", "v1", "ConfigMap").in_namespace("shop"),
            exports: KubeKey::new("consulresolver.io", "v1alpha1", "ConsulService"),
        }
    }

    fn keys(&self) -> BTreeSet<WatchKey> {
        [self.resolvers.clone(), self.mappings.clone(), self.configmaps.clone(), self.exports.clone()]
            .into_iter()
            .map(WatchKey::Kube)
            .collect()
    }
}

/// A world with every shape the snapshot can take, published after the bootstrap timeout.
async fn realistic_snapshot() -> Snapshot {
    let fixed = Fixed::new();
    let cfg = Config {
        endpoints_api: EndpointsApi::Endpoints,
        static_watches: vec![fixed.configmaps.clone()],
        ..Config::default()
    };
    let clock =
        WallClock { instant: Instant::now(), wall: SystemTime::UNIX_EPOCH + Duration::from_secs(1_795_413_600) };
    let mut p = Pipeline::new(cfg, BOOTSTRAP, Duration::from_millis(250), clock);
    let now = Instant::now();
    p.set_fixed(fixed.keys(), now);
    list_resolvers_and_mappings(&mut p, &fixed, now);
    list_exports_and_watched(&mut p, &fixed, now);
    answer_from_consul(&mut p, now);
    tokio::time::advance(BOOTSTRAP).await;
    match p.poll(Instant::now()) {
        Step::Publish(s) => (*s).clone(),
        other => panic!("expected a publication after the bootstrap timeout, got {other:?}"),
    }
}

/// A usable and an invalid resolver, and Mappings of every kind of target through them.
fn list_resolvers_and_mappings(p: &mut Pipeline, fixed: &Fixed, now: Instant) {
    p.apply(
        listed(
            &fixed.resolvers,
            vec![
                object(json!({"metadata": {"namespace": "shop", "name": "consul", "generation": 2},
                              "spec": {"address": "127.0.0.1:8500", "datacenter": "dc1"}})),
                object(json!({"metadata": {"namespace": "shop", "name": "broken", "generation": 1},
                              "spec": {"address": "${NOT_SET_ANYWHERE}:8500"}})),
            ],
        ),
        now,
    );
    let mapping = |name: &str, spec: Value| {
        object(json!({"apiVersion": "getambassador.io/v3alpha1", "kind": "Mapping",
                      "metadata": {"namespace": "shop", "name": name}, "spec": spec}))
    };
    p.apply(
        listed(
            &fixed.mappings,
            vec![
                mapping("billing", json!({"service": "billing:8080", "resolver": "consul", "prefix": "/b/"})),
                mapping("silent", json!({"service": "silent", "resolver": "consul", "prefix": "/s/"})),
                mapping("web", json!({"service": "web:80", "prefix": "/"})),
                mapping("literal", json!({"service": "10.9.9.9:443", "prefix": "/l/"})),
                mapping("missing", json!({"service": "api", "resolver": "nope", "prefix": "/m/"})),
                mapping("via-broken", json!({"service": "api", "resolver": "broken", "prefix": "/x/"})),
                mapping("flaky", json!({"service": "flaky", "resolver": "consul", "prefix": "/f/"})),
                mapping("vault", json!({"service": "vault.locked:8200", "prefix": "/v/"})),
            ],
        ),
        now,
    );
}

/// An export and one whose resolver does not exist, a watched ConfigMap, and the endpoints
/// of a Kubernetes Service with a ready and a not ready address.
fn list_exports_and_watched(p: &mut Pipeline, fixed: &Fixed, now: Instant) {
    p.apply(
        listed(
            &fixed.exports,
            vec![
                object(json!({"metadata": {"namespace": "shop", "name": "billing", "generation": 1},
                              "spec": {"service": "billing", "resolver": "consul"}})),
                object(json!({"metadata": {"namespace": "shop", "name": "lost"},
                              "spec": {"service": "billing", "resolver": "nope"}})),
            ],
        ),
        now,
    );
    p.apply(
        listed(
            &fixed.configmaps,
            vec![object(json!({"apiVersion": "v1", "kind": "ConfigMap",
                               "metadata": {"namespace": "shop", "name": "extra"}, "data": {"k": "v"}}))],
        ),
        now,
    );
    p.apply(
        listed(
            &EndpointsApi::Endpoints.key("shop", "web"),
            vec![object(json!({"metadata": {"namespace": "shop", "name": "web"},
                "subsets": [{"addresses": [{"ip": "10.1.0.1"}], "notReadyAddresses": [{"ip": "10.1.0.2"}],
                             "ports": [{"name": "http", "port": 80}]}]}))],
        ),
        now,
    );
}

/// Consul's answers to every query the world asks for (billing answers, flaky answers then
/// fails, silent never answers), and a Kubernetes Service the operator may not watch.
fn answer_from_consul(p: &mut Pipeline, now: Instant) {
    let consul_keys: Vec<_> = p
        .registry()
        .keys()
        .filter_map(|k| match k {
            WatchKey::Consul(c) => Some(c.clone()),
            WatchKey::Kube(_) => None,
        })
        .collect();
    p.apply(
        [Event::Kube(
            EndpointsApi::Endpoints.key("locked", "vault"),
            KubeEvent::Failed(WatchFailure::rejected("the API server answered 403 Forbidden: endpoints is forbidden")),
        )],
        now,
    );
    for key in consul_keys {
        if key.service == "flaky" {
            // Answers, then fails: its endpoints are kept, stale.
            let endpoints = vec![flaky_endpoint()];
            p.apply([Event::Consul(key.clone(), ConsulEvent::Answer { index: 7, endpoints: endpoints.into() })], now);
            p.apply([Event::Consul(key, ConsulEvent::Failed("500 No cluster leader".into()))], now);
            continue;
        }
        let event = if key.service == "billing" {
            ConsulEvent::Answer { index: 41, endpoints: vec![billing_endpoint()].into() }
        } else {
            ConsulEvent::Failed("Get \"http://127.0.0.1:8500/v1/health/service/silent\": connection refused".into())
        };
        p.apply([Event::Consul(key, event)], now);
    }
}

fn flaky_endpoint() -> Endpoint {
    Endpoint {
        address: "10.0.0.8".into(),
        port: 9000,
        node: "node-2".into(),
        service_id: "flaky-1".into(),
        tags: vec![],
        meta: BTreeMap::new(),
        health: Health::Passing,
        zone: None,
        weight: None,
    }
}

fn billing_endpoint() -> Endpoint {
    Endpoint {
        address: "10.0.0.7".into(),
        port: 8080,
        node: "node-1".into(),
        service_id: "billing-1".into(),
        tags: vec!["blue".into(), "v2".into()],
        meta: BTreeMap::from([("version".to_owned(), "2.3.1".to_owned())]),
        health: Health::Warning,
        zone: None,
        // Registered with `Weights: {Passing: 3, Warning: 2}`.
        weight: Some(2),
    }
}

#[tokio::test(start_paused = true)]
async fn a_published_snapshot_validates_against_the_schema() {
    let snapshot = realistic_snapshot().await;
    let doc: Value = serde_json::from_slice(&snapshot.to_json()).unwrap();

    // The world really has every shape the schema describes.
    let types: BTreeSet<&str> =
        doc["mappings"].as_array().unwrap().iter().map(|m| m["target"]["type"].as_str().unwrap()).collect();
    assert_eq!(types, BTreeSet::from(["address", "consul", "kubernetes", "unresolved"]), "{doc:#}");
    assert_eq!(doc["bootstrap"]["complete"], json!(false));
    assert_eq!(doc["bootstrap"]["unsynced"], json!(["shop/consul/silent"]));
    assert!(!doc["problems"].as_array().unwrap().is_empty());
    assert!(doc["resolvers"].as_array().unwrap().iter().any(|r| r.get("unusable").is_some()));
    let services = doc["resolvers"].as_array().unwrap().iter().flat_map(|r| r["services"].as_array().unwrap());
    assert!(services.clone().any(|s| s.get("stale").is_some()), "{doc:#}");
    assert!(doc["kubernetesServices"].as_array().unwrap().iter().any(|s| s.get("error").is_some()), "{doc:#}");
    assert!(doc["resolvers"].as_array().unwrap().iter().any(|r| r["generation"] == json!(2)));
    let web = doc["kubernetesServices"].as_array().unwrap().iter().find(|s| s["name"] == "web").unwrap();
    assert_eq!(web["endpoints"].as_array().unwrap().len(), 2);
    assert_eq!(doc["watched"][0]["objects"][0]["metadata"]["name"], json!("extra"));
    assert_eq!(doc["exports"][0]["resolver"], json!("shop/consul"));
    assert!(doc["exports"][1]["problem"].as_str().is_some_and(|p| p.contains("nope")), "{doc:#}");

    let validator = schema();
    let errs = errors(&validator, &doc);
    assert!(errs.is_empty(), "{errs:#?}\n{doc:#}");
}

#[tokio::test(start_paused = true)]
async fn the_schema_rejects_what_the_operator_never_writes() {
    let snapshot = realistic_snapshot().await;
    let doc: Value = serde_json::from_slice(&snapshot.to_json()).unwrap();
    let validator = schema();
    // Resolvers are sorted: [0] is shop/broken, [1] is shop/consul.
    type Mutation = (&'static str, fn(&mut Value));
    let mutations: [Mutation; 7] = [
        ("unknown unusable reason", |d| d["resolvers"][0]["unusable"]["reason"] = json!("Broken")),
        ("stale without since", |d| {
            let services = d["resolvers"][1]["services"].as_array_mut().unwrap();
            let flaky = services.iter_mut().find(|s| s["name"] == "flaky").unwrap();
            flaky["stale"].as_object_mut().unwrap().remove("since");
        }),
        ("unknown target type", |d| d["mappings"][0]["target"]["type"] = json!("dns")),
        ("port out of range", |d| d["resolvers"][1]["services"][0]["endpoints"][0]["port"] = json!(70000)),
        ("null instead of absent", |d| d["resolvers"][1]["datacenter"] = Value::Null),
        ("unknown field", |d| d["surprise"] = json!(1)),
        ("bad hash", |d| d["hash"] = json!("md5:abc")),
    ];
    for (what, mutate) in mutations {
        let mut bad = doc.clone();
        mutate(&mut bad);
        assert!(!errors(&validator, &bad).is_empty(), "{what} was accepted");
    }
}
