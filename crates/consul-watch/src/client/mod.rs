//! The HTTP side: one connection pool per Consul address and TLS settings, and the health
//! query with Consul's parameters and error statuses.
//!
//! `parse` reads the bodies; `http1` carries queries over HTTP/1.1, plain or TLS; over TLS,
//! `tls` builds the configuration both protocol paths share, and `multiplex` carries
//! queries as HTTP/2 streams when the server speaks it.
//!
//! The ACL token is a per-request header rather than part of the client, so watches with
//! different tokens share one connection pool (and one connection budget). It is never put
//! into an error message: errors name the address, never the request's headers.

pub(crate) mod body;
pub(crate) mod http1;
pub(crate) mod multiplex;
pub(crate) mod parse;
mod sameness;
pub(crate) mod tls;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use http::header::{AGE, HeaderMap, RETRY_AFTER};
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use crate::error::{QueryError, cause_chain};
use body::{Body, BodyError};
use consul_resolver_core::keys::{Consistency, ConsulKey, Remote, Secret, TlsSettings};
use consul_resolver_core::model::Endpoint;
use http1::{Conn, Http1};
use multiplex::{Multiplexed, Multiplexer, Protocol};

/// How much longer than its `wait` (plus the server's random extra of up to wait/16) a
/// request may take before the client gives up on it: a non-blocking read gets this alone.
/// A connection that silently died (a NAT or firewall forgot it, the server vanished)
/// is noticed by this, or sooner by TCP keepalive.
pub(crate) const REQUEST_MARGIN: Duration = Duration::from_secs(15);

/// How long a TCP connect (and a TLS handshake) may take, on every path.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// TCP keepalive on every path: a peer that vanished without a FIN or RST is noticed
/// within about 30 s, even in the middle of a five-minute blocking query.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(15);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_RETRIES: u32 = 3;

/// A TCP connection to `host` (looked up afresh) and `port` within [`CONNECT_TIMEOUT`], with
/// Nagle off and [`KEEPALIVE_IDLE`] and its kin on. `address` names the server in errors.
pub(crate) async fn connect_tcp(address: &str, host: &str, port: u16) -> Result<TcpStream, QueryError> {
    let network = |cause: String| QueryError::Network { address: address.to_owned(), cause };
    let tcp = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect((host, port)))
        .await
        .map_err(|_| network(format!("no connection within {CONNECT_TIMEOUT:?}")))?
        .map_err(|e| network(format!("cannot connect: {}", cause_chain(&e))))?;
    let _ = tcp.set_nodelay(true);
    let ka = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_RETRIES);
    let _ = socket2::SockRef::from(&tcp).set_tcp_keepalive(&ka);
    Ok(tcp)
}

/// How to make a TLS connection to one server: its configuration (roots, client
/// certificate, ALPN offer) and the name its certificate must carry, also sent as SNI
/// (`serverName`, else the address's host).
pub(crate) struct TlsConnect {
    connector: tokio_rustls::TlsConnector,
    server_name: ServerName<'static>,
}

impl TlsConnect {
    pub(crate) fn new(address: &str, config: rustls::ClientConfig, server_name: &str) -> Result<TlsConnect, String> {
        let server_name = ServerName::try_from(server_name.to_owned())
            .map_err(|_| format!("Consul at {address}: {server_name:?} is not a valid TLS server name"))?;
        Ok(TlsConnect { connector: tokio_rustls::TlsConnector::from(Arc::new(config)), server_name })
    }

    /// The TLS handshake over `tcp` within [`CONNECT_TIMEOUT`]; a certificate problem says
    /// which setting to check (see [`tls::explain`]).
    pub(crate) async fn handshake(&self, address: &str, tcp: TcpStream) -> Result<TlsStream<TcpStream>, QueryError> {
        tokio::time::timeout(CONNECT_TIMEOUT, self.connector.connect(self.server_name.clone(), tcp))
            .await
            .map_err(|_| QueryError::Network {
                address: address.to_owned(),
                cause: format!("no TLS handshake within {CONNECT_TIMEOUT:?}"),
            })?
            .map_err(|e| match tls::explain(&e) {
                Some(cause) => QueryError::Tls { address: address.to_owned(), cause },
                None => QueryError::Network { address: address.to_owned(), cause: cause_chain(&e) },
            })
    }
}

/// Where an `http(s)://` address connects: its host (an IPv6 address without brackets)
/// and its port.
fn host_and_port(address: &str, url: &url::Url) -> Result<(String, u16), String> {
    let host = url.host_str().ok_or_else(|| format!("Consul address {address} has no host"))?;
    let port = url.port_or_known_default().ok_or_else(|| format!("Consul address {address} has no port"))?;
    Ok((host.trim_start_matches('[').trim_end_matches(']').to_owned(), port))
}

