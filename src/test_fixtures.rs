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
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let (log2, stop2) = (log.clone(), stop.clone());
    tokio::spawn(async move {
        loop {
            let stream = tokio::select! {
                _ = stop2.cancelled() => return,
                a = listener.accept() => a.unwrap().0,
            };
            let (log, handler) = (log2.clone(), handler.clone());
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let (log, handler) = (log.clone(), handler.clone());
                async move {
                    let method = req.method().to_string();
                    let path = req.uri().path().to_owned();
                    let name = path.rsplit('/').next().unwrap_or_default();
                    log.lock().unwrap().push(format!("{method} {name}"));
                    let body = req.into_body().collect().await.unwrap().to_bytes();
                    let (code, out) = handler(&method, &path, &body);
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
    FakeApi { client: kube::Client::try_from(config).unwrap(), log, stop }
}

/// Snapshot content with these resolvers and nothing else, bootstrap complete.
pub(crate) fn content(resolvers: Vec<ResolverEntry>) -> Content {
    Content {
        bootstrap: Bootstrap { complete: true, unsynced: vec![] },
        resolvers: resolvers.into_iter().map(Part::new).collect(),
        mappings: vec![],
        kubernetes_services: vec![],
        watched: vec![],
        problems: vec![],
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
        services: vec![],
    }
}

/// The unit tests' allocator: the system's, plus a per-thread count of live heap bytes and
/// their peak, so a property test can assert that a parser or decoder fed hostile input
/// stays within a memory bound ([`peak_heap`]). Per thread, so tests running in parallel
/// do not count each other's allocations.
mod heap {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    pub(crate) struct Counting;

    thread_local! {
        static LIVE: Cell<isize> = const { Cell::new(0) };
        static PEAK: Cell<isize> = const { Cell::new(0) };
    }

    fn track(delta: isize) {
        // `try_with`: allocations during thread teardown are not counted, never a panic.
        let _ = LIVE.try_with(|live| {
            let now = live.get() + delta;
            live.set(now);
            let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
        });
    }

    // SAFETY: every call is forwarded to the system allocator unchanged; only counted.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            // SAFETY: same contract as ours.
            let p = unsafe { System.alloc(layout) };
            if !p.is_null() {
                track(layout.size() as isize);
            }
            p
        }

        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            // SAFETY: same contract as ours.
            let p = unsafe { System.alloc_zeroed(layout) };
            if !p.is_null() {
                track(layout.size() as isize);
            }
            p
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: same contract as ours.
            unsafe { System.dealloc(ptr, layout) };
            track(-(layout.size() as isize));
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            // SAFETY: same contract as ours.
            let p = unsafe { System.realloc(ptr, layout, new_size) };
            if !p.is_null() {
                track(new_size as isize - layout.size() as isize);
            }
            p
        }
    }

    /// Runs `f`; returns its result and the most heap it held at once on this thread, in
    /// bytes above what was live when it started.
    pub(crate) fn peak_heap<R>(f: impl FnOnce() -> R) -> (R, usize) {
        let start = LIVE.with(Cell::get);
        PEAK.with(|p| p.set(start));
        let r = f();
        let peak = PEAK.with(Cell::get);
        (r, usize::try_from(peak - start).unwrap_or(0))
    }
}

#[global_allocator]
static ALLOCATOR: heap::Counting = heap::Counting;

pub(crate) use heap::peak_heap;

#[cfg(test)]
mod tests {
    #[test]
    fn peak_heap_counts_what_is_held_at_once_on_this_thread() {
        let (len, peak) = super::peak_heap(|| {
            let a = vec![1u8; 1 << 20];
            let b = vec![2u8; 1 << 19];
            a.len() + b.len()
        });
        assert_eq!(len, 3 << 19);
        assert!((3 << 19..(3 << 19) + 4096).contains(&peak), "{peak}");
        let (_, freed_first) = super::peak_heap(|| {
            drop(vec![1u8; 1 << 20]);
            drop(vec![1u8; 1 << 20]);
        });
        assert!((1 << 20..(1 << 20) + 4096).contains(&freed_first), "{freed_first}");
    }
}
