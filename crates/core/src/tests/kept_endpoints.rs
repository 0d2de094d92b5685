//! Endpoints last obtained, kept and marked stale while they cannot be refreshed.

use std::time::Duration;

use serde_json::json;
use tokio::time::Instant;

use crate::assembler::snapshot::{Target, UnusableReason};
use crate::assembler::{self, Config};
use crate::keys::{ConsulKey, KubeKey, WatchKey};
use crate::model::{ConsulEvent, Event, KubeEvent, KubeObject};
use crate::pipeline::Pipeline;

use super::fixtures::{
    answer, bootstrapped_pipeline, consul_keys, ep, fixed, listed, mapping, mappings_key, next_publication, object,
    pipeline, publish, resolver, resolvers_key,
};

fn secret_object(ns: &str, name: &str, token: &str) -> KubeObject {
    use base64::Engine;
    let encoded = base64::engine::general_purpose::STANDARD.encode(token);
    object(json!({"metadata": {"namespace": ns, "name": name}, "data": {"token": encoded}}))
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
            ConsulEvent::Cached { index, endpoints: vec![ep("10.0.0.1", port)].into(), cut_off_since: since },
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

/// A resolver whose token is in the Secret shop/acl, a Mapping through it, and its query
/// answered and published: the pipeline, that query and the Secret's watch.
fn answered_with_a_token_from_a_secret() -> (Pipeline, ConsulKey, KubeKey) {
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
    (p, old, secret)
}

#[tokio::test(start_paused = true)]
async fn endpoints_last_obtained_outlive_a_token_rotation_a_lost_secret_and_a_broken_spec() {
    let (mut p, old, secret) = answered_with_a_token_from_a_secret();
    let service = |snap: &crate::assembler::Snapshot| snap.content.resolvers[0].services[0].as_ref().clone();

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
        crate::assembler::snapshot::Stale { since: "2026-11-23T06:00:10Z".into(), reason: "connection refused".into() }
    );
    p.apply([answer(&key, 2, vec![ep("10.0.0.1", 80)])], Instant::now());
    let s = next_publication(&mut p).await.content.resolvers[0].services[0].as_ref().clone();
    assert_eq!((s.stale, s.error), (None, None));
}
