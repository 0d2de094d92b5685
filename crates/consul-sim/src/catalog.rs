//! The catalog: nodes, service instances and checks, with Consul's index bookkeeping.
//!
//! Pure data and logic, no I/O, so the index rules can be unit tested directly.
//!
//! Index rules (after Consul's state store, `agent/consul/state/catalog.go`):
//! - every write that changes something takes the next raft index; a write that changes
//!   nothing (re-registering identical data) takes none, exactly like Consul skipping
//!   identical updates, so anti-entropy style re-registration does not wake watchers;
//! - a service's index moves when one of its instances or one of its checks changes, and
//!   when a node it runs on changes (address, meta, or a node-level check such as
//!   `serfHealth`);
//! - when a service loses its final instance its index entry is dropped and the "extinction"
//!   index is set; an unknown service reports the extinction index, or the catalog maximum if
//!   no service ever went extinct;
//! - `/v1/catalog/services` reports the index of the last change to any service instance;
//! - a Connect destination's index (`/v1/health/connect/<name>`) moves when one of the
//!   `connect-proxy` instances naming it in `Proxy.DestinationServiceName` changes (also by
//!   its checks or node, and when a proxy starts or stops naming it); destinations are
//!   compared case-insensitively. A destination with no proxy left is dropped and sets the
//!   Connect extinction index; an unknown destination reports it, or the catalog maximum;
//! - the checks table index (`/v1/health/state/<state>`) moves whenever a check is created,
//!   modified or removed (with its service or node too), and not for a write that touches no
//!   check, such as registering a service without one. A check keeps `CreateIndex` and takes
//!   the write's index as `ModifyIndex` whenever it is (re)written.
//!
//! When is a check rewritten? When its own fields change; when a write that changes anything
//! (node, service, or another check) names it again, as the 0.9 agent of
//! `docs/consul-protocol.md` did ("same check, new port": the check's `ModifyIndex` and the
//! checks index moved), unless [`Catalog::keeps_unchanged_checks`] (Consul 1.8's state
//! store, which skips a check that is the same: a port or address change then leaves its
//! check as it was); and when its service's name or tags change, because the check shows
//! them (`ServiceName`, `ServiceTags`), which is when current agents rewrite it too. A
//! registration that changes nothing rewrites nothing and takes no index.
//!
//! Nodes and instances keep `CreateIndex` and take the index of the write that last changed
//! them as `ModifyIndex` (`/v1/catalog/nodes`, `/v1/catalog/node-services/<node>`); the
//! nodes table index moves when a node is created, changed or removed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// The default Consul Enterprise namespace and partition (the only ones in Consul OSS).
pub(crate) const DEFAULT_SCOPE: &str = "default";

/// What identifies a service for health queries and indexes.
///
/// Namespaces and partitions are Consul Enterprise features; they are modelled only as part of
/// this identity so that a query scoped to `ns=a` does not see services registered in `ns=b`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub partition: String,
    pub namespace: String,
    pub name: String,
}

impl ServiceKey {
    /// A key in the default namespace and partition.
    pub fn new(name: impl Into<String>) -> Self {
        Self::scoped(name, None, None)
    }

    /// A key with optional namespace and partition; empty or absent means `default`.
    pub fn scoped(name: impl Into<String>, namespace: Option<&str>, partition: Option<&str>) -> Self {
        let scope = |s: Option<&str>| match s {
            Some(s) if !s.is_empty() => s.to_owned(),
            _ => DEFAULT_SCOPE.to_owned(),
        };
        Self { partition: scope(partition), namespace: scope(namespace), name: name.into() }
    }

    /// In the default namespace and partition.
    pub(crate) fn is_default_scope(&self) -> bool {
        self.namespace == DEFAULT_SCOPE && self.partition == DEFAULT_SCOPE
    }
}

/// A check's health. Consul's `maintenance` is stored (and shown) as `critical`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CheckStatus {
    Passing,
    Warning,
    Critical,
}

impl CheckStatus {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            CheckStatus::Passing => "passing",
            CheckStatus::Warning => "warning",
            CheckStatus::Critical => "critical",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "passing" => Some(CheckStatus::Passing),
            "warning" => Some(CheckStatus::Warning),
            "critical" | "maintenance" => Some(CheckStatus::Critical),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Node {
    pub id: String,
    pub name: String,
    pub address: String,
    pub datacenter: String,
    pub tagged_addresses: BTreeMap<String, String>,
    pub meta: BTreeMap<String, String>,
    pub create_index: u64,
    pub modify_index: u64,
}

impl Node {
    fn same_data(&self, other: &Node) -> bool {
        self.id == other.id
            && self.address == other.address
            && self.tagged_addresses == other.tagged_addresses
            && self.meta == other.meta
    }
}

/// A service instance's locality (Consul 1.17+): where it runs, for topology-aware routing.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "PascalCase", default)]
pub(crate) struct Locality {
    pub region: String,
    pub zone: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub(crate) struct TaggedAddress {
    #[serde(default)]
    pub address: String,
    #[serde(default)]
    pub port: u16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub(crate) struct Weights {
    #[serde(default = "one")]
    pub passing: i32,
    #[serde(default = "one")]
    pub warning: i32,
}

fn one() -> i32 {
    1
}

impl Default for Weights {
    fn default() -> Self {
        Weights { passing: 1, warning: 1 }
    }
}

/// `Service.Kind`: the kinds the simulator knows. Anything else is refused with a 400 rather
/// than stored and silently mis-served.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum ServiceKind {
    #[default]
    Typical,
    ConnectProxy,
}

impl ServiceKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ServiceKind::Typical => "",
            ServiceKind::ConnectProxy => "connect-proxy",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "" => Some(ServiceKind::Typical),
            "connect-proxy" => Some(ServiceKind::ConnectProxy),
            _ => None,
        }
    }
}

/// `Service.Proxy`: the fields the simulator models (Consul's `ConnectProxyConfig`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub(crate) struct ProxyConfig {
    pub destination_service_name: String,
    #[serde(rename = "DestinationServiceID")]
    pub destination_service_id: String,
    pub local_service_address: String,
    pub local_service_port: u16,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ServiceInstance {
    pub node: String,
    pub id: String,
    pub key: ServiceKey,
    pub tags: Vec<String>,
    pub address: String,
    pub port: u16,
    pub meta: BTreeMap<String, String>,
    pub tagged_addresses: BTreeMap<String, TaggedAddress>,
    /// As registered (`Service.Locality`); `None` when the registration sent none.
    pub locality: Option<Locality>,
    pub weights: Weights,
    pub enable_tag_override: bool,
    pub kind: ServiceKind,
    /// As registered; `None` when the registration sent no `Proxy`.
    pub proxy: Option<ProxyConfig>,
    pub create_index: u64,
    pub modify_index: u64,
}

impl ServiceInstance {
    /// The key of the destination this instance proxies for, in its own namespace and
    /// partition, with the name lowercased: `None` unless it is a `connect-proxy`.
    pub(crate) fn connect_destination(&self) -> Option<ServiceKey> {
        if self.kind != ServiceKind::ConnectProxy {
            return None;
        }
        let dest = self.proxy.as_ref()?;
        Some(connect_key(&dest.destination_service_name, &self.key.namespace, &self.key.partition))
    }

    fn same_data(&self, other: &ServiceInstance) -> bool {
        self.key == other.key
            && self.tags == other.tags
            && self.address == other.address
            && self.port == other.port
            && self.meta == other.meta
            && self.tagged_addresses == other.tagged_addresses
            && self.locality == other.locality
            && self.weights == other.weights
            && self.enable_tag_override == other.enable_tag_override
            && self.kind == other.kind
            && self.proxy == other.proxy
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Check {
    pub node: String,
    pub check_id: String,
    pub name: String,
    pub status: CheckStatus,
    pub notes: String,
    pub output: String,
    /// Empty for a node-level check.
    pub service_id: String,
    pub create_index: u64,
    pub modify_index: u64,
}

impl Check {
    fn same_data(&self, other: &Check) -> bool {
        self.name == other.name
            && self.status == other.status
            && self.notes == other.notes
            && self.output == other.output
            && self.service_id == other.service_id
    }
}

/// A write that was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum CatalogError {
    /// 400: the request is malformed.
    #[error("{0}")]
    BadRequest(String),
    /// 500: the request is well-formed but cannot be applied (Consul answers 500 for these).
    #[error("{0}")]
    Internal(String),
}

/// `PUT /v1/catalog/register` body. Field names are Consul's (PascalCase); unknown fields are
/// ignored. Unlike Go's decoder, key matching is case-sensitive.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub(crate) struct RegisterRequest {
    #[serde(rename = "ID")]
    pub id: Option<String>,
    pub node: Option<String>,
    pub address: Option<String>,
    pub datacenter: Option<String>,
    pub tagged_addresses: Option<BTreeMap<String, String>>,
    pub node_meta: Option<BTreeMap<String, String>>,
    pub service: Option<ServiceRegistration>,
    pub check: Option<CheckRegistration>,
    pub checks: Option<Vec<CheckRegistration>>,
    pub skip_node_update: bool,
    pub namespace: Option<String>,
    pub partition: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub(crate) struct ServiceRegistration {
    #[serde(rename = "ID")]
    pub id: Option<String>,
    pub service: Option<String>,
    pub tags: Option<Vec<String>>,
    pub address: Option<String>,
    pub port: Option<u16>,
    pub meta: Option<BTreeMap<String, String>>,
    pub tagged_addresses: Option<BTreeMap<String, TaggedAddress>>,
    pub locality: Option<Locality>,
    pub weights: Option<Weights>,
    pub enable_tag_override: bool,
    pub kind: Option<String>,
    pub proxy: Option<ProxyConfig>,
    pub namespace: Option<String>,
    pub partition: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub(crate) struct CheckRegistration {
    pub node: Option<String>,
    #[serde(rename = "CheckID")]
    pub check_id: Option<String>,
    pub name: Option<String>,
    pub status: Option<String>,
    pub notes: Option<String>,
    pub output: Option<String>,
    #[serde(rename = "ServiceID")]
    pub service_id: Option<String>,
}

/// `PUT /v1/catalog/deregister` body.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub(crate) struct DeregisterRequest {
    pub node: Option<String>,
    pub datacenter: Option<String>,
    #[serde(rename = "ServiceID")]
    pub service_id: Option<String>,
    #[serde(rename = "CheckID")]
    pub check_id: Option<String>,
}

/// One row of a health answer, before rendering: the catalog's own values, shared (a row
/// is taken under the catalog's lock, so it copies pointers, not strings).
#[derive(Clone, Debug)]
pub(crate) struct HealthEntry {
    pub node: Arc<Node>,
    pub service: Arc<ServiceInstance>,
    /// The cluster peer the instance was imported from (`PeerName`); `None` for local ones.
    pub peer: Option<String>,
    /// The node's own checks and the service's checks, together sorted by check ID.
    pub checks: Vec<Arc<Check>>,
}

impl HealthEntry {
    /// `?passing`: every check, node checks included, is `passing`.
    pub(crate) fn all_passing(&self) -> bool {
        self.checks.iter().all(|c| c.status == CheckStatus::Passing)
    }
}

/// Which checks `/v1/health/state/<state>` returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StateFilter {
    Any,
    Only(CheckStatus),
    /// An unknown state on an agent that answers it with `[]` rather than a 400.
    Nothing,
}

