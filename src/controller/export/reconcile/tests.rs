//! One export's reconcile against a loopback stand-in for the API server: what is sent,
//! with which bodies, for the cases the end-to-end tests cannot set up (a dual-stack
//! cluster, a re-created export racing a removal) and the rules every write follows.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use kube::api::{ApiResource, DynamicObject};
use kube::core::GroupVersionKind;
use serde_json::{Value, json};

use super::*;
use crate::controller::export::metrics::ExportMetrics;
use crate::controller::export::{Exports, ServerFeatures, SliceVersion};
use crate::test_fixtures::{self, FakeApi};
use consul_resolver_core::assembler::snapshot::{Part, ServiceEntry};
use consul_resolver_core::model::{Endpoint, Health};

const SERVICES: &str = "/api/v1/namespaces/shop/services";
const SLICES: &str = "/apis/discovery.k8s.io/v1beta1/namespaces/shop/endpointslices";

/// A request as the stand-in saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    body: Value,
}

/// The cluster's objects by path, and every request.
#[derive(Default)]
struct State {
    objects: BTreeMap<String, Value>,
    seen: Vec<Seen>,
    /// A path the operator's role may not touch: every request to it answers 403.
    forbidden: Option<String>,
}

fn status(code: u16, reason: &str) -> (u16, Value) {
    (code, json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": code}))
}

/// The stand-in: GET, list, server-side apply (the body is stored, a new object gets a
/// uid) and DELETE with a uid precondition, as the API server does them.
fn handle(state: &Mutex<State>, method: &str, path: &str, body: &[u8]) -> (u16, Value) {
    let body: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let mut st = state.lock().unwrap();
    st.seen.push(Seen { method: method.into(), path: path.into(), body: body.clone() });
    if st.forbidden.as_deref() == Some(path) {
        return status(403, "Forbidden");
    }
    match method {
        "GET" if path == SLICES => {
            let items: Vec<Value> =
                st.objects.iter().filter(|(p, _)| p.starts_with(SLICES)).map(|(_, o)| o.clone()).collect();
            (200, json!({"kind": "List", "apiVersion": "v1", "metadata": {}, "items": items}))
        }
        "GET" => st.objects.get(path).map(|o| (200, o.clone())).unwrap_or_else(|| test_fixtures::not_found(path)),
        "PATCH" => {
            let mut obj = body;
            let uid = st.objects.get(path).and_then(|o| o["metadata"]["uid"].as_str().map(str::to_owned));
            obj["metadata"]["uid"] = json!(uid.unwrap_or_else(|| format!("uid-{}", st.seen.len())));
            obj["metadata"]["managedFields"] = applied_fields(&obj);
            st.objects.insert(path.into(), obj.clone());
            (200, obj)
        }
        "DELETE" => {
            let Some(live) = st.objects.get(path) else { return test_fixtures::not_found(path) };
            if let Some(uid) = body["preconditions"]["uid"].as_str()
                && live["metadata"]["uid"] != uid
            {
                return status(409, "Conflict");
            }
            st.objects.remove(path);
            (200, json!({"kind": "Status", "apiVersion": "v1", "status": "Success"}))
        }
        _ => status(405, "MethodNotAllowed"),
    }
}

/// The managed fields an apply of `obj` leaves (its metadata keys only): who set which
/// label and annotation, as the operator reads them back.
fn applied_fields(obj: &Value) -> Value {
    let keys = |field: &str| -> serde_json::Map<String, Value> {
        obj["metadata"][field].as_object().into_iter().flatten().map(|(k, _)| (format!("f:{k}"), json!({}))).collect()
    };
    json!([{"manager": crate::kube_client::FIELD_MANAGER, "operation": "Apply", "apiVersion": "v1",
        "fieldsV1": {"f:metadata": {"f:labels": keys("labels"), "f:annotations": keys("annotations")}}}])
}

struct Fixture {
    ctx: Exports,
    state: Arc<Mutex<State>>,
    _api: FakeApi,
}

impl Fixture {
    async fn new(objects: Vec<(String, Value)>) -> Fixture {
        let state =
            Arc::new(Mutex::new(State { objects: objects.into_iter().collect(), seen: vec![], forbidden: None }));
        let s = state.clone();
        let api = test_fixtures::serve(Arc::new(move |m, p, b| handle(&s, m, p, b))).await;
        let slices = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("discovery.k8s.io", "v1beta1", "EndpointSlice"),
            "endpointslices",
        );
        let ctx = Exports {
            client: api.client.clone(),
            writer: api.client.clone(),
            services: ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "Service"), "services"),
            slices,
            endpoints: ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "Endpoints"), "endpoints"),
            version: SliceVersion::V1beta1,
            features: ServerFeatures::default(),
            instance: "default".into(),
            ambassador_id: "default".into(),
            metrics: ExportMetrics::unregistered(),
            removals: Mutex::default(),
        };
        Fixture { ctx, state, _api: api }
    }

    /// The writes sent: `METHOD path`.
    fn writes(&self) -> Vec<String> {
        let st = self.state.lock().unwrap();
        st.seen.iter().filter(|s| s.method != "GET").map(|s| format!("{} {}", s.method, s.path)).collect()
    }

    fn sent(&self, method: &str, path: &str) -> Vec<Value> {
        let st = self.state.lock().unwrap();
        st.seen.iter().filter(|s| s.method == method && s.path == path).map(|s| s.body.clone()).collect()
    }

    fn object(&self, path: &str) -> Option<Value> {
        self.state.lock().unwrap().objects.get(path).cloned()
    }

    fn until() -> Instant {
        Instant::now() + std::time::Duration::from_secs(30)
    }
}

