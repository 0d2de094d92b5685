//! The Consul endpoints: routing, parameters, blocking reads and writes, for one request at a
//! time (connections are `conn`'s).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use flate2::{Compress, Compression, Crc, FlushCompress, Status};
use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::Value;

use super::acl::{Identity, extract_token};
use super::blocking::{Wait, Watched, Woken, answers_zero, reported_index};
use super::catalog::{
    Catalog, CatalogError, ConfigEntry, DeregisterRequest, HealthEntry, Origin, RegisterRequest, ServiceKey,
    StateFilter, connect_key,
};
use super::control;
use super::duration::{effective_wait, jitter, parse_go_duration};
use super::faults::{Outcome, Quirks, RequestRecord};
use super::filter::Filter;
use super::render;
use super::state::{LogGuard, Shared, read_lock};
use super::urls::percent_decode;

type Resp = Response<Full<Bytes>>;

/// What goes on the wire: a whole body, or (the `truncated_body` fault) half of one.
pub(crate) type WireResp = Response<Either<Full<Bytes>, Truncated>>;

/// Marks a response whose body is to be cut off halfway (see [`Truncated`]).
#[derive(Clone, Copy)]
struct CutOff;

/// A body that announces its whole length, sends the first half, waits a moment (so hyper
/// flushes what it has), then fails, which makes hyper abort the connection: the client
/// sees an answer cut off mid-body.
pub(crate) struct Truncated {
    first_half: Option<Bytes>,
    len: u64,
    flushed: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl Truncated {
    fn of(whole: Bytes) -> Self {
        let len = whole.len() as u64;
        Truncated { first_half: Some(whole.slice(..whole.len() / 2)), len, flushed: None }
    }
}

/// The error that ends a [`Truncated`] body.
#[derive(Debug, thiserror::Error)]
#[error("body cut off by fault injection")]
pub(crate) struct CutOffError;

impl hyper::body::Body for Truncated {
    type Data = Bytes;
    type Error = CutOffError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, CutOffError>>> {
        use std::future::Future;
        if let Some(half) = self.first_half.take() {
            self.flushed = Some(Box::pin(tokio::time::sleep(Duration::from_millis(50))));
            return std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(half))));
        }
        match self.flushed.as_mut() {
            Some(wait) => {
                std::task::ready!(wait.as_mut().poll(cx));
                self.flushed = None;
                std::task::Poll::Ready(Some(Err(CutOffError)))
            }
            None => std::task::Poll::Ready(None),
        }
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.len)
    }
}

/// Label under which `/v1/catalog/services` blockers are counted in the stats.
pub const CATALOG_SERVICES_LABEL: &str = "_catalog_services";

/// Label under which `/v1/health/state/<state>` blockers are counted in the stats.
pub const HEALTH_STATE_LABEL: &str = "_health_state";

/// Prefix of the label under which `/v1/health/connect/<name>` blockers are counted in the
/// stats: `_connect/<name>` (the name as requested, decoded).
pub const HEALTH_CONNECT_LABEL_PREFIX: &str = "_connect/";

/// Label under which `/v1/catalog/nodes` blockers are counted in the stats.
pub const CATALOG_NODES_LABEL: &str = "_catalog_nodes";

/// Prefix of the label under which `/v1/catalog/node-services/<node>` blockers are counted
/// in the stats: `_node_services/<node>`.
pub const NODE_SERVICES_LABEL_PREFIX: &str = "_node_services/";

/// Returned by the service to make hyper close the connection without writing a response.
#[derive(Debug, thiserror::Error)]
#[error("connection dropped by fault injection")]
pub(crate) struct Dropped;

fn text(status: StatusCode, body: impl Into<String>) -> Resp {
    let mut resp = Response::new(Full::new(Bytes::from(body.into())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    resp
}

/// An error answer: a status and a plain-text body, as Consul sends them (no index headers).
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
    /// `Retry-After` seconds, on a 429 of the `too_many_requests` fault.
    retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), retry_after: None }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    fn into_response(self) -> Resp {
        let mut resp = text(self.status, self.message);
        if let Some(secs) = self.retry_after {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

impl From<CatalogError> for ApiError {
    fn from(e: CatalogError) -> Self {
        match e {
            CatalogError::BadRequest(m) => ApiError::bad_request(m),
            CatalogError::Internal(m) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, m),
        }
    }
}

/// Why a handler did not produce its normal answer.
enum Failure {
    Api(ApiError),
    Dropped,
}

impl From<ApiError> for Failure {
    fn from(e: ApiError) -> Self {
        Failure::Api(e)
    }
}

impl From<Dropped> for Failure {
    fn from(_: Dropped) -> Self {
        Failure::Dropped
    }
}

type Handled = Result<Resp, Failure>;

fn plain_json(value: &Value) -> Resp {
    json_bytes(value.to_string().into_bytes())
}

fn json_bytes(body: Vec<u8>) -> Resp {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn method_not_allowed(method: &Method) -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, format!("method {method} not allowed"))
}

/// Query parameters as Go's `url.Values` sees them.
struct Params(Vec<(String, String)>);

