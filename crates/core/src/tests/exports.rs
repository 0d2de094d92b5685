//! Exports (ConsulServices): one more consumer of the resolvers' queries.

use serde_json::{Value, json};
use tokio::time::Instant;

use crate::keys::{KubeKey, WatchKey};
use crate::model::{ConsulEvent, Event, KubeObject};

use super::fixtures::{
    bootstrapped_pipeline, consul_keys, ep, fixed, listed, mappings_key, object, publish, resolver, resolvers_key,
};

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
    p.apply(
        [Event::Consul(key.clone(), ConsulEvent::Answer { index: 3, endpoints: vec![ep("10.0.0.1", 80)].into() })],
        now,
    );
    let snap = publish(&mut p).expect("published");
    let exports = &snap.content.exports;
    assert_eq!(exports.len(), 2);
    let billing = &exports[0];
    assert_eq!((billing.resolver.as_deref(), billing.generation), (Some("shop/consul"), Some(2)));
    let source = billing.source.as_ref().expect("the service's entry");
    assert!(
        crate::assembler::snapshot::Part::ptr_eq(source, &snap.content.resolvers[0].services[0]),
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
    p.apply(
        [Event::Consul(key.clone(), ConsulEvent::Answer { index: 3, endpoints: vec![ep("10.0.0.1", 80)].into() })],
        now,
    );
    let snap = publish(&mut p).expect("published");
    let by_name = |n: &str| snap.content.exports.iter().find(|e| e.name == n).cloned().expect(n);
    let held = by_name("held");
    assert!(held.resolver_unusable, "{held:?}");
    assert!(held.problem.as_deref().is_some_and(|p| p.contains("cannot be used")), "{held:?}");
    let lost = by_name("lost");
    assert!(!lost.resolver_unusable && lost.problem.is_some(), "{lost:?}");
}
