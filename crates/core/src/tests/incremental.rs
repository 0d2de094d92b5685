//! Incremental assembly agrees with reading everything again, however it was reached.

use std::time::{Duration, SystemTime};

use serde_json::json;
use tokio::time::Instant;

use crate::assembler::snapshot::Parts;
use crate::assembler::{self, Config, EndpointsApi, WatchLimits};
use crate::keys::{ConsulKey, KubeKey, WatchKey};
use crate::model::{ConsulEvent, Event, KubeEvent};

use super::fixtures::{BOOTSTRAP, WALL_START, ep, fixed, mapping, mappings_key, object, resolver, resolvers_key};

/// xorshift64*: a deterministic stream of choices.
use crate::test_support::Rng;

/// A random change to the world, among the keys it tracks.
fn random_event(rng: &mut Rng, world: &crate::world::World) -> Option<Event> {
    use base64::Engine;
    let namespaces = ["a", "b"];
    let ns = *rng.pick(&namespaces);
    let secret = assembler::resolvers::secret_key(ns, "t1");
    // Consul answers are most of what arrives, as in a real cluster.
    Some(match rng.below(12) {
        0 | 1 => {
            let address = *rng.pick(&["127.0.0.1:8500", "127.0.0.2:8500", "${NOPE}:8500"]);
            let mut spec =
                json!({"address": address, "services": if rng.below(4) == 0 { json!(["always"]) } else { json!([]) }});
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
                Event::Kube(
                    secret.clone(),
                    KubeEvent::Deleted(object(json!({"metadata": {"namespace": ns, "name": "t1"}})).id),
                )
            } else {
                let token = base64::engine::general_purpose::STANDARD.encode(*rng.pick(&["tok-1", "tok-2"]));
                let obj = object(json!({"metadata": {"namespace": ns, "name": "t1"}, "data": {"token": token}}));
                Event::Kube(secret, KubeEvent::Applied(obj))
            }
        }
        4 | 5 => {
            let service =
                *rng.pick(&["s1", "s2", "s3:8080", "s4", "web", "always", "api.b:80", "10.0.0.1:80", "-x", ""]);
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
                Event::Consul(
                    key,
                    ConsulEvent::Answer {
                        index: rng.next_u64() % 100 + 1,
                        endpoints: vec![ep("10.0.0.9", port)].into(),
                    },
                )
            }
        }
        _ => return endpoints_event(rng, world),
    })
    .filter(|e| match e {
        Event::Kube(k, _) => world.kube().contains_key(k),
        Event::Consul(k, _) => world.consul().contains_key(k),
    })
}

/// A random change to an Endpoints watch: one Service's watch holds its own object; a shared
/// one (a namespace's or the cluster's) any Service's, routed to or not.
fn endpoints_event(rng: &mut Rng, world: &crate::world::World) -> Option<Event> {
    let keys: Vec<&KubeKey> = world.kube().keys().filter(|k| k.kind == "Endpoints").collect();
    if keys.is_empty() {
        return None;
    }
    let key = (*rng.pick(&keys)).clone();
    let own = key.field_selector.as_deref().and_then(|f| f.strip_prefix("metadata.name="));
    let name = own.unwrap_or_else(|| *rng.pick(&["x", "s1", "s2", "s4", "web", "always", "api"]));
    let ep_ns = key.namespace.clone().unwrap_or_else(|| (*rng.pick(&["a", "b"])).to_owned());
    let obj = object(json!({"metadata": {"namespace": ep_ns, "name": name},
        "subsets": [{"addresses": [{"ip": format!("10.1.0.{}", rng.below(3))}], "ports": [{"port": 80}]}]}));
    Some(match rng.below(6) {
        0 => Event::Kube(key, KubeEvent::Failed(crate::model::WatchFailure::rejected("endpoints is forbidden"))),
        1 => Event::Kube(key, KubeEvent::Deleted(obj.id)),
        _ => Event::Kube(key, KubeEvent::Applied(obj)),
    })
}

#[tokio::test(start_paused = true)]
async fn incremental_assembly_equals_reading_everything_again() {
    walk(Config { endpoints_api: EndpointsApi::Endpoints, ..Config::default() }, 0x5eed_1234_abcd_0001).await;
}

/// The same with Kubernetes Services moving between their own endpoints watch, their
/// namespace's (past one Service) and the cluster's (past a budget of two watches): a
/// change on a shared watch re-reads only the Services whose objects it touched.
#[tokio::test(start_paused = true)]
async fn incremental_assembly_over_shared_endpoints_watches_equals_reading_everything_again() {
    let endpoint_watches = WatchLimits { namespace_above: 1, budget: 2, cluster_wide: true };
    walk(
        Config { endpoints_api: EndpointsApi::Endpoints, endpoint_watches, ..Config::default() },
        0x5eed_1234_abcd_0002,
    )
    .await;
}

/// A random walk of the world under `cfg`, each incremental update checked against reading
/// everything again.
async fn walk(cfg: Config, seed: u64) {
    use crate::assembler::Assembler;
    use crate::world::World;
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
    let mut rng = Rng(seed);
    let (mut steps, mut consul_only, mut kept_lists) = (0, 0, 0);
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
            let before = incremental.content(&world);
            let updated = incremental.update(&world, &changes, wall);
            full.update(&world, &changes, wall);
            let content = incremental.content(&world);
            assert_eq!(content, full.content(&world), "step {step}: content");
            // Resolvers' entries are made again before a document, not at each update:
            // some steps make them, others leave them to be made with a later one.
            if rng.below(2) == 0 {
                incremental.make_entries();
                assert_eq!(incremental.content(&world), content, "step {step}: the entries made");
            }
            if changes.kube.is_empty() {
                // Consul alone: the very same lists, which the writer takes whole.
                assert!(Parts::ptr_eq(&before.mappings, &content.mappings), "step {step}: Mappings' list");
                assert!(Parts::ptr_eq(&before.kubernetes_services, &content.kubernetes_services), "step {step}");
                kept_lists += 1;
            }
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
    assert!(
        steps > 1000 && consul_only > 100 && kept_lists > 100,
        "the walk exercised it: {steps} updates, {consul_only} Consul-only, {kept_lists} with the lists kept"
    );
}

/// The desired watches are counted one way, whatever the path: a shared query, a Secret, a
/// Kubernetes target, each added by what starts holding it and removed by what stops. After
/// every update, incremental or everything read again, the counts kept equal the counts
/// taken from scratch, and an incremental update agrees with reading everything again.
#[tokio::test(start_paused = true)]
async fn desired_counts_agree_however_they_were_reached() {
    use crate::assembler::Assembler;
    use crate::world::World;
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