impl StateFilter {
    /// `any`, `passing`, `warning` or `critical`; `None` for anything else.
    pub(crate) fn parse(state: &str) -> Option<Self> {
        match state {
            "any" => Some(StateFilter::Any),
            "passing" => Some(StateFilter::Only(CheckStatus::Passing)),
            "warning" => Some(StateFilter::Only(CheckStatus::Warning)),
            "critical" => Some(StateFilter::Only(CheckStatus::Critical)),
            _ => None,
        }
    }
}

/// A check as [`Catalog`] holds it: by (node, check ID).
type KeyedCheck<'a> = (&'a (String, String), &'a Arc<Check>);

/// One row of a `/v1/health/state` answer, before rendering.
#[derive(Clone, Debug)]
pub(crate) struct StateEntry {
    pub check: Arc<Check>,
    /// The service instance it belongs to (its name, scope and tags show); `None` for a
    /// node check.
    pub owner: Option<Arc<ServiceInstance>>,
}

/// Bookkeeping of one write transaction.
#[derive(Default)]
struct Tx {
    changed: bool,
    services_table_changed: bool,
    nodes_table_changed: bool,
    checks_table_changed: bool,
    dirty: BTreeSet<ServiceKey>,
    /// Connect destinations (see [`connect_key`]) whose proxies changed.
    dirty_connect: BTreeSet<ServiceKey>,
}

impl Tx {
    /// An instance changed (or its checks or node did): its service's index moves, and so
    /// does its Connect destination's if it is a proxy.
    fn mark(&mut self, svc: &ServiceInstance) {
        self.dirty.insert(svc.key.clone());
        if let Some(dest) = svc.connect_destination() {
            self.dirty_connect.insert(dest);
        }
    }
}

/// The key of a Connect destination: its name lowercased (Consul compares service names
/// case-insensitively there), in the given namespace and partition.
pub(crate) fn connect_key(name: &str, namespace: &str, partition: &str) -> ServiceKey {
    ServiceKey::scoped(name.to_lowercase(), Some(namespace), Some(partition))
}

fn non_empty(s: Option<String>) -> Option<String> {
    s.filter(|s| !s.is_empty())
}

/// The service of a registration on `node_name`, normalised; `scope` is the namespace and
/// partition of the registration, used when the service does not name its own.
fn registered_service(
    s: ServiceRegistration,
    node_name: &str,
    (namespace, partition): (Option<&str>, Option<&str>),
    idx: u64,
) -> Result<ServiceInstance, CatalogError> {
    let name = non_empty(s.service).ok_or_else(|| CatalogError::BadRequest("Must provide service name".into()))?;
    let id = non_empty(s.id).unwrap_or_else(|| name.clone());
    let ns = non_empty(s.namespace).or_else(|| namespace.map(str::to_owned));
    let part = non_empty(s.partition).or_else(|| partition.map(str::to_owned));
    let kind_text = s.kind.unwrap_or_default();
    let kind = ServiceKind::parse(&kind_text).ok_or_else(|| {
        CatalogError::BadRequest(format!(
            "consul-sim: unsupported service Kind {kind_text:?} (only \"\" and \"connect-proxy\")"
        ))
    })?;
    let port = s.port.unwrap_or(0);
    if kind == ServiceKind::ConnectProxy {
        validate_connect_proxy(s.proxy.as_ref(), port)?;
    }
    Ok(ServiceInstance {
        node: node_name.to_owned(),
        id,
        key: ServiceKey::scoped(name, ns.as_deref(), part.as_deref()),
        tags: s.tags.unwrap_or_default(),
        address: s.address.unwrap_or_default(),
        port,
        meta: s.meta.unwrap_or_default(),
        tagged_addresses: s.tagged_addresses.unwrap_or_default(),
        locality: s.locality,
        weights: s.weights.unwrap_or_default(),
        enable_tag_override: s.enable_tag_override,
        kind,
        proxy: s.proxy,
        create_index: idx,
        modify_index: idx,
    })
}

/// Consul's NodeService.Validate for a Connect proxy, answered as 500 like other RPC errors.
fn validate_connect_proxy(proxy: Option<&ProxyConfig>, port: u16) -> Result<(), CatalogError> {
    let dest = proxy.map_or("", |p| p.destination_service_name.as_str());
    if dest.is_empty() {
        return Err(CatalogError::Internal(
            "Proxy.DestinationServiceName must be non-empty for Connect proxy services".into(),
        ));
    }
    if dest == "*" {
        return Err(CatalogError::Internal(
            "Proxy.DestinationServiceName must not be a wildcard for Connect proxy services".into(),
        ));
    }
    if port == 0 {
        return Err(CatalogError::Internal("Port must be set for a Connect proxy".into()));
    }
    Ok(())
}

/// Where a health read's instances come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Origin {
    /// This cluster's own catalog.
    Local,
    /// `?peer=<name>`: the services imported from a cluster peer.
    Peer(String),
    /// `?sameness-group=<name>`: the group's members in order, the first with instances
    /// left after the read's filters answering.
    Sameness(String),
}

/// One member of a sameness group: a partition of this cluster or a cluster peer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "PascalCase", default)]
pub(crate) struct SamenessMember {
    #[serde(skip_serializing_if = "String::is_empty")]
    pub partition: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub peer: String,
}

/// `PUT /v1/config` body for a sameness group (the only config entry kind modelled).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
pub(crate) struct ConfigEntry {
    pub kind: String,
    pub name: String,
    pub members: Vec<SamenessMember>,
}

#[derive(Clone, Debug)]
pub(crate) struct Catalog {
    datacenter: String,
    /// For the catalog of a peer's imported services, the peer's name (`PeerName`).
    peer_name: Option<String>,
    /// The services imported from each cluster peer: a catalog of their own, written
    /// through `/_sim/peers/<peer>/...` (peering replicates them; no client writes them),
    /// sharing this catalog's raft index as imported data does in Consul.
    imported: BTreeMap<String, Catalog>,
    /// Sameness groups by name: their members in order, and the index of the last write.
    sameness_groups: BTreeMap<String, (Vec<SamenessMember>, u64)>,
    raft_index: u64,
    nodes: BTreeMap<String, Arc<Node>>,
    /// Keyed by (node, service ID).
    /// Shared with the answers that show them (`Arc`): a 75,000-check answer takes a
    /// pointer per check under the lock, not copies of every string.
    services: BTreeMap<(String, String), Arc<ServiceInstance>>,
    /// The instances of each service, as keys of `services`: a health read or a write's
    /// index bookkeeping then costs the instances of one service, not the whole catalog
    /// (a full scan per read held the lock long enough to cap a 75,000-instance catalog
    /// at about 100 reads a second). Kept in step with `services` by `insert_service` and
    /// `remove_service_entry`; a service with no instance has no entry.
    by_service: HashMap<ServiceKey, BTreeSet<(String, String)>>,
    /// The tags of each service's instances, counted, for `/v1/catalog/services` (which
    /// shows their union): kept in step with `by_service`, so that answer costs the services
    /// and not every instance of them.
    tags_by_service: HashMap<ServiceKey, BTreeMap<String, usize>>,
    /// How many instances are outside the default namespace and partition: while none is,
    /// a default-scope checks answer needs no look at each instance's scope.
    scoped_instances: usize,
    /// Keyed by (node, check ID).
    checks: BTreeMap<(String, String), Arc<Check>>,
    /// The keys of `checks` by status (passing, warning, critical), kept in step by
    /// `insert_check` and `remove_check`: a query of one status walks that status's checks
    /// alone, not every check under the lock, as Consul's state store indexes checks by
    /// status.
    checks_by_status: [BTreeSet<(String, String)>; 3],
    /// The check IDs of each (node, service ID) owner, `""` for node checks: an instance's
    /// checks without walking every check of its node (thousands on a busy node). Kept in
    /// step with `checks` by `insert_check` and `remove_check`.
    checks_by_owner: HashMap<(String, String), BTreeSet<String>>,
    service_indexes: HashMap<ServiceKey, u64>,
    /// The `connect-proxy` instances of each Connect destination ([`connect_key`]), kept in
    /// step with `services` like `by_service`.
    by_destination: HashMap<ServiceKey, BTreeSet<(String, String)>>,
    /// The index of each Connect destination with at least one proxy.
    connect_indexes: HashMap<ServiceKey, u64>,
    /// When a destination last lost its final proxy.
    last_connect_extinction: Option<u64>,
    services_table_index: u64,
    /// The index of the last write to any node.
    nodes_table_index: u64,
    /// A registration that names an unchanged check again leaves it as it is, whatever
    /// else it changes (see the module's doc); set before each write.
    pub(crate) keeps_unchanged_checks: bool,
    /// The index of the last write to any check.
    checks_table_index: u64,
    /// Per status (passing, warning, critical): the index of the last write that put a
    /// check in that status, took one out of it, or rewrote one in it. A blocking
    /// `/v1/health/state/<status>` waits for this, not for any check write: Consul's state
    /// store watches the status index's entries, and reports the checks table's index.
    status_indexes: [u64; 3],
    /// The statuses the write being applied touched (see `status_indexes`).
    touched_statuses: [bool; 3],
    last_extinction: Option<u64>,
}