/// The client-side limit of a request that blocks for `block` (`None`: does not block).
pub(crate) fn request_timeout(block: Option<(u64, Duration)>) -> Duration {
    match block {
        Some((_, wait)) => wait + wait / 16 + REQUEST_MARGIN,
        None => REQUEST_MARGIN,
    }
}

/// A successful read: the index (never below 1) and the parsed body.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Answer<T> {
    pub index: u64,
    /// Whether the answer carried `X-Consul-Index`. Without it (something between the
    /// operator and Consul strips the header) no query can block: `index` is then 1, and
    /// a query blocking on it would answer at once, again and again.
    pub indexed: bool,
    pub value: T,
}

/// One answer of a watch's query.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Instances {
    /// The instances the key's options admit, sorted.
    pub endpoints: Vec<Endpoint>,
    /// What a change feed must wake this watch for.
    pub heard: Heard,
    /// A `cached` read answered from an agent's cache that lost its servers this long ago
    /// (see [`cache_age`]); `None` for a current answer.
    pub cache_age: Option<Duration>,
}

/// A successful response: its index, the agent cache's age, its body.
#[derive(Debug)]
struct Got {
    index: u64,
    indexed: bool,
    cache_age: Option<Duration>,
    body: Body,
}

/// What a watch asked about, before any filter of ours: every node its service's instances
/// run on and every service name they carry (its own, and on `connect` the proxies'), in
/// lower case as Consul compares names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Heard {
    pub nodes: BTreeSet<String>,
    pub names: BTreeSet<String>,
}

/// Which checks a `/v1/health/state` query asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CheckState {
    /// Every check: its index moves, and a blocking query wakes, on every check write.
    Any,
    /// The critical ones: a blocking query wakes when a check turns critical, stops being
    /// critical or is written while critical, not for a passing check rewritten
    /// (docs/consul.md, "Services without a blocking query of their own").
    Critical,
    /// The warning ones, likewise.
    Warning,
}

impl CheckState {
    fn path(self) -> &'static str {
        match self {
            CheckState::Any => "any",
            CheckState::Critical => "critical",
            CheckState::Warning => "warning",
        }
    }
}

/// A connection pool to one Consul address: HTTP/1.1 connections for `http://` (see
/// [`http1`]); over TLS, HTTP/2 streams when the server speaks it (see [`multiplex`]), else
/// HTTP/1.1 connections as over plain TCP.
pub(crate) struct HttpClient {
    transport: Transport,
    /// Where requests go (`https://<serverName>:port` when SNI is overridden).
    base: String,
    /// The address as configured, for messages.
    address: String,
    /// The largest answer read, inflated (`--consul-max-response-bytes`).
    max_body: usize,
}

enum Transport {
    Plain(Http1),
    Tls {
        /// Tried first, until the server turns out to speak HTTP/1.1 only.
        multiplexer: Arc<Multiplexer>,
        /// From then on.
        http1: Http1,
    },
}

impl std::fmt::Debug for HttpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpClient").field("address", &self.address).finish()
    }
}

impl HttpClient {
    /// Builds the pool. `max_connections` caps idle connections kept; the caller caps
    /// concurrent requests (and so open connections) with its budget.
    ///
    /// `serverName` (SNI override): we connect to the configured host (looked up afresh for
    /// every new connection, so a Consul behind a DNS name that moves is followed on
    /// reconnect), send `serverName` as SNI and in the `Host` header, and verify the
    /// certificate against it.
    ///
    /// Redirects are never followed: Consul does not send them, and following one would
    /// hand the ACL token to whatever the `Location` names.
    ///
    /// HTTP/2 connections each hold a permit of `budget` while open.
    pub(crate) fn new(
        address: &str,
        tls: Option<&TlsSettings>,
        max_connections: usize,
        max_body: usize,
        budget: Arc<tokio::sync::Semaphore>,
    ) -> Result<Self, String> {
        let url = url::Url::parse(address).map_err(|e| format!("invalid Consul address {address}: {e}"))?;
        let mut base = address.trim_end_matches('/').to_owned();
        let (host, port) = match url.scheme() {
            "http" | "https" => host_and_port(address, &url)?,
            other => return Err(format!("Consul address {address}: scheme {other:?} is not http or https")),
        };
        if url.scheme() == "http" {
            let transport = Transport::Plain(Http1::new(address, &url, host, port, None, max_connections, max_body));
            return Ok(HttpClient { transport, base, address: address.to_owned(), max_body });
        }
        let in_context = |e: String| format!("Consul at {address}: {e}");
        let server_name = tls.and_then(|t| t.server_name.as_deref()).filter(|n| !n.is_empty());
        let mut shown = url.clone();
        if let Some(name) = server_name {
            base = format!("https://{name}:{port}");
            shown = url::Url::parse(&base).map_err(|e| format!("Consul at {address}: tls.serverName {name:?}: {e}"))?;
        }
        let name = server_name.unwrap_or(&host);
        // A connection opened for HTTP/1.1 offers only that: a server that turned to HTTP/2
        // since the first connection must not pick it for a connection we speak 1.1 on.
        let http1_tls =
            TlsConnect::new(address, tls::client_config(tls, tls::Offer::Http1).map_err(in_context)?, name)?;
        let http1 = Http1::new(address, &shown, host.clone(), port, Some(http1_tls), max_connections, max_body);
        let h2_tls =
            TlsConnect::new(address, tls::client_config(tls, tls::Offer::Http2OrHttp1).map_err(in_context)?, name)?;
        let multiplexer = Multiplexer::new(address, &host, port, h2_tls, budget, max_body);
        Ok(HttpClient { transport: Transport::Tls { multiplexer, http1 }, base, address: address.to_owned(), max_body })
    }

