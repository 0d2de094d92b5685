//! Kubernetes naming rules, and the one way the operator names a namespaced object.
//!
//! A name the API server would refuse in a selector (`metadata.name=a,b`,
//! `kubernetes.io/service-name=-x`) must never become a watch: it is reported on the object
//! that holds it, as a validation error naming the field, and nothing is requested. These
//! are the rules of apimachinery's `validation.IsDNS1123Subdomain`, `IsDNS1123Label`,
//! `IsDNS1035Label` and `IsConfigMapKey`. Every Kubernetes name the operator checks is
//! checked here: the command line's flags, a resolver's spec, a Mapping's target.

use std::fmt;
use std::str::FromStr;

/// Why a name breaks a rule, for messages: "`\"a,b\"` is not a valid Secret name: ...".
pub(crate) type Broken = &'static str;

fn lower_alnum(c: char) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit()
}

fn label(s: &str, first_letter: bool) -> Result<(), Broken> {
    if s.len() > 63 {
        return Err("must be at most 63 characters");
    }
    label_chars(s, first_letter)
}

fn label_chars(s: &str, first_letter: bool) -> Result<(), Broken> {
    if s.is_empty() {
        return Err("must not be empty");
    }
    if !s.chars().all(|c| lower_alnum(c) || c == '-') {
        return Err("must consist of lowercase letters, digits and '-'");
    }
    let first = s.chars().next().unwrap_or('-');
    if first_letter && !first.is_ascii_lowercase() {
        return Err("must start with a lowercase letter");
    }
    if !lower_alnum(first) || !s.ends_with(lower_alnum) {
        return Err("must start and end with a lowercase letter or digit");
    }
    Ok(())
}

/// RFC 1123 label (namespaces): `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
pub fn dns1123_label(s: &str) -> Result<(), Broken> {
    label(s, false)
}

/// RFC 1035 label (Service names): like an RFC 1123 label, starting with a letter.
pub fn dns1035_label(s: &str) -> Result<(), Broken> {
    label(s, true)
}

/// RFC 1123 subdomain (Secrets, most object names): dot-separated parts like RFC 1123
/// labels (without their 63-character limit), at most 253 characters in all.
pub fn dns1123_subdomain(s: &str) -> Result<(), Broken> {
    if s.len() > 253 {
        return Err("must be at most 253 characters");
    }
    s.split('.').try_for_each(|part| label_chars(part, false)).map_err(|_| {
        "must consist of lowercase letters, digits, '-' and '.', each part starting and ending with a letter or digit"
    })
}

/// A key of a Secret's or ConfigMap's `data`: `[-._a-zA-Z0-9]+`, at most 253 characters.
pub fn data_key(s: &str) -> Result<(), Broken> {
    if s.is_empty() || s.len() > 253 {
        return Err("must be 1 to 253 characters");
    }
    if !s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')) {
        return Err("must consist of letters, digits, '-', '_' and '.'");
    }
    Ok(())
}

/// A qualified name's name part, or a non-empty label value:
/// `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?`, at most 63 characters.
fn name_part(s: &str) -> Result<(), Broken> {
    if s.is_empty() || s.len() > 63 {
        return Err("must be 1 to 63 characters");
    }
    let inner = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if !s.chars().all(inner)
        || !s.starts_with(|c: char| c.is_ascii_alphanumeric())
        || !s.ends_with(|c: char| c.is_ascii_alphanumeric())
    {
        return Err("must be letters, digits, '-', '_' and '.', starting and ending with a letter or digit");
    }
    Ok(())
}

/// A label or annotation key (`validation.IsQualifiedName`): a name of at most 63
/// characters, optionally after a DNS-1123 subdomain prefix and `/`.
pub fn qualified_name(s: &str) -> Result<(), Broken> {
    let name = match s.split_once('/') {
        Some((prefix, name)) => {
            dns1123_subdomain(prefix)
                .map_err(|_| "must have a prefix that is a DNS subdomain (lowercase, at most 253 characters)")?;
            name
        }
        None => s,
    };
    name_part(name)
}

