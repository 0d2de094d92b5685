//! A real Consul agent for tests: `consul agent -dev` (Debian bullseye's 1.8.7, cached by
//! `scripts/real-parts.sh consul`) on loopback, one per test, so tests that change nodes
//! and checks never see each other's writes. Killed by pid when dropped.
//!
//! Consul reads port 0 as "disabled", not "any free port": the HTTP, serf and server ports
//! (and HTTPS, with `start_tls`) are picked free here, DNS, gRPC and otherwise HTTPS are
//! switched off (-1), and a start that loses a port to someone else meanwhile is tried
//! again on other ports. The agent is ready once
//! `/v1/status/leader` names a leader (a dev agent elects itself within a second or two).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use consul_sim::tls::TestPki;

use crate::harness::{cached_binary, free_port};

/// How long an agent may take to elect itself.
const READY_WITHIN: Duration = Duration::from_secs(30);

pub struct RealAgent {
    child: Option<Child>,
    /// `http://127.0.0.1:PORT`.
    pub base_url: String,
    pub http: SocketAddr,
    /// `https://127.0.0.1:PORT`, when started with TLS (`start_tls`).
    pub https_url: Option<String>,
    pub log: PathBuf,
    _dir: tempfile::TempDir,
}

/// How an agent is started.
struct Options<'a> {
    http: Option<u16>,
    level: &'a str,
    /// Serve HTTPS too, with this PKI's server certificate (no client certificate asked).
    tls: Option<&'a TestPki>,
}

impl RealAgent {
    /// The cached binary; an error that says how to install it when missing. (The tests
    /// that run it are compiled ignored without it: e2e/build.rs.)
    pub fn binary() -> anyhow::Result<PathBuf> {
        cached_binary("scripts/real-parts.sh", "consul-path", "scripts/real-parts.sh consul")
    }

    /// A fresh dev agent, ready.
    pub fn start() -> anyhow::Result<RealAgent> {
        RealAgent::start_on(None)
    }

    /// A fresh dev agent whose HTTP API listens on `http` (a Consul back on the address
    /// its clients know), or on a free port.
    pub fn start_on(http: Option<u16>) -> anyhow::Result<RealAgent> {
        RealAgent::start_with(&Options { http, level: "debug", tls: None })
    }

    /// A fresh dev agent logging at `info`: for benchmarks, where logging every request
    /// would be part of what is measured.
    pub fn start_quiet() -> anyhow::Result<RealAgent> {
        RealAgent::start_with(&Options { http: None, level: "info", tls: None })
    }

    /// As `start_quiet`, also serving its API over HTTPS (where Consul serves HTTP/2) with
    /// `pki`'s server certificate, at `https_url`.
    pub fn start_tls(pki: &TestPki) -> anyhow::Result<RealAgent> {
        RealAgent::start_with(&Options { http: None, level: "info", tls: Some(pki) })
    }

    fn start_with(options: &Options) -> anyhow::Result<RealAgent> {
        let bin = RealAgent::binary()?;
        let mut last = None;
        for _ in 0..5 {
            match RealAgent::try_start(&bin, options.http.unwrap_or_else(free_port), options) {
                Ok(agent) => return Ok(agent),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("tried").context("the Consul agent did not start in 5 attempts"))
    }

    fn try_start(bin: &PathBuf, http: u16, options: &Options) -> anyhow::Result<RealAgent> {
        let dir = tempfile::Builder::new().prefix("cro-consul-").tempdir()?;
        let (serf_lan, serf_wan, server) = (free_port(), free_port(), free_port());
        let https = options.tls.map(|_| free_port());
        let mut config = serde_json::json!({
            "ports": {"http": http, "dns": -1, "grpc": -1, "https": https.map_or(-1, i32::from),
                      "serf_lan": serf_lan, "serf_wan": serf_wan, "server": server},
            "disable_update_check": true,
        });
        if let Some(pki) = options.tls {
            for (key, file, pem) in [
                ("cert_file", "server.pem", &pki.server_cert_pem),
                ("key_file", "server-key.pem", &pki.server_key_pem),
                ("ca_file", "ca.pem", &pki.ca_cert_pem),
            ] {
                std::fs::write(dir.path().join(file), pem)?;
                config[key] = dir.path().join(file).display().to_string().into();
            }
        }
        let config_file = dir.path().join("config.json");
        std::fs::write(&config_file, config.to_string())?;
        let log = dir.path().join("consul.log");
        let logfile = std::fs::File::create(&log)?;
        let child = Command::new(bin)
            .args(["agent", "-dev", "-bind", "127.0.0.1", "-client", "127.0.0.1", "-log-level", options.level])
            .arg("-config-file")
            .arg(&config_file)
            .stdin(Stdio::null())
            .stdout(logfile.try_clone()?)
            .stderr(logfile)
            .spawn()
            .context("starting consul agent -dev")?;
        let http_addr: SocketAddr = ([127, 0, 0, 1], http).into();
        let https_url = https.map(|p| format!("https://127.0.0.1:{p}"));
        let mut agent = RealAgent {
            child: Some(child),
            base_url: format!("http://{http_addr}"),
            http: http_addr,
            https_url,
            log,
            _dir: dir,
        };
        let deadline = Instant::now() + READY_WITHIN;
        while Instant::now() < deadline {
            if let Some(status) = agent.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                bail!("consul agent exited ({status}) before it was ready:\n{}", agent.logs());
            }
            if leader(http_addr).is_some_and(|l| !l.is_empty()) {
                return Ok(agent);
            }
            std::thread::sleep(Duration::from_millis(100)); // polling a starting process
        }
        bail!("consul agent on {http_addr} had no leader within {READY_WITHIN:?}:\n{}", agent.logs())
    }

    /// The agent's log so far (at debug level from `start` and `start_on`: every HTTP
    /// request it served).
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `host:port`, as a ConsulResolver's `address`.
    pub fn address(&self) -> String {
        self.http.to_string()
    }
}

impl Drop for RealAgent {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// What `/v1/status/leader` answers (the leader's address, `""` without one), or `None`
/// when nothing answers yet.
fn leader(addr: SocketAddr) -> Option<String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET /v1/status/leader HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    if !answer.starts_with("HTTP/1.0 200") && !answer.starts_with("HTTP/1.1 200") {
        return None;
    }
    let body = answer.split("\r\n\r\n").nth(1)?;
    Some(body.trim().trim_matches('"').to_owned())
}
