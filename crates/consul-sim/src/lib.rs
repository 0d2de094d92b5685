//! A Consul HTTP API simulator for tests.
//!
//! No Consul server can be installed in the test environment, so this stands in for an agent.
//! It implements exactly the slice of the API described in `docs/consul-protocol.md` and follows
//! the behaviour real agents show there (blocking queries, per-service indexes, error texts,
//! ACL filtering, the per-client connection limit), because the operator's client is tested
//! against it and the same e2e tests must pass unchanged against a real agent. Tests
//! therefore change the world only through Consul's own write API (`/v1/catalog/register`,
//! `/v1/catalog/deregister`); only failure injection and observation use the simulator's own
//! `/_sim/` endpoints, which a real agent lacks.
//!
//! # Consul endpoints
//!
//! - `GET /v1/health/service/<name>`: `passing`, `tag` (repeatable, all must match,
//!   case-insensitive), `dc` (another datacenter answers 500 `No path to datacenter`), `ns`
//!   (or header `X-Consul-Namespace`) and `partition` (part of the service's identity),
//!   `index`, `wait`, `stale`, `consistent`, `token`, and the newer parameters:
//!   - `filter`: a go-bexpr expression, the subset in the `filter` module (selectors on
//!     `Node`, `Service` and `Checks`, `==`, `!=`, `in`, `contains`, `is empty`, `and`, `or`,
//!     `not`); one that does not parse answers 400 `Failed to create boolean expression
//!     evaluator: <why>` (the `<why>` in the simulator's own words). The index stays the
//!     unfiltered set's.
//!   - `peer`: the services imported from that cluster peer, a data set of its own written
//!     through `/_sim/peers/<peer>/...` (below), rendered with `Service.PeerName`; imported
//!     writes take the catalog's next raft index, as in Consul; an unknown peer has no
//!     services.
//!   - `sameness-group`: the group's members (`PUT /v1/config`, below) in order, answered by
//!     the first with instances left after `passing`, `tag` and `filter`, blocking on the
//!     highest index of its members and of the group itself; an unknown group is 400, and
//!     so is naming both `peer` and `sameness-group` (the simulator's wording).
//!   - `cached`: the agent's background-refreshed cache: `X-Cache: HIT` and `Age: 0` while
//!     the servers answer; see the `agent_cut_off` fault for an agent cut off from them.
//! - `GET /v1/health/connect/<name>`: the health entries (same shape) of the `connect-proxy`
//!   instances whose `Proxy.DestinationServiceName` is `<name>` (compared case-insensitively)
//!   in the requested namespace/partition, filtered by the proxies' own checks (`passing`) and
//!   tags (`tag`). Same parameters, errors, faults, headers and request log (`service` is
//!   `<name>`) as the health endpoint; ACLs: service:read on `<name>`, the destination. It
//!   blocks on the destination's Connect index, which moves when one of its proxies, their
//!   checks or their nodes change, or a proxy starts or stops naming it (not when the
//!   destination service itself changes); an unknown destination reports the index at which
//!   a destination last lost its final proxy, or the catalog maximum if none ever did.
//!   Blockers are counted in the stats under [`HEALTH_CONNECT_LABEL_PREFIX`]`<name>`.
//!   Registrations carry `Service.Kind` (`""` or `"connect-proxy"`; other kinds are refused
//!   with a 400) and `Service.Proxy` (`DestinationServiceName`, `DestinationServiceID`,
//!   `LocalServiceAddress`, `LocalServicePort`; other proxy fields are ignored); a
//!   `connect-proxy` without a destination name or a port is refused with a 500, as Consul
//!   does. Both are rendered back as `Kind` and `Proxy` in the modern shape only.
//! - `GET /v1/health/state/<state>` (`any`, `passing`, `warning`, `critical`; anything else
//!   is 400 `Invalid check state`): every check in that state, sorted by node then check ID,
//!   each with `Node`, `CheckID`, `Name`, `Status`, `Notes`, `Output`, `ServiceID`,
//!   `ServiceName`, `ServiceTags` (the instance's tags, `[]` for a node check), `Type` (`""`),
//!   `CreateIndex`, `ModifyIndex`, and `Namespace`/`Partition` for a service outside the
//!   defaults. The same parameters as the health endpoint except `passing` and `tag`; it
//!   reports the checks table index, which moves whenever a check is created, changed or
//!   removed (also with its service or node) and not for writes that touch no check, such as
//!   registering a service without one. `any` blocks on that index; one status, as Consul's
//!   state store watches its status index, blocks until a check enters that status, leaves
//!   it or is written in it (a passing check rewritten does not wake a `critical` query), then
//!   answers once the index is past the client's (an index already past it answers at once).
//!   Scoping: the service checks of services in the
//!   requested namespace/partition, plus every node check whatever the namespace (node checks
//!   belong to no namespace here; a simplification). ACLs: service checks of services the
//!   token cannot read are left out (with `X-Consul-Results-Filtered-By-ACLs`); node checks
//!   are shown to every token that resolves, anonymous included (node rules are not
//!   modelled). Which writes rewrite a check (and so move its `ModifyIndex`) is in the
//!   `catalog` module: its own change, a changing write that names it again (as the 0.9
//!   agent of the protocol notes did for "same check, new port"), or a change to its
//!   service's name or tags.
//! - `PUT /v1/catalog/register`, `PUT /v1/catalog/deregister` (answer `true`).
//! - `GET /v1/catalog/services` (blocking on the index of the last change to any service).
//! - `GET /v1/catalog/nodes`: every node (`ID`, `Node`, `Address`, `Datacenter`,
//!   `TaggedAddresses`, `Meta`, `CreateIndex`, `ModifyIndex`), sorted by name, blocking on
//!   the nodes table index, which moves when a node is created, changed or removed. Node
//!   rules are not modelled: every token that resolves sees every node.
//! - `GET /v1/catalog/node-services/<node>` (1.7+): `{"Node": {...}, "Services": [...]}`, the
//!   node as above and its instances in the requested namespace/partition, each in the
//!   health answer's `Service` shape (with its `CreateIndex` and the `ModifyIndex` of the
//!   write that last changed it), sorted by ID; instances of services the token cannot read
//!   are left out (with `X-Consul-Results-Filtered-By-ACLs`). It blocks on the later of the
//!   nodes' and the services' table indexes, as Consul 1.8 does; a node that does not exist
//!   answers `{"Node": null, "Services": null}` at index 1. No node name is 400 `Missing
//!   node name`. Blockers of the two are counted in the stats under
//!   [`CATALOG_NODES_LABEL`] and [`NODE_SERVICES_LABEL_PREFIX`]`<node>`.
//! - `GET /v1/catalog/datacenters`, `GET /v1/status/leader`.
//! - `PUT /v1/config` of `{"Kind": "sameness-group", "Name", "Members": [{"Partition"} or
//!   {"Peer"}, ...]}` (the only config entry kind modelled; Enterprise 1.16+); it needs a
//!   token allowed to write; `GET /v1/config/sameness-group/<name>` reads it back (any
//!   token that resolves; 404 for a group that does not exist).
//! - `GET /v1/agent/self`, reduced to `Config.{Datacenter, NodeName, Version}` and `Member`:
//!   version `1.21.4`, or `0.9.3` with `ignores_newer_parameters`.
//!
//! Successful reads carry `X-Consul-Index` (at least 1, except under `zero_index_when_empty`),
//! `X-Consul-KnownLeader`, `X-Consul-LastContact: 0`, `X-Consul-Effective-Consistency`,
//! `X-Consul-Query-Backend`, and with ACLs on `X-Consul-Default-ACL-Policy` (plus
//! `X-Consul-Results-Filtered-By-ACLs` when entries were hidden). Errors carry none of them.
//! Successful responses are gzipped when the request sends `Accept-Encoding: gzip`, whatever
//! their size (real agents skip bodies under about 1.4 kB; clients must handle both).
//!
//! Response shapes: by default the modern one (`{}`/`[]` for empty maps and lists, plus
//! fields older agents lack). With [`Config::null_variants`] (`--null-variants`, or the
//! `null_variants` fault at run time) empty `Meta`, `TaggedAddresses` and `Tags` are `null`
//! and the newer fields are left out, as older agents answered.
//!
//! # Older agents
//!
//! By default the simulator is a current agent. Each behaviour of older agents listed in
//! `docs/consul-protocol.md` is a switch: a [`Config`] field, a `consul-sim` flag, and a
//! [`FaultsPatch`] field (`PUT /_sim/faults`, so a test can flip it on a running simulator;
//! it applies to requests that arrive afterwards, and `DELETE /_sim/faults` restores the
//! start-up value). [`Config::legacy`] (`--legacy`) turns them all on, with `null_variants`
//! and no connection limit: a 0.9-line agent.
//!
//! | switch | behaviour |
//! |---|---|
//! | `single_health_index` | one index for the whole health table: every `/v1/health/service/<any>` (and `/v1/health/connect/<any>`) reports and blocks on the catalog's raft index, so a write to any service or node wakes the blocking queries of unrelated services, which answer an unchanged body (the `/_sim/services/<name>/index` override then has no visible effect) |
//! | `zero_index_when_empty` | while the catalog holds no service at all (nodes alone do not count), every read answers `X-Consul-Index: 0`, at once even when sent a large `index` |
//! | `first_tag_only` | `/v1/health/service` applies only the first `tag` and ignores the rest |
//! | `no_server_cancel` | a blocking query whose client disconnects is not cancelled: it stays in flight, counted in [`Stats::blocking`] and [`Stats::blocking_detached`], until its wait ends or its index moves (the request log marks it `cancelled` at once, as the client went away) |
//! | `unknown_state_is_empty` | an unknown `/v1/health/state/<x>` answers 200 `[]` (with the checks index), blocking like any state |
//! | `ignores_newer_parameters` | `filter` (1.4), `cached` (1.3), `peer` (1.13) and `sameness-group` (1.16) are unknown parameters, ignored as Go's handlers ignore any: the local, unfiltered answer, without `X-Cache`; `/v1/catalog/node-services/<node>` (1.7) is an unknown path: 404 |
//!
//! # TLS and HTTP/2
//!
//! Without [`Config::tls`] the simulator speaks plain HTTP/1.1, as Consul without TLS: each
//! blocking query in flight holds a TCP connection. With it (`--tls-cert FILE --tls-key FILE
//! [--tls-client-ca FILE] [--h2-max-streams N]`) it serves HTTPS and offers ALPN `h2` and
//! `http/1.1`: a client that negotiates `h2` gets HTTP/2 (as Consul: HTTP/2 only over
//! HTTPS), with at most [`TlsConfig::h2_max_concurrent_streams`] streams at once (default
//! 250, Go's, announced as `SETTINGS_MAX_CONCURRENT_STREAMS`); [`RunningSim::base_url`] is
//! then `https://...`. A client CA makes a client certificate signed by it mandatory (mTLS).
//! The per-client connection limit counts TCP connections, so one HTTP/2 connection with
//! many streams is one connection; over TLS the limit's 429 is written as HTTP/1.1 inside
//! the TLS session after the handshake (an HTTP/2 client sees that as a protocol error).
//! [`Stats::open_connections_by_protocol`] (`h1`/`h2`) and
//! [`Stats::peak_streams_per_connection`] show multiplexing. Observed with hyper's HTTP/2
//! client: requests beyond the stream limit wait in the client until a stream closes; the
//! server never has more than the limit in flight on one connection, and nothing fails.
//! With the `test-pki` feature, `tls::TestPki` generates a CA, a server certificate (for
//! `127.0.0.1`, `localhost`, `consul.test`) and a client certificate for tests.
//!
//! # Control endpoints (`/_sim/...`, not in real Consul)
//!
//! All bodies are JSON. Control requests bypass faults, ACLs and the request log, but their
//! TCP connections do count towards the per-client connection statistics and limit.
//!
//! | request | body | answer |
//! |---|---|---|
//! | `GET /_sim/faults` | | [`Faults`] |
//! | `PUT /_sim/faults` | [`FaultsPatch`], e.g. `{"latency_ms": 200, "no_leader": 3, "too_many_requests": "always", "retry_after_s": 2, "bad_body": 1, "truncated_body": 1, "null_variants": true, "known_leader": false, "single_health_index": true}` | [`Faults`] after the change |
//! | `DELETE /_sim/faults` | | [`Faults`] back to the start-up defaults |
//! | `PUT /_sim/peers/<peer>/register`, `PUT /_sim/peers/<peer>/deregister` | as `/v1/catalog/register`, `/v1/catalog/deregister` | `true`: writes the services imported from `<peer>` (peering replicates them in Consul; no client API writes them, so tests of `peer` need the simulator) |
//! | `POST /_sim/drop-blocking` | | `{"dropped": n}`: every blocking query in flight is closed without a response |
//! | `PUT /_sim/services/<name>/index[?ns=&partition=]` | `{"index": n}` | `{"service", "index"}`, 404 for an unknown service: the service's index becomes `n` (may go backwards), data unchanged |
//! | `POST /_sim/reset-index` | `{"index": n}` (optional, default 1) | `{"index": n}`: every index becomes `n` while data is kept ("restart with a lower index"); the next write takes `n + 1` |
//! | `GET /_sim/requests[?path_prefix=/v1/health/service/web]` | | `[`[`RequestRecord`]`]`, oldest first |
//! | `DELETE /_sim/requests` | | `{"cleared": n}` |
//! | `GET /_sim/stats` | | [`Stats`]: open and peak connections per client IP and by protocol, the peak streams on one connection, 429 counts, blocking queries per service and those whose client went away (`/v1/catalog/services` under [`CATALOG_SERVICES_LABEL`], `/v1/health/state` under [`HEALTH_STATE_LABEL`], `/v1/health/connect/<name>` under [`HEALTH_CONNECT_LABEL_PREFIX`]`<name>`) |
//! | `DELETE /_sim/stats` | | [`Stats`] after resetting counters (connection peaks restart from the open counts, the streams peak from 0) |
//!
//! `strip_index` (a switch) is a proxy between client and agent that strips
//! `X-Consul-Index` from every answer: the agent still blocks on the `index` it is sent.
//!
//! `sameness_before_health` (a switch) is a sameness group that picks its member before the
//! health filter: the first member with any instances answers, and `?passing` filters them,
//! to nothing when none passes, where the default picks the first member with instances left
//! after every filter of the read.
//!
//! `keeps_unchanged_checks` (a switch, [`Config::keeps_unchanged_checks`],
//! `--keeps-unchanged-checks`) is Consul 1.8's catalog: a registration that names a check
//! again, unchanged, leaves it as it is, so a port or address change moves the catalog and
//! not the checks (through the agent API, 1.8 registers a changed service without its
//! unchanged check, to the same effect). Off, the check is rewritten with the change.
//!
//! `agent_cut_off` (a switch) is an agent that lost its servers: every `/v1/` request but
//! `/v1/agent/self` answers 500 `No known Consul servers`, except `?cached` health reads,
//! answered from the catalog as it was when the cut-off began, with `X-Cache: HIT` and `Age`
//! in whole seconds since (a blocking one waits its whole wait, as nothing moves that cache,
//! unless the servers come back first).
//!
//! Fault budgets ([`Budget`]) are `0` (off), a count `n` (the next `n` health queries), or
//! `"always"` (until cleared). `no_leader`, `too_many_requests` (with `Retry-After: n` when
//! `retry_after_s` is `n` > 0), `bad_body` (200 with Consul's headers and an HTML page for a
//! body) and `truncated_body` (200 announcing the whole body's length, half of it sent, the
//! connection closed; both answer at once, without blocking) apply to the health reads
//! (`/v1/health/service`, `/v1/health/connect` and `/v1/health/state`) only, checked after parameter validation,
//! the datacenter and the token, and before blocking (so writes and the catalog keep working
//! while a test breaks the read path); `latency_ms` applies to every `/v1/` request,
//! `checks_answer_ms` to every `/v1/health/state/any` answer once it is ready (after a
//! blocking one wakes), as a large catalog's checks answer is slow while other reads (the
//! checks of one status among them) stay fast. The in-process handle [`RunningSim`] offers the same
//! operations as methods.
//!
//! # Running it
//!
//! In-process: `let sim = Simulator::start(Config::default()).await?;` then talk to
//! `sim.base_url()`; the server stops when the handle is dropped (or on
//! [`RunningSim::shutdown`]). [`Simulator::start`] serves on the caller's runtime, so it dies
//! with it: each `#[tokio::test]` has its own runtime, hence a simulator shared between tests
//! (or used from synchronous code, or next to code that blocks its runtime) must be started
//! with [`Simulator::start_background`], which runs it on its own thread and runtime.
//!
//! As a process: `consul-sim --listen 127.0.0.1:0` prints `listening on <addr>` on stdout.
//!
//! # Deliberate simplifications
//!
//! Request bodies use Consul's exact (PascalCase) field names; Go's decoder would also accept
//! other capitalisations. No node ACL rules, no `node-meta` filter, no agent endpoints but `/v1/agent/self`, no
//! sessions or KV. No HTTP/2 without TLS (no h2c), as Consul.

