//! Routing one Mapping or export: where its traffic goes, what that reads, and why it
//! cannot go anywhere. Both find their resolver the same way ([`through_resolver`]).

use consul_resolver_api::names::{self, NamespacedName};
use consul_resolver_api::service::{Host, ServiceRef};

use super::lookup::{Found, Lookup, ResolverName};
use super::{Consumer, Entry, Inputs, Routed, Uses};
use crate::assembler::kept::ServiceOf;
use crate::assembler::snapshot::{ExportEntry, MappingEntry, Part, Target, UnusableReason};
use crate::model::{ExportObject, MappingObject};

/// Pass one for one Mapping. `None`: not this operator's (another Ambassador ID).
pub(super) fn route(
    inputs: &Inputs<'_>,
    lookup: &Lookup,
    consumer: &Consumer,
    m: &Result<MappingObject, String>,
) -> Option<Routed> {
    let m = match m {
        Ok(m) => m,
        Err(e) => {
            return Some(Routed {
                entry: None,
                problem: Some(Box::new(consumer.problem(e.clone()))),
                uses: Uses::Nothing,
            });
        }
    };
    if !m.serves_ambassador_id(&inputs.cfg.ambassador_id) {
        return None;
    }
    let (target, uses, why) = match &m.target {
        Err(e) => (Target::Unresolved, Uses::Nothing, Some(format!("spec.service: {e}"))),
        Ok(svc) => target(inputs, lookup, m, svc),
    };
    let entry = MappingEntry {
        kind: m.kind.kind().into(),
        namespace: m.namespace.clone(),
        name: m.name.clone(),
        service: m.service.clone(),
        target,
    };
    Some(Routed {
        entry: Some(Entry::Mapping(Part::new(entry))),
        problem: why.map(|why| Box::new(consumer.problem(why))),
        uses,
    })
}

/// Pass one for one export. `None`: not this operator's (another Ambassador ID). Its
/// problems are on its own status, not in the snapshot's `problems` (Ambassador's).
pub(super) fn route_export(
    inputs: &Inputs<'_>,
    lookup: &Lookup,
    consumer: &Consumer,
    e: &ExportObject,
) -> Option<Routed> {
    let Consumer::Export(id) = consumer else { return None };
    let entry = |service: &str, resolver: Option<String>, problem: Option<String>| ExportEntry {
        namespace: id.namespace.clone(),
        name: id.name.clone(),
        generation: e.generation,
        service: service.to_owned(),
        resolver,
        problem,
        resolver_unusable: false,
        source: None,
    };
    let spec = match &e.spec {
        Ok(spec) => spec,
        Err(why) => {
            return Some(Routed {
                entry: Some(Entry::Export(Box::new(entry("", None, Some(why.clone()))))),
                problem: None,
                uses: Uses::Nothing,
            });
        }
    };
    if !spec.serves_ambassador_id(&inputs.cfg.ambassador_id) {
        return None;
    }
    let wanted = match (&spec.resolver, &inputs.cfg.default_resolver) {
        (Some(r), _) => Ok(ResolverName { namespace: None, name: r.clone() }),
        (None, Some(d)) => Ok(d.clone()),
        (None, None) => Err("spec.resolver is not set and the operator has no --default-resolver".to_owned()),
    };
    let through = wanted
        .map_err(NoRoute::NoResolver)
        .and_then(|w| through_resolver(inputs, lookup, &id.namespace, &w, &spec.service, "ConsulServices"));
    let (entry, uses) = match through {
        Ok(resolver) => {
            (entry(&spec.service, Some(resolver.to_string()), None), Uses::Consul(resolver, spec.service.clone()))
        }
        Err(NoRoute::Unusable(why)) => {
            (ExportEntry { resolver_unusable: true, ..entry(&spec.service, None, Some(why)) }, Uses::Nothing)
        }
        Err(NoRoute::NoResolver(why)) => (entry(&spec.service, None, Some(why)), Uses::Nothing),
    };
    Some(Routed { entry: Some(Entry::Export(Box::new(entry))), problem: None, uses })
}