    /// Whether queries are HTTP/2 streams: learnt on the first connection, so `false` until
    /// a query reached the server. A watch of a multiplexed server needs no slot of the
    /// budget: a stream is cheap, and connections are counted as they open.
    pub(crate) fn multiplexed(&self) -> bool {
        matches!(&self.transport, Transport::Tls { multiplexer, .. } if multiplexer.protocol() == Protocol::Http2)
    }

    pub(crate) fn address(&self) -> &str {
        &self.address
    }

    /// `GET /v1/health/service/<name>` (or `/v1/health/connect/<name>`) for `key`; blocking
    /// when `block` is `Some((index, wait))`. What the server cannot filter (every tag on
    /// old agents, excluded tags, statuses other than passing-only) is filtered here.
    ///
    /// Only a blocking query lets Consul filter health (`?passing`): a read asks for every
    /// instance and filters here, so that it can say every node and name the service has,
    /// healthy or not. A fed watch must hear of those nodes' checks: a node that comes back
    /// to passing brings back instances no filtered answer showed. Except a sameness
    /// group's read: Consul picks the member that answers from what the query asks for, so
    /// asked for every instance it answers a member whose instances are all failing rather
    /// than fail over (and such a watch is never fed: its instances live in other clusters).
    /// A sameness group that leaves nothing is walked member by member ([`sameness`]).
    pub(crate) async fn health(
        &self,
        key: &ConsulKey,
        block: Option<(u64, Duration)>,
    ) -> Result<Answer<Instances>, QueryError> {
        let answer = self.read_health(key, block).await?;
        match &key.scope.remote {
            // Boxed: rare (a group that left nothing), and held by no other query.
            Some(Remote::SamenessGroup(group)) if answer.value.endpoints.is_empty() => {
                Box::pin(self.walk_members(key, group, answer)).await
            }
            _ => Ok(answer),
        }
    }

    async fn read_health(
        &self,
        key: &ConsulKey,
        block: Option<(u64, Duration)>,
    ) -> Result<Answer<Instances>, QueryError> {
        let q = &key.scope.query;
        let endpoint = if q.connect { "connect" } else { "service" };
        let url = format!("{}/v1/health/{endpoint}/{}", self.base, encode_segment(&key.service));
        let mut query: Vec<(&str, String)> = Vec::new();
        scope_params(
            &mut query,
            key.scope.datacenter.as_deref(),
            key.scope.namespace.as_deref(),
            key.scope.partition.as_deref(),
        );
        match &key.scope.remote {
            None => {}
            Some(Remote::Peer(peer)) => query.push(("peer", peer.clone())),
            Some(Remote::SamenessGroup(group)) => query.push(("sameness-group", group.clone())),
        }
        if let Some(filter) = &q.filter {
            query.push(("filter", filter.to_string()));
        }
        let fails_over = matches!(key.scope.remote, Some(Remote::SamenessGroup(_)));
        if q.statuses.only_passing() && (block.is_some() || fails_over) {
            query.push(("passing", "1".into()));
        }
        for t in &q.tags {
            query.push(("tag", t.clone()));
        }
        match q.consistency {
            Consistency::Default => {}
            Consistency::Stale => query.push(("stale", String::new())),
            Consistency::Consistent => query.push(("consistent", String::new())),
        }
        if q.cached {
            query.push(("cached", String::new()));
        }
        push_block(&mut query, block);
        let got = self.get(&url, &query, key.scope.server.token.as_ref(), request_timeout(block)).await?;
        let (index, indexed, body) = (got.index, got.indexed, self.whole(&got.body)?);
        let (mut endpoints, mut names) =
            parse::health_instances(&body, &q.address).map_err(|cause| self.body_error(cause))?;
        names.insert(key.service.to_ascii_lowercase());
        let nodes = endpoints.iter().map(|e| e.node.clone()).collect();
        let carries = |e: &Endpoint, want: &String| e.tags.iter().any(|t| t.eq_ignore_ascii_case(want));
        endpoints.retain(|e| {
            q.statuses.admits(e.health)
                && q.tags.iter().all(|want| carries(e, want))
                && !q.excluded_tags.iter().any(|no| carries(e, no))
        });
        let value = Instances { endpoints, heard: Heard { nodes, names }, cache_age: got.cache_age };
        Ok(Answer { index, indexed, value })
    }