mod acl;
mod blocking;
mod catalog;
mod conn;
mod control;
mod duration;
mod faults;
mod filter;
mod render;
mod server;
mod state;
pub mod tls;
mod urls;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

pub use acl::{AclConfig, AclToken, TokenPolicy, TokenSource};
pub use catalog::ServiceKey;
pub use duration::{DEFAULT_WAIT, DurationError, MAX_WAIT, effective_wait, parse_go_duration};
pub use faults::{Budget, Faults, FaultsPatch, Outcome, RequestRecord, Stats};
pub use server::{
    CATALOG_NODES_LABEL, CATALOG_SERVICES_LABEL, HEALTH_CONNECT_LABEL_PREFIX, HEALTH_STATE_LABEL,
    NODE_SERVICES_LABEL_PREFIX,
};
pub use tls::{DEFAULT_H2_MAX_CONCURRENT_STREAMS, TlsConfig};

use state::Shared;

/// Start-up settings. `Config::default()` listens on an ephemeral loopback port.
#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddr,
    /// The agent's datacenter; `?dc=` naming any other answers 500 `No path to datacenter`.
    pub datacenter: String,
    /// Concurrent connections allowed per client IP (Consul's
    /// `limits.http_max_conns_per_client`, default 200); beyond it a connection gets a 429
    /// and is closed. 0 disables the limit.
    pub max_conns_per_client: usize,
    /// `None` disables ACLs (tokens are ignored).
    pub acl: Option<AclConfig>,
    /// Start with the legacy `null` response shapes.
    pub null_variants: bool,
    /// What `/v1/status/leader` answers.
    pub leader_address: String,
    /// The raft index before the first write (the catalog maximum of an empty catalog).
    pub initial_index: u64,
    /// How many request records `/_sim/requests` keeps (oldest dropped first).
    pub request_log_capacity: usize,
    /// Serve HTTPS (HTTP/2 or HTTP/1.1 by ALPN) instead of plain HTTP/1.1; see [`tls`].
    pub tls: Option<TlsConfig>,
    /// A registration that names a check again, unchanged, leaves it as it is whatever else
    /// it changes, as Consul 1.8's state store does: a port or address change then moves
    /// neither the check's `ModifyIndex` nor the checks index, and a change feed's checks
    /// cannot account for the catalog's move. Off: the check is rewritten with the change
    /// (the 0.9 agent's "same check, new port"). A change of the service's name or tags
    /// rewrites its checks either way (they show them). Also a [`FaultsPatch`] field.
    pub keeps_unchanged_checks: bool,

    // Older agents' behaviours (`docs/consul-protocol.md`), off by default (a current agent).
    // All can also be flipped at run time through [`FaultsPatch`].
    /// One index for the whole health table (the 0.9 line): every `/v1/health/service/<any>`
    /// reports and blocks on the catalog's raft index, so any write wakes the blocking
    /// queries of every service, which answer an unchanged body.
    pub single_health_index: bool,
    /// While the catalog holds no service at all, reads answer `X-Consul-Index: 0`, at once
    /// even when sent an `index` (a freshly started older agent).
    pub zero_index_when_empty: bool,
    /// `/v1/health/service` applies only the first `tag` and ignores the rest (before 1.3).
    pub first_tag_only: bool,
    /// A blocking query whose client disconnects is not cancelled: it stays in flight (and
    /// in [`Stats::blocking`], [`Stats::blocking_detached`]) until its wait ends or a write
    /// wakes it.
    pub no_server_cancel: bool,
    /// An unknown `/v1/health/state/<state>` answers 200 `[]` instead of 400.
    pub unknown_state_is_empty: bool,
    /// `filter` (1.4), `cached` (1.3), `peer` (1.13) and `sameness-group` (1.16) are
    /// unknown query parameters, ignored as Go's handlers ignore any: the answer is the
    /// local, unfiltered one, without `X-Cache`; `/v1/agent/self` reports version 0.9.3,
    /// and `/v1/catalog/node-services/<node>` (1.7) is an unknown path (404).
    pub ignores_newer_parameters: bool,
}

