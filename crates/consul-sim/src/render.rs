//! JSON shapes of the answers, in two flavours.
//!
//! The modern flavour is what current agents send: empty maps as `{}`, empty lists as `[]`,
//! plus fields that older agents lack (`Kind`, `Proxy`, `Connect`, `PeerName`, check `Type`,
//! ...) so that client parsers meet unknown fields. The legacy flavour (`null_variants`) is
//! what older agents send: `null` for empty `Meta`, `TaggedAddresses` and `Tags`, and none of
//! the newer fields. Clients must parse both.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde::Serialize;
use serde_json::{Value, json};

use super::catalog::{Check, HealthEntry, Node, ProxyConfig, ServiceInstance, ServiceKey, StateEntry, TaggedAddress};

fn tags(tags: &[String], legacy: bool) -> Value {
    if tags.is_empty() && legacy {
        return Value::Null;
    }
    json!(tags)
}

/// The body of `GET /v1/health/service/<name>` and `GET /v1/health/connect/<name>`.
///
/// Serialised straight from the catalog's values, as [`checks`] is: a `Value` tree per row
/// (every string copied, every map a B-tree) was most of a read's time. At the scale
/// profile's cold start the benchmark's process, three quarters of it in these reads, used
/// more CPU than the operator (3.7 to 8.8 s in the runs measured, against 3.0 to 3.5 s) on
/// the two cores they share with the API server. The fields are in the order `health_json`
/// (a `Value`, keys sorted) gives them; a test holds the two equal.
pub(crate) fn health(entries: &[HealthEntry], legacy: bool) -> Vec<u8> {
    let rows: Vec<HealthOut<'_>> = entries.iter().map(|e| HealthOut::of(e, legacy)).collect();
    serde_json::to_vec(&rows).expect("health rows serialise")
}

/// One row of a health answer (see `health_json`).
#[derive(Serialize)]
#[serde(rename_all = "PascalCase")]
struct HealthOut<'a> {
    checks: Vec<CheckOut<'a>>,
    node: NodeOut<'a>,
    service: ServiceOut<'a>,
}

impl<'a> HealthOut<'a> {
    fn of(e: &'a HealthEntry, legacy: bool) -> Self {
        let s = &e.service;
        HealthOut {
            checks: e
                .checks
                .iter()
                .map(|c| {
                    let owner = (!c.service_id.is_empty()).then_some((&s.key, s.tags.as_slice()));
                    CheckOut::new(c, owner, legacy)
                })
                .collect(),
            node: NodeOut::of(&e.node, legacy),
            service: ServiceOut::of(s, e.peer.as_deref(), legacy),
        }
    }
}

/// The body of `GET /v1/catalog/nodes`: every node, as health answers show them.
pub(crate) fn nodes(nodes: &[Arc<Node>], legacy: bool) -> Vec<u8> {
    let rows: Vec<NodeOut<'_>> = nodes.iter().map(|n| NodeOut::of(n, legacy)).collect();
    serde_json::to_vec(&rows).expect("nodes serialise")
}

/// The body of `GET /v1/catalog/node-services/<node>`: the node and its instances, as
/// health answers show them, or `{"Node": null, "Services": null}` for a node that does not
/// exist (as Consul 1.8 answers it).
pub(crate) fn node_services(found: Option<(&Node, &[Arc<ServiceInstance>])>, legacy: bool) -> Vec<u8> {
    #[derive(Serialize)]
    #[serde(rename_all = "PascalCase")]
    struct NodeServicesOut<'a> {
        node: Option<NodeOut<'a>>,
        services: Option<Vec<ServiceOut<'a>>>,
    }
    let out = NodeServicesOut {
        node: found.map(|(n, _)| NodeOut::of(n, legacy)),
        services: found.map(|(_, services)| services.iter().map(|s| ServiceOut::of(s, None, legacy)).collect()),
    };
    serde_json::to_vec(&out).expect("node services serialise")
}

impl<'a> NodeOut<'a> {
    fn of(n: &'a Node, legacy: bool) -> Self {
        NodeOut {
            address: &n.address,
            create_index: n.create_index,
            datacenter: &n.datacenter,
            id: &n.id,
            meta: string_map_out(&n.meta, legacy),
            modify_index: n.modify_index,
            node: &n.name,
            tagged_addresses: string_map_out(&n.tagged_addresses, legacy),
        }
    }
}

