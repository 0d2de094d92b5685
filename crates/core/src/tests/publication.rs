//! The pace and identity of publications: one window, never overlapping, retried, deterministic.

use std::time::Duration;

use serde_json::json;
use tokio::time::Instant;

use crate::assembler::Config;
use crate::model::{ConsulEvent, Event, KubeEvent};
use crate::pipeline::Step;

use super::fixtures::{WINDOW, assemble, bootstrapped_pipeline, ep, mapping, mappings_key, publish, resolver};

const MAX_RETRY: Duration = Duration::from_secs(30);

#[tokio::test(start_paused = true)]
async fn a_burst_of_ten_thousand_events_is_at_most_two_publications_ending_in_the_final_world() {
    let (mut p, key) = bootstrapped_pipeline();
    p.apply([Event::Consul(key.clone(), ConsulEvent::Answer { index: 1, endpoints: vec![].into() })], Instant::now());
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
        p.apply(
            [Event::Consul(key.clone(), ConsulEvent::Answer { index: 2 + i as u64, endpoints: endpoints.into() })],
            Instant::now(),
        );
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
    p.apply([Event::Consul(key.clone(), ConsulEvent::Answer { index: 1, endpoints: vec![].into() })], Instant::now());
    let Step::Publish(first) = p.poll(Instant::now()) else { panic!("expected a publication") };
    for i in 0..500u16 {
        tokio::time::advance(WINDOW / 10).await;
        p.apply(
            [Event::Consul(
                key.clone(),
                ConsulEvent::Answer { index: 2 + u64::from(i), endpoints: vec![ep("10.0.0.2", i + 1)].into() },
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
    let answer =
        |i| Event::Consul(key.clone(), ConsulEvent::Answer { index: i, endpoints: vec![ep("10.0.0.1", 80)].into() });
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
        [Event::Consul(key, ConsulEvent::Answer { index: 1, endpoints: vec![ep("10.0.0.1", 80)].into() })],
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
