//! The server's Prometheus metrics, `consul_resolver_xds_*`, created with the server and
//! registered wherever the operator exports its own.

use prometheus::core::Collector;
use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};

use crate::resources::Kind;
use crate::status::Variant;

#[derive(Clone, Debug)]
pub(crate) struct Metrics {
    pub(crate) clients: IntGaugeVec,
    responses: IntCounterVec,
    response_bytes: IntCounterVec,
    acks: IntCounterVec,
    nacks: IntCounterVec,
    quarantined: IntCounterVec,
    pub(crate) refused: IntCounterVec,
    pub(crate) closed: IntCounterVec,
    pub(crate) rejected: IntCounterVec,
}

fn counter(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("a valid metric definition")
}

impl Metrics {
    pub(crate) fn new() -> Metrics {
        Metrics {
            clients: IntGaugeVec::new(
                Opts::new("consul_resolver_xds_clients", "xDS streams open, by protocol variant"),
                &["variant"],
            )
            .expect("a valid metric definition"),
            responses: counter(
                "consul_resolver_xds_responses_total",
                "xDS responses sent, by type and variant",
                &["type", "variant"],
            ),
            response_bytes: counter(
                "consul_resolver_xds_response_bytes_total",
                "Encoded size of the xDS responses sent, by type and variant",
                &["type", "variant"],
            ),
            acks: counter("consul_resolver_xds_acks_total", "Responses clients accepted", &["type", "variant"]),
            nacks: counter("consul_resolver_xds_nacks_total", "Responses clients refused", &["type", "variant"]),
            quarantined: counter(
                "consul_resolver_xds_quarantined_total",
                "Resources a client refused, held back from that client at the refused version",
                &["type"],
            ),
            refused: counter(
                "consul_resolver_xds_clients_refused_total",
                "Streams refused, by reason (max_clients, node_id, no_request)",
                &["reason"],
            ),
            closed: counter(
                "consul_resolver_xds_streams_closed_total",
                "Streams the server closed, by reason (slow_client, shutdown)",
                &["reason"],
            ),
            rejected: counter(
                "consul_resolver_xds_rejected_total",
                "Upstreams or endpoints left out because Envoy would refuse them, by reason",
                &["reason"],
            ),
        }
    }

    fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.clients.clone()),
            Box::new(self.responses.clone()),
            Box::new(self.response_bytes.clone()),
            Box::new(self.acks.clone()),
            Box::new(self.nacks.clone()),
            Box::new(self.quarantined.clone()),
            Box::new(self.refused.clone()),
            Box::new(self.closed.clone()),
            Box::new(self.rejected.clone()),
        ]
    }

    pub(crate) fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        self.collectors().into_iter().try_for_each(|c| registry.register(c))
    }

    /// Every metric's name, labelled or not yet.
    pub(crate) fn names(&self) -> Vec<String> {
        self.collectors().iter().flat_map(|c| c.desc().into_iter().map(|d| d.fq_name.clone())).collect()
    }

    pub(crate) fn response(&self, kind: Kind, variant: Variant, bytes: usize) {
        let labels = [kind.label(), variant.label()];
        self.responses.with_label_values(&labels).inc();
        self.response_bytes.with_label_values(&labels).inc_by(bytes as u64);
    }

    pub(crate) fn ack(&self, kind: Kind, variant: Variant) {
        self.acks.with_label_values(&[kind.label(), variant.label()]).inc();
    }

    pub(crate) fn nack(&self, kind: Kind, variant: Variant, quarantined: usize) {
        self.nacks.with_label_values(&[kind.label(), variant.label()]).inc();
        self.quarantined.with_label_values(&[kind.label()]).inc_by(quarantined as u64);
    }
}