fn export(spec: Value) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "consulresolver.io/v1alpha1", "kind": "ConsulService",
        "metadata": {"name": "web", "namespace": "shop", "uid": "export-1", "generation": 1},
        "spec": spec,
    }))
    .unwrap()
}

fn instance(address: &str, port: u16) -> Endpoint {
    Endpoint {
        address: address.into(),
        port,
        node: format!("node-{address}-{port}"),
        service_id: format!("web-{address}-{port}"),
        tags: vec![],
        meta: Default::default(),
        health: Health::Passing,
        zone: None,
        weight: None,
    }
}

fn entry(source: Option<ServiceEntry>) -> ExportEntry {
    ExportEntry {
        namespace: "shop".into(),
        name: "web".into(),
        generation: Some(1),
        service: "web".into(),
        resolver: Some("shop/consul".into()),
        problem: None,
        resolver_unusable: false,
        source: source.map(Part::new),
    }
}

fn answer(endpoints: Vec<Endpoint>) -> ServiceEntry {
    ServiceEntry {
        name: "web".into(),
        synced: true,
        index: Some(7),
        error: None,
        stale: None,
        endpoints: endpoints.into(),
    }
}

/// Our Service of export `owner`, as the API server holds it.
fn our_service(uid: &str, owner: &str, families: Option<&str>) -> (String, Value) {
    let mut spec = json!({"type": "ClusterIP", "clusterIP": "10.0.0.7",
        "ports": [{"name": "tcp-8080", "port": 8080, "protocol": "TCP"}]});
    if let Some(f) = families {
        spec["ipFamilies"] = json!([f]);
        spec["ipFamilyPolicy"] = json!("SingleStack");
    }
    let service = json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": "shop", "uid": uid,
            "labels": objects::service_labels("web", "default"),
            "ownerReferences": [objects::owner("consulresolver.io/v1alpha1", "ConsulService", "web", owner)]},
        "spec": spec});
    (format!("{SERVICES}/web"), service)
}

