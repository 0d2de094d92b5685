//! Kubernetes Services as targets: the endpoints watches they imply and what they report.

use std::collections::BTreeSet;

use serde_json::json;
use tokio::time::Instant;

use crate::assembler::snapshot::{KubeServiceEntry, Part};
use crate::assembler::{Config, EndpointsApi, WatchLimits};
use crate::keys::WatchKey;
use crate::model::{Event, KubeEvent, KubeObject, WatchFailure};
use crate::pipeline::{Pipeline, Step};

use super::fixtures::{
    BOOTSTRAP, WINDOW, fixed, listed, mapping, mappings_key, next_publication, object, pipeline, publish, resolvers_key,
};

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
    let endpoint_watches = WatchLimits { namespace_above: 3, ..WatchLimits::default() };
    let mut p = pipeline(Config { endpoint_watches, ..Config::default() });
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
/// stops) a watch per Service of its first pages. Its namespace's watch starts with the page
/// that takes it past the threshold, beside the pages still to come, and stays.
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
    let wide = EndpointsApi::EndpointSlices.namespace_key("shop");
    assert_eq!(slice_keys(&p), [wide.to_string()], "past the threshold while the routes list");
    p.apply(listed(&wide, (0..5).map(|i| slice("shop", &format!("s{i}"), "a", &format!("10.0.0.{i}"))).collect()), now);
    let diff = p.apply([Event::Kube(mappings_key(), KubeEvent::ListDone)], now);
    assert!(diff.added.is_empty() && diff.removed.is_empty(), "the early watch is the layout's: {diff:?}");
    assert_eq!(slice_keys(&p), [wide.to_string()]);
    assert!(kube_services(&p).iter().all(|(_, synced, endpoints)| *synced && endpoints.len() == 1));
}

/// Mapping `shop/m-<ns>-<i>` to Kubernetes Service `s<i>` of namespace `ns`.
fn route_to(ns: &str, i: usize) -> KubeObject {
    mapping("shop", &format!("m-{ns}-{i}"), json!({"service": format!("s{i}.{ns}:80")}))
}

/// A cold start's routes, one page per namespace with its number of Services (the list not
/// done): the EndpointSlice keys once each page is applied.
fn cold_start_pages(p: &mut Pipeline, now: Instant, namespaces: &[(&str, usize)]) -> Vec<Vec<String>> {
    p.apply([Event::Kube(mappings_key(), KubeEvent::ListStarted)], now);
    namespaces
        .iter()
        .map(|&(ns, services)| {
            let page: Vec<Event> =
                (0..services).map(|i| Event::Kube(mappings_key(), KubeEvent::Listed(route_to(ns, i)))).collect();
            p.apply(page, now);
            slice_keys(p)
        })
        .collect()
}

/// Past the budget, while the routes still list, the namespaces that the layout of the
/// routes so far watches whole (the biggest first) are watched whole at once: they list
/// beside the routes, and once every route is known nothing starts or stops, and the first
/// snapshot is whole without waiting for another list.
#[tokio::test(start_paused = true)]
async fn past_the_budget_namespaces_are_watched_whole_while_the_routes_list() {
    let endpoint_watches = WatchLimits { namespace_above: 100, budget: 4, cluster_wide: true };
    let mut p = pipeline(Config { endpoint_watches, ..Config::default() });
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    p.apply(listed(&resolvers_key(), vec![]), now);
    let keys = cold_start_pages(&mut p, now, &[("a", 3), ("b", 3), ("c", 3)]);
    let whole = |nss: &[&str]| -> Vec<String> {
        nss.iter().map(|ns| EndpointsApi::EndpointSlices.namespace_key(ns).to_string()).collect()
    };
    assert_eq!(keys, [vec![], whole(&["a"]), whole(&["a", "b", "c"])], "three Services, six, nine: past four");
    assert_eq!(p.assembler().desired_counts(), &p.assembler().recount(), "the early watches are counted");
    for ns in ["a", "b", "c"] {
        let objects = (0..3).map(|i| slice(ns, &format!("s{i}"), "x", &format!("10.0.0.{i}"))).collect();
        p.apply(listed(&EndpointsApi::EndpointSlices.namespace_key(ns), objects), now);
    }
    let diff = p.apply([Event::Kube(mappings_key(), KubeEvent::ListDone)], now);
    assert!(diff.added.is_empty() && diff.removed.is_empty(), "the early watches are the layout's: {diff:?}");
    let snapshot = publish(&mut p).expect("the first snapshot, at once");
    assert!(snapshot.content.bootstrap.complete);
    assert_eq!(kube_services(&p).len(), 9);
    assert!(kube_services(&p).iter().all(|(_, synced, endpoints)| *synced && endpoints.len() == 1));
}

