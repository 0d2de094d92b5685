//! Parsing a Mapping's `spec.service`.
//!
//! Ambassador accepts `name`, `name:port`, `scheme://name[:port]` and
//! `name.namespace[:port]` (also the longer `name.namespace.svc.cluster.local`). For Consul
//! the service name is the host's first label, without scheme, port or Kubernetes namespace
//! suffix; the port is kept for the snapshot. Using the string verbatim as the Consul name
//! (as Emissary does) watches `name:8080`, a service that does not exist.

use std::fmt;
use std::net::IpAddr;

/// A parsed `spec.service`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceRef {
    /// `http`, `https`, ... when given as `scheme://...`.
    pub scheme: Option<String>,
    pub host: Host,
    pub port: Option<u16>,
}

/// What the host part of a service names.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Host {
    /// A service name, with the Kubernetes namespace when written `name.namespace`.
    Service { name: String, namespace: Option<String> },
    /// A literal IP address: routed directly, nothing to watch.
    Ip(IpAddr),
}

/// Why a `spec.service` could not be parsed. Each message quotes the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServiceRefError {
    #[error("service is empty")]
    Empty,
    #[error("service {0:?} contains whitespace")]
    Whitespace(String),
    #[error("service {input:?} has an invalid scheme {scheme:?} (expected letters, digits, '+', '-', '.')")]
    BadScheme { input: String, scheme: String },
    #[error("service {0:?} has no host")]
    EmptyHost(String),
    #[error("service {input:?} has a path {path:?}; a service is [scheme://]name[.namespace][:port]")]
    Path { input: String, path: String },
    #[error("service {input:?} has an invalid port {port:?} (expected a number)")]
    BadPort { input: String, port: String },
    #[error("service {input:?} has port {port} out of range 1-65535")]
    PortOutOfRange { input: String, port: u64 },
    #[error("service {input:?} has an invalid name {name:?}: {reason}")]
    BadName { input: String, name: String, reason: &'static str },
}

impl ServiceRef {
    /// Parses `spec.service`. Malformed input is an error value, never a panic.
    pub fn parse(input: &str) -> Result<Self, ServiceRefError> {
        if input.is_empty() {
            return Err(ServiceRefError::Empty);
        }
        if input.chars().any(char::is_whitespace) {
            return Err(ServiceRefError::Whitespace(input.to_owned()));
        }
        let (scheme, rest) = match input.split_once("://") {
            Some((scheme, rest)) => {
                let valid = scheme.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
                    && scheme.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
                if !valid {
                    return Err(ServiceRefError::BadScheme { input: input.to_owned(), scheme: scheme.to_owned() });
                }
                (Some(scheme.to_ascii_lowercase()), rest)
            }
            None => (None, input),
        };
        if let Some(at) = rest.find('/') {
            return Err(ServiceRefError::Path { input: input.to_owned(), path: rest[at..].to_owned() });
        }
        let (host, port) = split_host_port(input, rest)?;
        if host.is_empty() {
            return Err(ServiceRefError::EmptyHost(input.to_owned()));
        }
        let host = parse_host(input, host)?;
        Ok(ServiceRef { scheme, host, port })
    }

    /// The service name when the host is a name (the Consul service name, or the
    /// Kubernetes Service name).
    pub fn name(&self) -> Option<&str> {
        match &self.host {
            Host::Service { name, .. } => Some(name),
            Host::Ip(_) => None,
        }
    }

    /// The Kubernetes namespace written after the name, if any.
    pub fn namespace(&self) -> Option<&str> {
        match &self.host {
            Host::Service { namespace, .. } => namespace.as_deref(),
            Host::Ip(_) => None,
        }
    }
}

fn split_host_port<'a>(input: &str, rest: &'a str) -> Result<(&'a str, Option<u16>), ServiceRefError> {
    // `[v6]` or `[v6]:port`
    if let Some(after) = rest.strip_prefix('[') {
        let Some((v6, tail)) = after.split_once(']') else {
            return Err(ServiceRefError::BadName {
                input: input.to_owned(),
                name: rest.to_owned(),
                reason: "unclosed '[' in IPv6 address",
            });
        };
        let port = match tail {
            "" => None,
            t => match t.strip_prefix(':') {
                Some(p) => Some(parse_port(input, p)?),
                None => {
                    return Err(ServiceRefError::BadPort { input: input.to_owned(), port: t.to_owned() });
                }
            },
        };
        return Ok((v6, port));
    }
    match rest.split_once(':') {
        None => Ok((rest, None)),
        Some((host, port)) => Ok((host, Some(parse_port(input, port)?))),
    }
}

