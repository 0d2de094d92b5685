//! Exports with the cluster's own controllers: a real kube-controller-manager (1.20.2) runs
//! the garbage collector, the namespace controller and the EndpointSlice mirroring
//! controller against this binary's own control plane. Only here: elsewhere its garbage
//! collector would hide the operator's own deletions, which clusters without one rely on
//! (e2e/tests/export.rs tests those).
//!
//! The API server enforces owner references as OpenShift does
//! (`OwnerReferencesPermissionEnforcement`): the owner references the garbage collector
//! follows are the ones the shipped RBAC lets the operator write.

use std::time::Duration;

use e2e::consul::{Consul, Instance};
use e2e::fixtures::{export_yaml, resolver_yaml, slices};
use e2e::harness::{Cluster, ControllerManager, Operator, unique, wait_for};

const T: Duration = Duration::from_secs(60);
const SLICES: &str = "endpointslices.v1beta1.discovery.k8s.io";
const CONTROLLERS: &str = "garbagecollector,namespace,endpointslicemirroring";

/// A namespace with exports granted, a resolver, and an export `web` of a service with two
/// instances, exported by `op`.
fn exported(cluster: &Cluster, consul: &Consul, prefix: &str) -> (String, Operator) {
    let ns = cluster.namespace(prefix).unwrap();
    cluster.grant_exports(&ns).unwrap();
    cluster.apply(&resolver_yaml(&ns, "consul", &consul.address(), "")).unwrap();
    let svc = format!("web{}", unique());
    let instances: Vec<Instance> = (0..2)
        .map(|i| Instance {
            node: format!("node-{svc}-{i}"),
            address: format!("192.0.2.{}", i + 1),
            service: svc.clone(),
            id: format!("{svc}-{i}"),
            port: 8080,
            status: "passing".into(),
            ..Instance::default()
        })
        .collect();
    consul.register_many(&instances, 2).unwrap();
    cluster.apply(&export_yaml(&ns, "web", &svc, "consul", "")).unwrap();
    let op = Operator::start(cluster, &["--namespace", &ns]).unwrap();
    wait_for("exported", T, || {
        let found = slices(cluster, &ns, "web");
        (found.values().map(|s| s["endpoints"].as_array().map_or(0, Vec::len)).sum::<usize>() == 2).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    (ns, op)
}

/// A Service deleted by hand (with no operator to write it again) takes its slices with it:
/// they are owned by it, and the garbage collector follows owner references the operator
/// could write under owner-reference enforcement. The mirroring controller, which copies
/// the Endpoints of selector-less Services into slices of its own, finds nothing to copy.
#[test]
#[cfg_attr(e2e_external_cluster, ignore = "starts a kube-controller-manager: needs the cluster the tests start")]
fn a_service_deleted_by_hand_takes_its_slices_through_the_garbage_collector() {
    let (cluster, consul) = (Cluster::shared(), Consul::shared());
    let kcm = ControllerManager::start(cluster, CONTROLLERS).unwrap();
    let (ns, mut op) = exported(cluster, consul, "gc-service");
    op.terminate(T).unwrap();
    assert!(!slices(cluster, &ns, "web").is_empty());
    let mirrored = |cluster: &Cluster| {
        let out = cluster
            .kubectl(&[
                "-n",
                &ns,
                "get",
                SLICES,
                "-l",
                "endpointslice.kubernetes.io/managed-by=endpointslice-mirroring-controller.k8s.io",
                "-o",
                "name",
            ])
            .unwrap_or_default();
        out.trim().to_owned()
    };
    assert_eq!(mirrored(cluster), "", "no Endpoints of ours, so nothing mirrored");

    cluster.kubectl(&["-n", &ns, "delete", "service", "web"]).unwrap();
    wait_for("the slices garbage-collected with their Service", T, || {
        slices(cluster, &ns, "web").is_empty().then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", kcm.logs()));
}

/// Deleting a namespace with an export, the operator running: the namespace controller
/// deletes the export, the garbage collector and the operator its Service and slices, and
/// the namespace goes, with nothing left behind.
#[test]
#[cfg_attr(e2e_external_cluster, ignore = "starts a kube-controller-manager: needs the cluster the tests start")]
fn deleting_a_namespace_with_exports_leaves_nothing_behind() {
    let (cluster, consul) = (Cluster::shared(), Consul::shared());
    let kcm = ControllerManager::start(cluster, CONTROLLERS).unwrap();
    let (ns, mut op) = exported(cluster, consul, "gc-namespace");
    cluster.kubectl(&["delete", "namespace", &ns, "--wait=false"]).unwrap();
    wait_for("the namespace gone", Duration::from_secs(180), || {
        let out = cluster.kubectl(&["get", "namespace", &ns, "-o", "name"]);
        out.is_err().then_some(())
    })
    .unwrap_or_else(|e| {
        let left = cluster.kubectl(&["-n", &ns, "get", "all,consulservices,endpointslices", "-o", "name"]);
        panic!("{e}: left {left:?}\n{}\n{}", op.logs(), kcm.logs())
    });
    for kind in ["consulservices", "services", SLICES] {
        let left = cluster.kubectl(&["-n", &ns, "get", kind, "-o", "name"]).unwrap_or_default();
        assert_eq!(left.trim(), "", "{kind} left in {ns}");
    }
    assert!(op.get("/healthz").is_some_and(|(code, _)| code == 200), "the operator lives on\n{}", op.logs());
    op.terminate(T).unwrap();
}
