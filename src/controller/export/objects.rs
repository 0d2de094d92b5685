//! The Service, EndpointSlices and Endpoints of an export as the API server holds them:
//! written from the core's plan, and read back into it. `discovery.k8s.io/v1` where served
//! (1.21+), `v1beta1` where only that is (1.20, which has `topology` instead of `zone` and
//! drops the `serving`/`terminating` conditions unless a feature gate is on: read back, an
//! absent condition is its API default, so a server that drops it is not rewritten
//! forever).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};

use crate::kube_client::FIELD_MANAGER;
use consul_resolver_api::export::{ConsulServiceSpec, IpFamily, TrafficDistribution};
use consul_resolver_core::assembler::snapshot::Stale;
use consul_resolver_core::export::endpoints::{EndpointsPlan, Subset};
use consul_resolver_core::export::layout::{LiveSlice, SlicePlan};
use consul_resolver_core::export::{Desired, Port, SliceEndpoint};

/// Label of every slice: how consumers find a Service's slices.
pub(crate) const SERVICE_NAME: &str = "kubernetes.io/service-name";
/// Label of every slice: who manages it. A label value cannot hold `/`, so this is the
/// operator's name under our domain, never the control plane's reserved values.
pub(crate) const MANAGED_BY: &str = "endpointslice.kubernetes.io/managed-by";
pub(crate) const MANAGED_BY_VALUE: &str = "consul-resolver-operator.consulresolver.io";
/// Label of the Service and its slices: the export they belong to.
pub(crate) const EXPORT: &str = "consulresolver.io/export";
/// Label of the Service and its slices: the operator instance (`--ambassador-id`), so two
/// operators in one cluster never list, change or delete each other's.
pub(crate) const INSTANCE: &str = "consulresolver.io/ambassador-id";
/// Annotations of a slice holding endpoints last obtained, not a current answer.
pub(crate) const STALE_SINCE: &str = "consulresolver.io/stale-since";
pub(crate) const STALE_REASON: &str = "consulresolver.io/stale-reason";
/// Annotation of a slice written with zone hints: read back without them, they were
/// dropped by a server whose feature is off, not left out, so the slice is not rewritten.
pub(crate) const ZONE_HINTS: &str = "consulresolver.io/zone-hints";
/// Annotation of a Service written with `spec.trafficDistribution`, its value: read back
/// without the field, it was dropped by a server whose feature gate is off (1.31 and 1.32
/// can turn it off), not left out, so the Service is not rewritten on every pass.
pub(crate) const TRAFFIC_DISTRIBUTION: &str = "consulresolver.io/traffic-distribution";

/// Label of a headless Service's slices: kube-proxy's informers skip slices that carry it
/// (a headless Service has no virtual IP to program), so no node's proxy watches them.
pub(crate) const HEADLESS: &str = "service.kubernetes.io/headless";

/// Label of the export's Endpoints: kube-controller-manager's EndpointSlice mirroring
/// controller copies the Endpoints of every selector-less Service into slices of its own,
/// which would give consumers every address twice; with it, the Endpoints are left alone.
pub(crate) const SKIP_MIRROR: &str = "endpointslice.kubernetes.io/skip-mirror";
/// Annotation of Endpoints cut to `endpoints::MAX_ADDRESSES`, as the control plane's controllers
/// write it.
pub(crate) const OVER_CAPACITY: &str = "endpoints.kubernetes.io/over-capacity";

/// Where v1beta1 keeps an endpoint's zone (v1 has a field of its own).
const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// Which EndpointSlice version the API server serves (discovered once at start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SliceVersion {
    V1,
    V1beta1,
}

impl SliceVersion {
    pub(crate) fn api_version(self) -> &'static str {
        match self {
            SliceVersion::V1 => "discovery.k8s.io/v1",
            SliceVersion::V1beta1 => "discovery.k8s.io/v1beta1",
        }
    }
}

/// The instance label's value: the Ambassador ID when it is a valid label value, else a
/// digest of it (label values are at most 63 of `[A-Za-z0-9_.-]`).
pub(crate) fn instance_value(ambassador_id: &str) -> String {
    let valid = !ambassador_id.is_empty()
        && ambassador_id.len() <= 63
        && ambassador_id.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && ambassador_id.starts_with(|c: char| c.is_ascii_alphanumeric())
        && ambassador_id.ends_with(|c: char| c.is_ascii_alphanumeric());
    if valid {
        return ambassador_id.to_owned();
    }
    use sha2::Digest;
    format!("sha256-{}", &hex::encode(sha2::Sha256::digest(ambassador_id.as_bytes()))[..32])
}