impl<'a> ServiceOut<'a> {
    fn of(s: &'a ServiceInstance, peer: Option<&'a str>, legacy: bool) -> Self {
        let modern = !legacy;
        let scoped = Some(&s.key).filter(|k| !k.is_default_scope());
        ServiceOut {
            address: &s.address,
            connect: modern.then_some(Empty {}),
            create_index: s.create_index,
            enable_tag_override: s.enable_tag_override,
            id: &s.id,
            kind: modern.then_some(s.kind.as_str()),
            locality: s.locality.as_ref().filter(|_| modern).map(|l| LocalityOut { region: &l.region, zone: &l.zone }),
            meta: string_map_out(&s.meta, legacy),
            modify_index: s.modify_index,
            namespace: scoped.map(|k| k.namespace.as_str()),
            partition: scoped.map(|k| k.partition.as_str()),
            peer_name: modern.then_some(peer.unwrap_or_default()),
            port: s.port,
            proxy: modern.then(|| ProxyOut::of(s.proxy.as_ref())),
            service: &s.key.name,
            socket_path: modern.then_some(""),
            tagged_addresses: (!(s.tagged_addresses.is_empty() && legacy)).then_some(TaggedOut(&s.tagged_addresses)),
            tags: (!(s.tags.is_empty() && legacy)).then_some(s.tags.as_slice()),
            weights: WeightsOut { passing: s.weights.passing, warning: s.weights.warning },
        }
    }
}

/// `None`: `null` (the legacy shape of an empty map).
fn string_map_out(map: &BTreeMap<String, String>, legacy: bool) -> Option<&BTreeMap<String, String>> {
    (!(map.is_empty() && legacy)).then_some(map)
}

#[derive(Serialize)]
#[serde(rename_all = "PascalCase")]
struct NodeOut<'a> {
    address: &'a str,
    create_index: u64,
    datacenter: &'a str,
    #[serde(rename = "ID")]
    id: &'a str,
    meta: Option<&'a BTreeMap<String, String>>,
    modify_index: u64,
    node: &'a str,
    tagged_addresses: Option<&'a BTreeMap<String, String>>,
}

#[derive(Serialize)]
#[serde(rename_all = "PascalCase")]
struct ServiceOut<'a> {
    address: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    connect: Option<Empty>,
    create_index: u64,
    enable_tag_override: bool,
    #[serde(rename = "ID")]
    id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    kind: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    locality: Option<LocalityOut<'a>>,
    meta: Option<&'a BTreeMap<String, String>>,
    modify_index: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    namespace: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    partition: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    peer_name: Option<&'a str>,
    port: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    proxy: Option<ProxyOut<'a>>,
    service: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    socket_path: Option<&'a str>,
    tagged_addresses: Option<TaggedOut<'a>>,
    tags: Option<&'a [String]>,
    weights: WeightsOut,
}

#[derive(Serialize)]
#[serde(rename_all = "PascalCase")]
struct LocalityOut<'a> {
    region: &'a str,
    zone: &'a str,
}

#[derive(Serialize)]
#[serde(rename_all = "PascalCase")]
struct WeightsOut {
    passing: i32,
    warning: i32,
}

/// `Service.TaggedAddresses`: by name, each `{"Address", "Port"}`.
struct TaggedOut<'a>(&'a BTreeMap<String, TaggedAddress>);

impl Serialize for TaggedOut<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        #[serde(rename_all = "PascalCase")]
        struct AddressOut<'a> {
            address: &'a str,
            port: u16,
        }
        serializer.collect_map(self.0.iter().map(|(k, v)| (k, AddressOut { address: &v.address, port: v.port })))
    }
}

/// The modern flavour's `Proxy`: Consul's defaults, and the modelled fields that are set
/// (they are `omitempty`; see `proxy_json`).
#[derive(Serialize)]
#[serde(rename_all = "PascalCase")]
struct ProxyOut<'a> {
    #[serde(rename = "DestinationServiceID", skip_serializing_if = "str::is_empty")]
    destination_service_id: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    destination_service_name: &'a str,
    expose: Empty,
    #[serde(skip_serializing_if = "str::is_empty")]
    local_service_address: &'a str,
    #[serde(skip_serializing_if = "is_zero")]
    local_service_port: u16,
    mesh_gateway: Empty,
    mode: &'static str,
}

fn is_zero(port: &u16) -> bool {
    *port == 0
}

