//! Behaviour of the core as a whole: the pipeline driven by events and a paused clock.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;

use super::aggregator::{ConsulEvent, Event, KubeEvent};
use super::assembler::snapshot::Target;
use super::assembler::{self, Config, EndpointsApi};
use super::keys::{ConsulKey, KubeKey, WatchKey};
use super::model::{Endpoint, Health, KubeObject};
use super::pipeline::{Pipeline, Step};

const MAX_RETRY: Duration = Duration::from_secs(30);

const WINDOW: Duration = Duration::from_millis(250);
const BOOTSTRAP: Duration = Duration::from_secs(30);

fn resolvers_key() -> KubeKey {
    KubeKey::new("consulresolver.io", "v1alpha1", "ConsulResolver")
}
fn mappings_key() -> KubeKey {
    KubeKey::new("getambassador.io", "v3alpha1", "Mapping")
}
fn fixed() -> BTreeSet<WatchKey> {
    [resolvers_key().into(), mappings_key().into()].into_iter().collect()
}

fn object(v: Value) -> KubeObject {
    KubeObject::from_value(v).unwrap()
}
fn resolver(ns: &str, name: &str, spec: Value) -> KubeObject {
    object(json!({"apiVersion": "consulresolver.io/v1alpha1", "kind": "ConsulResolver",
                  "metadata": {"namespace": ns, "name": name}, "spec": spec}))
}
fn mapping(ns: &str, name: &str, spec: Value) -> KubeObject {
    object(json!({"apiVersion": "getambassador.io/v3alpha1", "kind": "Mapping",
                  "metadata": {"namespace": ns, "name": name}, "spec": spec}))
}
fn listed(key: &KubeKey, objects: Vec<KubeObject>) -> Vec<Event> {
    let mut out = vec![Event::Kube(key.clone(), KubeEvent::ListStarted)];
    out.extend(objects.into_iter().map(|o| Event::Kube(key.clone(), KubeEvent::Listed(o))));
    out.push(Event::Kube(key.clone(), KubeEvent::ListDone));
    out
}
fn ep(addr: &str, port: u16) -> Endpoint {
    Endpoint {
        address: addr.into(),
        port,
        node: "node-1".into(),
        service_id: format!("{addr}:{port}"),
        tags: vec![],
        meta: Default::default(),
        health: Health::Passing,
    }
}
fn consul_keys(p: &Pipeline) -> Vec<ConsulKey> {
    p.registry()
        .keys()
        .filter_map(|k| match k {
            WatchKey::Consul(c) => Some(c.clone()),
            WatchKey::Kube(_) => None,
        })
        .collect()
}
fn publish(p: &mut Pipeline) -> Option<std::sync::Arc<super::assembler::Snapshot>> {
    match p.poll(Instant::now()) {
        Step::Publish(s) => {
            p.published(&s, true, Instant::now());
            Some(s)
        }
        _ => None,
    }
}

/// A world with one resolver and one Mapping through it, listed; the Consul key started.
fn bootstrapped_pipeline() -> (Pipeline, ConsulKey) {
    let mut p = Pipeline::new(Config::default(), BOOTSTRAP, WINDOW);
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    p.apply(listed(&resolvers_key(), vec![resolver("shop", "consul", json!({"address": "127.0.0.1:8500"}))]), now);
    let diff = p.apply(
        listed(
            &mappings_key(),
            vec![mapping("shop", "billing", json!({"service": "billing:8080", "resolver": "consul"}))],
        ),
        now,
    );
    assert_eq!(diff.start.len(), 1, "the Mapping implies exactly one Consul watch: {diff:?}");
    let key = consul_keys(&p).remove(0);
    (p, key)
}

