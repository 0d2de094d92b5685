//! The bootstrap an [`EnvoyConfig`] stands for, as Envoy's v3 JSON.
//!
//! What Envoy 1.40 needs that a first draft misses: a static route configuration checks at
//! load time that every cluster it names exists (`validate_clusters` defaults to true when
//! the routes are static), so a route to a cluster CDS has not delivered yet would refuse
//! the whole bootstrap; it is turned off here, and such a route answers 503 until the
//! cluster arrives. gRPC to the xDS cluster needs HTTP/2, said through the upstream HTTP
//! protocol options extension (the cluster-level `http2_protocol_options` is deprecated).

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{Value, json};

use super::{EnvoyConfig, Pem, Route, XdsSource, XdsTls};

/// The name of the static cluster that carries ADS.
pub(super) const XDS_CLUSTER: &str = "xds";

pub(super) fn bootstrap(config: &EnvoyConfig) -> Value {
    let mut clusters: Vec<Value> = config
        .static_clusters
        .iter()
        .map(|(name, addrs)| static_cluster(name, addrs, config.connect_timeout))
        .collect();
    let mut bootstrap = json!({
        "node": {"id": config.node_id, "cluster": config.node_cluster},
        // Port 0: the kernel picks it, Envoy writes it to --admin-address-path.
        "admin": {"address": socket(([127, 0, 0, 1], 0).into())},
        "static_resources": {"listeners": [listener(&config.routes)]},
    });
    if let Some(xds) = &config.xds {
        clusters.push(xds_cluster(xds, config.connect_timeout));
        bootstrap["dynamic_resources"] = dynamic_resources(xds);
    }
    bootstrap["static_resources"]["clusters"] = Value::Array(clusters);
    bootstrap
}

fn socket(addr: SocketAddr) -> Value {
    json!({"socket_address": {"address": addr.ip().to_string(), "port_value": addr.port()}})
}

/// A protobuf JSON duration: seconds with nanoseconds.
fn duration(d: Duration) -> String {
    format!("{}.{:09}s", d.as_secs(), d.subsec_nanos())
}

/// Round robin over fixed addresses. No health checks and no outlier detection: a dead
/// backend keeps its share, and its requests fail (503) instead of being steered away.
fn static_cluster(name: &str, addrs: &[SocketAddr], connect_timeout: Duration) -> Value {
    let endpoints: Vec<Value> = addrs.iter().map(|a| json!({"endpoint": {"address": socket(*a)}})).collect();
    json!({
        "name": name,
        "type": "STATIC",
        "lb_policy": "ROUND_ROBIN",
        "connect_timeout": duration(connect_timeout),
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
    })
}

fn xds_cluster(xds: &XdsSource, connect_timeout: Duration) -> Value {
    let mut cluster = static_cluster(XDS_CLUSTER, &[xds.addr], connect_timeout);
    cluster["typed_extension_protocol_options"] = json!({
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    });
    if let Some(tls) = &xds.tls {
        cluster["transport_socket"] = upstream_tls(tls);
    }
    cluster
}

fn data_source(pem: &Pem) -> Value {
    match pem {
        Pem::File(path) => json!({"filename": path.display().to_string()}),
        Pem::Inline(text) => json!({"inline_string": text}),
    }
}

fn upstream_tls(tls: &XdsTls) -> Value {
    let mut validation = json!({"trusted_ca": data_source(&tls.ca)});
    if let Some(san) = &tls.subject_alt_name {
        let san_type = if san.parse::<std::net::IpAddr>().is_ok() { "IP_ADDRESS" } else { "DNS" };
        validation["match_typed_subject_alt_names"] = json!([{"san_type": san_type, "matcher": {"exact": san}}]);
    }
    let mut common = json!({"alpn_protocols": ["h2"], "validation_context": validation});
    if let Some((cert, key)) = &tls.client_cert {
        common["tls_certificates"] = json!([{"certificate_chain": data_source(cert), "private_key": data_source(key)}]);
    }
    let mut context = json!({
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": common,
    });
    if let Some(sni) = &tls.sni {
        context["sni"] = json!(sni);
    }
    json!({"name": "envoy.transport_sockets.tls", "typed_config": context})
}

/// Clusters only, over one ADS stream: state of the world (`GRPC`) or incremental
/// (`DELTA_GRPC`). The node is sent on the stream's first request only, as most deployed
/// Envoys are configured: a server must remember it per stream.
fn dynamic_resources(xds: &XdsSource) -> Value {
    let mut cds = json!({"ads": {}, "resource_api_version": "V3"});
    if let Some(t) = xds.initial_fetch_timeout {
        cds["initial_fetch_timeout"] = json!(duration(t));
    }
    json!({
        "ads_config": {
            "api_type": if xds.delta { "DELTA_GRPC" } else { "GRPC" },
            "transport_api_version": "V3",
            "set_node_on_first_message_only": true,
            "grpc_services": [{"envoy_grpc": {"cluster_name": XDS_CLUSTER}}],
        },
        "cds_config": cds,
    })
}

/// One HTTP listener on a loopback port the kernel picks, its routes static, tried in
/// order. No retry policy: each probe request is one upstream attempt.
fn listener(routes: &[Route]) -> Value {
    let routes: Vec<Value> = routes.iter().map(route).collect();
    let manager = json!({
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "route_config": {
            "name": "static",
            // A cluster that comes from CDS later is unknown at load time.
            "validate_clusters": false,
            "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}],
        },
        "http_filters": [{
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
        }],
    });
    json!({
        "name": "ingress",
        "address": socket(([127, 0, 0, 1], 0).into()),
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}],
    })
}

fn route(r: &Route) -> Value {
    let mut matcher = json!({"prefix": r.prefix});
    if let Some((name, value)) = &r.header {
        matcher["headers"] = json!([{"name": name, "string_match": {"exact": value}}]);
    }
    json!({"match": matcher, "route": {"cluster": r.cluster}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_protobuf_json() {
        assert_eq!(duration(Duration::from_millis(250)), "0.250000000s");
        assert_eq!(duration(Duration::from_secs(15)), "15.000000000s");
    }

    #[test]
    fn a_header_route_matches_the_prefix_and_the_header() {
        let r = route(&Route::header("x-svc", "web", "web-cluster"));
        assert_eq!(r["match"]["prefix"], "/");
        assert_eq!(r["match"]["headers"][0]["string_match"]["exact"], "web");
        assert_eq!(r["route"]["cluster"], "web-cluster");
    }
}
