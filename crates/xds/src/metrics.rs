//! The server's Prometheus metrics, `consul_resolver_xds_*`, created with the server and
//! registered wherever the operator exports its own.

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

    pub(crate) fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.clients.clone()))?;
        registry.register(Box::new(self.responses.clone()))?;
        registry.register(Box::new(self.response_bytes.clone()))?;
        registry.register(Box::new(self.acks.clone()))?;
        registry.register(Box::new(self.nacks.clone()))?;
        registry.register(Box::new(self.quarantined.clone()))?;
        registry.register(Box::new(self.refused.clone()))?;
        registry.register(Box::new(self.closed.clone()))?;
        registry.register(Box::new(self.rejected.clone()))
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
