//! From the operator's neutral upstreams to Envoy's resources: validation (what Envoy would
//! refuse never leaves here), encoding once, and versions derived from the encoded bytes.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::cluster::v3::{Cluster, cluster};
use envoy_types::pb::envoy::config::core::v3::Address;
use envoy_types::pb::envoy::config::core::v3::{
    AggregatedConfigSource, ApiVersion, ConfigSource, HealthStatus, Locality, SocketAddress, address, config_source,
    socket_address,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints, lb_endpoint,
};
use envoy_types::pb::google::protobuf::{Any, Duration, UInt32Value};
use prost::Message;
use serde::Serialize;
use sha2::{Digest, Sha256};

/// The longest upstream name served. Envoy sets no limit of its own, but a cluster's name
/// is part of every one of its stats' names; 255 bytes keeps them reasonable and covers any
/// name built from Kubernetes and Consul names.
pub(crate) const MAX_NAME_LEN: usize = 255;

/// How long Envoy waits for a connection to an endpoint: Envoy's own default.
const CONNECT_TIMEOUT_SECONDS: i64 = 5;

/// One upstream: a cluster of the same name and its endpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Upstream {
    pub name: String,
    pub endpoints: Vec<UpstreamEndpoint>,
}

/// One endpoint of an upstream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpstreamEndpoint {
    /// An IP literal (v4 or v6): an EDS cluster's endpoints are never resolved.
    pub address: String,
    pub port: u16,
    /// The locality's zone; endpoints without one share the locality without a zone.
    pub zone: Option<String>,
    pub health: EndpointHealth,
    /// At least 1.
    pub weight: u32,
}

/// An endpoint's health as Envoy's load balancer sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EndpointHealth {
    Healthy,
    /// Used only when not enough healthy endpoints remain.
    Degraded,
    Unhealthy,
}

/// Something left out of what is served because Envoy would refuse it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Rejection {
    pub upstream: String,
    /// `address:port` of the endpoint left out; `None` when the whole upstream was.
    pub endpoint: Option<String>,
    pub reason: RejectReason,
}

/// Why something was left out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, thiserror::Error)]
#[serde(rename_all = "snake_case")]
pub enum RejectReason {
    #[error("the upstream's name is empty")]
    EmptyName,
    #[error("the upstream's name is longer than {MAX_NAME_LEN} bytes")]
    NameTooLong,
    #[error("the address is not an IP literal")]
    AddressNotIp,
    #[error("the port is 0")]
    PortZero,
    #[error("the weight is 0")]
    WeightZero,
    #[error("the same address and port appear twice")]
    DuplicateEndpoint,
    #[error("the locality's total weight would exceed 2^32-1")]
    WeightOverflow,
}

impl RejectReason {
    /// The metric label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            RejectReason::EmptyName => "empty_name",
            RejectReason::NameTooLong => "name_too_long",
            RejectReason::AddressNotIp => "address_not_ip",
            RejectReason::PortZero => "port_zero",
            RejectReason::WeightZero => "weight_zero",
            RejectReason::DuplicateEndpoint => "duplicate_endpoint",
            RejectReason::WeightOverflow => "weight_overflow",
        }
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.endpoint {
            Some(endpoint) => write!(f, "upstream {:?}: endpoint {endpoint} left out: {}", self.upstream, self.reason),
            None => write!(f, "upstream {:?} left out: {}", self.upstream, self.reason),
        }
    }
}

/// The two resource types served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Kind {
    Cluster,
    Endpoints,
}

pub(crate) const CLUSTER_TYPE: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub(crate) const ENDPOINTS_TYPE: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

impl Kind {
    pub(crate) const ALL: [Kind; 2] = [Kind::Cluster, Kind::Endpoints];

    pub(crate) fn type_url(self) -> &'static str {
        match self {
            Kind::Cluster => CLUSTER_TYPE,
            Kind::Endpoints => ENDPOINTS_TYPE,
        }
    }

    pub(crate) fn from_type_url(url: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|kind| kind.type_url() == url)
    }

    /// The metric label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Kind::Cluster => "cds",
            Kind::Endpoints => "eds",
        }
    }
}

