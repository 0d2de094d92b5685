//! Behaviour of the core as a whole: the pipeline driven by events and a paused clock.
//!
//! One module a subject; the worlds they start from are built by [`fixtures`].

mod bootstrap;
mod consul_watches;
mod exports;
mod fixtures;
mod incremental;
mod kept_endpoints;
mod kube_services;
mod publication;
mod resolvers;
mod secrets;