impl<'a> ProxyOut<'a> {
    fn of(p: Option<&'a ProxyConfig>) -> Self {
        let field = |f: fn(&'a ProxyConfig) -> &'a str| p.map_or("", f);
        ProxyOut {
            destination_service_id: field(|p| &p.destination_service_id),
            destination_service_name: field(|p| &p.destination_service_name),
            expose: Empty {},
            local_service_address: field(|p| &p.local_service_address),
            local_service_port: p.map_or(0, |p| p.local_service_port),
            mesh_gateway: Empty {},
            mode: "",
        }
    }
}

/// The body of `GET /v1/health/state/<state>`: the legacy flavour's, the modern one's for
/// one status, and the reference of [`CheckJsonCache`], which makes the modern one for
/// every check.
///
/// Serialised straight from the entries, without a `Value` per check: at 75,000 checks
/// (21 MB) building the tree first took most of the answer's 420 ms. The fields are in the
/// order `check_json` (a `Value`, keys sorted) gives them; a test holds the two equal.
pub(crate) fn checks(entries: &[StateEntry], legacy: bool) -> Vec<u8> {
    let rows: Vec<CheckOut<'_>> = entries.iter().map(|e| CheckOut::of(e, legacy)).collect();
    serde_json::to_vec(&rows).expect("checks serialise")
}

/// Each check's JSON in the modern flavour, made once and reused by every later answer of
/// every check (`/v1/health/state/any`) while neither the check nor its instance is
/// replaced.
///
/// At 75,000 checks, serialising every check again (string escaping, mostly) was most of a
/// 21 MB answer's time, and that answer is what a change feed waits for after every write.
/// A row is keyed by the addresses of the check and of its instance and holds both: the
/// catalog never changes a shared `Arc` in place (`Arc::make_mut` copies it while a row
/// holds it), and an address cannot be reused while a row keeps its value alive, so a key
/// names exactly the values its JSON was made from.
#[derive(Default)]
pub(crate) struct CheckJsonCache {
    rows: HashMap<(usize, usize), CachedCheck, foldhash::fast::RandomState>,
    /// The last answer's length: the next one's room.
    last_len: usize,
}

struct CachedCheck {
    check: Arc<Check>,
    owner: Option<Arc<ServiceInstance>>,
    json: Box<[u8]>,
}

impl CheckJsonCache {
    /// The body of `GET /v1/health/state/<state>` in the modern flavour: [`checks`]' bytes.
    pub(crate) fn render(&mut self, entries: &[StateEntry]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.last_len.max(2));
        out.push(b'[');
        for (i, e) in entries.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            let key = (Arc::as_ptr(&e.check) as usize, e.owner.as_ref().map_or(0, |o| Arc::as_ptr(o) as usize));
            let row = self.rows.entry(key).or_insert_with(|| CachedCheck {
                check: e.check.clone(),
                owner: e.owner.clone(),
                json: serde_json::to_vec(&CheckOut::of(e, false)).expect("a check serialises").into_boxed_slice(),
            });
            out.extend_from_slice(&row.json);
        }
        out.push(b']');
        self.last_len = out.len();
        out
    }

    /// Drops the rows of checks and instances that nothing but this cache holds any more:
    /// the catalog replaced or removed them.
    pub(crate) fn forget_replaced(&mut self) {
        self.rows.retain(|_, r| {
            Arc::strong_count(&r.check) > 1 && r.owner.as_ref().is_none_or(|o| Arc::strong_count(o) > 1)
        });
    }
}

/// One check as `/v1/health/state` shows it (see `value_shapes::check_json`).
#[derive(Serialize)]
#[serde(rename_all = "PascalCase")]
struct CheckOut<'a> {
    #[serde(rename = "CheckID")]
    check_id: &'a str,
    create_index: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    definition: Option<Empty>,
    #[serde(skip_serializing_if = "Option::is_none")]
    exposed_port: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    interval: Option<&'a str>,
    modify_index: u64,
    name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    namespace: Option<&'a str>,
    node: &'a str,
    notes: &'a str,
    output: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    partition: Option<&'a str>,
    #[serde(rename = "ServiceID")]
    service_id: &'a str,
    service_name: &'a str,
    /// `None`: `null` (the legacy shape of an empty list).
    service_tags: Option<&'a [String]>,
    status: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    timeout: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    r#type: Option<&'a str>,
}

/// `{}`.
#[derive(Serialize)]
struct Empty {}