/// Label of the Service and its Endpoints: who manages them, for people and tools.
pub(crate) const APP_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// The operator's own prefix: every key under it (or a subdomain of it) is the operator's.
pub(crate) const OWN_PREFIX: &str = "consulresolver.io";

/// Whether `key` is one the operator sets itself on an export's objects (or may come to
/// set: anything under its own prefix). An export may not put such a key on its Service:
/// it would either be overwritten or, worse, make the Service look like another export's
/// or another operator's, or hide its slices from their consumers.
pub(crate) fn is_own_key(key: &str) -> bool {
    let prefix = key.split_once('/').map(|(p, _)| p);
    let ours = prefix.is_some_and(|p| p == OWN_PREFIX || p.ends_with(&format!(".{OWN_PREFIX}")));
    ours || [APP_MANAGED_BY, SERVICE_NAME, MANAGED_BY, HEADLESS, SKIP_MIRROR, OVER_CAPACITY].contains(&key)
}

/// The export's `serviceLabels` and `serviceAnnotations`, refused when one names a key of
/// the operator's own (the reconcile reports it as `InvalidSpec`).
pub(crate) fn refuse_own_keys(spec: &ConsulServiceSpec) -> Result<(), String> {
    let fields = [("spec.serviceLabels", &spec.service_labels), ("spec.serviceAnnotations", &spec.service_annotations)];
    for (field, map) in fields {
        if let Some(key) = map.iter().flatten().map(|(k, _)| k).find(|k| is_own_key(k)) {
            return Err(format!(
                "{field}: key {key:?} is the operator's own (it sets it, or it is under {OWN_PREFIX}/): use another key"
            ));
        }
    }
    Ok(())
}

/// The operator's labels of an export's Service (and, with one more, of its Endpoints).
pub(crate) fn service_labels(export: &str, instance: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (APP_MANAGED_BY.to_owned(), "consul-resolver-operator".to_owned()),
        (EXPORT.to_owned(), export.to_owned()),
        (INSTANCE.to_owned(), instance.to_owned()),
    ])
}

/// The labels and annotations of the Service: the export's `serviceLabels` and
/// `serviceAnnotations`, with the operator's labels (`own`) over them. An export's key of
/// the operator's own never gets through (such a spec is refused before anything is
/// written; this is the backstop).
pub(crate) fn service_metadata(
    spec: &ConsulServiceSpec,
    own: BTreeMap<String, String>,
) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let theirs = |m: &Option<BTreeMap<String, String>>| -> BTreeMap<String, String> {
        m.iter().flatten().filter(|(k, _)| !is_own_key(k)).map(|(k, v)| (k.clone(), v.clone())).collect()
    };
    let mut labels = theirs(&spec.service_labels);
    labels.extend(own);
    (labels, theirs(&spec.service_annotations))
}

/// Labels of an export's slices (a headless Service's say so).
pub(crate) fn slice_labels(export: &str, instance: &str, headless: bool) -> BTreeMap<String, String> {
    let mut labels = ours(export, instance);
    if headless {
        labels.insert(HEADLESS.to_owned(), String::new());
    }
    labels
}

/// The labels that make a slice ours: found by these, whatever else it carries.
fn ours(export: &str, instance: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (SERVICE_NAME.to_owned(), export.to_owned()),
        (MANAGED_BY.to_owned(), MANAGED_BY_VALUE.to_owned()),
        (EXPORT.to_owned(), export.to_owned()),
        (INSTANCE.to_owned(), instance.to_owned()),
    ])
}

