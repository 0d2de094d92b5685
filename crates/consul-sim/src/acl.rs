//! A deliberately small model of Consul's ACL system: enough to test how a client presents a
//! token and how it copes with the three outcomes (403 `ACL not found`, 403 `Permission
//! denied`, and silently filtered health lists).
//!
//! Tokens are configured at start; a token is either `management` (everything) or may read
//! services whose names start with one of its prefixes (Consul's `service_prefix "..." {
//! policy = "read" }`). Node rules are not modelled: reading a service implies reading the
//! nodes it runs on. Writes (catalog register/deregister) need a management token.

use std::fmt;
use std::str::FromStr;

use hyper::HeaderMap;

/// What a token may do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenPolicy {
    /// Everything, including catalog writes.
    Management,
    /// `service:read` on every service whose name starts with one of these prefixes (an empty
    /// prefix matches all services). No writes.
    ServiceRead(Vec<String>),
}

/// One configured ACL token.
#[derive(Clone, PartialEq, Eq)]
pub struct AclToken {
    /// The secret a client presents.
    pub secret: String,
    pub policy: TokenPolicy,
}

impl fmt::Debug for AclToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Secrets stay out of logs even in a test tool.
        f.debug_struct("AclToken").field("secret", &"<redacted>").field("policy", &self.policy).finish()
    }
}

impl AclToken {
    pub fn management(secret: impl Into<String>) -> Self {
        AclToken { secret: secret.into(), policy: TokenPolicy::Management }
    }

    pub fn service_read<I, S>(secret: impl Into<String>, prefixes: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        AclToken {
            secret: secret.into(),
            policy: TokenPolicy::ServiceRead(prefixes.into_iter().map(Into::into).collect()),
        }
    }
}

/// Parses the `--acl-token` syntax: `SECRET=management` or
/// `SECRET=service-read:PREFIX[,PREFIX...]` (`SECRET=service-read:` reads every service).
impl FromStr for AclToken {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (secret, policy) = s
            .rsplit_once('=')
            .ok_or_else(|| "expected SECRET=management or SECRET=service-read:PREFIX,...".to_owned())?;
        if secret.is_empty() {
            return Err("empty token secret".to_owned());
        }
        if policy == "management" {
            return Ok(AclToken::management(secret));
        }
        if let Some(prefixes) = policy.strip_prefix("service-read:") {
            let prefixes: Vec<&str> = if prefixes.is_empty() { vec![""] } else { prefixes.split(',').collect() };
            return Ok(AclToken::service_read(secret, prefixes));
        }
        Err(format!("unknown policy {policy:?}: expected management or service-read:PREFIX,..."))
    }
}

/// ACL settings. `Config::acl = None` means ACLs are disabled (tokens are ignored).
#[derive(Clone, Debug, Default)]
pub struct AclConfig {
    pub tokens: Vec<AclToken>,
    /// Whether requests without a token (the anonymous token) may read every service.
    /// If false (default-deny), anonymous health lists come back filtered to `[]`.
    pub anonymous_read: bool,
}

/// Where the request's token came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenSource {
    /// `?token=` (deprecated).
    Query,
    /// `X-Consul-Token`.
    Header,
    /// `Authorization: Bearer`.
    Bearer,
}

/// Extracts the token in Consul's order of precedence: `?token=`, then `X-Consul-Token`,
/// then `Authorization: Bearer`. Empty values count as absent.
pub(crate) fn extract_token(query_token: Option<&str>, headers: &HeaderMap) -> Option<(String, TokenSource)> {
    if let Some(t) = query_token.filter(|t| !t.is_empty()) {
        return Some((t.to_owned(), TokenSource::Query));
    }
    if let Some(t) =
        headers.get("x-consul-token").and_then(|v| v.to_str().ok()).map(str::trim).filter(|t| !t.is_empty())
    {
        return Some((t.to_owned(), TokenSource::Header));
    }
    let auth = headers.get(hyper::header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, rest) = auth.split_once(' ')?;
    let token = rest.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then(|| (token.to_owned(), TokenSource::Bearer))
}

/// Who is asking.
#[derive(Debug)]
pub(crate) enum Identity<'a> {
    /// ACLs are disabled: everything is allowed.
    Unrestricted,
    /// No token while ACLs are enabled.
    Anonymous {
        read_all: bool,
    },
    Token(&'a AclToken),
}

/// The presented token is unknown: 403 `ACL not found`.
#[derive(Debug)]
pub(crate) struct AclNotFound;

impl<'a> Identity<'a> {
    pub(crate) fn resolve(acl: Option<&'a AclConfig>, token: Option<&str>) -> Result<Self, AclNotFound> {
        let Some(acl) = acl else {
            return Ok(Identity::Unrestricted);
        };
        match token {
            None => Ok(Identity::Anonymous { read_all: acl.anonymous_read }),
            Some(secret) => acl.tokens.iter().find(|t| t.secret == secret).map(Identity::Token).ok_or(AclNotFound),
        }
    }

    pub(crate) fn can_read_service(&self, name: &str) -> bool {
        match self {
            Identity::Unrestricted => true,
            Identity::Anonymous { read_all } => *read_all,
            Identity::Token(t) => match &t.policy {
                TokenPolicy::Management => true,
                TokenPolicy::ServiceRead(prefixes) => prefixes.iter().any(|p| name.starts_with(p.as_str())),
            },
        }
    }

    pub(crate) fn can_write(&self) -> bool {
        match self {
            Identity::Unrestricted => true,
            Identity::Anonymous { .. } => false,
            Identity::Token(t) => t.policy == TokenPolicy::Management,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cli_syntax() {
        assert_eq!("root=management".parse(), Ok(AclToken::management("root")));
        assert_eq!("t1=service-read:web,api".parse(), Ok(AclToken::service_read("t1", ["web", "api"])));
        assert_eq!("t2=service-read:".parse(), Ok(AclToken::service_read("t2", [""])));
        assert!("t3".parse::<AclToken>().is_err());
        assert!("=management".parse::<AclToken>().is_err());
        assert!("t4=write".parse::<AclToken>().is_err());
        assert!(!format!("{:?}", AclToken::management("s3cr3t")).contains("s3cr3t"));
    }

    #[test]
    fn token_precedence() {
        let mut h = HeaderMap::new();
        h.insert("authorization", "Bearer b".parse().unwrap());
        assert_eq!(extract_token(None, &h), Some(("b".into(), TokenSource::Bearer)));
        h.insert("x-consul-token", "x".parse().unwrap());
        assert_eq!(extract_token(None, &h), Some(("x".into(), TokenSource::Header)));
        assert_eq!(extract_token(Some("q"), &h), Some(("q".into(), TokenSource::Query)));
        assert_eq!(extract_token(None, &HeaderMap::new()), None);
    }

    #[test]
    fn policies() {
        let acl = AclConfig {
            tokens: vec![AclToken::management("m"), AclToken::service_read("r", ["web"])],
            anonymous_read: false,
        };
        assert!(Identity::resolve(Some(&acl), Some("nope")).is_err());
        let r = Identity::resolve(Some(&acl), Some("r")).unwrap();
        assert!(r.can_read_service("web-1") && !r.can_read_service("api") && !r.can_write());
        let m = Identity::resolve(Some(&acl), Some("m")).unwrap();
        assert!(m.can_read_service("api") && m.can_write());
        let anon = Identity::resolve(Some(&acl), None).unwrap();
        assert!(!anon.can_read_service("web") && !anon.can_write());
        let off = Identity::resolve(None, Some("whatever")).unwrap();
        assert!(off.can_read_service("x") && off.can_write());
    }
}
