//! Consul for e2e tests, changed only through Consul's real HTTP API (catalog
//! register/deregister), so the same tests run against a real agent: set
//! `E2E_CONSUL_ADDR` (e.g. `127.0.0.1:8500`) and optionally `E2E_CONSUL_TOKEN`. Without
//! them a simulator runs in this process on its own thread.

use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::{Value, json};

use consul_sim::{self as sim, RunningSim};

pub struct Consul {
    /// `http://host:port`.
    pub base_url: String,
    pub token: Option<String>,
    /// The in-process simulator, when not testing a real agent.
    pub sim: Option<RunningSim>,
}

static CONSUL: OnceLock<Consul> = OnceLock::new();

impl Consul {
    pub fn shared() -> &'static Consul {
        CONSUL.get_or_init(|| Consul::start().expect("cannot start Consul for e2e"))
    }

    fn start() -> anyhow::Result<Consul> {
        if let Ok(addr) = std::env::var("E2E_CONSUL_ADDR") {
            let base_url = if addr.contains("://") { addr } else { format!("http://{addr}") };
            return Ok(Consul { base_url, token: std::env::var("E2E_CONSUL_TOKEN").ok(), sim: None });
        }
        let running = sim::Simulator::start_background(sim::Config::default()).context("starting the simulator")?;
        Ok(Consul { base_url: running.base_url(), token: None, sim: Some(running) })
    }

    /// A Consul with ACLs enforced (default deny), and a token that may read every service,
    /// for the operator. A simulator of its own, with a management token for the test's
    /// writes; or, with `E2E_CONSUL_ADDR`, the real agent and `E2E_CONSUL_TOKEN` for both
    /// (tests that need this are ignored when it is not set: see e2e/build.rs).
    pub fn with_acls() -> anyhow::Result<(Consul, String)> {
        if let Ok(addr) = std::env::var("E2E_CONSUL_ADDR") {
            let token = std::env::var("E2E_CONSUL_TOKEN").context("E2E_CONSUL_TOKEN is required with ACLs")?;
            let base_url = if addr.contains("://") { addr } else { format!("http://{addr}") };
            return Ok((Consul { base_url, token: Some(token.clone()), sim: None }, token));
        }
        let (admin, reader) = ("e2e-admin-token", "e2e-reader-token");
        let acl = sim::AclConfig {
            tokens: vec![sim::AclToken::management(admin), sim::AclToken::service_read(reader, [""])],
            anonymous_read: false,
        };
        let running = sim::Simulator::start_background(sim::Config { acl: Some(acl), ..sim::Config::default() })
            .context("starting the simulator")?;
        Ok((
            Consul { base_url: running.base_url(), token: Some(admin.to_owned()), sim: Some(running) },
            reader.to_owned(),
        ))
    }

    /// `host:port`, as a ConsulResolver's `address`.
    pub fn address(&self) -> String {
        self.base_url.trim_start_matches("http://").to_owned()
    }

    fn put(&self, path: &str, body: &Value) -> anyhow::Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        rt.block_on(async {
            let mut req = crate::harness::http_client()
                .put(format!("{}{path}", self.base_url))
                .json(body)
                .timeout(Duration::from_secs(10));
            if let Some(t) = &self.token {
                req = req.header("X-Consul-Token", t);
            }
            let resp = req.send().await.with_context(|| format!("PUT {path}"))?;
            let status = resp.status();
            if !status.is_success() {
                bail!("PUT {path}: {status}: {}", resp.text().await.unwrap_or_default());
            }
            Ok(())
        })
    }

    /// Registers (or updates) one service instance with one service check.
    pub fn register(
        &self,
        node: &str,
        address: &str,
        service: &str,
        id: &str,
        port: u16,
        status: &str,
    ) -> anyhow::Result<()> {
        self.put(
            "/v1/catalog/register",
            &json!({
                "Node": node,
                "Address": address,
                "Service": {"ID": id, "Service": service, "Address": address, "Port": port, "Tags": [], "Meta": {}},
                "Check": {"CheckID": format!("check-{id}"), "Name": format!("{service} health"), "Status": status, "ServiceID": id}
            }),
        )
    }

    /// Registers (or updates) many service instances, each with its tags, meta and one
    /// service check, over one client with up to `concurrency` requests in flight.
    pub fn register_many(&self, instances: &[Instance], concurrency: usize) -> anyhow::Result<()> {
        use futures::{StreamExt, TryStreamExt};
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let client = crate::harness::http_client();
        let url = format!("{}/v1/catalog/register", self.base_url);
        rt.block_on(
            futures::stream::iter(instances.iter().map(|i| {
                let mut req = client.put(&url).json(&i.registration()).timeout(Duration::from_secs(10));
                if let Some(t) = &self.token {
                    req = req.header("X-Consul-Token", t);
                }
                async move {
                    let resp = req.send().await.with_context(|| format!("registering {}", i.id))?;
                    let status = resp.status();
                    if !status.is_success() {
                        bail!("registering {}: {status}: {}", i.id, resp.text().await.unwrap_or_default());
                    }
                    Ok(())
                }
            }))
            .buffer_unordered(concurrency.max(1))
            .try_collect::<Vec<()>>(),
        )?;
        Ok(())
    }

    /// Sets a node's own check (`serfHealth`), which counts against every instance on it.
    pub fn node_check(&self, node: &str, address: &str, status: &str) -> anyhow::Result<()> {
        self.put(
            "/v1/catalog/register",
            &json!({"Node": node, "Address": address,
                    "Check": {"CheckID": "serfHealth", "Name": "Serf Health Status", "Status": status}}),
        )
    }

    pub fn deregister(&self, node: &str, id: &str) -> anyhow::Result<()> {
        self.put("/v1/catalog/deregister", &json!({"Node": node, "ServiceID": id}))
    }
}

/// A service instance for [`Consul::register_many`]: like [`Consul::register`], plus tags
/// and meta (Consul allows up to 64 meta pairs, values up to 512 characters).
#[derive(Debug, Clone, Default)]
pub struct Instance {
    pub node: String,
    pub address: String,
    pub service: String,
    pub id: String,
    pub port: u16,
    /// The service check's status: `passing`, `warning` or `critical`.
    pub status: String,
    pub tags: Vec<String>,
    pub meta: std::collections::BTreeMap<String, String>,
    /// `Service.Locality.Zone` (Consul 1.17+); `None` sends no `Locality`.
    pub zone: Option<String>,
}

impl Instance {
    /// The `/v1/catalog/register` body.
    fn registration(&self) -> Value {
        let Instance { node, address, service, id, port, status, tags, meta, zone } = self;
        let mut body = json!({
            "Node": node,
            "Address": address,
            "Service": {"ID": id, "Service": service, "Address": address, "Port": port, "Tags": tags, "Meta": meta},
            "Check": {"CheckID": format!("check-{id}"), "Name": format!("{service} health"), "Status": status, "ServiceID": id}
        });
        if let Some(zone) = zone {
            body["Service"]["Locality"] = json!({"Region": "test", "Zone": zone});
        }
        body
    }
}
