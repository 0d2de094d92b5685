//! Pass two: reading. Each target routed to (and each service a resolver lists) gets its
//! endpoints, and whatever starts or stops being read adds or removes its watch in the
//! desired ones ([`super::desired`]).
//! - `consul`: resolvers' services, read through their queries, with the endpoints last
//!   obtained kept for when a query cannot answer (`entry`: one service's entry).
//! - `kube`: the Kubernetes Services routed to, from their own watch or a shared one (their
//!   namespace's or the cluster's), whose objects `shared` indexes by Service.

mod consul;
mod entry;
mod kube;
mod shared;

use std::time::SystemTime;

use super::Config;
use super::resolvers::Resolver;
use super::route::Routes;
use crate::world::World;

pub(crate) use consul::{Services, answered};
pub(crate) use kube::KubeTargets;

/// What pass two reads besides its own state.
pub(crate) struct Inputs<'a> {
    pub(crate) world: &'a World,
    pub(crate) cfg: &'a Config,
    /// The resolvers in scope, sorted by namespace and name.
    pub(crate) resolvers: &'a [Resolver],
    /// Pass one's result.
    pub(crate) routes: &'a Routes,
    /// Stamps the moment a service's endpoints become stale.
    pub(crate) now: SystemTime,
}