impl Catalog {
    pub(crate) fn new(datacenter: impl Into<String>, initial_index: u64) -> Self {
        Catalog {
            datacenter: datacenter.into(),
            peer_name: None,
            imported: BTreeMap::new(),
            sameness_groups: BTreeMap::new(),
            raft_index: initial_index,
            nodes: BTreeMap::new(),
            services: BTreeMap::new(),
            by_service: HashMap::new(),
            tags_by_service: HashMap::new(),
            scoped_instances: 0,
            checks: BTreeMap::new(),
            checks_by_status: Default::default(),
            checks_by_owner: HashMap::new(),
            service_indexes: HashMap::new(),
            by_destination: HashMap::new(),
            connect_indexes: HashMap::new(),
            last_connect_extinction: None,
            services_table_index: 0,
            nodes_table_index: 0,
            keeps_unchanged_checks: false,
            checks_table_index: 0,
            status_indexes: [0; 3],
            touched_statuses: [false; 3],
            last_extinction: None,
        }
    }

    /// The last raft index used by a write (the catalog maximum).
    pub(crate) fn raft_index(&self) -> u64 {
        self.raft_index
    }

    /// Whether no service instance is registered at all.
    pub(crate) fn has_no_service(&self) -> bool {
        self.services.is_empty()
    }

    /// The index `/v1/health/state/<state>` reports.
    pub(crate) fn checks_index(&self) -> u64 {
        self.checks_table_index
    }

    /// What a blocking `/v1/health/state/<state>` waits for: the last write to a check of
    /// that status for one status, any check write for `any` (see `status_indexes`).
    pub(crate) fn state_stirred_index(&self, filter: StateFilter) -> u64 {
        match filter {
            StateFilter::Only(status) => self.status_indexes[status as usize],
            StateFilter::Any | StateFilter::Nothing => self.checks_table_index,
        }
    }

    /// The index a health query for `key` reports (before the `1` minimum is applied).
    pub(crate) fn service_index(&self, key: &ServiceKey) -> u64 {
        match self.service_indexes.get(key) {
            Some(&index) => index,
            None => self.last_extinction.unwrap_or(self.raft_index),
        }
    }

    /// The index `/v1/health/connect/<name>` reports for a destination key ([`connect_key`])
    /// (before the `1` minimum is applied); an unknown destination falls back as an unknown
    /// service does, on the Connect extinction index.
    pub(crate) fn connect_index(&self, key: &ServiceKey) -> u64 {
        match self.connect_indexes.get(key) {
            Some(&index) => index,
            None => self.last_connect_extinction.unwrap_or(self.raft_index),
        }
    }

    /// The index `/v1/catalog/services` reports.
    pub(crate) fn services_index(&self) -> u64 {
        self.services_table_index
    }

    /// The index `/v1/catalog/nodes` reports.
    pub(crate) fn nodes_index(&self) -> u64 {
        self.nodes_table_index
    }

    /// The index `/v1/catalog/node-services/<node>` reports: the later of the nodes' and the
    /// services' tables, `0` for a node that does not exist (as Consul's state store).
    pub(crate) fn node_services_index(&self, node: &str) -> u64 {
        if self.nodes.contains_key(node) { self.nodes_table_index.max(self.services_table_index) } else { 0 }
    }

    /// Every node, by name.
    pub(crate) fn nodes(&self) -> Vec<Arc<Node>> {
        self.nodes.values().cloned().collect()
    }

    /// A node and its instances in a namespace/partition, by service ID; `None` for a node
    /// that does not exist.
    pub(crate) fn node_with_services(
        &self,
        node: &str,
        namespace: Option<&str>,
        partition: Option<&str>,
    ) -> Option<(Arc<Node>, Vec<Arc<ServiceInstance>>)> {
        let scope = ServiceKey::scoped("", namespace, partition);
        let in_scope =
            |s: &&Arc<ServiceInstance>| s.key.namespace == scope.namespace && s.key.partition == scope.partition;
        let on_node = (node.to_owned(), String::new())..(format!("{node}\0"), String::new());
        let services = self.services.range(on_node).map(|(_, s)| s).filter(in_scope).cloned().collect();
        Some((self.nodes.get(node)?.clone(), services))
    }

    /// Whether a sameness group of that name exists.
    pub(crate) fn has_sameness_group(&self, name: &str) -> bool {
        self.sameness_groups.contains_key(name)
    }

    /// Where each source of `origin` reads `key`: this catalog or a peer's (`None` for a
    /// peer never heard of, which has no services), and the key there.
    fn sources(&self, origin: &Origin, key: &ServiceKey) -> Vec<(Option<&Catalog>, ServiceKey)> {
        let peer = |name: &str| {
            // A peer's services are imported into the default partition, under their names.
            (self.imported.get(name), ServiceKey::scoped(key.name.clone(), Some(&key.namespace), None))
        };
        match origin {
            Origin::Local => vec![(Some(self), key.clone())],
            Origin::Peer(name) => vec![peer(name)],
            Origin::Sameness(group) => self
                .sameness_groups
                .get(group)
                .map(|(members, _)| members.as_slice())
                .unwrap_or_default()
                .iter()
                .map(|m| {
                    if m.peer.is_empty() {
                        (Some(self), ServiceKey::scoped(key.name.clone(), Some(&key.namespace), Some(&m.partition)))
                    } else {
                        peer(&m.peer)
                    }
                })
                .collect(),
        }
    }

    /// The index a health read of `key` from `origin` reports: the service's own index
    /// locally; the imported service's for a peer (the catalog maximum for an unknown peer);
    /// for a sameness group the highest of its members' and of the group's own last write,
    /// so that a change in any member wakes the read.
    pub(crate) fn origin_index(&self, origin: &Origin, key: &ServiceKey) -> u64 {
        let members =
            self.sources(origin, key).into_iter().map(|(c, k)| c.map_or(self.raft_index, |c| c.service_index(&k)));
        let group = match origin {
            Origin::Sameness(g) => self.sameness_groups.get(g).map_or(0, |(_, index)| *index),
            _ => 0,
        };
        members.fold(group, u64::max)
    }

    /// The health rows of `key` from `origin` that `keep` keeps (the read's own filters):
    /// for a sameness group, those of the first member that has rows `choose` keeps.
    pub(crate) fn origin_health(
        &self,
        origin: &Origin,
        key: &ServiceKey,
        tags: &[String],
        choose: impl Fn(&HealthEntry) -> bool,
        keep: impl Fn(&HealthEntry) -> bool,
    ) -> Vec<HealthEntry> {
        for (catalog, key) in self.sources(origin, key) {
            let mut entries = catalog.map(|c| c.health(&key, tags)).unwrap_or_default();
            if entries.iter().any(&choose) {
                entries.retain(&keep);
                return entries;
            }
        }
        Vec::new()
    }

    /// The members of the sameness group `name`, in order, and the index of its last write.
    pub(crate) fn sameness_group(&self, name: &str) -> Option<(&[SamenessMember], u64)> {
        self.sameness_groups.get(name).map(|(members, index)| (members.as_slice(), *index))
    }

    /// Registers into the services imported from `peer` (created at its first write); the
    /// write takes this catalog's next raft index.
    pub(crate) fn register_imported(&mut self, peer: &str, req: RegisterRequest) -> Result<bool, CatalogError> {
        self.write_imported(peer, |c| c.register(req, None, None))
    }

    /// Deregisters from the services imported from `peer`.
    pub(crate) fn deregister_imported(&mut self, peer: &str, req: DeregisterRequest) -> Result<bool, CatalogError> {
        self.write_imported(peer, |c| c.deregister(req))
    }

    fn write_imported(
        &mut self,
        peer: &str,
        write: impl FnOnce(&mut Catalog) -> Result<bool, CatalogError>,
    ) -> Result<bool, CatalogError> {
        let mut imported = self.imported.remove(peer).unwrap_or_else(|| Catalog {
            peer_name: Some(peer.to_owned()),
            ..Catalog::new(self.datacenter.clone(), self.raft_index)
        });
        imported.raft_index = self.raft_index;
        imported.keeps_unchanged_checks = self.keeps_unchanged_checks;
        let result = write(&mut imported);
        self.raft_index = imported.raft_index;
        self.imported.insert(peer.to_owned(), imported);
        result
    }