    /// `GET /v1/status/leader`: whether the server answers at all (any HTTP answer is one).
    pub(crate) async fn probe(&self, timeout: Duration) -> Result<(), QueryError> {
        let url = format!("{}/v1/status/leader", self.base);
        self.get(&url, &[], None, timeout).await.map(|_| ())
    }

    /// `GET /v1/catalog/services`: service names and their tags (the change feed). `apply`
    /// takes the answer's index and its body, and reads it if it needs to
    /// ([`parse::catalog_services`]); its error is a malformed answer.
    pub(crate) async fn catalog_services<R>(
        &self,
        scope: &Scope,
        token: Option<&Secret>,
        block: Option<(u64, Duration)>,
        apply: impl FnOnce(u64, &[u8]) -> Result<R, String>,
    ) -> Result<Answer<R>, QueryError> {
        let url = format!("{}/v1/catalog/services", self.base);
        let Got { index, indexed, body, .. } = self.scoped_get(&url, scope, token, block).await?;
        let value = apply(index, &self.whole(&body)?).map_err(|cause| self.body_error(cause))?;
        Ok(Answer { index, indexed, value })
    }

    /// `GET /v1/catalog/nodes`: every node the token may see, with the index that last wrote
    /// each (the change feed locating a catalog move, [`crate::locate`]). Never blocks.
    pub(crate) async fn catalog_nodes(
        &self,
        scope: &Scope,
        token: Option<&Secret>,
    ) -> Result<Vec<parse::NodeRow>, QueryError> {
        let url = format!("{}/v1/catalog/nodes", self.base);
        let got = self.scoped_get(&url, scope, token, None).await?;
        parse::catalog_nodes(&self.whole(&got.body)?).map_err(|cause| self.body_error(cause))
    }

    /// `GET /v1/catalog/node-services/<node>` (Consul 1.7+): the node's service instances in
    /// the scope, with the index that last wrote each. Never blocks.
    pub(crate) async fn node_services(
        &self,
        scope: &Scope,
        token: Option<&Secret>,
        node: &str,
    ) -> Result<parse::NodeServices, QueryError> {
        let url = format!("{}/v1/catalog/node-services/{}", self.base, encode_segment(node));
        let got = self.scoped_get(&url, scope, token, None).await?;
        parse::node_services(&self.whole(&got.body)?).map_err(|cause| self.body_error(cause))
    }

    /// `GET /v1/health/state/<state>`: the scope's checks in `state` (the change feed).
    /// `apply` takes the answer's index and its body as a stream, inflated as it is read (at
    /// the scale profile every check is 21 MB: see [`body`]), and reads what it needs of it
    /// (the checks it does not know already); its error is a malformed answer.
    pub(crate) async fn health_state<R>(
        &self,
        state: CheckState,
        scope: &Scope,
        token: Option<&Secret>,
        block: Option<(u64, Duration)>,
        apply: impl FnOnce(u64, &mut dyn std::io::Read) -> Result<R, String>,
    ) -> Result<Answer<R>, QueryError> {
        let url = format!("{}/v1/health/state/{}", self.base, state.path());
        let Got { index, indexed, body, .. } = self.scoped_get(&url, scope, token, block).await?;
        let mut reader = body.reader();
        let value = apply(index, &mut reader).map_err(|cause| match reader.too_large() {
            true => self.body_failure(BodyError::TooLarge),
            false => self.body_error(cause),
        })?;
        Ok(Answer { index, indexed, value })
    }

    async fn scoped_get(
        &self,
        url: &str,
        scope: &Scope,
        token: Option<&Secret>,
        block: Option<(u64, Duration)>,
    ) -> Result<Got, QueryError> {
        let mut query = Vec::new();
        scope_params(&mut query, scope.datacenter.as_deref(), scope.namespace.as_deref(), scope.partition.as_deref());
        push_block(&mut query, block);
        self.get(url, &query, token, request_timeout(block)).await
    }

    fn body_error(&self, cause: String) -> QueryError {
        QueryError::Body { address: self.address.clone(), cause }
    }

    fn body_failure(&self, e: BodyError) -> QueryError {
        match e {
            BodyError::Malformed(cause) => self.body_error(cause),
            BodyError::TooLarge => QueryError::TooLarge { address: self.address.clone(), limit: self.max_body },
        }
    }

    /// The body inflated whole.
    fn whole(&self, body: &Body) -> Result<bytes::Bytes, QueryError> {
        body.whole().map_err(|e| self.body_failure(e))
    }

