//! Who routes traffic to a target: the key of the routes table.

use consul_resolver_api::mapping::MappingKind;
use consul_resolver_api::names::NamespacedName;

use crate::assembler::snapshot::Problem;
use crate::model::ObjectId;

/// A consumer of targets: what the routes table is keyed by. Each one routes to at most one
/// target (a resolver's Consul service, a Kubernetes Service), and every consumer of one
/// target shares its watch. Sorts as the snapshot's entries do: Mappings by kind, namespace
/// and name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Consumer {
    /// A Mapping or TCPMapping.
    Mapping { kind: MappingKind, id: NamespacedName },
    /// A ConsulService: an export of one Consul service as a Service and EndpointSlices.
    Export(NamespacedName),
}

impl Consumer {
    pub(crate) fn mapping(kind: MappingKind, id: &ObjectId) -> Self {
        Consumer::Mapping { kind, id: NamespacedName::new(id.namespace.clone().unwrap_or_default(), id.name.clone()) }
    }

    pub(crate) fn export(id: &ObjectId) -> Self {
        Consumer::Export(NamespacedName::new(id.namespace.clone().unwrap_or_default(), id.name.clone()))
    }

    /// A problem reported on this consumer's object.
    pub(crate) fn problem(&self, message: String) -> Problem {
        match self {
            Consumer::Mapping { kind, id } => {
                Problem { kind: kind.kind().into(), namespace: id.namespace.clone(), name: id.name.clone(), message }
            }
            Consumer::Export(id) => Problem {
                kind: consul_resolver_api::export::KIND.into(),
                namespace: id.namespace.clone(),
                name: id.name.clone(),
                message,
            },
        }
    }
}
