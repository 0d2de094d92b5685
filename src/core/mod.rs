//! The pure core of the pipeline: no network, no Kubernetes client, no clock reads.
//!
//! sources (edge) -> [registry -> aggregator -> limiter -> assembler] -> publishers (edge)

pub mod aggregator;
pub mod assembler;
pub mod election;
pub mod keys;
pub mod limiter;
pub mod model;
pub mod pipeline;
pub mod registry;

#[cfg(test)]
mod tests;