#[tokio::test(start_paused = true)]
async fn nothing_publishes_before_bootstrap() {
    let mut p = Pipeline::new(Config::default(), BOOTSTRAP, WINDOW);
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    assert_eq!(p.poll(now), Step::Idle, "Kubernetes kinds not listed: no timeout, no publication");
    p.apply(listed(&resolvers_key(), vec![resolver("shop", "consul", json!({"address": "127.0.0.1:8500"}))]), now);
    assert_eq!(p.poll(now), Step::Idle, "Mappings not listed yet");
    p.apply(
        listed(&mappings_key(), vec![mapping("shop", "billing", json!({"service": "billing", "resolver": "consul"}))]),
        now,
    );
    // Everything listed, but the Consul service the Mapping references has not answered.
    assert_eq!(p.poll(now), Step::WaitUntil(now + BOOTSTRAP));
    let key = consul_keys(&p).remove(0);
    p.apply([Event::Consul(key, ConsulEvent::Answer { index: 3, endpoints: vec![ep("10.0.0.1", 80)] })], now);
    let snap = publish(&mut p).expect("complete: publishes at once");
    assert!(snap.content.bootstrap.complete);
    assert_eq!(snap.content.resolvers[0].services[0].endpoints, vec![ep("10.0.0.1", 80)]);
}

#[tokio::test(start_paused = true)]
async fn unreachable_consul_publishes_after_the_bootstrap_timeout() {
    let (mut p, key) = bootstrapped_pipeline();
    p.apply(
        [Event::Consul(key, ConsulEvent::Failed("connect 127.0.0.1:8500: connection refused".into()))],
        Instant::now(),
    );
    assert!(matches!(p.poll(Instant::now()), Step::WaitUntil(_)));
    tokio::time::advance(BOOTSTRAP).await;
    let snap = publish(&mut p).expect("published after the timeout");
    assert!(!snap.content.bootstrap.complete);
    assert_eq!(snap.content.bootstrap.unsynced, ["shop/consul/billing"]);
    let svc = &snap.content.resolvers[0].services[0];
    assert!(!svc.synced);
    assert_eq!(svc.error.as_deref(), Some("connect 127.0.0.1:8500: connection refused"));
}

#[tokio::test(start_paused = true)]
async fn a_burst_of_ten_thousand_events_is_at_most_two_publications_ending_in_the_final_world() {
    let (mut p, key) = bootstrapped_pipeline();
    p.apply([Event::Consul(key.clone(), ConsulEvent::Answer { index: 1, endpoints: vec![] })], Instant::now());
    publish(&mut p).expect("initial snapshot");
    tokio::time::advance(WINDOW * 4).await; // quiet

    let mut publications = Vec::new();
    let start = Instant::now();
    for i in 0..10_000u32 {
        // Spread over just under one window.
        if i % 100 == 0 {
            tokio::time::advance(WINDOW / 101).await;
        }
        let endpoints = vec![ep("10.0.0.1", 1 + (i % 60_000) as u16)];
        p.apply([Event::Consul(key.clone(), ConsulEvent::Answer { index: 2 + i as u64, endpoints })], Instant::now());
        if let Some(s) = publish(&mut p) {
            publications.push(s);
        }
    }
    assert!(Instant::now() - start < WINDOW, "the burst fits inside one window");
    // Drain: the trailing edge.
    loop {
        match p.poll(Instant::now()) {
            Step::WaitUntil(t) => tokio::time::advance(t - Instant::now()).await,
            Step::Publish(s) => {
                p.published(&s, true, Instant::now());
                publications.push(s);
            }
            Step::Idle => break,
        }
    }
    assert!(publications.len() <= 2, "{} publications", publications.len());
    let last = publications.last().unwrap();
    assert_eq!(last.content.resolvers[0].services[0].endpoints, vec![ep("10.0.0.1", 10_000)]);
    assert_eq!(last.content.resolvers[0].services[0].index, Some(10_001));
    let ids: Vec<u64> = publications.iter().map(|s| s.id).collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids increase: {ids:?}");
}

