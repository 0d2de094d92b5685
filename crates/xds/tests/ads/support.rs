//! A server on loopback and clients of both variants, built from envoy-types' tonic client.

use std::net::SocketAddr;
use std::time::Duration;

use consul_resolver_xds::{
    Changes, ClientStatus, EndpointHealth, ServeError, Upstream, UpstreamEndpoint, XdsConfig, XdsServer,
};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::google::rpc;
use prost::Message;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::Channel;
use tonic::{Status, Streaming};

pub(crate) const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub(crate) const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// How long a response may take to arrive on loopback, and how long silence must last to
/// count as "nothing sent".
const ARRIVAL: Duration = Duration::from_secs(5);
const SILENCE: Duration = Duration::from_millis(300);

pub(crate) struct Harness {
    pub(crate) server: XdsServer,
    pub(crate) addr: SocketAddr,
    pub(crate) registry: prometheus::Registry,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ServeError>>,
}

impl Harness {
    pub(crate) async fn start(config: XdsConfig) -> Harness {
        let server = XdsServer::new();
        let registry = prometheus::Registry::new();
        server.register_metrics(&registry).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel();
        let serving = server.clone();
        let task = tokio::spawn(async move {
            serving
                .serve(listener, config, async {
                    let _ = stopped.await;
                })
                .await
        });
        Harness { server, addr, registry, stop: Some(stop), task }
    }

    pub(crate) async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.addr)).unwrap().connect().await.unwrap()
    }

    /// Stops the server and waits for it: every stream must end for this to return.
    pub(crate) async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(ARRIVAL, self.task).await.expect("the server stops").unwrap().unwrap();
    }

    /// A counter's or gauge's value for the one label value given (or its only series).
    pub(crate) fn metric(&self, name: &str, label_value: &str) -> f64 {
        let families = self.registry.gather();
        let Some(family) = families.iter().find(|f| f.name() == name) else { return 0.0 };
        family
            .get_metric()
            .iter()
            .filter(|m| label_value.is_empty() || m.get_label().iter().any(|l| l.value() == label_value))
            // A series is a counter or a gauge; the other reads 0.
            .map(|m| m.get_counter().get_value() + m.get_gauge().get_value())
            .sum()
    }
}

pub(crate) fn upstream(name: &str, endpoints: &[(&str, u16)]) -> Upstream {
    let endpoints = endpoints
        .iter()
        .map(|(address, port)| UpstreamEndpoint {
            address: (*address).to_owned(),
            port: *port,
            zone: Some("zone-a".to_owned()),
            health: EndpointHealth::Healthy,
            weight: 1,
        })
        .collect();
    Upstream { name: name.to_owned(), endpoints }
}

pub(crate) fn complete(upstreams: Vec<Upstream>) -> Changes {
    Changes { upserts: upstreams, removals: Vec::new(), complete: true }
}

pub(crate) fn upserts(upstreams: Vec<Upstream>) -> Changes {
    Changes { upserts: upstreams, ..Default::default() }
}

/// The names of the clusters or assignments in `resources`.
pub(crate) fn names(resources: &[Any]) -> Vec<String> {
    resources
        .iter()
        .map(|any| match any.type_url.as_str() {
            CDS => Cluster::decode(any.value.as_slice()).unwrap().name,
            EDS => ClusterLoadAssignment::decode(any.value.as_slice()).unwrap().cluster_name,
            other => panic!("unexpected type {other}"),
        })
        .collect()
}

fn node(id: &str) -> Option<Node> {
    Some(Node { id: id.to_owned(), cluster: "test".to_owned(), ..Default::default() })
}

async fn arrive<T>(stream: &mut Streaming<T>) -> Result<Option<T>, Status> {
    arrive_within(stream, ARRIVAL).await
}

async fn arrive_within<T>(stream: &mut Streaming<T>, limit: Duration) -> Result<Option<T>, Status> {
    tokio::time::timeout(limit, stream.message()).await.expect("a message in time")
}

async fn silent<T: std::fmt::Debug>(stream: &mut Streaming<T>) {
    if let Ok(message) = tokio::time::timeout(SILENCE, stream.message()).await {
        panic!("expected nothing, got {message:?}");
    }
}

/// A state-of-the-world client.
pub(crate) struct Sotw {
    tx: mpsc::UnboundedSender<DiscoveryRequest>,
    rx: Streaming<DiscoveryResponse>,
    node: String,
}

impl Sotw {
    pub(crate) async fn open(channel: Channel, node_id: &str) -> Result<Sotw, Status> {
        let (tx, outbound) = mpsc::unbounded_channel();
        let mut client = AggregatedDiscoveryServiceClient::new(channel);
        let rx = client.stream_aggregated_resources(UnboundedReceiverStream::new(outbound)).await?.into_inner();
        Ok(Sotw { tx, rx, node: node_id.to_owned() })
    }