/// A label value (`validation.IsValidLabelValue`): empty, or as a qualified name's name.
pub fn label_value(s: &str) -> Result<(), Broken> {
    if s.is_empty() { Ok(()) } else { name_part(s) }
}

/// A namespaced object: `namespace/name` on the command line and in messages. Sorts by
/// namespace, then name (as the snapshot's entries do).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NamespacedName {
    pub namespace: String,
    pub name: String,
}

impl NamespacedName {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        NamespacedName { namespace: namespace.into(), name: name.into() }
    }
}

impl fmt::Display for NamespacedName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// `NAMESPACE/NAME`: a namespace (an RFC 1123 label) and an object name (an RFC 1123
/// subdomain, the rule of most kinds' names: ConfigMaps, Leases, custom resources).
impl FromStr for NamespacedName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let Some((namespace, name)) = s.split_once('/') else {
            return Err(format!("{s:?} is not NAMESPACE/NAME"));
        };
        dns1123_label(namespace).map_err(|why| format!("{s:?}: namespace {namespace:?} {why}"))?;
        dns1123_subdomain(name).map_err(|why| format!("{s:?}: name {name:?} {why}"))?;
        Ok(NamespacedName::new(namespace, name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_names() {
        for good in ["a", "consul-acl", "acl.v2", "0token", &"a".repeat(253)] {
            assert_eq!(dns1123_subdomain(good), Ok(()), "{good:?}");
        }
        for bad in ["", "a,b", "A", "-a", "a-", "a..b", ".a", "a b", "a/b", "a_b", &"a".repeat(254)] {
            assert!(dns1123_subdomain(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn service_names() {
        for good in ["web", "web-1", "a", &"a".repeat(63)] {
            assert_eq!(dns1035_label(good), Ok(()), "{good:?}");
        }
        for bad in ["-x", "x-", "_x", "1web", "Web", "a.b", &"a".repeat(64)] {
            assert!(dns1035_label(bad).is_err(), "{bad:?}");
        }
        assert_eq!(dns1123_label("1shop"), Ok(()), "namespaces may start with a digit");
    }

    #[test]
    fn label_and_annotation_keys_and_label_values() {
        for good in ["team", "app.kubernetes.io/name", "a_b.C-1", "example.com/X", &"a".repeat(63)] {
            assert_eq!(qualified_name(good), Ok(()), "{good:?}");
        }
        for bad in ["", "/a", "a/", "a/b/c", "Example.com/a", "-a", "a-", "a b", &"a".repeat(64)] {
            assert!(qualified_name(bad).is_err(), "{bad:?}");
        }
        for good in ["", "shop", "v1.2_x-y", &"a".repeat(63)] {
            assert_eq!(label_value(good), Ok(()), "{good:?}");
        }
        for bad in ["a b", "-a", "a/b", &"a".repeat(64)] {
            assert!(label_value(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn namespaced_names_parse_and_print() {
        let n: NamespacedName = "ops/snap.v2".parse().unwrap();
        assert_eq!(n, NamespacedName::new("ops", "snap.v2"));
        assert_eq!(n.to_string(), "ops/snap.v2");
        for bad in ["snap", "/snap", "ops/", "ops.x/snap", "Ops/snap", "ops/Snap", "ops/a/b", "ops/a..b"] {
            assert!(bad.parse::<NamespacedName>().is_err(), "{bad:?}");
        }
        let e = "ops.x/snap".parse::<NamespacedName>().unwrap_err();
        assert!(e.contains("namespace \"ops.x\" must consist of"), "{e}");
        assert!(NamespacedName::new("a", "z") < NamespacedName::new("b", "a"), "namespace first");
    }

    #[test]
    fn data_keys() {
        assert_eq!(data_key("token"), Ok(()));
        assert_eq!(data_key("ca.crt"), Ok(()));
        assert_eq!(data_key("ACL_Token-1"), Ok(()));
        for bad in ["", "a/b", "a b", "a,b"] {
            assert!(data_key(bad).is_err(), "{bad:?}");
        }
    }
}
