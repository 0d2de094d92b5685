//! The Kubernetes client, with a deadline on every request that is not a watch.
//!
//! kube's client has no overall request timeout by default: a request to an API server
//! that accepted the connection and then went silent (frozen, overloaded, a half-open
//! connection) waits for minutes. Every non-watch request of this operator (lists,
//! discovery, the Lease, the ConfigMap, statuses, Events) therefore gets `--kube-timeout`
//! from sending it to the end of its response body, enforced by a layer of the client
//! itself so no call site can forget it. Watches are left alone: they are long by design and
//! kube-runtime's watcher has its own idle timeout.
//!
//! The client also names this replica in its User-Agent, so the API server's audit log can
//! tell which replica wrote what.
//!
//! The snapshot's writer has a client of its own ([`fenced`]), whose request bodies are sent
//! only while this replica leads.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::client::retry::RetryPolicy;
use kube::client::{ClientBuilder, ConfigExt};
use tokio::time::{Instant, Sleep};
use tower::ServiceBuilder;
use tower::retry::RetryLayer;
use tower_layer::Layer;
use tower_service::Service;

mod fence;
pub(crate) use fence::fenced;
pub(crate) mod protobuf;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The field manager of everything the operator writes with server-side apply, and the
/// controller name in its Events.
pub(crate) const FIELD_MANAGER: &str = "consul-resolver-operator";

/// The API server's answer, when the error is one.
pub(crate) fn status_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

/// A short, bounded label for an error, for metrics: `conflict`, `forbidden`, `timeout`, ...
pub(crate) fn error_reason(e: &kube::Error) -> &'static str {
    match status_code(e) {
        Some(404) => "not_found",
        Some(409) => "conflict",
        Some(403) => "forbidden",
        Some(422) => "invalid",
        Some(429) => "throttled",
        Some(c) if c >= 500 => "server_error",
        Some(_) => "rejected",
        None if matches!(e, kube::Error::Service(b) if b.is::<DeadlineExceeded>()) => "timeout",
        None => "transport",
    }
}

/// A request that did not complete within its deadline.
#[derive(Debug, thiserror::Error)]
#[error("no complete response from the API server within {0:?} (--kube-timeout)")]
pub(crate) struct DeadlineExceeded(pub Duration);

/// The kubeconfig (or in-cluster config), with a User-Agent naming `identity`.
pub(crate) async fn config(identity: &str) -> anyhow::Result<kube::Config> {
    let mut config = kube::Config::infer().await?;
    let agent = format!("consul-resolver-operator/{} ({identity})", env!("CARGO_PKG_VERSION"));
    let agent = http::HeaderValue::from_str(&agent)
        .or_else(|_| http::HeaderValue::from_str(concat!("consul-resolver-operator/", env!("CARGO_PKG_VERSION"))))?;
    config.headers.push((http::header::USER_AGENT, agent));
    Ok(config)
}

/// The operator's client: `config` ([`config`]), and `timeout` on every request that is not
/// a watch.
///
/// Built as kube builds its own (the same TLS, timeouts, retries, credentials and headers),
/// but on a connector with TCP_NODELAY ([`connector`]), which kube's lacks and has no way
/// to set. Left out: kube's per-request debug spans. A kubeconfig naming a proxy gets
/// kube's own client, which knows proxies.
pub(crate) fn client(config: kube::Config, timeout: Duration) -> anyhow::Result<kube::Client> {
    if config.proxy_url.is_some() {
        return Ok(ClientBuilder::try_from(config)?.with_layer(&DeadlineLayer { timeout }).build());
    }
    let mut connector =
        hyper_timeout::TimeoutConnector::new(config.rustls_https_connector_with_connector(connector())?);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let hyper = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(MAX_IDLE_CONNECTIONS)
        .build(connector);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.default_retry.then(|| RetryLayer::new(RetryPolicy::server_retry())))
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(hyper);
    Ok(ClientBuilder::new(service, config.default_namespace).with_layer(&DeadlineLayer { timeout }).build())
}

/// Idle connections each client keeps to the API server. Over HTTP/1.1 a burst of
/// concurrent requests (a cold start's lists, statuses written in parallel, watches
/// renewed) opens a connection each, and without a bound every one stays open while idle
/// (90 s, longer when reused now and then): the tenants benchmark counted up to 347
/// connections where its 249 watches and the writers need about 265. A handful covers the
/// writers' concurrency; a watch holds its own connection while it runs.
const MAX_IDLE_CONNECTIONS: usize = 16;

/// The TCP connector of both clients, with TCP_NODELAY. Without it, a new connection's
/// first request was answered about 40 ms late (42 ms after the TLS handshake, against 1 ms
/// for the next request on the same connection): the request follows the handshake's last
/// message, and Nagle holds it until that message is acknowledged, which the receiver
/// delays (delayed ACK, 40 ms at least on Linux). A cold start opens a connection per
/// concurrent list and waits for them (docs/benchmarks.md, "Measured design
/// choices"); the snapshot writer's bodies go out in small writes, each of which would wait
/// likewise.
fn connector() -> HttpConnector {
    let mut tcp = HttpConnector::new();
    tcp.enforce_http(false);
    tcp.set_nodelay(true);
    tcp
}

/// Puts a deadline on every request that is not a watch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeadlineLayer {
    pub timeout: Duration,
}

impl<S> Layer<S> for DeadlineLayer {
    type Service = DeadlineService<S>;