impl Params {
    fn parse(query: &str) -> Self {
        Params(url::form_urlencoded::parse(query.as_bytes()).map(|(k, v)| (k.into_owned(), v.into_owned())).collect())
    }

    fn has(&self, key: &str) -> bool {
        self.0.iter().any(|(k, _)| k == key)
    }

    /// Like Go's `Values.Get`: the first value, possibly empty.
    fn first(&self, key: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    fn first_non_empty(&self, key: &str) -> Option<&str> {
        self.first(key).filter(|v| !v.is_empty())
    }

    fn all(&self, key: &str) -> Vec<String> {
        self.0.iter().filter(|(k, _)| k == key).map(|(_, v)| v.clone()).collect()
    }

    /// Consul's `getBoolQueryParam`: presence with an empty value is true, otherwise Go's
    /// `strconv.ParseBool`.
    fn bool_flag(&self, key: &str) -> Result<bool, ()> {
        match self.first(key) {
            None => Ok(false),
            Some("") => Ok(true),
            Some("1" | "t" | "T" | "TRUE" | "true" | "True") => Ok(true),
            Some("0" | "f" | "F" | "FALSE" | "false" | "False") => Ok(false),
            Some(_) => Err(()),
        }
    }
}

/// The blocking and consistency options of a read.
struct ReadOptions {
    index: u64,
    wait: Duration,
    consistency: &'static str,
}

/// Parses `stale`/`consistent`/`cached`, `wait` and `index` in Consul's order.
fn parse_read_options(p: &Params) -> Result<ReadOptions, ApiError> {
    let stale = p.has("stale");
    let consistent = p.has("consistent");
    if stale && consistent {
        return Err(ApiError::bad_request("Cannot specify ?stale with ?consistent, conflicting semantics."));
    }
    if p.has("cached") && consistent {
        return Err(ApiError::bad_request("Cannot specify ?cached with ?consistent, conflicting semantics."));
    }
    let requested = match p.first_non_empty("wait") {
        None => None,
        Some(w) => Some(parse_go_duration(w).map_err(|_| ApiError::bad_request("Invalid wait time"))?),
    };
    let index = match p.first_non_empty("index") {
        None => 0,
        // Go's ParseUint: digits only (Rust's parse would also take a leading '+').
        Some(i) if i.bytes().all(|b| b.is_ascii_digit()) => {
            i.parse::<u64>().map_err(|_| ApiError::bad_request("Invalid index"))?
        }
        Some(_) => return Err(ApiError::bad_request("Invalid index")),
    };
    Ok(ReadOptions {
        index,
        wait: effective_wait(requested),
        consistency: if stale {
            "stale"
        } else if consistent {
            "consistent"
        } else {
            "leader"
        },
    })
}

fn check_datacenter(shared: &Shared, dc: Option<&str>) -> Result<(), ApiError> {
    match dc {
        Some(dc) if !dc.is_empty() && dc != shared.config.datacenter => {
            Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "No path to datacenter"))
        }
        _ => Ok(()),
    }
}

fn namespace<'a>(p: &'a Params, headers: &'a HeaderMap) -> Option<&'a str> {
    p.first_non_empty("ns")
        .or_else(|| headers.get("x-consul-namespace").and_then(|v| v.to_str().ok()).filter(|v| !v.is_empty()))
}

fn accepts_gzip(headers: &HeaderMap) -> bool {
    headers.get_all(header::ACCEPT_ENCODING).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(',')).any(
        |item| {
            let mut parts = item.split(';').map(str::trim);
            let coding = parts.next().unwrap_or("");
            let q_zero = parts.any(|p| p.strip_prefix("q=").is_some_and(|q| q.parse::<f32>().is_ok_and(|q| q <= 0.0)));
            coding.eq_ignore_ascii_case("gzip") && !q_zero
        },
    )
}

fn gzip(resp: Resp) -> Resp {
    let (mut parts, body) = resp.into_parts();
    // Full<Bytes> is infallible and ready: take its bytes without an executor.
    let bytes = match futures::FutureExt::now_or_never(body.collect()) {
        Some(Ok(c)) => c.to_bytes(),
        _ => return Response::from_parts(parts, Full::new(Bytes::new())),
    };
    match gzipped(&bytes) {
        Some(out) => {
            parts.headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
            parts.headers.insert(header::VARY, HeaderValue::from_static("Accept-Encoding"));
            Response::from_parts(parts, Full::new(Bytes::from(out)))
        }
        None => Response::from_parts(parts, Full::new(bytes)),
    }
}

/// `bytes` as a gzip member, deflated at the fastest level by a compressor kept per thread:
/// making one (and zeroing its tables) per answer cost more than compressing most answers.
fn gzipped(bytes: &[u8]) -> Option<Vec<u8>> {
    thread_local! {
        static DEFLATE: std::cell::RefCell<Compress> = std::cell::RefCell::new(Compress::new(Compression::fast(), false));
    }
    // RFC 1952: magic, deflate, no flags, no time, no extra flags, unknown OS.
    let mut out = Vec::with_capacity(bytes.len() / 4 + 64);
    out.extend_from_slice(&[0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff]);
    DEFLATE.with_borrow_mut(|deflate| {
        deflate.reset();
        let mut input = bytes;
        loop {
            out.reserve(input.len() / 4 + 1024);
            let (before, written) = (deflate.total_in(), deflate.total_out());
            let status = deflate.compress_vec(input, &mut out, FlushCompress::Finish).ok()?;
            let read = (deflate.total_in() - before) as usize;
            input = &input[read..];
            if status == Status::StreamEnd {
                return Some(());
            }
            if read == 0 && deflate.total_out() == written {
                return None; // No progress with room to write: never loop on it.
            }
        }
    })?;
    let mut crc = Crc::new();
    crc.update(bytes);
    out.extend_from_slice(&crc.sum().to_le_bytes());
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    Some(out)
}

