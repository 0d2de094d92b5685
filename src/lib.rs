//! consul-resolver-operator: keeps an ingress controller's view of its upstreams complete
//! and current.
//!
//! The pipeline, from design.md, is readable from the module layout:
//!
//! ```text
//! sources -> core::registry -> core::aggregator -> core::limiter -> core::assembler -> publishers
//! ```
//!
//! `core` is pure logic (no I/O, time passed in); `sources` and `publishers` are the edges
//! that talk to Kubernetes, Consul and HTTP; `runtime` drives the core with them.

pub mod api;
pub mod cli;
pub mod controller;
pub mod core;
pub mod crdgen;
pub mod kube_client;
pub mod leadership;
pub mod metrics;
pub mod publishers;
pub mod runtime;
pub mod sources;
#[cfg(test)]
mod test_fixtures;
