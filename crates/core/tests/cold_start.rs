//! A benchmark, not a test (ignored, so it shows as such): the core's share of a cold start,
//! with no I/O. The operator benchmark's default world (1,000 Consul services, 10 Mappings
//! each over 5 namespaces, one resolver per namespace, the same Consul for all) goes through
//! the pipeline as the sources deliver it: each namespace's Mappings in pages of 500 in
//! turn, the Consul answers of the watches a page started right after it, then the lists'
//! ends and the first snapshot. Objects are decoded before the clock starts (that is the
//! sources' work). Figures in docs/benchmarks.md.
//!
//!     cargo test --release -p consul-resolver-core --test cold_start -- --ignored --nocapture
//!
//! `BENCH_SERVICES` (1000), `BENCH_INSTANCES_PER_SERVICE` (1) and `BENCH_ROUNDS` (7).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use consul_resolver_core::assembler::Config;
use consul_resolver_core::keys::{ConsulKey, KubeKey, WatchKey};
use consul_resolver_core::model::{ConsulEvent, Endpoint, Event, Health, KubeEvent, KubeObject};
use consul_resolver_core::pipeline::{Pipeline, Step, WallClock};
use serde_json::json;
use tokio::time::Instant;

const NAMESPACES: usize = 5;
const MAPPINGS_PER_SERVICE: usize = 10;
const PAGE: usize = 500;

fn metadata(namespace: &str, name: &str, n: usize) -> serde_json::Value {
    json!({"namespace": namespace, "name": name, "generation": 1, "uid": format!("0d1f6e0e-3f4c-4c3e-9a53-{n:012}"),
           "resourceVersion": (100_000 + n).to_string(), "creationTimestamp": "2026-11-26T18:00:00Z"})
}

/// Each namespace's Mappings, in list order.
fn mappings(namespaces: &[String], services: usize) -> Vec<Vec<KubeObject>> {
    let mut per_ns = vec![Vec::new(); namespaces.len()];
    for i in 0..services {
        for m in 0..MAPPINGS_PER_SERVICE {
            let ns = m % namespaces.len();
            let name = format!("svc-{i:05}-m{m}");
            let o = json!({"apiVersion": "getambassador.io/v3alpha1", "kind": "Mapping",
                "metadata": metadata(&namespaces[ns], &name, i * MAPPINGS_PER_SERVICE + m),
                "spec": {"prefix": format!("/{name}/"), "service": format!("svc-{i:05}:8080"), "resolver": "consul"}});
            per_ns[ns].push(KubeObject::from_value(o).expect("a Mapping"));
        }
    }
    per_ns
}

fn answer(key: ConsulKey, index: u64, instances: usize) -> Event {
    let endpoints = (0..instances)
        .map(|k| Endpoint {
            address: format!("10.{k}.{}.{}", index / 250 % 250, index % 250),
            port: 8080,
            node: format!("node-{k}"),
            service_id: format!("{}-{k}", key.service),
            tags: vec![],
            meta: BTreeMap::new(),
            health: Health::Passing,
            zone: None,
            weight: None,
        })
        .collect();
    Event::Consul(key, ConsulEvent::Answer { index, endpoints })
}

/// One cold start; returns the time from the first event to the first snapshot.
fn cold_start(services: usize, instances: usize) -> Duration {
    let namespaces: Vec<String> = (0..NAMESPACES).map(|i| format!("bench-{i}")).collect();
    let resolver_keys: Vec<KubeKey> = namespaces
        .iter()
        .map(|n| KubeKey::new("consulresolver.io", "v1alpha1", "ConsulResolver").in_namespace(n))
        .collect();
    let mapping_keys: Vec<KubeKey> =
        namespaces.iter().map(|n| KubeKey::new("getambassador.io", "v3alpha1", "Mapping").in_namespace(n)).collect();
    let resolvers: Vec<KubeObject> = namespaces
        .iter()
        .enumerate()
        .map(|(j, ns)| {
            KubeObject::from_value(json!({"apiVersion": "consulresolver.io/v1alpha1", "kind": "ConsulResolver",
                "metadata": metadata(ns, "consul", 1_000_000 + j), "spec": {"address": "127.0.0.1:8500"}}))
            .expect("a resolver")
        })
        .collect();
    let mut pages: Vec<std::vec::IntoIter<KubeObject>> =
        mappings(&namespaces, services).into_iter().map(Vec::into_iter).collect();

    let clock = WallClock { instant: Instant::now(), wall: SystemTime::now() };
    let mut p = Pipeline::new(Config::default(), Duration::from_secs(30), Duration::from_millis(250), clock);
    let now = Instant::now();
    let started = std::time::Instant::now();
    p.set_fixed(resolver_keys.iter().chain(&mapping_keys).cloned().map(WatchKey::Kube).collect(), now);
    for (key, o) in resolver_keys.iter().zip(resolvers) {
        let list = [KubeEvent::ListStarted, KubeEvent::Listed(o), KubeEvent::ListDone];
        p.apply(list.into_iter().map(|e| Event::Kube(key.clone(), e)), now);
    }
    p.apply(mapping_keys.iter().map(|k| Event::Kube(k.clone(), KubeEvent::ListStarted)), now);
    let mut asked = BTreeSet::new();
    let mut index = 10;
    loop {
        let mut listed = 0;
        for (key, page) in mapping_keys.iter().zip(&mut pages) {
            let events: Vec<Event> =
                page.by_ref().take(PAGE).map(|o| Event::Kube(key.clone(), KubeEvent::Listed(o))).collect();
            listed += events.len();
            if events.is_empty() {
                continue;
            }
            let started_watches = p.apply(events, now);
            let answers: Vec<Event> = started_watches
                .added
                .into_iter()
                .filter_map(|k| match k {
                    WatchKey::Consul(c) if asked.insert(c.clone()) => {
                        index += 1;
                        Some(answer(c, index, instances))
                    }
                    _ => None,
                })
                .collect();
            if !answers.is_empty() {
                p.apply(answers, now);
            }
        }
        if listed == 0 {
            break;
        }
    }
    p.apply(mapping_keys.iter().map(|k| Event::Kube(k.clone(), KubeEvent::ListDone)), now);
    let Step::Publish(snapshot) = p.poll(now) else { panic!("no first snapshot: {:?}", p.readiness(now)) };
    let elapsed = started.elapsed();
    assert_eq!(snapshot.content.mappings.len(), services * MAPPINGS_PER_SERVICE);
    assert!(snapshot.content.bootstrap.complete, "every service answered");
    elapsed
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[test]
#[ignore = "a benchmark: run with --ignored --nocapture (see the module's docs)"]
fn bench_the_cores_cold_start() {
    let (services, instances) = (env_usize("BENCH_SERVICES", 1000), env_usize("BENCH_INSTANCES_PER_SERVICE", 1));
    let mut times: Vec<Duration> =
        (0..env_usize("BENCH_ROUNDS", 7).max(1)).map(|_| cold_start(services, instances)).collect();
    times.sort();
    println!(
        "the core's cold start, {} Mappings, {services} services x {instances}: {:?} / {:?} / {:?} (min / median / max of {})",
        services * MAPPINGS_PER_SERVICE,
        times[0],
        times[times.len() / 2],
        times[times.len() - 1],
        times.len()
    );
}