/// One encoded resource, shared by every client that is sent it.
#[derive(Debug)]
pub(crate) struct Resource {
    pub(crate) name: String,
    /// Derived from the encoded bytes: equal content, equal version.
    pub(crate) version: String,
    pub(crate) any: Any,
    /// This name at this version, for order-independent digests of sets of resources.
    pub(crate) mix: u128,
}

impl Resource {
    fn encode<M: Message>(name: &str, kind: Kind, message: &M) -> Arc<Resource> {
        let value = message.encode_to_vec();
        let digest = Sha256::digest(&value);
        let version = hex::encode(&digest[..8]);
        let mix = mix(name, &version);
        let any = Any { type_url: kind.type_url().to_owned(), value };
        Arc::new(Resource { name: name.to_owned(), version, any, mix })
    }
}

/// A digest of one name at one version; a set's digest is the XOR of its members', so it
/// is kept up to date at the cost of the members that change.
pub(crate) fn mix(name: &str, version: &str) -> u128 {
    let mut hasher = Sha256::new();
    hasher.update(name.as_bytes());
    hasher.update([0]);
    hasher.update(version.as_bytes());
    let digest = hasher.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    u128::from_be_bytes(bytes)
}

/// The version string of a set whose digest is `mix`.
pub(crate) fn set_version(mix: u128) -> String {
    format!("{mix:032x}")
}

/// Whether Envoy would accept `name` as a cluster's name.
pub(crate) fn check_name(name: &str) -> Result<(), RejectReason> {
    if name.is_empty() {
        Err(RejectReason::EmptyName)
    } else if name.len() > MAX_NAME_LEN {
        Err(RejectReason::NameTooLong)
    } else {
        Ok(())
    }
}

/// The cluster named `name`: discovered over EDS through the same ADS stream.
pub(crate) fn build_cluster(name: &str) -> Arc<Resource> {
    let ads = ConfigSource {
        config_source_specifier: Some(config_source::ConfigSourceSpecifier::Ads(AggregatedConfigSource {})),
        resource_api_version: ApiVersion::V3 as i32,
        ..Default::default()
    };
    let cluster = Cluster {
        name: name.to_owned(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(cluster::DiscoveryType::Eds as i32)),
        eds_cluster_config: Some(cluster::EdsClusterConfig { eds_config: Some(ads), service_name: String::new() }),
        connect_timeout: Some(Duration { seconds: CONNECT_TIMEOUT_SECONDS, nanos: 0 }),
        lb_policy: cluster::LbPolicy::RoundRobin as i32,
        ..Default::default()
    };
    Resource::encode(name, Kind::Cluster, &cluster)
}

/// The upstream's endpoints, grouped by zone. Endpoints Envoy would refuse are left out and
/// told in `rejections`. Localities and endpoints are sorted, so the order the operator
/// lists them in does not change the version.
pub(crate) fn build_endpoints(upstream: &Upstream, rejections: &mut Vec<Rejection>) -> Arc<Resource> {
    let mut zones: BTreeMap<&str, Vec<&UpstreamEndpoint>> = BTreeMap::new();
    let mut seen: HashSet<(IpAddr, u16)> = HashSet::new();
    let mut sorted: Vec<&UpstreamEndpoint> = upstream.endpoints.iter().collect();
    sorted.sort_by(|a, b| (&a.zone, &a.address, a.port).cmp(&(&b.zone, &b.address, b.port)));
    for endpoint in sorted {
        match check_endpoint(endpoint, &mut seen) {
            Ok(()) => zones.entry(endpoint.zone.as_deref().unwrap_or("")).or_default().push(endpoint),
            Err(reason) => rejections.push(rejected(upstream, endpoint, reason)),
        }
    }
    let localities = zones
        .into_iter()
        .map(|(zone, endpoints)| locality(upstream, zone, endpoints, rejections))
        .filter(|locality| !locality.lb_endpoints.is_empty())
        .collect();
    let assignment =
        ClusterLoadAssignment { cluster_name: upstream.name.clone(), endpoints: localities, ..Default::default() };
    Resource::encode(&upstream.name, Kind::Endpoints, &assignment)
}

