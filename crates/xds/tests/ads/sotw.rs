//! The state-of-the-world variant.

use consul_resolver_xds::{Changes, RejectReason, XdsConfig};
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryResponse;
use prost::Message;
use tonic::Code;

use crate::support::{CDS, EDS, Harness, Sotw, complete, names, upserts, upstream};

/// A client holding clusters `a`, `b` and `c` and their assignments, everything ACKed.
async fn settled(harness: &Harness) -> (Sotw, DiscoveryResponse, DiscoveryResponse) {
    harness.server.update(complete(vec![
        upstream("a", &[("10.0.0.1", 80)]),
        upstream("b", &[("10.0.0.2", 80)]),
        upstream("c", &[("10.0.0.3", 80)]),
    ]));
    let mut client = Sotw::open(harness.channel().await, "envoy-1").await.unwrap();
    client.request(CDS, &[], "", "");
    let clusters = client.recv().await;
    assert_eq!(clusters.type_url, CDS);
    assert_eq!(names(&clusters.resources), vec!["a", "b", "c"]);
    client.ack(&clusters, &[]);
    client.request(EDS, &["a", "b", "c"], "", "");
    let assignments = client.recv().await;
    assert_eq!(names(&assignments.resources), vec!["a", "b", "c"]);
    client.ack(&assignments, &["a", "b", "c"]);
    (client, clusters, assignments)
}

#[tokio::test]
async fn nothing_is_sent_before_the_first_update() {
    let harness = Harness::start(XdsConfig::default()).await;
    let mut client = Sotw::open(harness.channel().await, "envoy-1").await.unwrap();
    client.request(CDS, &[], "", "");
    client.silent().await;
    harness.server.update(complete(vec![upstream("a", &[("10.0.0.1", 80)])]));
    assert_eq!(names(&client.recv().await.resources), vec!["a"]);
    // Stopping ends the stream, telling the client to go elsewhere.
    harness.stop().await;
    assert_eq!(client.failure().await.code(), Code::Unavailable);
}

#[tokio::test]
async fn a_first_request_is_answered_even_when_no_cluster_is_served() {
    let harness = Harness::start(XdsConfig::default()).await;
    harness.server.update(complete(vec![]));
    let mut client = Sotw::open(harness.channel().await, "envoy-1").await.unwrap();
    client.request(CDS, &[], "", "");
    let empty = client.recv().await;
    assert!(empty.resources.is_empty());
    client.ack(&empty, &[]);
    client.silent().await;
    harness.server.update(upserts(vec![upstream("a", &[("10.0.0.1", 80)])]));
    assert_eq!(names(&client.recv().await.resources), vec!["a"]);
    harness.stop().await;
}

#[tokio::test]
async fn an_endpoint_change_sends_that_one_assignment_only() {
    let harness = Harness::start(XdsConfig::default()).await;
    let (mut client, _, _) = settled(&harness).await;
    harness.server.update(upserts(vec![upstream("b", &[("10.0.0.2", 80), ("10.0.0.9", 80)])]));
    let response = client.recv().await;
    assert_eq!(response.type_url, EDS, "the cluster itself did not change");
    assert_eq!(response.resources.len(), 1);
    let assignment = ClusterLoadAssignment::decode(response.resources[0].value.as_slice()).unwrap();
    assert_eq!(assignment.cluster_name, "b");
    assert_eq!(assignment.endpoints[0].lb_endpoints.len(), 2);
    // Nothing else rides along: the response is that assignment and its envelope.
    let alone = DiscoveryResponse { resources: vec![response.resources[0].clone()], ..response.clone() };
    assert_eq!(response.encoded_len(), alone.encoded_len());
    assert_eq!(response.resources[0].value.len(), assignment.encoded_len());
    client.ack(&response, &["a", "b", "c"]);
    client.silent().await;
    harness.stop().await;
}

#[tokio::test]
async fn an_ack_moves_the_version_the_client_is_reported_to_hold() {
    let harness = Harness::start(XdsConfig::default()).await;
    let (mut client, clusters, assignments) = settled(&harness).await;
    harness.server.update(upserts(vec![upstream("a", &[("10.0.0.5", 80)])]));
    let changed = client.recv().await;
    assert_ne!(changed.version_info, assignments.version_info);
    client.ack(&changed, &["a", "b", "c"]);
    client.silent().await;
    let status = harness.server.clients();
    assert_eq!(status.len(), 1);
    let eds = &status[0].types[EDS];
    assert_eq!(eds.acked_version.as_deref(), Some(changed.version_info.as_str()));
    assert_eq!(eds.acked_nonce.as_deref(), Some(changed.nonce.as_str()));
    assert_eq!(eds.resources, 3);
    assert_eq!(status[0].types[CDS].acked_version.as_deref(), Some(clusters.version_info.as_str()));
    assert_eq!(status[0].node_id, "envoy-1");
    assert!(status[0].peer.as_deref().is_some_and(|peer| peer.starts_with("127.0.0.1:")));
    assert_eq!(harness.metric("consul_resolver_xds_acks_total", "eds"), 2.0);
    harness.stop().await;
}