/// Entry point for every request on a connection.
pub(crate) async fn handle(shared: Arc<Shared>, peer: SocketAddr, req: Request<Incoming>) -> Result<WireResp, Dropped> {
    let path = req.uri().path().to_owned();
    if path == "/_sim" || path.starts_with("/_sim/") {
        return Ok(control::handle(&shared, req).await.map(Either::Left));
    }
    let query = req.uri().query().unwrap_or("").to_owned();
    let params = Params::parse(&query);
    let token = extract_token(params.first("token"), req.headers());
    let service = path
        .strip_prefix("/v1/health/service/")
        .or_else(|| path.strip_prefix("/v1/health/connect/"))
        .and_then(percent_decode);
    let (token_value, token_source) = token.clone().map_or((None, None), |(t, s)| (Some(t), Some(s)));
    let seq = shared.log_request(RequestRecord {
        seq: 0,
        at_ms: 0,
        peer: peer.to_string(),
        method: req.method().to_string(),
        path: path.clone(),
        query: query.clone(),
        service,
        namespace: namespace(&params, req.headers()).map(str::to_owned),
        partition: params.first_non_empty("partition").map(str::to_owned),
        token: token_value,
        token_source,
        wait_ms: None,
        timeout_ms: None,
        outcome: Outcome::InFlight,
        status: None,
        index: None,
        duration_ms: None,
    });
    let log = LogGuard { shared: shared.clone(), seq, done: false };
    let wants_gzip = accepts_gzip(req.headers());

    let latency = shared.with_faults(|f| f.latency_ms);
    if latency > 0 {
        tokio::time::sleep(Duration::from_millis(latency)).await;
    }

    let ctx = Ctx { shared: &shared, params, token: token.map(|(t, _)| t), seq };
    match route(&ctx, req).await {
        Ok(resp) => {
            let index = resp.headers().get("x-consul-index").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
            log.finish(Outcome::Answered, Some(resp.status().as_u16()), index);
            let resp = if wants_gzip && resp.status().is_success() { gzip(resp) } else { resp };
            if resp.extensions().get::<CutOff>().is_none() {
                return Ok(resp.map(Either::Left));
            }
            // Full<Bytes> is infallible and ready: take its bytes without an executor.
            let (parts, body) = resp.into_parts();
            let whole = futures::FutureExt::now_or_never(body.collect()).and_then(Result::ok).map(|c| c.to_bytes());
            Ok(Response::from_parts(parts, Either::Right(Truncated::of(whole.unwrap_or_default()))))
        }
        Err(Dropped) => {
            log.finish(Outcome::Dropped, None, None);
            Err(Dropped)
        }
    }
}

struct Ctx<'a> {
    shared: &'a Arc<Shared>,
    params: Params,
    token: Option<String>,
    seq: u64,
}

impl Ctx<'_> {
    fn identity(&self) -> Result<Identity<'_>, ApiError> {
        Identity::resolve(self.shared.config.acl.as_ref(), self.token.as_deref())
            .map_err(|_| ApiError::new(StatusCode::FORBIDDEN, "ACL not found"))
    }

    /// Waits, if asked to, until `watched`'s index is above the client's or the wait passes;
    /// then returns the index to report and the `read` result. Wake-ups only evaluate the
    /// index (cheap), the full read happens once. Errors only when the fault injector drops
    /// blocking queries (or the simulator stops).
    async fn block<T>(
        &self,
        opts: &ReadOptions,
        label: &str,
        watched: Watched,
        quirks: Quirks,
        read: impl Fn(&Catalog) -> T,
    ) -> Result<(u64, T), Dropped> {
        let shared = self.shared;
        let snapshot = || {
            let catalog = read_lock(&shared.catalog);
            (reported_index(&watched, &catalog, quirks), read(&catalog))
        };
        if opts.index == 0 || answers_zero(&read_lock(&shared.catalog), quirks) {
            return Ok(snapshot());
        }
        let timeout = opts.wait + jitter(opts.wait);
        shared.update_request(self.seq, |r| {
            r.wait_ms = u64::try_from(opts.wait.as_millis()).ok();
            r.timeout_ms = u64::try_from(timeout.as_millis()).ok();
        });
        let deadline = tokio::time::Instant::now() + timeout;
        match Wait::start(shared, label, watched.clone(), quirks, opts.index, deadline).finish().await {
            Woken::Ready => Ok(snapshot()),
            Woken::Dropped => Err(Dropped),
        }
    }

    /// A successful read with Consul's headers (`index` as [`reported_index`] made it).
    fn read_ok(&self, body: &Value, index: u64, consistency: &'static str, acl_filtered: bool) -> Resp {
        self.read_ok_bytes(body.to_string().into_bytes(), index, consistency, acl_filtered)
    }

    fn read_ok_bytes(&self, body: Vec<u8>, index: u64, consistency: &'static str, acl_filtered: bool) -> Resp {
        let (known_leader, strip_index) = self.shared.with_faults(|f| (f.known_leader, f.strip_index));
        let mut resp = json_bytes(body);
        let h = resp.headers_mut();
        if !strip_index {
            h.insert("x-consul-index", HeaderValue::from(index));
        }
        h.insert("x-consul-knownleader", HeaderValue::from_static(if known_leader { "true" } else { "false" }));
        h.insert("x-consul-lastcontact", HeaderValue::from_static("0"));
        h.insert("x-consul-effective-consistency", HeaderValue::from_static(consistency));
        h.insert("x-consul-query-backend", HeaderValue::from_static("blocking-query"));
        if let Some(acl) = &self.shared.config.acl {
            h.insert(
                "x-consul-default-acl-policy",
                HeaderValue::from_static(if acl.anonymous_read { "allow" } else { "deny" }),
            );
        }
        if acl_filtered {
            h.insert("x-consul-results-filtered-by-acls", HeaderValue::from_static("true"));
        }
        resp
    }
}