    async fn get(
        &self,
        url: &str,
        query: &[(&str, String)],
        token: Option<&Secret>,
        timeout: Duration,
    ) -> Result<Got, QueryError> {
        let address = &self.address;
        let mut url = url::Url::parse(url)
            .map_err(|e| QueryError::Network { address: address.clone(), cause: format!("bad URL: {e}") })?;
        if !query.is_empty() {
            url.query_pairs_mut().extend_pairs(query);
        }
        let mut headers = HeaderMap::new();
        if let Some(t) = token {
            let h = multiplex::sensitive(t.expose()).ok_or_else(|| QueryError::Status {
                address: address.clone(),
                status: 0,
                body: "the ACL token is not a valid header value".into(),
            })?;
            headers.insert("x-consul-token", h);
        }
        let late = || QueryError::Network {
            address: address.clone(),
            cause: format!("no complete answer within {timeout:?} (the blocking wait plus a margin)"),
        };
        let target = || match url.query() {
            Some(q) => format!("{}?{q}", url.path()),
            None => url.path().to_owned(),
        };
        let (status, headers, body) = match &self.transport {
            Transport::Plain(http1) => {
                tokio::time::timeout(timeout, http1.get(&target(), &headers)).await.map_err(|_| late())??
            }
            Transport::Tls { multiplexer, http1 } => {
                let exchange = async {
                    if multiplexer.protocol() != Protocol::Http1 {
                        // Boxed: an HTTP/2 exchange's state is most of this future's size,
                        // which every HTTP/1.1 query would otherwise hold too.
                        match Box::pin(multiplexer.get(url.as_str(), &headers)).await? {
                            Multiplexed::Answer(answer) => return Ok(answer),
                            // The connection that learnt it carries this query.
                            Multiplexed::Http1(Some(probe)) => http1.keep(Conn::Tls(probe)),
                            Multiplexed::Http1(None) => {}
                        }
                    }
                    http1.get(&target(), &headers).await
                };
                tokio::time::timeout(timeout, exchange).await.map_err(|_| late())??
            }
        };
        if status.is_success() {
            let index = index_header(&headers);
            return Ok(Got {
                index: index.unwrap_or(1),
                indexed: index.is_some(),
                cache_age: cache_age(&headers),
                body,
            });
        }
        if status.is_redirection() {
            return Err(QueryError::Redirect { address: address.clone(), status: status.as_u16() });
        }
        // (An error's text that does not inflate is left out: the status says enough.)
        let text =
            String::from_utf8_lossy(&body.whole().unwrap_or_default()).trim().chars().take(500).collect::<String>();
        Err(match status {
            StatusCode::FORBIDDEN => QueryError::Forbidden { address: address.clone(), body: text },
            StatusCode::TOO_MANY_REQUESTS => {
                QueryError::RateLimited { address: address.clone(), retry_after: retry_after(&headers) }
            }
            s => QueryError::Status { address: address.clone(), status: s.as_u16(), body: text },
        })
    }
}

const USER_AGENT: &str = concat!("consul-resolver-operator/", env!("CARGO_PKG_VERSION"));

/// What a change feed covers: one datacenter, namespace and partition.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Scope {
    pub datacenter: Option<String>,
    pub namespace: Option<String>,
    pub partition: Option<String>,
}

impl Scope {
    pub(crate) fn of(key: &ConsulKey) -> Self {
        Scope {
            datacenter: key.scope.datacenter.clone(),
            namespace: key.scope.namespace.clone(),
            partition: key.scope.partition.clone(),
        }
    }
}

fn scope_params(query: &mut Vec<(&str, String)>, dc: Option<&str>, ns: Option<&str>, partition: Option<&str>) {
    for (name, value) in [("dc", dc), ("ns", ns), ("partition", partition)] {
        if let Some(v) = value.filter(|v| !v.is_empty()) {
            query.push((name, v.to_owned()));
        }
    }
}

fn push_block(query: &mut Vec<(&str, String)>, block: Option<(u64, Duration)>) {
    if let Some((index, wait)) = block {
        query.push(("index", index.to_string()));
        query.push(("wait", go_duration(wait)));
    }
}

/// A Go duration Consul accepts: whole milliseconds (`300000ms`), or seconds when exact.
pub(crate) fn go_duration(d: Duration) -> String {
    let ms = d.as_millis().max(1);
    if ms.is_multiple_of(1000) { format!("{}s", ms / 1000) } else { format!("{ms}ms") }
}

/// `X-Consul-Index`; a zero value counts as 1 (never block on 0). `None`: missing or
/// unparsable, so nothing can block on it.
fn index_header(headers: &HeaderMap) -> Option<u64> {
    headers.get("x-consul-index").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok()).map(|i| i.max(1))
}

