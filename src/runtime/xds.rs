//! `--xds-listen`: the xDS server's settings from the command line, its listener bound at
//! start (a port taken is an error at once, as for `--listen`), and its task.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::Context;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::Base;
use crate::cli::XdsArgs;
use consul_resolver_xds::{TlsConfig, XdsConfig, XdsServer};

/// The xDS server while it serves.
pub(super) struct Xds {
    pub(super) server: XdsServer,
    pub(super) task: JoinHandle<()>,
}

/// How long an Envoy may take to take a response and answer it before its stream is
/// closed (it reconnects and resumes).
const RESPONSE_DEADLINE: Duration = Duration::from_secs(30);

/// Binds and serves `--xds-listen`, if set. Nothing is sent until the first snapshot.
pub(super) async fn serve(args: &XdsArgs, base: &Base, shutdown: &CancellationToken) -> anyhow::Result<Option<Xds>> {
    let Some(listen) = args.xds_listen else { return Ok(None) };
    let config = config(args)?;
    let listener =
        tokio::net::TcpListener::bind(listen).await.with_context(|| format!("--xds-listen {listen}: cannot bind"))?;
    let server = XdsServer::new();
    server.register_metrics(base.metrics.unprefixed()).context("cannot register the xDS metrics")?;
    let (serving, stop) = (server.clone(), shutdown.clone());
    let tls = if config.tls.is_some() { "TLS" } else { "plaintext" };
    tracing::info!(address = %listen, tls, "serving xDS (ADS: clusters and endpoints)");
    let run = async move {
        if let Err(e) = serving.serve(listener, config, stop.cancelled_owned()).await {
            tracing::error!(error = %e, "the xDS server stopped");
        }
    };
    let task = tokio::spawn(base.vitals.watch("xds", run));
    Ok(Some(Xds { server, task }))
}

fn config(args: &XdsArgs) -> anyhow::Result<XdsConfig> {
    let allowed =
        (!args.xds_allow_nodes.is_empty()).then(|| args.xds_allow_nodes.iter().cloned().collect::<BTreeSet<_>>());
    Ok(XdsConfig {
        max_clients: args.xds_max_clients as usize,
        response_deadline: RESPONSE_DEADLINE,
        tls: tls(args)?,
        allowed_node_ids: allowed,
        ..XdsConfig::default()
    })
}

/// The certificate, key and client CA, read from their files (a mounted Secret) once.
fn tls(args: &XdsArgs) -> anyhow::Result<Option<TlsConfig>> {
    let (Some(cert), Some(key)) = (&args.xds_tls_cert, &args.xds_tls_key) else { return Ok(None) };
    let read = |flag: &str, path: &std::path::Path| {
        std::fs::read(path).with_context(|| format!("{flag} {}: cannot read", path.display()))
    };
    let client_ca_pem = args.xds_tls_client_ca.as_deref().map(|p| read("--xds-tls-client-ca", p)).transpose()?;
    Ok(Some(TlsConfig { cert_pem: read("--xds-tls-cert", cert)?, key_pem: read("--xds-tls-key", key)?, client_ca_pem }))
}