/// Our slice `name` of the Service `service_uid`, holding `addresses` on port 8080.
fn our_slice(name: &str, uid: &str, service_uid: &str, addresses: &[&str]) -> (String, Value) {
    let endpoints: Vec<Value> =
        addresses.iter().map(|a| json!({"addresses": [a], "conditions": {"ready": true}})).collect();
    let slice = json!({"apiVersion": "discovery.k8s.io/v1beta1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "shop", "uid": uid,
            "labels": objects::slice_labels("web", "default", false),
            "ownerReferences": [objects::owner("v1", "Service", "web", service_uid)]},
        "addressType": "IPv4",
        "ports": [{"name": "tcp-8080", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints});
    (format!("{SLICES}/{name}"), slice)
}

fn spec(v: Value) -> ConsulServiceSpec {
    serde_json::from_value(v).unwrap()
}

#[tokio::test]
async fn the_service_always_names_one_family_and_a_family_change_replaces_it() {
    // A new export: single-stack of its family, whatever the cluster's default.
    let f = Fixture::new(vec![]).await;
    let e = entry(Some(answer(vec![instance("192.0.2.1", 8080)])));
    let s = spec(json!({"service": "web"}));
    apply(&f.ctx, &export(json!({"service": "web"})), &s, &e, Fixture::until()).await.unwrap();
    let service = f.object(&format!("{SERVICES}/web")).unwrap();
    assert_eq!(service["spec"]["ipFamilyPolicy"], "SingleStack");
    assert_eq!(service["spec"]["ipFamilies"], json!(["IPv4"]));
    assert!(service["metadata"]["ownerReferences"][0].get("blockOwnerDeletion").is_none());

    // An IPv6 Service of ours (the export said IPv6 before, or the cluster's primary family
    // was given): the family cannot change in place, so it is deleted, exactly that one,
    // and written again.
    let f = Fixture::new(vec![our_service("svc-old", "export-1", Some("IPv6"))]).await;
    apply(&f.ctx, &export(json!({"service": "web"})), &s, &e, Fixture::until()).await.unwrap();
    let deletes = f.sent("DELETE", &format!("{SERVICES}/web"));
    assert_eq!(deletes.len(), 1, "{:?}", f.writes());
    assert_eq!(deletes[0]["preconditions"]["uid"], "svc-old");
    let service = f.object(&format!("{SERVICES}/web")).unwrap();
    assert_eq!(service["spec"]["ipFamilies"], json!(["IPv4"]));
    assert_ne!(service["metadata"]["uid"], "svc-old");

    // The same family: nothing written to the Service. A server that drops the dual-stack
    // fields (1.20 without its gate) is no difference either.
    for families in [Some("IPv4"), None] {
        let f = Fixture::new(vec![our_service("svc-1", "export-1", families)]).await;
        apply(&f.ctx, &export(json!({"service": "web"})), &s, &e, Fixture::until()).await.unwrap();
        assert!(f.sent("PATCH", &format!("{SERVICES}/web")).is_empty(), "{families:?}: {:?}", f.writes());
        assert!(f.sent("DELETE", &format!("{SERVICES}/web")).is_empty(), "{families:?}: {:?}", f.writes());
    }
}

#[tokio::test]
async fn the_service_carries_the_traffic_distribution_only_where_the_server_knows_it() {
    let e = entry(Some(answer(vec![instance("192.0.2.1", 8080)])));
    let (asked, unasked) = (json!({"service": "web", "trafficDistribution": "PreferClose"}), json!({"service": "web"}));
    for known in [true, false] {
        let mut f = Fixture::new(vec![]).await;
        f.ctx.features = ServerFeatures { service_traffic_distribution: known };
        // Two passes: the second finds it as written, and writes nothing.
        for _ in 0..2 {
            apply(&f.ctx, &export(asked.clone()), &spec(asked.clone()), &e, Fixture::until()).await.unwrap();
        }
        let service = f.object(&format!("{SERVICES}/web")).unwrap();
        let held = service["spec"].get("trafficDistribution").cloned();
        assert_eq!(held, known.then(|| json!("PreferClose")), "{service}");
        assert_eq!(f.sent("PATCH", &format!("{SERVICES}/web")).len(), 1, "{:?}", f.writes());
        // No longer asked: written again where it was there, without it.
        apply(&f.ctx, &export(unasked.clone()), &spec(unasked.clone()), &e, Fixture::until()).await.unwrap();
        let service = f.object(&format!("{SERVICES}/web")).unwrap();
        assert!(service["spec"].get("trafficDistribution").is_none(), "{service}");
        let writes = if known { 2 } else { 1 };
        assert_eq!(f.sent("PATCH", &format!("{SERVICES}/web")).len(), writes, "{:?}", f.writes());
    }
}

#[tokio::test]
async fn dynamic_ports_make_at_most_thirty_two_service_ports() {
    let f = Fixture::new(vec![]).await;
    let instances: Vec<Endpoint> = (0..40).map(|i| instance(&format!("192.0.2.{}", i + 1), 20000 + i)).collect();
    let e = entry(Some(answer(instances)));
    let s = spec(json!({"service": "web"}));
    let outcome = apply(&f.ctx, &export(json!({"service": "web"})), &s, &e, Fixture::until()).await.unwrap();
    let service = f.object(&format!("{SERVICES}/web")).unwrap();
    assert_eq!(service["spec"]["ports"].as_array().unwrap().len(), 32);
    let Outcome::Exported { desired, slices, .. } = outcome else { panic!("not exported") };
    assert_eq!((slices, desired.excluded.len()), (32, 8));
    assert_eq!(f.sent("PATCH", &format!("{SLICES}/web-31")).len(), 1);
    assert!(f.sent("PATCH", &format!("{SLICES}/web-32")).is_empty());
}

#[tokio::test]
async fn an_operator_without_an_answer_holds_the_live_slices_marked_stale() {
    let objects = vec![
        our_service("svc-1", "export-1", Some("IPv4")),
        our_slice("web-0", "slice-0", "svc-1", &["192.0.2.1", "192.0.2.2"]),
        our_slice("web-1", "slice-1", "svc-1", &["192.0.2.3"]),
    ];
    let s = spec(json!({"service": "web"}));
    // Nothing answered since the start (Consul down, the token refused), or the resolver
    // cannot be used (its Secret missing): held, whatever the reason.
    let unsynced =
        ServiceEntry { synced: false, index: None, error: Some("connection refused".into()), ..answer(vec![]) };
    let unusable = ExportEntry {
        resolver: None,
        problem: Some("resolver shop/consul cannot be used: Secret shop/token not found".into()),
        resolver_unusable: true,
        ..entry(None)
    };
    for (e, reason) in [(entry(Some(unsynced)), "connection refused"), (unusable, "Secret shop/token not found")] {
        let f = Fixture::new(objects.clone()).await;
        let outcome = apply(&f.ctx, &export(json!({"service": "web"})), &s, &e, Fixture::until()).await.unwrap();
        let Outcome::Held { desired, slices } = outcome else { panic!("not held: {:?}", f.writes()) };
        assert_eq!((desired.endpoint_count(), slices), (3, 2));
        assert!(f.writes().iter().all(|w| w.starts_with("PATCH") && w.contains("endpointslices")), "{:?}", f.writes());
        for (name, n) in [("web-0", 2), ("web-1", 1)] {
            let slice = f.object(&format!("{SLICES}/{name}")).unwrap();
            assert_eq!(slice["endpoints"].as_array().unwrap().len(), n, "{slice}");
            let marks = &slice["metadata"]["annotations"];
            assert!(marks[objects::STALE_SINCE].is_string(), "{slice}");
            assert!(marks[objects::STALE_REASON].as_str().unwrap().contains(reason), "{slice}");
        }
    }
    // The resolver gone (no resolver serves the export): removed, not held.
    let f = Fixture::new(objects.clone()).await;
    let gone = ExportEntry { resolver: None, problem: Some("no ConsulResolver".into()), ..entry(None) };
    let outcome = apply(&f.ctx, &export(json!({"service": "web"})), &s, &gone, Fixture::until()).await.unwrap();
    assert!(matches!(outcome, Outcome::NoResolver(_)));
    assert!(f.object(&format!("{SLICES}/web-0")).is_none() && f.object(&format!("{SLICES}/web-1")).is_none());
    // An answer, even an empty one, is followed.
    let f = Fixture::new(objects).await;
    apply(&f.ctx, &export(json!({"service": "web"})), &s, &entry(Some(answer(vec![]))), Fixture::until())
        .await
        .unwrap();
    assert!(f.object(&format!("{SLICES}/web-0")).is_none(), "{:?}", f.writes());
}

#[tokio::test]
async fn removals_delete_exactly_the_objects_they_mean() {
    let objects = vec![
        our_service("svc-1", "export-1", Some("IPv4")),
        our_slice("web-0", "slice-0", "svc-1", &["192.0.2.1"]),
        // Someone else's slice of ours by label, owned by another Service: not this one's.
        our_slice("web-9", "slice-9", "svc-other", &["192.0.2.9"]),
    ];
    let f = Fixture::new(objects.clone()).await;
    remove(&f.ctx, "shop", "web", "export-1", Fixture::until()).await.unwrap();
    assert_eq!(f.sent("DELETE", &format!("{SLICES}/web-0"))[0]["preconditions"]["uid"], "slice-0");
    assert_eq!(f.sent("DELETE", &format!("{SERVICES}/web"))[0]["preconditions"]["uid"], "svc-1");
    assert!(f.object(&format!("{SLICES}/web-9")).is_some(), "{:?}", f.writes());

    // The export was deleted and created again under the same name: the removal meant for
    // the old one (export-0) touches nothing of the new one's.
    let f = Fixture::new(objects.clone()).await;
    remove(&f.ctx, "shop", "web", "export-0", Fixture::until()).await.unwrap();
    assert!(f.writes().is_empty(), "{:?}", f.writes());

    // A delete that finds another object under the name (replaced meanwhile) is refused by
    // the API server, and that is not an error.
    let f = Fixture::new(objects).await;
    delete_one(&f.ctx, Written::Slice, ("shop", "web-0"), "slice-before", Fixture::until()).await.unwrap();
    assert!(f.object(&format!("{SLICES}/web-0")).is_some());
}

const ENDPOINTS: &str = "/api/v1/namespaces/shop/endpoints/web";

/// Our Endpoints of export `owner`, as the API server holds them.
fn our_endpoints(uid: &str, owner: &str) -> (String, Value) {
    let endpoints = json!({"apiVersion": "v1", "kind": "Endpoints",
        "metadata": {"name": "web", "namespace": "shop", "uid": uid,
            "labels": objects::endpoints_labels("web", "default"),
            "ownerReferences": [objects::owner("consulresolver.io/v1alpha1", "ConsulService", "web", owner)]},
        "subsets": [{"addresses": [{"ip": "192.0.2.1"}], "ports": [{"name": "tcp-8080", "port": 8080, "protocol": "TCP"}]}]});
    (ENDPOINTS.to_owned(), endpoints)
}

#[tokio::test]
async fn endpoints_are_written_only_when_asked_and_not_again_when_unchanged() {
    let e = entry(Some(answer(vec![instance("192.0.2.2", 8080), instance("192.0.2.1", 8080)])));
    // Off (the default): never written.
    let f = Fixture::new(vec![]).await;
    let s = spec(json!({"service": "web"}));
    apply(&f.ctx, &export(json!({"service": "web"})), &s, &e, Fixture::until()).await.unwrap();
    assert!(f.object(ENDPOINTS).is_none() && f.sent("PATCH", ENDPOINTS).is_empty(), "{:?}", f.writes());

    // On: named as the Service, owned by the export as it is, labelled ours and not to be
    // mirrored, both instances ready.
    let on = json!({"service": "web", "endpoints": true});
    apply(&f.ctx, &export(on.clone()), &spec(on.clone()), &e, Fixture::until()).await.unwrap();
    let written = f.object(ENDPOINTS).unwrap();
    let labels = &written["metadata"]["labels"];
    assert_eq!(labels[objects::SKIP_MIRROR], "true");
    assert_eq!((labels[objects::EXPORT].as_str(), labels[objects::INSTANCE].as_str()), (Some("web"), Some("default")));
    let owner = &written["metadata"]["ownerReferences"][0];
    assert_eq!((owner["kind"].as_str(), owner["uid"].as_str()), (Some("ConsulService"), Some("export-1")));
    assert_eq!(owner["controller"], true);
    assert!(owner.get("blockOwnerDeletion").is_none());
    assert_eq!(written["subsets"][0]["addresses"], json!([{"ip": "192.0.2.1"}, {"ip": "192.0.2.2"}]));
    assert_eq!(written["subsets"][0]["ports"], json!([{"name": "tcp-8080", "port": 8080, "protocol": "TCP"}]));
    assert!(written["metadata"]["annotations"].get(objects::OVER_CAPACITY).is_none());

    // The same again: nothing sent.
    apply(&f.ctx, &export(on.clone()), &spec(on), &e, Fixture::until()).await.unwrap();
    assert_eq!(f.sent("PATCH", ENDPOINTS).len(), 1, "{:?}", f.writes());

    // Off again: deleted, exactly the one read.
    let uid = f.object(ENDPOINTS).unwrap()["metadata"]["uid"].as_str().unwrap().to_owned();
    apply(&f.ctx, &export(json!({"service": "web"})), &s, &e, Fixture::until()).await.unwrap();
    assert_eq!(f.sent("DELETE", ENDPOINTS)[0]["preconditions"]["uid"], uid.as_str());
    assert!(f.object(ENDPOINTS).is_none());
}

#[tokio::test]
async fn endpoints_are_held_with_the_slices_and_removed_with_the_export() {
    let objects = vec![
        our_service("svc-1", "export-1", Some("IPv4")),
        our_slice("web-0", "slice-0", "svc-1", &["192.0.2.1", "192.0.2.2"]),
        our_endpoints("ep-1", "export-1"),
    ];
    let on = json!({"service": "web", "endpoints": true});
    let unsynced =
        ServiceEntry { synced: false, index: None, error: Some("connection refused".into()), ..answer(vec![]) };
    let f = Fixture::new(objects.clone()).await;
    let outcome =
        apply(&f.ctx, &export(on.clone()), &spec(on.clone()), &entry(Some(unsynced)), Fixture::until()).await.unwrap();
    assert!(matches!(outcome, Outcome::Held { .. }));
    let held = f.object(ENDPOINTS).unwrap();
    assert_eq!(held["subsets"][0]["addresses"], json!([{"ip": "192.0.2.1"}, {"ip": "192.0.2.2"}]));
    assert!(held["metadata"]["annotations"][objects::STALE_REASON].as_str().unwrap().contains("connection refused"));

    // No resolver: removed with the slices.
    let f = Fixture::new(objects.clone()).await;
    let gone = ExportEntry { resolver: None, problem: Some("no ConsulResolver".into()), ..entry(None) };
    apply(&f.ctx, &export(on.clone()), &spec(on), &gone, Fixture::until()).await.unwrap();
    assert_eq!(f.sent("DELETE", ENDPOINTS)[0]["preconditions"]["uid"], "ep-1");

    // The export gone: its Endpoints go, by uid; those of another incarnation stay.
    let f = Fixture::new(objects.clone()).await;
    remove(&f.ctx, "shop", "web", "export-1", Fixture::until()).await.unwrap();
    assert_eq!(f.sent("DELETE", ENDPOINTS)[0]["preconditions"]["uid"], "ep-1");
    let f = Fixture::new(objects).await;
    remove(&f.ctx, "shop", "web", "export-0", Fixture::until()).await.unwrap();
    assert!(f.object(ENDPOINTS).is_some(), "{:?}", f.writes());
}

#[tokio::test]
async fn someone_elses_endpoints_are_never_deleted() {
    // The Service and its Endpoints are someone else's (a Service with a selector, whose
    // Endpoints the control plane writes): a conflict, and nothing of theirs is touched.
    let (path, mut theirs) = our_endpoints("ep-theirs", "other");
    theirs["metadata"]["labels"] = json!({"app": "web"});
    let service = json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": "shop", "uid": "svc-theirs"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}});
    let f = Fixture::new(vec![(format!("{SERVICES}/web"), service), (path, theirs)]).await;
    let on = json!({"service": "web", "endpoints": true});
    let e = entry(Some(answer(vec![instance("192.0.2.1", 8080)])));
    let outcome = apply(&f.ctx, &export(on.clone()), &spec(on), &e, Fixture::until()).await.unwrap();
    assert!(matches!(outcome, Outcome::Conflict));
    assert!(f.writes().is_empty(), "{:?}", f.writes());
}

/// An operator whose role predates `spec.endpoints` may not read Endpoints: exports that do
/// not ask for them are written and removed as before; one that asks fails, naming them.
#[tokio::test]
async fn exports_without_endpoints_need_no_grant_on_endpoints() {
    let e = entry(Some(answer(vec![instance("192.0.2.1", 8080)])));
    let f = Fixture::new(vec![]).await;
    f.state.lock().unwrap().forbidden = Some(ENDPOINTS.into());
    let off = json!({"service": "web"});
    apply(&f.ctx, &export(off.clone()), &spec(off), &e, Fixture::until()).await.unwrap();
    assert!(f.writes().iter().any(|w| w.starts_with("PATCH /apis/discovery.k8s.io")), "{:?}", f.writes());
    let on = json!({"service": "web", "endpoints": true});
    let Err(refused) = apply(&f.ctx, &export(on.clone()), &spec(on), &e, Fixture::until()).await else {
        panic!("written without a grant on Endpoints");
    };
    assert!(refused.to_string().contains("Endpoints shop/web"), "{refused}");
    let service_uid = f.object(&format!("{SERVICES}/web")).unwrap()["metadata"]["uid"].as_str().unwrap().to_owned();
    remove(&f.ctx, "shop", "web", "export-1", Fixture::until()).await.unwrap();
    assert!(f.object(&format!("{SERVICES}/web")).is_none(), "removed, service uid {service_uid}");
}

/// An export whose objects cannot be written says so on its status (`Exported=False`,
/// `WriteFailed`) and in the per-export metric the alert reads; both clear once written.
#[tokio::test]
async fn a_failing_write_is_measured_per_export_until_it_succeeds() {
    use prometheus::core::Collector;
    let f = Fixture::new(vec![]).await;
    f.state.lock().unwrap().forbidden = Some(format!("{SERVICES}/web"));
    let e = entry(Some(answer(vec![instance("192.0.2.1", 8080)])));
    let job = || job(e.clone());
    let failing =
        |f: &Fixture| f.ctx.metrics.write_failing.get_metric_with_label_values(&["shop", "web"]).unwrap().get();
    let listed = |f: &Fixture| f.ctx.metrics.write_failing.collect()[0].get_metric().len();
    let obj = export(json!({"service": "web"}));
    assert!(reconcile(&f.ctx, &obj, job()).await.is_err());
    assert_eq!((failing(&f), listed(&f)), (1.0, 1));
    let status_path = "/apis/consulresolver.io/v1alpha1/namespaces/shop/consulservices/web/status";
    let said = f.sent("PATCH", status_path).pop().unwrap();
    let exported = said["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Exported").unwrap();
    assert_eq!((exported["status"].as_str(), exported["reason"].as_str()), (Some("False"), Some("WriteFailed")));

    // The grant is back: written, and the series goes.
    f.state.lock().unwrap().forbidden = None;
    reconcile(&f.ctx, &obj, job()).await.unwrap();
    assert!(f.object(&format!("{SERVICES}/web")).is_some(), "{:?}", f.writes());
    assert_eq!(listed(&f), 0);
}

/// A job for export shop/web whose snapshot entry is `e`.
fn job(e: ExportEntry) -> Job<ExportEntry> {
    use crate::controller::Published;
    let published =
        Published { snapshot_id: 1, entries: BTreeMap::from([(("shop".to_owned(), "web".to_owned()), Part::new(e))]) };
    let resource = ApiResource::erase::<ConsulService>(&());
    Job {
        at: kube::runtime::reflector::ObjectRef::new_with("web", resource).within("shop"),
        until: Fixture::until(),
        published: Some(Arc::new(published)),
    }
}

#[tokio::test]
async fn the_exports_labels_and_annotations_are_on_its_service_and_go_when_dropped() {
    let f = Fixture::new(vec![]).await;
    let e = entry(Some(answer(vec![instance("192.0.2.1", 8080)])));
    let path = format!("{SERVICES}/web");
    let with = |team: &str| {
        json!({"service": "web", "serviceLabels": {"team": team},
            "serviceAnnotations": {"external-dns.alpha.kubernetes.io/hostname": format!("{team}.example.com")}})
    };
    reconcile(&f.ctx, &export(with("shop")), job(e.clone())).await.unwrap();
    let service = f.object(&path).unwrap();
    let (labels, annotations) = (&service["metadata"]["labels"], &service["metadata"]["annotations"]);
    assert_eq!(labels["team"], "shop");
    assert_eq!(annotations["external-dns.alpha.kubernetes.io/hostname"], "shop.example.com");
    assert_eq!((labels[objects::EXPORT].as_str(), labels[objects::INSTANCE].as_str()), (Some("web"), Some("default")));

    // The same again: nothing written. A label someone else added is none of ours: it is no
    // reason to write either.
    f.state.lock().unwrap().objects.get_mut(&path).unwrap()["metadata"]["labels"]["added-by"] = json!("someone");
    reconcile(&f.ctx, &export(with("shop")), job(e.clone())).await.unwrap();
    assert_eq!(f.sent("PATCH", &path).len(), 1, "{:?}", f.writes());

    // Changed: written with the new values.
    reconcile(&f.ctx, &export(with("cart")), job(e.clone())).await.unwrap();
    let sent = f.sent("PATCH", &path);
    assert_eq!(sent.len(), 2, "{:?}", f.writes());
    assert_eq!(sent[1]["metadata"]["labels"]["team"], "cart");
    assert_eq!(sent[1]["metadata"]["annotations"]["external-dns.alpha.kubernetes.io/hostname"], "cart.example.com");

    // Dropped from the export: applied without them, which is what removes them.
    reconcile(&f.ctx, &export(json!({"service": "web"})), job(e)).await.unwrap();
    let sent = f.sent("PATCH", &path);
    assert_eq!(sent.len(), 3, "{:?}", f.writes());
    assert!(sent[2]["metadata"]["labels"].get("team").is_none(), "{}", sent[2]);
    assert!(sent[2]["metadata"].get("annotations").is_none(), "{}", sent[2]);
    assert_eq!(sent[2]["metadata"]["labels"][objects::EXPORT], "web");
}

#[tokio::test]
async fn the_operators_own_keys_are_refused_naming_the_key_and_never_override() {
    let e = entry(Some(answer(vec![instance("192.0.2.1", 8080)])));
    let status_path = "/apis/consulresolver.io/v1alpha1/namespaces/shop/consulservices/web/status";
    let cases = [
        ("serviceLabels", objects::EXPORT),
        ("serviceLabels", "app.kubernetes.io/managed-by"),
        ("serviceLabels", objects::SERVICE_NAME),
        ("serviceLabels", "team.consulresolver.io/x"),
        ("serviceAnnotations", objects::STALE_SINCE),
        ("serviceAnnotations", objects::HEADLESS),
    ];
    for (field, key) in cases {
        let f = Fixture::new(vec![]).await;
        let spec = json!({"service": "web", field: {key: "x"}});
        reconcile(&f.ctx, &export(spec), job(e.clone())).await.unwrap();
        assert!(f.sent("PATCH", &format!("{SERVICES}/web")).is_empty(), "{key}: {:?}", f.writes());
        let said = f.sent("PATCH", status_path).pop().unwrap();
        let ready = said["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Ready").unwrap();
        assert_eq!(ready["reason"], "InvalidSpec", "{key}: {said}");
        let message = ready["message"].as_str().unwrap();
        assert!(message.contains(&format!("spec.{field}: key {key:?}")), "{key}: {message}");
    }
    // Keys the operator does not set pass, even beside its own domain or in another one.
    let fine = spec(json!({"service": "web", "serviceLabels": {"consulresolver.io.example/x": "y", "team": "shop"},
        "serviceAnnotations": {"prometheus.io/scrape": "true"}}));
    assert_eq!(objects::refuse_own_keys(&fine), Ok(()));

    // The other way: were an own key to get past the refusal, the operator's value wins and
    // an own annotation is not written at all.
    let forced = spec(json!({"service": "web",
        "serviceLabels": {(objects::EXPORT): "other", (objects::INSTANCE): "other", "team": "shop"},
        "serviceAnnotations": {(objects::STALE_SINCE): "2000-01-01T00:00:00Z"}}));
    let (labels, annotations) = objects::service_metadata(&forced, objects::service_labels("web", "default"));
    assert_eq!(labels.get(objects::EXPORT).map(String::as_str), Some("web"));
    assert_eq!(labels.get(objects::INSTANCE).map(String::as_str), Some("default"));
    assert_eq!(labels.get("team").map(String::as_str), Some("shop"));
    assert!(annotations.is_empty(), "{annotations:?}");
}