async fn route(ctx: &Ctx<'_>, req: Request<Incoming>) -> Result<Resp, Dropped> {
    match dispatch(ctx, req).await {
        Ok(resp) => Ok(resp),
        Err(Failure::Api(e)) => Ok(e.into_response()),
        Err(Failure::Dropped) => Err(Dropped),
    }
}

async fn dispatch(ctx: &Ctx<'_>, req: Request<Incoming>) -> Handled {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    if let Some(name) = path.strip_prefix("/v1/health/service/") {
        if method != Method::GET {
            return Err(method_not_allowed(&method).into());
        }
        return health_service(ctx, name, req.headers(), false).await;
    }
    if let Some(name) = path.strip_prefix("/v1/health/connect/") {
        if method != Method::GET {
            return Err(method_not_allowed(&method).into());
        }
        return health_service(ctx, name, req.headers(), true).await;
    }
    // An agent without servers still answers about itself; everything else needs them.
    if ctx.shared.cut_off().is_some() && path != "/v1/agent/self" {
        return Err(no_servers().into());
    }
    if let Some(state) = path.strip_prefix("/v1/health/state/") {
        if method != Method::GET {
            return Err(method_not_allowed(&method).into());
        }
        return health_state(ctx, state, req.headers()).await;
    }
    if let Some(node) = path.strip_prefix("/v1/catalog/node-services/") {
        // Consul 1.7's: an older agent does not know the path.
        if ctx.shared.quirks().ignores_newer_parameters {
            return Err(ApiError::new(StatusCode::NOT_FOUND, "404 page not found\n").into());
        }
        if method != Method::GET {
            return Err(method_not_allowed(&method).into());
        }
        return node_services(ctx, node, req.headers()).await;
    }
    match (path.as_str(), &method) {
        ("/v1/health/service" | "/v1/health/connect", &Method::GET) => {
            Err(ApiError::bad_request("Missing service name").into())
        }
        ("/v1/health/state", &Method::GET) => Err(ApiError::bad_request("Missing check state").into()),
        ("/v1/catalog/node-services", &Method::GET) => Err(ApiError::bad_request("Missing node name").into()),
        ("/v1/catalog/register", &Method::PUT) => register(ctx, req).await,
        ("/v1/catalog/deregister", &Method::PUT) => deregister(ctx, req).await,
        ("/v1/catalog/services", &Method::GET) => catalog_services(ctx, req.headers()).await,
        ("/v1/catalog/nodes", &Method::GET) => catalog_nodes(ctx).await,
        ("/v1/config", &Method::PUT) => config_entry(ctx, req).await,
        (path, &Method::GET) if path.starts_with("/v1/config/sameness-group/") => sameness_group(ctx, path),
        ("/v1/agent/self", &Method::GET) => Ok(agent_self(ctx)),
        ("/v1/catalog/datacenters", &Method::GET) => {
            Ok(plain_json(&Value::from(vec![ctx.shared.config.datacenter.clone()])))
        }
        ("/v1/status/leader", &Method::GET) => {
            let no_leader = ctx.shared.with_faults(|f| f.no_leader.is_active());
            let leader = if no_leader { String::new() } else { ctx.shared.config.leader_address.clone() };
            Ok(plain_json(&Value::String(leader)))
        }
        (
            "/v1/catalog/register"
            | "/v1/catalog/deregister"
            | "/v1/catalog/services"
            | "/v1/catalog/nodes"
            | "/v1/catalog/node-services"
            | "/v1/catalog/datacenters"
            | "/v1/config"
            | "/v1/agent/self"
            | "/v1/status/leader",
            _,
        ) => Err(method_not_allowed(&method).into()),
        _ => Err(ApiError::new(StatusCode::NOT_FOUND, "404 page not found\n").into()),
    }
}

