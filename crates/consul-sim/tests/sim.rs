//! Black-box tests of the Consul simulator over HTTP, one per rule of `docs/consul-protocol.md`
//! ("Blocking queries", "Errors") plus the control endpoints and the binary.
//!
//! The client is a minimal raw HTTP/1.1 client so that tests control connections exactly
//! (the connection-limit tests need to hold sockets open). Timing assertions use short waits
//! and bounded `timeout`s; nothing sleeps "to be safe".

mod common;

use std::io::Read as _;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use consul_sim::{
    AclConfig, AclToken, Budget, Config, FaultsPatch, Outcome, RunningSim, ServiceKey, Simulator, TokenSource,
};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LONG: Duration = Duration::from_secs(5);

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    fn index(&self) -> u64 {
        self.header("X-Consul-Index").expect("X-Consul-Index").parse().expect("numeric index")
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A kept-alive HTTP/1.1 connection.
struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    async fn open(addr: SocketAddr) -> Conn {
        Conn { stream: TcpStream::connect(addr).await.expect("connect"), buf: Vec::new() }
    }

    async fn send(&mut self, method: &str, target: &str, headers: &[(&str, &str)], body: Option<&str>) {
        let mut req = format!("{method} {target} HTTP/1.1\r\nHost: consul\r\n");
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        if let Some(b) = body {
            req.push_str(&format!("Content-Length: {}\r\n", b.len()));
        }
        req.push_str("\r\n");
        if let Some(b) = body {
            req.push_str(b);
        }
        self.stream.write_all(req.as_bytes()).await.expect("write");
    }

    /// Reads one response; `Err` if the connection closed before a complete one.
    async fn read(&mut self) -> std::io::Result<Reply> {
        let eof = || std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
        let head_end = loop {
            if let Some(p) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p;
            }
            let mut chunk = [0u8; 8192];
            let n = self.stream.read(&mut chunk).await?;
            if n == 0 {
                return Err(eof());
            }
            self.buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&self.buf[..head_end]).into_owned();
        let mut lines = head.split("\r\n");
        let status: u16 =
            lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|s| s.parse().ok()).expect("status line");
        let headers: Vec<(String, String)> =
            lines.filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned())).collect();
        let len: usize = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .map_or(0, |(_, v)| v.parse().expect("content-length"));
        self.buf.drain(..head_end + 4);
        while self.buf.len() < len {
            let mut chunk = [0u8; 8192];
            let n = self.stream.read(&mut chunk).await?;
            if n == 0 {
                return Err(eof());
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
        let body = self.buf.drain(..len).collect();
        Ok(Reply { status, headers, body })
    }

    async fn call(
        &mut self,
        method: &str,
        target: &str,
        headers: &[(&str, &str)],
        body: Option<&str>,
    ) -> std::io::Result<Reply> {
        self.send(method, target, headers, body).await;
        self.read().await
    }

    /// True once the peer has closed the connection (EOF or reset).
    async fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.stream.read(&mut b).await, Ok(0) | Err(_))
    }
}

async fn call(addr: SocketAddr, method: &str, target: &str, headers: &[(&str, &str)], body: Option<&str>) -> Reply {
    let mut c = Conn::open(addr).await;
    let mut h = headers.to_vec();
    h.push(("Connection", "close"));
    c.call(method, target, &h, body).await.expect("response")
}

async fn get(addr: SocketAddr, target: &str) -> Reply {
    call(addr, "GET", target, &[], None).await
}

async fn put(addr: SocketAddr, target: &str, body: &Value) -> Reply {
    call(addr, "PUT", target, &[], Some(&body.to_string())).await
}

/// Registers one instance with a service check, as tests against a real agent would.
async fn register(addr: SocketAddr, node: &str, service: &str, id: &str, status: &str, tags: &[&str]) {
    let r = put(
        addr,
        "/v1/catalog/register",
        &json!({
            "Node": node,
            "Address": format!("10.0.0.{}", node.len()),
            "Service": {"ID": id, "Service": service, "Port": 8080, "Tags": tags},
            "Check": {"CheckID": format!("service:{id}"), "Name": "alive", "Status": status, "ServiceID": id},
        }),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json(), json!(true));
}

/// A node check (`serfHealth`) on `node`, keeping the address `register` gave it.
async fn register_node_check(addr: SocketAddr, node: &str, status: &str) {
    let r = put(
        addr,
        "/v1/catalog/register",
        &json!({"Node": node, "Address": format!("10.0.0.{}", node.len()),
                "Check": {"CheckID": "serfHealth", "Name": "Serf", "Status": status}}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

async fn start(config: Config) -> RunningSim {
    Simulator::start(config).await.expect("start simulator")
}

async fn start_default() -> RunningSim {
    start(Config::default()).await
}

fn spawn_get(addr: SocketAddr, target: String) -> tokio::task::JoinHandle<Reply> {
    tokio::spawn(async move { get(addr, &target).await })
}

async fn wait_blocking(sim: &RunningSim, label: &str, n: usize) {
    let (stats, ok) = sim.wait_for_stats(LONG, |s| s.blocking.get(label).copied().unwrap_or(0) >= n).await;
    assert!(ok, "expected {n} blocking on {label}: {stats:?}");
}

async fn still_pending<T>(h: &mut tokio::task::JoinHandle<T>, for_: Duration) -> bool {
    tokio::time::timeout(for_, h).await.is_err()
}

// ---------------------------------------------------------------- reads and shapes

#[tokio::test]
async fn index_absent_or_zero_answers_at_once() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &["v1"]).await;
    for target in ["/v1/health/service/web", "/v1/health/service/web?index=0&wait=10m"] {
        let r = tokio::time::timeout(Duration::from_secs(2), get(a, target)).await.expect("answers at once");
        assert_eq!(r.status, 200);
        assert!(r.index() >= 1);
        assert_eq!(r.json().as_array().unwrap().len(), 1);
    }
}

#[tokio::test]
async fn body_and_headers_follow_the_contract() {
    let sim = start_default().await;
    let a = sim.addr();
    let r = put(
        a,
        "/v1/catalog/register",
        &json!({
            "Node": "n1", "Address": "10.1.1.1", "NodeMeta": {"rack": "r1"},
            "TaggedAddresses": {"lan": "10.1.1.1"},
            "Service": {
                "ID": "web-1", "Service": "web", "Address": "10.2.2.2", "Port": 80, "Tags": ["blue"],
                "Meta": {"version": "3"},
                "TaggedAddresses": {"lan": {"Address": "10.2.2.2", "Port": 80}},
            },
            "Check": {"CheckID": "c1", "Name": "http", "Status": "passing", "ServiceID": "web-1", "Output": "ok"},
        }),
    )
    .await;
    assert_eq!(r.status, 200);
    let r = get(a, "/v1/health/service/web").await;
    assert_eq!(r.header("X-Consul-KnownLeader"), Some("true"));
    assert_eq!(r.header("X-Consul-LastContact"), Some("0"));
    assert_eq!(r.header("Content-Type"), Some("application/json"));
    let e = &r.json()[0];
    for f in ["ID", "Node", "Address", "Datacenter", "TaggedAddresses", "Meta", "CreateIndex", "ModifyIndex"] {
        assert!(e["Node"].get(f).is_some(), "Node.{f}");
    }
    for f in [
        "ID",
        "Service",
        "Tags",
        "Address",
        "Port",
        "Meta",
        "TaggedAddresses",
        "Weights",
        "EnableTagOverride",
        "CreateIndex",
        "ModifyIndex",
    ] {
        assert!(e["Service"].get(f).is_some(), "Service.{f}");
    }
    let c = &e["Checks"][0];
    for f in ["Node", "CheckID", "Name", "Status", "Output", "ServiceID", "ServiceName", "ServiceTags"] {
        assert!(c.get(f).is_some(), "Checks.{f}");
    }
    assert_eq!(e["Node"]["Datacenter"], "dc1");
    assert_eq!(e["Node"]["Meta"], json!({"rack": "r1"}));
    assert_eq!(e["Service"]["TaggedAddresses"]["lan"], json!({"Address": "10.2.2.2", "Port": 80}));
    assert_eq!(e["Service"]["Weights"], json!({"Passing": 1, "Warning": 1}));
    assert_eq!(c["ServiceName"], "web");
    assert_eq!(c["ServiceTags"], json!(["blue"]));
    assert_eq!(c["Output"], "ok");
    assert_eq!(r.index(), e["Service"]["ModifyIndex"].as_u64().unwrap());
}

/// `Service.Locality` (Consul 1.17+) is kept as registered and sent back; an instance
/// without one has no `Locality` field at all (Consul's `omitempty`). A locality change is a
/// change of the instance (its index moves).
#[tokio::test]
async fn locality_is_kept_and_sent_only_when_set() {
    let sim = start_default().await;
    let a = sim.addr();
    let with = |zone: &str| {
        json!({"Node": "n1", "Address": "10.1.1.1",
               "Service": {"ID": "web-1", "Service": "web", "Port": 80, "Locality": {"Region": "r", "Zone": zone}}})
    };
    assert_eq!(put(a, "/v1/catalog/register", &with("r-a")).await.status, 200);
    register(a, "n2", "web", "web-2", "passing", &[]).await;
    let r = get(a, "/v1/health/service/web").await;
    let body = r.json();
    let by_id = |id: &str| body.as_array().unwrap().iter().find(|e| e["Service"]["ID"] == id).unwrap().clone();
    assert_eq!(by_id("web-1")["Service"]["Locality"], json!({"Region": "r", "Zone": "r-a"}));
    assert!(by_id("web-2")["Service"].get("Locality").is_none());
    let before = r.index();
    assert_eq!(put(a, "/v1/catalog/register", &with("r-b")).await.status, 200);
    let r = get(a, "/v1/health/service/web").await;
    assert!(r.index() > before, "a new zone is a change");
}

#[tokio::test]
async fn null_variants_at_start_and_at_run_time() {
    let sim = start(Config { null_variants: true, ..Config::default() }).await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &[]).await;
    let e = get(a, "/v1/health/service/web").await.json()[0].clone();
    assert_eq!(e["Node"]["Meta"], Value::Null);
    assert_eq!(e["Node"]["TaggedAddresses"], Value::Null);
    assert_eq!(e["Service"]["Tags"], Value::Null);
    assert_eq!(e["Service"]["Meta"], Value::Null);
    assert_eq!(e["Service"]["TaggedAddresses"], Value::Null);
    assert!(e["Service"].get("Proxy").is_none());

    let r = put(a, "/_sim/faults", &json!({"null_variants": false})).await;
    assert_eq!(r.json()["null_variants"], false);
    let e = get(a, "/v1/health/service/web").await.json()[0].clone();
    assert_eq!(e["Node"]["Meta"], json!({}));
    assert_eq!(e["Service"]["Tags"], json!([]));
    assert_eq!(e["Service"]["TaggedAddresses"], json!({}));
    assert!(e["Service"].get("Proxy").is_some(), "modern shape has newer fields");
}

#[tokio::test]
async fn unknown_service_is_an_empty_200() {
    let sim = start_default().await;
    let r = get(sim.addr(), "/v1/health/service/nope").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json(), json!([]));
    assert!(r.index() >= 1);
}

#[tokio::test]
async fn gzip_when_asked() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &[]).await;
    let r = call(a, "GET", "/v1/health/service/web", &[("Accept-Encoding", "gzip")], None).await;
    assert_eq!(r.header("Content-Encoding"), Some("gzip"));
    let mut plain = String::new();
    flate2::read::GzDecoder::new(&r.body[..]).read_to_string(&mut plain).unwrap();
    let v: Value = serde_json::from_str(&plain).unwrap();
    assert_eq!(v[0]["Service"]["ID"], "web-1");
    let r = get(a, "/v1/health/service/web").await;
    assert_eq!(r.header("Content-Encoding"), None);
}

