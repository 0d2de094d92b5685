//! Behaviour of the core as a whole: the pipeline driven by events and a paused clock.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;

use std::time::SystemTime;

use super::assembler::snapshot::{Part, Target, UnusableReason};
use super::assembler::{self, Config, EndpointsApi};
use super::keys::{ConsulKey, KubeKey, WatchKey};
use super::model::{ConsulEvent, Event, KubeEvent, WatchFailure};
use super::model::{Endpoint, Health, KubeObject};
use super::pipeline::{Pipeline, Step, WallClock};

const MAX_RETRY: Duration = Duration::from_secs(30);

const WINDOW: Duration = Duration::from_millis(250);
const BOOTSTRAP: Duration = Duration::from_secs(30);

fn resolvers_key() -> KubeKey {
    KubeKey::new("consulresolver.io", "v1alpha1", "ConsulResolver")
}
fn mappings_key() -> KubeKey {
    KubeKey::new("getambassador.io", "v3alpha1", "Mapping")
}
/// 2026-11-23T06:00:00Z at the test's start.
const WALL_START: u64 = 1_795_413_600;

fn pipeline(cfg: Config) -> Pipeline {
    let clock = WallClock { instant: Instant::now(), wall: SystemTime::UNIX_EPOCH + Duration::from_secs(WALL_START) };
    Pipeline::new(cfg, BOOTSTRAP, WINDOW, clock)
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
        zone: None,
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
    let mut p = pipeline(Config::default());
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
    assert_eq!(diff.added.len(), 1, "the Mapping implies exactly one Consul watch: {diff:?}");
    let key = consul_keys(&p).remove(0);
    (p, key)
}

#[tokio::test(start_paused = true)]
async fn nothing_publishes_before_bootstrap() {
    let mut p = pipeline(Config::default());
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
    assert_eq!(*snap.content.resolvers[0].services[0].endpoints, vec![ep("10.0.0.1", 80)]);
}

#[tokio::test(start_paused = true)]
async fn consul_watches_start_while_the_mappings_still_list_and_nothing_publishes_before_they_are_listed() {
    let mut p = pipeline(Config::default());
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    p.apply(listed(&resolvers_key(), vec![resolver("shop", "consul", json!({"address": "127.0.0.1:8500"}))]), now);
    // The first page of Mappings: its Consul service is watched at once.
    let page = |names: &[&str]| {
        names
            .iter()
            .map(|n| mapping("shop", n, json!({"service": n, "resolver": "consul"})))
            .map(|m| Event::Kube(mappings_key(), KubeEvent::Listed(m)))
            .collect::<Vec<_>>()
    };
    let diff =
        p.apply([Event::Kube(mappings_key(), KubeEvent::ListStarted)].into_iter().chain(page(&["billing"])), now);
    assert_eq!(diff.added.iter().filter(|k| matches!(k, WatchKey::Consul(_))).count(), 1, "{diff:?}");
    for key in consul_keys(&p) {
        p.apply([Event::Consul(key, ConsulEvent::Answer { index: 3, endpoints: vec![ep("10.0.0.1", 80)] })], now);
    }
    assert_eq!(
        p.readiness(now),
        crate::world::Readiness::Waiting { kube_pending: 1, consul_pending: 0, deadline: None },
        "answered, but the Mappings are not all listed"
    );
    assert_eq!(p.poll(now), Step::Idle);
    let diff = p.apply(page(&["orders"]), now);
    assert_eq!(diff.added.len(), 1, "{diff:?}");
    p.apply([Event::Kube(mappings_key(), KubeEvent::ListDone)], now);
    assert_eq!(p.poll(now), Step::WaitUntil(now + BOOTSTRAP), "listed, but orders has not answered");
    for key in consul_keys(&p) {
        p.apply([Event::Consul(key, ConsulEvent::Answer { index: 3, endpoints: vec![ep("10.0.0.1", 80)] })], now);
    }
    let snap = publish(&mut p).expect("complete: publishes at once");
    assert!(snap.content.bootstrap.complete);
    assert_eq!(snap.content.mappings.len(), 2);
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
    assert_eq!(*last.content.resolvers[0].services[0].endpoints, vec![ep("10.0.0.1", 10_000)]);
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
    assert_eq!(*follow_up.content.resolvers[0].services[0].endpoints, vec![ep("10.0.0.2", 500)]);
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
    assert_eq!((again.id, &again.hash), (s.id, &s.hash), "a retry of the same content keeps its id");
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
    // A failed republication is retried, still forced, with the same id.
    p.published(&again, false, Instant::now());
    tokio::time::advance(MAX_RETRY).await;
    let retried = publish(&mut p).expect("retried");
    assert_eq!((retried.id, &retried.hash), (42, &first.hash));
    tokio::time::advance(WINDOW).await;
    assert_eq!(p.poll(Instant::now()), Step::Idle, "once is enough");
    // A floor below our own ids never moves them back.
    p.republish(3);
    assert_eq!(publish(&mut p).unwrap().id, 43);
}

#[tokio::test(start_paused = true)]
async fn mappings_drive_consul_watches_and_sharing() {
    let mut p = pipeline(Config::default());
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

    // The two resolvers' equal entries of billing are one part, whose JSON is made and
    // kept once, and stay one after a new answer.
    let billing = |s: &assembler::Snapshot, ns: &str| {
        s.resolver(ns, "consul")
            .and_then(|r| r.services.iter().find(|e| e.name == "billing"))
            .cloned()
            .expect("billing")
    };
    for (index, address) in [(3, "10.0.0.1"), (4, "10.0.0.2")] {
        let answers = consul_keys(&p)
            .into_iter()
            .map(|k| Event::Consul(k, ConsulEvent::Answer { index, endpoints: vec![ep(address, 80)] }));
        p.apply(answers, now);
        tokio::time::advance(WINDOW * 2).await;
        let s = publish(&mut p).expect("published");
        assert_eq!(billing(&s, "blog").endpoints[0].address, address);
        assert!(Part::ptr_eq(&billing(&s, "shop"), &billing(&s, "blog")), "one part for equal entries");
    }

    // Mapping d goes: posts stops. Mapping a goes: billing stays (b and c still use it).
    let diff = p.apply(
        [
            Event::Kube(mappings_key(), KubeEvent::Deleted(mapping("blog", "d", json!({})).id)),
            Event::Kube(mappings_key(), KubeEvent::Deleted(mapping("shop", "a", json!({})).id)),
        ],
        now,
    );
    assert!(diff.added.is_empty());
    assert_eq!(diff.removed.len(), 1);
    assert!(matches!(&diff.removed[0], WatchKey::Consul(k) if k.service == "posts"));

    // Changing the resolver's spec restarts only the watches whose key changed.
    let diff = p.apply(
        [Event::Kube(
            resolvers_key(),
            KubeEvent::Applied(resolver("blog", "consul", json!({"address": "127.0.0.1:8500", "datacenter": "dc2"}))),
        )],
        now,
    );
    assert_eq!(diff.added.len(), 1, "{diff:?}");
    assert!(matches!(&diff.added[0], WatchKey::Consul(k) if k.datacenter.as_deref() == Some("dc2")));
    assert!(diff.removed.is_empty(), "dc1 billing is still used by shop/b");
    // Their entries differ now (blog's new query has not answered): each its own.
    tokio::time::advance(WINDOW * 2).await;
    let s = publish(&mut p).expect("published");
    let (shop, blog) = (billing(&s, "shop"), billing(&s, "blog"));
    assert!(shop.synced && !blog.synced, "{shop:?} {blog:?}");
    assert!(!Part::ptr_eq(&shop, &blog));
}

