//! The incremental variant (`DeltaAggregatedResources`): each response carries the
//! resources that changed and the names of those gone. A reconnecting client's
//! `initial_resource_versions` count as held, so an operator restart resends nothing that
//! did not change.

use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource};

use crate::resources::{Kind, set_version};
use crate::session::{Client, Protocol};
use crate::state::View;
use crate::status::Variant;

pub(crate) struct Delta {
    client: Client,
}

impl Protocol for Delta {
    type Request = DeltaDiscoveryRequest;
    type Response = DeltaDiscoveryResponse;
    const VARIANT: Variant = Variant::Delta;

    fn node_id(request: &DeltaDiscoveryRequest) -> Option<&str> {
        request.node.as_ref().map(|node| node.id.as_str())
    }

    fn new(client: Client) -> Delta {
        Delta { client }
    }

    fn client(&self) -> &Client {
        &self.client
    }

    fn receive(&mut self, request: DeltaDiscoveryRequest) {
        let error = request.error_detail.as_ref().map(|status| status.message.as_str());
        let Some(kind) = self.client.request_for(&request.type_url, &request.response_nonce, error, None) else {
            return;
        };
        let tracker = self.client.tracker(kind);
        if !tracker.requested {
            tracker.requested = true;
            for (name, version) in &request.initial_resource_versions {
                tracker.assume_held(name, version);
            }
            // A first CDS request naming nothing is a wildcard request.
            if kind == Kind::Cluster && request.resource_names_subscribe.is_empty() {
                tracker.set_wildcard(true);
                // Answered even when no cluster is served, unless it resumes.
                tracker.owes_answer = request.initial_resource_versions.is_empty();
            }
            if !request.initial_resource_versions.is_empty() {
                let held = tracker.held_version();
                self.client.resumed(kind, &held);
            }
        }
        let tracker = self.client.tracker(kind);
        for name in &request.resource_names_subscribe {
            tracker.subscribe(name);
        }
        for name in &request.resource_names_unsubscribe {
            tracker.unsubscribe(name);
        }
        self.client.held_changed(kind);
    }

    fn respond(&mut self, kind: Kind, view: &View) -> Option<DeltaDiscoveryResponse> {
        let tracker = self.client.tracker(kind);
        let diff = tracker.diff(view)?;
        if diff.is_empty() && !tracker.owes_answer {
            return None;
        }
        let nonce = self.client.next_nonce();
        let tracker = self.client.tracker(kind);
        let resources = diff
            .changed
            .iter()
            .map(|resource| Resource {
                name: resource.name.clone(),
                version: resource.version.clone(),
                resource: Some(resource.any.clone()),
                ..Default::default()
            })
            .collect();
        let response = DeltaDiscoveryResponse {
            system_version_info: set_version(tracker.mix_after(&diff)),
            resources,
            type_url: kind.type_url().to_owned(),
            removed_resources: diff.removed.clone(),
            nonce: nonce.clone(),
            ..Default::default()
        };
        tracker.sent(nonce, diff);
        self.client.sending(kind, prost::Message::encoded_len(&response));
        Some(response)
    }
}
