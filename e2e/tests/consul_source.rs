//! The Consul source against the simulator, in a current and an older agent's shapes, and
//! against a real agent in the same run (`real`: a fresh `consul agent -dev` per test, or
//! the agent at `E2E_CONSUL_ADDR`, with `E2E_CONSUL_TOKEN` if ACLs are on). Tests that need
//! the simulator show their `real` variant as ignored, with the reason.
//!
//! Each test drives watches directly (no Kubernetes) and waits for conditions with
//! deadlines; blocking queries use a 1 s wait so that everything finishes in seconds.

use std::collections::BTreeSet;
use std::time::Duration;

use consul_resolver_core::keys::{AddressType, Consistency, ConsulKey, HealthStatuses, QueryOptions, Remote, Secret};
use consul_resolver_core::model::{ConsulEvent, Event};
use consul_resolver_core::model::{Endpoint, Health};
use consul_resolver_core::test_support::consul_key;
use consul_sim::{
    AclConfig, AclToken, Budget, Config, FaultsPatch, HEALTH_CONNECT_LABEL_PREFIX, HEALTH_STATE_LABEL, RunningSim,
    Simulator,
};
use consul_watch::Settings;
use e2e::agent::RealAgent;
use e2e::watches::{DEADLINE, NO_SWEEP, Watches};
use serde_json::json;
use tokio::time::Instant;

tokio::task_local! {
    /// Set for a test's `real` variant: [`Env::start`] gives it a real agent.
    static REAL_AGENT: bool;
}

/// Where Consul is: a fresh simulator, or (in a `real` variant) a real agent: a fresh dev
/// agent of its own, or the one at `E2E_CONSUL_ADDR`.
struct Env {
    address: String,
    /// A token allowed to write the catalog (real agent with ACLs, or the simulator's).
    admin_token: Option<String>,
    sim: Option<RunningSim>,
    /// The dev agent this test started (stopped with the test).
    _agent: Option<RealAgent>,
    http: reqwest::Client,
}

impl Env {
    async fn start(config: Config) -> Env {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::new();
        if REAL_AGENT.try_with(|real| *real).unwrap_or(false) {
            if let Ok(addr) = std::env::var("E2E_CONSUL_ADDR") {
                let address = if addr.contains("://") { addr } else { format!("http://{addr}") };
                let admin_token = std::env::var("E2E_CONSUL_TOKEN").ok();
                return Env { address, admin_token, sim: None, _agent: None, http };
            }
            let agent =
                tokio::task::spawn_blocking(RealAgent::start).await.unwrap().expect("a real Consul agent starts");
            return Env { address: agent.base_url.clone(), admin_token: None, sim: None, _agent: Some(agent), http };
        }
        let admin_token = config.acl.as_ref().map(|_| "admin-secret".to_owned());
        let sim = Simulator::start(config).await.expect("simulator starts");
        Env { address: sim.base_url(), admin_token, sim: Some(sim), _agent: None, http }
    }

    /// The simulator, for tests that inject faults or read its request log. Their `real`
    /// variants are ignored (`simulator_only`), so they show as ignored there, never as
    /// passed.
    fn simulator(&self) -> &RunningSim {
        self.sim.as_ref().expect("a simulator-only test ran against a real agent")
    }

    /// A key with the product's default options (`healthStatuses: [passing]`), as users run.
    fn key(&self, service: &str) -> ConsulKey {
        let mut key = consul_key(&self.address, service);
        key.scope_mut().server.token = self.admin_token.clone().map(Secret::new);
        key
    }

    /// A key that publishes every instance whatever its health, to see health change.
    fn key_any(&self, service: &str) -> ConsulKey {
        self.key(service)
            .with_scope(|s| s.query = QueryOptions { statuses: HealthStatuses::ANY, ..QueryOptions::default() })
    }

    /// Sets a node's own check (`serfHealth`), which counts against every instance on it.
    async fn node_check(&self, node: &str, status: &str) {
        self.put(
            "/v1/catalog/register",
            json!({"Node": node, "Address": "127.0.0.1",
                   "Check": {"CheckID": "serfHealth", "Name": "Serf Health Status", "Status": status}}),
        )
        .await;
    }

    async fn put(&self, path: &str, body: serde_json::Value) {
        let mut req = self.http.put(format!("{}{path}", self.address)).json(&body);
        if let Some(t) = &self.admin_token {
            req = req.header("X-Consul-Token", t);
        }
        let resp = req.send().await.expect("write reaches Consul");
        assert!(resp.status().is_success(), "{path}: {}", resp.status());
    }

    async fn register(&self, node: &str, id: &str, service: &str, port: u16, status: &str, tags: &[&str]) {
        self.put(
            "/v1/catalog/register",
            json!({
                "Node": node, "Address": "127.0.0.1",
                "Service": {"ID": id, "Service": service, "Port": port, "Tags": tags, "Address": ""},
                "Check": {"CheckID": format!("service:{id}"), "Name": "check", "Status": status, "ServiceID": id},
            }),
        )
        .await;
    }

    /// The last raft index a real server agent applied: besides the catalog's, its raft log
    /// takes writes that no catalog or check answer explains (a dev agent's network
    /// coordinates about every 15 s, the leader's barrier every minute). `None` on the
    /// simulator, whose only writes are the catalog's, and on an agent that does not say.
    async fn raft_index(&self) -> Option<u64> {
        self.sim.is_none().then_some(())?;
        let mut req = self.http.get(format!("{}/v1/agent/self", self.address));
        if let Some(t) = &self.admin_token {
            req = req.header("X-Consul-Token", t);
        }
        let agent: serde_json::Value = req.send().await.ok()?.json().await.ok()?;
        agent["Stats"]["raft"]["applied_index"].as_str()?.parse().ok()
    }

    async fn deregister(&self, node: &str, id: &str) {
        self.put("/v1/catalog/deregister", json!({"Node": node, "ServiceID": id})).await;
    }
}

/// A unique service name, so tests can share a real agent.
fn unique(prefix: &str) -> String {
    format!("{prefix}-{:08x}", rand::random::<u32>())
}

fn settings(max_connections: usize) -> Settings {
    Settings { wait: Duration::from_secs(1), max_connections, ..Settings::default() }
}

/// The product's defaults (a blocking query's `wait` of 5 minutes) at a budget of
/// `max_connections`, never swept: anything that would only show at the default `wait` (a
/// query left blocking on an old index after a change of mode) shows here as a change that
/// does not arrive within [`PROMPT`].
fn at_defaults(max_connections: usize) -> Settings {
    Settings { max_connections, sweep: NO_SWEEP, ..Settings::default() }
}

fn ports(eps: &[Endpoint]) -> Vec<u16> {
    eps.iter().map(|e| e.port).collect()
}