#[tokio::test(start_paused = true)]
async fn kubernetes_services_watch_only_their_own_endpoints() {
    let cfg = Config { endpoints_api: EndpointsApi::Endpoints, ..Config::default() };
    let mut p = pipeline(cfg);
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
    assert_eq!(p.poll(now), Step::WaitUntil(now + BOOTSTRAP), "their endpoints have not listed yet");
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

fn slice(ns: &str, service: &str, suffix: &str, ip: &str) -> KubeObject {
    object(json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                  "metadata": {"namespace": ns, "name": format!("{service}-{suffix}"),
                               "labels": {"kubernetes.io/service-name": service}},
                  "endpoints": [{"addresses": [ip]}], "ports": [{"port": 80}]}))
}

fn slice_keys(p: &Pipeline) -> Vec<String> {
    p.registry()
        .keys()
        .filter(|k| matches!(k, WatchKey::Kube(k) if k.kind == "EndpointSlice"))
        .map(ToString::to_string)
        .collect()
}

/// Kubernetes Services in the content: (name, synced, addresses).
fn kube_services(p: &Pipeline) -> Vec<(String, bool, Vec<String>)> {
    p.assembler()
        .content(p.world())
        .kubernetes_services
        .iter()
        .map(|s| (s.name.clone(), s.synced, s.endpoints.iter().map(|e| e.address.clone()).collect()))
        .collect()
}

/// A pipeline whose namespaces share one endpoints watch past three Services, with the
/// resolvers listed (none).
fn namespace_watch_above_three() -> (Pipeline, Instant) {
    let mut p = pipeline(Config { endpoints_namespace_watch_above: 3, ..Config::default() });
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    p.apply(listed(&resolvers_key(), vec![]), now);
    (p, now)
}

/// Mapping `shop/m<i>` to Kubernetes Service `s<i>`.
fn shop_route(i: usize) -> KubeObject {
    mapping("shop", &format!("m{i}"), json!({"service": format!("s{i}:80")}))
}

/// Past the threshold of routed-to Services in a namespace, one watch of the namespace's
/// EndpointSlices serves them all (each Service reading only its own slices); back at half
/// of it, one watch each again. Both moves keep what the old watch said until the new one
/// has listed: no Service is ever published empty in between.
#[tokio::test(start_paused = true)]
async fn many_services_of_a_namespace_share_one_endpoints_watch_and_back() {
    let (mut p, now) = namespace_watch_above_three();
    p.apply(listed(&mappings_key(), (0..4).map(shop_route).collect()), now);
    let wide = EndpointsApi::EndpointSlices.namespace_key("shop");
    assert_eq!(slice_keys(&p), [wide.to_string()], "four Services, one watch of the namespace");
    assert_eq!(wide.label_selector.as_deref(), Some("kubernetes.io/service-name"));
    let mut objects: Vec<KubeObject> =
        (0..4).map(|i| slice("shop", &format!("s{i}"), "a", &format!("10.0.0.{i}"))).collect();
    objects.push(slice("shop", "s1", "b", "10.0.1.1"));
    objects.push(slice("shop", "unrouted", "a", "10.9.9.9"));
    p.apply(listed(&wide, objects), now);
    let addrs = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        kube_services(&p),
        [
            ("s0".into(), true, addrs(&["10.0.0.0"])),
            ("s1".into(), true, addrs(&["10.0.0.1", "10.0.1.1"])),
            ("s2".into(), true, addrs(&["10.0.0.2"])),
            ("s3".into(), true, addrs(&["10.0.0.3"])),
        ],
        "each Service its own slices, the unrouted one nowhere"
    );
    p.apply([Event::Kube(wide.clone(), KubeEvent::Applied(slice("shop", "s2", "a", "10.0.2.2")))], now);
    assert_eq!(kube_services(&p)[2], ("s2".into(), true, addrs(&["10.0.2.2"])), "a change through the shared watch");

    // Down to two: above half the threshold, still shared (no flapping at the threshold).
    for i in [3, 2] {
        p.apply([Event::Kube(mappings_key(), KubeEvent::Deleted(shop_route(i).id))], now);
    }
    assert_eq!(slice_keys(&p), [wide.to_string()]);
    // Down to one: a watch of its own, and until it lists, what the shared one said.
    p.apply([Event::Kube(mappings_key(), KubeEvent::Deleted(shop_route(1).id))], now);
    let own = EndpointsApi::EndpointSlices.key("shop", "s0");
    assert_eq!(slice_keys(&p), [own.to_string()]);
    assert_eq!(kube_services(&p), [("s0".into(), true, addrs(&["10.0.0.0"]))], "never empty while it lists");
    p.apply(listed(&own, vec![slice("shop", "s0", "a", "10.0.3.0")]), now);
    assert_eq!(kube_services(&p), [("s0".into(), true, addrs(&["10.0.3.0"]))]);

    // Back up to four: shared again, the old answers standing until it has listed.
    p.apply((1..4).map(|i| Event::Kube(mappings_key(), KubeEvent::Applied(shop_route(i)))).collect::<Vec<_>>(), now);
    assert_eq!(slice_keys(&p), [wide.to_string()]);
    let pending = kube_services(&p);
    assert_eq!(pending[0], ("s0".into(), true, addrs(&["10.0.3.0"])), "s0 keeps its own watch's answer meanwhile");
    p.apply(listed(&wide, (0..4).map(|i| slice("shop", &format!("s{i}"), "c", &format!("10.0.4.{i}"))).collect()), now);
    let all = kube_services(&p);
    assert_eq!(all.len(), 4);
    for (i, (name, synced, a)) in all.iter().enumerate() {
        assert_eq!(
            (name.as_str(), *synced, a.clone()),
            (format!("s{i}").as_str(), true, addrs(&[&format!("10.0.4.{i}")]))
        );
    }
    // The incremental watches agree with a full re-read.
    let desired: BTreeSet<WatchKey> = p.assembler().desired().cloned().collect();
    assert_eq!(desired.iter().filter(|k| matches!(k, WatchKey::Kube(k) if k.kind == "EndpointSlice")).count(), 1);
}

/// A cold start's Mappings come page by page: no Service's own endpoints watch starts
/// before every route is known, so a namespace past the threshold never starts (then
/// stops) a watch per Service of its first pages.
#[tokio::test(start_paused = true)]
async fn endpoints_watches_wait_for_every_route() {
    let (mut p, now) = namespace_watch_above_three();
    let page =
        |from: usize, to: usize| (from..to).map(|i| Event::Kube(mappings_key(), KubeEvent::Listed(shop_route(i))));
    let first: Vec<Event> =
        std::iter::once(Event::Kube(mappings_key(), KubeEvent::ListStarted)).chain(page(0, 2)).collect();
    let diff = p.apply(first, now);
    assert!(slice_keys(&p).is_empty() && diff.added.is_empty(), "a first page starts no endpoints watch: {diff:?}");
    p.apply(page(2, 5).collect::<Vec<_>>(), now);
    assert!(slice_keys(&p).is_empty());
    p.apply([Event::Kube(mappings_key(), KubeEvent::ListDone)], now);
    assert_eq!(slice_keys(&p), [EndpointsApi::EndpointSlices.namespace_key("shop").to_string()]);
}

/// Resolvers with the same settings share one answer: their entries, their last known good
/// and the world's store hold one list of endpoints, not a copy each (at 75,000 endpoints
/// and five resolvers the copies were about 100 MiB).
#[tokio::test(start_paused = true)]
async fn resolvers_share_one_list_of_endpoints() {
    let mut p = pipeline(Config::default());
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    let address = json!({"address": "127.0.0.1:8500"});
    p.apply(
        listed(
            &resolvers_key(),
            vec![resolver("shop", "consul", address.clone()), resolver("blog", "consul", address)],
        ),
        now,
    );
    let routes = vec![
        mapping("shop", "a", json!({"service": "billing:80", "resolver": "consul"})),
        mapping("blog", "b", json!({"service": "billing:80", "resolver": "consul"})),
    ];
    p.apply(listed(&mappings_key(), routes), now);
    let key = consul_keys(&p).remove(0);
    p.apply([Event::Consul(key.clone(), ConsulEvent::Answer { index: 3, endpoints: vec![ep("10.0.0.1", 80)] })], now);
    let content = p.assembler().content(p.world());
    let (blog, shop) = (&content.resolvers[0].services[0].endpoints, &content.resolvers[1].services[0].endpoints);
    assert_eq!(**shop, [ep("10.0.0.1", 80)]);
    assert!(std::sync::Arc::ptr_eq(blog, shop), "one list for both resolvers");
    assert!(std::sync::Arc::ptr_eq(shop, &p.world().consul()[&key].endpoints), "the world's own");
}

