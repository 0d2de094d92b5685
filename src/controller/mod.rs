//! The two controllers fed from the published snapshot: ConsulResolver statuses and Events
//! (`resolver`), and ConsulService exports (`export`). Neither lists or watches: their
//! stores are fed from the world (`feed`), which already watches both kinds.

pub(crate) mod conditions;
pub(crate) mod export;
pub(crate) mod feed;
pub(crate) mod resolver;

// The names the rest of the crate reaches the resolver controller by.
pub(crate) use resolver::{ResolverController, events, metrics};
