//! The first publication: what it waits for, and what it stops waiting for once out.

use serde_json::json;
use tokio::time::Instant;

use crate::assembler::Config;
use crate::keys::WatchKey;
use crate::model::{ConsulEvent, Event, KubeEvent};
use crate::pipeline::Step;

use super::fixtures::{
    BOOTSTRAP, WINDOW, answer, bootstrapped_pipeline, consul_keys, ep, fixed, listed, mapping, mappings_key,
    next_publication, pipeline, publish, resolver, resolvers_key,
};

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
    p.apply([Event::Consul(key, ConsulEvent::Answer { index: 3, endpoints: vec![ep("10.0.0.1", 80)].into() })], now);
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
        p.apply(
            [Event::Consul(key, ConsulEvent::Answer { index: 3, endpoints: vec![ep("10.0.0.1", 80)].into() })],
            now,
        );
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
        p.apply(
            [Event::Consul(key, ConsulEvent::Answer { index: 3, endpoints: vec![ep("10.0.0.1", 80)].into() })],
            now,
        );
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