// ---------------------------------------------------------------- blocking

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_query_wakes_on_change() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &[]).await;
    let i = get(a, "/v1/health/service/web").await.index();
    let mut h = spawn_get(a, format!("/v1/health/service/web?index={i}&wait=5s"));
    wait_blocking(&sim, "web", 1).await;
    assert!(still_pending(&mut h, Duration::from_millis(200)).await);
    // Flip the check critical by registering it again.
    register(a, "n1", "web", "web-1", "critical", &[]).await;
    let r = tokio::time::timeout(Duration::from_secs(2), h).await.expect("woken").unwrap();
    assert_eq!(r.status, 200);
    assert!(r.index() > i);
    assert_eq!(r.json()[0]["Checks"][0]["Status"], "critical");
}

#[tokio::test]
async fn timeout_returns_same_index_and_full_body() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &[]).await;
    register(a, "n2", "web", "web-2", "passing", &[]).await;
    let first = get(a, "/v1/health/service/web").await;
    let started = Instant::now();
    let r = get(a, &format!("/v1/health/service/web?index={}&wait=300ms", first.index())).await;
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert_eq!(r.status, 200);
    assert_eq!(r.index(), first.index());
    assert_eq!(r.json(), first.json(), "a timeout returns the full body");
}

#[tokio::test]
async fn index_is_never_zero() {
    let sim = start(Config { initial_index: 0, ..Config::default() }).await;
    let a = sim.addr();
    assert_eq!(get(a, "/v1/health/service/x").await.index(), 1);
    assert_eq!(get(a, "/v1/catalog/services").await.index(), 1);
    register(a, "n1", "web", "web-1", "passing", &[]).await;
    let r = call(a, "POST", "/_sim/reset-index", &[], Some(r#"{"index": 0}"#)).await;
    assert_eq!(r.status, 200);
    assert_eq!(get(a, "/v1/health/service/web").await.index(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changing_one_service_does_not_wake_another() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "alpha", "alpha-1", "passing", &[]).await;
    register(a, "n2", "beta", "beta-1", "passing", &[]).await;
    let ia = get(a, "/v1/health/service/alpha").await.index();
    let mut h = spawn_get(a, format!("/v1/health/service/alpha?index={ia}&wait=5s"));
    wait_blocking(&sim, "alpha", 1).await;
    register(a, "n2", "beta", "beta-1", "critical", &[]).await;
    register(a, "n3", "beta", "beta-2", "passing", &[]).await;
    assert!(get(a, "/v1/health/service/beta").await.index() > ia);
    assert!(
        still_pending(&mut h, Duration::from_millis(300)).await,
        "a change to beta must not answer a blocker on alpha"
    );
    register(a, "n1", "alpha", "alpha-1", "warning", &[]).await;
    let r = tokio::time::timeout(Duration::from_secs(2), h).await.unwrap().unwrap();
    assert!(r.index() > ia);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_service_index_is_catalog_max_then_last_extinction() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "alpha", "alpha-1", "passing", &[]).await;
    register(a, "n1", "beta", "beta-1", "passing", &[]).await;
    let beta = get(a, "/v1/health/service/beta").await.index();
    // No service went extinct yet: the catalog maximum.
    assert_eq!(get(a, "/v1/health/service/ghost").await.index(), beta);

    let r = put(a, "/v1/catalog/deregister", &json!({"Node": "n1", "ServiceID": "alpha-1"})).await;
    assert_eq!(r.json(), json!(true));
    let extinct = get(a, "/v1/health/service/alpha").await;
    assert_eq!(extinct.json(), json!([]));
    assert!(extinct.index() > beta);
    assert_eq!(get(a, "/v1/health/service/ghost").await.index(), extinct.index());

    // Other services changing does not move it, nor wake a blocker on it.
    let mut h = spawn_get(a, format!("/v1/health/service/ghost?index={}&wait=5s", extinct.index()));
    wait_blocking(&sim, "ghost", 1).await;
    register(a, "n1", "beta", "beta-1", "critical", &[]).await;
    assert!(still_pending(&mut h, Duration::from_millis(300)).await);
    assert_eq!(get(a, "/v1/health/service/ghost").await.index(), extinct.index());
    // The service appearing does wake it.
    register(a, "n2", "ghost", "ghost-1", "passing", &[]).await;
    let r = tokio::time::timeout(Duration::from_secs(2), h).await.unwrap().unwrap();
    assert_eq!(r.json().as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn client_index_above_server_blocks_full_wait_and_returns_lower_index() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &[]).await;
    let cur = get(a, "/v1/health/service/web").await.index();
    let started = Instant::now();
    let r = get(a, &format!("/v1/health/service/web?index={}&wait=300ms", cur + 1000)).await;
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(r.status, 200);
    assert_eq!(r.index(), cur);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_parsing_default_and_cap() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &[]).await;
    let i = get(a, "/v1/health/service/web").await.index();
    for good in ["10s", "5m", "300000ms", "1m30s", "1.5h", "0"] {
        let r = get(a, &format!("/v1/health/service/web?wait={good}")).await;
        assert_eq!(r.status, 200, "wait={good}");
    }
    for bad in ["10", "5x", "1%20s", "-"] {
        let r = get(a, &format!("/v1/health/service/web?wait={bad}&index={i}")).await;
        assert_eq!((r.status, r.text().as_str()), (400, "Invalid wait time"), "wait={bad}");
        assert!(r.header("X-Consul-Index").is_none());
    }

    // The effective wait is visible in the request log while the query blocks.
    sim.clear_requests();
    let cases = [
        ("&wait=20m", 600_000u64),
        ("", 300_000),
        ("&wait=0s", 300_000),
        ("&wait=-1s", 300_000),
        ("&wait=90s", 90_000),
    ];
    let mut handles = Vec::new();
    for (q, _) in cases {
        handles.push(spawn_get(a, format!("/v1/health/service/web?index={i}{q}")));
    }
    wait_blocking(&sim, "web", cases.len()).await;
    let records = sim.requests();
    for (q, want) in cases {
        let rec = records
            .iter()
            .find(|r| r.query == format!("index={i}{q}"))
            .unwrap_or_else(|| panic!("no record for {q}: {records:?}"));
        assert_eq!(rec.wait_ms, Some(want), "{q}");
        let timeout = rec.timeout_ms.unwrap();
        assert!(timeout >= want && timeout <= want + want / 16, "{q}: {timeout}");
    }
    // Close them without waiting minutes.
    assert_eq!(sim.drop_blocking(), cases.len());
    for h in handles {
        assert!(h.await.is_err(), "dropped requests get no response");
    }
}

// ---------------------------------------------------------------- errors

#[tokio::test]
async fn bad_parameters_are_400_without_index_headers() {
    let sim = start_default().await;
    let a = sim.addr();
    for (q, body) in [
        ("index=abc", "Invalid index"),
        ("index=-1", "Invalid index"),
        ("index=%2B5", "Invalid index"),
        ("stale&consistent", "Cannot specify ?stale with ?consistent, conflicting semantics."),
        ("passing=maybe", "Invalid value for ?passing"),
    ] {
        let r = get(a, &format!("/v1/health/service/web?{q}")).await;
        assert_eq!(r.status, 400, "{q}");
        assert_eq!(r.text(), body, "{q}");
        assert!(r.header("X-Consul-Index").is_none(), "{q}");
        assert!(r.header("X-Consul-KnownLeader").is_none(), "{q}");
    }
    let r = get(a, "/v1/health/service/web?filter=Service.Port%3D%3D").await;
    assert_eq!(r.status, 400, "an expression that does not parse is refused");
    assert!(r.text().starts_with("Failed to create boolean expression evaluator: "), "{}", r.text());
    let r = get(a, "/v1/health/service/web?stale").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("X-Consul-Effective-Consistency"), Some("stale"));
    let r = get(a, "/v1/catalog/services?stale&consistent").await;
    assert_eq!(r.status, 400);
    let r = put(a, "/v1/catalog/register", &json!({"Address": "1.2.3.4"})).await;
    assert_eq!(r.status, 400);
    let r = call(a, "PUT", "/v1/catalog/register", &[], Some("{not json")).await;
    assert_eq!(r.status, 400);
    assert_eq!(call(a, "GET", "/v1/catalog/register", &[], None).await.status, 405);
    assert_eq!(get(a, "/v1/agent/members").await.status, 404);
    assert_eq!(get(a, "/v1/health/service/").await.status, 400);
}

#[tokio::test]
async fn unknown_datacenter_is_500() {
    let sim = start_default().await;
    let a = sim.addr();
    let r = get(a, "/v1/health/service/web?dc=dc2").await;
    assert_eq!((r.status, r.text().as_str()), (500, "No path to datacenter"));
    assert!(r.header("X-Consul-Index").is_none());
    assert_eq!(get(a, "/v1/health/service/web?dc=dc1").await.status, 200);
    let r = put(a, "/v1/catalog/register", &json!({"Node": "n", "Address": "1.1.1.1", "Datacenter": "dc9"})).await;
    assert_eq!(r.status, 500);
}

#[tokio::test]
async fn passing_filter_includes_node_checks_and_drops_warning() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &[]).await;
    register(a, "n2", "web", "web-2", "warning", &[]).await;
    register(a, "n3", "web", "web-3", "passing", &[]).await;
    register_node_check(a, "n3", "critical").await;
    let all = get(a, "/v1/health/service/web").await;
    assert_eq!(all.json().as_array().unwrap().len(), 3);
    for q in ["passing", "passing=true", "passing=1"] {
        let r = get(a, &format!("/v1/health/service/web?{q}")).await;
        let ids: Vec<_> = r.json().as_array().unwrap().iter().map(|e| e["Service"]["ID"].clone()).collect();
        assert_eq!(ids, vec![json!("web-1")], "{q}");
        assert_eq!(r.index(), all.index(), "the index describes the unfiltered set");
    }
    assert_eq!(get(a, "/v1/health/service/web?passing=false").await.json().as_array().unwrap().len(), 3);
    // n3's entry shows its node check too.
    let n3 = all.json().as_array().unwrap().iter().find(|e| e["Node"]["Node"] == "n3").cloned().unwrap();
    assert_eq!(n3["Checks"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn tag_filter_requires_every_tag() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &["blue", "v2"]).await;
    register(a, "n2", "web", "web-2", "passing", &["blue"]).await;
    register(a, "n3", "web", "web-3", "passing", &["v2"]).await;
    let ids = |r: Reply| -> Vec<String> {
        r.json().as_array().unwrap().iter().map(|e| e["Service"]["ID"].as_str().unwrap().to_owned()).collect()
    };
    assert_eq!(ids(get(a, "/v1/health/service/web?tag=blue").await), ["web-1", "web-2"]);
    assert_eq!(ids(get(a, "/v1/health/service/web?tag=blue&tag=v2").await), ["web-1"]);
    assert!(ids(get(a, "/v1/health/service/web?tag=blue&tag=v3").await).is_empty());
}

fn acl_config() -> Config {
    Config {
        acl: Some(AclConfig {
            tokens: vec![AclToken::management("root"), AclToken::service_read("reader", ["web"])],
            anonymous_read: false,
        }),
        ..Config::default()
    }
}

#[tokio::test]
async fn acl_unknown_token_is_403_acl_not_found() {
    let sim = start(acl_config()).await;
    let a = sim.addr();
    let r = call(a, "GET", "/v1/health/service/web", &[("X-Consul-Token", "bogus")], None).await;
    assert_eq!((r.status, r.text().as_str()), (403, "ACL not found"));
    assert!(r.header("X-Consul-Index").is_none());
    let r = call(a, "GET", "/v1/health/service/web", &[("Authorization", "Bearer bogus")], None).await;
    assert_eq!(r.status, 403);
    assert_eq!(get(a, "/v1/health/service/web?token=bogus").await.status, 403);
}