impl<'a> CheckOut<'a> {
    fn of(e: &'a StateEntry, legacy: bool) -> Self {
        CheckOut::new(&e.check, e.owner.as_ref().map(|o| (&o.key, o.tags.as_slice())), legacy)
    }

    /// `owner`: the key and tags of the check's service instance; `None` for a node check.
    fn new(c: &'a Check, owner: Option<(&'a ServiceKey, &'a [String])>, legacy: bool) -> Self {
        let tags: &[String] = owner.map_or(&[], |(_, tags)| tags);
        let scoped = owner.map(|(k, _)| k).filter(|k| !k.is_default_scope());
        let modern = !legacy;
        CheckOut {
            check_id: &c.check_id,
            create_index: c.create_index,
            definition: modern.then_some(Empty {}),
            exposed_port: modern.then_some(0),
            interval: modern.then_some(""),
            modify_index: c.modify_index,
            name: &c.name,
            namespace: scoped.map(|k| k.namespace.as_str()),
            node: &c.node,
            notes: &c.notes,
            output: &c.output,
            partition: scoped.map(|k| k.partition.as_str()),
            service_id: &c.service_id,
            service_name: owner.map_or("", |(k, _)| k.name.as_str()),
            service_tags: (!(tags.is_empty() && legacy)).then_some(tags),
            status: c.status.as_str(),
            timeout: modern.then_some(""),
            r#type: modern.then_some(""),
        }
    }
}

/// The body of `GET /v1/catalog/services`.
pub(crate) fn services(services: &BTreeMap<String, Vec<String>>, legacy: bool) -> Value {
    Value::Object(services.iter().map(|(name, t)| (name.clone(), tags(t, legacy))).collect())
}

#[cfg(test)]
mod value_shapes {
    //! The answers' shapes as `Value`s (keys sorted): the reference the direct
    //! serialisations are held equal to.

    use super::*;
    use serde_json::{Map, json};

    fn string_map(map: &BTreeMap<String, String>, legacy: bool) -> Value {
        if map.is_empty() && legacy {
            return Value::Null;
        }
        Value::Object(map.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect())
    }

    fn service_json(s: &ServiceInstance, peer: Option<&str>, legacy: bool) -> Value {
        let tagged: Map<String, Value> = s
            .tagged_addresses
            .iter()
            .map(|(k, v)| (k.clone(), json!({"Address": v.address, "Port": v.port})))
            .collect();
        let mut out = json!({
            "ID": s.id,
            "Service": s.key.name,
            "Tags": tags(&s.tags, legacy),
            "Address": s.address,
            "Port": s.port,
            "Meta": string_map(&s.meta, legacy),
            "TaggedAddresses": if tagged.is_empty() && legacy { Value::Null } else { Value::Object(tagged) },
            "Weights": {"Passing": s.weights.passing, "Warning": s.weights.warning},
            "EnableTagOverride": s.enable_tag_override,
            "CreateIndex": s.create_index,
            "ModifyIndex": s.modify_index,
        });
        // Consul 1.17+ sends `Locality` only when the instance has one (`omitempty`).
        if let Some(l) = s.locality.as_ref().filter(|_| !legacy) {
            out["Locality"] = json!({"Region": l.region, "Zone": l.zone});
        }
        if !legacy {
            let mut proxy = json!({"Mode": "", "MeshGateway": {}, "Expose": {}});
            merge(&mut proxy, proxy_json(s));
            let extra = json!({
                "Kind": s.kind.as_str(),
                "Proxy": proxy,
                "Connect": {},
                "PeerName": peer.unwrap_or_default(),
                "SocketPath": "",
            });
            merge(&mut out, extra);
        }
        scope(&mut out, &s.key);
        out
    }

    /// The modelled `Proxy` fields that are set (Consul's are `omitempty`).
    fn proxy_json(s: &ServiceInstance) -> Value {
        let mut out = Map::new();
        if let Some(p) = &s.proxy {
            for (k, v) in [
                ("DestinationServiceName", &p.destination_service_name),
                ("DestinationServiceID", &p.destination_service_id),
                ("LocalServiceAddress", &p.local_service_address),
            ] {
                if !v.is_empty() {
                    out.insert(k.to_owned(), Value::String(v.clone()));
                }
            }
            if p.local_service_port != 0 {
                out.insert("LocalServicePort".to_owned(), json!(p.local_service_port));
            }
        }
        Value::Object(out)
    }