/// `GET /v1/health/service/<name>`, or with `connect` `GET /v1/health/connect/<name>`: the
/// `connect-proxy` instances whose `Proxy.DestinationServiceName` is `<name>`, with the same
/// parameters, faults and headers, ACL-checked on `<name>` and blocking on its Connect index.
async fn health_service(ctx: &Ctx<'_>, raw_name: &str, headers: &HeaderMap, connect: bool) -> Handled {
    let shared = ctx.shared;
    let p = &ctx.params;
    let name = percent_decode(raw_name).ok_or_else(|| ApiError::bad_request("Invalid URL path encoding"))?;
    if name.is_empty() {
        return Err(ApiError::bad_request("Missing service name").into());
    }
    let opts = parse_read_options(p)?;
    let passing = p.bool_flag("passing").map_err(|()| ApiError::bad_request("Invalid value for ?passing"))?;
    let quirks = shared.quirks();
    // An agent that predates these parameters ignores them, as Go's handlers ignore any
    // unknown one.
    let newer = !quirks.ignores_newer_parameters;
    let filter = match p.first_non_empty("filter") {
        Some(expression) if newer => Some(Filter::parse(expression).map_err(ApiError::bad_request)?),
        _ => None,
    };
    let origin = if newer { origin(shared, p)? } else { Origin::Local };
    let cached = newer && p.has("cached");
    check_datacenter(shared, p.first("dc"))?;
    let identity = ctx.identity()?;
    let cut_off = shared.cut_off();
    if cut_off.is_some() && !cached {
        return Err(no_servers().into());
    }
    inject_read_faults(shared)?;
    let body_fault = take_body_fault(shared);
    let opts = without_blocking_if(body_fault.is_some(), opts);

    let key = ServiceKey::scoped(name, namespace(p, headers), p.first_non_empty("partition"));
    let mut tags = p.all("tag");
    if quirks.first_tag_only {
        tags.truncate(1);
    }
    let selected = |e: &HealthEntry| filter.as_ref().is_none_or(|f| f.matches(e));
    let keep = |e: &HealthEntry| (!passing || e.all_passing()) && selected(e);
    // Which member of a sameness group answers: the first with instances left after the
    // read's filters, or (`sameness_before_health`) after its filters but health.
    let before_health = shared.with_faults(|f| f.sameness_before_health);
    let choose = |e: &HealthEntry| if before_health { selected(e) } else { keep(e) };
    let (watched, label) = if connect {
        let dest = connect_key(&key.name, &key.namespace, &key.partition);
        (Watched::Connect(dest), format!("{HEALTH_CONNECT_LABEL_PREFIX}{}", key.name))
    } else {
        (Watched::Service(origin.clone(), key.clone()), key.name.clone())
    };
    let read = |c: &Catalog| match &watched {
        Watched::Connect(dest) => {
            let mut entries = c.connect_health(dest, &tags);
            entries.retain(keep);
            entries
        }
        _ => c.origin_health(&origin, &key, &tags, choose, keep),
    };
    if cut_off.is_some() {
        wait_while_cut_off(shared, &opts).await;
    }
    let (index, mut entries, age) = match shared.cut_off() {
        // Cut off from its servers, the agent answers from its cache, as it was then.
        Some(cut) if cached => {
            let index = reported_index(&watched, &cut.catalog, quirks);
            (index, read(&cut.catalog), Some(cut.since.elapsed().as_secs()))
        }
        Some(_) => return Err(no_servers().into()),
        None => {
            let (index, entries) = ctx.block(&opts, &label, watched.clone(), quirks, read).await?;
            (index, entries, cached.then_some(0))
        }
    };
    let mut acl_filtered = false;
    if !identity.can_read_service(&key.name) {
        acl_filtered = !entries.is_empty();
        entries.clear();
    }
    let legacy = shared.with_faults(|f| f.null_variants);
    let body = render::health(&entries, legacy);
    let mut resp = ctx.read_ok_bytes(body, index, opts.consistency, acl_filtered);
    if let Some(age) = age {
        // The background-refreshed cache: a hit, 0 s old while the servers answer.
        resp.headers_mut().insert("x-cache", HeaderValue::from_static("HIT"));
        resp.headers_mut().insert("age", HeaderValue::from(age));
    }
    Ok(with_body_fault(resp, body_fault))
}

/// `?peer=` or `?sameness-group=` (never both); a sameness group must exist.
fn origin(shared: &Shared, p: &Params) -> Result<Origin, ApiError> {
    match (p.first_non_empty("peer"), p.first_non_empty("sameness-group")) {
        (Some(_), Some(_)) => Err(ApiError::bad_request("Cannot specify both peer and sameness-group")),
        (Some(peer), None) => Ok(Origin::Peer(peer.to_owned())),
        (None, Some(group)) if read_lock(&shared.catalog).has_sameness_group(group) => {
            Ok(Origin::Sameness(group.to_owned()))
        }
        (None, Some(group)) => Err(ApiError::bad_request(format!("sameness group {group:?} does not exist"))),
        (None, None) => Ok(Origin::Local),
    }
}

/// What an agent cut off from its servers answers anything its cache cannot.
fn no_servers() -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "No known Consul servers")
}