/// The content and the implied watches of a world of these resolvers and Mappings.
struct Assembled {
    content: assembler::Content,
    desired: BTreeSet<WatchKey>,
}

fn assemble(resolvers: Vec<KubeObject>, mappings: Vec<KubeObject>, cfg: &Config) -> Assembled {
    let mut p = pipeline(cfg.clone());
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    p.apply(listed(&resolvers_key(), resolvers), now);
    p.apply(listed(&mappings_key(), mappings), now);
    Assembled { content: p.assembler().content(p.world()), desired: p.assembler().desired().cloned().collect() }
}

#[tokio::test(start_paused = true)]
async fn resolver_lookup_rules() {
    let spec = json!({"address": "127.0.0.1:8500"});
    let shared = json!({"address": "127.0.0.1:8500", "allowedNamespaces": {"from": "All"}});
    let own = json!({"address": "127.0.0.1:8500", "allowedNamespaces": {"from": "Same"}});
    let a = assemble(
        vec![
            resolver("shop", "consul", spec.clone()),
            resolver("a", "shared", shared.clone()),
            resolver("b", "shared", shared.clone()),
            resolver("c", "only", shared.clone()),
            resolver("d", "private", spec.clone()),
            resolver("e", "dup", shared.clone()),
            resolver("f", "dup", own.clone()),
        ],
        vec![
            mapping("shop", "same-ns", json!({"service": "s1", "resolver": "consul"})),
            mapping("other", "elsewhere", json!({"service": "s2", "resolver": "only"})),
            mapping("other", "ambiguous", json!({"service": "s3", "resolver": "shared"})),
            mapping("a", "local-wins", json!({"service": "s4", "resolver": "shared"})),
            mapping("shop", "missing", json!({"service": "s5", "resolver": "nope"})),
            mapping("shop", "bad-service", json!({"service": "s6:99999", "resolver": "consul"})),
            // Not shared (the default).
            mapping("other", "not-shared", json!({"service": "s7", "resolver": "private"})),
            mapping("d", "private-at-home", json!({"service": "s9", "resolver": "private"})),
            // Two of that name, one shared: the one that serves, not an ambiguity.
            mapping("other", "one-serves", json!({"service": "s10", "resolver": "dup"})),
        ],
        &Config::default(),
    );
    let target = |name: &str| a.content.mappings.iter().find(|m| m.name == name).unwrap().target.clone();
    let from = |name: &str| match target(name) {
        Target::Consul { resolver_namespace, .. } => resolver_namespace,
        other => panic!("{name}: {other:?}"),
    };
    assert_eq!(from("same-ns"), "shop");
    assert_eq!(from("elsewhere"), "c");
    assert_eq!(from("local-wins"), "a");
    assert_eq!(from("private-at-home"), "d");
    assert_eq!(from("one-serves"), "e");
    for unresolved in ["ambiguous", "missing", "bad-service", "not-shared"] {
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
    let want = "other/not-shared: resolver d/private does not serve Mappings from namespace other";
    assert!(msgs.iter().any(|m| m.starts_with(want) && m.contains("allowedNamespaces")), "{msgs:?}");
    // No watch for what a Mapping may not use: s7 is nobody's.
    let watched: Vec<String> = a
        .desired
        .iter()
        .filter_map(|k| match k {
            WatchKey::Consul(c) => Some(c.service.clone()),
            _ => None,
        })
        .collect();
    assert!(!watched.iter().any(|s| s == "s7"), "{watched:?}");
    assert!(watched.iter().any(|s| s == "s9") && watched.iter().any(|s| s == "s10"), "{watched:?}");

    // The operator's --default-resolver is held to the same rule: named namespace/name, it
    // still serves only the namespaces it allows.
    let cfg = Config { default_resolver: Some("d/private".parse().unwrap()), ..Config::default() };
    let a = assemble(
        vec![resolver("d", "private", spec.clone())],
        vec![
            mapping("other", "by-default", json!({"service": "s11"})),
            mapping("d", "home", json!({"service": "s12"})),
        ],
        &cfg,
    );
    let target = |name: &str| a.content.mappings.iter().find(|m| m.name == name).unwrap().target.clone();
    assert_eq!(target("by-default"), Target::Unresolved);
    assert!(matches!(target("home"), Target::Consul { .. }));
    assert!(
        a.content.problems.iter().any(|p| p.name == "by-default" && p.message.contains("does not serve Mappings")),
        "{:?}",
        a.content.problems
    );
}

/// `allowedNamespaces.from: Selector`: Namespaces are watched (only then), and a Mapping
/// follows its namespace's labels both ways: served once labelled, refused once not.
#[tokio::test(start_paused = true)]
async fn a_resolver_serves_the_namespaces_its_selector_matches_as_their_labels_change() {
    let mut p = pipeline(Config::default());
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    let selecting = json!({"address": "127.0.0.1:8500", "allowedNamespaces": {"from": "Selector",
        "selector": {"matchLabels": {"consul-access": "shop"}}}});
    let diff = p.apply(listed(&resolvers_key(), vec![resolver("shop", "consul", selecting)]), now);
    let namespaces = super::assembler::resolvers::namespaces_key();
    assert!(diff.added.contains(&WatchKey::Kube(namespaces.clone())), "Namespaces watched: {diff:?}");
    p.apply(
        listed(&mappings_key(), vec![mapping("blog", "m", json!({"service": "posts", "resolver": "consul"}))]),
        now,
    );
    let ns = |labels: Value| object(json!({"metadata": {"name": "blog", "labels": labels}}));
    let target = |p: &Pipeline| p.assembler().content(p.world()).mappings[0].target.clone();

    let diff = p.apply(listed(&namespaces, vec![ns(json!({"team": "blog"}))]), now);
    assert_eq!(target(&p), Target::Unresolved, "not labelled: not served");
    assert!(diff.added.iter().all(|k| !matches!(k, WatchKey::Consul(_))), "{diff:?}");

    let labelled = ns(json!({"team": "blog", "consul-access": "shop"}));
    let diff = p.apply([Event::Kube(namespaces.clone(), KubeEvent::Applied(labelled))], now);
    assert!(matches!(target(&p), Target::Consul { resolver_namespace, .. } if resolver_namespace == "shop"));
    assert!(diff.added.iter().any(|k| matches!(k, WatchKey::Consul(c) if c.service == "posts")), "{diff:?}");

    let diff = p.apply([Event::Kube(namespaces.clone(), KubeEvent::Applied(ns(json!({"team": "blog"}))))], now);
    assert_eq!(target(&p), Target::Unresolved, "the label gone: refused again");
    assert!(diff.removed.iter().any(|k| matches!(k, WatchKey::Consul(c) if c.service == "posts")), "{diff:?}");

    // No resolver selects any more: Namespaces are no longer watched.
    let shared = json!({"address": "127.0.0.1:8500", "allowedNamespaces": {"from": "All"}});
    let diff = p.apply(listed(&resolvers_key(), vec![resolver("shop", "consul", shared)]), now);
    assert!(diff.removed.contains(&WatchKey::Kube(namespaces)), "{diff:?}");
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
    let unusable = a.content.resolvers[0].unusable.as_ref().unwrap();
    assert_eq!(unusable.reason, UnusableReason::InvalidSpec);
    assert!(unusable.message.contains("NOT_SET is not set"), "{unusable:?}");
    let services: Vec<_> = a.content.resolvers[1].services.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(services, ["always", "web"], "spec.services plus the defaulted Mapping");
    assert_eq!(a.content.mappings.len(), 2, "not-ours is ignored");
    assert!(a.content.problems.iter().any(|p| p.name == "via-broken" && p.message.contains("cannot be used")));
}

#[tokio::test(start_paused = true)]
async fn tokens_come_from_secrets_and_never_reach_the_snapshot() {
    let token = "0f7e6d5c-4b3a-2918-7654-32100fedcba9";
    let mut p = pipeline(Config::default());
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
        diff.added.iter().map(ToString::to_string).collect::<Vec<_>>(),
        ["Secret/v1 in shop fields metadata.name=consul-acl"]
    );
    let diff = p.apply(
        listed(&mappings_key(), vec![mapping("shop", "m", json!({"service": "billing", "resolver": "consul"}))]),
        now,
    );
    assert!(diff.added.is_empty(), "no Consul watch without the token: {diff:?}");
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
    let WatchKey::Consul(k) = &diff.added[0] else { panic!("{diff:?}") };
    assert_eq!(k.server.token.as_ref().unwrap().expose(), token, "trimmed token from the Secret");
    p.apply([Event::Consul(k.clone(), ConsulEvent::Answer { index: 1, endpoints: vec![] })], now);
    let snap = publish(&mut p).unwrap();
    let bytes = String::from_utf8(snap.to_json().to_vec()).unwrap();
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
    assert_eq!((diff.added.len(), diff.removed.len()), (1, 1));
}