    /// Enterprise's `Namespace` and `Partition`, shown when not the defaults.
    fn scope(out: &mut Value, key: &ServiceKey) {
        if !key.is_default_scope() {
            merge(out, json!({"Namespace": key.namespace, "Partition": key.partition}));
        }
    }

    /// A check; `owner` is its service instance's key and tags, `None` for a node check (also
    /// the reference shape of [`checks`](super::checks)' direct serialisation).
    pub(super) fn check_json(c: &Check, owner: Option<(&ServiceKey, &[String])>, legacy: bool) -> Value {
        let (service_name, service_tags) = match owner {
            None => ("", tags(&[], legacy)),
            Some((key, t)) => (key.name.as_str(), tags(t, legacy)),
        };
        let mut out = json!({
            "Node": c.node,
            "CheckID": c.check_id,
            "Name": c.name,
            "Status": c.status.as_str(),
            "Notes": c.notes,
            "Output": c.output,
            "ServiceID": c.service_id,
            "ServiceName": service_name,
            "ServiceTags": service_tags,
            "CreateIndex": c.create_index,
            "ModifyIndex": c.modify_index,
        });
        if !legacy {
            merge(&mut out, json!({"Type": "", "Interval": "", "Timeout": "", "ExposedPort": 0, "Definition": {}}));
        }
        if let Some((key, _)) = owner {
            scope(&mut out, key);
        }
        out
    }

    fn merge(into: &mut Value, from: Value) {
        if let (Value::Object(into), Value::Object(from)) = (into, from) {
            into.extend(from);
        }
    }

