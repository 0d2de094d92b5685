//! consul-resolver-operator: keeps an ingress controller's view of its upstreams complete
//! and current. The pipeline, and where each stage lives, is in docs/architecture.md:
//!
//! ```text
//! sources -> registry -> world -> limiter -> assembler -> publishers
//! ```
//!
//! The pure stages are the `consul-resolver-core` crate (no I/O, time passed in). This crate
//! is the edges around it: `sources` watch Kubernetes and Consul, `publishers` write whole
//! snapshots, `controller` writes each resolver's status, `runtime` drives the core with
//! them. Its public API is small on purpose: the process entry point, and what tests and
//! readers of the snapshot need.

mod cli;
mod controller;
mod crdgen;
mod export;
mod kube_client;
mod leadership;
mod measure;
mod metrics;
mod ops;
mod process;
mod publishers;
mod runtime;
mod sources;
#[cfg(test)]
mod test_fixtures;

pub use process::main;

/// The snapshot ConfigMap format (docs/snapshot.md), for readers of it.
pub mod snapshot_configmap {
    pub use crate::publishers::configmap::{
        ANNOTATION_HASH, ANNOTATION_ID, DATA_BUDGET, Index, KEY_GZIP, KEY_JSON, KEY_PART, LABEL_PART_OF,
        LABEL_SNAPSHOT, MAX_DECODED_BYTES, PartRef, decode, decode_limited, index_of,
    };
}
