//! The ops HTTP server, on `--listen`: `/metrics`, `/healthz`, `/readyz`, and the snapshots
//! the HTTP publisher keeps (`/snapshot`, `/snapshots/<id>`). The routes are here; what a
//! connection may hold is in [`server`].

pub(crate) mod body;
pub(crate) mod health;
pub(crate) mod server;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use consul_resolver_core::assembler::snapshot::Snapshot;
use hyper::body::Incoming;
use hyper::header::HeaderValue;
use hyper::{Request, Response, StatusCode};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::publishers::http::{Body, KEPT, SnapshotStore};
use crate::vitals::Vitals;
use body::ResponseBody;
use health::Heartbeat;
use server::{ServerMetrics, Waiting};

/// The Prometheus text of every metric, at the moment of the scrape.
pub(crate) type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// Shared state the server reads.
#[derive(Clone)]
pub(crate) struct ServerState {
    pub store: Arc<SnapshotStore>,
    /// Renders every metric for `/metrics` (the process's registry, held by the runtime).
    pub render: Render,
    /// The server's own connection metrics.
    pub server_metrics: ServerMetrics,
    /// Ready once a snapshot was published (and, with leader election, also on
    /// standbys: readiness means "can serve", not "is leader").
    pub ready: Arc<std::sync::atomic::AtomicBool>,
    /// Beaten by the event loop; `/healthz` fails when it is older than `heartbeat_timeout`.
    pub heartbeat: Arc<Heartbeat>,
    pub heartbeat_timeout: Duration,
    /// The background tasks; `/healthz` fails when one ended before shutdown.
    pub vitals: Arc<Vitals>,
    /// Older snapshots being inflated for readers that do not take gzip: at most
    /// [`MAX_INFLATING`] at once (each a CPU for as long as its reader takes).
    pub inflating: Arc<tokio::sync::Semaphore>,
    /// The xDS server, with `--xds-listen`: `/xds/clients` lists its clients.
    pub xds: Option<consul_resolver_xds::XdsServer>,
}

/// Most older snapshots inflated at once for readers that do not take gzip; the next gets
/// 503 with `Retry-After`.
pub(crate) const MAX_INFLATING: usize = 2;

fn respond(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<ResponseBody> {
    respond_with(status, content_type, ResponseBody::from(body.into()))
}

fn respond_with(status: StatusCode, content_type: &str, body: ResponseBody) -> Response<ResponseBody> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(body)
        .expect("static response parts are valid")
}

/// The latest snapshot's entity tag: its content hash, weak because two snapshots of one
/// content differ in their `id` (as do the replicas'), which a reader holding either needs
/// no more of.
fn entity_tag(snapshot: &Snapshot) -> HeaderValue {
    HeaderValue::from_str(&format!("W/\"{}\"", snapshot.hash)).expect("a content hash is a valid header value")
}

/// Whether the request's `If-None-Match` names `tag` (or is `*`), compared weakly as RFC
/// 9110 says for it: the reader has this content already.
fn has_it(req: &Request<Incoming>, tag: &HeaderValue) -> bool {
    // The tag without its weakness: what the weak comparison compares.
    fn opaque(t: &str) -> &str {
        t.trim().trim_start_matches("W/")
    }
    let ours = opaque(tag.to_str().unwrap_or_default());
    req.headers()
        .get_all(hyper::header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim() == "*" || opaque(t) == ours)
}

