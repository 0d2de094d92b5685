//! One client's stream, whichever the variant: admission (first request, node id), then a
//! loop that answers requests and sends what changed. Sending a response, and the client's
//! answer to it, each have a deadline: a client that stops reading or answering has its
//! stream closed instead of holding responses forever.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, sleep_until, timeout};
use tonic::{Status, Streaming};

use crate::XdsShared;
use crate::resources::Kind;
use crate::state::View;
use crate::status::{ClientStatus, Nack, Variant, now_rfc3339};
use crate::tracker::{Answer, Tracker};

/// What each stream needs of the server's configuration.
#[derive(Debug)]
pub(crate) struct Limits {
    pub(crate) response_deadline: Duration,
    pub(crate) allowed_nodes: Option<BTreeSet<String>>,
    pub(crate) max_clients: usize,
}

/// What a protocol variant adds to the common book-keeping of `Client`.
pub(crate) trait Protocol: Send + Sized + 'static {
    type Request: Send + 'static;
    type Response: prost::Message + Send + 'static;
    const VARIANT: Variant;

    fn node_id(request: &Self::Request) -> Option<&str>;
    fn new(client: Client) -> Self;
    fn client(&self) -> &Client;
    /// Takes a request in: an answer to a response, a change of subscription, or both.
    fn receive(&mut self, request: Self::Request);
    /// The response of `kind` due, if any.
    fn respond(&mut self, kind: Kind, view: &View) -> Option<Self::Response>;

    /// The next response due, if any: clusters before endpoints.
    fn next(&mut self, view: &View) -> Option<Self::Response> {
        Kind::ALL.into_iter().find_map(|kind| self.respond(kind, view))
    }
}

/// A client's state common to both variants.
#[derive(Debug)]
pub(crate) struct Client {
    pub(crate) node: String,
    trackers: [Tracker; 2],
    nonces: u64,
    status: Arc<Mutex<ClientStatus>>,
    shared: Arc<XdsShared>,
    variant: Variant,
}

impl Client {
    pub(crate) fn tracker(&mut self, kind: Kind) -> &mut Tracker {
        &mut self.trackers[kind as usize]
    }

    /// When the oldest response the client has not answered yet was sent.
    fn unanswered_since(&self) -> Option<Instant> {
        self.trackers.iter().filter_map(Tracker::unanswered_since).min()
    }

    pub(crate) fn next_nonce(&mut self) -> String {
        self.nonces += 1;
        self.nonces.to_string()
    }

    /// Counts a response about to be sent.
    pub(crate) fn sending(&self, kind: Kind, bytes: usize) {
        self.shared.metrics.response(kind, self.variant, bytes);
    }

    /// The kind of resource a request is about, once its answer to a response (its
    /// `nonce`, an ACK or, with `error`, a NACK) is taken in; `None` for a type not served.
    pub(crate) fn request_for(
        &mut self,
        type_url: &str,
        nonce: &str,
        error: Option<&str>,
        version: Option<&str>,
    ) -> Option<Kind> {
        let Some(kind) = Kind::from_type_url(type_url) else {
            tracing::debug!(node = %self.node, type_url, "ignored a request for a type not served");
            return None;
        };
        if !nonce.is_empty() {
            self.answered(kind, nonce, error, version);
        }
        Some(kind)
    }

    /// The client answered response `nonce` of `kind`. `version` is the version the client
    /// now says it has (the state of the world tells it; delta does not).
    fn answered(&mut self, kind: Kind, nonce: &str, error: Option<&str>, version: Option<&str>) {
        let variant = self.variant;
        let tracker = &mut self.trackers[kind as usize];
        let Some(answer) = tracker.answer(nonce, error) else { return };
        let held = tracker.held_count();
        let acked_version = version.map_or_else(|| tracker.held_version(), str::to_owned);
        let mut status = self.status.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = status.types.entry(kind.type_url().to_owned()).or_default();
        entry.resources = held;
        match answer {
            Answer::Ack => {
                self.shared.metrics.ack(kind, variant);
                entry.acked_version = Some(acked_version);
                entry.acked_nonce = Some(nonce.to_owned());
            }
            Answer::Nack { quarantined, whole } => {
                let message = error.unwrap_or_default().to_owned();
                self.shared.metrics.nack(kind, variant, quarantined.len());
                tracing::warn!(
                    node = %self.node, r#type = kind.label(), ?quarantined, whole_response = whole, %message,
                    "an xDS client refused resources; they are held back from it at the refused version"
                );
                entry.last_nack = Some(Nack { at: now_rfc3339(), message, quarantined, whole_response: whole });
            }
        }
    }

    /// Records that the client now holds the set of `version` (after a resumption).
    pub(crate) fn resumed(&mut self, kind: Kind, version: &str) {
        self.held_changed(kind);
        let mut status = self.status.lock().unwrap_or_else(PoisonError::into_inner);
        status.types.entry(kind.type_url().to_owned()).or_default().acked_version = Some(version.to_owned());
    }