fn parse_port(input: &str, port: &str) -> Result<u16, ServiceRefError> {
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ServiceRefError::BadPort { input: input.to_owned(), port: port.to_owned() });
    }
    // Digits only, so the only parse failure left is overflow.
    let value: u64 = port.parse().unwrap_or(u64::MAX);
    match u16::try_from(value) {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(ServiceRefError::PortOutOfRange { input: input.to_owned(), port: value }),
    }
}

fn parse_host(input: &str, host: &str) -> Result<Host, ServiceRefError> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(Host::Ip(ip));
    }
    let mut labels = host.split('.');
    let name = labels.next().unwrap_or_default();
    let namespace = labels.next();
    let bad = |name: &str, reason| ServiceRefError::BadName { input: input.to_owned(), name: name.to_owned(), reason };
    for label in std::iter::once(name).chain(namespace) {
        if label.is_empty() {
            return Err(bad(host, "empty label"));
        }
        if !label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
            return Err(bad(label, "only letters, digits, '-' and '_' are allowed"));
        }
    }
    if labels.any(str::is_empty) {
        return Err(bad(host, "empty label"));
    }
    Ok(Host::Service { name: name.to_owned(), namespace: namespace.map(str::to_owned) })
}

impl fmt::Display for ServiceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(s) = &self.scheme {
            write!(f, "{s}://")?;
        }
        match &self.host {
            Host::Service { name, namespace } => {
                f.write_str(name)?;
                if let Some(ns) = namespace {
                    write!(f, ".{ns}")?;
                }
            }
            Host::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]")?,
            Host::Ip(ip) => write!(f, "{ip}")?,
        }
        if let Some(p) = self.port {
            write!(f, ":{p}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(name: &str, ns: Option<&str>) -> Host {
        Host::Service { name: name.into(), namespace: ns.map(Into::into) }
    }

    #[test]
    fn bare_name() {
        let r = ServiceRef::parse("billing").unwrap();
        assert_eq!(r, ServiceRef { scheme: None, host: svc("billing", None), port: None });
        assert_eq!(r.name(), Some("billing"));
    }

    #[test]
    fn name_and_port() {
        let r = ServiceRef::parse("billing:8080").unwrap();
        assert_eq!(r.host, svc("billing", None));
        assert_eq!(r.port, Some(8080));
    }

    #[test]
    fn scheme_name_port() {
        let r = ServiceRef::parse("HTTPS://billing:8443").unwrap();
        assert_eq!(r.scheme.as_deref(), Some("https"));
        assert_eq!(r.host, svc("billing", None));
        assert_eq!(r.port, Some(8443));
        let r = ServiceRef::parse("http://billing").unwrap();
        assert_eq!((r.scheme.as_deref(), r.port), (Some("http"), None));
    }

    #[test]
    fn name_namespace_port() {
        let r = ServiceRef::parse("billing.payments:80").unwrap();
        assert_eq!(r.host, svc("billing", Some("payments")));
        assert_eq!(r.namespace(), Some("payments"));
        assert_eq!(r.port, Some(80));
        let r = ServiceRef::parse("billing.payments.svc.cluster.local").unwrap();
        assert_eq!(r.host, svc("billing", Some("payments")));
    }

    #[test]
    fn ip_literals_are_not_services() {
        let r = ServiceRef::parse("10.1.2.3:80").unwrap();
        assert_eq!(r.name(), None);
        assert_eq!(r.port, Some(80));
        let r = ServiceRef::parse("[::1]:9000").unwrap();
        assert!(matches!(r.host, Host::Ip(IpAddr::V6(_))));
        assert_eq!(r.to_string(), "[::1]:9000");
    }

    #[test]
    fn display_round_trips() {
        for s in ["billing", "billing:80", "http://billing.ns:80", "10.0.0.1"] {
            assert_eq!(ServiceRef::parse(s).unwrap().to_string(), s);
        }
    }

    #[test]
    fn empty_is_an_error() {
        assert_eq!(ServiceRef::parse(""), Err(ServiceRefError::Empty));
        assert_eq!(ServiceRef::parse(":80"), Err(ServiceRefError::EmptyHost(":80".into())));
        assert!(matches!(ServiceRef::parse("http://"), Err(ServiceRefError::EmptyHost(_))));
    }

    #[test]
    fn spaces_are_an_error() {
        for s in [" billing", "billing ", "bill ing", "billing:\t80"] {
            let e = ServiceRef::parse(s).unwrap_err();
            assert_eq!(e, ServiceRefError::Whitespace(s.into()));
            assert!(e.to_string().contains("whitespace"), "{e}");
        }
    }

    #[test]
    fn bad_port_is_an_error() {
        for (s, p) in [("billing:", ""), ("billing:http", "http"), ("billing:80:81", "80:81"), ("billing:-1", "-1")] {
            let e = ServiceRef::parse(s).unwrap_err();
            assert_eq!(e, ServiceRefError::BadPort { input: s.into(), port: p.into() }, "{s}");
            assert!(e.to_string().contains(s), "message names the input: {e}");
        }
    }

    #[test]
    fn port_out_of_range_is_an_error() {
        for (s, p) in [("billing:0", 0), ("billing:65536", 65536), ("billing:99999999999999999999999", u64::MAX)] {
            assert_eq!(ServiceRef::parse(s), Err(ServiceRefError::PortOutOfRange { input: s.into(), port: p }), "{s}");
        }
        assert_eq!(ServiceRef::parse("billing:65535").unwrap().port, Some(65535));
    }

    #[test]
    fn bad_names_are_errors() {
        assert!(matches!(ServiceRef::parse("bil$ling"), Err(ServiceRefError::BadName { .. })));
        assert!(matches!(ServiceRef::parse("billing..ns"), Err(ServiceRefError::BadName { .. })));
        assert!(matches!(ServiceRef::parse(".ns"), Err(ServiceRefError::BadName { .. })));
        assert!(matches!(ServiceRef::parse("billing.ns."), Err(ServiceRefError::BadName { .. })));
        assert!(matches!(ServiceRef::parse("[::1"), Err(ServiceRefError::BadName { .. })));
        assert!(matches!(ServiceRef::parse("1ttp://x"), Err(ServiceRefError::BadScheme { .. })));
        assert!(matches!(ServiceRef::parse("http://billing/api"), Err(ServiceRefError::Path { .. })));
    }
}