/// `/snapshot`'s answer: the latest document, with its `tag`, or `304 Not Modified` to a
/// reader that has its content (`If-None-Match`), so that polling an unchanged snapshot
/// costs a few hundred bytes, not the document (55 MB at the scale profile).
fn latest(snapshot: Arc<Snapshot>, tag: HeaderValue, reader_has_it: bool) -> Response<ResponseBody> {
    let mut resp = if reader_has_it {
        let mut resp = Response::new(ResponseBody::from(Bytes::new()));
        *resp.status_mut() = StatusCode::NOT_MODIFIED;
        resp
    } else {
        respond_with(StatusCode::OK, "application/json", ResponseBody::document(snapshot))
    };
    let headers = resp.headers_mut();
    headers.insert(hyper::header::ETAG, tag);
    // The latest changes at any moment: a cache in between must ask again every time.
    headers.insert(hyper::header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

/// Whether the client takes a gzip body (`Accept-Encoding: gzip`).
fn accepts_gzip(req: &Request<Incoming>) -> bool {
    req.headers()
        .get_all(hyper::header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|e| e.trim().split(';').next().is_some_and(|name| name.trim() == "gzip"))
}

/// The longest a reader is held (`?wait=`), as Consul caps its blocking queries: longer asks
/// are held this long.
const MAX_WAIT: Duration = Duration::from_secs(300);

/// `?wait=` as a duration: a number and `ms`, `s` or `m` (`500ms`, `30s`, `5m`), at most
/// [`MAX_WAIT`]. `None` without one.
fn wait(req: &Request<Incoming>) -> Result<Option<Duration>, String> {
    let Some(value) = req.uri().query().into_iter().flat_map(|q| q.split('&')).find_map(|p| p.strip_prefix("wait="))
    else {
        return Ok(None);
    };
    let bad = || format!("wait must be a duration such as 500ms, 30s or 5m, not {value:?}\n");
    let split = value.find(|c: char| !c.is_ascii_digit() && c != '.').ok_or_else(bad)?;
    let (number, unit) = value.split_at(split);
    let number: f64 = number.parse().map_err(|_| bad())?;
    let seconds = match unit {
        "ms" => number / 1000.0,
        "s" => number,
        "m" => number * 60.0,
        _ => return Err(bad()),
    };
    Ok(Some(Duration::try_from_secs_f64(seconds).map_err(|_| bad())?.min(MAX_WAIT)))
}

/// The Envoys connected over xDS: node id, what each ACKed, its last NACK
/// (docs/xds.md, "Operating it"). 404 without `--xds-listen`.
fn xds_clients(state: &ServerState) -> Response<ResponseBody> {
    let Some(xds) = &state.xds else {
        return respond(StatusCode::NOT_FOUND, "text/plain", "xDS is not served (--xds-listen)\n");
    };
    let body = serde_json::json!({"upstreams": xds.upstreams(), "clients": xds.clients(), "leftOut": xds.rejections()});
    respond(StatusCode::OK, "application/json", serde_json::to_vec_pretty(&body).expect("JSON of plain values"))
}

/// `/snapshot`, held with `?wait=` until there is a snapshot the reader does not have (the
/// first one; one whose content differs from `If-None-Match`) or the wait ends, as a Consul
/// blocking query is: a reader follows the snapshots with one request per change and sees
/// each as soon as it is published.
async fn follow(state: &ServerState, req: &Request<Incoming>, waiting: Waiting) -> Response<ResponseBody> {
    let until = match wait(req) {
        Ok(w) => w.map(|w| tokio::time::Instant::now() + w),
        Err(e) => return respond(StatusCode::BAD_REQUEST, "text/plain", e),
    };
    loop {
        let published = state.store.published();
        tokio::pin!(published);
        // Enabled before the look: a snapshot pushed after it wakes the wait.
        published.as_mut().enable();
        // The latest, its tag, and whether the reader has its content.
        let look = state.store.latest().map(|s| {
            let tag = entity_tag(&s);
            let has = has_it(req, &tag);
            (s, tag, has)
        });
        let new = look.as_ref().is_some_and(|(_, _, has)| !has);
        if let Some(until) = until.filter(|_| !new)
            && waiting.idle_while(tokio::time::timeout_at(until, published)).await.is_ok()
        {
            // Published since the look: look again.
            continue;
        }
        // Something new, no wait asked, or the wait's end with nothing published since the
        // look (so what it saw is still the latest).
        return match look {
            Some((s, tag, has)) => latest(s, tag, has),
            None => respond(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "no snapshot published yet\n"),
        };
    }
}

async fn route(state: ServerState, req: Request<Incoming>, waiting: Waiting) -> Response<ResponseBody> {
    if req.method() != hyper::Method::GET {
        return respond(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "only GET\n");
    }
    let path = req.uri().path();
    match path {
        "/healthz" => match state
            .heartbeat
            .check(tokio::time::Instant::now(), state.heartbeat_timeout)
            .and_then(|()| state.vitals.check())
        {
            Ok(()) => respond(StatusCode::OK, "text/plain", "ok\n"),
            Err(why) => respond(StatusCode::SERVICE_UNAVAILABLE, "text/plain", format!("{why}\n")),
        },
        "/readyz" if state.ready.load(std::sync::atomic::Ordering::Relaxed) => {
            respond(StatusCode::OK, "text/plain", "ok\n")
        }
        "/readyz" => respond(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "no snapshot published yet\n"),
        "/metrics" => respond(StatusCode::OK, "text/plain; version=0.0.4", (state.render)()),
        "/snapshot" => follow(&state, &req, waiting).await,
        "/xds/clients" => xds_clients(&state),
        _ => match path.strip_prefix("/snapshots/").map(str::parse::<u64>) {
            Some(Ok(id)) => match state.store.get(id) {
                Some(Body::Latest(s)) => respond_with(StatusCode::OK, "application/json", ResponseBody::document(s)),
                Some(Body::Json(b)) => respond(StatusCode::OK, "application/json", b),
                Some(Body::Gzip(gz)) if accepts_gzip(&req) => {
                    let mut resp = respond(StatusCode::OK, "application/json", gz.to_bytes());
                    resp.headers_mut().insert("content-encoding", hyper::header::HeaderValue::from_static("gzip"));
                    resp
                }
                // Tens of megabytes at scale: inflated as it is sent, on a blocking thread,
                // a few at once; a reader beyond those is told to come back.
                Some(Body::Gzip(gz)) => match state.inflating.clone().try_acquire_owned() {
                    Ok(permit) => {
                        respond_with(StatusCode::OK, "application/json", ResponseBody::inflating(gz.to_bytes(), permit))
                    }
                    Err(_) => {
                        let mut resp = respond(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "text/plain",
                            format!(
                                "{MAX_INFLATING} older snapshots are being inflated for readers without gzip: retry, or send Accept-Encoding: gzip\n"
                            ),
                        );
                        resp.headers_mut().insert("retry-after", HeaderValue::from_static("1"));
                        resp
                    }
                },
                None => respond(
                    StatusCode::NOT_FOUND,
                    "text/plain",
                    format!("snapshot {id} is not among the last {KEPT}\n"),
                ),
            },
            Some(Err(_)) => respond(StatusCode::BAD_REQUEST, "text/plain", "snapshot id must be a number\n"),
            None => respond(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
        },
    }
}

/// Binds `addr` and serves until `shutdown`, within `limits`. Returns the bound address
/// (for `:0`).
pub(crate) async fn serve(
    addr: SocketAddr,
    state: ServerState,
    limits: server::Limits,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let metrics = state.server_metrics.clone();
    let vitals = state.vitals.clone();
    let handle = move |req: Request<Incoming>, waiting| route(state.clone(), req, waiting);
    let task = tokio::spawn(vitals.watch("ops server", server::run(listener, limits, metrics, shutdown, handle)));
    Ok((bound, task))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let resp = reqwest::Client::new().get(format!("http://{addr}{path}")).send().await.unwrap();
        (resp.status().as_u16(), resp.text().await.unwrap())
    }

    /// The wiring: `/healthz` answers from the heartbeat the loop beats.
    #[tokio::test]
    async fn healthz_fails_with_the_reason_when_the_heartbeat_is_stale() {
        let timeout = Duration::from_secs(60);
        let heartbeat = Arc::new(Heartbeat::new(tokio::time::Instant::now()));
        let vitals = Vitals::new(CancellationToken::new());
        let registry = prometheus::Registry::new();
        let state = ServerState {
            store: Arc::default(),
            render: test_render(&registry),
            server_metrics: ServerMetrics::register(&registry).unwrap(),
            ready: Arc::default(),
            heartbeat: heartbeat.clone(),
            heartbeat_timeout: timeout,
            vitals: vitals.clone(),
            inflating: Arc::new(tokio::sync::Semaphore::new(crate::ops::MAX_INFLATING)),
            xds: None,
        };
        let shutdown = CancellationToken::new();
        let (addr, task) =
            serve("127.0.0.1:0".parse().unwrap(), state, server::Limits::DEFAULT, shutdown.clone()).await.unwrap();
        assert_eq!(get(addr, "/healthz").await, (200, "ok\n".to_owned()));
        // The loop's last beat two minutes ago: wedged.
        heartbeat.beat(tokio::time::Instant::now() - Duration::from_secs(120));
        let (status, body) = get(addr, "/healthz").await;
        assert_eq!(status, 503);
        assert!(body.contains("the event loop has not turned for 2m"), "{body}");
        assert_eq!(get(addr, "/readyz").await.0, 503, "readiness is its own question");
        heartbeat.beat(tokio::time::Instant::now());
        assert_eq!(get(addr, "/healthz").await.0, 200);
        // A background task gone: unhealthy, and says which.
        tokio::spawn(vitals.watch("status controller", async {})).await.unwrap();
        let (status, body) = get(addr, "/healthz").await;
        assert_eq!(status, 503);
        assert!(body.contains("the status controller task returned"), "{body}");
        shutdown.cancel();
        task.await.unwrap();
    }

    /// The server's metrics in a registry of their own, rendered as `/metrics` renders.
    fn test_render(registry: &prometheus::Registry) -> Render {
        let registry = registry.clone();
        Arc::new(move || {
            let mut buf = Vec::new();
            prometheus::Encoder::encode(&prometheus::TextEncoder::new(), &registry.gather(), &mut buf).unwrap();
            String::from_utf8(buf).unwrap()
        })
    }

    fn state() -> ServerState {
        let registry = prometheus::Registry::new_custom(Some("consul_resolver".into()), None).unwrap();
        ServerState {
            store: Arc::default(),
            render: test_render(&registry),
            server_metrics: ServerMetrics::register(&registry).unwrap(),
            ready: Arc::default(),
            heartbeat: Arc::new(Heartbeat::new(tokio::time::Instant::now())),
            heartbeat_timeout: Duration::from_secs(60),
            vitals: Vitals::new(CancellationToken::new()),
            inflating: Arc::new(tokio::sync::Semaphore::new(crate::ops::MAX_INFLATING)),
            xds: None,
        }
    }

    /// The server on a loopback port of its own, with [`state`], within `limits`.
    struct Serving {
        state: ServerState,
        addr: SocketAddr,
        shutdown: CancellationToken,
        task: tokio::task::JoinHandle<()>,
    }

    impl Serving {
        async fn start(limits: server::Limits) -> Serving {
            let _ = rustls::crypto::ring::default_provider().install_default();
            let (state, shutdown) = (state(), CancellationToken::new());
            let (addr, task) =
                serve("127.0.0.1:0".parse().unwrap(), state.clone(), limits, shutdown.clone()).await.unwrap();
            Serving { state, addr, shutdown, task }
        }

        async fn stop(self) {
            self.shutdown.cancel();
            self.task.await.unwrap();
        }
    }

    fn sample(text: &str, series: &str) -> f64 {
        let line = text.lines().find(|l| l.starts_with(series)).unwrap_or_else(|| panic!("no {series} in {text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }

    /// `GET /snapshot?{query}`, with `If-None-Match` when given: status, ETag and body.
    async fn snapshot(addr: SocketAddr, query: &str, if_none_match: Option<String>) -> (u16, Option<String>, Bytes) {
        let mut req = reqwest::Client::new().get(format!("http://{addr}/snapshot?{query}"));
        if let Some(tag) = if_none_match {
            req = req.header("if-none-match", tag);
        }
        let resp = req.send().await.unwrap();
        let (status, tag) = (resp.status().as_u16(), resp.headers().get("etag").cloned());
        (status, tag.map(|t| t.to_str().unwrap().to_owned()), resp.bytes().await.unwrap())
    }

    /// `/snapshot` carries its content hash as a weak entity tag: a reader that has the
    /// content (`If-None-Match`) gets `304` and no body, from a later snapshot of the same
    /// content too; a new content is sent whole, with its own tag.
    #[tokio::test]
    async fn a_reader_that_has_the_content_gets_not_modified() {
        let server = Serving::start(server::Limits::DEFAULT).await;
        let (state, addr) = (&server.state, server.addr);
        let get = |if_none_match: Option<String>| snapshot(addr, "", if_none_match);
        let first = Arc::new(crate::test_fixtures::content(vec![]).into_snapshot(1));
        state.store.push(&first);
        let (status, tag, body) = get(None).await;
        let tag = tag.expect("an ETag");
        assert_eq!((status, tag.as_str()), (200, format!("W/\"{}\"", first.hash).as_str()));
        assert_eq!(Snapshot::parse(&body).unwrap().id, 1);
        for has in [tag.clone(), format!("\"{}\"", first.hash), format!("W/\"sha256:other\", {tag}"), "*".into()] {
            let (status, again, body) = get(Some(has.clone())).await;
            assert_eq!((status, again.as_deref(), body.len()), (304, Some(tag.as_str()), 0), "If-None-Match: {has}");
        }
        assert_eq!(get(Some("W/\"sha256:other\"".into())).await.0, 200);
        // The same content again, as snapshot 2: the reader has it.
        state.store.push(&Arc::new(crate::test_fixtures::content(vec![]).into_snapshot(2)));
        assert_eq!(get(Some(tag.clone())).await.0, 304);
        // A new content: whole, with its own tag.
        let mut changed = crate::test_fixtures::content(vec![]);
        changed.bootstrap.complete = false;
        let third = Arc::new(changed.into_snapshot(3));
        state.store.push(&third);
        let (status, new_tag, body) = get(Some(tag.clone())).await;
        assert_eq!((status, new_tag), (200, Some(format!("W/\"{}\"", third.hash))));
        assert_eq!(Snapshot::parse(&body).unwrap().id, 3);
        server.stop().await;
    }

    /// Waits until `series` reads `value` in the server's metrics; panics past 5 s.
    async fn until_metric(state: &ServerState, series: &str, value: f64) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while sample(&(state.render)(), series) != value {
            assert!(tokio::time::Instant::now() < deadline, "{series} never reached {value}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// `?wait=` holds a reader until there is a snapshot it does not have: the first one,
    /// then (with `If-None-Match`) a new content, not the same content again; at the wait's
    /// end it gets what there is (503 before any snapshot, 304 for the content it has).
    #[tokio::test]
    async fn a_held_reader_gets_the_next_content_as_it_is_published() {
        let server = Serving::start(server::Limits::DEFAULT).await;
        let (state, addr) = (&server.state, server.addr);
        let get =
            |query: &'static str, if_none_match: Option<&str>| snapshot(addr, query, if_none_match.map(str::to_owned));
        let waiting = "consul_resolver_ops_requests_waiting ";
        assert_eq!(get("wait=50ms", None).await.0, 503, "no snapshot within the wait");
        let (status, _, body) = get("wait=5x", None).await;
        assert_eq!(status, 400);
        assert!(String::from_utf8_lossy(&body).contains("such as 500ms, 30s or 5m"), "{body:?}");

        // Held for the first snapshot.
        let first = tokio::spawn(get("wait=60s", None));
        until_metric(state, waiting, 1.0).await;
        state.store.push(&Arc::new(crate::test_fixtures::content(vec![]).into_snapshot(1)));
        let (status, tag, body) = first.await.unwrap();
        assert_eq!((status, Snapshot::parse(&body).unwrap().id), (200, 1));
        let tag = tag.unwrap();
        until_metric(state, waiting, 0.0).await;

        // Held past a snapshot of the same content, answered by the next new one.
        let mut next = tokio::spawn(get("wait=60s", Some(&tag)));
        until_metric(state, waiting, 1.0).await;
        state.store.push(&Arc::new(crate::test_fixtures::content(vec![]).into_snapshot(2)));
        // Still held after the same content (the waiter is woken and looks again): no
        // answer within a while.
        let early = tokio::time::timeout(Duration::from_millis(300), &mut next).await;
        assert!(early.is_err(), "answered for a content the reader has: {early:?}");
        let mut changed = crate::test_fixtures::content(vec![]);
        changed.bootstrap.complete = false;
        state.store.push(&Arc::new(changed.into_snapshot(3)));
        let (status, new_tag, body) = next.await.unwrap();
        assert_eq!((status, Snapshot::parse(&body).unwrap().id), (200, 3));
        assert_ne!(new_tag.as_deref(), Some(tag.as_str()));

        // The wait ends with nothing new: 304, no body.
        let (status, _, body) = get("wait=50ms", new_tag.as_deref()).await;
        assert_eq!((status, body.len()), (304, 0));
        server.stop().await;
    }

    /// Held readers never keep a probe out: a held request's connection counts as idle, so
    /// with every connection held, a probe closes the one held longest and is answered.
    #[tokio::test]
    async fn held_readers_make_room_for_probes() {
        let server =
            Serving::start(server::Limits { max_connections: 4, header_timeout: Duration::from_secs(600) }).await;
        let (state, addr) = (&server.state, server.addr);
        let held: Vec<_> = (0..4)
            .map(|_| {
                tokio::spawn(async move {
                    let client = reqwest::Client::new();
                    client.get(format!("http://{addr}/snapshot?wait=60s")).send().await.map(|r| r.status().as_u16())
                })
            })
            .collect();
        until_metric(state, "consul_resolver_ops_requests_waiting ", 4.0).await;
        let answered = tokio::time::timeout(Duration::from_secs(5), get(addr, "/healthz")).await;
        assert_eq!(answered.expect("a probe is answered behind four held readers").0, 200);
        let mut closed = 0;
        for h in held {
            if let Ok(Ok(Err(_))) = tokio::time::timeout(Duration::from_millis(200), h).await {
                closed += 1;
            }
        }
        assert_eq!(closed, 1, "one held reader made room");
        let text = (state.render)();
        assert_eq!(sample(&text, "consul_resolver_ops_connections_closed_total{reason=\"evicted\"}"), 1.0, "{text}");
        server.stop().await;
    }

    /// Reads until the server closes the connection (EOF or reset); `false` past `within`.
    async fn closed_within(stream: &mut tokio::net::TcpStream, within: Duration) -> bool {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 1024];
        tokio::time::timeout(within, async {
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await
        .is_ok()
    }

    /// The server's connections have TCP_NODELAY: a snapshot's reader does not wait on
    /// Nagle for the rest of an answer.
    #[tokio::test]
    async fn connections_have_tcp_nodelay() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let server = Serving::start(server::Limits::DEFAULT).await;
        let addr = server.addr;
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(b"GET /healthz HTTP/1.1\r\nhost: ops\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 64];
        let n = stream.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", String::from_utf8_lossy(&buf[..n]));
        // The server's end: from its address to this one.
        let nodelay = crate::test_fixtures::tcp_nodelay(addr, stream.local_addr().unwrap());
        assert_eq!(nodelay, Some(true));
        server.stop().await;
    }

    /// More idle connections than the cap: the longest idle are closed to make room, and a
    /// probe that comes after all of them is answered at once.
    #[tokio::test]
    async fn a_flood_of_idle_connections_makes_room_for_probes_by_closing_the_longest_idle() {
        let server =
            Serving::start(server::Limits { max_connections: 16, header_timeout: Duration::from_secs(600) }).await;
        let (state, addr) = (&server.state, server.addr);
        let mut idle = Vec::new();
        for _ in 0..100 {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        for path in ["/healthz", "/metrics"] {
            let answered = tokio::time::timeout(Duration::from_secs(5), get(addr, path)).await;
            assert_eq!(answered.expect("answered within 5 s behind 100 idle connections").0, 200, "{path}");
        }
        assert!(closed_within(&mut idle[0], Duration::from_secs(5)).await, "the first idle connection was closed");
        let text = (state.render)();
        assert!(sample(&text, "consul_resolver_ops_connections ") <= 16.0, "{text}");
        assert!(sample(&text, "consul_resolver_ops_connections_closed_total{reason=\"evicted\"}") >= 84.0, "{text}");
        server.stop().await;
    }

    /// A client that sends its request head a byte at a time is cut off at the header
    /// timeout, and so is a kept-alive connection left idle after its request.
    #[tokio::test]
    async fn a_slow_header_client_and_an_idle_kept_alive_connection_are_cut_off() {
        use tokio::io::AsyncWriteExt;
        let server =
            Serving::start(server::Limits { max_connections: 16, header_timeout: Duration::from_millis(500) }).await;
        let (state, addr) = (&server.state, server.addr);

        let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET /metrics HTTP/1.1\r\n").await.unwrap();
        let dribble = async {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if slow.write_all(b"X").await.is_err() {
                    return;
                }
            }
        };
        let cut = tokio::time::timeout(Duration::from_secs(5), dribble).await;
        assert!(cut.is_ok(), "a byte every 100 ms keeps no connection past the 500 ms header timeout");

        let mut kept = tokio::net::TcpStream::connect(addr).await.unwrap();
        kept.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        assert!(closed_within(&mut kept, Duration::from_secs(5)).await, "idle after its answer: closed");

        let text = (state.render)();
        assert!(
            sample(&text, "consul_resolver_ops_connections_closed_total{reason=\"header_timeout\"}") >= 2.0,
            "{text}"
        );
        assert_eq!(get(addr, "/healthz").await.0, 200);
        server.stop().await;
    }

    /// An older snapshot, kept gzipped, is inflated as it is sent to a reader that does not
    /// take gzip, at most [`MAX_INFLATING`] at once: the next reader is told to come back
    /// (503, `Retry-After`), and served once one is done.
    #[tokio::test]
    async fn older_snapshots_are_inflated_a_few_at_once() {
        let serving = Serving::start(server::Limits::DEFAULT).await;
        let mut big = crate::test_fixtures::content(vec![]);
        big.problems = (0..2_000)
            .map(|i| consul_resolver_core::assembler::snapshot::Problem {
                kind: "Mapping".into(),
                namespace: "shop".into(),
                name: format!("m{i:05}"),
                message: "resolver \"nope\": no ConsulResolver of that name in shop".into(),
            })
            .collect();
        let first = Arc::new(big.clone().into_snapshot(1));
        serving.state.store.push(&first);
        serving.state.store.push(&Arc::new(big.into_snapshot(2)));
        assert!(matches!(serving.state.store.get(1), Some(Body::Gzip(_))), "kept gzipped");
        let url = format!("http://{}/snapshots/1", serving.addr);

        let busy = serving.state.inflating.clone().acquire_many_owned(MAX_INFLATING as u32).await.unwrap();
        let resp = reqwest::Client::new().get(&url).send().await.unwrap();
        assert_eq!(resp.status().as_u16(), 503);
        assert_eq!(resp.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned()), Some("1".into()));
        drop(busy);
        let resp = reqwest::Client::new().get(&url).send().await.unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        assert!(resp.headers().get("content-encoding").is_none());
        assert_eq!(resp.bytes().await.unwrap(), first.to_json(), "the document, whole");
        // Its permit went with the body.
        assert_eq!(serving.state.inflating.available_permits(), MAX_INFLATING);
        serving.stop().await;
    }
}