/// A blocking read answered from a cut-off agent's cache: nothing moves the cache's index,
/// so the read waits its whole wait, unless the servers come back first.
async fn wait_while_cut_off(shared: &Shared, opts: &ReadOptions) {
    if opts.index == 0 {
        return;
    }
    let deadline = tokio::time::Instant::now() + opts.wait;
    let mut changes = shared.changes.subscribe();
    while shared.cut_off().is_some() {
        tokio::select! {
            () = tokio::time::sleep_until(deadline) => return,
            changed = changes.changed() => if changed.is_err() { return },
        }
    }
}

/// What the `bad_body` and `truncated_body` faults do to a successful health read.
#[derive(Clone, Copy, PartialEq, Eq)]
enum BodyFault {
    NotJson,
    CutOff,
}

/// Takes one use of a body fault for this read, if any is active (checked with the other
/// read faults; the read then does not block).
fn take_body_fault(shared: &Shared) -> Option<BodyFault> {
    shared.with_faults(|f| {
        if f.truncated_body.take() {
            Some(BodyFault::CutOff)
        } else if f.bad_body.take() {
            Some(BodyFault::NotJson)
        } else {
            None
        }
    })
}

/// A read with a body fault answers at once, as a broken proxy or agent does, rather than
/// after blocking (a blocking query's answer may be minutes away).
fn without_blocking_if(faulty: bool, opts: ReadOptions) -> ReadOptions {
    if faulty { ReadOptions { index: 0, ..opts } } else { opts }
}

fn with_body_fault(mut resp: Resp, fault: Option<BodyFault>) -> Resp {
    match fault {
        None => {}
        Some(BodyFault::NotJson) => {
            let page = "<html><head><title>502 Bad Gateway</title></head><body>502 Bad Gateway</body></html>";
            *resp.body_mut() = Full::new(Bytes::from_static(page.as_bytes()));
            resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html"));
        }
        Some(BodyFault::CutOff) => {
            resp.extensions_mut().insert(CutOff);
        }
    }
    resp
}

/// The `no_leader` and `too_many_requests` faults of health reads (a 429 with `Retry-After`
/// when `retry_after_s` is set): checked after the
/// parameters, datacenter and token, before blocking.
fn inject_read_faults(shared: &Shared) -> Result<(), ApiError> {
    let injected = shared.with_faults(|f| {
        if f.too_many_requests.take() {
            let retry_after = (f.retry_after_s > 0).then_some(f.retry_after_s);
            Some(ApiError { retry_after, ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, "Too Many Requests") })
        } else if f.no_leader.take() {
            Some(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "No cluster leader"))
        } else {
            None
        }
    });
    match injected {
        Some(e) => {
            if e.status == StatusCode::TOO_MANY_REQUESTS {
                shared.count_injected_429();
            }
            Err(e)
        }
        None => Ok(()),
    }
}

/// `GET /v1/health/state/<state>`: every check in a state, blocking on the checks table index.
async fn health_state(ctx: &Ctx<'_>, raw_state: &str, headers: &HeaderMap) -> Handled {
    let shared = ctx.shared;
    let p = &ctx.params;
    let opts = parse_read_options(p)?;
    if p.first_non_empty("filter").is_some() {
        return Err(ApiError::bad_request(
            "Failed to create evaluator for expression: consul-sim does not implement ?filter",
        )
        .into());
    }
    let state = percent_decode(raw_state).ok_or_else(|| ApiError::bad_request("Invalid URL path encoding"))?;
    if state.is_empty() {
        return Err(ApiError::bad_request("Missing check state").into());
    }
    let quirks = shared.quirks();
    let filter = match StateFilter::parse(&state) {
        Some(f) => f,
        None if quirks.unknown_state_is_empty => StateFilter::Nothing,
        None => return Err(ApiError::bad_request("Invalid check state").into()),
    };
    check_datacenter(shared, p.first("dc"))?;
    let identity = ctx.identity()?;
    inject_read_faults(shared)?;

    let body_fault = take_body_fault(shared);
    let opts = without_blocking_if(body_fault.is_some(), opts);
    let ns = namespace(p, headers);
    let partition = p.first_non_empty("partition");
    let (index, mut entries) = ctx
        .block(&opts, HEALTH_STATE_LABEL, Watched::ChecksInState(filter), quirks, |c| {
            c.checks_in_state(filter, ns, partition)
        })
        .await?;
    // Every check of a large catalog is slow to write out; a few of one status are not.
    let slow = shared.with_faults(|f| f.checks_answer_ms);
    if slow > 0 && filter == StateFilter::Any {
        tokio::time::sleep(Duration::from_millis(slow)).await;
    }
    // Node checks are shown to everyone who may read at all (node rules are not modelled).
    let before = entries.len();
    entries.retain(|e| e.owner.as_ref().is_none_or(|o| identity.can_read_service(&o.key.name)));
    let legacy = shared.with_faults(|f| f.null_variants);
    let filtered = entries.len() != before;
    let body = shared.checks_body(entries, filter == StateFilter::Any, legacy);
    Ok(with_body_fault(ctx.read_ok_bytes(body, index, opts.consistency, filtered), body_fault))
}