/// The label selector of an export's slices, ours only.
pub(crate) fn slice_selector(export: &str, instance: &str) -> String {
    ours(export, instance).iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

/// Labels of an export's Endpoints: the Service's, and not to be mirrored.
pub(crate) fn endpoints_labels(export: &str, instance: &str) -> BTreeMap<String, String> {
    let mut labels = service_labels(export, instance);
    labels.insert(SKIP_MIRROR.to_owned(), "true".to_owned());
    labels
}

/// An owner reference, as the controller of the object that holds it. Without
/// `blockOwnerDeletion`: setting it needs `update` on the owner's `finalizers` wherever the
/// `OwnerReferencesPermissionEnforcement` admission plugin runs (OpenShift and OKD by
/// default), a grant per tenant namespace for no gain here. The garbage collector deletes
/// dependents either way; the flag only makes a foreground deletion of the owner wait for
/// them, and nobody waits on an export's or Service's foreground deletion.
pub(crate) fn owner(api_version: &str, kind: &str, name: &str, uid: &str) -> Value {
    json!({"apiVersion": api_version, "kind": kind, "name": name, "uid": uid, "controller": true})
}

/// The uid of `obj`'s controller owner, if it has one.
pub(crate) fn controller_uid(obj: &Value) -> Option<&str> {
    obj["metadata"]["ownerReferences"].as_array()?.iter().find(|r| r["controller"] == true)?["uid"].as_str()
}

/// A port of the Service or of a slice, as both write it.
fn port(p: &Port) -> Value {
    let mut port = json!({"name": p.name, "port": p.port, "protocol": p.protocol});
    if let Some(a) = &p.app_protocol {
        port["appProtocol"] = json!(a);
    }
    port
}

/// The export's Service: no selector (so no controller of the cluster fills its
/// endpoints), owned by the export, of one address family, always said: left out, a
/// dual-stack cluster gives the Service its primary family whatever the slices hold (an
/// IPv4 export on an IPv6-primary cluster would get an IPv6 ClusterIP and no traffic), and
/// a selector-less headless Service defaults to `RequireDualStack`. `distribution`: its
/// `spec.trafficDistribution`, only where the server knows the field
/// ([`super::ServerFeatures::service_traffic_distribution`]).
pub(crate) fn service(
    namespace: &str,
    name: &str,
    desired: &Desired,
    (labels, annotations): (&BTreeMap<String, String>, &BTreeMap<String, String>),
    distribution: Option<TrafficDistribution>,
    owner: Value,
) -> Value {
    let ports: Vec<Value> = desired.ports.iter().map(port).collect();
    let mut spec = json!({"type": "ClusterIP", "ports": ports});
    if desired.headless {
        spec["clusterIP"] = json!("None");
    }
    spec["ipFamilyPolicy"] = json!("SingleStack");
    spec["ipFamilies"] = json!([desired.family.as_str()]);
    let mut service = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "ownerReferences": [owner]},
        "spec": spec,
    });
    if !annotations.is_empty() {
        service["metadata"]["annotations"] = json!(annotations);
    }
    if let Some(d) = distribution {
        service["spec"]["trafficDistribution"] = json!(d);
        service["metadata"]["annotations"][TRAFFIC_DISTRIBUTION] = json!(d);
    }
    service
}

/// The keys of `metadata.<field>` (`labels`, `annotations`) the operator's last apply set,
/// from the object's managed fields (`None`: the API server keeps none for it). A key the
/// export no longer asks for is still there until the next apply, which removes it: only
/// this tells such a key from one someone else added.
fn applied_keys(live: &Value, field: &str) -> Option<BTreeSet<String>> {
    let fields = applied_fields(live)?["f:metadata"][format!("f:{field}")].as_object();
    Some(fields.into_iter().flatten().filter_map(|(k, _)| k.strip_prefix("f:").map(str::to_owned)).collect())
}

/// The fields the operator's last apply set (`fieldsV1`), from the object's managed fields
/// (`None`: the API server keeps none for it).
fn applied_fields(live: &Value) -> Option<&Value> {
    let entry = live["metadata"]["managedFields"].as_array()?.iter().find(|e| {
        e["manager"] == FIELD_MANAGER
            && e["operation"] == "Apply"
            && e.get("subresource").is_none_or(|s| s.is_null() || s == "")
    })?;
    Some(&entry["fieldsV1"])
}

/// Whether the live Service's `spec.trafficDistribution` is as `want` has it.
fn traffic_distribution_matches(live: &Value, want: &Value) -> bool {
    let (held, wanted) = (&live["spec"]["trafficDistribution"], &want["spec"]["trafficDistribution"]);
    if !wanted.is_null() {
        // Written with it and read back without it: dropped by a server with the gate off.
        let dropped = held.is_null() && live["metadata"]["annotations"][TRAFFIC_DISTRIBUTION] == *wanted;
        return held == wanted || dropped;
    }
    // Not wanted (not asked, or a server without the field, where it is never held): one
    // the operator's last apply set is removed by the next apply, which leaves it out. One
    // someone else set is theirs: an apply cannot remove it, so it is no difference.
    let theirs = applied_fields(live).is_some_and(|f| f["f:spec"].get("f:trafficDistribution").is_none());
    held.is_null() || theirs
}

/// Whether the live Service holds every label and annotation of `want`, and the operator's
/// last apply set no other.
fn metadata_matches(live: &Value, want: &Value) -> bool {
    ["labels", "annotations"].iter().all(|field| {
        let wanted = want["metadata"][field].as_object();
        let held = wanted.into_iter().flatten().all(|(k, v)| live["metadata"][field][k] == *v);
        let keys: BTreeSet<String> = wanted.into_iter().flatten().map(|(k, _)| k.clone()).collect();
        held && applied_keys(live, field).is_none_or(|applied| applied == keys)
    })
}

