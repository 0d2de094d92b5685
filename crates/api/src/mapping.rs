//! Read-only models of Ambassador's `Mapping` and `TCPMapping` (`getambassador.io`,
//! `v3alpha1` and `v2`).
//!
//! We read three fields (`service`, `resolver`, `ambassador_id`) and nothing else: at scale
//! (tens of thousands of Mappings) keeping what we never read would be most of the memory.
//! Both versions use the same names for the fields we read; `ambassador_id` is a string or
//! a list in both.

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use super::DEFAULT_AMBASSADOR_ID;

pub const GROUP: &str = "getambassador.io";

/// Which of Ambassador's route kinds an object is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum MappingKind {
    Mapping,
    #[serde(rename = "TCPMapping")]
    TcpMapping,
}

impl MappingKind {
    pub const ALL: [MappingKind; 2] = [MappingKind::Mapping, MappingKind::TcpMapping];

    pub fn kind(self) -> &'static str {
        match self {
            MappingKind::Mapping => "Mapping",
            MappingKind::TcpMapping => "TCPMapping",
        }
    }
}

/// A Mapping or TCPMapping as we read it.
#[derive(Debug, Clone, PartialEq)]
pub struct Mapping {
    pub kind: MappingKind,
    pub namespace: String,
    pub name: String,
    pub spec: MappingSpec,
}

/// The part of a Mapping's spec we read; every other field is ignored.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
pub struct MappingSpec {
    #[serde(default)]
    pub service: Option<String>,
    #[serde(default)]
    pub resolver: Option<String>,
    #[serde(default, deserialize_with = "string_or_list")]
    pub ambassador_id: Option<Vec<String>>,
}

impl MappingSpec {
    /// Whether this Mapping belongs to the operator's Ambassador ID (absent or empty
    /// means `default`, as in Ambassador).
    pub fn serves_ambassador_id(&self, id: &str) -> bool {
        match self.ambassador_id.as_deref() {
            None | Some([]) => id == DEFAULT_AMBASSADOR_ID,
            Some(ids) => ids.iter().any(|i| i == id),
        }
    }
}

/// Errors reading a Mapping object.
#[derive(Debug, thiserror::Error)]
pub enum MappingError {
    #[error("{kind} has no metadata.{field}")]
    MissingMeta { kind: &'static str, field: &'static str },
    #[error("{kind} {namespace}/{name}: spec is not valid: {source}")]
    Spec { kind: &'static str, namespace: String, name: String, source: serde_json::Error },
}

impl Mapping {
    /// Reads a Mapping from the object JSON the API server returned, of either version.
    pub fn from_object(kind: MappingKind, object: &Value) -> Result<Self, MappingError> {
        let meta = |field: &str| object.pointer(&format!("/metadata/{field}")).and_then(Value::as_str);
        let spec = object.get("spec").filter(|s| !s.is_null());
        Self::read(kind, meta("namespace"), meta("name"), || {
            spec.map_or(Ok(MappingSpec::default()), MappingSpec::deserialize)
        })
    }

    /// Reads a Mapping from its metadata's `namespace` and `name` and its `spec` as the API
    /// server wrote it (JSON text), without building the object's JSON first.
    pub fn from_spec_text(
        kind: MappingKind,
        namespace: Option<&str>,
        name: Option<&str>,
        spec: Option<&str>,
    ) -> Result<Self, MappingError> {
        Self::read(kind, namespace, name, || {
            let spec: Option<MappingSpec> = spec.map(serde_json::from_str).transpose()?.flatten();
            Ok(spec.unwrap_or_default())
        })
    }