async fn catalog_services(ctx: &Ctx<'_>, headers: &HeaderMap) -> Handled {
    let shared = ctx.shared;
    let p = &ctx.params;
    let opts = parse_read_options(p)?;
    check_datacenter(shared, p.first("dc"))?;
    let identity = ctx.identity()?;
    let ns = namespace(p, headers);
    let partition = p.first_non_empty("partition");
    let quirks = shared.quirks();
    let (index, mut services) = ctx
        .block(&opts, CATALOG_SERVICES_LABEL, Watched::CatalogServices, quirks, |c| c.services(ns, partition))
        .await?;
    let before = services.len();
    services.retain(|name, _| identity.can_read_service(name));
    let legacy = shared.with_faults(|f| f.null_variants);
    let body = render::services(&services, legacy);
    Ok(ctx.read_ok(&body, index, opts.consistency, services.len() != before))
}

/// `GET /v1/catalog/nodes`: every node, blocking on the nodes table index. Node rules are
/// not modelled: any token that resolves sees every node.
async fn catalog_nodes(ctx: &Ctx<'_>) -> Handled {
    let shared = ctx.shared;
    let opts = parse_read_options(&ctx.params)?;
    check_datacenter(shared, ctx.params.first("dc"))?;
    ctx.identity()?;
    let (index, nodes) = ctx.block(&opts, CATALOG_NODES_LABEL, Watched::Nodes, shared.quirks(), Catalog::nodes).await?;
    let legacy = shared.with_faults(|f| f.null_variants);
    Ok(ctx.read_ok_bytes(render::nodes(&nodes, legacy), index, opts.consistency, false))
}

/// `GET /v1/catalog/node-services/<node>` (Consul 1.7+): the node and its instances in the
/// namespace/partition, blocking on the later of the nodes' and services' table indexes;
/// instances of services the token may not read are left out. A node that does not exist
/// is `{"Node": null, "Services": null}` at index 1, as Consul 1.8 answers.
async fn node_services(ctx: &Ctx<'_>, raw_node: &str, headers: &HeaderMap) -> Handled {
    let shared = ctx.shared;
    let p = &ctx.params;
    let opts = parse_read_options(p)?;
    let node = percent_decode(raw_node).ok_or_else(|| ApiError::bad_request("Invalid URL path encoding"))?;
    if node.is_empty() {
        return Err(ApiError::bad_request("Missing node name").into());
    }
    check_datacenter(shared, p.first("dc"))?;
    let identity = ctx.identity()?;
    let (ns, partition) = (namespace(p, headers), p.first_non_empty("partition"));
    let label = format!("{NODE_SERVICES_LABEL_PREFIX}{node}");
    let watched = Watched::NodeServices(node.clone());
    let read = |c: &Catalog| c.node_with_services(&node, ns, partition);
    let (index, mut found) = ctx.block(&opts, &label, watched, shared.quirks(), read).await?;
    let mut filtered = false;
    if let Some((_, services)) = found.as_mut() {
        let before = services.len();
        services.retain(|s| identity.can_read_service(&s.key.name));
        filtered = services.len() != before;
    }
    let legacy = shared.with_faults(|f| f.null_variants);
    let body = render::node_services(found.as_ref().map(|(n, s)| (&**n, s.as_slice())), legacy);
    Ok(ctx.read_ok_bytes(body, index, opts.consistency, filtered))
}

async fn read_body<T: serde::de::DeserializeOwned>(req: Request<Incoming>) -> Result<T, ApiError> {
    let decode_failed = |e: &dyn std::fmt::Display| ApiError::bad_request(format!("Request decode failed: {e}"));
    let bytes = Limited::new(req.into_body(), 4 << 20).collect().await.map_err(|e| decode_failed(&e))?.to_bytes();
    serde_json::from_slice(&bytes).map_err(|e| decode_failed(&e))
}

/// Shared steps of the two writes: datacenter routing and the management-token check.
fn authorize_write(ctx: &Ctx<'_>, datacenter: Option<&str>) -> Result<(), ApiError> {
    check_datacenter(ctx.shared, datacenter)?;
    if !ctx.identity()?.can_write() {
        return Err(ApiError::new(StatusCode::FORBIDDEN, "Permission denied"));
    }
    Ok(())
}

async fn register(ctx: &Ctx<'_>, req: Request<Incoming>) -> Handled {
    let ns = namespace(&ctx.params, req.headers()).map(str::to_owned);
    let body: RegisterRequest = read_body(req).await?;
    authorize_write(ctx, body.datacenter.as_deref())?;
    let partition = ctx.params.first_non_empty("partition");
    ctx.shared.write_catalog(|c| c.register(body, ns.as_deref(), partition)).map_err(ApiError::from)?;
    Ok(plain_json(&Value::Bool(true)))
}

/// `PUT /v1/config`: a sameness group (the one config entry kind modelled).
async fn config_entry(ctx: &Ctx<'_>, req: Request<Incoming>) -> Handled {
    let entry: ConfigEntry = read_body(req).await?;
    authorize_write(ctx, None)?;
    ctx.shared.write_catalog(|c| c.set_config_entry(entry)).map_err(ApiError::from)?;
    Ok(plain_json(&Value::Bool(true)))
}

