//! What users write, and what the operator reads of it: the `ConsulResolver` spec (and, with
//! the `crd` feature, the custom resource and its status), read-only models of Ambassador's
//! `Mapping`/`TCPMapping`, the parser for a Mapping's `service`, Kubernetes naming rules, and
//! the CEL rules of the CRD schemas.
//! Plain data without the `crd` feature: the core depends on it without compiling against
//! kube.

pub mod export;
pub mod mapping;
pub mod names;
pub mod resolver;
pub mod rules;
pub mod service;
#[cfg(feature = "crd")]
pub mod status;

/// The Ambassador ID an object belongs to when it names none.
pub const DEFAULT_AMBASSADOR_ID: &str = "default";
