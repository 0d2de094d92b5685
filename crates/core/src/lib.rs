//! The pure core of the pipeline: no network, no Kubernetes client, no clock reads (time is
//! passed in, so everything here is tested on a paused clock). See docs/architecture.md.
//!
//! ```text
//! sources (edge) -> registry -> world -> limiter -> assembler -> publishers (edge)
//! ```

pub mod assembler;
pub mod delta;
pub mod election;
pub mod export;
mod ingest;
pub mod keys;
pub mod limiter;
pub mod model;
pub mod pipeline;
pub mod registry;
#[cfg(any(test, feature = "test-support"))]
pub mod test_support;
pub mod world;

#[cfg(test)]
mod tests;

/// The unit tests' allocator counts heap bytes (memory bounds are tested).
#[cfg(test)]
#[global_allocator]
static ALLOCATOR: heap_peak::Counting = heap_peak::Counting;
