//! Ingestion: each Kubernetes object is decoded once, when it arrives, into what the
//! assembler reads of its kind (see [`Stored`]). The kind comes from the watch key; the
//! `--watch` keys, whose objects the snapshot copies whole, are kept as JSON.

pub(crate) mod endpoints;

use std::cell::OnceCell;
use std::collections::BTreeMap;
use std::sync::Arc;

use base64::Engine;
use consul_resolver_api::export::{self, ConsulServiceSpec};
use consul_resolver_api::mapping::{self, Mapping, MappingKind};
use consul_resolver_api::resolver::{self, ConsulResolverSpec};
use consul_resolver_api::service::ServiceRef;
use serde::Deserialize;
use serde_json::Value;

use crate::keys::KubeKey;
use crate::model::{Decoded, ExportObject, KubeObject, MappingObject, ResolverObject, Stored};

/// How the objects of one watch key are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reading {
    Resolver,
    Export,
    Mapping(MappingKind),
    Secret,
    EndpointSlices,
    Endpoints,
    Namespace,
    Json,
}

impl Reading {
    /// The reading of `key`'s objects; `verbatim` keys (`--watch`) are read as JSON.
    pub(crate) fn of(key: &KubeKey, verbatim: bool) -> Reading {
        if verbatim {
            return Reading::Json;
        }
        match (key.group.as_str(), key.kind.as_str()) {
            (resolver::GROUP, resolver::KIND) => Reading::Resolver,
            (resolver::GROUP, export::KIND) => Reading::Export,
            (mapping::GROUP, kind) => {
                MappingKind::ALL.into_iter().find(|k| k.kind() == kind).map_or(Reading::Json, Reading::Mapping)
            }
            ("", "Secret") => Reading::Secret,
            ("discovery.k8s.io", "EndpointSlice") => Reading::EndpointSlices,
            ("", "Endpoints") => Reading::Endpoints,
            ("", "Namespace") => Reading::Namespace,
            _ => Reading::Json,
        }
    }

    pub(crate) fn decode(self, obj: &KubeObject) -> Stored {
        // The object's JSON is built only for what reads it: a Mapping is read from its
        // spec's text.
        let built = OnceCell::new();
        let value = || built.get_or_init(|| obj.to_value());
        let decoded = match self {
            Reading::Resolver => Decoded::Resolver(Box::new(resolver_object(value()))),
            Reading::Export => Decoded::Export(Box::new(export_object(value()))),
            Reading::Mapping(kind) => Decoded::Mapping(Box::new(mapping_object(kind, obj))),
            Reading::Secret => Decoded::Secret(secret_data(value())),
            Reading::EndpointSlices => Decoded::Endpoints {
                service: endpoints::service_of_slice(value()),
                endpoints: endpoints::from_slice(value()),
            },
            Reading::Endpoints => {
                Decoded::Endpoints { service: obj.id.name.clone(), endpoints: endpoints::from_endpoints(value()) }
            }
            Reading::Namespace => Decoded::Labels(labels_of(value())),
            Reading::Json => Decoded::Json,
        };
        // Resolvers and exports keep their JSON for their controllers; `--watch` objects
        // are JSON.
        let raw = matches!(self, Reading::Resolver | Reading::Export | Reading::Json)
            .then(|| Arc::new(built.into_inner().unwrap_or_else(|| obj.to_value())));
        Stored { raw, decoded }
    }

    /// Whether two versions of an object differ in anything the snapshot shows. A write of
    /// a resolver's status alone (the operator's own, echoed by its watch) does not.
    pub(crate) fn same(self, a: &Stored, b: &Stored) -> bool {
        a.decoded == b.decoded && (self != Reading::Json || a.raw == b.raw)
    }
}

/// `metadata.labels`; values that are not strings are left out (the API server has none).
fn labels_of(value: &Value) -> BTreeMap<String, String> {
    let labels = value.pointer("/metadata/labels").and_then(Value::as_object);
    labels.into_iter().flatten().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned()))).collect()
}

fn resolver_object(value: &Value) -> ResolverObject {
    let generation = value.pointer("/metadata/generation").and_then(Value::as_i64);
    let spec = match value.get("spec") {
        Some(spec) => ConsulResolverSpec::deserialize(spec).map_err(|e| format!("spec is not valid: {e}")),
        None => Err("spec is missing".to_owned()),
    };
    ResolverObject { generation, spec }
}