/// Whether the live Service already is what [`service`] would write (so nothing is sent).
pub(crate) fn service_matches(live: &Value, want: &Value) -> bool {
    let labels_ok = metadata_matches(live, want);
    let owner_ok = live["metadata"]["ownerReferences"].as_array().is_some_and(|o| {
        o.iter().any(|r| r["uid"] == want["metadata"]["ownerReferences"][0]["uid"] && r["controller"] == true)
    });
    let port = |p: &Value| {
        (
            p["name"].clone(),
            p["port"].clone(),
            p.get("protocol").cloned().unwrap_or(json!("TCP")),
            p.get("appProtocol").cloned(),
        )
    };
    let ports =
        |s: &Value| s["spec"]["ports"].as_array().map(|ps| ps.iter().map(port).collect::<Vec<_>>()).unwrap_or_default();
    let selectorless =
        live["spec"].get("selector").is_none_or(|s| s.is_null() || s.as_object().is_some_and(|m| m.is_empty()));
    // A server that does not know the dual-stack fields (1.20 without its feature gate)
    // drops them: absent is not a difference (it would be written again forever).
    let policy_ok =
        live["spec"].get("ipFamilyPolicy").is_none_or(|p| p.is_null() || *p == want["spec"]["ipFamilyPolicy"]);
    let families_ok = live["spec"].get("ipFamilies").is_none_or(|f| f.is_null() || *f == want["spec"]["ipFamilies"]);
    labels_ok
        && owner_ok
        && selectorless
        && policy_ok
        && families_ok
        && traffic_distribution_matches(live, want)
        && ports(live) == ports(want)
        && is_headless(live) == is_headless(want)
}

pub(crate) fn is_headless(service: &Value) -> bool {
    service["spec"]["clusterIP"] == "None"
}

/// Whether the live Service must be replaced to become `want`: its clusterIP (headless or
/// not) and its primary address family cannot change in place.
pub(crate) fn needs_replace(live: &Value, want: &Value) -> bool {
    let primary = |s: &Value| s["spec"]["ipFamilies"][0].as_str().map(str::to_owned);
    let family_changed = primary(live).is_some_and(|f| Some(f) != primary(want));
    is_headless(live) != is_headless(want) || family_changed
}

/// One slice of the plan, as written.
pub(crate) fn slice(
    version: SliceVersion,
    namespace: &str,
    plan: &SlicePlan,
    desired: &Desired,
    labels: &BTreeMap<String, String>,
    owner: Value,
) -> Value {
    let mut annotations = serde_json::Map::new();
    if let Some(s) = &desired.stale {
        annotations.insert(STALE_SINCE.into(), json!(s.since));
        annotations.insert(STALE_REASON.into(), json!(s.reason));
    }
    // `hints` is in both slice versions from 1.21; v1beta1 is written only to 1.20, which
    // refuses it under server-side apply.
    let hints = version == SliceVersion::V1 && plan.hinted();
    if hints {
        annotations.insert(ZONE_HINTS.into(), json!("true"));
    }
    let endpoints: Vec<Value> = plan
        .endpoints
        .iter()
        .map(|e| {
            let mut endpoint = json!({"addresses": [e.address],
                   "conditions": {"ready": e.ready, "serving": e.serving, "terminating": false}});
            if let Some(zone) = &e.zone {
                match version {
                    SliceVersion::V1 => endpoint["zone"] = json!(zone),
                    SliceVersion::V1beta1 => endpoint["topology"] = json!({ZONE_LABEL: zone}),
                }
            }
            if let Some(hint) = e.hint.as_ref().filter(|_| hints) {
                endpoint["hints"] = json!({"forZones": [{"name": hint}]});
            }
            endpoint
        })
        .collect();
    let ports: Vec<Value> = plan.ports.iter().map(port).collect();
    json!({
        "apiVersion": version.api_version(), "kind": "EndpointSlice",
        "metadata": {"name": plan.name, "namespace": namespace, "labels": labels,
                     "annotations": annotations, "ownerReferences": [owner]},
        "addressType": desired.family.as_str(),
        "ports": ports,
        "endpoints": endpoints,
    })
}

