//! Tiny HTTP/1.1 backends on loopback, for a proxy to route to: each answers every request
//! `200` with its name in the body and in an `x-backend` header. One can be stopped (its
//! listener and every connection closed, as when a process dies) and started again on the
//! same address.
//!
//! They run on a runtime of their own, so they keep answering while a test blocks its
//! thread, and are usable from sync and async tests alike.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinSet;

/// The header that names the backend that answered.
pub const BACKEND_HEADER: &str = "x-backend";

/// Longest a stop may take to close everything.
const STOP_WITHIN: Duration = Duration::from_secs(5);

/// Named backends; all stopped when dropped.
pub struct Backends {
    rt: Option<tokio::runtime::Runtime>,
    backends: BTreeMap<String, Backend>,
}

struct Backend {
    addr: SocketAddr,
    running: Option<Running>,
}

/// A serving backend: `stop` ends it, `stopped` says when its sockets are all closed.
struct Running {
    stop: oneshot::Sender<()>,
    stopped: std::sync::mpsc::Receiver<()>,
}

impl Backends {
    /// One backend per name, each on a free loopback port.
    pub fn start(names: &[&str]) -> anyhow::Result<Backends> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("backends")
            .enable_all()
            .build()
            .context("the backends' runtime")?;
        let mut all = Backends { rt: Some(rt), backends: BTreeMap::new() };
        for name in names {
            let running = all.serve(name, ([127, 0, 0, 1], 0).into())?;
            all.backends.insert((*name).to_owned(), running);
        }
        Ok(all)
    }

    fn serve(&self, name: &str, addr: SocketAddr) -> anyhow::Result<Backend> {
        let rt = self.rt.as_ref().context("the backends' runtime is gone")?;
        let _entered = rt.enter();
        let listener = std::net::TcpListener::bind(addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .and_then(TcpListener::from_std)
            .with_context(|| format!("backend {name}: binding {addr}"))?;
        let addr = listener.local_addr()?;
        let (stop, stop_rx) = oneshot::channel();
        let (stopped_tx, stopped) = std::sync::mpsc::channel();
        rt.spawn(serve(listener, Arc::from(name), stop_rx, stopped_tx));
        Ok(Backend { addr, running: Some(Running { stop, stopped }) })
    }

    fn get(&self, name: &str) -> &Backend {
        self.backends.get(name).unwrap_or_else(|| panic!("no backend named {name}"))
    }

    /// The address of backend `name` (it keeps it across stops and starts).
    pub fn addr(&self, name: &str) -> SocketAddr {
        self.get(name).addr
    }

    /// Every backend's address, in the order of their names.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.backends.values().map(|b| b.addr).collect()
    }

    pub fn is_running(&self, name: &str) -> bool {
        self.get(name).running.is_some()
    }

    /// Stops backend `name`: returns once its listener and every connection it had are
    /// closed, so that no request sent from now on can reach it.
    pub fn stop(&mut self, name: &str) -> anyhow::Result<()> {
        let backend = self.backends.get_mut(name).with_context(|| format!("no backend named {name}"))?;
        let Some(running) = backend.running.take() else {
            bail!("backend {name} is already stopped");
        };
        let _ = running.stop.send(());
        running
            .stopped
            .recv_timeout(STOP_WITHIN)
            .with_context(|| format!("backend {name} did not close its sockets within {STOP_WITHIN:?}"))
    }

    /// Starts backend `name` again on its address; an error if someone else took the port
    /// meanwhile.
    pub fn restart(&mut self, name: &str) -> anyhow::Result<()> {
        let addr = self.get(name).addr;
        if self.is_running(name) {
            bail!("backend {name} is running");
        }
        let backend = self.serve(name, addr)?;
        self.backends.insert(name.to_owned(), backend);
        Ok(())
    }
}

impl Drop for Backends {
    fn drop(&mut self) {
        // Callable in an async test too: the runtime is not waited for.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

async fn serve(
    listener: TcpListener,
    name: Arc<str>,
    mut stop: oneshot::Receiver<()>,
    stopped: std::sync::mpsc::Sender<()>,
) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut stop => break,
            accepted = listener.accept() => {
                if let Ok((stream, _)) = accepted {
                    connections.spawn(connection(stream, name.clone()));
                }
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    // Aborted and awaited: each connection's socket is closed once this returns.
    connections.shutdown().await;
    let _ = stopped.send(());
}

async fn connection(stream: tokio::net::TcpStream, name: Arc<str>) {
    let _ = stream.set_nodelay(true);
    let service = service_fn(move |_request| {
        let name = name.clone();
        async move {
            let answer = hyper::Response::builder()
                .header(BACKEND_HEADER, &*name)
                .header(hyper::header::CONTENT_TYPE, "text/plain")
                .body(Full::new(Bytes::from(name.to_string())))
                .expect("a valid response");
            Ok::<_, Infallible>(answer)
        }
    });
    let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
}
