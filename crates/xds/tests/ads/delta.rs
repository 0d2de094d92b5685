//! The incremental variant.

use consul_resolver_xds::{Changes, Variant, XdsConfig};
use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryResponse;

use crate::support::{CDS, Delta, EDS, Harness, complete, names, until, upserts, upstream, versions};

/// A client holding clusters `a` and `b` and their assignments, everything ACKed.
async fn settled(harness: &Harness) -> (Delta, DeltaDiscoveryResponse, DeltaDiscoveryResponse) {
    harness.server.update(complete(vec![upstream("a", &[("10.0.0.1", 80)]), upstream("b", &[("10.0.0.2", 80)])]));
    let mut client = Delta::open(harness.channel().await, "envoy-1").await.unwrap();
    client.subscribe(CDS, &[], &[]);
    let clusters = client.recv().await;
    assert_eq!(clusters.type_url, CDS);
    let any: Vec<_> = clusters.resources.iter().filter_map(|r| r.resource.clone()).collect();
    assert_eq!(names(&any), vec!["a", "b"]);
    client.ack(&clusters);
    client.subscribe(EDS, &["a", "b"], &[]);
    let assignments = client.recv().await;
    assert_eq!(versions(&assignments).len(), 2);
    client.ack(&assignments);
    (client, clusters, assignments)
}

#[tokio::test]
async fn nothing_is_sent_before_the_first_update() {
    let harness = Harness::start(XdsConfig::default()).await;
    let mut client = Delta::open(harness.channel().await, "envoy-1").await.unwrap();
    client.subscribe(CDS, &[], &[]);
    client.silent().await;
    harness.server.update(complete(vec![]));
    let empty = client.recv().await;
    assert!(empty.resources.is_empty() && empty.removed_resources.is_empty());
    client.ack(&empty);
    harness.server.update(upserts(vec![upstream("a", &[("10.0.0.1", 80)])]));
    assert_eq!(versions(&client.recv().await).len(), 1);
    assert_eq!(harness.server.clients()[0].variant, Variant::Delta);
    harness.stop().await;
}

#[tokio::test]
async fn resources_held_at_their_version_are_not_sent_again_on_a_new_stream() {
    let harness = Harness::start(XdsConfig::default()).await;
    let (_first, clusters, assignments) = settled(&harness).await;
    // Changed while the client was away: only `b`'s assignment differs from what it holds.
    harness.server.update(upserts(vec![upstream("b", &[("10.0.0.9", 80)])]));
    let mut again = Delta::open(harness.channel().await, "envoy-1").await.unwrap();
    again.resume(CDS, &[], &versions(&clusters));
    again.resume(EDS, &["a", "b"], &versions(&assignments));
    let resent = again.recv().await;
    assert_eq!(resent.type_url, EDS);
    assert_eq!(versions(&resent).into_iter().map(|(name, _)| name).collect::<Vec<_>>(), vec!["b"]);
    assert!(resent.removed_resources.is_empty());
    again.ack(&resent);
    again.silent().await;
    // Both streams report the set they hold: the one the first stream was sent.
    for client in harness.server.clients() {
        assert_eq!(client.types[CDS].acked_version.as_deref(), Some(clusters.system_version_info.as_str()));
    }
    harness.stop().await;
}

#[tokio::test]
async fn a_resumed_resource_that_is_gone_is_removed() {
    let harness = Harness::start(XdsConfig::default()).await;
    harness.server.update(complete(vec![upstream("a", &[("10.0.0.1", 80)])]));
    let mut client = Delta::open(harness.channel().await, "envoy-1").await.unwrap();
    client.resume(CDS, &[], &[("gone".to_owned(), "1".to_owned())]);
    let response = client.recv().await;
    assert_eq!(response.removed_resources, vec!["gone"]);
    assert_eq!(versions(&response).len(), 1);
    harness.stop().await;
}

#[tokio::test]
async fn a_removed_upstream_is_removed_from_the_client() {
    let harness = Harness::start(XdsConfig::default()).await;
    let (mut client, _, _) = settled(&harness).await;
    harness.server.update(Changes { removals: vec!["a".to_owned()], ..Default::default() });
    let clusters = client.recv().await;
    assert_eq!(clusters.type_url, CDS);
    assert_eq!(clusters.removed_resources, vec!["a"]);
    assert!(clusters.resources.is_empty());
    client.ack(&clusters);
    let assignments = client.recv().await;
    assert_eq!(assignments.type_url, EDS);
    assert_eq!(assignments.removed_resources, vec!["a"]);
    client.ack(&assignments);
    client.silent().await;
    assert_eq!(harness.server.clients()[0].types[CDS].resources, 1);
    harness.stop().await;
}

#[tokio::test]
async fn an_unsubscribed_assignment_is_no_longer_pushed() {
    let harness = Harness::start(XdsConfig::default()).await;
    let (mut client, _, _) = settled(&harness).await;
    client.subscribe(EDS, &[], &["b"]);
    until(&harness, |clients| clients[0].types[EDS].resources == 1).await;
    harness.server.update(upserts(vec![upstream("b", &[("10.0.0.9", 80)])]));
    client.silent().await;
    harness.server.update(upserts(vec![upstream("a", &[("10.0.0.9", 80)])]));
    let response = client.recv().await;
    assert_eq!(versions(&response).into_iter().map(|(name, _)| name).collect::<Vec<_>>(), vec!["a"]);
    harness.stop().await;
}

#[tokio::test]
async fn a_refused_assignment_is_not_sent_again_until_it_changes() {
    let harness = Harness::start(XdsConfig::default()).await;
    let (mut client, _, _) = settled(&harness).await;
    harness.server.update(upserts(vec![upstream("a", &[("10.0.0.5", 80)]), upstream("b", &[("10.0.0.6", 80)])]));
    let both = client.recv().await;
    assert_eq!(versions(&both).len(), 2);
    client.nack(&both, "cluster b: refused for the test");
    client.silent().await;
    assert_eq!(harness.metric("consul_resolver_xds_nacks_total", "delta"), 1.0);
    harness.server.update(upserts(vec![upstream("a", &[("10.0.0.7", 80)])]));
    let other = client.recv().await;
    assert_eq!(versions(&other).into_iter().map(|(name, _)| name).collect::<Vec<_>>(), vec!["a"]);
    client.ack(&other);
    harness.server.update(upserts(vec![upstream("b", &[("10.0.0.8", 80)])]));
    let retried = client.recv().await;
    assert_eq!(versions(&retried).into_iter().map(|(name, _)| name).collect::<Vec<_>>(), vec!["b"]);
    harness.stop().await;
}
