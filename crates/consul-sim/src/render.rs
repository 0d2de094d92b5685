//! JSON shapes of the answers, in two flavours.
//!
//! The modern flavour is what current agents send: empty maps as `{}`, empty lists as `[]`,
//! plus fields that older agents lack (`Kind`, `Proxy`, `Connect`, `PeerName`, check `Type`,
//! ...) so that client parsers meet unknown fields. The legacy flavour (`null_variants`) is
//! what older agents send: `null` for empty `Meta`, `TaggedAddresses` and `Tags`, and none of
//! the newer fields. Clients must parse both.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use super::catalog::{Check, DEFAULT_SCOPE, HealthEntry, ServiceInstance, ServiceKey, StateEntry};

fn string_map(map: &BTreeMap<String, String>, legacy: bool) -> Value {
    if map.is_empty() && legacy {
        return Value::Null;
    }
    Value::Object(map.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect())
}

fn tags(tags: &[String], legacy: bool) -> Value {
    if tags.is_empty() && legacy {
        return Value::Null;
    }
    json!(tags)
}

fn service_json(s: &ServiceInstance, peer: Option<&str>, legacy: bool) -> Value {
    let tagged: Map<String, Value> =
        s.tagged_addresses.iter().map(|(k, v)| (k.clone(), json!({"Address": v.address, "Port": v.port}))).collect();
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
    if key.namespace != DEFAULT_SCOPE || key.partition != DEFAULT_SCOPE {
        merge(out, json!({"Namespace": key.namespace, "Partition": key.partition}));
    }
}

/// A check; `owner` is its service instance's key and tags, `None` for a node check.
fn check_json(c: &Check, owner: Option<(&ServiceKey, &[String])>, legacy: bool) -> Value {
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

/// The body of `GET /v1/health/service/<name>` and `GET /v1/health/connect/<name>`.
pub(crate) fn health(entries: &[HealthEntry], legacy: bool) -> Value {
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

/// The body of `GET /v1/health/state/<state>`.
pub(crate) fn checks(entries: &[StateEntry], legacy: bool) -> Value {
    Value::Array(
        entries
            .iter()
            .map(|e| check_json(&e.check, e.owner.as_ref().map(|o| (&o.key, o.tags.as_slice())), legacy))
            .collect(),
    )
}

/// The body of `GET /v1/catalog/services`.
pub(crate) fn services(services: &BTreeMap<String, Vec<String>>, legacy: bool) -> Value {
    Value::Object(services.iter().map(|(name, t)| (name.clone(), tags(t, legacy))).collect())
}