    /// `PUT /v1/config` of a sameness group: creates or replaces it (taking a raft index).
    pub(crate) fn set_config_entry(&mut self, entry: ConfigEntry) -> Result<(), CatalogError> {
        if !entry.kind.eq_ignore_ascii_case("sameness-group") {
            return Err(CatalogError::BadRequest(format!(
                "config entry kind {:?} is not modelled by consul-sim",
                entry.kind
            )));
        }
        if entry.name.is_empty() {
            return Err(CatalogError::BadRequest("Name is required".into()));
        }
        if let Some(m) = entry.members.iter().find(|m| m.peer.is_empty() == m.partition.is_empty()) {
            return Err(CatalogError::BadRequest(format!(
                "a member must name exactly one of Partition and Peer: {m:?}"
            )));
        }
        self.raft_index += 1;
        self.sameness_groups.insert(entry.name, (entry.members, self.raft_index));
        Ok(())
    }

    /// The health rows of `key` whose instances carry every tag in `tags` (compared
    /// case-insensitively, as Consul does).
    pub(crate) fn health(&self, key: &ServiceKey, tags: &[String]) -> Vec<HealthEntry> {
        self.health_of(self.by_service.get(key), tags)
    }

    /// The health rows of the `connect-proxy` instances for the destination `key`
    /// ([`connect_key`]), filtered by the proxies' own tags as [`Catalog::health`] does.
    pub(crate) fn connect_health(&self, key: &ServiceKey, tags: &[String]) -> Vec<HealthEntry> {
        self.health_of(self.by_destination.get(key), tags)
    }

    fn health_of(&self, instances: Option<&BTreeSet<(String, String)>>, tags: &[String]) -> Vec<HealthEntry> {
        let mut entries = Vec::new();
        let instances = instances.into_iter().flatten().filter_map(|k| self.services.get(k));
        for svc in instances {
            let has_all_tags = tags.iter().all(|want| svc.tags.iter().any(|t| t.eq_ignore_ascii_case(want)));
            if !has_all_tags {
                continue;
            }
            let Some(node) = self.nodes.get(&svc.node) else {
                continue;
            };
            let mut checks: Vec<Arc<Check>> = self
                .owned_check_arcs(&svc.node, "")
                .chain(self.owned_check_arcs(&svc.node, &svc.id))
                .cloned()
                .collect();
            checks.sort_by(|a, b| a.check_id.cmp(&b.check_id));
            entries.push(HealthEntry {
                node: node.clone(),
                service: svc.clone(),
                peer: self.peer_name.clone(),
                checks,
            });
        }
        entries
    }

