//! JSON shapes of the answers, in two flavours.
//!
//! The modern flavour is what current agents send: empty maps as `{}`, empty lists as `[]`,
//! plus fields that older agents lack (`Kind`, `Proxy`, `Connect`, `PeerName`, check `Type`,
//! ...) so that client parsers meet unknown fields. The legacy flavour (`null_variants`) is
//! what older agents send: `null` for empty `Meta`, `TaggedAddresses` and `Tags`, and none of
//! the newer fields. Clients must parse both.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use super::catalog::{Check, DEFAULT_SCOPE, HealthEntry, ServiceInstance};

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

fn service_json(s: &ServiceInstance, legacy: bool) -> Value {
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
        let extra = json!({
            "Kind": "",
            "Proxy": {"Mode": "", "MeshGateway": {}, "Expose": {}},
            "Connect": {},
            "PeerName": "",
            "SocketPath": "",
        });
        merge(&mut out, extra);
    }
    if s.key.namespace != DEFAULT_SCOPE || s.key.partition != DEFAULT_SCOPE {
        merge(&mut out, json!({"Namespace": s.key.namespace, "Partition": s.key.partition}));
    }
    out
}

fn check_json(c: &Check, owner: &ServiceInstance, legacy: bool) -> Value {
    let (service_name, service_tags) = if c.service_id.is_empty() {
        ("", tags(&[], legacy))
    } else {
        (owner.key.name.as_str(), tags(&owner.tags, legacy))
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
    out
}

fn merge(into: &mut Value, from: Value) {
    if let (Value::Object(into), Value::Object(from)) = (into, from) {
        into.extend(from);
    }
}

/// The body of `GET /v1/health/service/<name>`.
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
                    "Service": service_json(&e.service, legacy),
                    "Checks": e.checks.iter().map(|c| check_json(c, &e.service, legacy)).collect::<Vec<_>>(),
                })
            })
            .collect(),
    )
}

/// The body of `GET /v1/catalog/services`.
pub(crate) fn services(services: &BTreeMap<String, Vec<String>>, legacy: bool) -> Value {
    Value::Object(services.iter().map(|(name, t)| (name.clone(), tags(t, legacy))).collect())
}