impl Config {
    /// A 0.9-line agent: every older-agent switch on, the `null` shapes, and no
    /// per-client connection limit (that came with 1.6). Listens like `Config::default()`.
    pub fn legacy() -> Self {
        Config {
            max_conns_per_client: 0,
            null_variants: true,
            single_health_index: true,
            zero_index_when_empty: true,
            first_tag_only: true,
            no_server_cancel: true,
            unknown_state_is_empty: true,
            ignores_newer_parameters: true,
            ..Config::default()
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            datacenter: "dc1".to_owned(),
            max_conns_per_client: 200,
            acl: None,
            null_variants: false,
            leader_address: "127.0.0.1:8300".to_owned(),
            initial_index: 1,
            request_log_capacity: 100_000,
            tls: None,
            keeps_unchanged_checks: false,
            single_health_index: false,
            zero_index_when_empty: false,
            first_tag_only: false,
            no_server_cancel: false,
            unknown_state_is_empty: false,
            ignores_newer_parameters: false,
        }
    }
}

/// Why the simulator could not start.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("starting the simulator's runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The TLS settings do not make a server configuration (bad PEM, key not matching...).
    #[error("TLS: {0}")]
    Tls(String),
}

/// Starts simulators.
pub struct Simulator;

impl Simulator {
    /// Binds and serves on the current tokio runtime.
    pub async fn start(config: Config) -> Result<RunningSim, SimError> {
        let tls = config.tls.as_ref().map(TlsConfig::acceptor).transpose().map_err(SimError::Tls)?;
        let listen = config.listen;
        let listener = TcpListener::bind(listen).await.map_err(|source| SimError::Bind { addr: listen, source })?;
        let addr = listener.local_addr().map_err(|source| SimError::Bind { addr: listen, source })?;
        let shared = Arc::new(Shared::new(config));
        let rx = shared.shutdown.subscribe();
        let task = tokio::spawn(conn::accept_loop(listener, tls, shared.clone(), rx));
        Ok(RunningSim { addr, shared, task: Some(task), thread: None })
    }