#[tokio::test]
async fn a_refused_resource_is_held_back_from_that_client_only_at_that_version() {
    let harness = Harness::start(XdsConfig::default()).await;
    let (mut client, _, assignments) = settled(&harness).await;
    harness.server.update(upserts(vec![upstream("a", &[("10.0.0.5", 80)]), upstream("b", &[("10.0.0.6", 80)])]));
    let both = client.recv().await;
    assert_eq!(names(&both.resources), vec!["a", "b"]);
    let message = "EDS update rejected for cluster b: malformed endpoint";
    client.nack(&both, &["a", "b", "c"], &assignments.version_info, message);
    // `a` counts as accepted, `b` is not offered again at this version.
    client.silent().await;
    let nack = harness.server.clients()[0].types[EDS].last_nack.clone().expect("the NACK is reported");
    assert_eq!(nack.quarantined, vec!["b"]);
    assert!(!nack.whole_response);
    assert_eq!(nack.message, message);
    assert_eq!(harness.metric("consul_resolver_xds_quarantined_total", "eds"), 1.0);

    harness.server.update(upserts(vec![upstream("c", &[("10.0.0.7", 80)])]));
    let other = client.recv().await;
    assert_eq!(names(&other.resources), vec!["c"], "another cluster's change still flows");
    client.ack(&other, &["a", "b", "c"]);
    harness.server.update(upserts(vec![upstream("b", &[("10.0.0.8", 80)])]));
    let retried = client.recv().await;
    assert_eq!(names(&retried.resources), vec!["b"], "a new version of the refused one is tried");
    harness.stop().await;
}

#[tokio::test]
async fn a_refusal_naming_nothing_holds_back_everything_the_response_changed() {
    let harness = Harness::start(XdsConfig::default()).await;
    let (mut client, _, assignments) = settled(&harness).await;
    harness.server.update(upserts(vec![upstream("a", &[("10.0.0.5", 80)]), upstream("b", &[("10.0.0.6", 80)])]));
    let both = client.recv().await;
    client.nack(&both, &["a", "b", "c"], &assignments.version_info, "something went wrong");
    client.silent().await;
    let nack = harness.server.clients()[0].types[EDS].last_nack.clone().unwrap();
    assert_eq!(nack.quarantined, vec!["a", "b"]);
    assert!(nack.whole_response);
    harness.server.update(upserts(vec![upstream("c", &[("10.0.0.7", 80)])]));
    assert_eq!(names(&client.recv().await.resources), vec!["c"]);
    harness.stop().await;
}

#[tokio::test]
async fn clusters_come_and_go_as_a_whole_set_and_new_subscriptions_are_answered_at_once() {
    let harness = Harness::start(XdsConfig::default()).await;
    let (mut client, _, _) = settled(&harness).await;
    harness.server.update(Changes {
        upserts: vec![upstream("d", &[("10.0.0.4", 80)])],
        removals: vec!["a".to_owned()],
        complete: false,
    });
    let clusters = client.recv().await;
    assert_eq!(clusters.type_url, CDS);
    assert_eq!(names(&clusters.resources), vec!["b", "c", "d"]);
    client.ack(&clusters, &[]);
    // Envoy asks for the new cluster's assignment (and drops the removed one's).
    client.request(EDS, &["b", "c", "d"], "", "");
    let added = client.recv().await;
    assert_eq!(names(&added.resources), vec!["d"]);
    client.ack(&added, &["b", "c", "d"]);
    // The removed cluster's assignment is never pushed again, even re-requested.
    client.request(EDS, &["a", "b", "c", "d"], &added.version_info, &added.nonce);
    client.silent().await;
    harness.stop().await;
}

#[tokio::test]
async fn a_client_reconnecting_with_the_current_version_is_sent_nothing() {
    let harness = Harness::start(XdsConfig::default()).await;
    let (_client, clusters, assignments) = settled(&harness).await;
    let mut again = Sotw::open(harness.channel().await, "envoy-1").await.unwrap();
    again.request(CDS, &[], &clusters.version_info, "");
    again.request(EDS, &["a", "b", "c"], &assignments.version_info, "");
    again.silent().await;
    harness.server.update(upserts(vec![upstream("c", &[("10.0.0.7", 80)])]));
    assert_eq!(names(&again.recv().await.resources), vec!["c"]);
    // One holding something else is sent the current set.
    let mut stale = Sotw::open(harness.channel().await, "envoy-2").await.unwrap();
    stale.request(CDS, &[], "an-old-version", "");
    assert_eq!(names(&stale.recv().await.resources), vec!["a", "b", "c"]);
    harness.stop().await;
}

