//! The ops HTTP server, on `--listen`: `/metrics`, `/healthz`, `/readyz`, and the snapshots
//! the HTTP publisher keeps (`/snapshot`, `/snapshots/<id>`).

pub(crate) mod metrics;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::publishers::gunzip;
use crate::publishers::http::{Body, KEPT, SnapshotStore};
use metrics::Metrics;

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
                Some(Body::Gzip(gz)) => match gunzip(&gz) {
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
