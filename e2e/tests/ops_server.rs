//! The ops server under abuse: a thousand idle connections and a client that sends its
//! request head a byte at a time. Probes and scrapes must still be answered at once, the
//! operator must hold no more connections than its cap, and the slow client is cut off
//! (docs/reliability.md, "The ops server").

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use e2e::harness::{Cluster, Operator, metric_sample, wait_for};

/// The server's cap and header timeout (src/ops/server.rs `Limits::DEFAULT`).
const CAP: f64 = 256.0;
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

fn addr(op: &Operator) -> SocketAddr {
    let url = op.url("");
    url.trim_start_matches("http://").trim_end_matches('/').parse().expect("the operator listens on an address")
}

/// One GET on a fresh connection, timed: status and how long the answer took.
fn timed_get(addr: SocketAddr, path: &str) -> (u16, Duration) {
    let started = Instant::now();
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nhost: ops\r\nconnection: close\r\n\r\n").unwrap();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer);
    let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, started.elapsed())
}

/// True once the server has closed `s` (EOF or reset).
fn closed(s: &mut TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 64];
    let gone = match s.read(&mut buf) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    s.set_nonblocking(false).unwrap();
    gone
}

#[test]
fn a_thousand_idle_connections_and_a_slow_client_keep_no_probe_or_scrape_out() {
    let cluster = Cluster::shared();
    let ns = cluster.namespace("ops").unwrap();
    let mut op = Operator::start(cluster, &["--namespace", &ns, "--bootstrap-timeout", "5s"]).unwrap();
    op.wait_ready(Duration::from_secs(60)).unwrap();
    let addr = addr(&op);

    let mut slow = TcpStream::connect(addr).unwrap();
    slow.write_all(b"GET /metrics HTTP/1.1\r\n").unwrap();
    let slow_since = Instant::now();
    let mut idle: Vec<TcpStream> = (0..1000).map(|_| TcpStream::connect(addr).unwrap()).collect();

    // Probes and scrapes behind the flood: each answered, the median at once.
    let mut took = Vec::new();
    for round in 0..5 {
        for path in ["/healthz", "/metrics"] {
            let (status, t) = timed_get(addr, path);
            assert_eq!(status, 200, "{path} (round {round}) behind 1,000 idle connections\n{}", op.logs());
            took.push(t);
        }
    }
    took.sort();
    let median = took[took.len() / 2];
    assert!(median <= Duration::from_millis(100), "median {median:?} over {took:?}");

    // The operator holds at most its cap: the first idle connections were closed for them.
    wait_for("the first idle connection closed by the operator", Duration::from_secs(10), || {
        closed(&mut idle[0]).then_some(())
    })
    .unwrap();
    let metrics = op.get("/metrics").unwrap().1;
    let open = metric_sample(&metrics, "consul_resolver_ops_connections").expect("the connections gauge");
    assert!(open <= CAP, "{open} connections open to the ops server");

    // The slow client, a byte every poll (100 ms), is cut off at the header timeout (the
    // flood may have evicted it sooner: either way it is gone well before 3 timeouts).
    let cut = wait_for("the slow-header client cut off", HEADER_TIMEOUT * 3, || {
        (slow.write_all(b"X").is_err() || closed(&mut slow)).then_some(())
    });
    assert!(cut.is_ok(), "still connected after {:?}", slow_since.elapsed());
    drop(idle);

    assert_eq!(op.get("/healthz").map(|r| r.0), Some(200));
    let status = op.terminate(Duration::from_secs(20)).unwrap();
    assert!(status.success(), "exit status after SIGTERM: {status}\n{}", op.logs());
}