    /// Binds and serves on a dedicated thread with its own runtime, so the simulator keeps
    /// answering even while the caller's thread or runtime is blocked. Callable from sync code.
    pub fn start_background(config: Config) -> Result<RunningSim, SimError> {
        let tls = config.tls.as_ref().map(TlsConfig::acceptor).transpose().map_err(SimError::Tls)?;
        let listen = config.listen;
        let std_listener = std::net::TcpListener::bind(listen)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|source| SimError::Bind { addr: listen, source })?;
        let addr = std_listener.local_addr().map_err(|source| SimError::Bind { addr: listen, source })?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("consul-sim")
            .enable_all()
            .build()
            .map_err(SimError::Runtime)?;
        let shared = Arc::new(Shared::new(config));
        let rx = shared.shutdown.subscribe();
        let serve_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("consul-sim".to_owned())
            .spawn(move || {
                runtime.block_on(async move {
                    match TcpListener::from_std(std_listener) {
                        Ok(listener) => conn::accept_loop(listener, tls, serve_shared, rx).await,
                        Err(e) => tracing::error!(error = %e, "consul-sim: cannot register listener"),
                    }
                });
                // Dropping the runtime here cancels every connection task.
                runtime.shutdown_timeout(Duration::from_secs(1));
            })
            .map_err(SimError::Runtime)?;
        Ok(RunningSim { addr, shared, task: None, thread: Some(thread) })
    }
}

