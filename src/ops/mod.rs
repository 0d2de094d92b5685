//! The ops HTTP server, on `--listen`: `/metrics`, `/healthz`, `/readyz`, and the snapshots
//! the HTTP publisher keeps (`/snapshot`, `/snapshots/<id>`).

pub(crate) mod health;
pub(crate) mod metrics;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::publishers::gunzip;
use crate::publishers::http::{Body, KEPT, SnapshotStore};
use health::Heartbeat;
use metrics::Metrics;

/// Shared state the server reads.
#[derive(Clone)]
pub(crate) struct ServerState {
    pub store: Arc<SnapshotStore>,
    pub metrics: Metrics,
    /// Ready once a snapshot was published (and, with leader election, also on
    /// standbys: readiness means "can serve", not "is leader").
    pub ready: Arc<std::sync::atomic::AtomicBool>,
    /// Beaten by the event loop; `/healthz` fails when it is older than `heartbeat_timeout`.
    pub heartbeat: Arc<Heartbeat>,
    pub heartbeat_timeout: Duration,
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
        "/healthz" => match state.heartbeat.check(tokio::time::Instant::now(), state.heartbeat_timeout) {
            Ok(()) => respond(StatusCode::OK, "text/plain", "ok\n"),
            Err(why) => respond(StatusCode::SERVICE_UNAVAILABLE, "text/plain", format!("{why}\n")),
        },
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
        let state = ServerState {
            store: Arc::default(),
            metrics: Metrics::new(),
            ready: Arc::default(),
            heartbeat: heartbeat.clone(),
            heartbeat_timeout: timeout,
        };
        let shutdown = CancellationToken::new();
        let (addr, task) = serve("127.0.0.1:0".parse().unwrap(), state, shutdown.clone()).await.unwrap();
        assert_eq!(get(addr, "/healthz").await, (200, "ok\n".to_owned()));
        // The loop's last beat two minutes ago: wedged.
        heartbeat.beat(tokio::time::Instant::now() - Duration::from_secs(120));
        let (status, body) = get(addr, "/healthz").await;
        assert_eq!(status, 503);
        assert!(body.contains("the event loop has not turned for 2m"), "{body}");
        assert_eq!(get(addr, "/readyz").await.0, 503, "readiness is its own question");
        heartbeat.beat(tokio::time::Instant::now());
        assert_eq!(get(addr, "/healthz").await.0, 200);
        shutdown.cancel();
        task.await.unwrap();
    }
}
