//! An object as the API server sends it, decoded once, straight into what the core keeps
//! ([`KubeObject`]): the metadata as JSON, every other top-level field as its text.
//!
//! `DynamicObject` decoded the metadata into `ObjectMeta` (`managedFields` included), the
//! rest into JSON, and the core then needed the metadata back as JSON (serialised again)
//! and read a Mapping's spec out of JSON it dropped at once. Here `managedFields` is
//! skipped unread, the metadata stays JSON, and a spec is decoded only by what reads it,
//! from its text. The watcher needs only the `resourceVersion` (to resume its watch),
//! which is copied out, with the name and namespace.

use std::borrow::Cow;
use std::fmt;

use kube::core::{ApiResource, DynamicResourceScope, ObjectMeta, Resource};
use serde::Deserialize;
use serde::de::{DeserializeSeed, Deserializer, Error as _, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use consul_resolver_core::model::{KubeObject, ObjectId};

/// The object, and what the watcher reads of its metadata.
#[derive(Clone, Debug)]
pub(crate) struct WireObject {
    /// `name`, `namespace` and `resourceVersion` only.
    meta: ObjectMeta,
    metadata: Map<String, Value>,
    /// Every other top-level field as the API server wrote it.
    fields: Vec<(String, Box<RawValue>)>,
}

impl WireObject {
    /// Which object this is, for a deletion.
    pub(crate) fn id(&self) -> ObjectId {
        ObjectId { namespace: self.meta.namespace.clone(), name: self.meta.name.clone().unwrap_or_default() }
    }

    /// The object as the core keeps it; `None` without a name.
    pub(crate) fn into_object(self) -> Option<KubeObject> {
        KubeObject::from_parts(self.metadata, self.fields)
    }
}

impl Resource for WireObject {
    type DynamicType = ApiResource;
    type Scope = DynamicResourceScope;

    fn group(dt: &ApiResource) -> Cow<'_, str> {
        dt.group.as_str().into()
    }

    fn version(dt: &ApiResource) -> Cow<'_, str> {
        dt.version.as_str().into()
    }

    fn kind(dt: &ApiResource) -> Cow<'_, str> {
        dt.kind.as_str().into()
    }

    fn api_version(dt: &ApiResource) -> Cow<'_, str> {
        dt.api_version.as_str().into()
    }

    fn plural(dt: &ApiResource) -> Cow<'_, str> {
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
        let (metadata, fields) = deserializer.deserialize_map(Object)?;
        let text = |key: &str| metadata.get(key).and_then(Value::as_str).map(str::to_owned);
        let meta = ObjectMeta {
            name: text("name"),
            namespace: text("namespace"),
            resource_version: text("resourceVersion"),
            ..ObjectMeta::default()
        };
        Ok(WireObject { meta, metadata, fields })
    }
}

/// The object's map: `metadata` read as [`Metadata`], the other fields kept as text.
struct Object;

impl<'de> Visitor<'de> for Object {
    type Value = (Map<String, Value>, Vec<(String, Box<RawValue>)>);

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a Kubernetes object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        // A field's text can be kept only when read from serde_json's own reader, which
        // does not know a map's length. A map that does (buffered by serde: a watch event
        // whose `object` comes before its `type`, which no API server writes; or a
        // `Value`) gives its fields as JSON, written back as text.
        let buffered = map.size_hint().is_some();
        let mut metadata = Map::new();
        let mut fields = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            if key == "metadata" {
                metadata = map.next_value_seed(Metadata)?;
            } else if buffered {
                let value: Value = map.next_value()?;
                fields.push((key, serde_json::value::to_raw_value(&value).map_err(A::Error::custom)?));
            } else {
                fields.push((key, map.next_value()?));
            }
        }
        Ok((metadata, fields))
    }
}

/// An object's metadata, but for `managedFields`, skipped unread.
struct Metadata;

impl<'de> DeserializeSeed<'de> for Metadata {
    type Value = Map<String, Value>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Metadata {
    type Value = Map<String, Value>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object's metadata")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if key == "managedFields" {
                map.next_value::<IgnoredAny>()?;
            } else {
                let value = map.next_value()?;
                out.insert(key, value);
            }
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
        assert_eq!(object.to_value(), expected);
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
        let list: ObjectList<WireObject> = serde_json::from_str(&list.to_string()).unwrap();
        assert_eq!(list.metadata.resource_version.as_deref(), Some("50"));
        let object = list.items.into_iter().next().unwrap().into_object().unwrap();
        assert_eq!(object.field("kind"), None);
        assert_eq!(object.field("spec"), Some(r#"{"prefix":"/web/","resolver":"consul-dc1","service":"web"}"#));
        assert_eq!(object.id.name, "web");

        // As the API server writes an event (`type` first), and the other way round, which
        // serde reads from a buffer.
        let object = serde_json::to_string(&mapping()).unwrap();
        for event in [
            format!(r#"{{"type":"MODIFIED","object":{object}}}"#),
            format!(r#"{{"object":{object},"type":"MODIFIED"}}"#),
        ] {
            let WatchEvent::Modified(o) = serde_json::from_str::<WatchEvent<WireObject>>(&event).unwrap() else {
                panic!("a modification")
            };
            assert_eq!(o.resource_version().as_deref(), Some("42"));
            let mut expected = mapping();
            expected["metadata"].as_object_mut().unwrap().remove("managedFields");
            assert_eq!(o.into_object().unwrap().to_value(), expected);
        }
        let from_value: WireObject = serde_json::from_value(mapping()).unwrap();
        assert_eq!(
            from_value.into_object().unwrap().field("spec"),
            Some(r#"{"prefix":"/web/","resolver":"consul-dc1","service":"web"}"#)
        );

        let nameless: WireObject = serde_json::from_str(r#"{"metadata": {}, "spec": {}}"#).unwrap();
        assert!(nameless.into_object().is_none());
        assert!(serde_json::from_str::<WireObject>(r#"["not", "an", "object"]"#).is_err());
        assert!(serde_json::from_str::<WireObject>(r#"{"metadata": "text"}"#).is_err());
        assert!(serde_json::from_str::<WireObject>(r#"{"metadata": {"name": "x"}, "spec": {"#).is_err());
    }
}