#[tokio::test(start_paused = true)]
async fn a_slow_publication_is_never_overlapped_and_gets_one_follow_up() {
    let (mut p, key) = bootstrapped_pipeline();
    p.apply([Event::Consul(key.clone(), ConsulEvent::Answer { index: 1, endpoints: vec![] })], Instant::now());
    let Step::Publish(first) = p.poll(Instant::now()) else { panic!("expected a publication") };
    for i in 0..500u16 {
        tokio::time::advance(WINDOW / 10).await;
        p.apply(
            [Event::Consul(
                key.clone(),
                ConsulEvent::Answer { index: 2 + u64::from(i), endpoints: vec![ep("10.0.0.2", i + 1)] },
            )],
            Instant::now(),
        );
        assert_eq!(p.poll(Instant::now()), Step::Idle, "never two at once");
    }
    p.published(&first, true, Instant::now());
    let follow_up = publish(&mut p).expect("one follow-up at once");
    assert_eq!(follow_up.content.resolvers[0].services[0].endpoints, vec![ep("10.0.0.2", 500)]);
    assert_eq!(p.poll(Instant::now()), Step::Idle);
}

#[tokio::test(start_paused = true)]
async fn unchanged_content_is_not_republished_and_failures_are_retried() {
    let (mut p, key) = bootstrapped_pipeline();
    let answer = |i| Event::Consul(key.clone(), ConsulEvent::Answer { index: i, endpoints: vec![ep("10.0.0.1", 80)] });
    p.apply([answer(1)], Instant::now());
    let first = publish(&mut p).unwrap();
    tokio::time::advance(WINDOW).await;
    // A Consul wake-up with a new index but the same endpoints is no change at all.
    p.apply([answer(1)], Instant::now());
    assert_eq!(p.poll(Instant::now()), Step::Idle);
    // A Mapping changes; its publication fails; the retry comes later with the latest.
    p.apply(
        [Event::Kube(
            mappings_key(),
            KubeEvent::Applied(mapping("shop", "extra", json!({"service": "billing", "resolver": "consul"}))),
        )],
        Instant::now(),
    );
    let Step::Publish(s) = p.poll(Instant::now()) else { panic!() };
    assert_eq!(s.id, first.id + 1);
    p.published(&s, false, Instant::now());
    let Step::WaitUntil(retry) = p.poll(Instant::now()) else { panic!("backs off") };
    assert!(retry > Instant::now());
    tokio::time::advance(retry - Instant::now()).await;
    let again = publish(&mut p).expect("retried");
    assert_eq!(again.hash, s.hash);
}

#[tokio::test(start_paused = true)]
async fn a_new_leader_republishes_unchanged_content_above_the_previous_leaders_id() {
    let (mut p, key) = bootstrapped_pipeline();
    p.apply(
        [Event::Consul(key, ConsulEvent::Answer { index: 1, endpoints: vec![ep("10.0.0.1", 80)] })],
        Instant::now(),
    );
    let first = publish(&mut p).unwrap();
    tokio::time::advance(WINDOW).await;
    assert_eq!(p.poll(Instant::now()), Step::Idle);
    // The ConfigMap says another replica got to id 41 with this same world.
    p.republish(41);
    let Step::Publish(again) = p.poll(Instant::now()) else { panic!("republished although unchanged") };
    assert_eq!((again.id, &again.hash), (42, &first.hash));
    // A failed republication is retried, still forced.
    p.published(&again, false, Instant::now());
    tokio::time::advance(MAX_RETRY).await;
    let retried = publish(&mut p).expect("retried");
    assert_eq!((retried.id, &retried.hash), (43, &first.hash));
    tokio::time::advance(WINDOW).await;
    assert_eq!(p.poll(Instant::now()), Step::Idle, "once is enough");
    // A floor below our own ids never moves them back.
    p.republish(3);
    assert_eq!(publish(&mut p).unwrap().id, 44);
}