    fn layer(&self, inner: S) -> DeadlineService<S> {
        DeadlineService { inner, timeout: self.timeout }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct DeadlineService<S> {
    inner: S,
    timeout: Duration,
}

/// `?watch=true` (or `1`) is a watch; everything else is a request with an end.
fn is_watch(uri: &Uri) -> bool {
    uri.query().is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"))
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for DeadlineService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = Response<DeadlineBody<ResBody>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let timeout = self.timeout;
        let deadline = (!is_watch(req.uri())).then(|| Instant::now() + timeout);
        let response = self.inner.call(req);
        Box::pin(async move {
            let response = match deadline {
                None => response.await.map_err(Into::into)?,
                Some(at) => match tokio::time::timeout_at(at, response).await {
                    Ok(r) => r.map_err(Into::into)?,
                    Err(_) => return Err(Box::new(DeadlineExceeded(timeout)) as BoxError),
                },
            };
            Ok(response.map(|body| DeadlineBody {
                body,
                deadline: deadline.map(|at| Box::pin(tokio::time::sleep_until(at))),
                timeout,
            }))
        })
    }
}

pin_project_lite::pin_project! {
    /// A response body that fails once the request's deadline passes.
    pub struct DeadlineBody<B> {
        #[pin]
        body: B,
        deadline: Option<Pin<Box<Sleep>>>,
        timeout: Duration,
    }
}

impl<B> Body for DeadlineBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        if let Some(deadline) = this.deadline.as_mut()
            && deadline.as_mut().poll(cx).is_ready()
        {
            return Poll::Ready(Some(Err(Box::new(DeadlineExceeded(*this.timeout)))));
        }
        this.body.poll_frame(cx).map_err(Into::into)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The client's connections have TCP_NODELAY (see [`connector`]).
    #[tokio::test]
    async fn the_client_connects_with_tcp_nodelay() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (stream, peer) = listener.accept().await.unwrap();
            let service = hyper::service::service_fn(|_req: Request<hyper::body::Incoming>| async {
                Ok::<_, std::convert::Infallible>(Response::new(http_body_util::Full::new(Bytes::from("{}"))))
            });
            let serving = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            tokio::spawn(serving);
            peer
        });
        let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
        let client = client(config, Duration::from_secs(5)).unwrap();
        client.request_text(Request::get("/version").body(Vec::new()).unwrap()).await.unwrap();
        let client_end = server.await.unwrap();

        // The connection stays open in the client's pool.
        let nodelay = crate::test_fixtures::tcp_nodelay(client_end, addr);
        assert_eq!(nodelay, Some(true), "the client's socket to {addr} (from {client_end})");
    }

    /// After a burst of concurrent requests, the client keeps at most
    /// [`MAX_IDLE_CONNECTIONS`] of the connections it opened.
    #[tokio::test]
    async fn a_burst_leaves_a_bounded_number_of_idle_connections() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        const BURST: usize = 40;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let open = Arc::new(AtomicUsize::new(0));
        let counted = open.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                counted.fetch_add(1, Ordering::SeqCst);
                // Each answer takes a moment, so the burst's requests overlap.
                let service = hyper::service::service_fn(|_req: Request<hyper::body::Incoming>| async {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    Ok::<_, std::convert::Infallible>(Response::new(http_body_util::Full::new(Bytes::from("{}"))))
                });
                let serving = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                let counted = counted.clone();
                tokio::spawn(async move {
                    let _ = serving.await;
                    counted.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
        let client = client(config, Duration::from_secs(5)).unwrap();
        let requests = (0..BURST).map(|_| client.request_text(Request::get("/version").body(Vec::new()).unwrap()));
        for answer in futures::future::join_all(requests).await {
            answer.unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while open.load(Ordering::SeqCst) > MAX_IDLE_CONNECTIONS && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let still = open.load(Ordering::SeqCst);
        assert!(still <= MAX_IDLE_CONNECTIONS, "{still} connections left open after a burst of {BURST}");
        assert!(still > 0, "the pool keeps some");
    }

    #[test]
    fn watches_are_told_apart() {
        let uri = |s: &str| s.parse::<Uri>().unwrap();
        assert!(is_watch(&uri("/api/v1/secrets?fieldSelector=metadata.name%3Dx&watch=true&timeoutSeconds=290")));
        assert!(is_watch(&uri("/api/v1/secrets?watch=1")));
        assert!(!is_watch(&uri("/api/v1/secrets?fieldSelector=metadata.name%3Dx")));
        assert!(!is_watch(&uri("/api/v1/namespaces/a/configmaps/watch-true")));
        assert!(!is_watch(&uri("/api/v1/secrets?allowWatchBookmarks=true")));
    }

    /// An API server that accepts and answers nothing: a request fails at its deadline
    /// rather than waiting for ever, while a watch is not cut.
    #[tokio::test]
    async fn a_silent_api_server_fails_requests_at_their_deadline_but_not_watches() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // Accept and hold connections, never answering.
        let held = tokio::spawn(async move {
            let mut conns = Vec::new();
            while let Ok((c, _)) = listener.accept().await {
                conns.push(c);
            }
        });
        let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
        let timeout = Duration::from_millis(300);
        let client = ClientBuilder::try_from(config).unwrap().with_layer(&DeadlineLayer { timeout }).build();
        let api: kube::Api<k8s_openapi::api::core::v1::ConfigMap> = kube::Api::namespaced(client.clone(), "a");
        let started = std::time::Instant::now();
        let err = api.get("x").await.unwrap_err();
        let took = started.elapsed();
        assert_eq!(error_reason(&err), "timeout", "{err:?}");
        assert!(took >= timeout && took < Duration::from_secs(5), "{took:?}");
        // A watch is still waiting well past the deadline.
        let params = kube::api::WatchParams::default();
        let watch = api.watch(&params, "0");
        assert!(tokio::time::timeout(timeout * 3, watch).await.is_err(), "the watch was cut by the request deadline");
        held.abort();
    }
}
