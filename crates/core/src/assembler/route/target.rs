//! Routing one Mapping: where its traffic goes, what that reads, and why it cannot go
//! anywhere.

use consul_resolver_api::names::{self, NamespacedName};
use consul_resolver_api::service::{Host, ServiceRef};

use super::lookup::{Found, Lookup, ResolverName};
use super::{Consumer, Inputs, Routed, Uses};
use crate::assembler::kept::ServiceOf;
use crate::assembler::snapshot::{MappingEntry, Part, Target, UnusableReason};
use crate::model::MappingObject;

/// Pass one for one Mapping. `None`: not this operator's (another Ambassador ID).
pub(super) fn route(
    inputs: &Inputs<'_>,
    lookup: &Lookup,
    consumer: &Consumer,
    m: &Result<MappingObject, String>,
) -> Option<Routed> {
    let m = match m {
        Ok(m) => m,
        Err(e) => return Some(Routed { entry: None, problem: Some(consumer.problem(e.clone())), uses: Uses::Nothing }),
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
    Some(Routed { entry: Some(Part::new(entry)), problem: why.map(|why| consumer.problem(why)), uses })
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
    match lookup.find(inputs.resolvers, &m.namespace, &wanted) {
        Found::One(i) => {
            let r = &inputs.resolvers[i];
            let resolver = r.id();
            match &r.settings {
                // Unless served from the endpoints last obtained, or waiting a moment for a
                // Secret: then the Mapping keeps its route.
                Err(u)
                    if u.reason != UnusableReason::WaitingForSecret
                        && inputs.kept.get(&ServiceOf::new(&resolver, name)).is_none() =>
                {
                    unresolved(format!("resolver {resolver} cannot be used: {}", u.message))
                }
                _ => {
                    let target = Target::Consul {
                        resolver_namespace: r.namespace.clone(),
                        resolver_name: r.name.clone(),
                        service: name.clone(),
                        port: svc.port,
                    };
                    (target, Uses::Consul(resolver, name.clone()), None)
                }
            }
        }
        Found::None => unresolved(format!(
            "resolver {:?}: no ConsulResolver of that name in {} or any other watched namespace",
            wanted.to_string(),
            m.namespace
        )),
        Found::NotServed(all) => unresolved(format!(
            "resolver {} does not serve Mappings from namespace {}: its spec.allowedNamespaces does not admit it (absent, only its own namespace; `from: All`, or `from: Selector` with the namespace's labels, shares it)",
            all.join(", "),
            m.namespace
        )),
        Found::Ambiguous(all) => unresolved(format!(
            "resolver {:?} is ambiguous: no ConsulResolver of that name in {}, and several elsewhere ({}); name one in the Mapping's namespace",
            wanted.name,
            m.namespace,
            all.join(", ")
        )),
    }
}