    pub(crate) fn request(&self, type_url: &str, names: &[&str], version: &str, nonce: &str) {
        self.send(type_url, names, version, nonce, None);
    }

    pub(crate) fn ack(&self, response: &DiscoveryResponse, names: &[&str]) {
        self.send(&response.type_url, names, &response.version_info, &response.nonce, None);
    }

    /// Refuses `response`, saying the version held before.
    pub(crate) fn nack(&self, response: &DiscoveryResponse, names: &[&str], previous: &str, message: &str) {
        self.send(&response.type_url, names, previous, &response.nonce, Some(message));
    }

    fn send(&self, type_url: &str, names: &[&str], version: &str, nonce: &str, error: Option<&str>) {
        let request = DiscoveryRequest {
            version_info: version.to_owned(),
            node: node(&self.node),
            resource_names: names.iter().map(|n| (*n).to_owned()).collect(),
            type_url: type_url.to_owned(),
            response_nonce: nonce.to_owned(),
            error_detail: error.map(|message| rpc::Status { code: 3, message: message.to_owned(), details: vec![] }),
            ..Default::default()
        };
        self.tx.send(request).unwrap();
    }

    pub(crate) async fn recv(&mut self) -> DiscoveryResponse {
        arrive(&mut self.rx).await.expect("a response").expect("an open stream")
    }

    pub(crate) async fn silent(&mut self) {
        silent(&mut self.rx).await;
    }

    /// The status the stream ended with.
    pub(crate) async fn failure(&mut self) -> Status {
        self.failure_within(ARRIVAL).await
    }

    pub(crate) async fn failure_within(&mut self, limit: Duration) -> Status {
        arrive_within(&mut self.rx, limit).await.expect_err("the stream fails")
    }
}

/// A delta client.
pub(crate) struct Delta {
    tx: mpsc::UnboundedSender<DeltaDiscoveryRequest>,
    rx: Streaming<DeltaDiscoveryResponse>,
    node: String,
}

impl Delta {
    pub(crate) async fn open(channel: Channel, node_id: &str) -> Result<Delta, Status> {
        let (tx, outbound) = mpsc::unbounded_channel();
        let mut client = AggregatedDiscoveryServiceClient::new(channel);
        let rx = client.delta_aggregated_resources(UnboundedReceiverStream::new(outbound)).await?.into_inner();
        Ok(Delta { tx, rx, node: node_id.to_owned() })
    }

    /// A request that answers no response: subscription changes only.
    pub(crate) fn subscribe(&self, type_url: &str, subscribe: &[&str], unsubscribe: &[&str]) {
        self.send(DeltaDiscoveryRequest {
            type_url: type_url.to_owned(),
            resource_names_subscribe: subscribe.iter().map(|n| (*n).to_owned()).collect(),
            resource_names_unsubscribe: unsubscribe.iter().map(|n| (*n).to_owned()).collect(),
            ..Default::default()
        });
    }

    /// The first request of a type on a stream, saying what the client holds already.
    pub(crate) fn resume(&self, type_url: &str, subscribe: &[&str], held: &[(String, String)]) {
        self.send(DeltaDiscoveryRequest {
            type_url: type_url.to_owned(),
            resource_names_subscribe: subscribe.iter().map(|n| (*n).to_owned()).collect(),
            initial_resource_versions: held.iter().cloned().collect(),
            ..Default::default()
        });
    }

    pub(crate) fn ack(&self, response: &DeltaDiscoveryResponse) {
        self.send(DeltaDiscoveryRequest {
            type_url: response.type_url.clone(),
            response_nonce: response.nonce.clone(),
            ..Default::default()
        });
    }

    pub(crate) fn nack(&self, response: &DeltaDiscoveryResponse, message: &str) {
        self.send(DeltaDiscoveryRequest {
            type_url: response.type_url.clone(),
            response_nonce: response.nonce.clone(),
            error_detail: Some(rpc::Status { code: 3, message: message.to_owned(), details: vec![] }),
            ..Default::default()
        });
    }

    fn send(&self, mut request: DeltaDiscoveryRequest) {
        request.node = node(&self.node);
        self.tx.send(request).unwrap();
    }

    pub(crate) async fn recv(&mut self) -> DeltaDiscoveryResponse {
        arrive(&mut self.rx).await.expect("a response").expect("an open stream")
    }

    pub(crate) async fn silent(&mut self) {
        silent(&mut self.rx).await;
    }
}

/// Waits until `ready` holds of the server's clients (a request was taken in).
pub(crate) async fn until(harness: &Harness, ready: impl Fn(&[ClientStatus]) -> bool) {
    tokio::time::timeout(ARRIVAL, async {
        while !ready(&harness.server.clients()) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the server took the request in");
}

/// Name and version of each resource of a delta response.
pub(crate) fn versions(response: &DeltaDiscoveryResponse) -> Vec<(String, String)> {
    response.resources.iter().map(|r| (r.name.clone(), r.version.clone())).collect()
}
