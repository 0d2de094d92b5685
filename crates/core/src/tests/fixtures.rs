//! What the tests of the core build their worlds from.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use serde_json::{Value, json};
use tokio::time::Instant;

use crate::assembler::{self, Config};
use crate::keys::{ConsulKey, KubeKey, WatchKey};
use crate::model::{ConsulEvent, Endpoint, Event, KubeEvent, KubeObject};
use crate::pipeline::{Pipeline, Step, WallClock};

pub(super) const WINDOW: Duration = Duration::from_millis(250);

pub(super) const BOOTSTRAP: Duration = Duration::from_secs(30);

pub(super) fn resolvers_key() -> KubeKey {
    KubeKey::new("consulresolver.io", "v1alpha1", "ConsulResolver")
}

pub(super) fn mappings_key() -> KubeKey {
    KubeKey::new("getambassador.io", "v3alpha1", "Mapping")
}

/// 2026-11-23T06:00:00Z at the test's start.
pub(super) const WALL_START: u64 = 1_795_413_600;

pub(super) fn pipeline(cfg: Config) -> Pipeline {
    let clock = WallClock { instant: Instant::now(), wall: SystemTime::UNIX_EPOCH + Duration::from_secs(WALL_START) };
    Pipeline::new(cfg, BOOTSTRAP, WINDOW, clock)
}

pub(super) fn fixed() -> BTreeSet<WatchKey> {
    [resolvers_key().into(), mappings_key().into()].into_iter().collect()
}

pub(super) use crate::test_support::{endpoint as ep, kube_object as object};

pub(super) fn resolver(ns: &str, name: &str, spec: Value) -> KubeObject {
    object(json!({"apiVersion": "consulresolver.io/v1alpha1", "kind": "ConsulResolver",
                  "metadata": {"namespace": ns, "name": name}, "spec": spec}))
}

pub(super) fn mapping(ns: &str, name: &str, spec: Value) -> KubeObject {
    object(json!({"apiVersion": "getambassador.io/v3alpha1", "kind": "Mapping",
                  "metadata": {"namespace": ns, "name": name}, "spec": spec}))
}

pub(super) fn listed(key: &KubeKey, objects: Vec<KubeObject>) -> Vec<Event> {
    let mut out = vec![Event::Kube(key.clone(), KubeEvent::ListStarted)];
    out.extend(objects.into_iter().map(|o| Event::Kube(key.clone(), KubeEvent::Listed(o))));
    out.push(Event::Kube(key.clone(), KubeEvent::ListDone));
    out
}

pub(super) fn consul_keys(p: &Pipeline) -> Vec<ConsulKey> {
    p.registry()
        .keys()
        .filter_map(|k| match k {
            WatchKey::Consul(c) => Some(c.clone()),
            WatchKey::Kube(_) => None,
        })
        .collect()
}

pub(super) fn publish(p: &mut Pipeline) -> Option<std::sync::Arc<crate::assembler::Snapshot>> {
    match p.poll(Instant::now()) {
        Step::Publish(s) => {
            p.published(&s, true, Instant::now());
            Some(s)
        }
        _ => None,
    }
}

/// A world with one resolver and one Mapping through it, listed; the Consul key started.
pub(super) fn bootstrapped_pipeline() -> (Pipeline, ConsulKey) {
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

/// The content and the implied watches of a world of these resolvers and Mappings.
pub(super) struct Assembled {
    pub(super) content: assembler::Content,
    pub(super) desired: BTreeSet<WatchKey>,
}

pub(super) fn assemble(resolvers: Vec<KubeObject>, mappings: Vec<KubeObject>, cfg: &Config) -> Assembled {
    let mut p = pipeline(cfg.clone());
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    p.apply(listed(&resolvers_key(), resolvers), now);
    p.apply(listed(&mappings_key(), mappings), now);
    Assembled { content: p.assembler().content(p.world()), desired: p.assembler().desired().cloned().collect() }
}

pub(super) fn answer(key: &ConsulKey, index: u64, endpoints: Vec<Endpoint>) -> Event {
    Event::Consul(key.clone(), ConsulEvent::Answer { index, endpoints: endpoints.into() })
}

/// Publishes whatever is due, waiting out the window first.
pub(super) async fn next_publication(p: &mut Pipeline) -> std::sync::Arc<crate::assembler::Snapshot> {
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