#[tokio::test]
async fn acl_read_denied_filters_silently_and_writes_need_management() {
    let sim = start(acl_config()).await;
    let a = sim.addr();
    let body = json!({"Node": "n1", "Address": "10.0.0.1", "Service": {"Service": "db", "Port": 5432}});
    // Writes: anonymous and read-only tokens are refused.
    let r = put(a, "/v1/catalog/register", &body).await;
    assert_eq!((r.status, r.text().as_str()), (403, "Permission denied"));
    let r = call(a, "PUT", "/v1/catalog/register", &[("X-Consul-Token", "reader")], Some(&body.to_string())).await;
    assert_eq!(r.status, 403);
    let r = call(a, "PUT", "/v1/catalog/register", &[("X-Consul-Token", "root")], Some(&body.to_string())).await;
    assert_eq!(r.status, 200);
    let web = json!({"Node": "n1", "Address": "10.0.0.1", "Service": {"Service": "web", "Port": 80}});
    let r = call(a, "PUT", "/v1/catalog/register", &[("Authorization", "Bearer root")], Some(&web.to_string())).await;
    assert_eq!(r.status, 200);

    // Reads: the reader sees web, not db; anonymous sees nothing; all are 200.
    let r = call(a, "GET", "/v1/health/service/db", &[("X-Consul-Token", "reader")], None).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json(), json!([]));
    assert!(r.index() >= 1);
    assert_eq!(r.header("X-Consul-Results-Filtered-By-ACLs"), Some("true"));
    let r = call(a, "GET", "/v1/health/service/web", &[("X-Consul-Token", "reader")], None).await;
    assert_eq!(r.json().as_array().unwrap().len(), 1);
    let r = get(a, "/v1/health/service/web").await;
    assert_eq!((r.status, r.json()), (200, json!([])));
    let r = get(a, "/v1/health/service/db?token=root").await;
    assert_eq!(r.json().as_array().unwrap().len(), 1);
    let r = call(a, "GET", "/v1/catalog/services", &[("X-Consul-Token", "reader")], None).await;
    assert_eq!(r.json(), json!({"web": []}));

    // The log tells which token was presented, and how.
    let recs = sim.requests();
    let sources: Vec<_> = recs.iter().filter_map(|r| r.token_source).collect();
    assert!(sources.contains(&TokenSource::Header));
    assert!(sources.contains(&TokenSource::Bearer));
    assert!(sources.contains(&TokenSource::Query));
    assert!(recs.iter().any(|r| r.token.as_deref() == Some("reader")));
}

// ---------------------------------------------------------------- Connect

/// Registers a `connect-proxy` instance for `dest` with a service check, as a sidecar's
/// registration through the catalog API looks.
async fn register_proxy(addr: SocketAddr, node: &str, id: &str, dest: &str, status: &str, tags: &[&str]) {
    let r = put(
        addr,
        "/v1/catalog/register",
        &json!({
            "Node": node,
            "Address": format!("10.0.0.{}", node.len()),
            "Service": {
                "ID": id, "Service": format!("{dest}-sidecar-proxy"), "Kind": "connect-proxy", "Port": 21000,
                "Tags": tags,
                "Proxy": {"DestinationServiceName": dest, "DestinationServiceID": format!("{dest}-1"), "LocalServicePort": 8080},
            },
            "Check": {"CheckID": format!("service:{id}"), "Name": "proxy alive", "Status": status, "ServiceID": id},
        }),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

fn service_ids(r: &Reply) -> Vec<String> {
    r.json().as_array().unwrap().iter().map(|e| e["Service"]["ID"].as_str().unwrap().to_owned()).collect()
}

#[tokio::test]
async fn connect_lists_the_proxies_of_a_destination() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &[]).await;
    register_proxy(a, "n1", "web-proxy-1", "web", "passing", &[]).await;
    register(a, "n2", "api", "api-1", "passing", &[]).await;

    let r = get(a, "/v1/health/connect/web").await;
    assert_eq!(r.status, 200);
    assert_eq!(service_ids(&r), ["web-proxy-1"]);
    let e = &r.json()[0];
    assert_eq!(e["Service"]["Kind"], "connect-proxy");
    assert_eq!(e["Service"]["Service"], "web-sidecar-proxy");
    assert_eq!(e["Service"]["Port"], 21000);
    assert_eq!(e["Service"]["Proxy"]["DestinationServiceName"], "web");
    assert_eq!(e["Service"]["Proxy"]["DestinationServiceID"], "web-1");
    assert_eq!(e["Service"]["Proxy"]["LocalServicePort"], 8080);
    assert_eq!(e["Checks"][0]["ServiceName"], "web-sidecar-proxy");
    assert_eq!(r.index(), e["Service"]["ModifyIndex"].as_u64().unwrap());
    for h in ["X-Consul-KnownLeader", "X-Consul-LastContact", "X-Consul-Effective-Consistency"] {
        assert!(r.header(h).is_some(), "{h}");
    }
    // Destination names compare case-insensitively.
    assert_eq!(service_ids(&get(a, "/v1/health/connect/WEB").await), ["web-proxy-1"]);

    // Not a proxy for api, and not an instance of web.
    let r = get(a, "/v1/health/connect/api").await;
    assert_eq!((r.status, r.json()), (200, json!([])));
    assert!(r.index() >= 1);
    let r = get(a, "/v1/health/service/web").await;
    assert_eq!(service_ids(&r), ["web-1"]);
    assert_eq!(r.json()[0]["Service"]["Kind"], "");
    assert!(r.json()[0]["Service"]["Proxy"].get("DestinationServiceName").is_none());
    // The proxy is a service of its own.
    assert_eq!(service_ids(&get(a, "/v1/health/service/web-sidecar-proxy").await), ["web-proxy-1"]);

    // The legacy shape leaves the newer fields out.
    put(a, "/_sim/faults", &json!({"null_variants": true})).await;
    let e = get(a, "/v1/health/connect/web").await.json()[0].clone();
    assert!(e["Service"].get("Kind").is_none());
    assert!(e["Service"].get("Proxy").is_none());
    put(a, "/_sim/faults", &json!({"null_variants": false})).await;

    // One health index for everything on older agents.
    put(a, "/_sim/faults", &json!({"single_health_index": true})).await;
    let raft = get(a, "/v1/health/service/api").await.index();
    assert_eq!(get(a, "/v1/health/connect/web").await.index(), raft);
    assert_eq!(get(a, "/v1/health/connect/api").await.index(), raft);
    put(a, "/_sim/faults", &json!({"single_health_index": false})).await;

    // Same parameter checks, datacenter, faults and request log as /v1/health/service.
    assert_eq!(get(a, "/v1/health/connect/web?filter=Service.Nope%3D%3D1").await.status, 400);
    assert_eq!(get(a, "/v1/health/connect/web?index=x").await.status, 400);
    assert_eq!(get(a, "/v1/health/connect/").await.status, 400);
    assert_eq!(get(a, "/v1/health/connect/web?dc=other").await.status, 500);
    assert_eq!(get(a, "/v1/health/connect/web?stale").await.header("X-Consul-Effective-Consistency"), Some("stale"));
    assert_eq!(call(a, "PUT", "/v1/health/connect/web", &[], None).await.status, 405);
    put(a, "/_sim/faults", &json!({"no_leader": 1})).await;
    let r = get(a, "/v1/health/connect/web").await;
    assert_eq!((r.status, r.text().as_str()), (500, "No cluster leader"));
    assert!(r.header("X-Consul-Index").is_none());
    let recs = sim.requests();
    let connect: Vec<_> = recs.iter().filter(|r| r.path.starts_with("/v1/health/connect/")).collect();
    assert!(connect.iter().any(|r| r.service.as_deref() == Some("web") && r.status == Some(200)));
    assert!(connect.iter().any(|r| r.service.as_deref() == Some("api")));

    // Invalid proxy registrations are refused as Consul refuses them.
    let bad = json!({"Node": "n3", "Address": "10.0.0.3",
        "Service": {"Service": "x-proxy", "Kind": "connect-proxy", "Port": 21000}});
    assert_eq!(put(a, "/v1/catalog/register", &bad).await.status, 500);
}

#[tokio::test]
async fn connect_passing_and_tag_filters_apply_to_the_proxy() {
    let sim = start_default().await;
    let a = sim.addr();
    // The destination instance is critical and untagged: it must not matter.
    register(a, "n1", "web", "web-1", "critical", &[]).await;
    register_proxy(a, "n1", "p-blue", "web", "passing", &["blue"]).await;
    register_proxy(a, "n2", "p-green", "web", "passing", &["green"]).await;
    register_proxy(a, "n3", "p-sick", "web", "critical", &["blue"]).await;
    let ids = |r: Reply| {
        let mut v = service_ids(&r);
        v.sort();
        v
    };
    assert_eq!(ids(get(a, "/v1/health/connect/web").await), ["p-blue", "p-green", "p-sick"]);
    assert_eq!(ids(get(a, "/v1/health/connect/web?passing").await), ["p-blue", "p-green"]);
    assert_eq!(ids(get(a, "/v1/health/connect/web?tag=BLUE").await), ["p-blue", "p-sick"]);
    assert_eq!(ids(get(a, "/v1/health/connect/web?tag=blue&passing").await), ["p-blue"]);
    assert!(ids(get(a, "/v1/health/connect/web?tag=blue&tag=green").await).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_blocking_wakes_on_the_proxy_only() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &[]).await;
    register_proxy(a, "n1", "web-proxy-1", "web", "passing", &[]).await;
    register(a, "n2", "api", "api-1", "passing", &[]).await;
    let i = get(a, "/v1/health/connect/web").await.index();
    let mut h = spawn_get(a, format!("/v1/health/connect/web?index={i}&wait=5s"));
    let label = format!("{}web", consul_sim::HEALTH_CONNECT_LABEL_PREFIX);
    wait_blocking(&sim, &label, 1).await;
    // An unrelated service changes, and a proxy for another destination appears.
    register(a, "n2", "api", "api-1", "critical", &[]).await;
    register_proxy(a, "n2", "api-proxy-1", "api", "passing", &[]).await;
    assert!(get(a, "/v1/health/service/api").await.index() > i);
    assert!(still_pending(&mut h, Duration::from_millis(300)).await, "api's changes must not wake web's Connect query");
    // The proxy's check flips.
    register_proxy(a, "n1", "web-proxy-1", "web", "critical", &[]).await;
    let r = tokio::time::timeout(Duration::from_secs(2), h).await.expect("woken").unwrap();
    assert_eq!(r.status, 200);
    assert!(r.index() > i);
    assert_eq!(r.json()[0]["Checks"][0]["Status"], "critical");
    // An unknown destination falls back like an unknown service: the catalog maximum.
    assert_eq!(get(a, "/v1/health/connect/nope").await.index(), get(a, "/v1/health/service/nope").await.index());
}

#[tokio::test]
async fn connect_is_acl_filtered_on_the_destination_and_scoped_by_namespace() {
    let sim = start(acl_config()).await;
    let a = sim.addr();
    let root = [("X-Consul-Token", "root")];
    let proxy = |ns: &str| {
        json!({"Node": "n1", "Address": "10.0.0.1", "Service": {
            "ID": format!("p-{ns}"), "Service": "sidecar-for-web", "Kind": "connect-proxy", "Port": 21000,
            "Namespace": ns, "Proxy": {"DestinationServiceName": "web", "LocalServicePort": 8080}}})
    };
    for ns in ["default", "team"] {
        let r = call(a, "PUT", "/v1/catalog/register", &root, Some(&proxy(ns).to_string())).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    // The reader may read web, the destination, but not sidecar-for-web: the destination is
    // what counts. Anonymous may read nothing.
    let r = call(a, "GET", "/v1/health/connect/web", &[("X-Consul-Token", "reader")], None).await;
    assert_eq!(service_ids(&r), ["p-default"]);
    let r = get(a, "/v1/health/connect/web").await;
    assert_eq!((r.status, r.json()), (200, json!([])));
    assert_eq!(r.header("X-Consul-Results-Filtered-By-ACLs"), Some("true"));
    let r = call(a, "GET", "/v1/health/connect/web?ns=team", &root, None).await;
    assert_eq!(service_ids(&r), ["p-team"]);
}

// ---------------------------------------------------------------- connections

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_limit_answers_429_and_closes() {
    let sim = start(Config { max_conns_per_client: 3, ..Config::default() }).await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &[]).await;
    let (_, ok) = sim.wait_for_stats(LONG, |s| s.open_connections_total == 0).await;
    assert!(ok);
    let i = get(a, "/v1/health/service/web").await.index();
    // Three connections, each holding a blocking query.
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut c = Conn::open(a).await;
        c.send("GET", &format!("/v1/health/service/web?index={i}&wait=5s"), &[], None).await;
        held.push(c);
    }
    wait_blocking(&sim, "web", 3).await;
    // The fourth is refused with 429 and closed.
    let mut c = Conn::open(a).await;
    let r = c.call("GET", "/v1/health/service/web", &[], None).await.expect("a 429 reply");
    assert_eq!(r.status, 429);
    assert!(r.header("X-Consul-Index").is_none());
    assert!(tokio::time::timeout(LONG, c.closed()).await.expect("closed in time"));
    let s = sim.stats();
    assert_eq!(s.rejected_connections, 1);
    assert_eq!(s.total_429, 1);
    assert_eq!(s.open_connections.get("127.0.0.1"), Some(&3));
    assert_eq!(s.peak_connections.get("127.0.0.1"), Some(&3));

    // Closing one frees a slot (the server notices the client going away mid-block).
    drop(held.pop());
    let (s, ok) = sim.wait_for_stats(LONG, |s| s.open_connections_total == 2 && s.blocking_total == 2).await;
    assert!(ok, "{s:?}");
    assert_eq!(get(a, "/v1/status/leader").await.status, 200);
    assert!(sim.requests().iter().any(|r| r.outcome == Outcome::Cancelled));
    // The remaining blockers still get their answer on a change.
    register(a, "n1", "web", "web-1", "critical", &[]).await;
    for mut c in held {
        let r = tokio::time::timeout(LONG, c.read()).await.unwrap().unwrap();
        assert!(r.index() > i);
    }
}

