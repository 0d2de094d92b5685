//! `consul-sim`: the Consul HTTP API simulator as a process, for harnesses and manual runs.
//!
//! Prints `listening on <addr>` on stdout once bound (one line, flushed), so a harness can
//! start it on port 0 and read the real port. Logs go to stderr (`RUST_LOG` filters them).
//! Exits cleanly on SIGTERM or Ctrl-C. See the `consul_sim` crate docs for the API it serves,
//! including the `/_sim/` control endpoints.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::Parser;
use consul_sim::{AclConfig, AclToken, Config, DEFAULT_H2_MAX_CONCURRENT_STREAMS, Simulator, TlsConfig};

#[derive(Debug, Parser)]
#[command(name = "consul-sim", about = "A Consul HTTP API simulator for tests")]
struct Args {
    /// Address to listen on; port 0 picks a free port (printed on stdout).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,

    /// The agent's datacenter; any other `?dc=` answers 500 `No path to datacenter`.
    #[arg(long, default_value = "dc1")]
    datacenter: String,

    /// Concurrent connections allowed per client IP before answering 429 (0 = unlimited).
    /// Default 200, or 0 with `--legacy`.
    #[arg(long)]
    max_conns_per_client: Option<usize>,

    /// An ACL token: `SECRET=management` or `SECRET=service-read:PREFIX[,PREFIX...]`
    /// (`service-read:` alone reads every service). Repeatable; any token enables ACLs.
    #[arg(long = "acl-token", value_name = "SECRET=POLICY")]
    acl_tokens: Vec<AclToken>,

    /// Enable ACLs even without tokens (everything anonymous is then denied or filtered).
    #[arg(long)]
    acl_enabled: bool,

    /// With ACLs on, let requests without a token read every service.
    #[arg(long)]
    acl_anonymous_read: bool,

    /// Answer with the legacy `null` shapes for empty Meta, TaggedAddresses and Tags.
    #[arg(long)]
    null_variants: bool,

    /// What `/v1/status/leader` answers.
    #[arg(long, default_value = "127.0.0.1:8300")]
    leader_address: String,

    /// The raft index of the empty catalog.
    #[arg(long, default_value_t = 1)]
    initial_index: u64,

    /// A registration that names an unchanged check again leaves it as it is (Consul 1.8):
    /// a port change then moves the catalog and not the checks.
    #[arg(long)]
    keeps_unchanged_checks: bool,

    /// Serve HTTPS with this certificate chain (PEM, leaf first): HTTP/2 to clients that
    /// negotiate ALPN `h2`, HTTP/1.1 to the others. Needs `--tls-key`.
    #[arg(long, value_name = "FILE", requires = "tls_key", help_heading = "TLS")]
    tls_cert: Option<PathBuf>,

    /// The private key of `--tls-cert` (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert", help_heading = "TLS")]
    tls_key: Option<PathBuf>,

    /// Require client certificates signed by this CA (PEM): mTLS.
    #[arg(long, value_name = "FILE", requires = "tls_cert", help_heading = "TLS")]
    tls_client_ca: Option<PathBuf>,

    /// HTTP/2 streams allowed at once on one connection (SETTINGS_MAX_CONCURRENT_STREAMS).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_H2_MAX_CONCURRENT_STREAMS, help_heading = "TLS")]
    h2_max_streams: u32,

    /// Offer only `http/1.1` in ALPN (no HTTP/2).
    #[arg(long, help_heading = "TLS")]
    tls_http1_only: bool,

    /// Behave as a 0.9-line agent: every older-agent switch below, the `null` shapes, and
    /// no per-client connection limit (unless `--max-conns-per-client` is given).
    #[arg(long, help_heading = "Older agents")]
    legacy: bool,

    /// One index for the whole health table: every `/v1/health/service/<any>` reports and
    /// blocks on the catalog's raft index, so any write wakes every service's watchers.
    #[arg(long, help_heading = "Older agents")]
    single_health_index: bool,