/// A test run three times: against the simulator as a current agent, against the simulator
/// as a 0.9-line agent (`Config::legacy()`: one index for the whole health table, index 0
/// when empty, only the first `tag` applied, no server-side cancel, no connection limit,
/// `null` shapes), and against a real agent (`real`: a fresh `consul agent -dev`, Debian
/// bullseye's 1.8.7, or the agent at `E2E_CONSUL_ADDR`). A test that needs the simulator
/// (fault injection, its request log, what 1.8 lacks) says so first:
/// `simulator_only: "why";`, and its `real` variant shows as ignored with that reason.
macro_rules! on_both_agents {
    (simulator_only: $why:literal; $($rest:tt)*) => {
        on_both_agents!(@variants legacy, Config::legacy(), [#[ignore = $why]] $($rest)*);
    };
    // One generator for both macros: `$older` names the older agent's variant, run with
    // `$older_config`; `$real` are the attributes of the real agent's.
    (@variants $older:ident, $older_config:expr, [$(#[$real:meta])*]
        $(#[$attr:meta])* async fn $name:ident($config:ident: Config) $body:block) => {
        mod $name {
            use super::*;

            async fn run($config: Config) $body

            #[tokio::test]
            $(#[$attr])*
            async fn current() {
                run(Config::default()).await
            }

            #[tokio::test]
            $(#[$attr])*
            async fn $older() {
                run($older_config).await
            }

            #[tokio::test]
            $(#[$real])*
            $(#[$attr])*
            async fn real() {
                REAL_AGENT.scope(true, run(Config::default())).await
            }
        }
    };
    ($($rest:tt)*) => {
        on_both_agents!(@variants legacy, Config::legacy(), [#[cfg_attr(e2e_no_real_agent, ignore = "no real Consul agent (bash scripts/real-parts.sh consul)")]] $($rest)*);
    };
}

on_both_agents! {
    async fn unknown_service_is_an_empty_answer(config: Config) {
        let env = Env::start(config).await;
        let mut w = Watches::new(settings(10));
        let key = env.key(&unique("nothing"));
        w.start(&key);
        w.answer(&key, "the first answer", |e| e.is_empty()).await;
    }
}

on_both_agents! {
    async fn instances_added_and_removed(config: Config) {
        let env = Env::start(config).await;
        let svc = unique("web");
        let mut w = Watches::new(settings(10));
        let key = env.key(&svc);
        w.start(&key);
        w.answer(&key, "empty", |e| e.is_empty()).await;
        env.register("n1", &format!("{svc}-1"), &svc, 8081, "passing", &["b", "a"]).await;
        let eps = w.answer(&key, "one instance", |e| e.len() == 1).await;
        assert_eq!(eps[0].address, "127.0.0.1", "Node.Address when Service.Address is empty");
        assert_eq!(eps[0].tags, ["a", "b"]);
        assert_eq!(eps[0].node, "n1");
        env.register("n2", &format!("{svc}-2"), &svc, 8082, "passing", &[]).await;
        let eps = w.answer(&key, "two instances", |e| e.len() == 2).await;
        assert_eq!(ports(&eps), [8081, 8082]);
        env.deregister("n1", &format!("{svc}-1")).await;
        let eps = w.answer(&key, "one left", |e| e.len() == 1).await;
        assert_eq!(ports(&eps), [8082]);
        env.deregister("n2", &format!("{svc}-2")).await;
    }
}

on_both_agents! {
    async fn check_going_critical_and_back(config: Config) {
        let env = Env::start(config).await;
        let svc = unique("api");
        let id = format!("{svc}-1");
        // One event stream per watch: `until` skips other keys' events.
        let mut w = Watches::new(settings(10));
        let mut wp = Watches::new(settings(10));
        let all = env.key_any(&svc);
        let passing = env.key(&svc);
        env.register("n1", &id, &svc, 9000, "passing", &[]).await;
        w.start(&all);
        wp.start(&passing);
        w.answer(&all, "passing instance", |e| e.len() == 1 && e[0].health == Health::Passing).await;
        wp.answer(&passing, "passing instance (onlyPassing)", |e| e.len() == 1).await;
        env.register("n1", &id, &svc, 9000, "critical", &[]).await;
        w.answer(&all, "critical instance", |e| e.len() == 1 && e[0].health == Health::Critical).await;
        wp.answer(&passing, "instance filtered out", |e| e.is_empty()).await;
        env.register("n1", &id, &svc, 9000, "passing", &[]).await;
        w.answer(&all, "passing again", |e| e.len() == 1 && e[0].health == Health::Passing).await;
        wp.answer(&passing, "back (onlyPassing)", |e| e.len() == 1).await;
        env.deregister("n1", &id).await;
    }
}

on_both_agents! {
    async fn tags_filter_instances(config: Config) {
        let env = Env::start(config).await;
        let svc = unique("tagged");
        env.register("n1", &format!("{svc}-1"), &svc, 1, "passing", &["blue", "v1"]).await;
        env.register("n2", &format!("{svc}-2"), &svc, 2, "passing", &["green", "v1"]).await;
        let mut w = Watches::new(settings(10));
        let mut key = env.key(&svc);
        key.scope_mut().query.tags = ["blue".to_owned(), "v1".to_owned()].into();
        w.start(&key);
        let eps = w.answer(&key, "the blue instance", |e| !e.is_empty()).await;
        assert_eq!(ports(&eps), [1]);
        env.deregister("n1", &format!("{svc}-1")).await;
        env.deregister("n2", &format!("{svc}-2")).await;
    }
}

on_both_agents! {
    simulator_only: "needs the simulator's fault injection or request log";
async fn dc_ns_partition_and_tags_are_sent(config: Config) {
        let env = Env::start(config).await;
        let sim = env.simulator();
        let mut w = Watches::new(settings(10));
        let mut key = env.key("billing");
        let scope = key.scope_mut();
        (scope.datacenter, scope.namespace) = (Some("dc1".into()), Some("team-a".into()));
        (scope.partition, scope.remote) = (Some("part-1".into()), None);
        scope.query = QueryOptions { tags: ["x".to_owned(), "y".to_owned()].into(), ..QueryOptions::default() };
        w.start(&key);
        w.answer(&key, "an answer", |_| true).await;
        let has = |query: &str, part: &str| query.split('&').any(|p| p == part || p.starts_with(&format!("{part}=")));
        let reqs = sim.requests();
        let r = reqs.iter().find(|r| r.service.as_deref() == Some("billing")).expect("a health request");
        for part in ["dc=dc1", "ns=team-a", "partition=part-1", "tag=x", "tag=y"] {
            assert!(has(&r.query, part), "{part} in {}", r.query);
        }
        assert!(!r.query.contains("index="), "the first query does not block: {}", r.query);
        // A read asks for every instance, whatever its health, and filters here: a watch that
        // is fed must learn every node its service runs on, healthy or not (docs/consul.md).
        assert!(!has(&r.query, "passing"), "a read filters health itself: {}", r.query);
        // The next query blocks with the index (at least 1, even where an empty older
        // agent answers 0) and a Go duration.
        let deadline = Instant::now() + DEADLINE;
        let blocking = loop {
            let reqs = sim.requests();
            if let Some(r) = reqs.into_iter().filter(|r| r.service.as_deref() == Some("billing")).nth(1) {
                break r;
            }
            assert!(Instant::now() < deadline, "no second query");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert!(blocking.query.contains("wait=1s"), "{}", blocking.query);
        assert!(has(&blocking.query, "passing"), "a blocking query lets Consul filter: {}", blocking.query);
        assert!(
            blocking.query.split('&').any(|p| p.strip_prefix("index=").is_some_and(|i| i.parse::<u64>().unwrap() >= 1)),
            "{}",
            blocking.query
        );
    }
}

fn acl_config() -> Config {
    Config {
        acl: Some(AclConfig {
            tokens: vec![
                AclToken::management("admin-secret"),
                AclToken::service_read("reader-secret-1234", ["pay"]),
                AclToken::service_read("narrow-secret-5678", ["other"]),
            ],
            anonymous_read: false,
        }),
        ..Config::default()
    }
}

#[tokio::test]
#[cfg_attr(e2e_real_consul, ignore = "needs the simulator's fault injection or request log")]
async fn tokens_accepted_rejected_and_insufficient() {
    let env = Env::start(acl_config()).await;
    let sim = env.simulator();
    env.register("n1", "pay-1", "pay", 443, "passing", &[]).await;
    let mut w = Watches::new(settings(10));
    let with = |t: &str| {
        let mut k = env.key("pay");
        k.scope_mut().server.token = Some(Secret::new(t));
        k
    };
    let good = with("reader-secret-1234");
    let bad = with("unknown-secret-9999");
    let narrow = with("narrow-secret-5678");
    let (mut wb, mut wn) = (Watches::new(settings(10)), Watches::new(settings(10)));
    w.start(&good);
    wb.start(&bad);
    wn.start(&narrow);
    w.answer(&good, "the instance", |e| e.len() == 1).await;
    let msg = wb.failure(&bad, "an auth failure").await;
    assert!(msg.contains("ACL token rejected") && msg.contains(&env.address), "{msg}");
    assert!(!msg.contains("unknown-secret"), "the token must not appear: {msg}");
    wn.answer(&narrow, "a filtered (empty) answer", |e| e.is_empty()).await;
    let sent: Vec<_> = sim.requests().into_iter().filter_map(|r| r.token).collect();
    assert!(sent.iter().any(|t| t == "reader-secret-1234"), "sent as a header");
}

on_both_agents! {
    simulator_only: "needs the simulator's fault injection or request log";
async fn index_going_backwards_is_reset(config: Config) {
        let env = Env::start(config).await;
        let sim = env.simulator();
        env.register("n1", "db-1", "db", 5432, "passing", &[]).await;
        for i in 0..20 {
            env.register("other", &format!("o-{i}"), "other", 1, "passing", &[]).await;
        }
        env.register("n1", "db-1", "db", 5433, "passing", &[]).await;
        let mut w = Watches::new(settings(10));
        let key = env.key("db");
        w.start(&key);
        w.answer(&key, "the instance", |e| ports(e) == [5433]).await;
        let (_, ok) = sim.wait_for_stats(DEADLINE, |s| s.blocking.get("db").copied().unwrap_or(0) > 0).await;
        assert!(ok);
        // The server "restarts" with lower indexes; the watch must notice and re-read.
        sim.reset_indexes(2);
        sim.clear_requests();
        let deadline = Instant::now() + DEADLINE;
        loop {
            let reset = sim.requests().iter().any(|r| r.service.as_deref() == Some("db") && !r.query.contains("index="));
            if reset {
                break;
            }
            assert!(Instant::now() < deadline, "no non-blocking re-read after the index went backwards");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        env.register("n1", "db-1", "db", 5434, "passing", &[]).await;
        w.answer(&key, "the change after the reset", |e| ports(e) == [5434]).await;
    }
}

/// Counts health requests for `service` over `period`.
async fn count_requests(sim: &RunningSim, service: &str, period: Duration) -> usize {
    sim.clear_requests();
    tokio::time::sleep(period).await;
    sim.requests().iter().filter(|r| r.service.as_deref() == Some(service)).count()
}

on_both_agents! {
    simulator_only: "needs the simulator's fault injection or request log";
    /// A proxy that strips `X-Consul-Index`: nothing can block on an answer without it. The
    /// watch reads at the sweep instead of "blocking" on a made-up index 1, which answered
    /// at once, seven to ten times a second, with no metric or log. Counted, and the answer
    /// that came without its index is still published.
    async fn answers_without_an_index_are_read_at_the_sweep_not_in_a_loop(config: Config) {
        let env = Env::start(config).await;
        let sim = env.simulator();
        let svc = unique("stripped");
        env.register("n1", &format!("{svc}-1"), &svc, 1, "passing", &[]).await;
        let mut w = Watches::new(at_defaults(10));
        let key = env.key(&svc);
        w.start(&key);
        w.answer(&key, "the instance", |e| e.len() == 1).await;
        sim.set_faults(FaultsPatch { strip_index: Some(true), ..Default::default() });
        // Wakes the blocking query: its answer comes without an index.
        env.register("n1", &format!("{svc}-1"), &svc, 2, "passing", &[]).await;
        w.answer_within(&key, "the change, answered without an index", PROMPT, |e| ports(e) == [2]).await;
        let n = count_requests(sim, &svc, Duration::from_secs(3)).await;
        assert!(n <= 1, "{n} requests in 3 s without an index to block on");
        assert!(w.metrics.unindexed("service") >= 1, "counted");
    }
}

on_both_agents! {
    simulator_only: "needs the simulator's fault injection or request log";
async fn server_errors_back_off_and_recover(config: Config) {
        let env = Env::start(config).await;
        let sim = env.simulator();
        env.register("n1", "q-1", "queue", 1, "passing", &[]).await;
        let mut w = Watches::new(settings(10));
        let key = env.key("queue");
        w.start(&key);
        w.answer(&key, "the instance", |e| e.len() == 1).await;
        sim.set_faults(FaultsPatch { no_leader: Some(Budget::Always), ..Default::default() });
        // Wake the blocking query so the next one fails.
        env.register("n1", "q-1", "queue", 2, "passing", &[]).await;
        let msg = w.failure(&key, "a 500").await;
        assert!(msg.contains("500") && msg.contains("No cluster leader"), "{msg}");
        // Backoff 250 ms, 500, 1 s, 2 s...: a few requests in 3 s, not a hot loop.
        let n = count_requests(sim, "queue", Duration::from_secs(3)).await;
        assert!((1..=6).contains(&n), "{n} requests in 3 s while failing");
        sim.clear_faults();
        // An answer after errors is always sent, so the error clears.
        w.answer(&key, "recovery", |e| ports(e) == [2]).await;
    }
}

on_both_agents! {
    simulator_only: "needs the simulator's fault injection or request log";
async fn rate_limits_back_off(config: Config) {
        let env = Env::start(config).await;
        let sim = env.simulator();
        sim.set_faults(FaultsPatch { too_many_requests: Some(Budget::Always), ..Default::default() });
        let mut w = Watches::new(settings(10));
        let key = env.key("limited");
        w.start(&key);
        let msg = w.failure(&key, "a 429").await;
        assert!(msg.contains("429"), "{msg}");
        let n = count_requests(sim, "limited", Duration::from_secs(3)).await;
        assert!(n <= 6, "{n} requests in 3 s while rate limited");
        sim.clear_faults();
        w.answer(&key, "an answer after the limit lifts", |e| e.is_empty()).await;
    }
}

on_both_agents! {
    async fn thousand_services_within_a_small_budget(config: Config) {
        const SERVICES: usize = 1000;
        const BUDGET: usize = 20;
        let env = Env::start(Config { max_conns_per_client: 25, ..config }).await;
        let prefix = unique("many");
        let names: Vec<String> = (0..SERVICES).map(|i| format!("{prefix}-{i}")).collect();
        for (i, n) in names.iter().enumerate().filter(|(i, _)| i % 2 == 0) {
            env.register("bulk", n, n, 1000 + (i % 1000) as u16, "passing", &[]).await;
        }
        // No sweep: the changes below reach fed watches through their feed, or not at all.
        let mut w = Watches::new(Settings { sweep: NO_SWEEP, ..settings(BUDGET) });
        let keys: Vec<ConsulKey> = names.iter().map(|n| env.key(n)).collect();
        for k in &keys {
            w.start(k);
        }
        every_one_answers(&mut w, SERVICES, Duration::from_secs(30)).await;
        // Changes to a dedicated-looking and a fed-looking service, and a new instance, arrive.
        for i in [1usize, 500, 998, 999] {
            env.register("late", &format!("{}-late", names[i]), &names[i], 7000, "passing", &[]).await;
            w.answer(&keys[i], "the new instance", |e| e.iter().any(|e| e.port == 7000)).await;
        }
        if let Some(sim) = &env.sim {
            let stats = sim.stats();
            assert_eq!(stats.total_429, 0, "{stats:?}");
            let peak = stats.peak_connections.get("127.0.0.1").copied().unwrap_or(0);
            // The budget bounds requests in flight, and so connections, up to hyper's pool: a
            // request that finds no idle connection starts a new one and races it against a
            // connection coming back, and the loser stays open (idle, reused later). With
            // every query churning (wait=1s here) that is a few above the budget (measured
            // 21 to 23 for 20), never anywhere near one per service.
            assert!(
                peak <= BUDGET + BUDGET / 4 + 1,
                "peak {peak} connections for a budget of {BUDGET} (+1 for the test's writes)"
            );
        }
    }
}

on_both_agents! {
    simulator_only: "needs the simulator's fault injection or request log";
async fn dropping_a_watch_cancels_its_query(config: Config) {
        let server_cancels = !config.no_server_cancel;
        let env = Env::start(config).await;
        let sim = env.simulator();
        // Something registered: an empty older agent answers index 0 at once, never blocking.
        env.register("n1", "present-1", "present", 80, "passing", &[]).await;
        let mut w = Watches::new(Settings { wait: Duration::from_secs(60), ..settings(10) });
        let key = env.key("gone");
        w.start(&key);
        w.answer(&key, "first", |_| true).await;
        let (_, ok) = sim.wait_for_stats(DEADLINE, |s| s.blocking.get("gone").copied().unwrap_or(0) == 1).await;
        assert!(ok, "blocking");
        w.stop_all();
        if server_cancels {
            let (_, ok) = sim.wait_for_stats(DEADLINE, |s| s.blocking.get("gone").copied().unwrap_or(0) == 0).await;
            assert!(ok, "the blocking query is cancelled when the watch is dropped");
        } else {
            // An older agent keeps the query; what the client can do is close its side.
            let (stats, ok) = sim.wait_for_stats(DEADLINE, |s| s.blocking_detached == 1).await;
            assert!(ok, "the client closed its connection: {stats:?}");
        }
    }
}

on_both_agents! {
    simulator_only: "needs the simulator's fault injection or request log";
async fn a_held_watch_reads_blocks_only_once_released_and_misses_nothing(config: Config) {
        let env = Env::start(config).await;
        let sim = env.simulator();
        let (held_svc, free_svc) = (unique("held"), unique("free"));
        env.register("n1", &format!("{held_svc}-1"), &held_svc, 1, "passing", &[]).await;
        env.register("n1", &format!("{free_svc}-1"), &free_svc, 1, "passing", &[]).await;
        let blocking = |s: &consul_sim::Stats, svc: &str| s.blocking.get(svc).copied().unwrap_or(0);
        // No pacing: a watch not held blocks the moment it has its first answer.
        let unpaced = Settings { wait: Duration::from_secs(60), min_interval: Duration::ZERO, ..settings(10) };
        let mut held = Watches::new(unpaced.clone());
        held.hold_blocking();
        let key = env.key(&held_svc);
        held.start(&key);
        held.answer(&key, "the held watch's first read", |e| ports(e) == [1]).await;
        // A watch not held, started after that answer: by the time its blocking query waits
        // in Consul, the held watch's would have been there long before.
        let mut free = Watches::new(unpaced);
        let free_key = env.key(&free_svc);
        free.start(&free_key);
        free.answer(&free_key, "the free watch's first read", |e| ports(e) == [1]).await;
        let (stats, ok) = sim.wait_for_stats(DEADLINE, |s| blocking(s, &free_svc) == 1).await;
        assert!(ok, "the free watch blocks: {stats:?}");
        assert_eq!(blocking(&sim.stats(), &held_svc), 0, "the held watch read, and waits to block");
        // A change while held: seen once released (its blocking query carries its first
        // read's index, and is answered at once).
        env.register("n1", &format!("{held_svc}-1"), &held_svc, 2, "passing", &[]).await;
        held.release_blocking();
        held.answer(&key, "the change made while held, once released", |e| ports(e) == [2]).await;
        let (stats, ok) = sim.wait_for_stats(DEADLINE, |s| blocking(s, &held_svc) == 1).await;
        assert!(ok, "blocking once released: {stats:?}");
    }
}

on_both_agents! {
    simulator_only: "needs the simulator's fault injection or request log";
async fn first_reads_take_the_lanes_held_watches_leave_idle_and_give_them_back(config: Config) {
        // A budget of 20: two reads of its own and 18 lanes, for 60 services: a feed (two
        // lanes: no status queries at this size) and 16 dedicated watches once
        // placed.
        const SERVICES: usize = 60;
        const BUDGET: usize = 20;
        const LANES: usize = BUDGET - BUDGET / 10;
        let env = Env::start(config).await;
        let sim = env.simulator();
        let prefix = unique("idle-lanes");
        let names: Vec<String> = (0..SERVICES).map(|i| format!("{prefix}-{i}")).collect();
        for (i, n) in names.iter().enumerate() {
            env.register("n1", n, n, 1000 + i as u16, "passing", &[]).await;
        }
        // Every read slow, so that reads pile up as a cold start's do against a busy agent.
        sim.set_faults(FaultsPatch { latency_ms: Some(200), ..Default::default() });
        sim.reset_stats();
        let mut w = Watches::new(at_defaults(BUDGET));
        w.hold_blocking();
        let keys: Vec<ConsulKey> = names.iter().map(|n| env.key(n)).collect();
        for k in &keys {
            w.start(k);
        }
        every_one_answers(&mut w, SERVICES, DEADLINE).await;
        // The held watches' lanes carried first reads: about the budget at once, not its
        // tenth, and never more than the budget (up to the pool's race, as above).
        let peak = sim.stats().peak_connections_total;
        assert!(peak >= BUDGET * 3 / 4, "{peak} connections at most while {SERVICES} first reads waited");
        assert!(peak <= BUDGET + BUDGET / 4, "{peak} connections for a budget of {BUDGET}");
        // Released, every lane goes to its blocking query: the reads gave back what they took.
        sim.clear_faults();
        w.release_blocking();
        let (stats, ok) = sim.wait_for_stats(DEADLINE, |s| s.blocking_total == LANES).await;
        assert!(ok, "every lane's blocking query waits in Consul: {stats:?}");
    }
}

/// Waits until `services` distinct services have answered once (none failing), within `within`.
async fn every_one_answers(w: &mut Watches, services: usize, within: Duration) {
    let mut answered = BTreeSet::new();
    let deadline = Instant::now() + within;
    while answered.len() < services {
        match w.next(deadline).await {
            Some(Event::Consul(k, ConsulEvent::Answer { .. })) => {
                answered.insert(k.service);
            }
            Some(Event::Consul(k, ConsulEvent::Failed(m))) => panic!("{k}: {m}"),
            Some(_) => {}
            None => panic!("only {} of {services} answered", answered.len()),
        }
    }
}

/// Waits (up to the deadline) until no non-blocking health read has arrived for `quiet`.
async fn wait_until_no_reads_for(sim: &RunningSim, quiet: Duration) {
    let reads = || sim.requests().iter().filter(|r| r.service.is_some() && !r.query.contains("index=")).count();
    let deadline = Instant::now() + DEADLINE;
    let (mut seen, mut since) = (reads(), Instant::now());
    while since.elapsed() < quiet {
        assert!(Instant::now() < deadline, "health reads did not settle");
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = reads();
        if now != seen {
            (seen, since) = (now, Instant::now());
        }
    }
}

/// Non-blocking health reads of services other than `except` since the log was cleared:
/// the re-reads of fed watches (a dedicated watch's queries carry an index).
fn fed_rereads_except(sim: &RunningSim, services: &[String], except: &str) -> Vec<String> {
    sim.requests()
        .into_iter()
        .filter(|r| r.path.starts_with("/v1/health/service/") && !r.query.contains("index="))
        .filter_map(|r| r.service)
        .filter(|s| s != except && services.contains(s))
        .collect()
}

/// How soon a change must arrive on any path (dedicated, fed, multiplexed): a few round
/// trips. No sweep comes in these tests ([`NO_SWEEP`]), so only the feed can be this prompt.
const PROMPT: Duration = Duration::from_secs(3);

/// Registers one instance of each of `services`, each on a node of its own (`<service>-node`).
async fn one_instance_each(env: &Env, services: &[String]) {
    for (i, s) in services.iter().enumerate() {
        env.register(&format!("{s}-node"), &format!("{s}-1"), s, 8000 + i as u16, "passing", &[]).await;
    }
}

/// Waits, on the simulator, until the change feed's checks query blocks and the health
/// reads have settled (members joining re-read once: a finite burst), then clears the log.
async fn feed_settled(env: &Env) {
    if let Some(sim) = &env.sim {
        let (_, ok) =
            sim.wait_for_stats(DEADLINE, |s| s.blocking.get(HEALTH_STATE_LABEL).copied().unwrap_or(0) >= 1).await;
        assert!(ok, "the feed's checks query blocks");
        wait_until_no_reads_for(sim, Duration::from_millis(500)).await;
        sim.clear_requests();
    }
}

/// Five services with one instance each, watched at a budget of 4 (one read, at most one
/// dedicated query: the rest are fed), each answered once, the feed settled.
async fn five_mostly_fed(env: &Env, prefix: &str) -> (Vec<String>, Vec<ConsulKey>, Watches) {
    five_mostly_fed_with(env, prefix, at_defaults(4)).await
}

/// [`five_mostly_fed`] with `settings`.
async fn five_mostly_fed_with(env: &Env, prefix: &str, settings: Settings) -> (Vec<String>, Vec<ConsulKey>, Watches) {
    let svcs: Vec<String> = (0..5).map(|i| unique(&format!("{prefix}{i}"))).collect();
    one_instance_each(env, &svcs).await;
    let mut w = Watches::new(settings);
    let keys: Vec<ConsulKey> = svcs.iter().map(|s| env.key(s)).collect();
    w.start_each_with_one_instance(keys.iter()).await;
    feed_settled(env).await;
    (svcs, keys, w)
}

on_both_agents! {
    /// Beyond the budget's dedicated queries, with the product's default options, a service
    /// learns of every change Consul reports as promptly as with a query of its own, in both
    /// directions: its service check (critical and back), its node's check (critical and
    /// back: while critical, `?passing` drops the instance, so a watch that only remembered
    /// the nodes of its last answer would never hear of the recovery), a new port, an
    /// instance registered and deregistered, with a check or without.
    async fn fed_services_follow_every_change_both_ways(config: Config) {
        let env = Env::start(config).await;
        let (svcs, keys, mut w) = five_mostly_fed(&env, "fed").await;

        let node = |i: usize| format!("{}-node", svcs[i]);
        let id = |i: usize| format!("{}-1", svcs[i]);
        env.register(&node(2), &id(2), &svcs[2], 8002, "critical", &[]).await;
        w.answer_within(&keys[2], "its check critical: no instance", PROMPT, |e| e.is_empty()).await;
        if let Some(sim) = &env.sim {
            let others = fed_rereads_except(sim, &svcs, &svcs[2]);
            assert!(others.is_empty(), "only the flipped service is re-read, not {others:?}");
        }
        env.register(&node(2), &id(2), &svcs[2], 8002, "passing", &[]).await;
        w.answer_within(&keys[2], "its check passing again", PROMPT, |e| e.len() == 1).await;

        env.node_check(&node(3), "critical").await;
        w.answer_within(&keys[3], "its node critical: no instance", PROMPT, |e| e.is_empty()).await;
        env.node_check(&node(3), "passing").await;
        w.answer_within(&keys[3], "its node passing again", PROMPT, |e| e.len() == 1).await;

        env.register(&node(4), &id(4), &svcs[4], 9004, "passing", &[]).await;
        w.answer_within(&keys[4], "the new port", PROMPT, |e| ports(e) == [9004]).await;

        env.register(&node(1), &format!("{}-2", svcs[1]), &svcs[1], 7001, "passing", &[]).await;
        w.answer_within(&keys[1], "a second instance", PROMPT, |e| ports(e) == [7001, 8001]).await;
        env.deregister(&node(1), &format!("{}-2", svcs[1])).await;
        w.answer_within(&keys[1], "the second instance gone", PROMPT, |e| ports(e) == [8001]).await;

        // An instance without any check: only the catalog moves.
        env.put(
            "/v1/catalog/register",
            json!({"Node": node(0), "Address": "127.0.0.1",
                   "Service": {"ID": format!("{}-bare", svcs[0]), "Service": svcs[0], "Port": 7000}}),
        )
        .await;
        w.answer_within(&keys[0], "a check-less instance", PROMPT, |e| ports(e) == [7000, 8000]).await;
        env.deregister(&node(0), &format!("{}-bare", svcs[0])).await;
        w.answer_within(&keys[0], "the check-less instance gone", PROMPT, |e| ports(e) == [8000]).await;
        for n in (0..svcs.len()).map(node) {
            env.put("/v1/catalog/deregister", json!({"Node": n})).await;
        }
    }
}

on_both_agents! {
    simulator_only: "needs the simulator's fault injection or request log";
    /// A large catalog's checks answer (every check: tens of megabytes at 75,000 instances)
    /// arrives long after the catalog's small one. A port change rewrites its check, so the
    /// checks view accounts for the catalog's move once its answer is in: only that service
    /// is re-read, not every fed service (at 5,000 services a fixed wait shorter than the
    /// checks answer cost thousands of requests per change). A move no check write explains
    /// (a check-less instance) still re-reads everything, once the wait is over, both ways.
    async fn a_slow_checks_answer_still_accounts_for_a_port_change(config: Config) {
        let env = Env::start(config).await;
        let sim = env.simulator();
        sim.set_faults(FaultsPatch { checks_answer_ms: Some(600), ..Default::default() });
        let (svcs, keys, mut w) = five_mostly_fed(&env, "slow").await;
        for (round, i) in [1usize, 3, 4].into_iter().enumerate() {
            let port = 9100 + round as u16;
            env.register(&format!("{}-node", svcs[i]), &format!("{}-1", svcs[i]), &svcs[i], port, "passing", &[]).await;
            w.answer_within(&keys[i], "the new port", PROMPT, |e| ports(e) == [port]).await;
            // Whatever is still coming for this change has come once the checks answer has.
            wait_until_no_reads_for(sim, Duration::from_millis(1500)).await;
            let others = fed_rereads_except(sim, &svcs, &svcs[i]);
            assert!(others.is_empty(), "change {round}: only {} is re-read, not {others:?}", svcs[i]);
            sim.clear_requests();
        }
        let node = format!("{}-node", svcs[0]);
        let bare = format!("{}-bare", svcs[0]);
        env.put(
            "/v1/catalog/register",
            json!({"Node": node, "Address": "127.0.0.1",
                   "Service": {"ID": bare, "Service": svcs[0], "Port": 7000}}),
        )
        .await;
        w.answer_within(&keys[0], "a check-less instance", PROMPT, |e| ports(e) == [7000, 8000]).await;
        env.deregister(&node, &bare).await;
        w.answer_within(&keys[0], "the check-less instance gone", PROMPT, |e| ports(e) == [8000]).await;
    }
}

on_both_agents! {
    simulator_only: "needs the simulator's fault injection and request log";
    /// A large catalog's checks answer takes a real agent a second or more (every check of
    /// the group), but a check turning critical or warning, or passing again, shows at once
    /// in the feed's queries of the critical and the warning checks, which wake the fed
    /// members without waiting for it: a service check and a node check, both ways, with
    /// the default statuses (a warning instance is left out). When every check's answer
    /// comes, it names the same writes, and nobody re-reads for them a second time. (The
    /// feed runs those queries from 10,000 checks by default; here from any number.)
    async fn a_fed_health_flip_does_not_wait_for_every_checks_answer(config: Config) {
        let env = Env::start(config).await;
        let sim = env.simulator();
        // A budget of 5: one read and four lanes, the feed's two and its status queries'.
        let always = Settings { status_queries_from_checks: 0, ..at_defaults(5) };
        let (svcs, keys, mut w) = five_mostly_fed_with(&env, "flip", always).await;
        let slow = PROMPT + Duration::from_secs(2);
        sim.set_faults(FaultsPatch { checks_answer_ms: Some(slow.as_millis() as u64), ..Default::default() });
        let node = |i: usize| format!("{}-node", svcs[i]);
        let flips = [("critical", 0), ("passing", 1), ("warning", 0), ("passing", 1)];
        for (status, instances) in flips {
            env.register(&node(2), &format!("{}-1", svcs[2]), &svcs[2], 8002, status, &[]).await;
            w.answer_within(&keys[2], &format!("its check {status}"), PROMPT, |e| e.len() == instances).await;
            env.node_check(&node(3), status).await;
            w.answer_within(&keys[3], &format!("its node {status}"), PROMPT, |e| e.len() == instances).await;
        }
        // Every check's answers to those writes (one or two, each `slow`: its query blocks
        // again once it has answered the last), then whatever they would wake.
        let within = DEADLINE + 2 * slow;
        let (_, ok) =
            sim.wait_for_stats(within, |s| s.blocking.get(HEALTH_STATE_LABEL).copied().unwrap_or(0) >= 3).await;
        assert!(ok, "every check's query answered the flips and blocks again, beside the status queries");
        wait_until_no_reads_for(sim, Duration::from_secs(1)).await;
        let reads = |s: &str| fed_rereads_except(sim, &svcs, "").into_iter().filter(|r| r == s).count();
        assert_eq!((reads(&svcs[2]), reads(&svcs[3])), (4, 4), "one re-read a flip: {:?}", sim.requests());
        let all = fed_rereads_except(sim, &svcs, "");
        assert_eq!(all.len(), 8, "no other service re-read: {all:?}");
    }
}

on_both_agents! {
    simulator_only: "reads which queries block from the simulator";
    /// The critical and warning checks' queries cost a request per flip, worth it only
    /// where every check's answer is slow: the feed runs them once its group holds
    /// `status_queries_from_checks` checks (8 here), and stops them below half of that,
    /// both ways. Their lanes are the plan's: taken from dedicated watches while they run,
    /// and given back.
    async fn the_status_queries_run_while_the_group_is_large(config: Config) {
        let env = Env::start(config).await;
        let sim = env.simulator();
        // A budget of 5: one read and four lanes, a feed and two dedicated queries.
        let from_eight = Settings { status_queries_from_checks: 8, ..at_defaults(5) };
        let (svcs, _keys, w) = five_mostly_fed_with(&env, "grow", from_eight).await;
        // The 0.9 line does not cancel a query whose client went away: it blocks on, counted
        // as detached, until a write wakes it. Here the queries given up are the dedicated
        // watches' (once the status queries start; woken by the writes after) and then the
        // status queries (once the group shrinks, after the last write).
        let checks_queries = |n: usize| move |s: &consul_sim::Stats| s.blocking.get(HEALTH_STATE_LABEL).copied() == Some(n);
        let live = |n: usize| move |s: &consul_sim::Stats| s.blocking_total - s.blocking_detached == n;
        assert_eq!(sim.stats().blocking.get(HEALTH_STATE_LABEL).copied(), Some(1), "five checks: every check's query alone");
        assert_eq!(w.metrics.watches("dedicated"), 2, "the third and fourth lanes are watches'");
        // Five more instances: ten checks.
        for (i, s) in svcs.iter().enumerate() {
            env.register(&format!("{s}-node"), &format!("{s}-2"), s, 9000 + i as u16, "passing", &[]).await;
        }
        let (stats, ok) = sim.wait_for_stats(DEADLINE, checks_queries(3)).await;
        assert!(ok, "ten checks: the critical and warning checks' queries block too: {stats:?}");
        assert_eq!(w.metrics.watches("dedicated"), 0, "the dedicated watches gave their lanes up");
        let (stats, ok) = sim.wait_for_stats(DEADLINE, live(4)).await;
        assert!(ok, "the feed's four queries block, within the budget: {stats:?}");
        // Seven instances gone: three checks, below half of eight.
        for s in &svcs[..4] {
            env.deregister(&format!("{s}-node"), &format!("{s}-2")).await;
        }
        for s in &svcs[..3] {
            env.deregister(&format!("{s}-node"), &format!("{s}-1")).await;
        }
        let live_checks_queries = |s: &consul_sim::Stats| {
            s.blocking.get(HEALTH_STATE_LABEL).copied().unwrap_or(0).saturating_sub(s.blocking_detached) == 1
        };
        let (stats, ok) = sim.wait_for_stats(DEADLINE, live_checks_queries).await;
        assert!(ok, "three checks: the status queries stop: {stats:?}");
        let (stats, ok) = sim.wait_for_stats(DEADLINE, live(4)).await;
        assert!(ok, "their lanes go back to watches' own queries: {stats:?}");
        assert_eq!(w.metrics.watches("dedicated"), 2);
    }
}

on_both_agents! {
    /// A large group's feed asks for two lanes more, for its critical and warning checks'
    /// queries; where the budget has not both left without sweeping a watch, it goes
    /// without, and the gauge counts it, until they are free.
    async fn a_feed_short_of_its_status_lanes_is_counted_until_they_are_free(config: Config) {
        let env = Env::start(config).await;
        assert!(env.admin_token.is_none(), "a second token makes a second group only without ACLs");
        // Two groups on one server: two tokens, five services each, every check seen by both.
        let scoped = |token: &str, s: &str| {
            let mut k = env.key(s);
            k.scope_mut().server.token = Some(Secret::new(token));
            k
        };
        let teams: Vec<Vec<String>> =
            (0..2).map(|t| (0..5).map(|i| unique(&format!("lane{t}-{i}"))).collect()).collect();
        for team in &teams {
            one_instance_each(&env, team).await;
        }
        // A budget of 5: one read and four lanes, a feed of two for each group. Ten checks
        // (and a real agent's own node check) are not large; fourteen are.
        let mut w = Watches::new(Settings { status_queries_from_checks: 14, ..at_defaults(5) });
        let keys: Vec<Vec<ConsulKey>> = ["team-a", "team-b"]
            .iter()
            .zip(&teams)
            .map(|(token, team)| team.iter().map(|s| scoped(token, s)).collect())
            .collect();
        w.start_each_with_one_instance(keys.iter().flatten()).await;
        feed_settled(&env).await;
        condition_within("a feed for each group", || w.metrics.feeds() == 2).await;
        assert_eq!(w.metrics.feeds_short_of_status_lanes(), 0, "small groups ask for no lane");
        for s in &teams[0][..4] {
            env.register(&format!("{s}-node"), &format!("{s}-2"), s, 9000, "passing", &[]).await;
        }
        condition_within("both feeds short of their status lanes", || w.metrics.feeds_short_of_status_lanes() == 2)
            .await;
        assert_eq!(w.metrics.watches("swept"), 0, "no watch is swept for status lanes");
        let status_queries = |sim: &RunningSim, status: &str| {
            let path = format!("/v1/health/state/{status}");
            sim.requests().iter().filter(|r| r.path == path).count()
        };
        if let Some(sim) = &env.sim {
            let sent = (status_queries(sim, "critical"), status_queries(sim, "warning"));
            assert_eq!(sent, (0, 0), "no status query without lanes");
        }
        // The second group leaves: its feed's lanes are free, and the first feed takes one.
        for k in &keys[1] {
            w.stop(k);
        }
        condition_within("the remaining feed given its lanes", || w.metrics.feeds_short_of_status_lanes() == 0).await;
        assert_eq!(w.metrics.feeds(), 1);
        if let Some(sim) = &env.sim {
            condition_within("the critical and warning checks' queries sent", || {
                status_queries(sim, "critical") > 0 && status_queries(sim, "warning") > 0
            })
            .await;
        }
    }
}

/// Waits (up to the deadline) until `condition` holds; panics naming `what` if it never does.
async fn condition_within(what: &str, condition: impl Fn() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !condition() {
        assert!(Instant::now() < deadline, "not within {DEADLINE:?}: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The non-blocking health reads the watches sent, by the operator's own counters.
fn reads(w: &Watches) -> u64 {
    w.metrics.requests("service", "read", "ok")
}

/// Waits (up to the deadline) until the watches have sent no health read for `quiet`.
async fn reads_settled(w: &Watches, quiet: Duration) {
    let deadline = Instant::now() + DEADLINE;
    let (mut seen, mut since) = (reads(w), Instant::now());
    while since.elapsed() < quiet {
        assert!(Instant::now() < deadline, "health reads did not settle");
        tokio::time::sleep(Duration::from_millis(20)).await;
        if reads(w) != seen {
            (seen, since) = (reads(w), Instant::now());
        }
    }
}

on_both_agents! {
    /// Many services on one node, as an agent registers its host's, most of them fed. A
    /// port change that rewrites no check (Consul 1.8 keeps a check a registration names
    /// again unchanged; the simulator with `keeps_unchanged_checks`) moves the catalog
    /// alone: no check write accounts for it. The feed locates what the move wrote (the
    /// node's instances, and the index that last wrote each) and re-reads that service
    /// alone, not every fed one, and the new port is seen promptly. (A 0.9 agent rewrites
    /// the check with the port, and its checks account for the move.)
    async fn a_port_change_no_check_accounts_for_rereads_that_service_alone(config: Config) {
        let keeps = !config.ignores_newer_parameters;
        let env = Env::start(Config { keeps_unchanged_checks: keeps, ..config }).await;
        let host = unique("host");
        let svcs: Vec<String> = (0..16).map(|i| unique(&format!("onhost{i}"))).collect();
        for (i, s) in svcs.iter().enumerate() {
            env.register(&host, &format!("{s}-1"), s, 8000 + i as u16, "passing", &[]).await;
        }
        let mut raft = env.raft_index().await;
        // A budget of 4: one read and three lanes, a feed and one dedicated query.
        let mut w = Watches::new(at_defaults(4));
        let keys: Vec<ConsulKey> = svcs.iter().map(|s| env.key(s)).collect();
        w.start_each_with_one_instance(keys.iter()).await;
        feed_settled(&env).await;
        reads_settled(&w, Duration::from_millis(500)).await;
        // Three changes judged, of three services at least: at most one is the dedicated one.
        let mut judged = 0;
        for (round, i) in [3usize, 7, 11, 5, 9, 13].into_iter().enumerate() {
            let (port, before) = (9000 + round as u16, reads(&w));
            env.register(&host, &format!("{}-1", svcs[i]), &svcs[i], port, "passing", &[]).await;
            let since = std::mem::replace(&mut raft, env.raft_index().await);
            w.answer_within(&keys[i], "the new port", PROMPT, |e| ports(e) == [port]).await;
            // Whatever is still coming for this change has come once the wait for the
            // checks is over (at most 3 s) and the re-reads it set off are done.
            reads_settled(&w, Duration::from_millis(1500)).await;
            let reread = reads(&w) - before;
            eprintln!("port change {round}: {reread} health reads");
            let mut others = Vec::new();
            if let Some(sim) = &env.sim {
                others = fed_rereads_except(sim, &svcs, &svcs[i]);
                sim.clear_requests();
            }
            if since.zip(raft).is_some_and(|(since, now)| now != since + 1) {
                // Another raft write came within the move (on a real agent): an index that
                // neither the checks nor the catalog explain, so everyone is re-read.
                eprintln!("port change {round}: another raft write within the move, not judged");
                continue;
            }
            assert!(others.is_empty(), "change {round}: only {} is re-read, not {others:?}", svcs[i]);
            // Against an agent of its own (one shared with other tests holds too many nodes
            // for the feed to locate anything in them).
            if env.sim.is_some() || env._agent.is_some() {
                assert!(reread <= 2, "change {round}: {reread} services re-read for one port change");
            }
            judged += 1;
            if judged == 3 {
                break;
            }
        }
        assert_eq!(judged, 3, "three of six port changes came without another raft write");
        env.put("/v1/catalog/deregister", json!({"Node": host})).await;
    }
}

on_both_agents! {
    /// Several scopes on one server at a small budget: the same agent spelled two ways, and
    /// a second team's token. Every scope's fed services see their health change both ways
    /// as promptly as a dedicated query would: each scope gets a change feed (the first
    /// scope's feed must not hold the budget's feed permits while the others wait for a
    /// slot no one frees).
    async fn every_scope_gets_a_feed(config: Config) {
        let env = Env::start(config).await;
        let localhost = env.address.replace("127.0.0.1", "localhost");
        // Two spellings of one agent; and, where tokens are not checked (no ACLs), a second
        // token, which is another scope to us whatever the agent does with it.
        // Each scope as (address, token).
        let mut scopes: Vec<(String, Option<Secret>)> = vec![
            (env.address.clone(), env.admin_token.clone().map(Secret::new)),
            (localhost, env.admin_token.clone().map(Secret::new)),
        ];
        if env.admin_token.is_none() {
            scopes.push((env.address.clone(), Some(Secret::new("second-team-token"))));
        }
        let scoped = |(address, token): &(String, Option<Secret>), s: &str| {
            let mut k = env.key(s);
            let server = &mut k.scope_mut().server;
            (server.address, server.token) = (address.clone(), token.clone());
            k
        };
        let svcs: Vec<Vec<String>> =
            (0..scopes.len()).map(|t| (0..6).map(|i| unique(&format!("team{t}-{i}"))).collect()).collect();
        for team in &svcs {
            one_instance_each(&env, team).await;
        }
        // A budget of 8: one read and seven lanes for blocking queries, far fewer than the
        // watches. The two spellings of one server share a feed (plain HTTP, one token);
        // the second token needs its own.
        let mut w = Watches::new(at_defaults(8));
        let keys: Vec<Vec<ConsulKey>> =
            scopes.iter().zip(&svcs).map(|(scope, team)| team.iter().map(|s| scoped(scope, s)).collect()).collect();
        w.start_each_with_one_instance(keys.iter().flatten()).await;
        feed_settled(&env).await;
        if let Some(sim) = &env.sim {
            let feeds = if env.admin_token.is_none() { 2 } else { 1 };
            let (stats, ok) =
                sim.wait_for_stats(DEADLINE, |s| s.blocking.get(HEALTH_STATE_LABEL).copied() == Some(feeds)).await;
            assert!(ok, "{feeds} change feeds: {stats:?}");
        }
        for (team, keys) in svcs.iter().zip(&keys) {
            for (i, status) in [(1, "critical"), (1, "passing"), (2, "critical"), (2, "passing")] {
                let started = Instant::now();
                env.register(&format!("{}-node", team[i]), &format!("{}-1", team[i]), &team[i], 8000 + i as u16, status, &[])
                    .await;
                let want = if status == "passing" { 1 } else { 0 };
                w.answer_within(&keys[i], &format!("its check {status}"), PROMPT, |e| e.len() == want).await;
                eprintln!("{}: {status} after {:?}", keys[i], started.elapsed());
            }
            env.node_check(&format!("{}-node", team[3]), "critical").await;
            w.answer_within(&keys[3], "its node critical", PROMPT, |e| e.is_empty()).await;
            env.node_check(&format!("{}-node", team[3]), "passing").await;
            w.answer_within(&keys[3], "its node passing again", PROMPT, |e| e.len() == 1).await;
        }
        if let Some(sim) = &env.sim {
            let stats = sim.stats();
            assert_eq!(stats.total_429, 0, "{stats:?}");
        }
    }
}

on_both_agents! {
    /// Fed `connect: true` watches follow their proxies, whose checks and registrations carry
    /// the proxy's name (`<service>-sidecar-proxy`, or any other), not the destination's.
    #[cfg_attr(e2e_consul_without_connect, ignore = "the agent at E2E_CONSUL_ADDR predates Connect (1.2)")]
    async fn fed_connect_watches_follow_their_proxies(config: Config) {
        let env = Env::start(config).await;
        // A budget of 4: one dedicated query, which a plain watch started first takes.
        let mut w = Watches::new(at_defaults(4));
        let first = unique("first");
        env.register("first-node", &format!("{first}-1"), &first, 1, "passing", &[]).await;
        let first = env.key(&first);
        w.start(&first);
        w.answer(&first, "the first watch's answer", |e| e.len() == 1).await;
        // Three Connect watches: with the first, more watches than lanes.
        let svcs: Vec<String> = (0..3).map(|i| unique(&format!("mesh{i}"))).collect();
        let proxy = |svc: &str, name: &str, id: &str, port: u16, status: &str| {
            json!({"Node": format!("{svc}-node"), "Address": "127.0.0.1",
                   "Service": {"ID": id, "Service": name, "Kind": "connect-proxy", "Port": port,
                               "Proxy": {"DestinationServiceName": svc, "DestinationServiceID": format!("{svc}-1"),
                                         "LocalServicePort": 8080}},
                   "Check": {"CheckID": format!("service:{id}"), "Name": "proxy", "Status": status, "ServiceID": id}})
        };
        let keys: Vec<ConsulKey> = svcs
            .iter()
            .map(|s| env.key(s).with_scope(|s| s.query = QueryOptions { connect: true, ..QueryOptions::default() }))
            .collect();
        for s in &svcs {
            env.register(&format!("{s}-node"), &format!("{s}-1"), s, 8080, "passing", &[]).await;
            env.put("/v1/catalog/register", proxy(s, &format!("{s}-sidecar-proxy"), &format!("{s}-p1"), 21000, "passing"))
                .await;
        }
        for k in &keys {
            w.start(k);
            w.answer(k, "the proxy", |e| ports(e) == [21000]).await;
        }
        feed_settled(&env).await;
        let s = &svcs[1];
        if let Some(sim) = &env.sim {
            let blocking = sim.stats().blocking.get(&format!("{HEALTH_CONNECT_LABEL_PREFIX}{s}")).copied();
            assert_eq!(blocking.unwrap_or(0), 0, "the Connect watch under test is fed");
        }
        let sidecar = format!("{s}-sidecar-proxy");
        env.put("/v1/catalog/register", proxy(s, &sidecar, &format!("{s}-p1"), 21000, "critical")).await;
        w.answer_within(&keys[1], "its proxy critical", PROMPT, |e| e.is_empty()).await;
        env.put("/v1/catalog/register", proxy(s, &sidecar, &format!("{s}-p1"), 21000, "passing")).await;
        w.answer_within(&keys[1], "its proxy passing again", PROMPT, |e| ports(e) == [21000]).await;
        env.put("/v1/catalog/register", proxy(s, &sidecar, &format!("{s}-p2"), 21001, "passing")).await;
        w.answer_within(&keys[1], "a second sidecar", PROMPT, |e| ports(e) == [21000, 21001]).await;
        // A proxy whose name follows no convention.
        env.put("/v1/catalog/register", proxy(s, &format!("{s}-edge"), &format!("{s}-e1"), 21002, "passing")).await;
        w.answer_within(&keys[1], "a proxy with another name", PROMPT, |e| ports(e) == [21000, 21001, 21002]).await;
        env.deregister(&format!("{s}-node"), &format!("{s}-p2")).await;
        w.answer_within(&keys[1], "the second sidecar gone", PROMPT, |e| ports(e) == [21000, 21002]).await;
    }
}

on_both_agents! {
    simulator_only: "needs the simulator's fault injection or request log";
    /// A slot that frees goes to a fed watch at once, not at its next wake-up: when the
    /// dedicated watch stops, the fed one is blocking on its own query within a moment.
    async fn a_freed_slot_goes_to_a_fed_watch_at_once(config: Config) {
        let env = Env::start(config).await;
        let sim = env.simulator();
        let holder = unique("holder");
        let waiters: Vec<String> = (0..3).map(|i| unique(&format!("waiter{i}"))).collect();
        one_instance_each(&env, &[vec![holder.clone()], waiters.clone()].concat()).await;
        // A budget of 4: one read and three lanes for four watches: a feed (two lanes) and
        // one dedicated query, which the first watch holds.
        let mut w = Watches::new(at_defaults(4));
        fn blocking(name: &str) -> impl Fn(&consul_sim::Stats) -> bool + '_ {
            move |s| s.blocking.get(name).copied().unwrap_or(0) >= 1
        }
        let kh = env.key(&holder);
        w.start(&kh);
        w.answer(&kh, "the holder's answer", |e| e.len() == 1).await;
        let (_, ok) = sim.wait_for_stats(DEADLINE, blocking(&holder)).await;
        assert!(ok, "the first watch blocks on its own query");
        let keys: Vec<ConsulKey> = waiters.iter().map(|s| env.key(s)).collect();
        for k in &keys {
            w.start(k);
            w.answer(k, "the waiter's answer", |e| e.len() == 1).await;
        }
        feed_settled(&env).await;
        let stats = sim.stats();
        for name in &waiters {
            assert_eq!(stats.blocking.get(name.as_str()).copied().unwrap_or(0), 0, "{name} is fed: {stats:?}");
        }
        assert!(blocking(&holder)(&stats), "the holder kept its lane");
        let stopped = Instant::now();
        w.stop(&kh);
        // Three watches on three lanes: each gets one, the feed stops.
        for name in &waiters {
            let (stats, ok) = sim.wait_for_stats(Duration::from_secs(2), blocking(name)).await;
            assert!(ok, "the freed lanes did not go to the fed watches within 2 s: {stats:?}");
        }
        eprintln!("the fed watches blocked on their own queries {:?} after the lane freed", stopped.elapsed());
        // (An older agent keeps a dropped query until its wait ends: count ours.)
        assert_eq!(w.metrics.feeds(), 0, "a feed with no member left stops");
        assert_eq!(w.metrics.watches("dedicated"), 3);
        let b = &waiters[0];
        env.register(&format!("{b}-node"), &format!("{b}-1"), b, 9999, "passing", &[]).await;
        w.answer_within(&keys[0], "a change through its own query", PROMPT, |e| ports(e) == [9999]).await;
    }
}

on_both_agents! {
    simulator_only: "namespaces are Enterprise, and which watch blocks is read from the simulator";
    /// A swept watch handed a lane that freed blocks on its own query at the default `wait`,
    /// and a change arrives within PROMPT: one left reading at the sweep, or blocking on an
    /// index its last read did not give it, would wait minutes.
    async fn a_swept_watch_given_a_lane_follows_changes_at_the_default_wait(config: Config) {
        let env = Env::start(config).await;
        let sim = env.simulator();
        // Four services, each in a namespace of its own: four groups, no feed can serve two.
        let svcs: Vec<String> = (0..4).map(|i| unique(&format!("team{i}"))).collect();
        let register = |i: usize, port: u16| {
            let s = &svcs[i];
            json!({"Node": format!("{s}-node"), "Address": "127.0.0.1", "Namespace": format!("team-{i}"),
                   "Service": {"ID": format!("{s}-1"), "Service": s, "Port": port},
                   "Check": {"CheckID": format!("service:{s}-1"), "Name": "c", "Status": "passing",
                             "ServiceID": format!("{s}-1")}})
        };
        for i in 0..svcs.len() {
            env.put("/v1/catalog/register", register(i, 8000)).await;
        }
        // A budget of 4: one read and three lanes, so three watches are dedicated and the
        // fourth is swept.
        let mut w = Watches::new(at_defaults(4));
        let keys: Vec<ConsulKey> = (0..svcs.len())
            .map(|i| env.key(&svcs[i]).with_scope(|s| s.namespace = Some(format!("team-{i}"))))
            .collect();
        for k in &keys {
            w.start(k);
            w.answer(k, "the first answer", |e| e.len() == 1).await;
        }
        let blocking = |stats: &consul_sim::Stats, s: &str| stats.blocking.get(s).copied().unwrap_or(0) >= 1;
        let (stats, ok) = sim.wait_for_stats(DEADLINE, |st| svcs.iter().filter(|s| blocking(st, s)).count() == 3).await;
        assert!(ok, "three dedicated queries: {stats:?}");
        assert_eq!(w.metrics.watches("swept"), 1);
        let swept = svcs.iter().position(|s| !blocking(&stats, s)).expect("one swept");
        let holder = (swept + 1) % svcs.len();
        w.stop(&keys[holder]);
        let (stats, ok) = sim.wait_for_stats(Duration::from_secs(2), |st| blocking(st, &svcs[swept])).await;
        assert!(ok, "the freed lane went to the swept watch within 2 s: {stats:?}");
        assert_eq!(w.metrics.watches("swept"), 0);
        env.put("/v1/catalog/register", register(swept, 9000)).await;
        w.answer_within(&keys[swept], "a change through its own query", PROMPT, |e| ports(e) == [9000]).await;
    }
}

on_both_agents! {
    simulator_only: "needs the simulator's fault injection or request log";
    /// A minute without Consul, then a fresh cluster on the same address (a lower index, new
    /// data). While it is down every watch reports the failure and keeps quiet: at most one
    /// connection attempt a second for the whole server, however many watches (one probe,
    /// not a backoff per watch). When it is back every service converges within 5 s.
    async fn a_minute_without_consul_then_a_fresh_cluster(config: Config) {
        const SERVICES: usize = 60;
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut config = Config { initial_index: 5_000, ..config };
        let sim = Simulator::start(config.clone()).await.expect("simulator starts");
        let env = Env { address: sim.base_url(), admin_token: None, sim: Some(sim), _agent: None, http: reqwest::Client::new() };
        let svcs: Vec<String> = (0..SERVICES).map(|i| format!("outage-{i}")).collect();
        one_instance_each(&env, &svcs).await;
        // Some dedicated queries, the rest fed.
        let mut w = Watches::new(Settings { wait: Duration::from_secs(60), sweep: NO_SWEEP, ..settings(20) });
        let keys: Vec<ConsulKey> = svcs.iter().map(|s| env.key(s)).collect();
        w.start_each_with_one_instance(keys.iter()).await;
        feed_settled(&env).await;

        let addr = env.simulator().addr();
        let Env { sim, .. } = env;
        sim.expect("ours").shutdown().await;
        let down = Instant::now();
        // Every watch says so, fed ones included.
        let mut failed = BTreeSet::new();
        while failed.len() < SERVICES {
            match w.next(down + DEADLINE).await {
                Some(Event::Consul(k, ConsulEvent::Failed(m))) => {
                    assert!(m.contains(&addr.to_string()), "{m}");
                    failed.insert(k.service);
                }
                Some(_) => {}
                None => panic!("only {} of {SERVICES} watches reported Consul gone: {failed:?}", failed.len()),
            }
        }
        // Attempts over the rest of the minute: the requests counted, whatever their kind.
        tokio::time::sleep_until(down + Duration::from_secs(2)).await;
        let before = w.metrics.requests_total();
        tokio::time::sleep_until(down + Duration::from_secs(60)).await;
        let attempts = w.metrics.requests_total() - before;
        eprintln!("{attempts} requests in the 58 s without Consul, for {SERVICES} watches");
        assert!(attempts <= 58, "{attempts} connection attempts in 58 s: more than one a second");

        // A fresh cluster: a lower index, every service on a new port.
        config.listen = addr;
        config.initial_index = 2;
        let sim = Simulator::start(config).await.expect("the simulator starts again on the same address");
        let env = Env { address: sim.base_url(), admin_token: None, sim: Some(sim), _agent: None, http: reqwest::Client::new() };
        for (i, s) in svcs.iter().enumerate() {
            env.register(&format!("{s}-node"), &format!("{s}-1"), s, 9000 + i as u16, "passing", &[]).await;
        }
        let back = Instant::now();
        let mut converged = BTreeSet::new();
        while converged.len() < SERVICES {
            match w.next(back + Duration::from_secs(5)).await {
                Some(Event::Consul(k, ConsulEvent::Answer { endpoints, .. })) => {
                    let i = svcs.iter().position(|s| *s == k.service).expect("one of ours");
                    if ports(&endpoints) == [9000 + i as u16] {
                        converged.insert(k.service);
                    }
                }
                Some(_) => {}
                None => panic!("{} of {SERVICES} services converged within 5 s of Consul's return", converged.len()),
            }
        }
        eprintln!("every service converged {:?} after Consul came back", back.elapsed());
    }
}

on_both_agents! {
    simulator_only: "needs the simulator's fault injection or request log";
    /// After a failed request the index is forgotten: a Consul that comes back as a fresh
    /// cluster with lower indexes is followed at once, not after the blocking wait (a
    /// minute here) on the old index.
    async fn a_failed_request_forgets_the_index(config: Config) {
        let env = Env::start(config).await;
        let sim = env.simulator();
        let svc = unique("reborn");
        for i in 0..20 {
            env.register("n1", &format!("{svc}-{i}"), &svc, 1000 + i, "passing", &[]).await;
        }
        let mut w = Watches::new(Settings { wait: Duration::from_secs(60), ..settings(10) });
        let key = env.key(&svc);
        w.start(&key);
        w.answer(&key, "twenty instances", |e| e.len() == 20).await;
        let (_, ok) = sim.wait_for_stats(DEADLINE, |s| s.blocking.get(svc.as_str()).copied() == Some(1)).await;
        assert!(ok, "blocking on the current index");
        // The server goes away mid-query and comes back with lower indexes and new data.
        sim.reset_indexes(1);
        env.register("n1", &format!("{svc}-new"), &svc, 7000, "passing", &[]).await;
        sim.drop_blocking();
        let started = Instant::now();
        w.answer(&key, "the new instance", |e| e.iter().any(|e| e.port == 7000)).await;
        assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
    }
}

on_both_agents! {
    /// The resolver options: statuses, excluded tags, consistency, the agent cache and the
    /// published address, on the wire and in the answer.
    async fn query_options_shape_the_query_and_the_answer(config: Config) {
        let env = Env::start(config).await;
        let svc = unique("opts");
        // One instance with an address of its own, which `address: node` passes over.
        let id = format!("{svc}-p");
        env.put(
            "/v1/catalog/register",
            json!({"Node": "n1", "Address": "127.0.0.1",
                   "Service": {"ID": id, "Service": svc, "Port": 1, "Tags": ["v2"], "Address": "10.9.9.1"},
                   "Check": {"CheckID": format!("service:{id}"), "Name": "check", "Status": "passing", "ServiceID": id}}),
        )
        .await;
        env.register("n2", &format!("{svc}-w"), &svc, 2, "warning", &["v2"]).await;
        env.register("n3", &format!("{svc}-c"), &svc, 3, "critical", &["v2"]).await;
        env.register("n4", &format!("{svc}-canary"), &svc, 4, "passing", &["v2", "canary"]).await;
        let mut w = Watches::new(settings(10));
        let base = env.key(&svc);
        let key = base.with_scope(|s| {
            s.query = QueryOptions {
                statuses: HealthStatuses { passing: true, warning: true, critical: false },
                tags: ["v2".to_owned()].into(),
                excluded_tags: ["CANARY".to_owned()].into(),
                consistency: Consistency::Stale,
                cached: true,
                address: AddressType::Node,
                ..QueryOptions::default()
            }
        });
        w.start(&key);
        let eps = w.answer(&key, "passing and warning, no canary", |e| !e.is_empty()).await;
        assert_eq!(ports(&eps), [1, 2]);
        assert!(eps.iter().all(|e| e.address == "127.0.0.1"), "the node's address: {eps:?}");
        if let Some(sim) = &env.sim {
            let r = sim.requests().into_iter().find(|r| r.service.as_deref() == Some(svc.as_str())).unwrap();
            let params: Vec<&str> = r.query.split('&').map(|p| p.split('=').next().unwrap()).collect();
            for p in ["stale", "cached", "tag"] {
                assert!(params.contains(&p), "{p} in {}", r.query);
            }
            assert!(!params.contains(&"passing"), "statuses beyond passing are filtered here: {}", r.query);
        }
    }
}

on_both_agents! {
    /// `connect: true` publishes the service's sidecar proxies, and follows them.
    #[cfg_attr(e2e_consul_without_connect, ignore = "the agent at E2E_CONSUL_ADDR predates Connect (1.2)")]
    async fn connect_publishes_the_sidecar_proxies(config: Config) {
        let env = Env::start(config).await;
        let svc = unique("mesh");
        env.register("n1", &format!("{svc}-1"), &svc, 8080, "passing", &[]).await;
        let proxy = |id: &str, port: u16, status: &str| {
            json!({"Node": "n1", "Address": "127.0.0.1",
                   "Service": {"ID": id, "Service": format!("{svc}-sidecar-proxy"), "Kind": "connect-proxy", "Port": port,
                               "Proxy": {"DestinationServiceName": svc, "DestinationServiceID": format!("{svc}-1"),
                                         "LocalServicePort": 8080}},
                   "Check": {"CheckID": format!("service:{id}"), "Name": "proxy", "Status": status, "ServiceID": id}})
        };
        env.put("/v1/catalog/register", proxy(&format!("{svc}-proxy-1"), 21000, "passing")).await;
        let mut w = Watches::new(settings(10));
        let base = env.key(&svc);
        let key = base.with_scope(|s| s.query.connect = true);
        w.start(&key);
        w.answer(&key, "the proxy, not the service", |e| ports(e) == [21000]).await;
        env.put("/v1/catalog/register", proxy(&format!("{svc}-proxy-2"), 21001, "passing")).await;
        w.answer(&key, "a second proxy", |e| ports(e) == [21000, 21001]).await;
        if let Some(sim) = &env.sim {
            let r = sim.requests().into_iter().find(|r| r.service.as_deref() == Some(svc.as_str())).unwrap();
            assert!(r.path.starts_with("/v1/health/connect/"), "{}", r.path);
        }
    }
}

/// The health requests for `service` in the log: (ms since the simulator started, status).
fn request_times(sim: &RunningSim, service: &str) -> Vec<(u64, Option<u16>)> {
    sim.requests().into_iter().filter(|r| r.service.as_deref() == Some(service)).map(|r| (r.at_ms, r.status)).collect()
}

on_both_agents! {
    simulator_only: "needs the simulator's fault injection or request log";
    /// A 429 with `Retry-After` longer than the backoff is honoured: no retry before it has
    /// passed (the backoff alone would retry after 250 ms, then 500 ms). Then the answer.
    async fn a_retry_after_longer_than_the_backoff_is_honoured(config: Config) {
        let env = Env::start(config).await;
        let sim = env.simulator();
        let svc = unique("ra");
        env.register("n1", &format!("{svc}-1"), &svc, 1, "passing", &[]).await;
        let mut w = Watches::new(settings(10));
        let key = env.key(&svc);
        w.start(&key);
        w.answer(&key, "the instance", |e| ports(e) == [1]).await;
        sim.set_faults(FaultsPatch {
            too_many_requests: Some(Budget::Always),
            retry_after_s: Some(1),
            ..Default::default()
        });
        sim.clear_requests();
        // Wakes the blocking query (sent before the fault); the next one meets it.
        env.register("n1", &format!("{svc}-1"), &svc, 2, "passing", &[]).await;
        let msg = w.failure(&key, "a 429").await;
        assert!(msg.contains("429"), "{msg}");
        tokio::time::sleep(Duration::from_millis(3300)).await;
        let limited: Vec<u64> =
            request_times(sim, &svc).into_iter().filter(|(_, s)| *s == Some(429)).map(|(t, _)| t).collect();
        assert!(limited.len() >= 2, "retried: {limited:?}");
        for pair in limited.windows(2) {
            assert!(pair[1] - pair[0] >= 990, "a retry {} ms after a 429 asking for 1 s: {limited:?}", pair[1] - pair[0]);
        }
        sim.clear_faults();
        w.answer(&key, "the change, once the limit lifts", |e| ports(e) == [2]).await;
    }
}

on_both_agents! {
    simulator_only: "needs the simulator's fault injection or request log";
    /// A 200 whose body is not JSON, or is cut off mid-way, is a failure like any other
    /// (index forgotten, backoff, endpoints kept): never a partial list of endpoints.
    async fn unreadable_or_cut_off_answers_are_failures_never_partial_lists(config: Config) {
        let env = Env::start(config).await;
        let sim = env.simulator();
        let svc = unique("cut");
        for i in 0..20u16 {
            env.register(&format!("n{i}"), &format!("{svc}-{i}"), &svc, 1000 + i, "passing", &[]).await;
        }
        let mut w = Watches::new(settings(10));
        let key = env.key(&svc);
        w.start(&key);
        w.answer(&key, "20 instances", |e| e.len() == 20).await;
        let mut count = 20u16;
        for (fault, says) in [
            (FaultsPatch { bad_body: Some(Budget::Always), ..Default::default() }, &["unreadable answer"][..]),
            // A body cut off is reported by the HTTP client, as the connection's failure.
            (FaultsPatch { truncated_body: Some(Budget::Always), ..Default::default() }, &["cannot reach", "unreadable"]),
        ] {
            sim.set_faults(fault);
            // Wakes the blocking query sent before the fault: it answers whole.
            env.register("late", &format!("{svc}-{count}"), &svc, 1000 + count, "passing", &[]).await;
            count += 1;
            let deadline = Instant::now() + DEADLINE;
            let message = loop {
                match w.next(deadline).await {
                    Some(Event::Consul(k, ConsulEvent::Answer { endpoints, .. })) if k == key => {
                        assert_eq!(endpoints.len(), usize::from(count), "only whole answers are answers");
                    }
                    Some(Event::Consul(k, ConsulEvent::Failed(m))) if k == key => break m,
                    Some(_) => {}
                    None => panic!("no failure for {says:?} within {DEADLINE:?}"),
                }
            };
            assert!(says.iter().any(|s| message.contains(s)) && message.contains(&env.address), "{message}");
            // Retried with backoff, not in a loop.
            let n = count_requests(sim, &svc, Duration::from_secs(2)).await;
            assert!((1..=5).contains(&n), "{n} requests in 2 s while failing");
            sim.clear_faults();
            let want = usize::from(count);
            w.answer(&key, "whole again", |e| e.len() == want).await;
        }
    }
}

on_both_agents! {
    simulator_only: "needs the simulator's fault injection or request log";
    /// Slow answers (every request held 1.5 s) are answers, not failures.
    async fn slow_answers_are_answers(config: Config) {
        let env = Env::start(config).await;
        let sim = env.simulator();
        let svc = unique("slow");
        env.register("n1", &format!("{svc}-1"), &svc, 1, "passing", &[]).await;
        let mut w = Watches::new(settings(10));
        let key = env.key(&svc);
        w.start(&key);
        w.answer(&key, "the instance", |e| ports(e) == [1]).await;
        sim.set_faults(FaultsPatch { latency_ms: Some(1500), ..Default::default() });
        for port in [2, 3] {
            env.register("n1", &format!("{svc}-1"), &svc, port, "passing", &[]).await;
            match w.until(&key, "the next event", |_| true).await {
                ConsulEvent::Answer { endpoints, .. } => assert_eq!(ports(&endpoints), [port]),
                ConsulEvent::Failed(m) => panic!("a slow answer is not a failure: {m}"),
                other => panic!("not a cached read: {other:?}"),
            }
        }
    }
}

/// A test of the newer query parameters (`filter`, `cached`, `peer`, `sameness-group`), run
/// against a current agent and against the older agents' indexes and `null` shapes with the
/// parameters understood, so that their answers are read in both shapes. (An agent that
/// predates a parameter ignores it, as Go ignores any unknown parameter: docs/consul.md says
/// which versions a user needs.) And against a real agent, as `on_both_agents!` does.
macro_rules! on_current_and_older_shapes {
    (simulator_only: $why:literal; $($rest:tt)*) => {
        on_both_agents!(@variants older_shapes, Config { ignores_newer_parameters: false, ..Config::legacy() },
            [#[ignore = $why]] $($rest)*);
    };
    ($($rest:tt)*) => {
        on_both_agents!(@variants older_shapes, Config { ignores_newer_parameters: false, ..Config::legacy() },
            [#[cfg_attr(e2e_no_real_agent, ignore = "no real Consul agent (bash scripts/real-parts.sh consul)")]] $($rest)*);
    };
}

fn with_filter(key: ConsulKey, expression: &str) -> ConsulKey {
    key.with_scope(|s| s.query.filter = Some(expression.into()))
}

on_current_and_older_shapes! {
    #[cfg_attr(e2e_consul_without_filter, ignore = "the agent at E2E_CONSUL_ADDR predates filters (1.4)")]
    async fn filter_is_applied_by_consul_and_its_refusal_is_the_watch_error(config: Config) {
        let env = Env::start(config).await;
        let svc = unique("filtered");
        env.register("n1", &format!("{svc}-1"), &svc, 1, "passing", &["blue"]).await;
        env.register("n2", &format!("{svc}-2"), &svc, 2, "passing", &["green"]).await;
        let mut w = Watches::new(settings(10));
        let key = with_filter(env.key(&svc), r#""blue" in Service.Tags"#);
        w.start(&key);
        let eps = w.answer(&key, "the blue instance only", |e| !e.is_empty()).await;
        assert_eq!(ports(&eps), [1]);
        // Both ways: an instance enters the filter's selection, then leaves it.
        env.register("n2", &format!("{svc}-2"), &svc, 2, "passing", &["blue"]).await;
        w.answer(&key, "both, once green turned blue", |e| ports(e) == [1, 2]).await;
        env.register("n1", &format!("{svc}-1"), &svc, 1, "passing", &["green"]).await;
        w.answer(&key, "the other one, once blue turned green", |e| ports(e) == [2]).await;

        // An expression Consul refuses is that watch's error, in Consul's words.
        let bad = with_filter(env.key(&svc), "Service.Tags ==");
        w.start(&bad);
        let message = w.failure(&bad, "Consul's refusal").await;
        assert!(message.contains("Failed to create boolean expression evaluator"), "{message}");
        env.deregister("n1", &format!("{svc}-1")).await;
        env.deregister("n2", &format!("{svc}-2")).await;
    }
}

on_current_and_older_shapes! {
    simulator_only: "a peer's services are written through the simulator (peering replicates them)";
    async fn a_peer_is_read_from_its_own_data_set_both_ways(config: Config) {
        let env = Env::start(config).await;
        env.register("n1", "web-local", "web", 80, "passing", &[]).await;
        let imported = |status: &str| {
            json!({"Node": "east-n1", "Address": "127.0.0.2",
                   "Service": {"ID": "web-east", "Service": "web", "Port": 81},
                   "Check": {"CheckID": "service:web-east", "Name": "c", "Status": status, "ServiceID": "web-east"}})
        };
        env.put("/_sim/peers/east/register", imported("passing")).await;
        let mut w = Watches::new(settings(10));
        let key = env.key("web").with_scope(|s| s.remote = Some(Remote::Peer("east".into())));
        w.start(&key);
        let eps = w.answer(&key, "the peer's instance", |e| !e.is_empty()).await;
        assert_eq!((ports(&eps), eps[0].address.as_str()), (vec![81], "127.0.0.2"), "not the local one");
        env.put("/_sim/peers/east/register", imported("critical")).await;
        w.answer(&key, "the peer's instance gone critical", |e| e.is_empty()).await;
        env.put("/_sim/peers/east/register", imported("passing")).await;
        w.answer(&key, "the peer's instance back", |e| ports(e) == [81]).await;
    }
}

/// Sameness group `web-group`: the local partition, then peer `east`; each holds an
/// instance of `web` (the local one on port 80 with its check `local`, the peer's on 81,
/// passing). The key of a watch of `web` through the group.
async fn sameness_group_of_web(env: &Env, local: &str) -> ConsulKey {
    env.put(
        "/v1/config",
        json!({"Kind": "sameness-group", "Name": "web-group", "Members": [{"Partition": "default"}, {"Peer": "east"}]}),
    )
    .await;
    env.register("n1", "web-local", "web", 80, local, &[]).await;
    env.put(
        "/_sim/peers/east/register",
        json!({"Node": "east-n1", "Address": "127.0.0.2",
               "Service": {"ID": "web-east", "Service": "web", "Port": 81},
               "Check": {"CheckID": "service:web-east", "Name": "c", "Status": "passing", "ServiceID": "web-east"}}),
    )
    .await;
    env.key("web").with_scope(|s| s.remote = Some(Remote::SamenessGroup("web-group".into())))
}

on_current_and_older_shapes! {
    simulator_only: "sameness groups are Enterprise, and a peer's services are written through the simulator";
    async fn a_sameness_group_fails_over_to_the_next_member_and_back(config: Config) {
        let env = Env::start(config).await;
        let key = sameness_group_of_web(&env, "passing").await;
        // A dedicated watch at the default `wait`: each failover arrives within PROMPT.
        let mut w = Watches::new(at_defaults(10));
        w.start(&key);
        w.answer(&key, "the first member's instance", |e| ports(e) == [80]).await;
        env.register("n1", "web-local", "web", 80, "critical", &[]).await;
        w.answer_within(&key, "the peer's, the local one failing", PROMPT, |e| ports(e) == [81]).await;
        env.register("n1", "web-local", "web", 80, "passing", &[]).await;
        w.answer_within(&key, "the first member's again", PROMPT, |e| ports(e) == [80]).await;
    }
}

on_current_and_older_shapes! {
    simulator_only: "sameness groups are Enterprise, and a peer's services are written through the simulator";
    /// A sameness group whose first member has instances, none of them passing, when the
    /// watch starts. Consul decides the failover on what the query asks for, so the first
    /// read must ask for passing instances as the blocking queries do: asking for every
    /// instance, it got the first member's critical ones, filtered them to nothing, and then
    /// blocked on that index for the whole `wait` while the peer served.
    async fn a_sameness_groups_first_read_fails_over_as_its_blocking_queries_do(config: Config) {
        let env = Env::start(config).await;
        let key = sameness_group_of_web(&env, "critical").await;
        let mut w = Watches::new(at_defaults(10));
        w.start(&key);
        w.answer_within(&key, "the peer's instance, from the first read", PROMPT, |e| ports(e) == [81]).await;
        env.register("n1", "web-local", "web", 80, "passing", &[]).await;
        w.answer_within(&key, "the first member's, passing again", PROMPT, |e| ports(e) == [80]).await;
    }
}

on_current_and_older_shapes! {
    simulator_only: "sameness groups are Enterprise, and the member is picked by the simulator's switch";
    /// A sameness group whose Consul picks the member before the health filter: the first
    /// member with any instances answers, filtered to nothing when none passes. The watch
    /// walks the group's members itself then, so it fails over as when Consul picks after
    /// the filter, on the first read and on every wake, at the default `wait`.
    async fn a_sameness_group_picked_before_the_health_filter_still_fails_over(config: Config) {
        let env = Env::start(config).await;
        let key = sameness_group_of_web(&env, "critical").await;
        env.simulator().set_faults(FaultsPatch { sameness_before_health: Some(true), ..FaultsPatch::default() });
        let mut w = Watches::new(at_defaults(10));
        w.start(&key);
        w.answer_within(&key, "the peer's instance, from the first read", PROMPT, |e| ports(e) == [81]).await;
        env.register("n1", "web-local", "web", 80, "passing", &[]).await;
        w.answer_within(&key, "the first member's, passing again", PROMPT, |e| ports(e) == [80]).await;
        env.register("n1", "web-local", "web", 80, "critical", &[]).await;
        w.answer_within(&key, "the peer's, the local one failing", PROMPT, |e| ports(e) == [81]).await;
    }
}

on_current_and_older_shapes! {
    simulator_only: "needs the simulator's fault injection or request log";
    async fn a_cut_off_agent_cache_is_reported_with_its_cut_off_then_fresh_again(config: Config) {
        let env = Env::start(config).await;
        let sim = env.simulator();
        env.register("n1", "api-1", "api", 80, "passing", &[]).await;
        let mut w = Watches::new(settings(10));
        let key = env.key("api").with_scope(|s| s.query = QueryOptions { cached: true, ..QueryOptions::default() });
        w.start(&key);
        w.answer(&key, "the instance, fresh", |e| ports(e) == [80]).await;
        let before = std::time::SystemTime::now();
        sim.set_faults(FaultsPatch { agent_cut_off: Some(true), ..FaultsPatch::default() });
        let cut = w.until(&key, "the cache's answer, cut off", |ev| matches!(ev, ConsulEvent::Cached { .. })).await;
        let ConsulEvent::Cached { endpoints, cut_off_since, .. } = cut else { unreachable!() };
        assert_eq!(ports(&endpoints), [80], "the last endpoints are kept");
        let now = std::time::SystemTime::now();
        // `Age` is in whole seconds: the cut-off is known to a second.
        assert!(
            cut_off_since + Duration::from_secs(2) >= before && cut_off_since <= now,
            "cut off since {cut_off_since:?}, fault set at {before:?}"
        );
        sim.set_faults(FaultsPatch { agent_cut_off: Some(false), ..FaultsPatch::default() });
        w.answer(&key, "fresh again once the servers are back", |e| ports(e) == [80]).await;
        env.register("n1", "api-1", "api", 81, "passing", &[]).await;
        w.answer(&key, "a change, fresh", |e| ports(e) == [81]).await;
    }
}