fn check_endpoint(endpoint: &UpstreamEndpoint, seen: &mut HashSet<(IpAddr, u16)>) -> Result<(), RejectReason> {
    let ip: IpAddr = endpoint.address.parse().map_err(|_| RejectReason::AddressNotIp)?;
    if endpoint.port == 0 {
        return Err(RejectReason::PortZero);
    }
    if endpoint.weight == 0 {
        return Err(RejectReason::WeightZero);
    }
    // Compared as addresses, not strings: "::1" and "0:0::1" are one endpoint to Envoy.
    if !seen.insert((ip, endpoint.port)) {
        return Err(RejectReason::DuplicateEndpoint);
    }
    Ok(())
}

fn rejected(upstream: &Upstream, endpoint: &UpstreamEndpoint, reason: RejectReason) -> Rejection {
    Rejection {
        upstream: upstream.name.clone(),
        endpoint: Some(match endpoint.address.parse::<IpAddr>() {
            Ok(IpAddr::V6(_)) => format!("[{}]:{}", endpoint.address, endpoint.port),
            _ => format!("{}:{}", endpoint.address, endpoint.port),
        }),
        reason,
    }
}

fn locality(
    upstream: &Upstream,
    zone: &str,
    endpoints: Vec<&UpstreamEndpoint>,
    rejections: &mut Vec<Rejection>,
) -> LocalityLbEndpoints {
    // Envoy refuses a locality whose endpoints' weights add up to more than 2^32-1.
    let mut total: u32 = 0;
    let mut lb_endpoints = Vec::with_capacity(endpoints.len());
    for endpoint in endpoints {
        match total.checked_add(endpoint.weight) {
            Some(sum) => {
                total = sum;
                lb_endpoints.push(lb_endpoint(endpoint));
            }
            None => rejections.push(rejected(upstream, endpoint, RejectReason::WeightOverflow)),
        }
    }
    let locality = (!zone.is_empty()).then(|| Locality { zone: zone.to_owned(), ..Default::default() });
    LocalityLbEndpoints { locality, lb_endpoints, ..Default::default() }
}