#[tokio::test]
async fn keep_alive_connections_are_reused() {
    let sim = start_default().await;
    let a = sim.addr();
    let mut c = Conn::open(a).await;
    for _ in 0..5 {
        assert_eq!(c.call("GET", "/v1/health/service/x", &[], None).await.unwrap().status, 200);
    }
    let s = sim.stats();
    assert_eq!(s.peak_connections.get("127.0.0.1"), Some(&1));
    assert_eq!(s.requests_total, 5);
}

// ---------------------------------------------------------------- faults

#[tokio::test]
async fn fault_latency() {
    let sim = start_default().await;
    let a = sim.addr();
    let r = put(a, "/_sim/faults", &json!({"latency_ms": 250})).await;
    assert_eq!(r.json()["latency_ms"], 250);
    let started = Instant::now();
    assert_eq!(get(a, "/v1/health/service/web").await.status, 200);
    assert!(started.elapsed() >= Duration::from_millis(250));
    call(a, "DELETE", "/_sim/faults", &[], None).await;
    assert_eq!(sim.faults().latency_ms, 0);
}

/// A slow checks answer (a large catalog's) slows `/v1/health/state` only.
#[tokio::test]
async fn fault_slow_checks_answer() {
    let sim = start_default().await;
    let a = sim.addr();
    let r = put(a, "/_sim/faults", &json!({"checks_answer_ms": 300})).await;
    assert_eq!(r.json()["checks_answer_ms"], 300);
    let started = Instant::now();
    assert_eq!(get(a, "/v1/health/state/any").await.status, 200);
    assert!(started.elapsed() >= Duration::from_millis(300));
    let started = Instant::now();
    assert_eq!(get(a, "/v1/health/service/web").await.status, 200);
    assert!(started.elapsed() < Duration::from_millis(300), "other reads are not slowed");
    call(a, "DELETE", "/_sim/faults", &[], None).await;
    assert_eq!(sim.faults().checks_answer_ms, 0);
}

#[tokio::test]
async fn fault_no_leader_for_n_requests_and_until_cleared() {
    let sim = start_default().await;
    let a = sim.addr();
    put(a, "/_sim/faults", &json!({"no_leader": 2})).await;
    assert_eq!(get(a, "/v1/status/leader").await.json(), json!(""));
    for _ in 0..2 {
        let r = get(a, "/v1/health/service/web").await;
        assert_eq!((r.status, r.text().as_str()), (500, "No cluster leader"));
        assert!(r.header("X-Consul-Index").is_none());
    }
    assert_eq!(get(a, "/v1/health/service/web").await.status, 200);
    assert_eq!(get(a, "/v1/status/leader").await.json(), json!("127.0.0.1:8300"));

    sim.set_faults(FaultsPatch { no_leader: Some(Budget::Always), ..FaultsPatch::default() });
    for _ in 0..3 {
        assert_eq!(get(a, "/v1/health/service/web").await.status, 500);
    }
    sim.clear_faults();
    assert_eq!(get(a, "/v1/health/service/web").await.status, 200);
}

#[tokio::test]
async fn fault_too_many_requests_keeps_the_connection() {
    let sim = start_default().await;
    let a = sim.addr();
    put(a, "/_sim/faults", &json!({"too_many_requests": 1})).await;
    let mut c = Conn::open(a).await;
    let r = c.call("GET", "/v1/health/service/web", &[], None).await.unwrap();
    assert_eq!(r.status, 429);
    let r = c.call("GET", "/v1/health/service/web", &[], None).await.unwrap();
    assert_eq!(r.status, 200);
    let s = sim.stats();
    assert_eq!((s.injected_429, s.rejected_connections, s.total_429), (1, 0, 1));
    let s: Value = get(a, "/_sim/stats").await.json();
    assert_eq!(s["total_429"], 1);
    let r = call(a, "DELETE", "/_sim/stats", &[], None).await;
    assert_eq!(r.json()["total_429"], 0);
}

#[tokio::test]
async fn fault_too_many_requests_with_and_without_retry_after() {
    let sim = start_default().await;
    let a = sim.addr();
    put(a, "/_sim/faults", &json!({"too_many_requests": 1, "retry_after_s": 7})).await;
    let r = get(a, "/v1/health/service/web").await;
    assert_eq!((r.status, r.header("Retry-After")), (429, Some("7")));
    put(a, "/_sim/faults", &json!({"too_many_requests": 1, "retry_after_s": 0})).await;
    let r = get(a, "/v1/health/service/web").await;
    assert_eq!((r.status, r.header("Retry-After")), (429, None));
    assert_eq!(sim.faults().retry_after_s, 0);
}

#[tokio::test]
async fn fault_bad_body_answers_200_with_headers_and_no_json() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &[]).await;
    put(a, "/_sim/faults", &json!({"bad_body": 2})).await;
    for path in ["/v1/health/service/web", "/v1/health/state/any"] {
        let r = get(a, path).await;
        assert_eq!(r.status, 200, "{path}");
        assert!(r.index() >= 1, "{path}: Consul's headers are there");
        assert!(serde_json::from_slice::<Value>(&r.body).is_err(), "{path}: {}", r.text());
        assert!(r.text().contains("502 Bad Gateway"));
    }
    assert_eq!(get(a, "/v1/health/service/web").await.json().as_array().map(Vec::len), Some(1));
}

