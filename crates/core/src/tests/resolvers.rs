//! Which resolver a Mapping uses, and the resolvers that cannot be used.

use serde_json::{Value, json};
use tokio::time::Instant;

use crate::assembler::Config;
use crate::assembler::snapshot::{Target, UnusableReason};
use crate::keys::WatchKey;
use crate::model::{Event, KubeEvent};
use crate::pipeline::Pipeline;

use super::fixtures::{assemble, fixed, listed, mapping, mappings_key, object, pipeline, resolver, resolvers_key};

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

    assert_the_default_resolver_serves_only_the_namespaces_it_allows(&spec);
}

/// The operator's --default-resolver is held to the same rule as a resolver a Mapping names:
/// named namespace/name, it still serves only the namespaces it allows.
fn assert_the_default_resolver_serves_only_the_namespaces_it_allows(spec: &Value) {
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
    let namespaces = crate::assembler::resolvers::namespaces_key();
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