#[tokio::test(start_paused = true)]
async fn client_certificates_come_from_secrets_and_go_in_pairs() {
    let mut p = pipeline(Config::default());
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    let tls = |key_ref: serde_json::Value| {
        json!({"address": "https://127.0.0.1:8501", "tls": {
            "clientCertSecretRef": {"name": "consul-client", "key": "tls.crt"}, "clientKeySecretRef": key_ref}})
    };
    let both = resolver("shop", "paired", tls(json!({"name": "consul-client", "key": "tls.key"})));
    let half = resolver("shop", "half", tls(serde_json::Value::Null));
    p.apply(listed(&resolvers_key(), vec![both, half]), now);
    let mappings = vec![
        mapping("shop", "a", json!({"service": "billing", "resolver": "paired"})),
        mapping("shop", "b", json!({"service": "billing", "resolver": "half"})),
    ];
    p.apply(listed(&mappings_key(), mappings), now);
    use base64::Engine;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let secret = json!({"metadata": {"namespace": "shop", "name": "consul-client"}, "type": "kubernetes.io/tls",
        "data": {"tls.crt": b64("CERT PEM"), "tls.key": b64("KEY PEM")}});
    let diff =
        p.apply(listed(&super::assembler::resolvers::secret_key("shop", "consul-client"), vec![object(secret)]), now);
    let [WatchKey::Consul(k)] = diff.added.as_slice() else { panic!("one Consul watch: {diff:?}") };
    let id = k.server.tls.as_ref().and_then(|t| t.client_identity.as_ref()).expect("a client identity");
    assert_eq!((&*id.cert_pem, id.key_pem.expose()), ("CERT PEM", "KEY PEM"));
    assert!(!format!("{k:?}").contains("KEY PEM"), "the key never prints");
    p.apply([Event::Consul(k.clone(), ConsulEvent::Answer { index: 1, endpoints: vec![] })], now);
    let snap = publish(&mut p).unwrap();
    let half = snap.content.resolvers.iter().find(|r| r.name == "half").unwrap();
    let unusable = half.unusable.as_ref().expect("half an identity is refused");
    assert!(unusable.message.contains("spec.tls.clientKeySecretRef"), "{unusable:?}");
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
    let mut value = resolver("shop", "consul", json!({"address": "127.0.0.1:8500"})).to_value();
    value["metadata"]["generation"] = json!(7);
    let with_generation = object(value);
    let a = assemble(
        vec![with_generation, resolver("shop", "bare", json!({"address": "127.0.0.1:8500"}))],
        vec![],
        &Config::default(),
    );
    let generation = |name: &str| a.content.resolvers.iter().find(|r| r.name == name).unwrap().generation;
    assert_eq!(generation("consul"), Some(7));
    assert_eq!(generation("bare"), None, "absent stays absent (and out of the JSON)");
}

fn secret_object(ns: &str, name: &str, token: &str) -> KubeObject {
    use base64::Engine;
    let encoded = base64::engine::general_purpose::STANDARD.encode(token);
    object(json!({"metadata": {"namespace": ns, "name": name}, "data": {"token": encoded}}))
}

fn answer(key: &ConsulKey, index: u64, endpoints: Vec<Endpoint>) -> Event {
    Event::Consul(key.clone(), ConsulEvent::Answer { index, endpoints })
}