/// The export's Endpoints (named as its Service), as the plan says; owned by the export
/// as the Service is.
pub(crate) fn endpoints(
    namespace: &str,
    name: &str,
    plan: &EndpointsPlan,
    labels: &BTreeMap<String, String>,
    owner: Value,
) -> Value {
    let mut annotations = serde_json::Map::new();
    if plan.truncated {
        annotations.insert(OVER_CAPACITY.into(), json!("truncated"));
    }
    if let Some(s) = &plan.stale {
        annotations.insert(STALE_SINCE.into(), json!(s.since));
        annotations.insert(STALE_REASON.into(), json!(s.reason));
    }
    let ips = |list: &[String]| list.iter().map(|a| json!({"ip": a})).collect::<Vec<_>>();
    let subsets: Vec<Value> = plan
        .subsets
        .iter()
        .map(|s| {
            let mut subset = json!({"ports": s.ports.iter().map(port).collect::<Vec<_>>()});
            if !s.ready.is_empty() {
                subset["addresses"] = json!(ips(&s.ready));
            }
            if !s.not_ready.is_empty() {
                subset["notReadyAddresses"] = json!(ips(&s.not_ready));
            }
            subset
        })
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Endpoints",
        "metadata": {"name": name, "namespace": namespace, "labels": labels,
                     "annotations": annotations, "ownerReferences": [owner]},
        "subsets": subsets,
    })
}

/// Live Endpoints in the plan's terms (the order of each list not kept).
pub(crate) fn live_endpoints(obj: &Value) -> EndpointsPlan {
    let ips = |list: &Value| -> Vec<String> {
        list.as_array().into_iter().flatten().filter_map(|a| a["ip"].as_str().map(str::to_owned)).collect()
    };
    let subsets = obj["subsets"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| Subset {
            ports: read_ports(&s["ports"]),
            ready: ips(&s["addresses"]),
            not_ready: ips(&s["notReadyAddresses"]),
        })
        .collect();
    let annotation = |k: &str| obj["metadata"]["annotations"][k].as_str().map(str::to_owned);
    let stale = match (annotation(STALE_SINCE), annotation(STALE_REASON)) {
        (Some(since), Some(reason)) => Some(Stale { since, reason }),
        _ => None,
    };
    let truncated = annotation(OVER_CAPACITY).is_some();
    EndpointsPlan { subsets, truncated, stale }.normalized()
}

/// Whether the live Endpoints already are what [`endpoints`] would write for `plan` (so
/// nothing is sent): the same content, our labels, owned by the export `owner_uid`.
pub(crate) fn endpoints_match(
    live: &Value,
    plan: &EndpointsPlan,
    labels: &BTreeMap<String, String>,
    owner_uid: &str,
) -> bool {
    let labels_ok = labels.iter().all(|(k, v)| live["metadata"]["labels"][k].as_str() == Some(v.as_str()));
    labels_ok && controller_uid(live) == Some(owner_uid) && live_endpoints(live) == plan.normalized()
}

/// Ports as the Service, a slice and a subset write them, read back.
fn read_ports(ports: &Value) -> Vec<Port> {
    ports
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| Port {
            name: p["name"].as_str().unwrap_or_default().to_owned(),
            port: p["port"].as_u64().and_then(|n| u16::try_from(n).ok()).unwrap_or(0),
            protocol: match p["protocol"].as_str() {
                Some("UDP") => "UDP",
                Some("SCTP") => "SCTP",
                _ => "TCP",
            },
            app_protocol: p["appProtocol"].as_str().map(str::to_owned),
        })
        .collect()
}