    /// The reference shape of [`health`](super::health)'s direct serialisation.
    pub(super) fn health_json(entries: &[HealthEntry], legacy: bool) -> Value {
        Value::Array(
            entries
                .iter()
                .map(|e| {
                    let n = &e.node;
                    json!({
                        "Node": {
                            "ID": n.id,
                            "Node": n.name,
                            "Address": n.address,
                            "Datacenter": n.datacenter,
                            "TaggedAddresses": string_map(&n.tagged_addresses, legacy),
                            "Meta": string_map(&n.meta, legacy),
                            "CreateIndex": n.create_index,
                            "ModifyIndex": n.modify_index,
                        },
                        "Service": service_json(&e.service, e.peer.as_deref(), legacy),
                        "Checks": e.checks.iter().map(|c| {
                            let owner = (!c.service_id.is_empty()).then_some((&e.service.key, e.service.tags.as_slice()));
                            check_json(c, owner, legacy)
                        }).collect::<Vec<_>>(),
                    })
                })
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::value_shapes::{check_json, health_json};
    use super::*;

    use crate::catalog::CheckStatus;

    /// An instance of `key` with `tags`: what a check shows of its owner.
    fn owner(key: ServiceKey, tags: Vec<String>) -> Option<Arc<ServiceInstance>> {
        Some(Arc::new(ServiceInstance {
            node: "n".into(),
            id: "i".into(),
            key,
            tags,
            address: String::new(),
            port: 1,
            meta: BTreeMap::new(),
            tagged_addresses: BTreeMap::new(),
            locality: None,
            weights: Default::default(),
            enable_tag_override: false,
            kind: Default::default(),
            proxy: None,
            create_index: 1,
            modify_index: 1,
        }))
    }

    /// The direct serialisation of checks is byte for byte the `Value` shape's, in both
    /// flavours, for node checks, service checks with and without tags, and scoped ones.
    #[test]
    fn checks_serialise_as_their_value_shape() {
        let check = |node: &str, id: &str, service_id: &str, status| {
            Arc::new(Check {
                node: node.into(),
                check_id: id.into(),
                name: "c".into(),
                status,
                notes: "n".into(),
                output: "out \"quoted\"".into(),
                service_id: service_id.into(),
                create_index: 3,
                modify_index: 9,
            })
        };
        let entries = vec![
            StateEntry { check: check("n1", "serfHealth", "", CheckStatus::Critical), owner: None },
            StateEntry {
                check: check("n1", "c-web", "web-1", CheckStatus::Passing),
                owner: owner(ServiceKey::scoped("web", None, None), vec!["a".into(), "b".into()]),
            },
            StateEntry {
                check: check("n2", "c-api", "api-1", CheckStatus::Warning),
                owner: owner(ServiceKey::scoped("api", Some("team"), Some("p1")), vec![]),
            },
        ];
        for legacy in [false, true] {
            let reference = Value::Array(
                entries
                    .iter()
                    .map(|e| check_json(&e.check, e.owner.as_ref().map(|o| (&o.key, o.tags.as_slice())), legacy))
                    .collect(),
            );
            assert_eq!(String::from_utf8(checks(&entries, legacy)).unwrap(), reference.to_string(), "legacy: {legacy}");
        }

        // The kept JSON is the same bytes, and a replaced check or instance is shown anew.
        let mut cache = CheckJsonCache::default();
        assert_eq!(cache.render(&entries), checks(&entries, false));
        assert_eq!(cache.render(&[]), b"[]");
        let mut changed = entries.clone();
        changed[1].check = check("n1", "c-web", "web-1", CheckStatus::Critical);
        changed[2].owner = owner(ServiceKey::scoped("api", Some("team"), Some("p1")), vec!["new".into()]);
        assert_eq!(cache.render(&changed), checks(&changed, false));
        assert_eq!(cache.rows.len(), 5, "the replaced values are still held by `entries`");
        drop(entries);
        cache.forget_replaced();
        assert_eq!(cache.rows.len(), 3, "only the rows of what `changed` holds are kept");
        assert_eq!(cache.render(&changed), checks(&changed, false));
    }

    /// The direct serialisation of health rows is byte for byte the `Value` shape's, in
    /// both flavours: node maps empty and set, tagged addresses, a locality, tags empty and
    /// set, a connect proxy, a peer, a namespaced instance, node and service checks.
    #[test]
    fn health_serialises_as_its_value_shape() {
        use crate::catalog::{Catalog, DEFAULT_SCOPE, RegisterRequest, connect_key};
        let mut c = Catalog::new("dc1", 1);
        let mut reg = |v: Value, namespace: Option<&str>| {
            c.register(serde_json::from_value::<RegisterRequest>(v).unwrap(), namespace, None).unwrap();
        };
        reg(
            json!({"Node": "n1", "ID": "0b1f", "Address": "10.0.0.1",
                   "TaggedAddresses": {"lan": "10.0.0.1", "wan": "198.51.100.1"}, "NodeMeta": {"rack": "r1"},
                   "Service": {"ID": "web-1", "Service": "web", "Port": 80, "Tags": ["b", "a"], "Address": "10.1.0.1",
                               "Meta": {"version": "2", "quote": "say \"hi\""},
                               "TaggedAddresses": {"lan_ipv4": {"Address": "10.1.0.1", "Port": 80}},
                               "Locality": {"Region": "eu", "Zone": "eu-1a"}, "Weights": {"Passing": 3, "Warning": 1}},
                   "Checks": [{"CheckID": "serfHealth", "Name": "Serf", "Status": "passing"},
                              {"CheckID": "c-web-1", "Name": "http", "Status": "warning", "ServiceID": "web-1",
                               "Output": "slow\nline two"}]}),
            None,
        );
        reg(
            json!({"Node": "n2", "Address": "10.0.0.2",
                   "Service": {"ID": "web-2", "Service": "web", "Port": 81}}),
            None,
        );
        reg(
            json!({"Node": "n2", "Address": "10.0.0.2",
                   "Service": {"ID": "web-proxy", "Service": "web-sidecar-proxy", "Port": 21000, "Kind": "connect-proxy",
                               "Proxy": {"DestinationServiceName": "web", "DestinationServiceID": "web-2",
                                         "LocalServicePort": 81}}}),
            None,
        );
        reg(
            json!({"Node": "n3", "Address": "10.0.0.3",
                   "Service": {"ID": "api-1", "Service": "api", "Port": 90, "Namespace": "team"},
                   "Check": {"CheckID": "c-api", "Name": "tcp", "Status": "critical", "ServiceID": "api-1"}}),
            Some("team"),
        );
        let mut rows = c.health(&ServiceKey::new("web"), &[]);
        rows.extend(c.connect_health(&connect_key("web", DEFAULT_SCOPE, DEFAULT_SCOPE), &[]));
        rows.extend(c.health(&ServiceKey::scoped("api", Some("team"), None), &[]));
        assert_eq!(rows.len(), 4, "every registered instance is a row");
        rows[1].peer = Some("other-cluster".into());
        for legacy in [false, true] {
            let reference = health_json(&rows, legacy).to_string();
            assert_eq!(String::from_utf8(health(&rows, legacy)).unwrap(), reference, "legacy: {legacy}");
        }
        assert_eq!(health(&[], false), b"[]");
    }
}