    fn read(
        kind: MappingKind,
        namespace: Option<&str>,
        name: Option<&str>,
        spec: impl FnOnce() -> Result<MappingSpec, serde_json::Error>,
    ) -> Result<Self, MappingError> {
        let missing = |field| MappingError::MissingMeta { kind: kind.kind(), field };
        let namespace = namespace.ok_or_else(|| missing("namespace"))?.to_owned();
        let name = name.ok_or_else(|| missing("name"))?.to_owned();
        let spec = spec().map_err(|source| MappingError::Spec {
            kind: kind.kind(),
            namespace: namespace.clone(),
            name: name.clone(),
            source,
        })?;
        Ok(Mapping { kind, namespace, name, spec })
    }
}

fn string_or_list<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<String>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match Option::<OneOrMany>::deserialize(d)? {
        None => None,
        Some(OneOrMany::One(s)) => Some(vec![s]),
        Some(OneOrMany::Many(v)) => Some(v),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_v3alpha1_and_ignores_the_fields_it_does_not_read() {
        let obj = json!({
            "apiVersion": "getambassador.io/v3alpha1", "kind": "Mapping",
            "metadata": {"name": "billing", "namespace": "shop"},
            "spec": {"prefix": "/billing/", "service": "billing:8080", "resolver": "consul-dc1",
                     "ambassador_id": ["blue"], "hostname": "*", "timeout_ms": 3000}
        });
        let m = Mapping::from_object(MappingKind::Mapping, &obj).unwrap();
        assert_eq!((m.namespace.as_str(), m.name.as_str()), ("shop", "billing"));
        assert_eq!(m.spec.service.as_deref(), Some("billing:8080"));
        assert_eq!(m.spec.resolver.as_deref(), Some("consul-dc1"));
        assert!(m.spec.serves_ambassador_id("blue"));
        assert!(!m.spec.serves_ambassador_id("default"));
    }

    #[test]
    fn reads_v2_string_ambassador_id() {
        let obj = json!({"metadata": {"name": "t", "namespace": "n"},
                         "spec": {"service": "db:5432", "port": 5432, "ambassador_id": "green"}});
        let m = Mapping::from_object(MappingKind::TcpMapping, &obj).unwrap();
        assert_eq!(m.spec.ambassador_id, Some(vec!["green".to_owned()]));
        assert!(m.spec.serves_ambassador_id("green"));
    }

    #[test]
    fn absent_ambassador_id_means_default() {
        let obj = json!({"metadata": {"name": "t", "namespace": "n"}, "spec": {"service": "a"}});
        let m = Mapping::from_object(MappingKind::Mapping, &obj).unwrap();
        assert!(m.spec.serves_ambassador_id("default"));
        assert!(!m.spec.serves_ambassador_id("blue"));
    }

    #[test]
    fn bad_spec_is_an_error_naming_the_object() {
        let obj = json!({"metadata": {"name": "t", "namespace": "n"}, "spec": {"service": 42}});
        let e = Mapping::from_object(MappingKind::Mapping, &obj).unwrap_err();
        assert!(e.to_string().starts_with("Mapping n/t: spec is not valid"), "{e}");
        let e = Mapping::from_object(MappingKind::Mapping, &json!({"metadata": {"name": "x"}})).unwrap_err();
        assert!(e.to_string().contains("metadata.namespace"), "{e}");
        let e = Mapping::from_spec_text(MappingKind::Mapping, Some("n"), Some("t"), Some(r#"{"service": 42}"#));
        assert!(e.unwrap_err().to_string().starts_with("Mapping n/t: spec is not valid"));
        let e = Mapping::from_spec_text(MappingKind::TcpMapping, Some("n"), None, None).unwrap_err();
        assert!(e.to_string().contains("metadata.name"), "{e}");
        let none = Mapping::from_spec_text(MappingKind::Mapping, Some("n"), Some("t"), Some("null")).unwrap();
        assert_eq!(none.spec, MappingSpec::default(), "a null spec, as an absent one");
    }
}

/// Property tests: any object the API server could hand over is read or refused with an
/// error naming it, never a panic; the three fields read back as written, whichever form
/// `ambassador_id` takes.
#[cfg(test)]
mod proptests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn any_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            ".{0,8}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            let key = prop_oneof![
                prop::sample::select(vec![
                    "service",
                    "resolver",
                    "ambassador_id",
                    "spec",
                    "metadata",
                    "name",
                    "namespace"
                ])
                .prop_map(str::to_owned),
                "[a-z_]{0,6}",
            ];
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                prop::collection::btree_map(key, inner, 0..4).prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn any_object_is_read_or_refused_naming_it(object in any_json(), spec in any_json(), tcp in any::<bool>()) {
            let kind = if tcp { MappingKind::TcpMapping } else { MappingKind::Mapping };
            // An arbitrary value, and a well-named object with an arbitrary spec.
            let _ = Mapping::from_object(kind, &object);
            let named = json!({"metadata": {"name": "m", "namespace": "ns"}, "spec": spec});
            let from_object = Mapping::from_object(kind, &named);
            match &from_object {
                Ok(m) => prop_assert_eq!((m.namespace.as_str(), m.name.as_str()), ("ns", "m")),
                Err(e) => prop_assert!(e.to_string().starts_with(&format!("{} ns/m: spec is not valid", kind.kind())), "{}", e),
            }
            // The spec read from its text: the same Mapping, or an error too.
            let from_text = Mapping::from_spec_text(kind, Some("ns"), Some("m"), Some(&spec.to_string()));
            match (from_object, from_text) {
                (Ok(a), Ok(b)) => prop_assert_eq!(a, b),
                (Err(_), Err(e)) => prop_assert!(e.to_string().starts_with(&format!("{} ns/m: spec is not valid", kind.kind())), "{}", e),
                (a, b) => prop_assert!(false, "{:?} read from the object, {:?} from the text", a, b),
            }
        }

        #[test]
        fn the_fields_read_back_as_written(
            service in prop::option::of(".{0,12}"),
            resolver in prop::option::of(".{0,12}"),
            ids in prop::option::of(prop::collection::vec("[a-z]{1,6}", 0..4)),
            as_string in any::<bool>(),
            noise in any_json(),
        ) {
            let mut spec = json!({"prefix": "/x/", "timeout_ms": 3000, "extra": noise});
            if let Some(s) = &service { spec["service"] = json!(s); }
            if let Some(r) = &resolver { spec["resolver"] = json!(r); }
            let single = ids.as_ref().filter(|i| as_string && i.len() == 1);
            match (&ids, single) {
                (_, Some(one)) => spec["ambassador_id"] = json!(one[0]),
                (Some(list), None) => spec["ambassador_id"] = json!(list),
                (None, None) => {}
            }
            let m = Mapping::from_object(MappingKind::Mapping, &json!({"metadata": {"name": "m", "namespace": "n"}, "spec": spec})).unwrap();
            prop_assert_eq!(m.spec.service.clone(), service);
            prop_assert_eq!(m.spec.resolver.clone(), resolver);
            prop_assert_eq!(m.spec.ambassador_id.clone(), ids.clone());
            let serves_default = ids.as_ref().is_none_or(|i| i.is_empty() || i.iter().any(|i| i == "default"));
            prop_assert_eq!(m.spec.serves_ambassador_id("default"), serves_default);
        }
    }
}