/// How long an agent's cache has been without its servers, from a `cached` read's headers:
/// `X-Cache: HIT` with an `Age` above 0. For results the agent refreshes in the background
/// (service health) `Age` stays 0 while it is connected to its servers and counts the
/// seconds since it lost them otherwise (Consul's agent caching docs). `None`: current.
fn cache_age(headers: &HeaderMap) -> Option<Duration> {
    let hit =
        headers.get("x-cache").and_then(|v| v.to_str().ok()).is_some_and(|v| v.trim().eq_ignore_ascii_case("hit"));
    let age: u64 = headers.get(AGE)?.to_str().ok()?.trim().parse().ok()?;
    (hit && age > 0).then(|| Duration::from_secs(age))
}

/// `Retry-After` in seconds (the HTTP-date form is not used by Consul).
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let secs: u64 = headers.get(RETRY_AFTER)?.to_str().ok()?.trim().parse().ok()?;
    Some(Duration::from_secs(secs.min(300)))
}

/// Path segment encoding for a service name (names are usually plain, but never trust).
fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget() -> Arc<tokio::sync::Semaphore> {
        Arc::new(tokio::sync::Semaphore::new(4))
    }
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn requests_may_take_their_wait_its_jitter_and_a_margin() {
        assert_eq!(request_timeout(None), REQUEST_MARGIN);
        let five_minutes = Duration::from_secs(300);
        assert_eq!(
            request_timeout(Some((7, five_minutes))),
            five_minutes + Duration::from_millis(18_750) + REQUEST_MARGIN
        );
    }

    /// A server that accepts the connection and never answers (a dropped connection
    /// looks the same): the request fails at its limit instead of hanging.
    #[tokio::test]
    async fn a_silent_server_fails_the_query_at_its_limit() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let held = tokio::spawn(async move {
            let mut conns = Vec::new();
            while let Ok((c, _)) = listener.accept().await {
                conns.push(c);
            }
        });
        let c = HttpClient::new(&format!("http://{addr}"), None, 4, 1 << 20, budget()).unwrap();
        let started = std::time::Instant::now();
        let err = c
            .get(&format!("http://{addr}/v1/health/service/web"), &[], None, Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
        assert!(err.to_string().contains("no complete answer within 300ms"), "{err}");
        held.abort();
    }

    /// The change feed's checks answer is inflated as it is read: a 5 MB answer (gzipped, as
    /// agents send it) is never held inflated. (At 75,000 checks it is 21 MB, which was the
    /// operator's largest transient at the scale profile.)
    #[test]
    fn a_checks_answer_is_read_as_a_stream_never_inflated_whole() {
        use std::io::{BufRead, Write};
        let _ = rustls::crypto::ring::default_provider().install_default();
        let checks: Vec<_> = (0..20_000)
            .map(|i| {
                serde_json::json!({"Node": format!("node-{i}"), "CheckID": format!("service:web-{i}"), "Name": "web",
                    "Status": "passing", "Output": "HTTP GET http://10.0.0.1:8080/health: 200 OK Output: ok",
                    "ServiceID": format!("web-{i}"), "ServiceName": format!("web-{}", i % 1000), "ServiceTags": [],
                    "Type": "http", "CreateIndex": 10, "ModifyIndex": 10 + i})
            })
            .collect();
        let json = serde_json::to_vec(&checks).unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&json).unwrap();
        let gz = gz.finish().unwrap();
        let head = "HTTP/1.1 200 OK\r\nX-Consul-Index: 30000\r\nContent-Encoding: gzip\r\n";
        let response = [format!("{head}Content-Length: {}\r\n\r\n", gz.len()).as_bytes(), &gz].concat();
        // The server on threads of its own (one per connection): its allocations are not
        // the client's.
        let response = Arc::new(response);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let consul = format!("http://{}", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let response = response.clone();
                std::thread::spawn(move || {
                    let mut reader = std::io::BufReader::new(conn.try_clone().unwrap());
                    let mut line = String::new();
                    while reader.read_line(&mut line).is_ok_and(|n| n > 0) {
                        if line == "\r\n" && conn.write_all(&response).is_err() {
                            return;
                        }
                        line.clear();
                    }
                });
            }
        });
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let c = HttpClient::new(&consul, None, 4, 64 << 20, budget()).unwrap();
        let scope = Scope { datacenter: None, namespace: None, partition: None };
        let mut view = crate::changes::ChecksView::default();
        let mut read = || {
            let answer =
                rt.block_on(c.health_state(CheckState::Any, &scope, None, None, |index, body| view.apply(index, body)));
            answer.unwrap().value
        };
        assert_eq!(read(), crate::changes::Written::Everything, "the first answer: every check new to the view");
        // The same answer again: every check known by its bytes, so what is held is the
        // answer's reading, not the view's growth.
        let (again, peak) = heap_peak::peak_heap(&mut read);
        assert_eq!(again, crate::changes::Written::Checks(vec![]));
        assert!(peak < json.len() / 4, "{peak} bytes held to read a {} byte answer ({} gzipped)", json.len(), gz.len());
        // Inflated past the limit, the stream is an answer too large, as a whole one is.
        let small = HttpClient::new(&consul, None, 4, json.len() - 1, budget()).unwrap();
        let mut view = crate::changes::ChecksView::default();
        let err = rt
            .block_on(small.health_state(CheckState::Any, &scope, None, None, |i, body| view.apply(i, body)))
            .unwrap_err();
        assert!(matches!(err, QueryError::TooLarge { .. }), "{err}");
        assert_eq!(view.index(), None, "nothing of it was taken");
    }

    /// A one-shot HTTP server answering every connection with `response`; counts connections.
    async fn canned(response: Vec<u8>) -> (String, Arc<AtomicUsize>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let counted = connections.clone();
        tokio::spawn(async move {
            while let Ok((mut c, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                let response = response.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 8192];
                    let _ = c.read(&mut buf).await;
                    let _ = c.write_all(&response).await;
                    let _ = c.shutdown().await;
                });
            }
        });
        (format!("http://{addr}"), connections)
    }

    /// A watch of `web` at `address` with a token, any health, and `tags` (`!tag`: excluded).
    pub(super) fn key(address: &str, tags: &[&str]) -> ConsulKey {
        let mut key = consul_resolver_core::test_support::consul_key(address, "web");
        key.scope_mut().server.token = Some(Secret::new("s3cret"));
        key.scope_mut().query = consul_resolver_core::keys::QueryOptions {
            statuses: consul_resolver_core::keys::HealthStatuses::ANY,
            tags: tags.iter().filter(|t| !t.starts_with('!')).map(|t| t.to_string()).collect(),
            excluded_tags: tags.iter().filter_map(|t| t.strip_prefix('!')).map(str::to_owned).collect(),
            ..Default::default()
        };
        key
    }

    #[tokio::test]
    async fn redirects_are_not_followed() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let (elsewhere, reached) = canned(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]".to_vec()).await;
        let redirect = format!(
            "HTTP/1.1 307 Temporary Redirect\r\nLocation: {elsewhere}/v1/health/service/web\r\nContent-Length: 0\r\n\r\n"
        );
        let (consul, _) = canned(redirect.into_bytes()).await;
        let c = HttpClient::new(&consul, None, 4, 1 << 20, budget()).unwrap();
        let err = c.health(&key(&consul, &[]), None).await.unwrap_err();
        assert!(matches!(err, QueryError::Redirect { status: 307, .. }), "{err}");
        assert!(err.to_string().contains("not followed"), "{err}");
        assert_eq!(reached.load(Ordering::SeqCst), 0, "the token never went to the redirect's target");
    }

    #[tokio::test]
    async fn oversized_answers_are_errors() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let body = format!("[{}]", vec!["{}"; 100_000].join(","));
        // Announced by Content-Length, and streamed without one (read until close).
        for head in [format!("Content-Length: {}\r\n", body.len()), "Connection: close\r\n".to_owned()] {
            let (consul, _) = canned(format!("HTTP/1.1 200 OK\r\n{head}\r\n{body}").into_bytes()).await;
            let c = HttpClient::new(&consul, None, 4, 64 * 1024, budget()).unwrap();
            let err = c.health(&key(&consul, &[]), None).await.unwrap_err();
            assert!(matches!(err, QueryError::TooLarge { limit: 65536, .. }), "{head}: {err}");
        }
    }

    /// Agents before 1.3 apply only the first `tag`: the client keeps only instances with all.
    #[tokio::test]
    async fn tags_are_filtered_client_side() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let body = r#"[{"Node":{"Node":"n","Address":"10.0.0.1"},"Service":{"ID":"a","Port":1,"Tags":["a"]},"Checks":[]},
                       {"Node":{"Node":"n","Address":"10.0.0.1"},"Service":{"ID":"ab","Port":2,"Tags":["B","a"]},"Checks":[]}]"#;
        let response = format!("HTTP/1.1 200 OK\r\nX-Consul-Index: 5\r\nContent-Length: {}\r\n\r\n{body}", body.len());
        let (consul, _) = canned(response.into_bytes()).await;
        let c = HttpClient::new(&consul, None, 4, 1 << 20, budget()).unwrap();
        let answer = c.health(&key(&consul, &["a", "b"]), None).await.unwrap();
        assert_eq!(answer.value.endpoints.iter().map(|e| e.service_id.as_str()).collect::<Vec<_>>(), ["ab"]);
        assert_eq!(answer.index, 5);
    }

    /// A read asks for every instance and filters health here (the same answer `?passing`
    /// would give), and says every node and name it saw: the critical instance's node too,
    /// whose recovery a fed watch must hear of. A blocking query lets Consul filter.
    #[tokio::test]
    async fn a_read_filters_health_here_and_hears_every_node() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let _ = rustls::crypto::ring::default_provider().install_default();
        let body = r#"[{"Node":{"Node":"up","Address":"10.0.0.1"},"Service":{"ID":"a","Service":"Web","Port":1},
                        "Checks":[{"Status":"passing"}]},
                       {"Node":{"Node":"down","Address":"10.0.0.2"},"Service":{"ID":"b","Service":"web","Port":2},
                        "Checks":[{"Status":"passing"},{"Status":"critical"}]}]"#;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let consul = format!("http://{}", listener.local_addr().unwrap());
        let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel::<String>();
        tokio::spawn(async move {
            while let Ok((mut c, _)) = listener.accept().await {
                let mut buf = vec![0u8; 8192];
                let n = c.read(&mut buf).await.unwrap_or(0);
                let _ = seen_tx.send(String::from_utf8_lossy(&buf[..n]).lines().next().unwrap_or("").to_owned());
                let response =
                    format!("HTTP/1.1 200 OK\r\nX-Consul-Index: 5\r\nContent-Length: {}\r\n\r\n{body}", body.len());
                let _ = c.write_all(response.as_bytes()).await;
                let _ = c.shutdown().await;
            }
        });
        let c = HttpClient::new(&consul, None, 4, 1 << 20, budget()).unwrap();
        let mut passing = key(&consul, &[]);
        passing.scope_mut().query = Default::default();
        let read = c.health(&passing, None).await.unwrap().value;
        let line = seen.recv().await.unwrap();
        assert!(!line.contains("passing"), "{line}");
        assert_eq!(read.endpoints.iter().map(|e| e.port).collect::<Vec<_>>(), [1], "filtered here");
        assert_eq!(read.heard.nodes, BTreeSet::from(["down".to_owned(), "up".to_owned()]));
        assert_eq!(read.heard.names, BTreeSet::from(["web".to_owned()]), "lower case, the key's own included");
        let _ = c.health(&passing, Some((5, Duration::from_secs(1)))).await;
        let line = seen.recv().await.unwrap();
        assert!(line.contains("passing=1") && line.contains("index=5"), "{line}");
    }

    #[test]
    fn an_agent_cache_without_its_servers_has_an_age() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.insert(*k, v.parse().unwrap());
            }
            h
        };
        assert_eq!(cache_age(&headers(&[("x-cache", "HIT"), ("age", "42")])), Some(Duration::from_secs(42)));
        assert_eq!(cache_age(&headers(&[("x-cache", "HIT"), ("age", "0")])), None, "connected: current");
        assert_eq!(cache_age(&headers(&[("x-cache", "MISS")])), None);
        assert_eq!(cache_age(&headers(&[("age", "42")])), None, "not from the agent's cache");
        assert_eq!(cache_age(&headers(&[("x-cache", "HIT"), ("age", "soon")])), None);
    }

    #[test]
    fn go_durations() {
        assert_eq!(go_duration(Duration::from_secs(300)), "300s");
        assert_eq!(go_duration(Duration::from_millis(1500)), "1500ms");
        assert_eq!(go_duration(Duration::ZERO), "1ms");
    }

    #[test]
    fn index_never_below_one_and_none_when_missing() {
        let mut h = HeaderMap::new();
        assert_eq!(index_header(&h), None, "stripped by something in between: nothing to block on");
        h.insert("x-consul-index", "soon".parse().unwrap());
        assert_eq!(index_header(&h), None);
        h.insert("x-consul-index", "0".parse().unwrap());
        assert_eq!(index_header(&h), Some(1));
        h.insert("x-consul-index", "42".parse().unwrap());
        assert_eq!(index_header(&h), Some(42));
    }

    #[test]
    fn segments_are_encoded() {
        assert_eq!(encode_segment("web-1.v2"), "web-1.v2");
        assert_eq!(encode_segment("a b/c"), "a%20b%2Fc");
    }

    #[tokio::test]
    async fn builds_tls_clients_and_rejects_bad_settings() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let tls = TlsSettings {
            server_name: Some("consul.internal".into()),
            insecure_skip_verify: true,
            ..Default::default()
        };
        let c = HttpClient::new("https://127.0.0.1:8501", Some(&tls), 4, 1 << 20, budget()).unwrap();
        assert_eq!(c.base, "https://consul.internal:8501");
        let bad = TlsSettings { ca_pem: Some("not a pem".into()), ..Default::default() };
        assert!(HttpClient::new("https://127.0.0.1:8501", Some(&bad), 4, 1 << 20, budget()).is_err());
        assert!(HttpClient::new("not a url", None, 4, 1 << 20, budget()).is_err());
    }

    #[test]
    fn errors_do_not_carry_tokens() {
        let e = QueryError::Forbidden { address: "http://127.0.0.1:8500".into(), body: "ACL not found".into() };
        assert!(e.to_string().contains("ACL token rejected"));
    }
}