    /// The checks in `filter`'s state, by (node, check ID): the service checks of services in
    /// the namespace/partition, and every node check whatever the scope (node checks belong
    /// to no namespace; see the crate docs).
    pub(crate) fn checks_in_state(
        &self,
        filter: StateFilter,
        namespace: Option<&str>,
        partition: Option<&str>,
    ) -> Vec<StateEntry> {
        let scope = ServiceKey::scoped("", namespace, partition);
        let mut out = Vec::new();
        // Checks come node by node: the instances of the node being walked, by service ID.
        // (A lookup per check in `services` compared node names at every level of the tree:
        // thousands of instances share a node.)
        let mut node: Option<&str> = None;
        let mut instances: HashMap<&str, &Arc<ServiceInstance>, foldhash::fast::RandomState> = HashMap::default();
        // Each instance's scope is a look at two more strings per check, all over memory.
        let every_instance_in_scope = self.scoped_instances == 0 && scope.is_default_scope();
        let in_state: Box<dyn Iterator<Item = KeyedCheck<'_>>> = match filter {
            StateFilter::Any => Box::new(self.checks.iter()),
            StateFilter::Only(status) => {
                Box::new(self.checks_by_status[status as usize].iter().filter_map(|k| self.checks.get_key_value(k)))
            }
            StateFilter::Nothing => Box::new(std::iter::empty()),
        };
        for ((check_node, _), c) in in_state {
            let owner = if c.service_id.is_empty() {
                None
            } else {
                if node != Some(check_node.as_str()) {
                    node = Some(check_node);
                    instances.clear();
                    // Exactly this node's keys: no key lies between `node` and `node\0`.
                    let on_node = (check_node.clone(), String::new())..(format!("{check_node}\0"), String::new());
                    instances.extend(self.services.range(on_node).map(|((_, id), s)| (id.as_str(), s)));
                }
                // Registration refuses a check of an unknown instance and removing an
                // instance removes its checks, so the owner exists.
                let Some(s) = instances.get(c.service_id.as_str()) else {
                    continue;
                };
                if !every_instance_in_scope
                    && (s.key.namespace != scope.namespace || s.key.partition != scope.partition)
                {
                    continue;
                }
                Some(Arc::clone(s))
            };
            out.push(StateEntry { check: c.clone(), owner });
        }
        out
    }

    /// Service names in a namespace/partition with the union of their tags (sorted, unique).
    pub(crate) fn services(&self, namespace: Option<&str>, partition: Option<&str>) -> BTreeMap<String, Vec<String>> {
        let scope = ServiceKey::scoped("", namespace, partition);
        self.tags_by_service
            .iter()
            .filter(|(key, _)| key.namespace == scope.namespace && key.partition == scope.partition)
            .map(|(key, tags)| (key.name.clone(), tags.keys().cloned().collect()))
            .collect()
    }

    /// Applies a registration atomically; returns whether anything changed.
    ///
    /// `namespace`/`partition` are the request's `?ns=`/`?partition=`, used when the body
    /// does not name them.
    pub(crate) fn register(
        &mut self,
        req: RegisterRequest,
        namespace: Option<&str>,
        partition: Option<&str>,
    ) -> Result<bool, CatalogError> {
        let node_name = non_empty(req.node).ok_or_else(|| CatalogError::BadRequest("Must provide node".into()))?;
        let address = non_empty(req.address);
        let keep_node = req.skip_node_update && self.nodes.contains_key(&node_name);
        if address.is_none() && !keep_node {
            return Err(CatalogError::BadRequest("Must provide address".into()));
        }

        let idx = self.raft_index + 1;
        let top_ns = non_empty(req.namespace).or_else(|| namespace.map(str::to_owned));
        let top_partition = non_empty(req.partition).or_else(|| partition.map(str::to_owned));
        let scope = (top_ns.as_deref(), top_partition.as_deref());

        // Everything is validated before the state is touched.
        let service = req.service.map(|s| registered_service(s, &node_name, scope, idx)).transpose()?;
        let checks = req
            .check
            .into_iter()
            .chain(req.checks.into_iter().flatten())
            .map(|c| self.registered_check(c, &node_name, service.as_ref(), idx))
            .collect::<Result<Vec<_>, _>>()?;

        let mut tx = Tx::default();
        if !keep_node {
            let node = Node {
                id: req.id.unwrap_or_default(),
                name: node_name.clone(),
                address: address.unwrap_or_default(),
                datacenter: self.datacenter.clone(),
                tagged_addresses: req.tagged_addresses.unwrap_or_default(),
                meta: req.node_meta.unwrap_or_default(),
                create_index: idx,
                modify_index: idx,
            };
            self.write_node(node, &mut tx);
        }
        if let Some(svc) = service {
            self.write_service(svc, idx, &mut tx);
        }
        self.write_checks(&node_name, checks, idx, &mut tx);
        Ok(self.commit(idx, tx))
    }

    /// A check of a registration on `node_name`, normalised; the service it names must be in
    /// the same registration (`service`) or already on the node.
    fn registered_check(
        &self,
        c: CheckRegistration,
        node_name: &str,
        service: Option<&ServiceInstance>,
        idx: u64,
    ) -> Result<Check, CatalogError> {
        let name = c.name.unwrap_or_default();
        let check_id = non_empty(c.check_id)
            .or_else(|| non_empty(Some(name.clone())))
            .ok_or_else(|| CatalogError::BadRequest("Must provide check ID or name".into()))?;
        if let Some(n) = non_empty(c.node)
            && n != node_name
        {
            return Err(CatalogError::BadRequest(format!(
                "Check node {n:?} does not match registration node {node_name:?}"
            )));
        }
        let status = match non_empty(c.status) {
            None => CheckStatus::Critical,
            Some(s) => CheckStatus::parse(&s)
                .ok_or_else(|| CatalogError::BadRequest(format!("Invalid check status: {s:?}")))?,
        };
        let service_id = c.service_id.unwrap_or_default();
        if !service_id.is_empty() {
            let in_request = service.is_some_and(|s| s.id == service_id);
            let existing = self.services.contains_key(&(node_name.to_owned(), service_id.clone()));
            if !in_request && !existing {
                return Err(CatalogError::Internal(format!(
                    "Missing service registration for check {check_id:?} (service ID {service_id:?})"
                )));
            }
        }
        Ok(Check {
            node: node_name.to_owned(),
            check_id,
            name,
            status,
            notes: c.notes.unwrap_or_default(),
            output: c.output.unwrap_or_default(),
            service_id,
            create_index: idx,
            modify_index: idx,
        })
    }

    /// Writes a registration's node, keeping its create index when it exists.
    fn write_node(&mut self, node: Node, tx: &mut Tx) {
        let node_name = node.name.clone();
        match self.nodes.get_mut(&node_name) {
            Some(existing) if existing.same_data(&node) => {}
            Some(existing) => {
                *existing = Arc::new(Node { create_index: existing.create_index, ..node });
                tx.changed = true;
                tx.nodes_table_changed = true;
                self.mark_node_services(&node_name, tx);
            }
            None => {
                self.nodes.insert(node_name, Arc::new(node));
                tx.changed = true;
                tx.nodes_table_changed = true;
            }
        }
    }

    /// Writes a registration's service instance, keeping its create index when it exists.
    fn write_service(&mut self, svc: ServiceInstance, idx: u64, tx: &mut Tx) {
        let k = (svc.node.clone(), svc.id.clone());
        match self.services.get_mut(&k) {
            Some(existing) if existing.same_data(&svc) => {}
            Some(existing) => {
                tx.mark(existing);
                tx.mark(&svc);
                let create_index = existing.create_index;
                let shown_in_checks_changed = existing.key != svc.key || existing.tags != svc.tags;
                // The instance may have moved to another service name (same ID).
                self.remove_service_entry(&k);
                self.insert_service(ServiceInstance { create_index, ..svc });
                tx.changed = true;
                tx.services_table_changed = true;
                if shown_in_checks_changed {
                    self.rewrite_owned_checks(&k.0, &k.1, idx, tx);
                }
            }
            None => {
                tx.mark(&svc);
                self.insert_service(svc);
                tx.changed = true;
                tx.services_table_changed = true;
            }
        }
    }

    /// Writes a registration's checks: all rewritten if anything in the write changed (see
    /// the module docs).
    fn write_checks(&mut self, node_name: &str, checks: Vec<Check>, idx: u64, tx: &mut Tx) {
        let any_check_differs = checks.iter().any(|check| {
            self.checks.get(&(node_name.to_owned(), check.check_id.clone())).is_none_or(|e| !e.same_data(check))
        });
        if !tx.changed && !any_check_differs {
            return;
        }
        for check in checks {
            let k = (node_name.to_owned(), check.check_id.clone());
            if self.keeps_unchanged_checks && self.checks.get(&k).is_some_and(|e| e.same_data(&check)) {
                continue;
            }
            let previous_service = self.checks.get(&k).map(|c| c.service_id.clone());
            for sid in previous_service.iter().chain(std::iter::once(&check.service_id)) {
                self.mark_check_owner(node_name, sid, tx);
            }
            let create_index = self.checks.get(&k).map_or(idx, |c| c.create_index);
            self.insert_check(Check { create_index, ..check });
            tx.changed = true;
            tx.checks_table_changed = true;
        }
    }

    /// Applies a deregistration; returns whether anything changed. Deregistering something
    /// that does not exist is not an error (Consul answers `true`).
    pub(crate) fn deregister(&mut self, req: DeregisterRequest) -> Result<bool, CatalogError> {
        let node = non_empty(req.node).ok_or_else(|| CatalogError::BadRequest("Must provide node".into()))?;
        let service_id = non_empty(req.service_id);
        let check_id = non_empty(req.check_id);
        let idx = self.raft_index + 1;
        let mut tx = Tx::default();

        if service_id.is_none() && check_id.is_none() {
            if self.nodes.remove(&node).is_some() {
                tx.changed = true;
                tx.nodes_table_changed = true;
            }
            let ids: Vec<_> = self.node_services(&node).map(|s| s.id.clone()).collect();
            for id in ids {
                self.remove_service(&node, &id, &mut tx);
            }
            let checks: Vec<_> = self.node_check_ids(&node);
            for id in checks {
                self.remove_check(&node, &id);
                tx.changed = true;
                tx.checks_table_changed = true;
            }
        }
        if let Some(id) = service_id {
            self.remove_service(&node, &id, &mut tx);
        }
        if let Some(id) = check_id
            && let Some(check) = self.remove_check(&node, &id)
        {
            tx.changed = true;
            tx.checks_table_changed = true;
            self.mark_check_owner(&node, &check.service_id, &mut tx);
        }
        Ok(self.commit(idx, tx))
    }

    /// Overrides one service's index (fault injection: "index goes backwards").
    pub(crate) fn set_service_index(&mut self, key: &ServiceKey, index: u64) -> bool {
        match self.service_indexes.get_mut(key) {
            Some(i) => {
                *i = index;
                true
            }
            None => false,
        }
    }

    /// Sets every index, stored and derived, to `index` while keeping the data, as after a
    /// restore from an older snapshot or a rebuilt cluster. The next write takes `index + 1`.
    pub(crate) fn reset_indexes(&mut self, index: u64) {
        for imported in self.imported.values_mut() {
            imported.reset_indexes(index);
        }
        self.nodes_table_index = index;
        for (_, i) in self.sameness_groups.values_mut() {
            *i = index;
        }
        self.raft_index = index;
        self.services_table_index = index;
        self.checks_table_index = index;
        self.status_indexes = [index; 3];
        if self.last_extinction.is_some() {
            self.last_extinction = Some(index);
        }
        if self.last_connect_extinction.is_some() {
            self.last_connect_extinction = Some(index);
        }
        for i in self.service_indexes.values_mut().chain(self.connect_indexes.values_mut()) {
            *i = index;
        }
        for n in self.nodes.values_mut() {
            let n = Arc::make_mut(n);
            n.create_index = index;
            n.modify_index = index;
        }
        for s in self.services.values_mut() {
            let s = Arc::make_mut(s);
            s.create_index = index;
            s.modify_index = index;
        }
        for c in self.checks.values_mut() {
            let c = Arc::make_mut(c);
            c.create_index = index;
            c.modify_index = index;
        }
    }

    fn node_services<'a>(&'a self, node: &'a str) -> impl Iterator<Item = &'a ServiceInstance> + 'a {
        self.services
            .range((node.to_owned(), String::new())..)
            .take_while(move |((n, _), _)| n == node)
            .map(|(_, s)| &**s)
    }

    /// A node change dirties every instance on it.
    fn mark_node_services(&self, node: &str, tx: &mut Tx) {
        for s in self.node_services(node) {
            tx.mark(s);
        }
    }

    fn node_checks<'a>(&'a self, node: &'a str) -> impl Iterator<Item = &'a Check> + 'a {
        self.checks
            .range((node.to_owned(), String::new())..)
            .take_while(move |((n, _), _)| n == node)
            .map(|(_, c)| &**c)
    }

    /// The checks of one instance (`service_id` empty: the node's own checks), by check ID.
    fn owned_checks<'a>(&'a self, node: &'a str, service_id: &str) -> impl Iterator<Item = &'a Check> + 'a {
        self.owned_check_arcs(node, service_id).map(|c| &**c)
    }

    /// [`Catalog::owned_checks`] as the catalog holds them, to share.
    fn owned_check_arcs<'a>(&'a self, node: &'a str, service_id: &str) -> impl Iterator<Item = &'a Arc<Check>> + 'a {
        self.checks_by_owner
            .get(&(node.to_owned(), service_id.to_owned()))
            .into_iter()
            .flatten()
            .filter_map(move |id| self.checks.get(&(node.to_owned(), id.clone())))
    }

    /// Inserts or replaces a check, moving it between owners if its service changed.
    fn insert_check(&mut self, check: Check) {
        self.remove_check(&check.node, &check.check_id);
        self.checks_by_owner
            .entry((check.node.clone(), check.service_id.clone()))
            .or_default()
            .insert(check.check_id.clone());
        self.touched_statuses[check.status as usize] = true;
        let key = (check.node.clone(), check.check_id.clone());
        self.checks_by_status[check.status as usize].insert(key.clone());
        self.checks.insert(key, Arc::new(check));
    }

    fn remove_check(&mut self, node: &str, check_id: &str) -> Option<Arc<Check>> {
        let key = (node.to_owned(), check_id.to_owned());
        let check = self.checks.remove(&key)?;
        self.touched_statuses[check.status as usize] = true;
        self.checks_by_status[check.status as usize].remove(&key);
        let owner = (check.node.clone(), check.service_id.clone());
        if let Some(ids) = self.checks_by_owner.get_mut(&owner) {
            ids.remove(check_id);
            if ids.is_empty() {
                self.checks_by_owner.remove(&owner);
            }
        }
        Some(check)
    }

    fn node_check_ids(&self, node: &str) -> Vec<String> {
        self.node_checks(node).map(|c| c.check_id.clone()).collect()
    }

    /// A check change dirties its service, or every service of the node for a node check.
    fn mark_check_owner(&self, node: &str, service_id: &str, tx: &mut Tx) {
        if service_id.is_empty() {
            self.mark_node_services(node, tx);
        } else if let Some(s) = self.services.get(&(node.to_owned(), service_id.to_owned())) {
            tx.mark(s);
        }
    }

    /// Gives an instance's checks the write's index, as their rendering changed with it.
    fn rewrite_owned_checks(&mut self, node: &str, service_id: &str, idx: u64, tx: &mut Tx) {
        let ids = self.checks_by_owner.get(&(node.to_owned(), service_id.to_owned())).cloned().unwrap_or_default();
        for id in ids {
            if let Some(c) = self.checks.get_mut(&(node.to_owned(), id)) {
                Arc::make_mut(c).modify_index = idx;
                self.touched_statuses[c.status as usize] = true;
                tx.checks_table_changed = true;
            }
        }
    }

    fn insert_service(&mut self, svc: ServiceInstance) {
        let k = (svc.node.clone(), svc.id.clone());
        self.by_service.entry(svc.key.clone()).or_default().insert(k.clone());
        let tags = self.tags_by_service.entry(svc.key.clone()).or_default();
        for tag in &svc.tags {
            *tags.entry(tag.clone()).or_default() += 1;
        }
        self.scoped_instances += usize::from(!svc.key.is_default_scope());
        if let Some(dest) = svc.connect_destination() {
            self.by_destination.entry(dest).or_default().insert(k.clone());
        }
        self.services.insert(k, Arc::new(svc));
    }

    /// Removes an instance from `services` and `by_service` (not its checks).
    fn remove_service_entry(&mut self, k: &(String, String)) -> Option<Arc<ServiceInstance>> {
        let svc = self.services.remove(k)?;
        if let Some(instances) = self.by_service.get_mut(&svc.key) {
            instances.remove(k);
            if instances.is_empty() {
                self.by_service.remove(&svc.key);
                self.tags_by_service.remove(&svc.key);
            } else if let Some(tags) = self.tags_by_service.get_mut(&svc.key) {
                for tag in &svc.tags {
                    if let Some(n) = tags.get_mut(tag) {
                        *n -= 1;
                        if *n == 0 {
                            tags.remove(tag);
                        }
                    }
                }
            }
        }
        self.scoped_instances -= usize::from(!svc.key.is_default_scope());
        if let Some(dest) = svc.connect_destination()
            && let Some(proxies) = self.by_destination.get_mut(&dest)
        {
            proxies.remove(k);
            if proxies.is_empty() {
                self.by_destination.remove(&dest);
            }
        }
        Some(svc)
    }

    fn remove_service(&mut self, node: &str, id: &str, tx: &mut Tx) {
        let Some(svc) = self.remove_service_entry(&(node.to_owned(), id.to_owned())) else {
            return;
        };
        tx.changed = true;
        tx.services_table_changed = true;
        tx.mark(&svc);
        let owned: Vec<String> = self.owned_checks(node, id).map(|c| c.check_id.clone()).collect();
        for check_id in owned {
            self.remove_check(node, &check_id);
            tx.checks_table_changed = true;
        }
    }

    fn commit(&mut self, idx: u64, tx: Tx) -> bool {
        if !tx.changed {
            self.touched_statuses = [false; 3];
            return false;
        }
        self.raft_index = idx;
        if tx.services_table_changed {
            self.services_table_index = idx;
        }
        if tx.nodes_table_changed {
            self.nodes_table_index = idx;
        }
        if tx.checks_table_changed {
            self.checks_table_index = idx;
        }
        for (touched, index) in self.touched_statuses.iter_mut().zip(&mut self.status_indexes) {
            if std::mem::take(touched) {
                *index = idx;
            }
        }
        for key in tx.dirty {
            let alive = self.by_service.contains_key(&key);
            if alive {
                self.service_indexes.insert(key, idx);
            } else if self.service_indexes.remove(&key).is_some() {
                self.last_extinction = Some(idx);
            }
        }
        for key in tx.dirty_connect {
            if self.by_destination.contains_key(&key) {
                self.connect_indexes.insert(key, idx);
            } else if self.connect_indexes.remove(&key).is_some() {
                self.last_connect_extinction = Some(idx);
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(node: &str, addr: &str, svc: &str, id: &str, status: &str) -> RegisterRequest {
        serde_json::from_value(serde_json::json!({
            "Node": node,
            "Address": addr,
            "Service": {"ID": id, "Service": svc, "Port": 80, "Tags": ["a"]},
            "Check": {"CheckID": format!("check-{id}"), "Name": "c", "Status": status, "ServiceID": id}
        }))
        .unwrap()
    }

    fn node_check(node: &str, status: &str) -> RegisterRequest {
        serde_json::from_value(serde_json::json!({
            "Node": node,
            "Address": "10.0.0.1",
            "Check": {"CheckID": "serfHealth", "Name": "Serf", "Status": status}
        }))
        .unwrap()
    }

    fn dereg(node: &str, service_id: Option<&str>) -> DeregisterRequest {
        DeregisterRequest { node: Some(node.into()), service_id: service_id.map(Into::into), ..Default::default() }
    }

    impl Catalog {
        /// `by_service`, `checks_by_owner` and `checks_by_status` hold exactly what a rebuild
        /// from `services` and `checks` would.
        fn assert_lookup_tables_consistent(&self) {
            let mut rebuilt: HashMap<ServiceKey, BTreeSet<(String, String)>> = HashMap::new();
            for (k, s) in &self.services {
                rebuilt.entry(s.key.clone()).or_default().insert(k.clone());
            }
            assert_eq!(self.by_service, rebuilt);
            let mut tags: HashMap<ServiceKey, BTreeMap<String, usize>> = HashMap::new();
            for s in self.services.values() {
                let counts = tags.entry(s.key.clone()).or_default();
                for t in &s.tags {
                    *counts.entry(t.clone()).or_default() += 1;
                }
            }
            assert_eq!(self.tags_by_service, tags);
            let scoped = self.services.values().filter(|s| !s.key.is_default_scope()).count();
            assert_eq!(self.scoped_instances, scoped);
            let mut owners: HashMap<(String, String), BTreeSet<String>> = HashMap::new();
            for ((node, id), c) in &self.checks {
                owners.entry((node.clone(), c.service_id.clone())).or_default().insert(id.clone());
            }
            assert_eq!(self.checks_by_owner, owners);
            let mut by_status: [BTreeSet<(String, String)>; 3] = Default::default();
            for (k, c) in &self.checks {
                by_status[c.status as usize].insert(k.clone());
            }
            assert_eq!(self.checks_by_status, by_status);
            let mut proxies: HashMap<ServiceKey, BTreeSet<(String, String)>> = HashMap::new();
            for (k, s) in &self.services {
                if let Some(dest) = s.connect_destination() {
                    proxies.entry(dest).or_default().insert(k.clone());
                }
            }
            assert_eq!(self.by_destination, proxies);
        }
    }

    fn proxy(node: &str, id: &str, dest: &str, status: &str) -> RegisterRequest {
        serde_json::from_value(serde_json::json!({
            "Node": node,
            "Address": "10.0.0.1",
            "Service": {
                "ID": id, "Service": format!("{dest}-sidecar-proxy"), "Kind": "connect-proxy", "Port": 21000,
                "Proxy": {"DestinationServiceName": dest, "DestinationServiceID": dest, "LocalServicePort": 8080},
            },
            "Check": {"CheckID": format!("check-{id}"), "Name": "c", "Status": status, "ServiceID": id}
        }))
        .unwrap()
    }

    #[test]
    fn connect_index_follows_the_destinations_proxies() {
        let mut c = Catalog::new("dc1", 1);
        let web = connect_key("web", DEFAULT_SCOPE, DEFAULT_SCOPE);
        let api = connect_key("api", DEFAULT_SCOPE, DEFAULT_SCOPE);
        assert_eq!(c.connect_index(&web), 1, "unknown: catalog max");
        c.register(reg("n1", "10.0.0.1", "web", "web-1", "passing"), None, None).unwrap();
        c.register(proxy("n1", "p1", "Web", "passing"), None, None).unwrap();
        let i = c.raft_index();
        assert_eq!(c.connect_index(&web), i, "destination names compare case-insensitively");
        assert_eq!(c.connect_health(&web, &[]).len(), 1);
        assert!(c.connect_health(&api, &[]).is_empty());
        assert_eq!(c.health(&ServiceKey::new("web"), &[]).len(), 1, "the proxy is not a web instance");
        // The destination service itself changing does not move the Connect index.
        c.register(reg("n2", "10.0.0.2", "web", "web-2", "critical"), None, None).unwrap();
        assert_eq!(c.connect_index(&web), i);
        // The proxy's check does; so does its node.
        c.register(proxy("n1", "p1", "Web", "critical"), None, None).unwrap();
        assert_eq!(c.connect_index(&web), c.raft_index());
        c.register(node_check("n1", "warning"), None, None).unwrap();
        assert_eq!(c.connect_index(&web), c.raft_index());
        c.assert_lookup_tables_consistent();
        // Re-pointing the proxy moves both destinations; web goes extinct.
        c.register(proxy("n1", "p1", "api", "critical"), None, None).unwrap();
        let moved = c.raft_index();
        assert_eq!((c.connect_index(&web), c.connect_index(&api)), (moved, moved));
        assert!(c.connect_health(&web, &[]).is_empty());
        c.assert_lookup_tables_consistent();
        c.register(reg("n2", "10.0.0.2", "web", "web-2", "passing"), None, None).unwrap();
        assert_eq!(c.connect_index(&web), moved, "extinction index, not the catalog max");
        c.deregister(dereg("n1", None)).unwrap();
        assert_eq!(c.connect_index(&api), c.raft_index());
        c.assert_lookup_tables_consistent();
        c.reset_indexes(2);
        assert_eq!(c.connect_index(&api), 2);
    }

    #[test]
    fn connect_proxy_registrations_are_validated() {
        let mut c = Catalog::new("dc1", 1);
        let mut r = proxy("n1", "p1", "web", "passing");
        r.service.as_mut().unwrap().proxy = None;
        assert!(matches!(c.register(r, None, None), Err(CatalogError::Internal(_))));
        let mut r = proxy("n1", "p1", "web", "passing");
        r.service.as_mut().unwrap().port = None;
        assert!(matches!(c.register(r, None, None), Err(CatalogError::Internal(_))));
        let mut r = proxy("n1", "p1", "web", "passing");
        r.service.as_mut().unwrap().kind = Some("mesh-gateway".into());
        assert!(matches!(c.register(r, None, None), Err(CatalogError::BadRequest(_))));
        assert_eq!(c.raft_index(), 1);
        // A typical service may carry a Proxy block; it is not a proxy for anything.
        let mut r = proxy("n1", "p1", "web", "passing");
        r.service.as_mut().unwrap().kind = None;
        c.register(r, None, None).unwrap();
        assert!(c.connect_health(&connect_key("web", DEFAULT_SCOPE, DEFAULT_SCOPE), &[]).is_empty());
    }

    #[test]
    fn the_service_index_follows_every_write() {
        let mut c = Catalog::new("dc1", 1);
        c.register(reg("n1", "10.0.0.1", "a", "x1", "passing"), None, None).unwrap();
        c.register(reg("n2", "10.0.0.2", "a", "x2", "passing"), None, None).unwrap();
        c.register(reg("n1", "10.0.0.1", "b", "b1", "passing"), None, None).unwrap();
        c.assert_lookup_tables_consistent();
        // The same instance ID re-registered under another name moves between services.
        let a = ServiceKey::new("a");
        let ia = c.service_index(&a);
        c.register(reg("n1", "10.0.0.1", "c", "x1", "passing"), None, None).unwrap();
        c.assert_lookup_tables_consistent();
        assert_eq!(c.health(&a, &[]).len(), 1);
        assert_eq!(c.health(&ServiceKey::new("c"), &[]).len(), 1);
        assert!(c.service_index(&a) > ia, "a lost an instance");
        // And into another namespace.
        c.register(reg("n2", "10.0.0.2", "a", "x2", "passing"), Some("team"), None).unwrap();
        c.assert_lookup_tables_consistent();
        assert!(c.health(&a, &[]).is_empty());
        assert_eq!(c.service_index(&a), c.raft_index(), "a went extinct");
        c.deregister(dereg("n1", Some("b1"))).unwrap();
        c.assert_lookup_tables_consistent();
        c.deregister(dereg("n1", None)).unwrap();
        c.assert_lookup_tables_consistent();
        assert_eq!(c.by_service.len(), 1, "only the namespaced a is left");
        c.reset_indexes(3);
        c.assert_lookup_tables_consistent();
        assert_eq!(c.health(&ServiceKey::scoped("a", Some("team"), None), &[]).len(), 1);
        // Deregistering n1 took its checks along: only x2's check, on n2, is left.
        assert_eq!(c.checks.len(), 1);
    }

    fn bare_service(node: &str, svc: &str, id: &str, port: u16) -> RegisterRequest {
        serde_json::from_value(serde_json::json!({
            "Node": node,
            "Address": "10.0.0.1",
            "Service": {"ID": id, "Service": svc, "Port": port},
        }))
        .unwrap()
    }

    /// `/v1/catalog/services` shows each service's union of its instances' tags, as they
    /// are now: a tag dropped by one instance stays while another has it.
    #[test]
    fn the_services_list_follows_tags_in_and_out() {
        let tagged = |node: &str, id: &str, tags: &[&str]| -> RegisterRequest {
            serde_json::from_value(serde_json::json!({
                "Node": node,
                "Address": "10.0.0.1",
                "Service": {"ID": id, "Service": "web", "Port": 80, "Tags": tags},
            }))
            .unwrap()
        };
        let list = |c: &Catalog| -> Vec<(String, Vec<String>)> { c.services(None, None).into_iter().collect() };
        let web = |tags: &[&str]| vec![("web".to_owned(), tags.iter().map(|t| t.to_string()).collect())];
        let mut c = Catalog::new("dc1", 1);
        c.register(tagged("n1", "w1", &["b", "a"]), None, None).unwrap();
        c.register(tagged("n2", "w2", &["a", "c"]), None, None).unwrap();
        assert_eq!(list(&c), web(&["a", "b", "c"]));
        c.register(tagged("n1", "w1", &[]), None, None).unwrap();
        assert_eq!(list(&c), web(&["a", "c"]));
        c.register(bare_service("n3", "api", "a1", 80), Some("team"), None).unwrap();
        assert_eq!(list(&c), web(&["a", "c"]), "another namespace's service is not listed");
        c.assert_lookup_tables_consistent();
        c.deregister(dereg("n2", Some("w2"))).unwrap();
        assert_eq!(list(&c), web(&[]));
        c.deregister(dereg("n1", Some("w1"))).unwrap();
        assert!(list(&c).is_empty());
        c.assert_lookup_tables_consistent();
    }

    fn check_of<'a>(c: &'a Catalog, node: &str, id: &str) -> &'a Check {
        &c.checks[&(node.to_owned(), id.to_owned())]
    }

    #[test]
    fn checks_index_moves_with_checks_only() {
        let mut c = Catalog::new("dc1", 1);
        c.register(reg("n1", "10.0.0.1", "a", "a1", "passing"), None, None).unwrap();
        let i = c.checks_index();
        assert_eq!(i, c.raft_index());
        // A service without a check: a write, but not to the checks table.
        c.register(bare_service("n2", "b", "b1", 80), None, None).unwrap();
        assert_eq!(c.checks_index(), i);
        assert!(c.raft_index() > i);
        // Nor is its port change, nor its removal.
        c.register(bare_service("n2", "b", "b1", 81), None, None).unwrap();
        c.deregister(dereg("n2", Some("b1"))).unwrap();
        assert_eq!(c.checks_index(), i);
        // A service removed with its check moves it.
        c.register(reg("n2", "10.0.0.2", "b", "b2", "passing"), None, None).unwrap();
        let i = c.checks_index();
        c.deregister(dereg("n2", Some("b2"))).unwrap();
        assert!(c.checks_index() > i);
        assert!(c.checks.keys().all(|(n, _)| n != "n2"));
        // A node removed with its node check moves it.
        c.register(node_check("n3", "passing"), None, None).unwrap();
        let i = c.checks_index();
        c.deregister(dereg("n3", None)).unwrap();
        assert_eq!(c.checks_index(), i + 1);
        // A check removed on its own moves it.
        let i = c.checks_index();
        c.deregister(DeregisterRequest {
            node: Some("n1".into()),
            check_id: Some("check-a1".into()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(c.checks_index(), i + 1);
        c.assert_lookup_tables_consistent();
    }

    #[test]
    fn a_check_keeps_its_create_index_and_takes_the_writes_modify_index() {
        let mut c = Catalog::new("dc1", 1);
        c.register(reg("n1", "10.0.0.1", "a", "a1", "passing"), None, None).unwrap();
        c.register(reg("n2", "10.0.0.2", "b", "b1", "passing"), None, None).unwrap();
        let created = c.raft_index() - 1;
        assert_eq!(check_of(&c, "n1", "check-a1").create_index, created);
        c.register(reg("n1", "10.0.0.1", "a", "a1", "critical"), None, None).unwrap();
        let a1 = check_of(&c, "n1", "check-a1");
        assert_eq!((a1.create_index, a1.modify_index), (created, c.raft_index()));
        assert_eq!(check_of(&c, "n2", "check-b1").modify_index, created + 1, "b1 untouched");
        // New tags: the check shows them, so it is rewritten even when not sent again.
        let i = c.raft_index();
        let mut r = bare_service("n1", "a", "a1", 80);
        r.address = Some("10.0.0.1".into());
        r.service.as_mut().unwrap().tags = Some(vec!["new".into()]);
        c.register(r, None, None).unwrap();
        assert_eq!(check_of(&c, "n1", "check-a1").modify_index, i + 1);
        assert_eq!(c.checks_index(), i + 1);
        // A port change without the check does not rewrite it.
        let mut r = bare_service("n1", "a", "a1", 81);
        r.service.as_mut().unwrap().tags = Some(vec!["new".into()]);
        c.register(r, None, None).unwrap();
        assert_eq!(check_of(&c, "n1", "check-a1").modify_index, i + 1);
        assert_eq!(c.checks_index(), i + 1);
        assert_eq!(c.raft_index(), i + 2);
    }

    #[test]
    fn nodes_and_instances_take_the_index_of_their_last_change() {
        let mut c = Catalog::new("dc1", 1);
        c.register(reg("n1", "10.0.0.1", "a", "a1", "passing"), None, None).unwrap();
        let created = c.raft_index();
        c.register(bare_service("n1", "b", "b1", 80), Some("team"), None).unwrap();
        assert_eq!(c.nodes_index(), created, "the node did not change");
        let n1 = |c: &Catalog| c.node_with_services("n1", None, None).unwrap();
        let (node, services) = n1(&c);
        assert_eq!((node.create_index, node.modify_index), (created, created));
        assert_eq!(services.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["a1"], "b1 is in another namespace");
        assert_eq!(c.node_with_services("n1", Some("team"), None).unwrap().1[0].id, "b1");
        // A port change without the check: the instance's ModifyIndex moves, its CreateIndex stays.
        let mut r = bare_service("n1", "a", "a1", 81);
        r.service.as_mut().unwrap().tags = Some(vec!["a".into()]);
        c.register(r, None, None).unwrap();
        assert_eq!(check_of(&c, "n1", "check-a1").modify_index, created, "the check was not named");
        let a1 = &n1(&c).1[0];
        assert_eq!((a1.create_index, a1.modify_index, a1.port), (created, c.raft_index(), 81));
        assert_eq!(c.node_services_index("n1"), c.raft_index(), "the services table moved");
        // A new address: the node moves, and the nodes table.
        let readdressed = serde_json::json!({"Node": "n1", "Address": "10.0.0.9"});
        c.register(serde_json::from_value(readdressed).unwrap(), None, None).unwrap();
        let (node, _) = n1(&c);
        assert_eq!((node.create_index, node.modify_index), (created, c.raft_index()));
        assert_eq!(c.nodes_index(), c.raft_index());
        assert_eq!(c.nodes().iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["n1"]);
        assert!(c.node_with_services("n9", None, None).is_none());
        assert_eq!(c.node_services_index("n9"), 0, "an unknown node: no index (answered as 1)");
        c.deregister(dereg("n1", None)).unwrap();
        assert_eq!(c.nodes_index(), c.raft_index(), "a node removed moves the table");
        c.reset_indexes(2);
        assert_eq!(c.nodes_index(), 2);
    }

    #[test]
    fn a_kept_check_is_not_rewritten_by_its_services_port_change() {
        let mut c = Catalog { keeps_unchanged_checks: true, ..Catalog::new("dc1", 1) };
        c.register(reg("n1", "10.0.0.1", "a", "a1", "passing"), None, None).unwrap();
        let written = c.checks_index();
        let mut r = reg("n1", "10.0.0.1", "a", "a1", "passing");
        r.service.as_mut().unwrap().port = Some(81);
        assert!(c.register(r, None, None).unwrap());
        assert_eq!(check_of(&c, "n1", "check-a1").modify_index, written);
        assert_eq!((c.checks_index(), c.services_index()), (written, written + 1));
        // A change of its own is written.
        c.register(reg("n1", "10.0.0.1", "a", "a1", "critical"), None, None).unwrap();
        assert_eq!(check_of(&c, "n1", "check-a1").modify_index, c.raft_index());
        // Without the switch, the 0.9 agent's "same check, new port".
        c.keeps_unchanged_checks = false;
        let mut r = reg("n1", "10.0.0.1", "a", "a1", "critical");
        r.service.as_mut().unwrap().port = Some(82);
        c.register(r, None, None).unwrap();
        assert_eq!(check_of(&c, "n1", "check-a1").modify_index, c.raft_index());
    }

    #[test]
    fn checks_in_state_filter_and_scope() {
        let mut c = Catalog::new("dc1", 1);
        c.register(reg("n1", "10.0.0.1", "a", "a1", "passing"), None, None).unwrap();
        c.register(reg("n2", "10.0.0.2", "b", "b1", "warning"), Some("team"), None).unwrap();
        c.register(node_check("n2", "critical"), None, None).unwrap();
        let ids = |c: &Catalog, f, ns| -> Vec<String> {
            c.checks_in_state(f, ns, None).into_iter().map(|e| e.check.check_id.clone()).collect()
        };
        assert_eq!(ids(&c, StateFilter::Any, None), ["check-a1", "serfHealth"]);
        assert_eq!(ids(&c, StateFilter::Any, Some("team")), ["check-b1", "serfHealth"]);
        assert_eq!(ids(&c, StateFilter::Only(CheckStatus::Critical), Some("team")), ["serfHealth"]);
        assert_eq!(ids(&c, StateFilter::Only(CheckStatus::Warning), Some("team")), ["check-b1"]);
        assert!(ids(&c, StateFilter::Only(CheckStatus::Warning), None).is_empty());
        // A check moves between statuses, and leaves with its instance.
        c.register(reg("n1", "10.0.0.1", "a", "a1", "critical"), None, None).unwrap();
        assert_eq!(ids(&c, StateFilter::Only(CheckStatus::Critical), None), ["check-a1", "serfHealth"]);
        assert!(ids(&c, StateFilter::Only(CheckStatus::Passing), None).is_empty());
        c.deregister(dereg("n1", Some("a1"))).unwrap();
        assert_eq!(ids(&c, StateFilter::Only(CheckStatus::Critical), None), ["serfHealth"]);
        c.assert_lookup_tables_consistent();
    }

    #[test]
    fn per_service_indexes_are_isolated() {
        let mut c = Catalog::new("dc1", 1);
        let a = ServiceKey::new("a");
        let b = ServiceKey::new("b");
        assert!(c.register(reg("n1", "10.0.0.1", "a", "a1", "passing"), None, None).unwrap());
        let ia = c.service_index(&a);
        assert!(c.register(reg("n2", "10.0.0.2", "b", "b1", "passing"), None, None).unwrap());
        assert_eq!(c.service_index(&a), ia, "b's change must not move a");
        assert!(c.service_index(&b) > ia);
        // Identical re-registration changes nothing.
        assert!(!c.register(reg("n2", "10.0.0.2", "b", "b1", "passing"), None, None).unwrap());
        // A check flip moves only its service.
        let ib = c.service_index(&b);
        assert!(c.register(reg("n2", "10.0.0.2", "b", "b1", "critical"), None, None).unwrap());
        assert!(c.service_index(&b) > ib);
        assert_eq!(c.service_index(&a), ia);
    }

    #[test]
    fn node_checks_move_services_of_the_node() {
        let mut c = Catalog::new("dc1", 1);
        c.register(reg("n1", "10.0.0.1", "a", "a1", "passing"), None, None).unwrap();
        c.register(reg("n2", "10.0.0.2", "b", "b1", "passing"), None, None).unwrap();
        let (ia, ib) = (c.service_index(&ServiceKey::new("a")), c.service_index(&ServiceKey::new("b")));
        c.register(node_check("n1", "critical"), None, None).unwrap();
        assert!(c.service_index(&ServiceKey::new("a")) > ia);
        assert_eq!(c.service_index(&ServiceKey::new("b")), ib);
        let entries = c.health(&ServiceKey::new("a"), &[]);
        assert_eq!(entries[0].checks.len(), 2);
        assert!(!entries[0].all_passing());
    }

    #[test]
    fn unknown_service_index_is_catalog_max_then_extinction() {
        let mut c = Catalog::new("dc1", 1);
        let x = ServiceKey::new("x");
        assert_eq!(c.service_index(&x), 1);
        c.register(reg("n1", "10.0.0.1", "a", "a1", "passing"), None, None).unwrap();
        c.register(reg("n1", "10.0.0.1", "b", "b1", "passing"), None, None).unwrap();
        assert_eq!(c.service_index(&x), c.raft_index(), "no extinction yet: catalog max");
        c.deregister(dereg("n1", Some("a1"))).unwrap();
        let extinct = c.raft_index();
        assert_eq!(c.service_index(&x), extinct);
        assert_eq!(c.service_index(&ServiceKey::new("a")), extinct);
        // Later changes to other services do not move the unknown service's index.
        c.register(reg("n1", "10.0.0.1", "b", "b1", "critical"), None, None).unwrap();
        assert_eq!(c.service_index(&x), extinct);
    }

    #[test]
    fn deregistering_a_node_removes_everything() {
        let mut c = Catalog::new("dc1", 1);
        c.register(reg("n1", "10.0.0.1", "a", "a1", "passing"), None, None).unwrap();
        c.register(node_check("n1", "passing"), None, None).unwrap();
        assert!(c.deregister(dereg("n1", None)).unwrap());
        assert!(c.health(&ServiceKey::new("a"), &[]).is_empty());
        assert!(c.services(None, None).is_empty());
        assert!(!c.deregister(dereg("n1", None)).unwrap(), "second time is a no-op");
    }

    #[test]
    fn tags_all_must_match_case_insensitively() {
        let mut c = Catalog::new("dc1", 1);
        let mut r = reg("n1", "10.0.0.1", "a", "a1", "passing");
        r.service.as_mut().unwrap().tags = Some(vec!["Blue".into(), "v2".into()]);
        c.register(r, None, None).unwrap();
        c.register(reg("n2", "10.0.0.2", "a", "a2", "passing"), None, None).unwrap();
        let key = ServiceKey::new("a");
        assert_eq!(c.health(&key, &[]).len(), 2);
        assert_eq!(c.health(&key, &["blue".into()]).len(), 1);
        assert_eq!(c.health(&key, &["blue".into(), "v2".into()]).len(), 1);
        assert_eq!(c.health(&key, &["blue".into(), "v3".into()]).len(), 0);
    }

    #[test]
    fn namespaces_are_part_of_the_identity() {
        let mut c = Catalog::new("dc1", 1);
        c.register(reg("n1", "10.0.0.1", "a", "a1", "passing"), Some("team"), None).unwrap();
        assert!(c.health(&ServiceKey::new("a"), &[]).is_empty());
        assert_eq!(c.health(&ServiceKey::scoped("a", Some("team"), None), &[]).len(), 1);
    }

    #[test]
    fn validation() {
        let mut c = Catalog::new("dc1", 1);
        let bad = |v: serde_json::Value| serde_json::from_value::<RegisterRequest>(v).unwrap();
        assert!(matches!(
            c.register(bad(serde_json::json!({"Address": "1.2.3.4"})), None, None),
            Err(CatalogError::BadRequest(_))
        ));
        assert!(matches!(
            c.register(bad(serde_json::json!({"Node": "n"})), None, None),
            Err(CatalogError::BadRequest(_))
        ));
        assert!(matches!(
            c.register(
                bad(serde_json::json!({"Node": "n", "Address": "1.2.3.4", "Check": {"CheckID": "c", "ServiceID": "nope"}})),
                None,
                None
            ),
            Err(CatalogError::Internal(_))
        ));
        assert!(matches!(
            c.register(
                bad(serde_json::json!({"Node": "n", "Address": "1.2.3.4", "Check": {"CheckID": "c", "Status": "sad"}})),
                None,
                None
            ),
            Err(CatalogError::BadRequest(_))
        ));
        assert_eq!(c.raft_index(), 1, "refused writes change nothing");
    }

    #[test]
    fn reset_indexes_keeps_data() {
        let mut c = Catalog::new("dc1", 1);
        for i in 0..5 {
            c.register(reg("n1", "10.0.0.1", "a", &format!("a{i}"), "passing"), None, None).unwrap();
        }
        c.reset_indexes(2);
        let entries = c.health(&ServiceKey::new("a"), &[]);
        assert_eq!(c.service_index(&ServiceKey::new("a")), 2);
        assert_eq!(entries.len(), 5);
        c.register(reg("n1", "10.0.0.1", "a", "a9", "passing"), None, None).unwrap();
        assert_eq!(c.service_index(&ServiceKey::new("a")), 3);
    }
}
