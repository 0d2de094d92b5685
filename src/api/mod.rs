//! Kubernetes-facing resource types: our `ConsulResolver` CRD and read-only models of
//! Ambassador's `Mapping`/`TCPMapping`, plus the parser for a Mapping's `service`.

pub mod mapping;
pub mod names;
pub mod resolver;
pub mod service;

pub use mapping::{Mapping, MappingKind, MappingSpec};
pub use resolver::{ConsulResolver, ConsulResolverSpec, ConsulResolverStatus};
pub use service::{ServiceRef, ServiceRefError};

/// The Ambassador ID an object belongs to when it names none.
pub const DEFAULT_AMBASSADOR_ID: &str = "default";
