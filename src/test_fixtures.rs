//! Test fixtures shared by the edge modules: a loopback stand-in for the Kubernetes API
//! server (each request is recorded as `METHOD last-path-segment` and answered by a
//! handler), and snapshot fixtures.

use std::sync::{Arc, Mutex};

use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use consul_resolver_core::assembler::snapshot::{Bootstrap, Content, Part, ResolverEntry};

pub(crate) type Handler = dyn Fn(&str, &str, &[u8]) -> (u16, Value) + Send + Sync;

pub(crate) struct FakeApi {
    pub(crate) client: kube::Client,
    pub(crate) log: Arc<Mutex<Vec<String>>>,
    /// The media type of each request body, in order (requests without one are left out).
    pub(crate) bodies: Arc<Mutex<Vec<String>>>,
    stop: CancellationToken,
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl FakeApi {
    /// Takes the requests recorded so far.
    pub(crate) fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.log.lock().unwrap())
    }
}

/// A `kind: Status` 404 body.
pub(crate) fn not_found(name: &str) -> (u16, Value) {
    let status = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
        "reason": "NotFound", "code": 404, "message": format!("{name} not found")});
    (404, status)
}

/// Serves `handler(method, path, body)` on 127.0.0.1 until dropped.
pub(crate) async fn serve(handler: Arc<Handler>) -> FakeApi {
    let log = Arc::new(Mutex::new(Vec::new()));
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let (log2, bodies2, stop2) = (log.clone(), bodies.clone(), stop.clone());
    tokio::spawn(async move {
        loop {
            let stream = tokio::select! {
                _ = stop2.cancelled() => return,
                a = listener.accept() => a.unwrap().0,
            };
            let (log, bodies, handler) = (log2.clone(), bodies2.clone(), handler.clone());
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let (log, bodies, handler) = (log.clone(), bodies.clone(), handler.clone());
                async move {
                    let method = req.method().to_string();
                    let path = req.uri().path().to_owned();
                    let name = path.rsplit('/').next().unwrap_or_default();
                    log.lock().unwrap().push(format!("{method} {name}"));
                    let body = json_body(req, &bodies).await;
                    // Handlers may block (the gated ones hold a request until others
                    // arrive), and a blocked worker strands the tasks queued on it.
                    let (code, out) = tokio::task::spawn_blocking(move || handler(&method, &path, &body))
                        .await
                        .expect("the handler does not panic");
                    let resp = Response::builder()
                        .status(code)
                        .header("content-type", "application/json")
                        .body(Full::new(bytes::Bytes::from(serde_json::to_vec(&out).unwrap())))
                        .unwrap();
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            tokio::spawn(async move {
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
            });
        }
    });
    let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
    FakeApi { client: kube::Client::try_from(config).unwrap(), log, bodies, stop }
}

/// The body of `req` as JSON, for the handlers, as the API server reads either encoding
/// into one object; its media type is recorded in `bodies`.
async fn json_body(req: Request<hyper::body::Incoming>, bodies: &Mutex<Vec<String>>) -> bytes::Bytes {
    let media = req.headers().get("content-type").and_then(|t| t.to_str().ok()).unwrap_or_default().to_owned();
    let body = req.into_body().collect().await.unwrap().to_bytes();
    if body.is_empty() {
        return body;
    }
    let protobuf = media == crate::kube_client::protobuf::PROTOBUF;
    bodies.lock().unwrap().push(media);
    if protobuf {
        serde_json::to_vec(&crate::kube_client::protobuf::tests::decoded(&body)).unwrap().into()
    } else {
        body
    }
}

/// The key of a watch of Consul service `web` at `address`, with the default options.
pub(crate) fn consul_key(address: &str) -> consul_resolver_core::keys::ConsulKey {
    consul_resolver_core::test_support::consul_key(address, "web")
}

/// Snapshot content with these resolvers and nothing else, bootstrap complete.
pub(crate) fn content(resolvers: Vec<ResolverEntry>) -> Content {
    Content {
        bootstrap: Bootstrap { complete: true, unsynced: vec![] },
        resolvers: resolvers.into_iter().map(Part::new).collect(),
        mappings: Default::default(),
        kubernetes_services: Default::default(),
        watched: vec![],
        problems: vec![],
        exports: vec![],
    }
}

/// A valid resolver at generation 3 with no services.
pub(crate) fn resolver_entry(namespace: &str, name: &str) -> ResolverEntry {
    ResolverEntry {
        namespace: namespace.into(),
        name: name.into(),
        generation: Some(3),
        address: "http://127.0.0.1:8500".into(),
        datacenter: None,
        unusable: None,
        services: Default::default(),
    }
}

#[global_allocator]
static ALLOCATOR: heap_peak::Counting = heap_peak::Counting;

pub(crate) use heap_peak::peak_heap;

/// Whether the TCP socket of this process from `local` to `peer` has TCP_NODELAY; `None`
/// without one. Tests hold both ends of a loopback connection, so either end is found
/// among the process's own descriptors.
pub(crate) fn tcp_nodelay(local: std::net::SocketAddr, peer: std::net::SocketAddr) -> Option<bool> {
    use std::os::fd::BorrowedFd;
    for entry in std::fs::read_dir("/proc/self/fd").ok()? {
        let Ok(fd) = entry.ok()?.file_name().to_string_lossy().parse::<i32>() else { continue };
        // SAFETY: only duplicated; a descriptor closed meanwhile fails to duplicate.
        let Ok(owned) = unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned() else { continue };
        let socket = std::net::TcpStream::from(owned);
        if socket.local_addr().ok() == Some(local) && socket.peer_addr().ok() == Some(peer) {
            return socket.nodelay().ok();
        }
    }
    None
}
