//! Kubernetes naming rules, checked before a name goes into a field or label selector.
//!
//! A name the API server would refuse in a selector (`metadata.name=a,b`,
//! `kubernetes.io/service-name=-x`) must never become a watch: it is reported on the object
//! that holds it, as a validation error naming the field, and nothing is requested. These
//! are the rules of apimachinery's `validation.IsDNS1123Subdomain`, `IsDNS1123Label`,
//! `IsDNS1035Label` and `IsConfigMapKey`.

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
    fn data_keys() {
        assert_eq!(data_key("token"), Ok(()));
        assert_eq!(data_key("ca.crt"), Ok(()));
        assert_eq!(data_key("ACL_Token-1"), Ok(()));
        for bad in ["", "a/b", "a b", "a,b"] {
            assert!(data_key(bad).is_err(), "{bad:?}");
        }
    }
}