#[tokio::test(start_paused = true)]
async fn mappings_drive_consul_watches_and_sharing() {
    let mut p = Pipeline::new(Config::default(), BOOTSTRAP, WINDOW);
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    p.apply(
        listed(
            &resolvers_key(),
            vec![
                resolver("shop", "consul", json!({"address": "127.0.0.1:8500", "datacenter": "dc1"})),
                // Same settings in another namespace: same queries, shared watches.
                resolver("blog", "consul", json!({"address": "http://127.0.0.1:8500", "datacenter": "dc1"})),
            ],
        ),
        now,
    );
    p.apply(
        listed(
            &mappings_key(),
            vec![
                mapping("shop", "a", json!({"service": "billing:8080", "resolver": "consul"})),
                mapping("shop", "b", json!({"service": "http://billing", "resolver": "consul"})),
                mapping("blog", "c", json!({"service": "billing.blog:80", "resolver": "consul"})),
                mapping("blog", "d", json!({"service": "posts", "resolver": "consul"})),
            ],
        ),
        now,
    );
    let services: Vec<_> = consul_keys(&p).iter().map(|k| k.service.clone()).collect();
    assert_eq!(services, ["billing", "posts"], "three Mappings, two resolvers, one billing watch");
    assert!(consul_keys(&p).iter().all(|k| k.datacenter.as_deref() == Some("dc1")));

    // Mapping d goes: posts stops. Mapping a goes: billing stays (b and c still use it).
    let diff = p.apply(
        [
            Event::Kube(mappings_key(), KubeEvent::Deleted(mapping("blog", "d", json!({})).id)),
            Event::Kube(mappings_key(), KubeEvent::Deleted(mapping("shop", "a", json!({})).id)),
        ],
        now,
    );
    assert!(diff.start.is_empty());
    assert_eq!(diff.stop.len(), 1);
    assert!(matches!(&diff.stop[0], WatchKey::Consul(k) if k.service == "posts"));

    // Changing the resolver's spec restarts only the watches whose key changed.
    let diff = p.apply(
        [Event::Kube(
            resolvers_key(),
            KubeEvent::Applied(resolver("blog", "consul", json!({"address": "127.0.0.1:8500", "datacenter": "dc2"}))),
        )],
        now,
    );
    assert_eq!(diff.start.len(), 1, "{diff:?}");
    assert!(matches!(&diff.start[0], WatchKey::Consul(k) if k.datacenter.as_deref() == Some("dc2")));
    assert!(diff.stop.is_empty(), "dc1 billing is still used by shop/b");
}

#[tokio::test(start_paused = true)]
async fn kubernetes_services_watch_only_their_own_endpoints() {
    let cfg = Config { endpoints_api: EndpointsApi::Endpoints, ..Config::default() };
    let mut p = Pipeline::new(cfg, BOOTSTRAP, WINDOW);
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    p.apply(listed(&resolvers_key(), vec![]), now);
    p.apply(
        listed(
            &mappings_key(),
            vec![
                mapping("shop", "a", json!({"service": "web:80"})),
                mapping("shop", "b", json!({"service": "api.backend:9000"})),
            ],
        ),
        now,
    );
    let kube: Vec<String> = p
        .registry()
        .keys()
        .filter(|k| matches!(k, WatchKey::Kube(k) if k.kind == "Endpoints"))
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        kube,
        ["Endpoints/v1 in backend fields metadata.name=api", "Endpoints/v1 in shop fields metadata.name=web"]
    );
    assert_eq!(p.poll(now), Step::Idle, "their endpoints have not listed yet");
    let web = EndpointsApi::Endpoints.key("shop", "web");
    let api = EndpointsApi::Endpoints.key("backend", "api");
    p.apply(
        listed(
            &web,
            vec![object(json!({"metadata": {"namespace": "shop", "name": "web"},
        "subsets": [{"addresses": [{"ip": "10.1.0.1"}], "ports": [{"port": 80}]}]}))],
        ),
        now,
    );
    p.apply(listed(&api, vec![]), now);
    let snap = publish(&mut p).unwrap();
    let svcs: Vec<_> = snap
        .content
        .kubernetes_services
        .iter()
        .map(|s| (s.namespace.as_str(), s.name.as_str(), s.endpoints.len()))
        .collect();
    assert_eq!(svcs, [("backend", "api", 0), ("shop", "web", 1)]);
}

fn assemble(resolvers: Vec<KubeObject>, mappings: Vec<KubeObject>, cfg: &Config) -> assembler::Assembly {
    let mut p = Pipeline::new(cfg.clone(), BOOTSTRAP, WINDOW);
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    p.apply(listed(&resolvers_key(), resolvers), now);
    p.apply(listed(&mappings_key(), mappings), now);
    assembler::assemble(p.world(), cfg)
}