fn export_object(value: &Value) -> ExportObject {
    let generation = value.pointer("/metadata/generation").and_then(Value::as_i64);
    let spec = match value.get("spec") {
        Some(spec) => ConsulServiceSpec::deserialize(spec).map_err(|e| format!("spec is not valid: {e}")),
        None => Err("spec is missing".to_owned()),
    };
    ExportObject { generation, spec }
}

fn mapping_object(kind: MappingKind, obj: &KubeObject) -> Result<MappingObject, String> {
    let (namespace, name) = (obj.id.namespace.as_deref(), Some(obj.id.name.as_str()));
    let m = Mapping::from_spec_text(kind, namespace, name, obj.field("spec")).map_err(|e| e.to_string())?;
    let service = m.spec.service.unwrap_or_default();
    Ok(MappingObject {
        kind,
        namespace: m.namespace,
        name: m.name,
        target: ServiceRef::parse(&service),
        service,
        resolver: m.spec.resolver,
        ambassador_ids: m.spec.ambassador_id,
    })
}

fn secret_data(value: &Value) -> BTreeMap<String, Option<Vec<u8>>> {
    let data = value.get("data").and_then(Value::as_object).into_iter().flatten();
    data.map(|(k, v)| {
        let bytes = v.as_str().and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok());
        (k.clone(), bytes)
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(v: Value) -> KubeObject {
        KubeObject::from_value(v).unwrap()
    }

    #[test]
    fn keys_are_read_by_kind_and_watched_keys_as_json() {
        let mappings = KubeKey::new("getambassador.io", "", "TCPMapping");
        assert_eq!(Reading::of(&mappings, false), Reading::Mapping(MappingKind::TcpMapping));
        assert_eq!(Reading::of(&mappings, true), Reading::Json);
        assert_eq!(Reading::of(&KubeKey::new("", "v1", "Service"), false), Reading::Json);
        assert_eq!(
            Reading::of(&KubeKey::new("consulresolver.io", "v1alpha1", "ConsulResolver"), false),
            Reading::Resolver
        );
    }

    #[test]
    fn a_mapping_keeps_only_what_is_read() {
        let m = object(json!({"metadata": {"namespace": "shop", "name": "m"},
            "spec": {"service": "billing:8080", "resolver": "consul", "prefix": "/b/", "timeout_ms": 3000}}));
        let stored = Reading::Mapping(MappingKind::Mapping).decode(&m);
        assert_eq!(stored.raw, None, "no JSON kept");
        let Decoded::Mapping(m) = stored.decoded else { panic!("{stored:?}") };
        let Ok(m) = *m else { panic!() };
        assert_eq!((m.service.as_str(), m.resolver.as_deref()), ("billing:8080", Some("consul")));
        assert_eq!(m.target.unwrap().port, Some(8080));
        let bad = object(json!({"metadata": {"namespace": "shop", "name": "m"}, "spec": {"service": 42}}));
        let Decoded::Mapping(m) = Reading::Mapping(MappingKind::Mapping).decode(&bad).decoded else { panic!() };
        let Err(e) = *m else { panic!() };
        assert!(e.starts_with("Mapping shop/m: spec is not valid"), "{e}");
    }

    #[test]
    fn a_resolver_status_write_alone_is_no_difference() {
        let r = |rv: &str, status: &str| {
            Reading::Resolver.decode(&object(json!({"metadata": {"namespace": "a", "name": "r", "generation": 2,
                "resourceVersion": rv}, "spec": {"address": "x:1"}, "status": {"s": status}})))
        };
        let (a, b) = (r("1", "old"), r("2", "new"));
        assert!(Reading::Resolver.same(&a, &b));
        assert_ne!(a.raw, b.raw, "the JSON is kept, current, for the status controller");
        let watched =
            |rv: &str| Reading::Json.decode(&object(json!({"metadata": {"name": "x", "resourceVersion": rv}})));
        assert!(!Reading::Json.same(&watched("1"), &watched("2")), "--watch objects are copied whole");
    }

    #[test]
    fn secrets_are_decoded_per_key() {
        let s = object(json!({"metadata": {"namespace": "a", "name": "s"}, "data": {"token": "dG9r", "bad": "%%"}}));
        let Decoded::Secret(data) = Reading::Secret.decode(&s).decoded else { panic!() };
        assert_eq!(data["token"].as_deref(), Some(&b"tok"[..]));
        assert_eq!(data["bad"], None);
    }
}