/// Early watches stay one fewer than the budget: when the namespaces outnumber it, the
/// cluster's watch replaces them once every route is known, within the budget throughout.
#[tokio::test(start_paused = true)]
async fn early_watches_leave_room_for_the_clusters_within_the_budget() {
    let endpoint_watches = WatchLimits { namespace_above: 100, budget: 3, cluster_wide: true };
    let mut p = pipeline(Config { endpoint_watches, ..Config::default() });
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    p.apply(listed(&resolvers_key(), vec![]), now);
    let keys = cold_start_pages(&mut p, now, &["a", "b", "c", "d", "e"].map(|ns| (ns, 2)));
    assert!(keys.iter().all(|k| k.len() <= 2), "{keys:?}");
    assert_eq!(keys.last().map(Vec::len), Some(2), "{keys:?}");
    p.apply([Event::Kube(mappings_key(), KubeEvent::ListDone)], now);
    assert_eq!(slice_keys(&p), [EndpointsApi::EndpointSlices.cluster_key().to_string()]);
}

/// A namespace watched whole early that the layout of every route watches one Service at
/// a time has its early watch stopped once every route is known.
#[tokio::test(start_paused = true)]
async fn an_early_watch_the_final_layout_does_not_need_stops() {
    let endpoint_watches = WatchLimits { namespace_above: 100, budget: 8, cluster_wide: true };
    let mut p = pipeline(Config { endpoint_watches, ..Config::default() });
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    p.apply(listed(&resolvers_key(), vec![]), now);
    let keys = cold_start_pages(&mut p, now, &[("a", 7), ("b", 5)]);
    let a = EndpointsApi::EndpointSlices.namespace_key("a");
    assert_eq!(keys, [vec![], vec![a.to_string()]], "twelve Services, past eight: the biggest namespace whole");
    // Four of b's routes were gone by the end of the list: eight Services, one watch each.
    let gone: Vec<Event> =
        (1..5).map(|i| Event::Kube(mappings_key(), KubeEvent::Deleted(route_to("b", i).id))).collect();
    p.apply(gone, now);
    let diff = p.apply([Event::Kube(mappings_key(), KubeEvent::ListDone)], now);
    assert_eq!(diff.removed, [WatchKey::Kube(a)]);
    let mut own: Vec<String> =
        (0..7).map(|i| EndpointsApi::EndpointSlices.key("a", &format!("s{i}")).to_string()).collect();
    own.push(EndpointsApi::EndpointSlices.key("b", "s0").to_string());
    own.sort();
    let mut keys = slice_keys(&p);
    keys.sort();
    assert_eq!(keys, own);
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

/// Mapping `shop/m-<ns>` to Service `web` of namespace `ns`.
fn route_to_web_in(ns: &str) -> KubeObject {
    mapping("shop", &format!("m-{ns}"), json!({"service": format!("web.{ns}:80")}))
}

/// More namespaces than the budget of endpoints watches: one watch of the cluster's
/// EndpointSlices serves every Service, each reading the slices of its own namespace (same
/// names elsewhere are someone else's); back within the budget, one watch each again, never
/// empty in between. Confined to namespaces, one watch each over the budget, and said.
#[tokio::test(start_paused = true)]
async fn more_namespaces_than_the_budget_share_a_watch_of_the_cluster_and_back() {
    let endpoint_watches = WatchLimits { budget: 2, ..WatchLimits::default() };
    let mut p = pipeline(Config { endpoint_watches, ..Config::default() });
    let now = Instant::now();
    p.set_fixed(fixed(), now);
    p.apply(listed(&resolvers_key(), vec![]), now);
    p.apply(listed(&mappings_key(), ["a", "b", "c"].map(route_to_web_in).to_vec()), now);
    let cluster = EndpointsApi::EndpointSlices.cluster_key();
    assert_eq!(slice_keys(&p), [cluster.to_string()], "three namespaces, a budget of two: the cluster's watch");
    assert_eq!(p.endpoints_over_budget(), None);
    let objects = ["a", "b", "c", "d"].map(|ns| slice(ns, "web", "x", &format!("10.0.0.{}", ns.as_bytes()[0])));
    p.apply(listed(&cluster, objects.to_vec()), now);
    let by_namespace: Vec<(String, Vec<String>)> = p
        .assembler()
        .content(p.world())
        .kubernetes_services
        .iter()
        .map(|s| (s.namespace.clone(), s.endpoints.iter().map(|e| e.address.clone()).collect()))
        .collect();
    let expect = |ns: &str| (ns.to_owned(), vec![format!("10.0.0.{}", ns.as_bytes()[0])]);
    assert_eq!(by_namespace, [expect("a"), expect("b"), expect("c")], "each its own namespace's web");

    // Down to one namespace (within three quarters of two): its own watch, and until it
    // lists, what the cluster's said.
    for ns in ["b", "c"] {
        p.apply([Event::Kube(mappings_key(), KubeEvent::Deleted(route_to_web_in(ns).id))], now);
    }
    let own = EndpointsApi::EndpointSlices.key("a", "web");
    assert_eq!(slice_keys(&p), [own.to_string()]);
    assert_eq!(kube_services(&p), [("web".into(), true, vec!["10.0.0.97".into()])], "never empty while it lists");

    // Confined to namespaces: no watch of the cluster, one each over the budget.
    let confined = WatchLimits { budget: 2, cluster_wide: false, ..WatchLimits::default() };
    let mut p = pipeline(Config { endpoint_watches: confined, ..Config::default() });
    p.set_fixed(fixed(), now);
    p.apply(listed(&resolvers_key(), vec![]), now);
    p.apply(listed(&mappings_key(), ["a", "b", "c"].map(route_to_web_in).to_vec()), now);
    assert_eq!(slice_keys(&p).len(), 3, "{:?}", slice_keys(&p));
    assert!(!slice_keys(&p).contains(&cluster.to_string()));
    assert_eq!(p.endpoints_over_budget(), Some((3, 2)));
    p.apply([Event::Kube(mappings_key(), KubeEvent::Deleted(route_to_web_in("c").id))], now);
    assert_eq!(p.endpoints_over_budget(), None);
}

/// On a shared watch, a change re-reads only the Service whose objects it touched: the
/// others keep their very parts (nothing of theirs is read or written again), whatever the
/// number of Services the watch serves.
#[tokio::test(start_paused = true)]
async fn a_change_on_a_shared_watch_reads_only_its_own_service_again() {
    let (mut p, now) = namespace_watch_above_three();
    p.apply(listed(&mappings_key(), (0..6).map(shop_route).collect()), now);
    let wide = EndpointsApi::EndpointSlices.namespace_key("shop");
    p.apply(listed(&wide, (0..6).map(|i| slice("shop", &format!("s{i}"), "a", &format!("10.0.0.{i}"))).collect()), now);
    let parts = |p: &Pipeline| p.assembler().content(p.world()).kubernetes_services;
    let before = parts(&p);
    assert_eq!(before.len(), 6);
    let same = |after: &[Part<KubeServiceEntry>]| -> Vec<bool> {
        before.iter().zip(after).map(|(b, a)| Part::ptr_eq(b, a)).collect()
    };
    // s2 gains a slice, s4 loses its own (a delete names only the object).
    p.apply([Event::Kube(wide.clone(), KubeEvent::Applied(slice("shop", "s2", "b", "10.0.2.2")))], now);
    p.apply([Event::Kube(wide.clone(), KubeEvent::Deleted(slice("shop", "s4", "a", "").id))], now);
    let after = parts(&p);
    assert_eq!(same(&after), [true, true, false, true, false, true]);
    assert_eq!(after[2].endpoints.len(), 2);
    assert!(after[4].endpoints.is_empty(), "s4's deleted slice is gone from it");
    // An unrouted Service's slice touches nobody.
    p.apply([Event::Kube(wide, KubeEvent::Applied(slice("shop", "unrouted", "a", "10.9.9.9")))], now);
    let unrouted = parts(&p);
    assert!(after.iter().zip(unrouted.iter()).all(|(a, u)| Part::ptr_eq(a, u)));
}
