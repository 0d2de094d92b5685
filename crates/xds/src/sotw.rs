//! The state-of-the-world variant (`StreamAggregatedResources`). CDS is wildcard and each
//! response carries every cluster, as the protocol requires; EDS responses carry only the
//! assignments that changed, which the protocol allows for EDS.

use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::protobuf::Any;

use crate::resources::{Kind, set_version};
use crate::session::{Client, Protocol};
use crate::state::View;
use crate::status::Variant;
use crate::tracker::Diff;

pub(crate) struct Sotw {
    client: Client,
    /// The version a client reconnecting says it holds, by kind, until first compared.
    resume: [Option<String>; 2],
}

impl Protocol for Sotw {
    type Request = DiscoveryRequest;
    type Response = DiscoveryResponse;
    const VARIANT: Variant = Variant::Sotw;

    fn node_id(request: &DiscoveryRequest) -> Option<&str> {
        request.node.as_ref().map(|node| node.id.as_str())
    }

    fn new(client: Client) -> Sotw {
        Sotw { client, resume: [None, None] }
    }

    fn client(&self) -> &Client {
        &self.client
    }

    fn receive(&mut self, request: DiscoveryRequest) {
        let error = request.error_detail.as_ref().map(|status| status.message.as_str());
        let (nonce, version) = (&request.response_nonce, Some(request.version_info.as_str()));
        let Some(kind) = self.client.request_for(&request.type_url, nonce, error, version) else { return };
        let tracker = self.client.tracker(kind);
        let first = !tracker.requested;
        tracker.requested = true;
        tracker.owes_answer |= first && kind == Kind::Cluster;
        let names: Vec<String> = request.resource_names.iter().filter(|n| *n != "*").cloned().collect();
        // An empty list is a wildcard request for CDS only (legacy wildcard); `*` for any.
        let wildcard = request.resource_names.iter().any(|n| n == "*")
            || (kind == Kind::Cluster && request.resource_names.is_empty());
        tracker.set_wildcard(wildcard);
        tracker.resubscribe(&names);
        if first && request.response_nonce.is_empty() && !request.version_info.is_empty() {
            self.resume[kind as usize] = Some(request.version_info);
        }
        self.client.held_changed(kind);
    }

    fn respond(&mut self, kind: Kind, view: &View) -> Option<DiscoveryResponse> {
        if view.ready()
            && let Some(version) = self.resume[kind as usize].take()
        {
            self.resume_if_current(kind, view, &version);
        }
        let tracker = self.client.tracker(kind);
        let mut diff = tracker.diff(view)?;
        let resources = match kind {
            Kind::Cluster if diff.is_empty() && !tracker.owes_answer => return None,
            Kind::Cluster => self.all_clusters(view),
            Kind::Endpoints => {
                // Envoy drops an assignment with its cluster: nothing to send for it.
                for name in diff.removed.drain(..) {
                    tracker.forget(&name);
                }
                if diff.changed.is_empty() {
                    return None;
                }
                diff.changed.iter().map(|resource| resource.any.clone()).collect()
            }
        };
        Some(self.response(kind, diff, resources))
    }
}

impl Sotw {
    fn response(&mut self, kind: Kind, diff: Diff, resources: Vec<Any>) -> DiscoveryResponse {
        let nonce = self.client.next_nonce();
        let tracker = self.client.tracker(kind);
        let version_info = set_version(tracker.mix_after(&diff));
        tracker.sent(nonce.clone(), diff);
        let response = DiscoveryResponse {
            version_info,
            resources,
            type_url: kind.type_url().to_owned(),
            nonce,
            ..Default::default()
        };
        self.client.sending(kind, prost::Message::encoded_len(&response));
        response
    }

    /// Every cluster, as this client is to hold it: one it refused at its current version
    /// is sent as the client last accepted it, so sending the whole set never withdraws it.
    fn all_clusters(&mut self, view: &View) -> Vec<Any> {
        let tracker = self.client.tracker(Kind::Cluster);
        // Envoy asks for every cluster; a client naming some is sent those.
        let mut names: Vec<&str> = view.names().filter(|name| tracker.wants(name)).collect();
        names.sort_unstable();
        names
            .into_iter()
            .filter_map(|name| {
                let current = view.get(name)?.get(Kind::Cluster);
                if tracker.quarantined(name) != Some(current.version.as_str()) {
                    return Some(current.any.clone());
                }
                tracker.held(name)?.resource.as_ref().map(|resource| resource.any.clone())
            })
            .collect()
    }

    /// A client reconnecting with the version it would be sent holds that set already:
    /// nothing is resent (an operator restart costs no traffic).
    fn resume_if_current(&mut self, kind: Kind, view: &View, version: &str) {
        let tracker = self.client.tracker(kind);
        if set_version(tracker.current_mix(view)) == version {
            tracker.assume_current(view);
            self.client.resumed(kind, version);
        }
    }
}