#[tokio::test(start_paused = true)]
async fn resolver_lookup_rules() {
    let spec = json!({"address": "127.0.0.1:8500"});
    let a = assemble(
        vec![
            resolver("shop", "consul", spec.clone()),
            resolver("a", "shared", spec.clone()),
            resolver("b", "shared", spec.clone()),
            resolver("c", "only", spec.clone()),
        ],
        vec![
            mapping("shop", "same-ns", json!({"service": "s1", "resolver": "consul"})),
            mapping("other", "elsewhere", json!({"service": "s2", "resolver": "only"})),
            mapping("other", "ambiguous", json!({"service": "s3", "resolver": "shared"})),
            mapping("a", "local-wins", json!({"service": "s4", "resolver": "shared"})),
            mapping("shop", "missing", json!({"service": "s5", "resolver": "nope"})),
            mapping("shop", "bad-service", json!({"service": "s6:99999", "resolver": "consul"})),
        ],
        &Config::default(),
    );
    let target = |name: &str| a.content.mappings.iter().find(|m| m.name == name).unwrap().target.clone();
    assert!(matches!(target("same-ns"), Target::Consul { resolver_namespace, .. } if resolver_namespace == "shop"));
    assert!(matches!(target("elsewhere"), Target::Consul { resolver_namespace, .. } if resolver_namespace == "c"));
    assert!(matches!(target("local-wins"), Target::Consul { resolver_namespace, .. } if resolver_namespace == "a"));
    for unresolved in ["ambiguous", "missing", "bad-service"] {
        assert_eq!(target(unresolved), Target::Unresolved, "{unresolved}");
    }
    let msgs: Vec<_> =
        a.content.problems.iter().map(|p| format!("{}/{}: {}", p.namespace, p.name, p.message)).collect();
    assert!(
        msgs.iter()
            .any(|m| m.starts_with("other/ambiguous: resolver \"shared\" is ambiguous")
                && m.contains("a/shared, b/shared")),
        "{msgs:?}"
    );
    assert!(msgs.iter().any(|m| m.starts_with("shop/missing: resolver \"nope\": no ConsulResolver")), "{msgs:?}");
    assert!(
        msgs.iter()
            .any(|m| m.starts_with("shop/bad-service: spec.service: service \"s6:99999\" has port 99999 out of range")),
        "{msgs:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn invalid_resolvers_and_ambassador_ids() {
    let cfg = Config {
        ambassador_id: "blue".into(),
        default_resolver: Some("shop/consul".parse().unwrap()),
        ..Config::default()
    };
    let a = assemble(
        vec![
            resolver(
                "shop",
                "consul",
                json!({"address": "127.0.0.1:8500", "ambassadorId": ["blue"], "services": ["always"]}),
            ),
            resolver("shop", "green", json!({"address": "127.0.0.1:8500", "ambassadorId": ["green"]})),
            resolver("shop", "broken", json!({"address": "${NOT_SET}:8500", "ambassadorId": ["blue"]})),
        ],
        vec![
            mapping("shop", "defaulted", json!({"service": "web", "ambassador_id": "blue"})),
            mapping("shop", "not-ours", json!({"service": "other", "ambassador_id": ["green"]})),
            mapping("shop", "via-broken", json!({"service": "x", "resolver": "broken", "ambassador_id": ["blue"]})),
        ],
        &cfg,
    );
    let names: Vec<_> = a.content.resolvers.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["broken", "consul"], "green belongs to another Ambassador");
    assert!(a.content.resolvers[0].invalid.as_deref().unwrap().contains("NOT_SET is not set"));
    let services: Vec<_> = a.content.resolvers[1].services.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(services, ["always", "web"], "spec.services plus the defaulted Mapping");
    assert_eq!(a.content.mappings.len(), 2, "not-ours is ignored");
    assert!(a.content.problems.iter().any(|p| p.name == "via-broken" && p.message.contains("cannot be used")));
}

