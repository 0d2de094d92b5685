//! `--xds-listen`: Envoy reads the snapshot's upstreams over xDS (docs/xds.md). The
//! protocol is the `consul-resolver-xds` crate's; this edge turns each snapshot into what
//! changed for Envoy ([`view`]) and hands it over. Every replica serves it, as every
//! replica serves `/snapshot`.

mod view;

use std::sync::{Arc, Mutex, PoisonError};

use futures::FutureExt;
use futures::future::BoxFuture;

use super::{PublishError, Publisher};
use consul_resolver_core::assembler::Snapshot;
use consul_resolver_xds::XdsServer;

pub(crate) struct XdsPublisher {
    server: XdsServer,
    view: Mutex<Option<view::View>>,
}

impl XdsPublisher {
    pub(crate) fn new(server: XdsServer) -> Self {
        XdsPublisher { server, view: Mutex::new(None) }
    }

    /// Hands what `snapshot` changed to the server; the first snapshot is everything.
    fn hand_over(&self, snapshot: &Snapshot) {
        let mut view = self.view.lock().unwrap_or_else(PoisonError::into_inner);
        let first = view.is_none();
        let mut changes = view.get_or_insert_with(view::View::default).update(&snapshot.content);
        if !first && changes.upserts.is_empty() && changes.removals.is_empty() {
            return;
        }
        changes.complete = first;
        let report = self.server.update(changes);
        for r in report.rejections {
            let endpoint = r.endpoint.as_deref().unwrap_or("(the whole upstream)");
            tracing::warn!(upstream = %r.upstream, endpoint, reason = %r.reason, "xDS: left out, Envoy would refuse it");
        }
    }
}

impl Publisher for XdsPublisher {
    fn name(&self) -> &'static str {
        "xds"
    }

    /// Never fails: the server keeps the view, and each client catches up on its own.
    fn publish(&self, snapshot: Arc<Snapshot>) -> BoxFuture<'static, Result<(), PublishError>> {
        self.hand_over(&snapshot);
        futures::future::ready(Ok(())).boxed()
    }
}
