//! The HTTP endpoint: `/snapshot` (latest), `/snapshots/<id>` (the last few), plus the
//! operator's `/metrics`, `/healthz` and `/readyz`, on one port.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::Publisher;
use crate::metrics::Metrics;
use consul_resolver_core::assembler::Snapshot;

/// How many snapshots `/snapshots/<id>` keeps.
pub(crate) const KEPT: usize = 10;

/// The latest snapshots, as the bytes served: the latest as published (the same bytes
/// every publisher writes), older ones gzipped, so keeping ten costs about one.
#[derive(Default)]
pub(crate) struct SnapshotStore {
    kept: Mutex<VecDeque<(u64, Body)>>,
}

/// A kept snapshot's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Body {
    Json(Bytes),
    Gzip(Bytes),
}

/// Snapshots smaller than this stay uncompressed in the history (not worth it).
const COMPRESS_FROM: usize = 16 * 1024;

impl SnapshotStore {
    pub(crate) fn push(&self, snapshot: &Snapshot) {
        let mut kept = self.kept.lock().expect("store lock");
        if let Some((_, body)) = kept.back_mut()
            && let Body::Json(json) = body
            && json.len() >= COMPRESS_FROM
        {
            *body = Body::Gzip(Bytes::from(super::gzip(json)));
        }
        kept.push_back((snapshot.id, Body::Json(snapshot.to_json())));
        while kept.len() > KEPT {
            kept.pop_front();
        }
    }

    pub(crate) fn latest(&self) -> Option<Bytes> {
        match self.kept.lock().expect("store lock").back() {
            Some((_, Body::Json(json))) => Some(json.clone()),
            _ => None,
        }
    }

    pub(crate) fn get(&self, id: u64) -> Option<Body> {
        self.kept.lock().expect("store lock").iter().find(|(i, _)| *i == id).map(|(_, b)| b.clone())
    }
}

/// Publishing to HTTP is keeping the snapshot for the server.
pub(crate) struct HttpPublisher(pub Arc<SnapshotStore>);

impl Publisher for HttpPublisher {
    fn name(&self) -> &'static str {
        "http"
    }
    fn publish(&self, snapshot: Arc<Snapshot>) -> BoxFuture<'static, Result<(), String>> {
        self.0.push(&snapshot);
        futures::future::ready(Ok(())).boxed()
    }
}

/// Shared state the server reads.
#[derive(Clone)]
pub(crate) struct ServerState {
    pub store: Arc<SnapshotStore>,
    pub metrics: Metrics,
    /// Ready once a snapshot was published (and, with leader election, also on
    /// standbys: readiness means "can serve", not "is leader").
    pub ready: Arc<std::sync::atomic::AtomicBool>,
}

fn respond(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(body.into()))
        .expect("static response parts are valid")
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

fn route(state: &ServerState, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != hyper::Method::GET {
        return respond(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "only GET\n");
    }
    let path = req.uri().path();
    match path {
        "/healthz" => respond(StatusCode::OK, "text/plain", "ok\n"),
        "/readyz" if state.ready.load(std::sync::atomic::Ordering::Relaxed) => {
            respond(StatusCode::OK, "text/plain", "ok\n")
        }
        "/readyz" => respond(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "no snapshot published yet\n"),
        "/metrics" => respond(StatusCode::OK, "text/plain; version=0.0.4", state.metrics.render()),
        "/snapshot" => match state.store.latest() {
            Some(b) => respond(StatusCode::OK, "application/json", b),
            None => respond(StatusCode::SERVICE_UNAVAILABLE, "text/plain", "no snapshot published yet\n"),
        },
        _ => match path.strip_prefix("/snapshots/").map(str::parse::<u64>) {
            Some(Ok(id)) => match state.store.get(id) {
                Some(Body::Json(b)) => respond(StatusCode::OK, "application/json", b),
                Some(Body::Gzip(gz)) if accepts_gzip(req) => {
                    let mut resp = respond(StatusCode::OK, "application/json", gz);
                    resp.headers_mut().insert("content-encoding", hyper::header::HeaderValue::from_static("gzip"));
                    resp
                }
                Some(Body::Gzip(gz)) => match super::gunzip(&gz) {
                    Ok(json) => respond(StatusCode::OK, "application/json", json),
                    Err(e) => respond(StatusCode::INTERNAL_SERVER_ERROR, "text/plain", format!("{e}\n")),
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

/// Binds `addr` and serves until `shutdown`. Returns the bound address (for `:0`).
pub(crate) async fn serve(
    addr: SocketAddr,
    state: ServerState,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let (stream, _) = tokio::select! {
                _ = shutdown.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        continue;
                    }
                },
            };
            let state = state.clone();
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let resp = route(&state, &req);
                async move { Ok::<_, Infallible>(resp) }
            });
            tokio::spawn(async move {
                let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                if let Err(e) = builder.serve_connection(TokioIo::new(stream), service).await {
                    tracing::debug!(error = %e, "http connection ended with an error");
                }
            });
        }
    });
    Ok((bound, task))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::content;

    #[test]
    fn the_history_keeps_the_latest_as_published_and_older_ones_gzipped() {
        let store = SnapshotStore::default();
        let mut big = content(vec![]);
        big.problems = (0..400)
            .map(|i| consul_resolver_core::assembler::snapshot::Problem {
                kind: "Mapping".into(),
                namespace: "shop".into(),
                name: format!("m{i}"),
                message: "resolver \"nope\": no ConsulResolver of that name in shop".into(),
            })
            .collect();
        let first = big.clone().into_snapshot(1);
        let second = big.into_snapshot(2);
        assert!(first.to_json().len() >= COMPRESS_FROM, "{}", first.to_json().len());
        store.push(&first);
        store.push(&second);
        assert_eq!(store.latest(), Some(second.to_json()), "the very bytes published");
        let Some(Body::Gzip(gz)) = store.get(1) else { panic!("the older one is compressed") };
        assert!(gz.len() * 10 < first.to_json().len());
        assert_eq!(super::super::gunzip(&gz).unwrap(), first.to_json());
        for id in 3..20 {
            store.push(&content(vec![]).into_snapshot(id));
        }
        assert_eq!(store.get(2), None, "only the last ten");
        assert!(matches!(store.get(19), Some(Body::Json(_))));
    }
}