fn lb_endpoint(endpoint: &UpstreamEndpoint) -> LbEndpoint {
    let socket = SocketAddress {
        protocol: socket_address::Protocol::Tcp as i32,
        address: endpoint.address.clone(),
        port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(endpoint.port))),
        ..Default::default()
    };
    let health = match endpoint.health {
        EndpointHealth::Healthy => HealthStatus::Healthy,
        EndpointHealth::Degraded => HealthStatus::Degraded,
        EndpointHealth::Unhealthy => HealthStatus::Unhealthy,
    };
    LbEndpoint {
        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
            address: Some(Address { address: Some(address::Address::SocketAddress(socket)) }),
            ..Default::default()
        })),
        health_status: health as i32,
        load_balancing_weight: Some(UInt32Value { value: endpoint.weight }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(address: &str, port: u16) -> UpstreamEndpoint {
        UpstreamEndpoint {
            address: address.to_owned(),
            port,
            zone: Some("a".to_owned()),
            health: EndpointHealth::Healthy,
            weight: 1,
        }
    }

    fn upstream(endpoints: Vec<UpstreamEndpoint>) -> Upstream {
        Upstream { name: "web".to_owned(), endpoints }
    }

    fn decode(resource: &Resource) -> ClusterLoadAssignment {
        ClusterLoadAssignment::decode(resource.any.value.as_slice()).unwrap()
    }

    #[test]
    fn versions_are_equal_for_equal_content_whatever_the_order() {
        let mut rejections = Vec::new();
        let a = build_endpoints(&upstream(vec![endpoint("10.0.0.1", 80), endpoint("10.0.0.2", 80)]), &mut rejections);
        let b = build_endpoints(&upstream(vec![endpoint("10.0.0.2", 80), endpoint("10.0.0.1", 80)]), &mut rejections);
        let c = build_endpoints(&upstream(vec![endpoint("10.0.0.2", 80), endpoint("10.0.0.1", 81)]), &mut rejections);
        assert_eq!(a.version, b.version);
        assert_eq!(a.any.value, b.any.value);
        assert_ne!(a.version, c.version);
        assert_eq!(build_cluster("web").version, build_cluster("web").version);
        assert_ne!(build_cluster("web").version, build_cluster("api").version);
        assert!(rejections.is_empty());
    }

    #[test]
    fn endpoints_envoy_would_refuse_are_left_out_with_their_reason() {
        let mut weightless = endpoint("10.0.0.4", 80);
        weightless.weight = 0;
        let endpoints = vec![
            endpoint("10.0.0.1", 80),
            endpoint("web.example", 80),
            endpoint("10.0.0.2", 0),
            weightless,
            endpoint("10.0.0.1", 80),
            endpoint("::1", 80),
            endpoint("0:0::1", 80),
        ];
        let mut rejections = Vec::new();
        let resource = build_endpoints(&upstream(endpoints), &mut rejections);
        let mut reasons: Vec<_> = rejections.iter().map(|r| (r.endpoint.clone().unwrap(), r.reason)).collect();
        reasons.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            reasons,
            vec![
                ("10.0.0.1:80".to_owned(), RejectReason::DuplicateEndpoint),
                ("10.0.0.2:0".to_owned(), RejectReason::PortZero),
                ("10.0.0.4:80".to_owned(), RejectReason::WeightZero),
                ("[::1]:80".to_owned(), RejectReason::DuplicateEndpoint),
                ("web.example:80".to_owned(), RejectReason::AddressNotIp),
            ]
        );
        let served: usize = decode(&resource).endpoints.iter().map(|l| l.lb_endpoints.len()).sum();
        assert_eq!(served, 2);
    }

    #[test]
    fn a_locality_never_weighs_more_than_envoy_accepts() {
        let mut heavy = vec![endpoint("10.0.0.1", 80), endpoint("10.0.0.2", 80)];
        heavy[0].weight = u32::MAX;
        let mut rejections = Vec::new();
        let resource = build_endpoints(&upstream(heavy), &mut rejections);
        assert_eq!(rejections.len(), 1);
        assert_eq!(rejections[0].reason, RejectReason::WeightOverflow);
        assert_eq!(decode(&resource).endpoints[0].lb_endpoints.len(), 1);
    }

    #[test]
    fn endpoints_are_grouped_by_zone_with_health_and_weight() {
        let mut b = endpoint("10.0.0.2", 80);
        b.zone = Some("b".to_owned());
        b.health = EndpointHealth::Degraded;
        b.weight = 7;
        let mut none = endpoint("10.0.0.3", 80);
        none.zone = None;
        let mut rejections = Vec::new();
        let cla = decode(&build_endpoints(&upstream(vec![b, endpoint("10.0.0.1", 80), none]), &mut rejections));
        let zones: Vec<_> = cla.endpoints.iter().map(|l| l.locality.as_ref().map(|l| l.zone.clone())).collect();
        assert_eq!(zones, vec![None, Some("a".to_owned()), Some("b".to_owned())]);
        let in_b = &cla.endpoints[2].lb_endpoints[0];
        assert_eq!(in_b.health_status, HealthStatus::Degraded as i32);
        assert_eq!(in_b.load_balancing_weight, Some(UInt32Value { value: 7 }));
        assert_eq!(cla.cluster_name, "web");
    }

    #[test]
    fn names_envoy_would_refuse_are_told() {
        assert_eq!(check_name(""), Err(RejectReason::EmptyName));
        assert_eq!(check_name(&"x".repeat(MAX_NAME_LEN + 1)), Err(RejectReason::NameTooLong));
        assert_eq!(check_name(&"x".repeat(MAX_NAME_LEN)), Ok(()));
    }
}