/// Why an object cannot be read through a resolver.
enum NoRoute {
    /// No resolver serves it: none of that name, one that does not admit the namespace, an
    /// ambiguous name, or none named.
    NoResolver(String),
    /// Its resolver exists but cannot be used now (its spec, or a Secret it names), and
    /// nothing obtained through it is kept.
    Unusable(String),
}

impl NoRoute {
    fn message(self) -> String {
        match self {
            NoRoute::NoResolver(why) | NoRoute::Unusable(why) => why,
        }
    }
}

/// The resolver `wanted` by an object in `from` (whose kind, plural, is `what`) to read
/// `service` through, or why none can be used.
fn through_resolver(
    inputs: &Inputs<'_>,
    lookup: &Lookup,
    from: &str,
    wanted: &ResolverName,
    service: &str,
    what: &str,
) -> Result<NamespacedName, NoRoute> {
    match lookup.find(inputs.resolvers, from, wanted) {
        Found::One(i) => {
            let r = &inputs.resolvers[i];
            let resolver = r.id();
            match &r.settings {
                // Unless served from the endpoints last obtained, or waiting a moment for a
                // Secret: then the route stands.
                Err(u)
                    if u.reason != UnusableReason::WaitingForSecret
                        && inputs.kept.get(&ServiceOf::new(&resolver, service)).is_none() =>
                {
                    Err(NoRoute::Unusable(format!("resolver {resolver} cannot be used: {}", u.message)))
                }
                _ => Ok(resolver),
            }
        }
        Found::None => Err(NoRoute::NoResolver(format!(
            "resolver {:?}: no ConsulResolver of that name in {from} or any other watched namespace",
            wanted.to_string(),
        ))),
        Found::NotServed(all) => Err(NoRoute::NoResolver(format!(
            "resolver {} does not serve {what} from namespace {from}: its spec.allowedNamespaces does not admit it (absent, only its own namespace; `from: All`, or `from: Selector` with the namespace's labels, shares it)",
            all.join(", "),
        ))),
        Found::Ambiguous(all) => Err(NoRoute::NoResolver(format!(
            "resolver {:?} is ambiguous: no ConsulResolver of that name in {from}, and several elsewhere ({}); name one in the {} namespace",
            wanted.name,
            all.join(", "),
            if what == "Mappings" { "Mapping's" } else { "export's" },
        ))),
    }
}

/// The target of a Mapping whose `service` parsed, what it reads, and why it cannot be
/// routed.
fn target(inputs: &Inputs<'_>, lookup: &Lookup, m: &MappingObject, svc: &ServiceRef) -> (Target, Uses, Option<String>) {
    let unresolved = |why: String| (Target::Unresolved, Uses::Nothing, Some(why));
    let (name, namespace) = match &svc.host {
        Host::Ip(_) => {
            let address = ServiceRef { scheme: None, ..svc.clone() }.to_string();
            return (Target::Address { address }, Uses::Nothing, None);
        }
        Host::Service { name, namespace } => (name, namespace),
    };
    let wanted = match (&m.resolver, &inputs.cfg.default_resolver) {
        (Some(r), _) => ResolverName { namespace: None, name: r.clone() },
        (None, Some(d)) => d.clone(),
        (None, None) => {
            let ns = namespace.clone().unwrap_or_else(|| m.namespace.clone());
            // The name goes into a label or field selector: check it first.
            if let Err(why) = names::dns1035_label(name) {
                return unresolved(format!("spec.service: {name:?} is not a valid Kubernetes Service name: it {why}"));
            }
            if let Err(why) = names::dns1123_label(&ns) {
                return unresolved(format!("spec.service: {ns:?} is not a valid namespace: it {why}"));
            }
            let target = Target::Kubernetes { namespace: ns.clone(), service: name.clone(), port: svc.port };
            return (target, Uses::Kube(NamespacedName::new(ns, name.clone())), None);
        }
    };
    match through_resolver(inputs, lookup, &m.namespace, &wanted, name, "Mappings") {
        Ok(resolver) => {
            let target = Target::Consul {
                resolver_namespace: resolver.namespace.clone(),
                resolver_name: resolver.name.clone(),
                service: name.clone(),
                port: svc.port,
            };
            (target, Uses::Consul(resolver, name.clone()), None)
        }
        Err(no) => unresolved(no.message()),
    }
}