#[tokio::test(start_paused = true)]
async fn tokens_come_from_secrets_and_never_reach_the_snapshot() {
    let token = "0f7e6d5c-4b3a-2918-7654-32100fedcba9";
    let mut p = Pipeline::new(Config::default(), BOOTSTRAP, WINDOW);
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    let diff = p.apply(
        listed(
            &resolvers_key(),
            vec![resolver(
                "shop",
                "consul",
                json!({"address": "127.0.0.1:8500", "tokenSecretRef": {"name": "consul-acl", "key": "token"}}),
            )],
        ),
        now,
    );
    // The Secret is watched by name as soon as the resolver names it.
    assert_eq!(
        diff.start.iter().map(ToString::to_string).collect::<Vec<_>>(),
        ["Secret/v1 in shop fields metadata.name=consul-acl"]
    );
    let diff = p.apply(
        listed(&mappings_key(), vec![mapping("shop", "m", json!({"service": "billing", "resolver": "consul"}))]),
        now,
    );
    assert!(diff.start.is_empty(), "no Consul watch without the token: {diff:?}");
    let secret_key = super::assembler::resolvers::secret_key("shop", "consul-acl");
    use base64::Engine;
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("{token}\n"));
    let diff = p.apply(
        listed(
            &secret_key,
            vec![object(json!({"metadata": {"namespace": "shop", "name": "consul-acl"}, "data": {"token": encoded}}))],
        ),
        now,
    );
    let WatchKey::Consul(k) = &diff.start[0] else { panic!("{diff:?}") };
    assert_eq!(k.server.token.as_ref().unwrap().expose(), token, "trimmed token from the Secret");
    p.apply([Event::Consul(k.clone(), ConsulEvent::Answer { index: 1, endpoints: vec![] })], now);
    let snap = publish(&mut p).unwrap();
    let bytes = String::from_utf8(snap.to_json()).unwrap();
    assert!(!bytes.contains(token) && !bytes.contains(&encoded[..20]), "token leaked into the snapshot");
    // A rotated token restarts the watch with the new token.
    let encoded2 = base64::engine::general_purpose::STANDARD.encode("rotated");
    let diff = p.apply(
        [Event::Kube(
            secret_key,
            KubeEvent::Applied(object(
                json!({"metadata": {"namespace": "shop", "name": "consul-acl"}, "data": {"token": encoded2}}),
            )),
        )],
        now,
    );
    assert_eq!((diff.start.len(), diff.stop.len()), (1, 1));
}

#[tokio::test(start_paused = true)]
async fn snapshots_are_deterministic() {
    let build = |order: bool| {
        let mut ms = vec![
            mapping("shop", "a", json!({"service": "billing", "resolver": "consul"})),
            mapping("shop", "b", json!({"service": "web"})),
        ];
        if order {
            ms.reverse();
        }
        assemble(vec![resolver("shop", "consul", json!({"address": "127.0.0.1:8500"}))], ms, &Config::default()).content
    };
    let (a, b) = (build(false), build(true));
    assert_eq!(serde_json::to_vec(&a).unwrap(), serde_json::to_vec(&b).unwrap());
    assert_eq!(a.hash(), b.hash());
    assert_eq!(a.clone().into_snapshot(1).hash, a.hash());
}

#[tokio::test(start_paused = true)]
async fn resolver_entries_carry_the_generation_for_observed_generation() {
    let mut with_generation = resolver("shop", "consul", json!({"address": "127.0.0.1:8500"}));
    let mut value = (*with_generation.value).clone();
    value["metadata"]["generation"] = json!(7);
    with_generation.value = std::sync::Arc::new(value);
    let a = assemble(
        vec![with_generation, resolver("shop", "bare", json!({"address": "127.0.0.1:8500"}))],
        vec![],
        &Config::default(),
    );
    let generation = |name: &str| a.content.resolvers.iter().find(|r| r.name == name).unwrap().generation;
    assert_eq!(generation("consul"), Some(7));
    assert_eq!(generation("bare"), None, "absent stays absent (and out of the JSON)");
}