/// Property tests: any string parses or is refused with a message quoting it, never a
/// panic; what parses prints back to itself; every well-formed reference round-trips.
#[cfg(test)]
mod proptests {
    use super::*;
    use proptest::prelude::*;

    fn config() -> ProptestConfig {
        ProptestConfig { cases: 512, ..ProptestConfig::default() }
    }

    /// Strings over the characters that matter to the grammar, so most cases reach deep
    /// into it; and any Unicode at all.
    fn input() -> impl Strategy<Value = String> {
        prop_oneof!["[a-zA-Z0-9:./\\[\\]_+ -]{0,24}", ".{0,24}", "[a-z]{1,6}://[a-z0-9.-]{0,12}(:[0-9]{0,6})?"]
    }

    fn label() -> impl Strategy<Value = String> {
        "[a-zA-Z0-9_][a-zA-Z0-9_-]{0,14}"
    }

    fn well_formed() -> impl Strategy<Value = ServiceRef> {
        let host = prop_oneof![
            (label(), prop::option::of(label())).prop_map(|(name, namespace)| Host::Service { name, namespace }),
            any::<std::net::IpAddr>().prop_map(Host::Ip),
        ];
        (prop::option::of("[a-z][a-z0-9+.-]{0,6}"), host, prop::option::of(1u16..))
            .prop_map(|(scheme, host, port)| ServiceRef { scheme, host, port })
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn any_input_parses_or_is_refused_quoting_it(s in input()) {
            match ServiceRef::parse(&s) {
                Ok(r) => {
                    // What parsed prints to a form that parses to the same reference.
                    prop_assert_eq!(ServiceRef::parse(&r.to_string()), Ok(r.clone()));
                    // Nothing is made up: the parts come from the input.
                    let held = r.scheme.as_ref().map_or(0, String::len)
                        + r.name().map_or(0, str::len)
                        + r.namespace().map_or(0, str::len);
                    prop_assert!(held <= s.len());
                }
                Err(ServiceRefError::Empty) => prop_assert!(s.is_empty()),
                Err(e) => prop_assert!(e.to_string().contains(&format!("{s:?}")), "{e} does not quote {s:?}"),
            }
        }

        #[test]
        fn well_formed_references_round_trip(r in well_formed()) {
            prop_assert_eq!(ServiceRef::parse(&r.to_string()), Ok(r));
        }

        #[test]
        fn kubernetes_suffixes_and_scheme_case_do_not_change_the_reference(
            scheme in prop::option::of("[a-z][a-z0-9+.-]{0,6}"),
            name in label(),
            namespace in label(),
            port in prop::option::of(1u16..),
            upper in any::<bool>(),
        ) {
            let r = ServiceRef { scheme, host: Host::Service { name, namespace: Some(namespace) }, port };
            let mut long = r.to_string();
            if let Some(p) = r.port {
                long.truncate(long.len() - p.to_string().len() - 1);
            }
            long.push_str(".svc.cluster.local");
            if let Some(p) = r.port {
                long.push_str(&format!(":{p}"));
            }
            if upper {
                long = long.replacen(r.scheme.as_deref().unwrap_or_default(), &r.scheme.as_deref().unwrap_or_default().to_ascii_uppercase(), 1);
            }
            prop_assert_eq!(ServiceRef::parse(&long), Ok(r));
        }
    }
}
