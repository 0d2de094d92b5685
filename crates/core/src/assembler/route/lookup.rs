//! Finding the resolver a route names: in its own namespace first, else the one resolver of
//! that name that serves it.

use std::collections::BTreeMap;

use consul_resolver_api::names;

use crate::assembler::resolvers::{self, Resolver};
use crate::world::World;

/// A resolver named by `namespace/name`, or by `name` alone (looked up like a Mapping's
/// `resolver`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolverName {
    pub namespace: Option<String>,
    pub name: String,
}

/// `NAME` or `NAMESPACE/NAME`, each part held to Kubernetes' rule for it (a resolver's name
/// is an object name, an RFC 1123 subdomain; a namespace an RFC 1123 label).
impl std::str::FromStr for ResolverName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (namespace, name) = match s.split_once('/') {
            Some((ns, name)) => (Some(ns), name),
            None => (None, s),
        };
        let bad = |why: &str| format!("{s:?} is not NAME or NAMESPACE/NAME: {why}");
        if let Some(ns) = namespace {
            names::dns1123_label(ns).map_err(|why| bad(&format!("namespace {ns:?} {why}")))?;
        }
        names::dns1123_subdomain(name).map_err(|why| bad(&format!("name {name:?} {why}")))?;
        Ok(ResolverName { namespace: namespace.map(str::to_owned), name: name.to_owned() })
    }
}

impl std::fmt::Display for ResolverName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{ns}/{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

/// Resolver lookup by name: same namespace first, else the single one of that name that
/// serves the Mapping's namespace (`spec.allowedNamespaces`).
#[derive(Debug, Clone, Default)]
pub(crate) struct Lookup {
    /// Positions in the resolver list, by name.
    by_name: BTreeMap<String, Vec<usize>>,
    /// Namespaces' labels, read only when some resolver selects namespaces by them.
    labels: BTreeMap<String, BTreeMap<String, String>>,
}

pub(crate) enum Found {
    One(usize),
    None,
    Ambiguous(Vec<String>),
    /// Resolvers of that name exist, but none serves the Mapping's namespace.
    NotServed(Vec<String>),
}

impl Lookup {
    pub(crate) fn new(resolvers: &[Resolver], world: &World) -> Self {
        let mut by_name: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (i, r) in resolvers.iter().enumerate() {
            by_name.entry(r.name.clone()).or_default().push(i);
        }
        let selecting = resolvers.iter().any(Resolver::selects_namespaces);
        let labels = if selecting { resolvers::namespace_labels(world) } else { BTreeMap::new() };
        Lookup { by_name, labels }
    }

    pub(crate) fn find(&self, resolvers: &[Resolver], from_namespace: &str, name: &ResolverName) -> Found {
        let candidates = self.by_name.get(&name.name).map(Vec::as_slice).unwrap_or_default();
        let in_ns = |ns: &str| candidates.iter().copied().find(|&i| resolvers[i].namespace == ns);
        let serves = |i: usize| resolvers[i].serves(from_namespace, self.labels.get(from_namespace));
        let shown = |i: &usize| format!("{}/{}", resolvers[*i].namespace, resolvers[*i].name);
        if let Some(ns) = &name.namespace {
            return match in_ns(ns) {
                None => Found::None,
                Some(i) if serves(i) => Found::One(i),
                Some(i) => Found::NotServed(vec![shown(&i)]),
            };
        }
        if let Some(i) = in_ns(from_namespace) {
            return Found::One(i);
        }
        // Only those that serve the Mapping's namespace count: a resolver that does not
        // share itself neither answers nor makes the name ambiguous.
        let serving: Vec<usize> = candidates.iter().copied().filter(|&i| serves(i)).collect();
        match (serving.as_slice(), candidates) {
            ([], []) => Found::None,
            ([], others) => Found::NotServed(others.iter().map(shown).collect()),
            ([i], _) => Found::One(*i),
            (many, _) => Found::Ambiguous(many.iter().map(shown).collect()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolver_names_follow_kubernetes_rules() {
        let named = |s: &str| s.parse::<ResolverName>();
        assert_eq!(named("consul"), Ok(ResolverName { namespace: None, name: "consul".into() }));
        assert_eq!(
            named("ops/consul.v2"),
            Ok(ResolverName { namespace: Some("ops".into()), name: "consul.v2".into() })
        );
        assert_eq!(named("ops/consul").unwrap().to_string(), "ops/consul");
        for bad in ["", "/consul", "ops/", "Consul", "ops.x/consul", "ops/a/b", "a..b", "-a"] {
            assert!(named(bad).is_err(), "{bad:?}");
        }
    }
}