/// A live slice in the plan's terms; `intact` when its labels and owner are ours as
/// [`slice`] writes them.
pub(crate) fn live_slice(obj: &Value, labels: &BTreeMap<String, String>, owner_uid: Option<&str>) -> LiveSlice {
    let family = match obj["addressType"].as_str() {
        Some("IPv4") => Some(IpFamily::IPv4),
        Some("IPv6") => Some(IpFamily::IPv6),
        _ => None,
    };
    let ports = read_ports(&obj["ports"]);
    let endpoints = obj["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let address = e["addresses"].as_array()?.first()?.as_str()?.to_owned();
            let c = &e["conditions"];
            let zone = e["zone"].as_str().or_else(|| e["topology"][ZONE_LABEL].as_str()).map(str::to_owned);
            let for_zones: Vec<&str> =
                e["hints"]["forZones"].as_array().into_iter().flatten().filter_map(|z| z["name"].as_str()).collect();
            Some(SliceEndpoint {
                address,
                ready: c["ready"].as_bool().unwrap_or(true),
                serving: c["serving"].as_bool().unwrap_or(c["ready"].as_bool().unwrap_or(true)),
                zone,
                // Never more than one of ours; someone else's list is a difference.
                hint: (!for_zones.is_empty()).then(|| for_zones.join(",")),
            })
        })
        .collect();
    let annotation = |k: &str| obj["metadata"]["annotations"][k].as_str().map(str::to_owned);
    let stale = match (annotation(STALE_SINCE), annotation(STALE_REASON)) {
        (Some(since), Some(reason)) => Some(Stale { since, reason }),
        _ => None,
    };
    let labels_ok = labels.iter().all(|(k, v)| obj["metadata"]["labels"][k].as_str() == Some(v.as_str()));
    let owner_ok = owner_uid.is_some_and(|uid| {
        obj["metadata"]["ownerReferences"]
            .as_array()
            .is_some_and(|o| o.iter().any(|r| r["uid"] == uid && r["controller"] == true))
    });
    LiveSlice {
        name: obj["metadata"]["name"].as_str().unwrap_or_default().to_owned(),
        family,
        ports,
        endpoints,
        stale,
        hinted: annotation(ZONE_HINTS).is_some(),
        intact: labels_ok && owner_ok,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::export::ServerFeatures;
    use consul_resolver_api::export::ConsulServiceSpec;
    use consul_resolver_core::assembler::snapshot::ServiceEntry;
    use consul_resolver_core::export::{endpoints, layout};
    use consul_resolver_core::model::{Endpoint, Health};

    fn desired() -> Desired {
        let spec: ConsulServiceSpec = serde_json::from_value(json!({"service": "web",
            "ports": [{"name": "http", "port": 80, "appProtocol": "http"}]}))
        .unwrap();
        let ep = |a: &str| Endpoint {
            address: a.into(),
            port: 8080,
            node: "n".into(),
            service_id: a.into(),
            tags: vec![],
            meta: Default::default(),
            health: Health::Passing,
            zone: (a == "10.0.0.1").then(|| "zone-a".to_owned()),
            weight: None,
        };
        let entry = ServiceEntry {
            name: "web".into(),
            synced: true,
            index: Some(1),
            error: None,
            stale: Some(Stale { since: "2026-11-25T00:00:00Z".into(), reason: "Consul unreachable".into() }),
            endpoints: vec![ep("10.0.0.2"), ep("10.0.0.1")].into(),
        };
        Desired::of(&spec, Some(&entry))
    }

    #[test]
    fn a_written_slice_reads_back_as_the_plan_so_it_is_not_written_again() {
        let d = desired();
        let plan = layout::plan("web", &d, &[]);
        let labels = slice_labels("web", "default", false);
        for version in [SliceVersion::V1, SliceVersion::V1beta1] {
            let written = slice(version, "shop", &plan.slices[0], &d, &labels, owner("v1", "Service", "web", "u-1"));
            assert_eq!(written["addressType"], "IPv4");
            assert_eq!(written["metadata"]["labels"][SERVICE_NAME], "web");
            assert_eq!(written["metadata"]["labels"][MANAGED_BY], MANAGED_BY_VALUE);
            assert_eq!(
                written["ports"][0],
                json!({"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"})
            );
            assert_eq!(written["endpoints"][0]["addresses"], json!(["10.0.0.1"]));
            let zone = match version {
                SliceVersion::V1 => &written["endpoints"][0]["zone"],
                SliceVersion::V1beta1 => &written["endpoints"][0]["topology"][ZONE_LABEL],
            };
            assert_eq!(zone, "zone-a");
            assert!(written["endpoints"][1].get("zone").is_none() && written["endpoints"][1].get("topology").is_none());
            assert!(written["endpoints"][0].get("nodeName").is_none(), "a Consul node is not a Kubernetes Node");
            let live = live_slice(&written, &labels, Some("u-1"));
            assert!(live.intact);
            let again = layout::plan("web", &d, &[live]);
            assert!(again.write.is_empty(), "{again:?}");
        }
        // A 1.20 server without the gate drops `serving`: read back as ready.
        let mut dropped =
            slice(SliceVersion::V1beta1, "shop", &plan.slices[0], &d, &labels, owner("v1", "Service", "web", "u-1"));
        dropped["endpoints"][0]["conditions"] = json!({"ready": true});
        dropped["endpoints"][1]["conditions"] = json!({"ready": true});
        assert!(layout::plan("web", &d, &[live_slice(&dropped, &labels, Some("u-1"))]).write.is_empty());
        // Someone else's owner, or a label changed: not intact.
        assert!(!live_slice(&dropped, &labels, Some("u-2")).intact);
    }

    #[test]
    fn zone_hints_are_written_to_v1_only_and_dropped_ones_are_not_rewritten() {
        let spec: ConsulServiceSpec =
            serde_json::from_value(json!({"service": "web", "trafficDistribution": "PreferClose"})).unwrap();
        let ep = |a: &str, zone: &str| Endpoint {
            zone: Some(zone.into()),
            weight: None,
            ..consul_resolver_core::test_support::endpoint(a, 8080)
        };
        let entry = ServiceEntry {
            name: "web".into(),
            synced: true,
            index: Some(1),
            error: None,
            stale: None,
            endpoints: vec![ep("10.0.0.1", "zone-a"), ep("10.0.0.2", "zone-b")].into(),
        };
        let d = Desired::of(&spec, Some(&entry));
        let plan = layout::plan("web", &d, &[]);
        let labels = slice_labels("web", "default", false);
        let owner = || owner("v1", "Service", "web", "u-1");
        let written = slice(SliceVersion::V1, "shop", &plan.slices[0], &d, &labels, owner());
        assert_eq!(written["endpoints"][1]["hints"], json!({"forZones": [{"name": "zone-b"}]}));
        assert_eq!(written["metadata"]["annotations"][ZONE_HINTS], "true");
        let live = live_slice(&written, &labels, Some("u-1"));
        assert!(live.hinted && live.endpoints[0].hint.as_deref() == Some("zone-a"));
        assert!(layout::plan("web", &d, &[live]).write.is_empty());
        // A server with the feature off drops them: not written again.
        let mut dropped = written.clone();
        for e in dropped["endpoints"].as_array_mut().unwrap() {
            e.as_object_mut().unwrap().remove("hints");
        }
        assert!(layout::plan("web", &d, &[live_slice(&dropped, &labels, Some("u-1"))]).write.is_empty());
        // v1beta1 (1.20) never carries them.
        let beta = slice(SliceVersion::V1beta1, "shop", &plan.slices[0], &d, &labels, owner());
        assert!(beta["endpoints"].as_array().unwrap().iter().all(|e| e.get("hints").is_none()));
        assert!(beta["metadata"]["annotations"].get(ZONE_HINTS).is_none());
    }

    #[test]
    fn the_service_has_no_selector_and_matches_itself_only() {
        let d = desired();
        let labels = service_labels("web", "default");
        let want = service(
            "shop",
            "web",
            &d,
            (&labels, &BTreeMap::new()),
            None,
            owner("consulresolver.io/v1alpha1", "ConsulService", "web", "u-1"),
        );
        assert!(want["spec"].get("selector").is_none());
        let mut live = want.clone();
        live["spec"]["clusterIP"] = json!("10.0.0.7");
        live["spec"]["ports"][0]["targetPort"] = json!(80);
        assert!(service_matches(&live, &want));
        live["spec"]["selector"] = json!({"app": "web"});
        assert!(!service_matches(&live, &want));
    }

    /// The export's Service for `asked` (its `spec.trafficDistribution`) on a server with
    /// `features`.
    fn service_for(features: ServerFeatures, asked: Option<TrafficDistribution>) -> Value {
        let (d, labels) = (desired(), service_labels("web", "default"));
        let distribution = features.service_traffic_distribution(asked);
        let owner = owner("consulresolver.io/v1alpha1", "ConsulService", "web", "u-1");
        service("shop", "web", &d, (&labels, &BTreeMap::new()), distribution, owner)
    }

    #[test]
    fn the_services_traffic_distribution_is_written_only_where_asked_and_known() {
        let (known, old) = (ServerFeatures { service_traffic_distribution: true }, ServerFeatures::default());
        let asked = Some(TrafficDistribution::PreferClose);
        let wanted = service_for(known, asked);
        assert_eq!(wanted["spec"]["trafficDistribution"], "PreferClose");
        assert_eq!(wanted["metadata"]["annotations"][TRAFFIC_DISTRIBUTION], "PreferClose");
        // Asked on a server without the field (1.20), or not asked: neither is written.
        for unwritten in [service_for(old, asked), service_for(known, None)] {
            assert!(unwritten["spec"].get("trafficDistribution").is_none(), "{unwritten}");
            assert!(unwritten["metadata"].get("annotations").is_none(), "{unwritten}");
        }
    }

    #[test]
    fn the_services_traffic_distribution_is_rewritten_both_ways_but_never_for_a_server_without_it() {
        let known = ServerFeatures { service_traffic_distribution: true };
        let asked = Some(TrafficDistribution::PreferClose);
        let (wanted, unasked) = (service_for(known, asked), service_for(known, None));
        assert!(service_matches(&wanted, &wanted) && service_matches(&unasked, &unasked));
        // Absent but wanted (written before the export asked): written again.
        assert!(!service_matches(&unasked, &wanted));
        // Present but no longer wanted: written again, which removes it.
        assert!(!service_matches(&wanted, &unasked));
        // A server without the field (1.20): asked, never written nor held, no difference.
        let on_old = service_for(ServerFeatures::default(), asked);
        assert!(service_matches(&on_old, &on_old));
        // Written with it, read back without it (a 1.31 or 1.32 server with the gate off
        // drops it): no difference, or it would be written on every pass.
        let mut dropped = wanted.clone();
        dropped["spec"].as_object_mut().unwrap().remove("trafficDistribution");
        assert!(service_matches(&dropped, &wanted));
    }

    #[test]
    fn a_traffic_distribution_someone_else_set_is_left_alone() {
        let known = ServerFeatures { service_traffic_distribution: true };
        let unasked = service_for(known, None);
        let mut theirs = unasked.clone();
        theirs["spec"]["trafficDistribution"] = json!("PreferClose");
        let labels: serde_json::Map<String, Value> =
            service_labels("web", "default").into_keys().map(|k| (format!("f:{k}"), json!({}))).collect();
        let applied = |spec: Value| {
            json!([{"manager": FIELD_MANAGER, "operation": "Apply", "apiVersion": "v1",
                "fieldsV1": {"f:metadata": {"f:labels": labels}, "f:spec": spec}}])
        };
        // The operator's last apply did not set it: an apply cannot remove it.
        theirs["metadata"]["managedFields"] = applied(json!({"f:ports": {}}));
        assert!(service_matches(&theirs, &unasked));
        // It did: the next apply leaves it out, and so removes it.
        theirs["metadata"]["managedFields"] = applied(json!({"f:ports": {}, "f:trafficDistribution": {}}));
        assert!(!service_matches(&theirs, &unasked));
    }

    #[test]
    fn a_headless_services_slices_say_so_and_are_still_found_by_our_labels() {
        let labels = slice_labels("web", "default", true);
        assert_eq!(labels.get(HEADLESS).map(String::as_str), Some(""));
        assert!(!slice_labels("web", "default", false).contains_key(HEADLESS));
        // Listed by the labels every slice of ours has, headless or not.
        assert!(!slice_selector("web", "default").contains(HEADLESS));
        // A slice written before the Service became headless lacks the label: not intact,
        // so it is written again.
        let d = desired();
        let plan = layout::plan("web", &d, &[]);
        let owner = owner("v1", "Service", "web", "u-1");
        let plain = slice(SliceVersion::V1, "shop", &plan.slices[0], &d, &slice_labels("web", "default", false), owner);
        assert!(!live_slice(&plain, &labels, Some("u-1")).intact);
    }

    #[test]
    fn written_endpoints_read_back_as_the_plan_and_say_when_they_are_truncated() {
        let d = desired();
        let labels = endpoints_labels("web", "default");
        assert_eq!(labels.get(SKIP_MIRROR).map(String::as_str), Some("true"));
        let owner = || owner("consulresolver.io/v1alpha1", "ConsulService", "web", "u-1");
        let mut plan = endpoints::plan(&d);
        plan.subsets[0].not_ready = vec!["10.0.0.9".into()];
        let written = endpoints("shop", "web", &plan, &labels, owner());
        assert_eq!(written["subsets"][0]["addresses"], json!([{"ip": "10.0.0.1"}, {"ip": "10.0.0.2"}]));
        assert_eq!(written["subsets"][0]["notReadyAddresses"], json!([{"ip": "10.0.0.9"}]));
        assert_eq!(
            written["subsets"][0]["ports"][0],
            json!({"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "http"})
        );
        assert!(written["metadata"]["annotations"].get(OVER_CAPACITY).is_none());
        assert!(written["metadata"]["annotations"][STALE_SINCE].is_string(), "held as the slices are");
        assert!(endpoints_match(&written, &plan, &labels, "u-1"));
        // Another owner, a label gone, or the content changed: written again.
        assert!(!endpoints_match(&written, &plan, &labels, "u-2"));
        let mut unlabelled = written.clone();
        unlabelled["metadata"]["labels"].as_object_mut().unwrap().remove(SKIP_MIRROR);
        assert!(!endpoints_match(&unlabelled, &plan, &labels, "u-1"));
        let mut cut = plan.clone();
        cut.truncated = true;
        assert!(!endpoints_match(&written, &cut, &labels, "u-1"));
        let truncated = endpoints("shop", "web", &cut, &labels, owner());
        assert_eq!(truncated["metadata"]["annotations"][OVER_CAPACITY], "truncated");
        assert!(endpoints_match(&truncated, &cut, &labels, "u-1"));
        // The same addresses in another order are no difference.
        let mut reordered = written.clone();
        reordered["subsets"][0]["addresses"] = json!([{"ip": "10.0.0.2"}, {"ip": "10.0.0.1"}]);
        assert!(endpoints_match(&reordered, &plan, &labels, "u-1"));
    }

    #[test]
    fn instance_values_are_valid_labels() {
        assert_eq!(instance_value("default"), "default");
        let odd = instance_value("team a/prod");
        assert!(odd.starts_with("sha256-") && odd.len() <= 63);
    }
}
