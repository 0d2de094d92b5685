//! What each connected client holds and said, for an ops endpoint.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use serde::Serialize;

/// The protocol variant of a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Variant {
    /// State of the world: `StreamAggregatedResources`.
    Sotw,
    /// Incremental: `DeltaAggregatedResources`.
    Delta,
}

impl Variant {
    /// The metric label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Variant::Sotw => "sotw",
            Variant::Delta => "delta",
        }
    }
}

/// One connected client.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientStatus {
    pub node_id: String,
    /// The peer's address, when the transport knows it.
    pub peer: Option<String>,
    pub variant: Variant,
    /// RFC 3339, UTC.
    pub connected_since: String,
    /// By type URL.
    pub types: BTreeMap<String, TypeStatus>,
}

/// One client's state for one resource type.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TypeStatus {
    /// The version the client last accepted: the response's `version_info` for the state of
    /// the world, the digest of the set it holds for delta.
    pub acked_version: Option<String>,
    pub acked_nonce: Option<String>,
    /// Resources of this type the client holds.
    pub resources: usize,
    pub last_nack: Option<Nack>,
}

/// A response a client refused.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Nack {
    /// RFC 3339, UTC.
    pub at: String,
    /// Envoy's `error_detail.message`.
    pub message: String,
    /// Resources held back from this client at the version it refused.
    pub quarantined: Vec<String>,
    /// The message named none of the response's resources, so all it changed were.
    pub whole_response: bool,
}

pub(crate) fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(SystemTime::now()).to_string()
}

/// Every connected client's status, each updated by its own stream.
#[derive(Debug, Default)]
pub(crate) struct Clients {
    next: AtomicU64,
    open: Mutex<HashMap<u64, Arc<Mutex<ClientStatus>>>>,
}

impl Clients {
    pub(crate) fn add(&self, status: ClientStatus) -> (u64, Arc<Mutex<ClientStatus>>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let status = Arc::new(Mutex::new(status));
        self.open.lock().unwrap_or_else(PoisonError::into_inner).insert(id, status.clone());
        (id, status)
    }

    pub(crate) fn remove(&self, id: u64) {
        self.open.lock().unwrap_or_else(PoisonError::into_inner).remove(&id);
    }

    pub(crate) fn snapshot(&self) -> Vec<ClientStatus> {
        let open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let mut all: Vec<ClientStatus> =
            open.values().map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).clone()).collect();
        all.sort_by(|a, b| (&a.node_id, &a.connected_since).cmp(&(&b.node_id, &b.connected_since)));
        all
    }
}