/// A running simulator. Dropping it stops the server and closes every connection.
pub struct RunningSim {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: Option<tokio::task::JoinHandle<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RunningSim {
    /// The bound address (the real port when started on port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>`, or `https://<addr>` with TLS, without a trailing slash.
    pub fn base_url(&self) -> String {
        let scheme = if self.shared.config.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    pub fn faults(&self) -> Faults {
        self.shared.faults()
    }

    /// Applies a partial fault change; returns the resulting faults.
    pub fn set_faults(&self, patch: FaultsPatch) -> Faults {
        self.shared.set_faults(patch)
    }

    /// Back to the start-up defaults.
    pub fn clear_faults(&self) -> Faults {
        self.shared.clear_faults()
    }

    /// Closes every in-flight blocking query without a response; returns how many.
    pub fn drop_blocking(&self) -> usize {
        self.shared.drop_blocking()
    }

    /// Sets a registered service's index (it may go backwards); false if the service is
    /// unknown.
    pub fn set_service_index(&self, key: &ServiceKey, index: u64) -> bool {
        self.shared.set_service_index(key, index)
    }

    /// Sets every index to `index`, keeping the data ("restart with a lower index").
    pub fn reset_indexes(&self, index: u64) {
        self.shared.reset_indexes(index);
    }

    pub fn requests(&self) -> Vec<RequestRecord> {
        self.shared.requests()
    }

    /// When the simulator started: [`RequestRecord::at_ms`] counts from here.
    pub fn started(&self) -> std::time::Instant {
        self.shared.started()
    }

    /// The `seq` of the latest request (0 before any), without copying the log.
    pub fn last_request_seq(&self) -> u64 {
        self.shared.last_request_seq()
    }

    /// Empties the request log; returns how many records it held.
    pub fn clear_requests(&self) -> usize {
        self.shared.clear_requests()
    }

    pub fn stats(&self) -> Stats {
        self.shared.stats()
    }

    pub fn reset_stats(&self) {
        self.shared.reset_stats();
    }

    /// Polls the stats until `cond` holds or `timeout` passes; returns the last stats and
    /// whether the condition held. For waiting on a condition rather than sleeping and hoping.
    pub async fn wait_for_stats(&self, timeout: Duration, cond: impl Fn(&Stats) -> bool) -> (Stats, bool) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let stats = self.stats();
            if cond(&stats) {
                return (stats, true);
            }
            if tokio::time::Instant::now() >= deadline {
                return (stats, false);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Stops accepting, closes every connection, and waits for the accept loop to end.
    pub async fn shutdown(mut self) {
        self.shared.shutdown.send_replace(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        if let Some(thread) = self.thread.take() {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }
}

impl Drop for RunningSim {
    fn drop(&mut self) {
        self.shared.shutdown.send_replace(true);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl std::fmt::Debug for RunningSim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningSim").field("addr", &self.addr).finish()
    }
}