/// `GET /v1/config/sameness-group/<name>`: the group's entry (`Kind`, `Name`, `Members`
/// in order, the indexes), 404 for a group that does not exist.
fn sameness_group(ctx: &Ctx<'_>, path: &str) -> Handled {
    ctx.identity()?;
    let raw = path.trim_start_matches("/v1/config/sameness-group/");
    let name = percent_decode(raw).ok_or_else(|| ApiError::bad_request("Invalid URL path encoding"))?;
    let catalog = read_lock(&ctx.shared.catalog);
    let Some((members, index)) = catalog.sameness_group(&name) else {
        let message = format!("Config entry not found for \"sameness-group\" / \"{name}\"");
        return Err(ApiError::new(StatusCode::NOT_FOUND, message).into());
    };
    let entry = serde_json::json!({
        "Kind": "sameness-group", "Name": name, "Members": members,
        "CreateIndex": index, "ModifyIndex": index,
    });
    Ok(plain_json(&entry))
}

/// `GET /v1/agent/self`, reduced to what clients read: the agent's version and datacenter.
fn agent_self(ctx: &Ctx<'_>) -> Resp {
    let version = if ctx.shared.quirks().ignores_newer_parameters { "0.9.3" } else { "1.21.4" };
    let datacenter = &ctx.shared.config.datacenter;
    plain_json(&serde_json::json!({
        "Config": {"Datacenter": datacenter, "NodeName": "consul-sim", "Version": version},
        "Member": {"Name": "consul-sim", "Addr": "127.0.0.1"},
    }))
}

async fn deregister(ctx: &Ctx<'_>, req: Request<Incoming>) -> Handled {
    let body: DeregisterRequest = read_body(req).await?;
    authorize_write(ctx, body.datacenter.as_deref())?;
    ctx.shared.write_catalog(|c| c.deregister(body)).map_err(ApiError::from)?;
    Ok(plain_json(&Value::Bool(true)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("web%20api").as_deref(), Some("web api"));
        assert_eq!(percent_decode("plain").as_deref(), Some("plain"));
        assert_eq!(percent_decode("bad%2"), None);
        assert_eq!(percent_decode("bad%zz"), None);
        assert_eq!(percent_decode("%ff"), None);
    }

    #[test]
    fn bool_flags_follow_go() {
        let p = Params::parse("passing&b=true&c=0&d=yes&e=");
        assert_eq!(p.bool_flag("passing"), Ok(true));
        assert_eq!(p.bool_flag("b"), Ok(true));
        assert_eq!(p.bool_flag("c"), Ok(false));
        assert_eq!(p.bool_flag("d"), Err(()));
        assert_eq!(p.bool_flag("e"), Ok(true));
        assert_eq!(p.bool_flag("absent"), Ok(false));
    }

    #[test]
    fn gzipped_answers_read_back_whatever_came_before() {
        use std::io::Read as _;
        // The compressor is kept per thread: each answer must be whole on its own, after a
        // large one, an empty one and a small one alike.
        let large: Vec<u8> = (0..3_000_000u32).flat_map(|i| (i % 251).to_le_bytes()).collect();
        for body in [&large[..], b"", b"[]", &large[..1000], b"{\"a\":1}"] {
            let gz = gzipped(body).unwrap();
            let mut back = Vec::new();
            flate2::read::GzDecoder::new(&gz[..]).read_to_end(&mut back).unwrap();
            assert_eq!(back, body);
        }
    }

    #[test]
    fn gzip_negotiation() {
        let mut h = HeaderMap::new();
        assert!(!accepts_gzip(&h));
        h.insert(header::ACCEPT_ENCODING, HeaderValue::from_static("br, GZIP;q=0.5"));
        assert!(accepts_gzip(&h));
        h.insert(header::ACCEPT_ENCODING, HeaderValue::from_static("gzip;q=0"));
        assert!(!accepts_gzip(&h));
    }

    #[test]
    fn read_options() {
        let ok = |q: &str| parse_read_options(&Params::parse(q)).map_err(|e| e.status);
        assert_eq!(ok("").unwrap().wait, super::super::duration::DEFAULT_WAIT);
        assert_eq!(ok("wait=").unwrap().wait, super::super::duration::DEFAULT_WAIT);
        assert_eq!(ok("wait=20m").unwrap().wait, super::super::duration::MAX_WAIT);
        assert_eq!(ok("wait=1m30s&index=7").unwrap().index, 7);
        assert_eq!(ok("wait=10").err(), Some(StatusCode::BAD_REQUEST));
        assert_eq!(ok("index=+5").err(), Some(StatusCode::BAD_REQUEST));
        assert_eq!(ok("index=-1").err(), Some(StatusCode::BAD_REQUEST));
        assert_eq!(ok("index=x").err(), Some(StatusCode::BAD_REQUEST));
        assert_eq!(ok("stale&consistent").err(), Some(StatusCode::BAD_REQUEST));
        assert_eq!(ok("cached&consistent").err(), Some(StatusCode::BAD_REQUEST));
        assert_eq!(ok("stale").unwrap().consistency, "stale");
    }
}
