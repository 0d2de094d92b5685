//! An object as the API server sends it, decoded once, straight into the JSON the core
//! keeps ([`KubeObject`]).
//!
//! `DynamicObject` decodes the metadata into `ObjectMeta` (`managedFields` included: at
//! 10,000 Mappings a tenth of a cold start's decoding), and the core then needed the
//! metadata back as JSON, serialised again from `ObjectMeta`. Here `managedFields` is
//! skipped unread, and the metadata stays JSON; the watcher only needs the
//! `resourceVersion` (to resume its watch), which is copied out.

use std::fmt;

use kube::core::{ApiResource, DynamicResourceScope, ObjectMeta, Resource};
use serde::Deserialize;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::{Map, Value};

use consul_resolver_core::model::{KubeObject, ObjectId};

/// The object, and what the watcher reads of its metadata.
#[derive(Clone, Debug)]
pub(crate) struct WireObject {
    /// `name`, `namespace` and `resourceVersion` only.
    meta: ObjectMeta,
    value: Map<String, Value>,
}

impl WireObject {
    /// Which object this is, for a deletion.
    pub(crate) fn id(&self) -> ObjectId {
        ObjectId { namespace: self.meta.namespace.clone(), name: self.meta.name.clone().unwrap_or_default() }
    }

    /// The object as the core keeps it; `None` without a name.
    pub(crate) fn into_object(self) -> Option<KubeObject> {
        KubeObject::from_value(Value::Object(self.value))
    }
}

impl Resource for WireObject {
    type DynamicType = ApiResource;
    type Scope = DynamicResourceScope;

    fn group(dt: &ApiResource) -> std::borrow::Cow<'_, str> {
        dt.group.as_str().into()
    }

    fn version(dt: &ApiResource) -> std::borrow::Cow<'_, str> {
        dt.version.as_str().into()
    }

    fn kind(dt: &ApiResource) -> std::borrow::Cow<'_, str> {
        dt.kind.as_str().into()
    }

    fn api_version(dt: &ApiResource) -> std::borrow::Cow<'_, str> {
        dt.api_version.as_str().into()
    }

    fn plural(dt: &ApiResource) -> std::borrow::Cow<'_, str> {
        dt.plural.as_str().into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.meta
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.meta
    }
}

impl<'de> Deserialize<'de> for WireObject {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = deserializer.deserialize_map(Fields::Object)?;
        let text =
            |key: &str| value.get("metadata").and_then(|m| m.get(key)).and_then(Value::as_str).map(str::to_owned);
        let meta = ObjectMeta {
            name: text("name"),
            namespace: text("namespace"),
            resource_version: text("resourceVersion"),
            ..ObjectMeta::default()
        };
        Ok(WireObject { meta, value })
    }
}

/// Which map is being read: the object (whose `metadata` is read as [`Fields::Metadata`])
/// or its metadata (whose `managedFields` is skipped).
#[derive(Clone, Copy)]
enum Fields {
    Object,
    Metadata,
}

impl<'de> DeserializeSeed<'de> for Fields {
    type Value = Map<String, Value>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Fields {
    type Value = Map<String, Value>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(match self {
            Fields::Object => "a Kubernetes object",
            Fields::Metadata => "an object's metadata",
        })
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let value = match (self, key.as_str()) {
                (Fields::Object, "metadata") => Value::Object(map.next_value_seed(Fields::Metadata)?),
                (Fields::Metadata, "managedFields") => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
                _ => map.next_value::<Value>()?,
            };
            out.insert(key, value);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::ResourceExt;
    use kube::api::DynamicObject;
    use kube::core::{ObjectList, WatchEvent};
    use serde_json::json;

    fn mapping() -> Value {
        json!({
            "apiVersion": "getambassador.io/v2",
            "kind": "Mapping",
            "metadata": {
                "name": "web", "namespace": "shop", "resourceVersion": "42", "uid": "u-1",
                "labels": {"app": "web"},
                "annotations": {"note": "managedFields is a field name, not a field here"},
                "managedFields": [{"manager": "kubectl", "operation": "Apply",
                    "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:service": {}}}}]
            },
            "spec": {"prefix": "/web/", "service": "web", "resolver": "consul-dc1"}
        })
    }

    /// The same object the old path kept (DynamicObject, `managedFields` dropped, the
    /// metadata serialised again): nothing the core reads differs.
    #[test]
    fn the_core_gets_the_object_without_managed_fields() {
        let body = serde_json::to_vec(&mapping()).unwrap();
        let wire: WireObject = serde_json::from_slice(&body).unwrap();
        assert_eq!(wire.resource_version().as_deref(), Some("42"));
        assert_eq!((wire.name_any(), wire.namespace()), ("web".to_string(), Some("shop".to_string())));
        let object = wire.into_object().unwrap();
        let mut expected = mapping();
        expected["metadata"].as_object_mut().unwrap().remove("managedFields");
        assert_eq!(*object.value, expected);
        let dynamic: DynamicObject = serde_json::from_slice(&body).unwrap();
        assert_eq!(dynamic.metadata.managed_fields.map(|m| m.len()), Some(1), "the fixture has managed fields");
    }

    /// As the watcher receives objects: list items (no `apiVersion` or `kind`) and watch
    /// events; a nameless object is not an object for the core.
    #[test]
    fn lists_and_watch_events_decode() {
        let mut item = mapping();
        item.as_object_mut().unwrap().retain(|k, _| k == "metadata" || k == "spec");
        let list = json!({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": "50"}, "items": [item]});
        let list: ObjectList<WireObject> = serde_json::from_value(list).unwrap();
        assert_eq!(list.metadata.resource_version.as_deref(), Some("50"));
        let object = list.items.into_iter().next().unwrap().into_object().unwrap();
        assert_eq!(object.value.get("kind"), None);
        assert_eq!(object.id.name, "web");

        let event = json!({"type": "MODIFIED", "object": mapping()});
        let WatchEvent::Modified(o) = serde_json::from_value::<WatchEvent<WireObject>>(event).unwrap() else {
            panic!("a modification")
        };
        assert_eq!(o.resource_version().as_deref(), Some("42"));

        let nameless: WireObject = serde_json::from_value(json!({"metadata": {}, "spec": {}})).unwrap();
        assert!(nameless.into_object().is_none());
        assert!(serde_json::from_value::<WireObject>(json!(["not", "an", "object"])).is_err());
        assert!(serde_json::from_value::<WireObject>(json!({"metadata": "text"})).is_err());
    }
}