/// Publishes whatever is due, waiting out the window first.
async fn next_publication(p: &mut Pipeline) -> std::sync::Arc<super::assembler::Snapshot> {
    loop {
        match p.poll(Instant::now()) {
            Step::Publish(s) => {
                p.published(&s, true, Instant::now());
                return s;
            }
            Step::WaitUntil(t) => tokio::time::advance(t - Instant::now()).await,
            Step::Idle => panic!("nothing to publish"),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn after_the_first_publication_a_new_or_silent_key_holds_nothing_back() {
    let (mut p, billing) = bootstrapped_pipeline();
    p.apply([answer(&billing, 1, vec![ep("10.0.0.1", 80)])], Instant::now());
    publish(&mut p).expect("the first, complete snapshot");
    tokio::time::advance(WINDOW).await;
    // Another team adds a Mapping to a service whose Consul never answers.
    let diff = p.apply(
        [Event::Kube(
            mappings_key(),
            KubeEvent::Applied(mapping("shop", "orders", json!({"service": "orders", "resolver": "consul"}))),
        )],
        Instant::now(),
    );
    assert_eq!(diff.added.len(), 1);
    let snap = publish(&mut p).expect("published at once, not after the bootstrap timeout");
    let orders = snap.content.resolvers[0].services.iter().find(|s| s.name == "orders").unwrap();
    assert!(!orders.synced && orders.endpoints.is_empty());
    assert!(!snap.content.bootstrap.complete);
    // A healthy service's change a moment later goes out within the window, though
    // orders is still silent.
    tokio::time::advance(WINDOW / 2).await;
    p.apply([answer(&billing, 2, vec![ep("10.0.0.1", 81)])], Instant::now());
    let snap = next_publication(&mut p).await;
    let billing_entry = snap.content.resolvers[0].services.iter().find(|s| s.name == "billing").unwrap();
    assert_eq!(*billing_entry.endpoints, vec![ep("10.0.0.1", 81)]);
    // orders fails, then answers: each is published as it comes.
    let orders_key = consul_keys(&p).into_iter().find(|k| k.service == "orders").unwrap();
    p.apply([Event::Consul(orders_key.clone(), ConsulEvent::Failed("connection refused".into()))], Instant::now());
    let snap = next_publication(&mut p).await;
    let orders = snap.content.resolvers[0].services.iter().find(|s| s.name == "orders").unwrap();
    assert_eq!(orders.error.as_deref(), Some("connection refused"));
    p.apply([answer(&orders_key, 7, vec![ep("10.0.0.9", 90)])], Instant::now());
    let snap = next_publication(&mut p).await;
    assert!(snap.content.bootstrap.complete);
}

#[tokio::test(start_paused = true)]
async fn a_watch_the_api_server_rejects_is_a_problem_on_its_mappings_and_holds_nothing_back() {
    let cfg = Config { endpoints_api: EndpointsApi::Endpoints, ..Config::default() };
    let mut p = pipeline(cfg);
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    p.apply(listed(&resolvers_key(), vec![]), now);
    p.apply(listed(&mappings_key(), vec![mapping("shop", "web", json!({"service": "web:80"}))]), now);
    let web = EndpointsApi::Endpoints.key("shop", "web");
    p.apply(listed(&web, vec![]), now);
    publish(&mut p).expect("first snapshot");
    tokio::time::advance(WINDOW).await;
    // A Mapping to a Service in a namespace the operator may not read.
    p.apply(
        [Event::Kube(mappings_key(), KubeEvent::Applied(mapping("shop", "vault", json!({"service": "vault.locked"}))))],
        Instant::now(),
    );
    let locked = EndpointsApi::Endpoints.key("locked", "vault");
    let forbidden = "the API server answered 403 Forbidden: endpoints is forbidden";
    p.apply([Event::Kube(locked.clone(), KubeEvent::Failed(WatchFailure::rejected(forbidden)))], Instant::now());
    let snap = next_publication(&mut p).await;
    let entry = snap.content.kubernetes_services.iter().find(|s| s.namespace == "locked").unwrap();
    assert_eq!((entry.synced, entry.error.as_deref()), (false, Some(forbidden)));
    let problem = snap.content.problems.iter().find(|p| p.name == "vault").expect("a problem on the Mapping");
    assert_eq!(
        problem.message,
        format!("cannot watch the endpoints of Service locked/vault: {forbidden}"),
        "names what and where"
    );
    assert!(snap.content.problems.iter().all(|p| p.name == "vault"), "nobody else is affected");
    // The watch is still wanted (the source retries it with backoff); once it lists, the
    // problem goes.
    assert!(p.registry().contains(&WatchKey::Kube(locked.clone())));
    p.apply(listed(&locked, vec![]), Instant::now());
    let snap = next_publication(&mut p).await;
    assert!(snap.content.problems.is_empty(), "{:?}", snap.content.problems);
}

#[tokio::test(start_paused = true)]
async fn a_rejected_secret_watch_does_not_hold_back_the_first_publication() {
    let mut p = pipeline(Config::default());
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    let spec = json!({"address": "127.0.0.1:8500", "tokenSecretRef": {"name": "acl", "key": "token"}});
    p.apply(listed(&resolvers_key(), vec![resolver("locked", "consul", spec)]), now);
    p.apply(listed(&mappings_key(), vec![]), now);
    assert_eq!(p.poll(now), Step::WaitUntil(now + BOOTSTRAP), "the Secret is waited for");
    let secret = assembler::resolvers::secret_key("locked", "acl");
    p.apply([Event::Kube(secret, KubeEvent::Failed(WatchFailure::rejected("secrets is forbidden")))], now);
    let snap = publish(&mut p).expect("rejected is settled: published at once");
    let unusable = snap.content.resolvers[0].unusable.as_ref().unwrap();
    assert_eq!(unusable.reason, UnusableReason::SecretUnavailable);
    assert_eq!(unusable.message, "spec.tokenSecretRef: Secret locked/acl cannot be read: secrets is forbidden");
}

#[tokio::test(start_paused = true)]
async fn names_that_cannot_be_selected_are_reported_and_never_watched() {
    let long = "a".repeat(64);
    let a = assemble(
        vec![
            resolver(
                "other",
                "bad",
                json!({"address": "127.0.0.1:8500", "tokenSecretRef": {"name": "a,b", "key": "token"}}),
            ),
            resolver("shop", "good", json!({"address": "127.0.0.1:8500"})),
        ],
        vec![
            mapping("shop", "fine", json!({"service": "web", "resolver": "good"})),
            mapping("shop", "dash", json!({"service": "-x"})),
            mapping("shop", "trailing", json!({"service": "x-"})),
            mapping("shop", "underscore", json!({"service": "_x"})),
            mapping("shop", "long", json!({"service": long})),
        ],
        &Config::default(),
    );
    let bad = a.content.resolvers.iter().find(|r| r.name == "bad").unwrap();
    let unusable = bad.unusable.as_ref().unwrap();
    assert_eq!(unusable.reason, UnusableReason::InvalidSpec);
    assert!(
        unusable.message.starts_with("spec.tokenSecretRef: name \"a,b\" is not a valid Secret name"),
        "{}",
        unusable.message
    );
    for name in ["dash", "trailing", "underscore", "long"] {
        let problem = a.content.problems.iter().find(|p| p.name == name).unwrap_or_else(|| panic!("{name}"));
        assert!(problem.message.contains("is not a valid Kubernetes Service name"), "{name}: {}", problem.message);
    }
    let watched: Vec<String> = a.desired.iter().map(ToString::to_string).collect();
    assert_eq!(watched, ["consul web at http://127.0.0.1:8500 passing"], "no Secret, no endpoints watch");
}

/// A `cached` read answered by an agent cut off from its servers: its endpoints are
/// published (they are what the agent last knew), marked stale since the cut-off, with the
/// reason; a later answer of the same cut-off keeps that time; back in touch, not stale.
#[tokio::test(start_paused = true)]
async fn an_agent_cache_cut_off_from_its_servers_is_published_stale_since_the_cut_off() {
    let mut p = pipeline(Config::default());
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    let spec = json!({"address": "127.0.0.1:8500", "cached": true});
    p.apply(listed(&resolvers_key(), vec![resolver("shop", "consul", spec)]), now);
    p.apply(
        listed(&mappings_key(), vec![mapping("shop", "m", json!({"service": "billing", "resolver": "consul"}))]),
        now,
    );
    let key = consul_keys(&p).remove(0);
    p.apply([answer(&key, 5, vec![ep("10.0.0.1", 80)])], now);
    let snap = publish(&mut p).unwrap();
    assert_eq!(snap.content.resolvers[0].services[0].stale, None);
    let cut = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_795_000_000);
    let cached = |index, port, since| {
        Event::Consul(
            key.clone(),
            ConsulEvent::Cached { index, endpoints: vec![ep("10.0.0.1", port)], cut_off_since: since },
        )
    };
    tokio::time::advance(Duration::from_secs(1)).await;
    p.apply([cached(6, 81, cut)], Instant::now());
    let snap = publish(&mut p).unwrap();
    let s = snap.content.resolvers[0].services[0].as_ref().clone();
    assert_eq!(*s.endpoints, vec![ep("10.0.0.1", 81)], "the agent's last knowledge is published");
    assert!(s.synced && s.error.is_none(), "{s:?}");
    let stale = s.stale.expect("stale while the agent is cut off");
    assert_eq!(stale.since, "2026-11-18T11:06:40Z", "since the cut-off, not since we noticed");
    assert!(stale.reason.contains("cut off from its servers"), "{}", stale.reason);
    // The same cut-off answering again (a second later by its Age) changes nothing.
    let later = cut + Duration::from_secs(1);
    p.apply([cached(6, 81, later)], Instant::now());
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(publish(&mut p).is_none(), "nothing to publish");
    // Back in touch: current again.
    tokio::time::advance(Duration::from_secs(1)).await;
    p.apply([answer(&key, 7, vec![ep("10.0.0.1", 81)])], Instant::now());
    let snap = publish(&mut p).unwrap();
    assert_eq!(snap.content.resolvers[0].services[0].stale, None);
}

#[tokio::test(start_paused = true)]
async fn endpoints_last_obtained_outlive_a_token_rotation_a_lost_secret_and_a_broken_spec() {
    let mut p = pipeline(Config::default());
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    let spec = json!({"address": "127.0.0.1:8500", "tokenSecretRef": {"name": "acl", "key": "token"}});
    p.apply(listed(&resolvers_key(), vec![resolver("shop", "consul", spec.clone())]), now);
    p.apply(
        listed(&mappings_key(), vec![mapping("shop", "m", json!({"service": "billing", "resolver": "consul"}))]),
        now,
    );
    let secret = assembler::resolvers::secret_key("shop", "acl");
    p.apply(listed(&secret, vec![secret_object("shop", "acl", "old-token")]), now);
    let old = consul_keys(&p).remove(0);
    p.apply([answer(&old, 5, vec![ep("10.0.0.1", 80)])], now);
    let snap = publish(&mut p).unwrap();
    assert_eq!(snap.content.resolvers[0].services[0].stale, None);
    let service = |snap: &super::assembler::Snapshot| snap.content.resolvers[0].services[0].as_ref().clone();

    // The token is rotated: the old query stops, the new one has not answered.
    tokio::time::advance(Duration::from_secs(60)).await;
    let diff = p.apply(
        [Event::Kube(secret.clone(), KubeEvent::Applied(secret_object("shop", "acl", "new-token")))],
        Instant::now(),
    );
    assert_eq!((diff.added.len(), diff.removed, &diff.added), (1, vec![WatchKey::Consul(old.clone())], &diff.added));
    let new = consul_keys(&p).remove(0);
    let snap = next_publication(&mut p).await;
    let s = service(&snap);
    assert_eq!((s.synced, s.endpoints.clone(), s.index), (false, vec![ep("10.0.0.1", 80)].into(), Some(5)));
    let stale = s.stale.unwrap();
    assert_eq!(stale.since, "2026-11-23T06:01:00Z");
    assert_eq!(stale.reason, "the resolver's token changed: waiting for Consul to answer with the new settings");
    assert_eq!(
        snap.content.mappings[0].target,
        Target::Consul {
            resolver_namespace: "shop".into(),
            resolver_name: "consul".into(),
            service: "billing".into(),
            port: None,
        }
    );

    // Consul rejects the new token: still the old endpoints, the cause named, same since.
    tokio::time::advance(Duration::from_secs(30)).await;
    let rejected = "Consul at http://127.0.0.1:8500 rejected the request: ACL token rejected (ACL not found)";
    p.apply([Event::Consul(new.clone(), ConsulEvent::Failed(rejected.into()))], Instant::now());
    let s = service(&*next_publication(&mut p).await);
    assert_eq!(*s.endpoints, vec![ep("10.0.0.1", 80)]);
    assert_eq!(s.error.as_deref(), Some(rejected));
    let stale = s.stale.unwrap();
    assert_eq!(stale.since, "2026-11-23T06:01:00Z", "stale since it first was");
    assert_eq!(
        stale.reason,
        format!("the resolver's token changed, and the query with the new settings failed: {rejected}")
    );

    // The new token answers: current again.
    p.apply([answer(&new, 9, vec![ep("10.0.0.2", 80)])], Instant::now());
    let s = service(&*next_publication(&mut p).await);
    assert_eq!((s.synced, s.stale, s.endpoints), (true, None, vec![ep("10.0.0.2", 80)].into()));

    // The Secret is deleted: nothing can be queried; the last endpoints stay.
    tokio::time::advance(Duration::from_secs(60)).await;
    let diff =
        p.apply([Event::Kube(secret.clone(), KubeEvent::Deleted(secret_object("shop", "acl", "").id))], Instant::now());
    assert_eq!(diff.removed, vec![WatchKey::Consul(new)]);
    let snap = next_publication(&mut p).await;
    let unusable = snap.content.resolvers[0].unusable.clone().unwrap();
    assert_eq!(unusable.reason, UnusableReason::SecretUnavailable);
    let s = service(&snap);
    assert_eq!(*s.endpoints, vec![ep("10.0.0.2", 80)]);
    assert_eq!(s.stale.clone().unwrap().reason, "spec.tokenSecretRef: Secret shop/acl not found");
    assert_eq!(s.stale.unwrap().since, "2026-11-23T06:02:30Z");
    assert!(matches!(snap.content.mappings[0].target, Target::Consul { .. }), "the route stays");

    // A broken edit of the spec on top: still kept, now for that reason.
    let broken = json!({"address": "${NOPE}:8500", "tokenSecretRef": {"name": "acl", "key": "token"}});
    p.apply([Event::Kube(resolvers_key(), KubeEvent::Applied(resolver("shop", "consul", broken)))], Instant::now());
    let snap = next_publication(&mut p).await;
    assert_eq!(snap.content.resolvers[0].unusable.as_ref().unwrap().reason, UnusableReason::InvalidSpec);
    let s = service(&snap);
    assert_eq!(*s.endpoints, vec![ep("10.0.0.2", 80)]);
    assert!(s.stale.unwrap().reason.contains("NOPE is not set"));

    // Only deleting the Mapping lets them go; a new Mapping gets nothing from before.
    p.apply([Event::Kube(mappings_key(), KubeEvent::Deleted(mapping("shop", "m", json!({})).id))], Instant::now());
    let snap = next_publication(&mut p).await;
    assert!(snap.content.resolvers[0].services.is_empty());
    p.apply(
        [Event::Kube(
            mappings_key(),
            KubeEvent::Applied(mapping("shop", "m", json!({"service": "billing", "resolver": "consul"}))),
        )],
        Instant::now(),
    );
    let snap = next_publication(&mut p).await;
    assert!(snap.content.resolvers[0].services.is_empty());
    assert_eq!(snap.content.mappings[0].target, Target::Unresolved);
}

#[tokio::test(start_paused = true)]
async fn deleting_the_resolver_lets_its_kept_endpoints_go() {
    let (mut p, key) = bootstrapped_pipeline();
    p.apply([answer(&key, 1, vec![ep("10.0.0.1", 80)])], Instant::now());
    publish(&mut p).unwrap();
    // The resolver's address changes: kept, stale.
    p.apply(
        [Event::Kube(
            resolvers_key(),
            KubeEvent::Applied(resolver("shop", "consul", json!({"address": "127.0.0.2:8500"}))),
        )],
        Instant::now(),
    );
    let snap = next_publication(&mut p).await;
    let s = &snap.content.resolvers[0].services[0];
    assert!(s.stale.as_ref().unwrap().reason.starts_with("the resolver's address changed"));
    p.apply(
        [Event::Kube(resolvers_key(), KubeEvent::Deleted(resolver("shop", "consul", json!({})).id))],
        Instant::now(),
    );
    let snap = next_publication(&mut p).await;
    assert!(snap.content.resolvers.is_empty());
    // Re-created with the old address: nothing kept from before.
    p.apply(
        [Event::Kube(
            resolvers_key(),
            KubeEvent::Applied(resolver("shop", "consul", json!({"address": "127.0.0.1:8500"}))),
        )],
        Instant::now(),
    );
    let snap = next_publication(&mut p).await;
    let s = &snap.content.resolvers[0].services[0];
    assert!(!s.synced && s.endpoints.is_empty() && s.stale.is_none(), "{s:?}");
}

#[tokio::test(start_paused = true)]
async fn a_query_failing_after_answers_keeps_its_endpoints_stale_since_the_first_failure() {
    let (mut p, key) = bootstrapped_pipeline();
    p.apply([answer(&key, 1, vec![ep("10.0.0.1", 80)])], Instant::now());
    publish(&mut p).unwrap();
    tokio::time::advance(Duration::from_secs(10)).await;
    p.apply([Event::Consul(key.clone(), ConsulEvent::Failed("500 No cluster leader".into()))], Instant::now());
    let s = next_publication(&mut p).await.content.resolvers[0].services[0].as_ref().clone();
    assert!(s.synced, "it has answered before");
    assert_eq!(*s.endpoints, vec![ep("10.0.0.1", 80)]);
    assert_eq!(s.stale.unwrap().since, "2026-11-23T06:00:10Z");
    tokio::time::advance(Duration::from_secs(10)).await;
    p.apply([Event::Consul(key.clone(), ConsulEvent::Failed("connection refused".into()))], Instant::now());
    let s = next_publication(&mut p).await.content.resolvers[0].services[0].as_ref().clone();
    assert_eq!(
        s.stale.unwrap(),
        super::assembler::snapshot::Stale { since: "2026-11-23T06:00:10Z".into(), reason: "connection refused".into() }
    );
    p.apply([answer(&key, 2, vec![ep("10.0.0.1", 80)])], Instant::now());
    let s = next_publication(&mut p).await.content.resolvers[0].services[0].as_ref().clone();
    assert_eq!((s.stale, s.error), (None, None));
}

/// xorshift64*: a deterministic stream of choices.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// A random change to the world, among the keys it tracks.
fn random_event(rng: &mut Rng, world: &super::world::World) -> Option<Event> {
    use base64::Engine;
    let namespaces = ["a", "b"];
    let ns = *rng.pick(&namespaces);
    let secret = assembler::resolvers::secret_key(ns, "t1");
    // Consul answers are most of what arrives, as in a real cluster.
    Some(match rng.below(12) {
        0 | 1 => {
            let address = *rng.pick(&["127.0.0.1:8500", "127.0.0.2:8500", "${NOPE}:8500"]);
            let mut spec = json!({"address": address, "services": if rng.below(4) == 0 { json!(["always"]) } else { json!([]) }});
            if rng.below(2) == 0 {
                spec["tokenSecretRef"] = json!({"name": "t1", "key": "token"});
            }
            if rng.below(3) == 0 {
                spec["datacenter"] = json!("dc2");
            }
            let name = *rng.pick(&["c1", "c2"]);
            Event::Kube(resolvers_key(), KubeEvent::Applied(resolver(ns, name, spec)))
        }
        2 => {
            let name = *rng.pick(&["c1", "c2"]);
            Event::Kube(resolvers_key(), KubeEvent::Deleted(resolver(ns, name, json!({})).id))
        }
        3 if world.kube().contains_key(&secret) => {
            if rng.below(3) == 0 {
                Event::Kube(secret.clone(), KubeEvent::Deleted(object(json!({"metadata": {"namespace": ns, "name": "t1"}})).id))
            } else {
                let token = base64::engine::general_purpose::STANDARD.encode(*rng.pick(&["tok-1", "tok-2"]));
                let obj = object(json!({"metadata": {"namespace": ns, "name": "t1"}, "data": {"token": token}}));
                Event::Kube(secret, KubeEvent::Applied(obj))
            }
        }
        4 | 5 => {
            let service = *rng.pick(&["s1", "s2", "s3:8080", "s4", "web", "always", "api.b:80", "10.0.0.1:80", "-x", ""]);
            let mut spec = json!({"service": service});
            if let Some(r) = *rng.pick(&[None, Some("c1"), Some("c2"), Some("nope")]) {
                spec["resolver"] = json!(r);
            }
            let name = format!("m{}", rng.below(8));
            Event::Kube(mappings_key(), KubeEvent::Applied(mapping(ns, &name, spec)))
        }
        6 => Event::Kube(mappings_key(), KubeEvent::Deleted(mapping(ns, &format!("m{}", rng.below(8)), json!({})).id)),
        7..=10 => {
            let keys: Vec<&ConsulKey> = world.consul().keys().collect();
            if keys.is_empty() {
                return None;
            }
            let key = (*rng.pick(&keys)).clone();
            if rng.below(4) == 0 {
                Event::Consul(key, ConsulEvent::Failed(rng.pick(&["refused", "403 ACL not found"]).to_string()))
            } else {
                let port = 80 + rng.below(20) as u16;
                Event::Consul(key, ConsulEvent::Answer { index: rng.next() % 100 + 1, endpoints: vec![ep("10.0.0.9", port)] })
            }
        }
        _ => {
            let keys: Vec<&KubeKey> = world.kube().keys().filter(|k| k.kind == "Endpoints").collect();
            if keys.is_empty() {
                return None;
            }
            let key = (*rng.pick(&keys)).clone();
            if rng.below(4) == 0 {
                Event::Kube(key, KubeEvent::Failed(super::model::WatchFailure::rejected("endpoints is forbidden")))
            } else {
                let ep_ns = key.namespace.clone().unwrap_or_default();
                let obj = object(json!({"metadata": {"namespace": ep_ns, "name": "x"},
                    "subsets": [{"addresses": [{"ip": format!("10.1.0.{}", rng.below(3))}], "ports": [{"port": 80}]}]}));
                return Some(Event::Kube(key, KubeEvent::Applied(obj)));
            }
        }
    })
    .filter(|e| match e {
        Event::Kube(k, _) => world.kube().contains_key(k),
        Event::Consul(k, _) => world.consul().contains_key(k),
    })
}

#[tokio::test(start_paused = true)]
async fn incremental_assembly_equals_reading_everything_again() {
    use super::assembler::Assembler;
    use super::world::World;
    let cfg = Config { endpoints_api: EndpointsApi::Endpoints, ..Config::default() };
    let mut world = World::new(BOOTSTRAP);
    let now = Instant::now();
    for key in fixed() {
        world.track(&key, now);
    }
    for key in [resolvers_key(), mappings_key()] {
        world.apply(Event::Kube(key.clone(), KubeEvent::ListStarted), now);
        world.apply(Event::Kube(key, KubeEvent::ListDone), now);
    }
    let mut incremental = Assembler::new(cfg.clone());
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let (mut steps, mut consul_only) = (0, 0);
    for step in 0..1500u64 {
        tokio::time::advance(Duration::from_secs(1)).await;
        let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(WALL_START + step);
        let batch: Vec<Event> = (0..1 + rng.below(3)).filter_map(|_| random_event(&mut rng, &world)).collect();
        let only_consul = batch.iter().all(|e| matches!(e, Event::Consul(..)));
        for e in batch {
            world.apply(e, Instant::now());
        }
        // Settle as the pipeline does, checking every update against a full reading.
        loop {
            let changes = world.take_changes();
            if changes.is_empty() {
                break;
            }
            let mut full = incremental.clone();
            full.read_everything_next();
            let updated = incremental.update(&world, &changes, wall);
            full.update(&world, &changes, wall);
            assert_eq!(incremental.content(&world), full.content(&world), "step {step}: content");
            assert_eq!(
                incremental.desired().collect::<Vec<_>>(),
                full.desired().collect::<Vec<_>>(),
                "step {step}: desired watches"
            );
            assert_eq!(incremental.kept(), full.kept(), "step {step}: endpoints kept");
            assert_eq!(incremental.desired_counts(), &incremental.recount(), "step {step}: counts drifted");
            assert_eq!(incremental.desired_counts(), full.desired_counts(), "step {step}: desired counts");
            if only_consul && !changes.consul.is_empty() && changes.kube.is_empty() {
                assert!(updated.added.is_empty() && updated.removed.is_empty(), "step {step}: Consul alone");
                consul_only += 1;
            }
            for key in updated.removed {
                world.untrack(&key);
            }
            for key in updated.added {
                world.track(&key, Instant::now());
            }
            steps += 1;
        }
    }
    assert!(steps > 1000 && consul_only > 100, "the walk exercised it: {steps} updates, {consul_only} Consul-only");
}

/// The desired watches are counted one way, whatever the path: a shared query, a Secret, a
/// Kubernetes target, each added by what starts holding it and removed by what stops. After
/// every update, incremental or everything read again, the counts kept equal the counts
/// taken from scratch, and an incremental update agrees with reading everything again.
#[tokio::test(start_paused = true)]
async fn desired_counts_agree_however_they_were_reached() {
    use super::assembler::Assembler;
    use super::world::World;
    let now = Instant::now();
    let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(WALL_START);
    let mut world = World::new(BOOTSTRAP);
    for key in fixed() {
        world.track(&key, now);
    }
    for key in [resolvers_key(), mappings_key()] {
        world.apply(Event::Kube(key.clone(), KubeEvent::ListStarted), now);
        world.apply(Event::Kube(key, KubeEvent::ListDone), now);
    }
    let shared = |dc: Option<&str>| {
        let mut spec = json!({"address": "127.0.0.1:8500", "allowedNamespaces": {"from": "All"}});
        if let Some(dc) = dc {
            spec["datacenter"] = json!(dc);
        }
        spec
    };
    let mut a = Assembler::new(Config { endpoints_api: EndpointsApi::Endpoints, ..Config::default() });
    let billing = |ns: &str, name: &str, resolver: &str| {
        Event::Kube(
            mappings_key(),
            KubeEvent::Applied(mapping(ns, name, json!({"service": "billing", "resolver": resolver}))),
        )
    };
    let steps: Vec<Vec<Event>> = vec![
        // Two resolvers with the same settings: their billing queries are one key, twice.
        vec![
            Event::Kube(resolvers_key(), KubeEvent::Applied(resolver("shop", "consul", shared(None)))),
            Event::Kube(resolvers_key(), KubeEvent::Applied(resolver("ops", "consul", shared(None)))),
        ],
        vec![billing("shop", "m1", "consul"), billing("shop", "m2", "consul"), billing("ops", "m3", "consul")],
        vec![Event::Kube(
            mappings_key(),
            KubeEvent::Applied(mapping("shop", "web", json!({"service": "web.shop:80"}))),
        )],
        // One of the two uses goes: the key stays, counted once.
        vec![Event::Kube(mappings_key(), KubeEvent::Deleted(mapping("ops", "m3", json!({})).id))],
        // A setting changes: the query moves to a new key (read everything again).
        vec![Event::Kube(resolvers_key(), KubeEvent::Applied(resolver("shop", "consul", shared(Some("dc2")))))],
        vec![billing("ops", "m3", "consul")],
        vec![Event::Kube(mappings_key(), KubeEvent::Deleted(mapping("shop", "m1", json!({})).id))],
        // shop's Mapping m2 goes to ops/consul (it serves every namespace).
        vec![Event::Kube(resolvers_key(), KubeEvent::Deleted(resolver("shop", "consul", json!({})).id))],
        vec![Event::Kube(mappings_key(), KubeEvent::Deleted(mapping("shop", "web", json!({})).id))],
        vec![
            Event::Kube(mappings_key(), KubeEvent::Deleted(mapping("shop", "m2", json!({})).id)),
            Event::Kube(mappings_key(), KubeEvent::Deleted(mapping("ops", "m3", json!({})).id)),
        ],
        vec![Event::Kube(resolvers_key(), KubeEvent::Deleted(resolver("ops", "consul", json!({})).id))],
    ];
    let mut shared_seen = false;
    for (step, batch) in steps.into_iter().enumerate() {
        for e in batch {
            world.apply(e, now);
        }
        loop {
            let changes = world.take_changes();
            if changes.is_empty() {
                break;
            }
            let mut full = a.clone();
            full.read_everything_next();
            let delta = a.update(&world, &changes, wall);
            full.update(&world, &changes, wall);
            assert_eq!(a.desired_counts(), &a.recount(), "step {step}: the counts kept are the counts");
            assert_eq!(a.desired_counts(), full.desired_counts(), "step {step}: incremental and full agree");
            shared_seen |= a
                .desired_counts()
                .iter()
                .any(|(k, n)| matches!(k, WatchKey::Consul(c) if c.service == "billing") && *n == 2);
            for key in delta.removed {
                world.untrack(&key);
            }
            for key in delta.added {
                world.track(&key, now);
            }
        }
    }
    assert!(shared_seen, "one billing query was implied by both resolvers at once");
    assert!(a.desired_counts().is_empty(), "nothing is implied any more: {:?}", a.desired_counts());
}

fn exports_key() -> KubeKey {
    KubeKey::new("consulresolver.io", "v1alpha1", "ConsulService")
}
fn export(ns: &str, name: &str, spec: Value) -> KubeObject {
    object(json!({"apiVersion": "consulresolver.io/v1alpha1", "kind": "ConsulService",
                  "metadata": {"namespace": ns, "name": name, "generation": 2}, "spec": spec}))
}

/// An export is one more consumer of the shared registry: the Consul service a Mapping and
/// an export both name is one watch, which stays while either wants it; the export's entry
/// shares the resolver's service entry; an export whose resolver cannot be found says why.
#[tokio::test(start_paused = true)]
async fn an_export_and_a_mapping_of_one_service_share_one_watch_both_ways() {
    let (mut p, key) = bootstrapped_pipeline();
    let now = Instant::now();
    let mut fixed = fixed();
    fixed.insert(exports_key().into());
    p.set_fixed(fixed, now);
    let diff = p.apply(
        listed(
            &exports_key(),
            vec![
                export("shop", "billing", json!({"service": "billing", "resolver": "consul"})),
                export("shop", "lost", json!({"service": "billing", "resolver": "nowhere"})),
            ],
        ),
        now,
    );
    assert!(diff.added.is_empty(), "the Mapping's watch serves the export too: {diff:?}");
    assert_eq!(consul_keys(&p), std::slice::from_ref(&key));
    p.apply([Event::Consul(key.clone(), ConsulEvent::Answer { index: 3, endpoints: vec![ep("10.0.0.1", 80)] })], now);
    let snap = publish(&mut p).expect("published");
    let exports = &snap.content.exports;
    assert_eq!(exports.len(), 2);
    let billing = &exports[0];
    assert_eq!((billing.resolver.as_deref(), billing.generation), (Some("shop/consul"), Some(2)));
    let source = billing.source.as_ref().expect("the service's entry");
    assert!(
        super::assembler::snapshot::Part::ptr_eq(source, &snap.content.resolvers[0].services[0]),
        "shared, not copied"
    );
    assert!(exports[1].problem.as_deref().is_some_and(|p| p.contains("\"nowhere\"")), "{:?}", exports[1]);
    assert!(snap.content.problems.is_empty(), "an export's problem is on its status, not Ambassador's list");

    // The Mapping goes: the export still wants the service.
    let mappings = mappings_key();
    let diff = p.apply(listed(&mappings, vec![]), now);
    assert!(diff.removed.is_empty(), "{diff:?}");
    assert_eq!(consul_keys(&p), std::slice::from_ref(&key));
    // And the export: nobody does.
    let diff = p.apply(listed(&exports_key(), vec![export("shop", "lost", json!({"service": "billing"}))]), now);
    assert_eq!(diff.removed, [WatchKey::Consul(key.clone())]);
    // Back up: an export alone starts it.
    let diff = p.apply(
        listed(&exports_key(), vec![export("shop", "billing", json!({"service": "billing", "resolver": "consul"}))]),
        now,
    );
    assert_eq!(diff.added, [WatchKey::Consul(key)]);
}

/// An export whose resolver exists but cannot be used now (and kept nothing) says so, apart
/// from one no resolver serves: the edge holds the first's live slices (a problem) and
/// removes the second's (a removal).
#[tokio::test(start_paused = true)]
async fn an_export_tells_an_unusable_resolver_from_none() {
    let (mut p, key) = bootstrapped_pipeline();
    let now = Instant::now();
    let mut fixed = fixed();
    fixed.insert(exports_key().into());
    p.set_fixed(fixed, now);
    let resolvers = vec![
        resolver("shop", "consul", json!({"address": "127.0.0.1:8500"})),
        resolver("shop", "broken", json!({"address": "${NOT_SET}:8500"})),
    ];
    p.apply(listed(&resolvers_key(), resolvers), now);
    let exports = vec![
        export("shop", "held", json!({"service": "billing", "resolver": "broken"})),
        export("shop", "lost", json!({"service": "billing", "resolver": "nowhere"})),
    ];
    p.apply(listed(&exports_key(), exports), now);
    p.apply([Event::Consul(key.clone(), ConsulEvent::Answer { index: 3, endpoints: vec![ep("10.0.0.1", 80)] })], now);
    let snap = publish(&mut p).expect("published");
    let by_name = |n: &str| snap.content.exports.iter().find(|e| e.name == n).cloned().expect(n);
    let held = by_name("held");
    assert!(held.resolver_unusable, "{held:?}");
    assert!(held.problem.as_deref().is_some_and(|p| p.contains("cannot be used")), "{held:?}");
    let lost = by_name("lost");
    assert!(!lost.resolver_unusable && lost.problem.is_some(), "{lost:?}");
}
