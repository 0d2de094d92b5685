//! What the API server saw of a client: its watch requests, from the audit log, and its
//! connections, from `/proc` (the audit log records requests, not connections).
//!
//! The 1.20 API server logs a watch once it ends (a `ResponseComplete` event carrying when
//! it was received), so a client's watches are all known once it has exited.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use serde_json::Value;

/// The port of the API server a kubeconfig names.
pub fn port(kubeconfig: &Path) -> anyhow::Result<u16> {
    let text = std::fs::read_to_string(kubeconfig).with_context(|| format!("reading {}", kubeconfig.display()))?;
    let kc: Value = serde_yaml::from_str(&text)?;
    let server = kc["clusters"][0]["cluster"]["server"].as_str().context("no server in the kubeconfig")?;
    url::Url::parse(server)?.port().context("the server's address has no port")
}

/// The established TCP connections of process `pid` to port `port`: its sockets (from
/// `/proc/<pid>/fd`) found in its network namespace's tables with that remote port.
pub fn connections(pid: u32, port: u16) -> usize {
    let inodes: BTreeSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| Some(l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned()))
        .collect();
    let mut n = 0;
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let remote = f.get(2).and_then(|r| r.rsplit(':').next()).and_then(|p| u16::from_str_radix(p, 16).ok());
            // State 01 is ESTABLISHED; field 9 is the socket's inode.
            if remote == Some(port) && f.get(3) == Some(&"01") && f.get(9).is_some_and(|i| inodes.contains(*i)) {
                n += 1;
            }
        }
    }
    n
}

/// One watch request, from its audit event.
#[derive(Debug, Clone)]
pub struct WatchRequest {
    pub started: SystemTime,
    pub ended: SystemTime,
    /// `None`: every namespace.
    pub namespace: Option<String>,
    pub field_selector: Option<String>,
    pub label_selector: Option<String>,
}

impl WatchRequest {
    /// Whether it selects one object's worth (by name or by its Service's label).
    pub fn selects_one(&self) -> bool {
        self.field_selector.is_some() || self.label_selector.as_deref().is_some_and(|l| l.contains('='))
    }
}

/// The ended watch requests of `user` on `resource`, from the audit log's events.
pub fn watch_requests(events: &[Value], user: &str, resource: &str) -> Vec<WatchRequest> {
    let time = |e: &Value, field: &str| humantime::parse_rfc3339_weak(e[field].as_str()?).ok();
    events
        .iter()
        .filter(|e| e["user"]["username"] == user && e["objectRef"]["resource"] == resource)
        .filter(|e| e["verb"] == "watch" && e["stage"] == "ResponseComplete")
        .filter_map(|e| {
            let uri = url::Url::parse(&format!("http://apiserver{}", e["requestURI"].as_str()?)).ok()?;
            let query = |name: &str| uri.query_pairs().find(|(k, _)| k == name).map(|(_, v)| v.into_owned());
            Some(WatchRequest {
                started: time(e, "requestReceivedTimestamp")?,
                ended: time(e, "stageTimestamp")?,
                namespace: e["objectRef"]["namespace"].as_str().map(str::to_owned),
                field_selector: query("fieldSelector"),
                label_selector: query("labelSelector"),
            })
        })
        .collect()
}

/// The most watches running at once: at each one's start, those begun by then and not
/// ending within `stopping` of it (the API server logs a watch's end once it notices the
/// closed connection, so one being stopped as another began is not counted beside it).
pub fn most_at_once(watches: &[WatchRequest], stopping: Duration) -> usize {
    watches
        .iter()
        .map(|w| watches.iter().filter(|o| o.started <= w.started && o.ended > w.started + stopping).count())
        .max()
        .unwrap_or(0)
}

/// One completed request of a client on one object, from its audit event.
#[derive(Debug, Clone)]
pub struct ObjectRequest {
    pub verb: String,
    pub resource: String,
    /// `""` for the object itself.
    pub subresource: String,
    pub namespace: String,
    pub name: String,
    pub code: u64,
    /// When the API server received it.
    pub received: SystemTime,
    /// When it sent the response.
    pub answered: SystemTime,
}

impl ObjectRequest {
    /// A write (create, update, patch) that succeeded.
    pub fn wrote(&self) -> bool {
        matches!(self.verb.as_str(), "create" | "update" | "patch") && (200..300).contains(&self.code)
    }
}

/// The completed requests of `user` that name an object, in the audit log's order.
pub fn object_requests(events: &[Value], user: &str) -> Vec<ObjectRequest> {
    let time = |e: &Value, field: &str| humantime::parse_rfc3339_weak(e[field].as_str()?).ok();
    let text = |e: &Value, field: &str| e["objectRef"][field].as_str().unwrap_or_default().to_owned();
    events
        .iter()
        .filter(|e| e["user"]["username"] == user && e["stage"] == "ResponseComplete")
        .filter(|e| e["objectRef"]["name"].is_string())
        .filter_map(|e| {
            Some(ObjectRequest {
                verb: e["verb"].as_str()?.to_owned(),
                resource: text(e, "resource"),
                subresource: text(e, "subresource"),
                namespace: text(e, "namespace"),
                name: text(e, "name"),
                code: e["responseStatus"]["code"].as_u64()?,
                received: time(e, "requestReceivedTimestamp")?,
                answered: time(e, "stageTimestamp")?,
            })
        })
        .collect()
}