    /// While no service is registered, reads answer `X-Consul-Index: 0`, at once even to a
    /// large `index`.
    #[arg(long, help_heading = "Older agents")]
    zero_index_when_empty: bool,

    /// `/v1/health/service` applies only the first `tag` and ignores the rest.
    #[arg(long, help_heading = "Older agents")]
    first_tag_only: bool,

    /// A blocking query whose client disconnects stays in flight (and in `/_sim/stats`)
    /// until its wait ends or a write wakes it.
    #[arg(long, help_heading = "Older agents")]
    no_server_cancel: bool,

    /// An unknown `/v1/health/state/<state>` answers 200 `[]` instead of 400.
    #[arg(long, help_heading = "Older agents")]
    unknown_state_is_empty: bool,

    /// `filter`, `cached`, `peer` and `sameness-group` are ignored, as agents before them
    /// ignore any unknown parameter.
    #[arg(long, help_heading = "Older agents")]
    ignores_newer_parameters: bool,
}

fn read_pem(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

impl Args {
    fn tls(&self) -> anyhow::Result<Option<TlsConfig>> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            return Ok(None);
        };
        let mut tls =
            TlsConfig::new(read_pem(cert)?, read_pem(key)?).with_h2_max_concurrent_streams(self.h2_max_streams);
        if let Some(ca) = &self.tls_client_ca {
            tls = tls.with_client_ca(read_pem(ca)?);
        }
        if self.tls_http1_only {
            tls = tls.http1_only();
        }
        Ok(Some(tls))
    }

    fn into_config(self) -> anyhow::Result<Config> {
        let tls = self.tls()?;
        let acl = (self.acl_enabled || !self.acl_tokens.is_empty())
            .then_some(AclConfig { tokens: self.acl_tokens, anonymous_read: self.acl_anonymous_read });
        let base = if self.legacy { Config::legacy() } else { Config::default() };
        Ok(Config {
            listen: self.listen,
            datacenter: self.datacenter,
            max_conns_per_client: self.max_conns_per_client.unwrap_or(base.max_conns_per_client),
            acl,
            null_variants: base.null_variants || self.null_variants,
            leader_address: self.leader_address,
            initial_index: self.initial_index,
            keeps_unchanged_checks: self.keeps_unchanged_checks,
            single_health_index: base.single_health_index || self.single_health_index,
            zero_index_when_empty: base.zero_index_when_empty || self.zero_index_when_empty,
            first_tag_only: base.first_tag_only || self.first_tag_only,
            no_server_cancel: base.no_server_cancel || self.no_server_cancel,
            unknown_state_is_empty: base.unknown_state_is_empty || self.unknown_state_is_empty,
            ignores_newer_parameters: base.ignores_newer_parameters || self.ignores_newer_parameters,
            tls,
            ..base
        })
    }
}

/// Registers for SIGTERM at once, and resolves when it (or Ctrl-C) comes. Called before
/// the address is printed: a harness may signal as soon as it reads it, and a SIGTERM that
/// came before the handler would kill the process with the default action.
fn on_termination() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    async move {
        #[cfg(unix)]
        if let Some(mut term) = term {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();

    let config = Args::parse().into_config()?;
    if !config.listen.ip().is_loopback() {
        tracing::warn!(listen = %config.listen, "listening on a non-loopback address");
    }
    let terminated = on_termination();
    let sim = Simulator::start(config).await.context("starting consul-sim")?;

    let mut out = std::io::stdout().lock();
    writeln!(out, "listening on {}", sim.addr()).context("writing the address")?;
    out.flush().context("flushing stdout")?;
    drop(out);
    tracing::info!(addr = %sim.addr(), "consul-sim ready");

    terminated.await;
    tracing::info!("shutting down");
    sim.shutdown().await;
    Ok(())
}