#[tokio::test]
async fn fault_truncated_body_sends_half_and_closes() {
    let sim = start_default().await;
    let a = sim.addr();
    for i in 0..20 {
        register(a, &format!("n{i}"), "web", &format!("web-{i}"), "passing", &[]).await;
    }
    let whole = get(a, "/v1/health/service/web").await;
    put(a, "/_sim/faults", &json!({"truncated_body": 1})).await;
    let mut c = Conn::open(a).await;
    c.send("GET", "/v1/health/service/web", &[], None).await;
    // Everything until the server closes: the head announces the whole body, half comes.
    let mut got = Vec::new();
    c.stream.read_to_end(&mut got).await.expect("read until closed");
    let head_end = got.windows(4).position(|w| w == b"\r\n\r\n").expect("the head arrived");
    let head = String::from_utf8_lossy(&got[..head_end]).to_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains(&format!("content-length: {}", whole.body.len())), "{head}");
    assert_eq!(got.len() - head_end - 4, whole.body.len() / 2, "half the body, then the connection closed");
    // The next request is whole again.
    assert_eq!(get(a, "/v1/health/service/web").await.body, whole.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_drop_blocking_closes_without_response() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &[]).await;
    let i = get(a, "/v1/health/service/web").await.index();
    let mut c = Conn::open(a).await;
    c.send("GET", &format!("/v1/health/service/web?index={i}&wait=5s"), &[], None).await;
    let mut c2 = Conn::open(a).await;
    c2.send("GET", &format!("/v1/catalog/services?index={}&wait=5s", i + 100), &[], None).await;
    wait_blocking(&sim, "web", 1).await;
    wait_blocking(&sim, consul_sim::CATALOG_SERVICES_LABEL, 1).await;
    let r = call(a, "POST", "/_sim/drop-blocking", &[], None).await;
    assert_eq!(r.json(), json!({"dropped": 2}));
    let err = tokio::time::timeout(LONG, c.read()).await.expect("closed in time");
    assert!(err.is_err(), "no response: {err:?}");
    assert!(tokio::time::timeout(LONG, c2.read()).await.unwrap().is_err());
    let recs = sim.requests();
    assert_eq!(recs.iter().filter(|r| r.outcome == Outcome::Dropped).count(), 2);
    // Non-blocking queries are unaffected, and the simulator keeps serving.
    assert_eq!(get(a, "/v1/health/service/web").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_service_index_goes_backwards() {
    let sim = start_default().await;
    let a = sim.addr();
    for n in 1..=5 {
        register(a, &format!("n{n}"), "web", &format!("web-{n}"), "passing", &[]).await;
    }
    let high = get(a, "/v1/health/service/web").await.index();
    assert!(high > 3);
    let r = put(a, "/_sim/services/web/index", &json!({"index": 2})).await;
    assert_eq!(r.json(), json!({"service": "web", "index": 2}));
    assert_eq!(put(a, "/_sim/services/nope/index", &json!({"index": 2})).await.status, 404);
    let r = get(a, "/v1/health/service/web").await;
    assert_eq!(r.index(), 2);
    assert_eq!(r.json().as_array().unwrap().len(), 5, "data unchanged");
    // A client still holding the old, higher index blocks the full wait and sees the lower one.
    let r = get(a, &format!("/v1/health/service/web?index={high}&wait=200ms")).await;
    assert_eq!(r.index(), 2);
    // And the in-process handle does the same.
    assert!(sim.set_service_index(&ServiceKey::new("web"), 1));
    assert_eq!(get(a, "/v1/health/service/web").await.index(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_restart_with_lower_index() {
    let sim = start_default().await;
    let a = sim.addr();
    for n in 1..=5 {
        register(a, &format!("n{n}"), "web", &format!("web-{n}"), "passing", &[]).await;
    }
    let high = get(a, "/v1/health/service/web").await.index();
    let mut h = spawn_get(a, format!("/v1/health/service/web?index={high}&wait=800ms"));
    wait_blocking(&sim, "web", 1).await;
    let r = call(a, "POST", "/_sim/reset-index", &[], Some(r#"{"index": 3}"#)).await;
    assert_eq!(r.json(), json!({"index": 3}));
    assert!(still_pending(&mut h, Duration::from_millis(150)).await, "a lower index does not answer");
    let r = h.await.unwrap();
    assert_eq!(r.index(), 3);
    assert_eq!(r.json().as_array().unwrap().len(), 5);
    assert_eq!(get(a, "/v1/catalog/services").await.index(), 3);
    assert_eq!(get(a, "/v1/health/service/ghost").await.index(), 3);
    // The next write continues from there.
    register(a, "n1", "web", "web-1", "critical", &[]).await;
    assert_eq!(get(a, "/v1/health/service/web").await.index(), 4);
}

// ---------------------------------------------------------------- health state

/// Registers `web-1` on n1 with port `port` and its check in `status`, as the table of
/// `docs/consul-protocol.md` ("Watching every check at once") does.
async fn register_web(addr: SocketAddr, port: u16, status: &str) {
    let r = put(
        addr,
        "/v1/catalog/register",
        &json!({
            "Node": "n1", "Address": "10.0.0.1",
            "Service": {"ID": "web-1", "Service": "web", "Port": port, "Tags": ["blue"]},
            "Check": {"CheckID": "service:web-1", "Name": "alive", "Status": status, "ServiceID": "web-1"},
        }),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

fn check_named<'a>(checks: &'a Value, id: &str) -> &'a Value {
    checks.as_array().unwrap().iter().find(|c| c["CheckID"] == id).unwrap_or_else(|| panic!("no {id} in {checks}"))
}

#[tokio::test]
async fn checks_index_follows_the_observed_table() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n2", "api", "api-1", "passing", &[]).await;
    let api_written = get(a, "/v1/health/state/any").await.index();

    // register: both indexes move, the check is written at that index.
    register_web(a, 8080, "passing").await;
    let services = get(a, "/v1/catalog/services").await.index();
    let state = get(a, "/v1/health/state/any").await;
    assert_eq!(state.index(), services);
    assert_eq!(check_named(&state.json(), "service:web-1")["ModifyIndex"], services);
    assert_eq!(check_named(&state.json(), "service:web-1")["CreateIndex"], services);

    // same check, new port: both move, the check is rewritten.
    register_web(a, 9090, "passing").await;
    let services2 = get(a, "/v1/catalog/services").await.index();
    let state = get(a, "/v1/health/state/any").await;
    assert_eq!(services2, services + 1);
    assert_eq!(state.index(), services2);
    assert_eq!(check_named(&state.json(), "service:web-1")["ModifyIndex"], services2);

    // check -> critical: only the checks index moves, and only that check's ModifyIndex.
    register_web(a, 9090, "critical").await;
    assert_eq!(get(a, "/v1/catalog/services").await.index(), services2);
    let state = get(a, "/v1/health/state/any").await;
    assert_eq!(state.index(), services2 + 1);
    let body = state.json();
    let web = check_named(&body, "service:web-1");
    assert_eq!((web["ModifyIndex"].as_u64(), web["CreateIndex"].as_u64()), (Some(services2 + 1), Some(services)));
    assert_eq!(web["Status"], "critical");
    assert_eq!(check_named(&body, "service:api-1")["ModifyIndex"], api_written);

    // The shape: sorted by (Node, CheckID), every documented field.
    let nodes: Vec<_> = body.as_array().unwrap().iter().map(|c| c["Node"].as_str().unwrap().to_owned()).collect();
    assert_eq!(nodes, ["n1", "n2"]);
    for f in [
        "Node",
        "CheckID",
        "Name",
        "Status",
        "Notes",
        "Output",
        "ServiceID",
        "ServiceName",
        "ServiceTags",
        "Type",
        "CreateIndex",
        "ModifyIndex",
    ] {
        assert!(web.get(f).is_some(), "{f} in {web}");
    }
    assert_eq!((&web["ServiceName"], &web["ServiceTags"], &web["Type"]), (&json!("web"), &json!(["blue"]), &json!("")));
    assert!(web.get("Namespace").is_none());
    assert_eq!(state.header("X-Consul-KnownLeader"), Some("true"));
    assert_eq!(state.header("Content-Type"), Some("application/json"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_state_blocks_on_the_checks_index() {
    let sim = start_default().await;
    let a = sim.addr();
    register_web(a, 8080, "passing").await;
    let i = get(a, "/v1/health/state/any").await.index();
    let mut h = spawn_get(a, format!("/v1/health/state/any?index={i}&wait=5s"));
    wait_blocking(&sim, consul_sim::HEALTH_STATE_LABEL, 1).await;
    // A service registered without a check is a catalog write, not a checks write.
    let r = put(a, "/v1/catalog/register", &json!({"Node": "n2", "Address": "10.0.0.2", "Service": {"Service": "db"}}))
        .await;
    assert_eq!(r.status, 200);
    assert!(get(a, "/v1/catalog/services").await.index() > i);
    assert!(still_pending(&mut h, Duration::from_millis(300)).await, "a check-less write must not answer");
    assert_eq!(get(a, "/v1/health/state/any").await.index(), i);
    // A check write does.
    register_web(a, 8080, "warning").await;
    let r = tokio::time::timeout(LONG, h).await.expect("woken").unwrap();
    assert!(r.index() > i);
    assert_eq!(r.json()[0]["Status"], "warning");
    let rec = sim.requests().into_iter().find(|r| r.query == format!("index={i}&wait=5s")).unwrap();
    assert_eq!((rec.path.as_str(), rec.outcome, rec.wait_ms), ("/v1/health/state/any", Outcome::Answered, Some(5000)));

    // A timeout answers the same index and the full body.
    let r = get(a, &format!("/v1/health/state/any?index={}&wait=100ms", r.index())).await;
    assert_eq!(r.json().as_array().unwrap().len(), 1);
}

/// A query of one state waits for a write to a check of that state, not for any check
/// write, as Consul 1.8.7 does (a passing check rewritten with its instance's new port leaves
/// a blocked `critical` query waiting); it still reports the checks table's index, and an
/// index already behind that answers at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_query_waits_for_a_check_of_its_state() {
    let sim = start_default().await;
    let a = sim.addr();
    register_web(a, 8080, "passing").await;
    let i = get(a, "/v1/health/state/critical").await.index();
    let mut h = spawn_get(a, format!("/v1/health/state/critical?index={i}&wait=5s"));
    wait_blocking(&sim, consul_sim::HEALTH_STATE_LABEL, 1).await;
    register_web(a, 8081, "passing").await;
    let moved = get(a, "/v1/health/state/any").await.index();
    assert!(moved > i, "the passing check was rewritten");
    assert!(still_pending(&mut h, Duration::from_millis(300)).await, "a passing write must not answer");
    register_web(a, 8081, "critical").await;
    let r = tokio::time::timeout(LONG, h).await.expect("a check turning critical answers").unwrap();
    assert!(r.index() > moved);
    assert_eq!(r.json()[0]["Status"], "critical");

    // Leaving the state wakes it too.
    let j = r.index();
    let h = spawn_get(a, format!("/v1/health/state/critical?index={j}&wait=5s"));
    wait_blocking(&sim, consul_sim::HEALTH_STATE_LABEL, 1).await;
    register_web(a, 8081, "passing").await;
    let r = tokio::time::timeout(LONG, h).await.expect("a check leaving critical answers").unwrap();
    assert!(r.index() > j);
    assert_eq!(r.json().as_array().unwrap().len(), 0);

    // An index the table has passed answers at once, whatever the write was.
    register_web(a, 8082, "passing").await;
    let behind = format!("/v1/health/state/critical?index={}&wait=5s", r.index());
    let r = tokio::time::timeout(Duration::from_secs(2), get(a, &behind)).await.expect("answered at once");
    assert!(r.index() > j);
}

#[tokio::test]
async fn health_state_filters_by_state_and_shows_node_checks() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &["blue"]).await;
    register(a, "n2", "web", "web-2", "warning", &[]).await;
    register(a, "n3", "api", "api-1", "critical", &[]).await;
    register_node_check(a, "n1", "critical").await;
    let ids = |r: Reply| -> Vec<String> {
        r.json()
            .as_array()
            .unwrap()
            .iter()
            .map(|c| format!("{}/{}", c["Node"].as_str().unwrap(), c["CheckID"].as_str().unwrap()))
            .collect()
    };
    assert_eq!(
        ids(get(a, "/v1/health/state/any").await),
        ["n1/serfHealth", "n1/service:web-1", "n2/service:web-2", "n3/service:api-1"]
    );
    assert_eq!(ids(get(a, "/v1/health/state/passing").await), ["n1/service:web-1"]);
    assert_eq!(ids(get(a, "/v1/health/state/warning").await), ["n2/service:web-2"]);
    assert_eq!(ids(get(a, "/v1/health/state/critical").await), ["n1/serfHealth", "n3/service:api-1"]);

    let any = get(a, "/v1/health/state/any").await.json();
    let serf = check_named(&any, "serfHealth");
    assert_eq!((&serf["ServiceID"], &serf["ServiceName"], &serf["ServiceTags"]), (&json!(""), &json!(""), &json!([])));

    // Namespaces: service checks of that namespace, node checks whatever the namespace.
    let body = json!({"Node": "n9", "Address": "10.0.0.9", "Service": {"ID": "t1", "Service": "team-svc"},
        "Check": {"CheckID": "t1-check", "Status": "passing", "ServiceID": "t1"}});
    assert_eq!(put(a, "/v1/catalog/register?ns=team", &body).await.status, 200);
    assert_eq!(ids(get(a, "/v1/health/state/any?ns=team").await), ["n1/serfHealth", "n9/t1-check"]);
    let r = call(a, "GET", "/v1/health/state/passing", &[("X-Consul-Namespace", "team")], None).await;
    let team = r.json();
    assert_eq!((&team[0]["Namespace"], &team[0]["Partition"]), (&json!("team"), &json!("default")));
    assert!(!ids(get(a, "/v1/health/state/any").await).contains(&"n9/t1-check".to_owned()));

    // Older shapes: null tags on node checks, no newer fields.
    sim.set_faults(FaultsPatch { null_variants: Some(true), ..FaultsPatch::default() });
    let any = get(a, "/v1/health/state/any").await.json();
    let serf = check_named(&any, "serfHealth");
    assert_eq!(serf["ServiceTags"], Value::Null);
    assert!(serf.get("Type").is_none());
}

#[tokio::test]
async fn health_state_errors_and_faults() {
    let sim = start_default().await;
    let a = sim.addr();
    for (target, status, body) in [
        ("/v1/health/state/bogus", 400, "Invalid check state"),
        ("/v1/health/state/ANY", 400, "Invalid check state"),
        ("/v1/health/state/", 400, "Missing check state"),
        (
            "/v1/health/state/any?stale&consistent",
            400,
            "Cannot specify ?stale with ?consistent, conflicting semantics.",
        ),
        ("/v1/health/state/any?index=x", 400, "Invalid index"),
        ("/v1/health/state/any?wait=10", 400, "Invalid wait time"),
        ("/v1/health/state/any?dc=dc2", 500, "No path to datacenter"),
    ] {
        let r = get(a, target).await;
        assert_eq!((r.status, r.text().as_str()), (status, body), "{target}");
        assert!(r.header("X-Consul-Index").is_none(), "{target}");
    }
    assert_eq!(get(a, "/v1/health/state/any?filter=Status%3D%3Dpassing").await.status, 400);
    assert_eq!(call(a, "PUT", "/v1/health/state/any", &[], Some("")).await.status, 405);
    let r = get(a, "/v1/health/state/any?stale&cached&dc=dc1").await;
    assert_eq!((r.status, r.json()), (200, json!([])));
    assert_eq!(r.header("X-Consul-Effective-Consistency"), Some("stale"));

    put(a, "/_sim/faults", &json!({"no_leader": 1, "too_many_requests": 1})).await;
    assert_eq!(get(a, "/v1/health/state/any").await.status, 429);
    let r = get(a, "/v1/health/state/any").await;
    assert_eq!((r.status, r.text().as_str()), (500, "No cluster leader"));
    assert_eq!(get(a, "/v1/health/state/any").await.status, 200);
    assert_eq!(sim.stats().injected_429, 1);
    assert!(sim.requests().iter().all(|r| r.service.is_none()), "not a service query");
}

#[tokio::test]
async fn health_state_filters_service_checks_by_acl() {
    let sim = start(acl_config()).await;
    let a = sim.addr();
    let root = [("X-Consul-Token", "root")];
    for (node, svc) in [("n1", "web"), ("n2", "db")] {
        let body = json!({"Node": node, "Address": "10.0.0.1", "Service": {"Service": svc},
            "Checks": [{"CheckID": format!("{svc}-check"), "Status": "passing", "ServiceID": svc},
                       {"CheckID": "serfHealth", "Status": "passing"}]});
        let r = call(a, "PUT", "/v1/catalog/register", &root, Some(&body.to_string())).await;
        assert_eq!(r.status, 200, "{}", r.text());
    }
    let checks = |r: &Reply| -> Vec<String> {
        r.json().as_array().unwrap().iter().map(|c| c["CheckID"].as_str().unwrap().to_owned()).collect()
    };
    let r = call(a, "GET", "/v1/health/state/any", &root, None).await;
    assert_eq!(checks(&r), ["serfHealth", "web-check", "db-check", "serfHealth"]);
    assert_eq!(r.header("X-Consul-Results-Filtered-By-ACLs"), None);
    let r = call(a, "GET", "/v1/health/state/any", &[("X-Consul-Token", "reader")], None).await;
    assert_eq!(checks(&r), ["serfHealth", "web-check", "serfHealth"], "db's check is hidden, node checks are not");
    assert_eq!(r.header("X-Consul-Results-Filtered-By-ACLs"), Some("true"));
    assert_eq!(r.header("X-Consul-Default-ACL-Policy"), Some("deny"));
    let r = get(a, "/v1/health/state/any").await;
    assert_eq!(checks(&r), ["serfHealth", "serfHealth"], "anonymous");
    let r = call(a, "GET", "/v1/health/state/any", &[("X-Consul-Token", "bogus")], None).await;
    assert_eq!((r.status, r.text().as_str()), (403, "ACL not found"));
}

// ---------------------------------------------------------------- nodes and their services

/// The `(ID, Port, ModifyIndex)` of each instance of a `/v1/catalog/node-services` answer.
fn instances(r: &Reply) -> Vec<(String, u64, u64)> {
    let services = r.json()["Services"].as_array().cloned().unwrap_or_default();
    services
        .iter()
        .map(|s| {
            (s["ID"].as_str().unwrap().to_owned(), s["Port"].as_u64().unwrap(), s["ModifyIndex"].as_u64().unwrap())
        })
        .collect()
}

/// As Consul 1.8 answers them: every node with the index that last wrote it; a node's
/// instances, each with the index of the write that last changed it (a port change moves
/// it, a check write does not); the index of the nodes table, and the later of the nodes'
/// and services' tables for a node's services; an unknown node as nulls at index 1.
#[tokio::test]
async fn nodes_and_node_services_carry_the_index_of_their_last_write() {
    let sim = start_default().await;
    let a = sim.addr();
    register_web(a, 8080, "passing").await;
    register(a, "n22", "api", "api-1", "passing", &[]).await;
    let created = get(a, "/v1/catalog/services").await.index();
    let r = get(a, "/v1/catalog/nodes").await;
    assert_eq!((r.status, r.index()), (200, created), "n22 was created by the last write");
    let nodes = r.json();
    let names: Vec<_> = nodes.as_array().unwrap().iter().map(|n| n["Node"].as_str().unwrap()).collect();
    assert_eq!(names, ["n1", "n22"]);
    for f in ["ID", "Node", "Address", "Datacenter", "TaggedAddresses", "Meta", "CreateIndex", "ModifyIndex"] {
        assert!(nodes[0].get(f).is_some(), "{f} in {}", nodes[0]);
    }
    assert_eq!((&nodes[1]["CreateIndex"], &nodes[1]["ModifyIndex"]), (&json!(created), &json!(created)));

    // A port change: the instance's ModifyIndex and the services table move, the node's not.
    register_web(a, 9090, "passing").await;
    let moved = get(a, "/v1/catalog/services").await.index();
    let r = get(a, "/v1/catalog/node-services/n1").await;
    assert_eq!((r.status, r.index()), (200, moved));
    assert_eq!(instances(&r), [("web-1".to_owned(), 9090, moved)]);
    let body = r.json();
    assert_eq!((&body["Node"]["Node"], &body["Node"]["ModifyIndex"]), (&json!("n1"), &json!(created - 1)));
    for f in ["ID", "Service", "Tags", "Address", "Port", "Meta", "Weights", "CreateIndex", "ModifyIndex"] {
        assert!(body["Services"][0].get(f).is_some(), "{f} in {}", body["Services"][0]);
    }
    assert_eq!(get(a, "/v1/catalog/nodes").await.index(), created, "no node changed");
    // A check write moves neither.
    register_web(a, 9090, "critical").await;
    assert_eq!(instances(&get(a, "/v1/catalog/node-services/n1").await), [("web-1".to_owned(), 9090, moved)]);
    // A node's address: the node and the nodes table move.
    let r = put(a, "/v1/catalog/register", &json!({"Node": "n1", "Address": "10.9.9.9"})).await;
    assert_eq!(r.status, 200);
    let readdressed = get(a, "/v1/catalog/nodes").await;
    assert_eq!(readdressed.json()[0]["ModifyIndex"], json!(readdressed.index()));
    assert_eq!(get(a, "/v1/catalog/node-services/n1").await.index(), readdressed.index());

    let r = get(a, "/v1/catalog/node-services/nowhere").await;
    assert_eq!((r.status, r.index(), r.json()), (200, 1, json!({"Node": null, "Services": null})));
    let r = get(a, "/v1/catalog/node-services/").await;
    assert_eq!((r.status, r.text().as_str()), (400, "Missing node name"));
    assert_eq!(call(a, "PUT", "/v1/catalog/nodes", &[], None).await.status, 405);
    // Before 1.7 the path is unknown.
    sim.set_faults(FaultsPatch { ignores_newer_parameters: Some(true), ..FaultsPatch::default() });
    assert_eq!(get(a, "/v1/catalog/node-services/n1").await.status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_services_block_and_follow_acls() {
    let sim = start(acl_config()).await;
    let a = sim.addr();
    let root = [("X-Consul-Token", "root")];
    for (svc, id) in [("web", "web-1"), ("db", "db-1")] {
        let body = json!({"Node": "n1", "Address": "10.0.0.1", "Service": {"ID": id, "Service": svc, "Port": 80}});
        assert_eq!(call(a, "PUT", "/v1/catalog/register", &root, Some(&body.to_string())).await.status, 200);
    }
    let r = call(a, "GET", "/v1/catalog/node-services/n1", &[("X-Consul-Token", "reader")], None).await;
    assert_eq!(instances(&r).iter().map(|i| i.0.as_str()).collect::<Vec<_>>(), ["web-1"], "db is hidden");
    assert_eq!(r.header("X-Consul-Results-Filtered-By-ACLs"), Some("true"));
    let r = call(a, "GET", "/v1/catalog/nodes", &[("X-Consul-Token", "reader")], None).await;
    assert_eq!(r.json().as_array().unwrap().len(), 1, "node rules are not modelled: every node is shown");
    let r = call(a, "GET", "/v1/catalog/node-services/n1", &[("X-Consul-Token", "bogus")], None).await;
    assert_eq!((r.status, r.text().as_str()), (403, "ACL not found"));
    assert_eq!(call(a, "GET", "/v1/catalog/nodes", &[("X-Consul-Token", "bogus")], None).await.status, 403);

    // Blocking: a port change on the node answers.
    let i = call(a, "GET", "/v1/catalog/node-services/n1", &root, None).await.index();
    let mut h = spawn_get(a, format!("/v1/catalog/node-services/n1?index={i}&wait=5s&token=root"));
    wait_blocking(&sim, &format!("{}n1", consul_sim::NODE_SERVICES_LABEL_PREFIX), 1).await;
    assert!(still_pending(&mut h, Duration::from_millis(200)).await);
    let body = json!({"Node": "n1", "Address": "10.0.0.1", "Service": {"ID": "db-1", "Service": "db", "Port": 81}});
    assert_eq!(call(a, "PUT", "/v1/catalog/register", &root, Some(&body.to_string())).await.status, 200);
    let r = tokio::time::timeout(LONG, h).await.expect("woken").unwrap();
    assert_eq!(instances(&r)[0], ("db-1".to_owned(), 81, r.index()));
}

/// Consul 1.8 keeps a check that a registration names again unchanged: a port change moves
/// the catalog and the instance, not the check nor the checks index. Its tags still rewrite
/// it (the check shows them), and so does a change of its own.
#[tokio::test]
async fn keeps_unchanged_checks_leaves_the_check_of_a_port_change() {
    for at_start in [true, false] {
        let sim = start_with_switch("keeps_unchanged_checks", at_start, |c| c.keeps_unchanged_checks = true).await;
        let a = sim.addr();
        register_web(a, 8080, "passing").await;
        let written = get(a, "/v1/health/state/any").await.index();
        register_web(a, 9090, "passing").await;
        let moved = get(a, "/v1/catalog/services").await.index();
        assert_eq!(moved, written + 1);
        let state = get(a, "/v1/health/state/any").await;
        assert_eq!(state.index(), written, "the checks did not move");
        assert_eq!(check_named(&state.json(), "service:web-1")["ModifyIndex"], written);
        assert_eq!(instances(&get(a, "/v1/catalog/node-services/n1").await), [("web-1".to_owned(), 9090, moved)]);
        register_web(a, 9090, "critical").await;
        assert_eq!(get(a, "/v1/health/state/any").await.index(), moved + 1, "a change of its own is written");
        let r = put(
            a,
            "/v1/catalog/register",
            &json!({"Node": "n1", "Address": "10.0.0.1",
                    "Service": {"ID": "web-1", "Service": "web", "Port": 9090, "Tags": ["green"]},
                    "Check": {"CheckID": "service:web-1", "Name": "alive", "Status": "critical", "ServiceID": "web-1"}}),
        )
        .await;
        assert_eq!(r.status, 200);
        let state = get(a, "/v1/health/state/any").await;
        assert_eq!(check_named(&state.json(), "service:web-1")["ModifyIndex"], json!(moved + 2), "new tags: rewritten");
    }
}

// ---------------------------------------------------------------- older agents

/// Starts a simulator with one older-agent switch on from the start (`at_start`), or with
/// it off and then flipped on at run time through `PUT /_sim/faults`.
async fn start_with_switch(name: &str, at_start: bool, set: fn(&mut Config)) -> RunningSim {
    let mut config = Config::default();
    if at_start {
        set(&mut config);
    }
    let sim = start(config).await;
    assert_eq!(sim.faults().quirk(name), at_start, "{name} at start");
    if !at_start {
        let r = put(sim.addr(), "/_sim/faults", &json!({ name: true })).await;
        assert_eq!((r.status, &r.json()[name]), (200, &json!(true)), "{name}");
    }
    sim
}

trait Quirk {
    fn quirk(&self, name: &str) -> bool;
}

impl Quirk for consul_sim::Faults {
    fn quirk(&self, name: &str) -> bool {
        serde_json::to_value(self).unwrap()[name].as_bool().unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_health_index_wakes_unrelated_services() {
    for at_start in [true, false] {
        let sim = start_with_switch("single_health_index", at_start, |c| c.single_health_index = true).await;
        let a = sim.addr();
        register(a, "n1", "alpha", "alpha-1", "passing", &[]).await;
        register(a, "n2", "beta", "beta-1", "passing", &[]).await;
        let alpha = get(a, "/v1/health/service/alpha").await;
        let beta = get(a, "/v1/health/service/beta").await;
        assert_eq!(alpha.index(), beta.index(), "one index for every service");
        assert_eq!(get(a, "/v1/health/service/ghost").await.index(), beta.index());

        let mut h = spawn_get(a, format!("/v1/health/service/alpha?index={}&wait=5s", alpha.index()));
        wait_blocking(&sim, "alpha", 1).await;
        register(a, "n2", "beta", "beta-1", "critical", &[]).await;
        let r = tokio::time::timeout(LONG, &mut h).await.expect("a write to beta wakes alpha").unwrap();
        assert!(r.index() > alpha.index());
        assert_eq!(r.json(), alpha.json(), "with an unchanged body");
        // The checks table keeps its own index.
        assert_eq!(get(a, "/v1/health/state/any").await.index(), r.index());
        let r = put(a, "/v1/catalog/register", &json!({"Node": "n3", "Address": "10.0.0.3"})).await;
        assert_eq!(r.status, 200);
        assert!(get(a, "/v1/health/state/any").await.index() < get(a, "/v1/health/service/alpha").await.index());

        // Off again: alpha has its own index, that of its registration (just before beta's).
        sim.set_faults(FaultsPatch { single_health_index: Some(false), ..FaultsPatch::default() });
        assert_eq!(get(a, "/v1/health/service/alpha").await.index(), beta.index() - 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_index_when_empty_answers_zero_at_once() {
    for at_start in [true, false] {
        let sim = start_with_switch("zero_index_when_empty", at_start, |c| c.zero_index_when_empty = true).await;
        let a = sim.addr();
        for target in [
            "/v1/health/service/web",
            "/v1/health/service/web?index=100&wait=5s",
            "/v1/catalog/services?index=100&wait=5s",
            "/v1/health/state/any?index=100&wait=5s",
        ] {
            let r = tokio::time::timeout(Duration::from_secs(2), get(a, target)).await.expect("answers at once");
            assert_eq!((r.status, r.index()), (200, 0), "{target}");
        }
        // A node (no service) is not enough; a service is.
        let r = put(a, "/v1/catalog/register", &json!({"Node": "n0", "Address": "10.0.0.1"})).await;
        assert_eq!(r.status, 200);
        assert_eq!(get(a, "/v1/health/service/web").await.index(), 0);
        register(a, "n1", "web", "web-1", "passing", &[]).await;
        let i = get(a, "/v1/health/service/web").await.index();
        assert!(i >= 1);
        let mut h = spawn_get(a, format!("/v1/health/service/web?index={i}&wait=5s"));
        wait_blocking(&sim, "web", 1).await;
        assert!(still_pending(&mut h, Duration::from_millis(100)).await, "blocks again once a service exists");
        // Empty again: the blocker, woken by the write, answers 0.
        put(a, "/v1/catalog/deregister", &json!({"Node": "n1"})).await;
        let r = tokio::time::timeout(LONG, h).await.unwrap().unwrap();
        assert_eq!(r.index(), 0);
        sim.clear_faults();
        assert_eq!(get(a, "/v1/health/service/web").await.index() >= 1, !at_start);
    }
}

#[tokio::test]
async fn first_tag_only_ignores_later_tags() {
    for at_start in [true, false] {
        let sim = start_with_switch("first_tag_only", at_start, |c| c.first_tag_only = true).await;
        let a = sim.addr();
        register(a, "n1", "web", "web-1", "passing", &["blue", "v2"]).await;
        register(a, "n2", "web", "web-2", "passing", &["blue"]).await;
        register(a, "n3", "web", "web-3", "passing", &["v2"]).await;
        let ids = |r: Reply| -> Vec<String> {
            r.json().as_array().unwrap().iter().map(|e| e["Service"]["ID"].as_str().unwrap().to_owned()).collect()
        };
        assert_eq!(ids(get(a, "/v1/health/service/web?tag=blue&tag=v2").await), ["web-1", "web-2"]);
        assert_eq!(ids(get(a, "/v1/health/service/web?tag=v2&tag=nope").await), ["web-1", "web-3"]);
        sim.set_faults(FaultsPatch { first_tag_only: Some(false), ..FaultsPatch::default() });
        assert_eq!(ids(get(a, "/v1/health/service/web?tag=blue&tag=v2").await), ["web-1"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_server_cancel_keeps_abandoned_queries() {
    for at_start in [true, false] {
        let sim = start_with_switch("no_server_cancel", at_start, |c| c.no_server_cancel = true).await;
        let a = sim.addr();
        register(a, "n1", "web", "web-1", "passing", &[]).await;
        register(a, "n2", "api", "api-1", "passing", &[]).await;
        let i = get(a, "/v1/health/service/web").await.index();

        // Abandoned, then woken by a write to its service.
        let mut c = Conn::open(a).await;
        c.send("GET", &format!("/v1/health/service/web?index={i}&wait=5s"), &[], None).await;
        wait_blocking(&sim, "web", 1).await;
        drop(c);
        let (s, ok) = sim.wait_for_stats(LONG, |s| s.blocking_detached == 1).await;
        assert!(ok, "the server saw the client go: {s:?}");
        assert_eq!(s.blocking.get("web"), Some(&1), "and still holds the query");
        assert!(sim.requests().iter().any(|r| r.outcome == Outcome::Cancelled));
        assert_eq!(s.open_connections_total, 0, "the connection itself is gone");
        register(a, "n2", "api", "api-1", "critical", &[]).await;
        assert_eq!(sim.stats().blocking.get("web"), Some(&1), "a write elsewhere does not wake it");
        register(a, "n1", "web", "web-1", "critical", &[]).await;
        let (s, ok) = sim.wait_for_stats(LONG, |s| s.blocking_total == 0 && s.blocking_detached == 0).await;
        assert!(ok, "a write to web ends it: {s:?}");

        // Abandoned, then its wait ends.
        let i = get(a, "/v1/health/service/web").await.index();
        let mut c = Conn::open(a).await;
        c.send("GET", &format!("/v1/health/service/web?index={i}&wait=300ms"), &[], None).await;
        wait_blocking(&sim, "web", 1).await;
        drop(c);
        let (s, ok) = sim.wait_for_stats(LONG, |s| s.blocking_total == 0 && s.blocking_detached == 0).await;
        assert!(ok, "its wait ends it: {s:?}");

        // A client that stays gets its answer as usual.
        let mut h = spawn_get(a, format!("/v1/health/service/web?index={i}&wait=5s"));
        wait_blocking(&sim, "web", 1).await;
        register(a, "n1", "web", "web-1", "passing", &[]).await;
        assert!(tokio::time::timeout(LONG, &mut h).await.unwrap().unwrap().index() > i);
        assert_eq!(sim.stats().blocking_detached, 0);

        // Off: the server drops the query with its client.
        sim.set_faults(FaultsPatch { no_server_cancel: Some(false), ..FaultsPatch::default() });
        let i = get(a, "/v1/health/service/web").await.index();
        let mut c = Conn::open(a).await;
        c.send("GET", &format!("/v1/health/service/web?index={i}&wait=5s"), &[], None).await;
        wait_blocking(&sim, "web", 1).await;
        drop(c);
        let (s, ok) = sim.wait_for_stats(LONG, |s| s.blocking_total == 0).await;
        assert!(ok && s.blocking_detached == 0, "{s:?}");
    }
}

#[tokio::test]
async fn unknown_state_is_empty_answers_an_empty_list() {
    for at_start in [true, false] {
        let sim = start_with_switch("unknown_state_is_empty", at_start, |c| c.unknown_state_is_empty = true).await;
        let a = sim.addr();
        register(a, "n1", "web", "web-1", "passing", &[]).await;
        let r = get(a, "/v1/health/state/bogus").await;
        assert_eq!((r.status, r.json()), (200, json!([])));
        assert_eq!(r.index(), get(a, "/v1/health/state/any").await.index());
        assert_eq!(get(a, "/v1/health/state/").await.status, 400, "a missing state is still refused");
        sim.clear_faults();
        assert_eq!(get(a, "/v1/health/state/bogus").await.status, if at_start { 200 } else { 400 });
    }
}

#[tokio::test]
async fn legacy_config_is_a_0_9_agent() {
    let sim = start(Config::legacy()).await;
    let a = sim.addr();
    let f = sim.faults();
    for name in [
        "null_variants",
        "single_health_index",
        "zero_index_when_empty",
        "first_tag_only",
        "no_server_cancel",
        "unknown_state_is_empty",
    ] {
        assert!(f.quirk(name), "{name}");
    }
    assert_eq!(get(a, "/v1/health/service/web").await.index(), 0);
    register(a, "n1", "web", "web-1", "passing", &[]).await;
    assert_eq!(get(a, "/v1/health/service/web").await.json()[0]["Service"]["Meta"], Value::Null);
    // No connection limit: more than the default 200 at once.
    let mut held = Vec::new();
    for _ in 0..210 {
        held.push(Conn::open(a).await);
    }
    let (s, ok) = sim.wait_for_stats(LONG, |s| s.open_connections_total == 210).await;
    assert!(ok && s.rejected_connections == 0, "{s:?}");
}

// ---------------------------------------------------------------- writes, catalog, control

#[tokio::test]
async fn register_and_deregister() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &[]).await;
    let i = get(a, "/v1/health/service/web").await.index();
    // Identical re-registration changes nothing (no index churn).
    register(a, "n1", "web", "web-1", "passing", &[]).await;
    assert_eq!(get(a, "/v1/health/service/web").await.index(), i);
    // A check flip via `Checks` list.
    let r = put(
        a,
        "/v1/catalog/register",
        &json!({"Node": "n1", "Address": "10.0.0.2", "Checks": [{"CheckID": "service:web-1", "Name": "alive", "Status": "critical", "ServiceID": "web-1"}]}),
    )
    .await;
    assert_eq!(r.status, 200);
    let r = get(a, "/v1/health/service/web").await;
    assert!(r.index() > i);
    assert_eq!(r.json()[0]["Checks"][0]["Status"], "critical");
    // Deregister a check, then the node.
    let r = put(a, "/v1/catalog/deregister", &json!({"Node": "n1", "CheckID": "service:web-1"})).await;
    assert_eq!(r.json(), json!(true));
    assert!(get(a, "/v1/health/service/web").await.json()[0]["Checks"].as_array().unwrap().is_empty());
    register(a, "n1", "api", "api-1", "passing", &[]).await;
    let r = put(a, "/v1/catalog/deregister", &json!({"Node": "n1"})).await;
    assert_eq!(r.json(), json!(true));
    assert_eq!(get(a, "/v1/health/service/web").await.json(), json!([]));
    assert_eq!(get(a, "/v1/catalog/services").await.json(), json!({}));
    // Deregistering what does not exist is still `true`.
    assert_eq!(put(a, "/v1/catalog/deregister", &json!({"Node": "zz"})).await.json(), json!(true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catalog_services_lists_tags_and_blocks() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &["b", "a"]).await;
    register(a, "n2", "web", "web-2", "passing", &["c", "a"]).await;
    let r = get(a, "/v1/catalog/services").await;
    assert_eq!(r.json(), json!({"web": ["a", "b", "c"]}));
    let i = r.index();
    let mut h = spawn_get(a, format!("/v1/catalog/services?index={i}&wait=5s"));
    wait_blocking(&sim, consul_sim::CATALOG_SERVICES_LABEL, 1).await;
    // A check change is not a catalog services change.
    register(a, "n1", "web", "web-1", "critical", &["b", "a"]).await;
    assert!(still_pending(&mut h, Duration::from_millis(200)).await);
    register(a, "n3", "db", "db-1", "passing", &[]).await;
    let r = tokio::time::timeout(LONG, h).await.unwrap().unwrap();
    assert!(r.index() > i);
    assert_eq!(r.json()["db"], json!([]));
}

#[tokio::test]
async fn namespaces_scope_services() {
    let sim = start_default().await;
    let a = sim.addr();
    let body = json!({"Node": "n1", "Address": "10.0.0.1", "Service": {"Service": "web", "Port": 80}});
    assert_eq!(put(a, "/v1/catalog/register?ns=team-a", &body).await.status, 200);
    assert_eq!(get(a, "/v1/health/service/web").await.json(), json!([]));
    let r = get(a, "/v1/health/service/web?ns=team-a").await;
    assert_eq!(r.json()[0]["Service"]["Namespace"], "team-a");
    let r = call(a, "GET", "/v1/health/service/web", &[("X-Consul-Namespace", "team-a")], None).await;
    assert_eq!(r.json().as_array().unwrap().len(), 1);
    let recs = sim.requests();
    let scoped: Vec<_> = recs.iter().filter(|r| r.namespace.as_deref() == Some("team-a")).collect();
    assert_eq!(scoped.len(), 3, "query and header forms are both recorded: {recs:?}");
}

#[tokio::test]
async fn status_leader_and_datacenters() {
    let sim = start_default().await;
    let a = sim.addr();
    assert_eq!(get(a, "/v1/status/leader").await.json(), json!("127.0.0.1:8300"));
    assert_eq!(get(a, "/v1/catalog/datacenters").await.json(), json!(["dc1"]));
}

#[tokio::test]
async fn request_log_counts_queries() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &[]).await;
    get(a, "/v1/health/service/web?passing").await;
    get(a, "/v1/health/service/api").await;
    get(a, "/_sim/stats").await; // control requests are not logged
    let r = get(a, "/_sim/requests?path_prefix=/v1/health/service/web").await;
    let recs: Vec<consul_sim::RequestRecord> = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(recs.len(), 1, "exactly one query for web");
    assert_eq!(recs[0].query, "passing");
    assert_eq!(recs[0].service.as_deref(), Some("web"));
    assert_eq!(sim.requests().iter().filter(|r| r.service.as_deref() == Some("api")).count(), 1);
    assert_eq!((recs[0].status, recs[0].outcome), (Some(200), Outcome::Answered));
    assert!(recs[0].index.is_some());
    assert_eq!(sim.requests().len(), 3);
    let r = call(a, "DELETE", "/_sim/requests", &[], None).await;
    assert_eq!(r.json(), json!({"cleared": 3}));
    assert!(sim.requests().is_empty());
    let r = put(a, "/_sim/faults", &json!({"latency": 5})).await;
    assert_eq!(r.status, 400, "unknown fault fields are rejected");
    assert_eq!(get(a, "/_sim/nope").await.status, 404);
}

#[test]
fn background_simulator_serves_sync_callers() {
    let sim = Simulator::start_background(Config::default()).unwrap();
    let mut s = std::net::TcpStream::connect(sim.addr()).unwrap();
    use std::io::Write as _;
    s.write_all(b"GET /v1/status/leader HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(out.ends_with("\"127.0.0.1:8300\""), "{out}");
    let addr = sim.addr();
    // Dropping joins the server thread, whose runtime owned the listener.
    drop(sim);
    assert!(std::net::TcpStream::connect(addr).is_err(), "still accepting after drop");
}

#[tokio::test]
async fn dropping_the_handle_stops_the_server() {
    let sim = start_default().await;
    let a = sim.addr();
    let mut c = Conn::open(a).await;
    assert_eq!(c.call("GET", "/v1/status/leader", &[], None).await.unwrap().status, 200);
    drop(sim);
    assert!(tokio::time::timeout(LONG, c.closed()).await.unwrap());
    let deadline = Instant::now() + LONG;
    while TcpStream::connect(a).await.is_ok() {
        assert!(Instant::now() < deadline, "still accepting after drop");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[cfg(unix)]
#[tokio::test]
async fn binary_legacy_flags() {
    for (args, legacy) in [(&["--legacy"][..], true), (&["--first-tag-only", "--no-server-cancel"][..], false)] {
        let (mut child, addr) = common::spawn_binary(args, LONG).await;
        let f = get(addr, "/_sim/faults").await.json();
        let on = |name: &str| f[name].as_bool().unwrap();
        assert!(on("first_tag_only") && on("no_server_cancel"), "{args:?}: {f}");
        assert_eq!(on("single_health_index"), legacy, "{args:?}: {f}");
        assert_eq!(on("null_variants"), legacy, "{args:?}: {f}");
        child.kill().await.unwrap();
    }
}

#[cfg(unix)]
#[tokio::test]
async fn binary_prints_its_address_and_exits_on_sigterm() {
    let (mut child, addr) =
        common::spawn_binary(&["--max-conns-per-client", "7", "--acl-token", "root=management"], LONG).await;
    assert_eq!(get(addr, "/v1/status/leader").await.json(), json!("127.0.0.1:8300"));
    assert_eq!(get(addr, "/v1/health/service/x?token=nope").await.status, 403);
    let pid = child.id().unwrap().to_string();
    let status = std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(status.success());
    let exit = tokio::time::timeout(LONG, child.wait()).await.expect("exits in time").unwrap();
    assert!(exit.success(), "{exit:?}");
}

// ---------------------------------------------------------------- newer parameters

fn ids_of(r: &Reply) -> Vec<String> {
    assert_eq!(r.status, 200, "{}", r.text());
    let mut ids: Vec<String> =
        r.json().as_array().expect("array").iter().map(|e| e["Service"]["ID"].as_str().unwrap().to_owned()).collect();
    ids.sort();
    ids
}

#[tokio::test]
async fn filter_selects_rows_after_passing_and_tags() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &["blue"]).await;
    register(a, "n2", "web", "web-2", "passing", &["green"]).await;
    register(a, "n3", "web", "web-3", "critical", &["blue"]).await;
    let blue = "filter=%22blue%22%20in%20Service.Tags";
    assert_eq!(ids_of(&get(a, &format!("/v1/health/service/web?{blue}")).await), ["web-1", "web-3"]);
    assert_eq!(ids_of(&get(a, &format!("/v1/health/service/web?{blue}&passing")).await), ["web-1"]);
    let all = get(a, "/v1/health/service/web").await.index();
    assert_eq!(
        get(a, &format!("/v1/health/service/web?{blue}")).await.index(),
        all,
        "the index is the unfiltered set's"
    );
    let r = get(a, "/v1/health/service/web?filter=Service.Colour%20%3D%3D%20blue").await;
    assert_eq!(
        (r.status, r.text().as_str()),
        (400, r#"Failed to create boolean expression evaluator: Selector "Service.Colour" is not valid"#)
    );
    assert!(r.header("X-Consul-Index").is_none());

    // An agent from before filters (1.4) ignores the parameter: the answer is unfiltered.
    put(a, "/_sim/faults", &json!({"ignores_newer_parameters": true})).await;
    assert_eq!(ids_of(&get(a, &format!("/v1/health/service/web?{blue}")).await), ["web-1", "web-2", "web-3"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_are_data_sets_of_their_own_with_their_peer_name() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "local-1", "passing", &[]).await;
    let imported = json!({"Node": "p-n1", "Address": "10.9.0.1",
        "Service": {"ID": "remote-1", "Service": "web", "Port": 9090},
        "Check": {"CheckID": "service:remote-1", "Name": "alive", "Status": "passing", "ServiceID": "remote-1"}});
    assert_eq!(put(a, "/_sim/peers/east/register", &imported).await.status, 200);
    assert_eq!(ids_of(&get(a, "/v1/health/service/web").await), ["local-1"]);
    let r = get(a, "/v1/health/service/web?peer=east").await;
    assert_eq!(ids_of(&r), ["remote-1"]);
    assert_eq!(r.json()[0]["Service"]["PeerName"], "east");
    assert_eq!(
        ids_of(&get(a, "/v1/health/service/web?peer=west").await),
        Vec::<String>::new(),
        "an unknown peer has nothing"
    );

    // A blocking read of the peer's service wakes on the peer's writes, not on local ones.
    let index = r.index();
    let mut h = spawn_get(a, format!("/v1/health/service/web?peer=east&index={index}&wait=5s"));
    wait_blocking(&sim, "web", 1).await;
    register(a, "n2", "web", "local-2", "passing", &[]).await;
    assert!(still_pending(&mut h, Duration::from_millis(300)).await, "a local write woke a peer's read");
    assert_eq!(
        put(a, "/_sim/peers/east/deregister", &json!({"Node": "p-n1", "ServiceID": "remote-1"})).await.status,
        200
    );
    let woke = tokio::time::timeout(LONG, h).await.expect("woken").expect("joined");
    assert!(woke.index() > index);
    assert_eq!(ids_of(&woke), Vec::<String>::new());
    assert_eq!(get(a, "/v1/health/service/web?peer=east&sameness-group=g").await.status, 400);
}

#[tokio::test]
async fn a_sameness_group_answers_from_its_first_member_with_instances() {
    let sim = start_default().await;
    let a = sim.addr();
    assert_eq!(get(a, "/v1/health/service/web?sameness-group=web-group").await.status, 400, "unknown group");
    let group = json!({"Kind": "sameness-group", "Name": "web-group",
                       "Members": [{"Partition": "default"}, {"Peer": "east"}]});
    assert_eq!(put(a, "/v1/config", &group).await.status, 200);
    let imported = json!({"Node": "p-n1", "Address": "10.9.0.1",
        "Service": {"ID": "remote-1", "Service": "web", "Port": 9090},
        "Check": {"CheckID": "service:remote-1", "Name": "alive", "Status": "passing", "ServiceID": "remote-1"}});
    assert_eq!(put(a, "/_sim/peers/east/register", &imported).await.status, 200);
    let q = "/v1/health/service/web?sameness-group=web-group&passing";
    assert_eq!(ids_of(&get(a, q).await), ["remote-1"], "the local member has none: the peer answers");
    register(a, "n1", "web", "local-1", "passing", &[]).await;
    assert_eq!(ids_of(&get(a, q).await), ["local-1"], "the first member answers once it has instances");
    register(a, "n1", "web", "local-1", "critical", &[]).await;
    assert_eq!(ids_of(&get(a, q).await), ["remote-1"], "a member without passing instances is passed over");
}

#[tokio::test]
async fn a_sameness_group_that_picks_before_the_health_filter_answers_nothing_and_its_entry_names_the_members() {
    let sim = start_default().await;
    let a = sim.addr();
    assert_eq!(get(a, "/v1/config/sameness-group/web-group").await.status, 404);
    let members = json!([{"Partition": "default"}, {"Peer": "east"}]);
    let group = json!({"Kind": "sameness-group", "Name": "web-group", "Members": members});
    assert_eq!(put(a, "/v1/config", &group).await.status, 200);
    let entry = get(a, "/v1/config/sameness-group/web-group").await;
    assert_eq!((entry.status, &entry.json()["Members"]), (200, &members));
    let imported = json!({"Node": "p-n1", "Address": "10.9.0.1",
        "Service": {"ID": "remote-1", "Service": "web", "Port": 9090},
        "Check": {"CheckID": "service:remote-1", "Name": "alive", "Status": "passing", "ServiceID": "remote-1"}});
    assert_eq!(put(a, "/_sim/peers/east/register", &imported).await.status, 200);
    register(a, "n1", "web", "local-1", "critical", &[]).await;
    let q = "/v1/health/service/web?sameness-group=web-group&passing";
    assert_eq!(ids_of(&get(a, q).await), ["remote-1"], "by default the member is picked after the filter");
    put(a, "/_sim/faults", &json!({"sameness_before_health": true})).await;
    assert!(ids_of(&get(a, q).await).is_empty(), "picked before it: the local member, filtered to nothing");
    let member = "/v1/health/service/web?peer=east&passing";
    assert_eq!(ids_of(&get(a, member).await), ["remote-1"], "a member read on its own still answers");
    register(a, "n1", "web", "local-1", "passing", &[]).await;
    assert_eq!(ids_of(&get(a, q).await), ["local-1"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_agent_answers_cached_reads_from_its_cache_with_their_age() {
    let sim = start_default().await;
    let a = sim.addr();
    register(a, "n1", "web", "web-1", "passing", &[]).await;
    let r = get(a, "/v1/health/service/web?cached").await;
    assert_eq!((r.header("X-Cache"), r.header("Age")), (Some("HIT"), Some("0")));
    assert_eq!(get(a, "/v1/health/service/web").await.header("X-Cache"), None, "only cached reads say so");

    put(a, "/_sim/faults", &json!({"agent_cut_off": true})).await;
    let r = get(a, "/v1/health/service/web").await;
    assert_eq!((r.status, r.text().as_str()), (500, "No known Consul servers"));
    let w = json!({"Node": "n2", "Address": "10.0.0.2"});
    assert_eq!(put(a, "/v1/catalog/register", &w).await.status, 500, "writes need the servers too");
    let started = Instant::now();
    let index = get(a, "/v1/health/service/web?cached").await.index();
    let r = get(a, &format!("/v1/health/service/web?cached&index={index}&wait=1s")).await;
    assert!(started.elapsed() >= Duration::from_secs(1), "nothing moves a cut-off cache: the read waits");
    assert_eq!(ids_of(&r), ["web-1"]);
    assert_eq!(r.header("X-Cache"), Some("HIT"));
    assert!(r.header("Age").unwrap().parse::<u64>().unwrap() >= 1, "{:?}", r.header("Age"));

    // The servers come back: a waiting cached read answers at once, fresh.
    let h = spawn_get(a, format!("/v1/health/service/web?cached&index={index}&wait=30s"));
    let deadline = Instant::now() + LONG;
    while !sim.requests().iter().any(|r| r.query.contains("wait=30s") && r.outcome == Outcome::InFlight) {
        assert!(Instant::now() < deadline, "the cached read never arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    put(a, "/_sim/faults", &json!({"agent_cut_off": false})).await;
    register(a, "n1", "web", "web-1", "critical", &[]).await;
    let r = tokio::time::timeout(LONG, h).await.expect("answered once the servers are back").expect("joined");
    assert_eq!(r.header("Age"), Some("0"));
    assert_eq!(r.json()[0]["Checks"][0]["Status"], "critical");
}

#[tokio::test]
async fn agent_self_reports_a_version() {
    let sim = start_default().await;
    assert_eq!(get(sim.addr(), "/v1/agent/self").await.json()["Config"]["Version"], "1.21.4");
    let old = start(Config::legacy()).await;
    assert_eq!(get(old.addr(), "/v1/agent/self").await.json()["Config"]["Version"], "0.9.3");
}