#[tokio::test]
async fn a_refused_cluster_stays_out_while_the_others_flow() {
    let harness = Harness::start(XdsConfig::default()).await;
    let (mut client, clusters, _) = settled(&harness).await;
    harness.server.update(upserts(vec![upstream("d", &[("10.0.0.4", 80)]), upstream("e", &[("10.0.0.5", 80)])]));
    let added = client.recv().await;
    assert_eq!(names(&added.resources), vec!["a", "b", "c", "d", "e"]);
    let message = "Error adding/updating cluster(s) d: refused for the test";
    client.nack(&added, &[], &clusters.version_info, message);
    client.silent().await;
    let status = harness.server.clients();
    assert_eq!(status[0].types[CDS].last_nack.as_ref().unwrap().quarantined, vec!["d"]);
    assert_eq!(status[0].types[CDS].resources, 4, "e counts as accepted");
    harness.server.update(upserts(vec![upstream("f", &[("10.0.0.6", 80)])]));
    let next = client.recv().await;
    assert_eq!(names(&next.resources), vec!["a", "b", "c", "e", "f"], "the refused cluster is not offered again");
    harness.stop().await;
}

#[tokio::test]
async fn a_version_is_the_content_it_describes() {
    let harness = Harness::start(XdsConfig::default()).await;
    let (mut client, clusters, assignments) = settled(&harness).await;
    harness.server.update(upserts(vec![upstream("a", &[("10.0.0.5", 80)])]));
    let changed = client.recv().await;
    assert_ne!(changed.version_info, assignments.version_info);
    client.ack(&changed, &["a", "b", "c"]);
    harness.server.update(upserts(vec![upstream("a", &[("10.0.0.1", 80)])]));
    let back = client.recv().await;
    assert_eq!(back.version_info, assignments.version_info, "the same content has the same version");
    // Another server fed the same upstreams in another order serves the same versions.
    let other = Harness::start(XdsConfig::default()).await;
    other.server.update(complete(vec![
        upstream("c", &[("10.0.0.3", 80)]),
        upstream("a", &[("10.0.0.1", 80)]),
        upstream("b", &[("10.0.0.2", 80)]),
    ]));
    let mut elsewhere = Sotw::open(other.channel().await, "envoy-2").await.unwrap();
    elsewhere.request(CDS, &[], "", "");
    assert_eq!(elsewhere.recv().await.version_info, clusters.version_info);
    other.stop().await;
    harness.stop().await;
}

#[tokio::test]
async fn an_endpoint_envoy_would_refuse_is_left_out_and_reported() {
    let harness = Harness::start(XdsConfig::default()).await;
    let report = harness.server.update(complete(vec![upstream("a", &[("10.0.0.1", 80), ("web.example", 80)])]));
    assert_eq!(report.rejections.len(), 1);
    assert_eq!(report.rejections[0].reason, RejectReason::AddressNotIp);
    assert_eq!(report.rejections[0].endpoint.as_deref(), Some("web.example:80"));
    assert_eq!(harness.server.rejections(), report.rejections);
    assert_eq!(harness.metric("consul_resolver_xds_rejected_total", "address_not_ip"), 1.0);
    let mut client = Sotw::open(harness.channel().await, "envoy-1").await.unwrap();
    client.request(EDS, &["a"], "", "");
    let response = client.recv().await;
    let assignment = ClusterLoadAssignment::decode(response.resources[0].value.as_slice()).unwrap();
    assert_eq!(assignment.endpoints[0].lb_endpoints.len(), 1);
    // Fixed, the reason goes away.
    harness.server.update(upserts(vec![upstream("a", &[("10.0.0.1", 80)])]));
    assert!(harness.server.rejections().is_empty());
    harness.stop().await;
}

#[tokio::test]
async fn a_client_naming_clusters_is_sent_those() {
    let harness = Harness::start(XdsConfig::default()).await;
    let (mut client, _, _) = settled(&harness).await;
    let mut named = Sotw::open(harness.channel().await, "envoy-2").await.unwrap();
    named.request(CDS, &["b", "z"], "", "");
    let clusters = named.recv().await;
    assert_eq!(names(&clusters.resources), vec!["b"]);
    named.ack(&clusters, &["b", "z"]);
    harness.server.update(upserts(vec![upstream("z", &[("10.0.0.26", 80)]), upstream("y", &[("10.0.0.25", 80)])]));
    assert_eq!(names(&named.recv().await.resources), vec!["b", "z"]);
    assert_eq!(names(&client.recv().await.resources), vec!["a", "b", "c", "y", "z"]);
    harness.stop().await;
}