    /// Reports how many resources the client holds, after a request changed it.
    pub(crate) fn held_changed(&mut self, kind: Kind) {
        let held = self.trackers[kind as usize].held_count();
        let mut status = self.status.lock().unwrap_or_else(PoisonError::into_inner);
        status.types.entry(kind.type_url().to_owned()).or_default().resources = held;
    }
}

/// Why a stream ended.
enum End {
    ClientLeft,
    SlowClient,
    Shutdown,
}

/// Runs one client's stream to its end.
pub(crate) async fn run<P: Protocol>(
    shared: Arc<XdsShared>,
    limits: Arc<Limits>,
    mut inbound: Streaming<P::Request>,
    tx: mpsc::Sender<Result<P::Response, Status>>,
    peer: Option<String>,
    stop: watch::Receiver<bool>,
) {
    let Some(first) = admit::<P>(&shared, &limits, &mut inbound, &tx).await else { return };
    let node = P::node_id(&first).unwrap_or_default().to_owned();
    let status = ClientStatus {
        node_id: node.clone(),
        peer,
        variant: P::VARIANT,
        connected_since: now_rfc3339(),
        types: Default::default(),
    };
    let (id, status) = shared.clients.add(status);
    let gauge = shared.metrics.clients.with_label_values(&[P::VARIANT.label()]);
    gauge.inc();
    let client = Client {
        node: node.clone(),
        trackers: [Tracker::new(Kind::Cluster), Tracker::new(Kind::Endpoints)],
        nonces: 0,
        status,
        shared: shared.clone(),
        variant: P::VARIANT,
    };
    let mut protocol = P::new(client);
    protocol.receive(first);
    let end = serve_stream(&shared, &limits, &mut protocol, inbound, &tx, stop).await;
    gauge.dec();
    shared.clients.remove(id);
    match end {
        End::ClientLeft => tracing::debug!(node = %node, "xDS client left"),
        End::SlowClient => {
            shared.metrics.closed.with_label_values(&["slow_client"]).inc();
            tracing::warn!(node = %node, deadline = ?limits.response_deadline,
                "closed the stream of an xDS client that did not take or answer a response in time");
            let _ = tx.try_send(Err(Status::deadline_exceeded("a response was not taken or answered in time")));
        }
        End::Shutdown => {
            shared.metrics.closed.with_label_values(&["shutdown"]).inc();
            // UNAVAILABLE: the client reconnects, to another replica if there is one.
            let _ = tx.try_send(Err(Status::unavailable("the xDS server is shutting down")));
        }
    }
}

/// Reads the first request within the deadline and checks the client's node id.
async fn admit<P: Protocol>(
    shared: &XdsShared,
    limits: &Limits,
    inbound: &mut Streaming<P::Request>,
    tx: &mpsc::Sender<Result<P::Response, Status>>,
) -> Option<P::Request> {
    let refuse = |reason: &str, status: Status| {
        shared.metrics.refused.with_label_values(&[reason]).inc();
        // The channel is empty: this cannot wait.
        let _ = tx.try_send(Err(status));
    };
    let first = match timeout(limits.response_deadline, inbound.message()).await {
        Ok(Ok(Some(first))) => first,
        Ok(Ok(None) | Err(_)) => return None,
        Err(_) => {
            refuse("no_request", Status::deadline_exceeded("no request in time"));
            return None;
        }
    };
    let node = P::node_id(&first).unwrap_or_default();
    if let Some(allowed) = &limits.allowed_nodes
        && !allowed.contains(node)
    {
        tracing::warn!(node = %node, "refused an xDS client whose node id is not allowed");
        refuse("node_id", Status::permission_denied(format!("node id {node:?} is not allowed")));
        return None;
    }
    Some(first)
}

async fn serve_stream<P: Protocol>(
    shared: &XdsShared,
    limits: &Limits,
    protocol: &mut P,
    mut inbound: Streaming<P::Request>,
    tx: &mpsc::Sender<Result<P::Response, Status>>,
    mut stop: watch::Receiver<bool>,
) -> End {
    let mut changes = shared.notify.subscribe();
    loop {
        loop {
            let next = protocol.next(&shared.view());
            let Some(response) = next else { break };
            match timeout(limits.response_deadline, tx.send(Ok(response))).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return End::ClientLeft,
                Err(_) => return End::SlowClient,
            }
        }
        // Envoy answers every response; one left unanswered means a client that stopped.
        let answer_due = protocol.client().unanswered_since().map(|sent| sent + limits.response_deadline);
        tokio::select! {
            () = sleep_until_some(answer_due) => return End::SlowClient,
            request = inbound.message() => match request {
                Ok(Some(request)) => protocol.receive(request),
                Ok(None) | Err(_) => return End::ClientLeft,
            },
            changed = changes.changed() => if changed.is_err() { return End::Shutdown },
            _ = stop.changed() => return End::Shutdown,
        }
    }
}

async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
