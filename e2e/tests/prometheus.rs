//! The monitoring of manifests/monitoring, checked by the real thing: Debian's `promtool`
//! checks the alert rules and runs their unit tests, and a real Prometheus scrapes the
//! operator (its own process, real RBAC) while the world changes, with the alert rules
//! loaded, and answers every query of the Grafana dashboard. The monitoring component
//! itself is applied to the API server (with stand-in CRDs, e2e/crds/monitoring.yaml).
//!
//! Without Debian's `prometheus` package the Prometheus tests are compiled `#[ignore]`
//! (e2e/build.rs), so they show as ignored, never as passed; `.ci/run` installs it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use consul_sim::RunningSim;
use e2e::consul::Consul;
use e2e::fixtures::{mapping_yaml, ports, resolver_yaml};
use e2e::harness::{Cluster, Operator, free_port, http_client, repo_root, unique, wait_for};
use serde_json::Value;

const T: Duration = Duration::from_secs(60);

fn monitoring(file: &str) -> PathBuf {
    repo_root().join("manifests/monitoring").join(file)
}

/// The rule groups of the PrometheusRule, as a plain Prometheus rules file: the manifest
/// is the one copy of the rules.
fn rules_file(dir: &Path) -> anyhow::Result<PathBuf> {
    let text = std::fs::read_to_string(monitoring("prometheusrule.yaml"))?;
    let rule: serde_yaml::Value = serde_yaml::from_str(&text)?;
    assert_eq!(rule["kind"], "PrometheusRule");
    let path = dir.join("rules.yaml");
    std::fs::write(&path, serde_yaml::to_string(&rule["spec"])?)?;
    Ok(path)
}

fn alert_names() -> anyhow::Result<BTreeSet<String>> {
    let rule: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(monitoring("prometheusrule.yaml"))?)?;
    let groups = rule["spec"]["groups"].as_sequence().context("spec.groups")?;
    Ok(groups
        .iter()
        .flat_map(|g| g["rules"].as_sequence().into_iter().flatten())
        .filter_map(|r| r["alert"].as_str().map(str::to_owned))
        .collect())
}

fn run(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        bail!("{cmd:?} failed ({}):\n{text}", out.status);
    }
    Ok(text)
}

#[test]
#[cfg_attr(e2e_no_prometheus, ignore = "needs promtool (Debian's prometheus package; .ci/run installs it)")]
fn alert_rules_pass_promtool_and_every_alert_has_a_unit_test() {
    let dir = tempfile::tempdir().unwrap();
    let rules = rules_file(dir.path()).unwrap();
    let checked = run(Command::new("promtool").arg("check").arg("rules").arg(&rules)).unwrap();
    let alerts = alert_names().unwrap();
    assert!(checked.contains(&format!("SUCCESS: {} rules found", alerts.len())), "{checked}");

    let tests_text = std::fs::read_to_string(monitoring("tests/rules-test.yaml")).unwrap();
    let tests: serde_yaml::Value = serde_yaml::from_str(&tests_text).unwrap();
    let tested: BTreeSet<String> = tests["tests"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_sequence().into_iter().flatten())
        .filter(|c| c["exp_alerts"].as_sequence().is_some_and(|a| !a.is_empty()))
        .filter_map(|c| c["alertname"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(tested, alerts, "every alert has a case where it fires (and only those)");
    let test_file = dir.path().join("rules-test.yaml");
    std::fs::write(&test_file, tests_text).unwrap();
    let out = run(Command::new("promtool").arg("test").arg("rules").arg(&test_file)).unwrap();
    assert!(out.contains("SUCCESS"), "{out}");
}

/// The component applies as a whole (kustomize), and what it holds is what the API server
/// stores: the rules are the ones promtool checks, the dashboard is the file.
#[test]
fn the_monitoring_component_applies() {
    let cluster = Cluster::shared();
    let crds = repo_root().join("e2e/crds/monitoring.yaml");
    cluster.kubectl(&["apply", "-f", &crds.display().to_string()]).unwrap();
    cluster
        .kubectl(&[
            "wait",
            "--for",
            "condition=established",
            "--timeout=60s",
            "crd/podmonitors.monitoring.coreos.com",
            "crd/prometheusrules.monitoring.coreos.com",
        ])
        .unwrap();
    // The operator's namespace comes from the base manifests; create it if this cluster
    // has not got it.
    let _ = cluster.kubectl(&["create", "namespace", "consul-resolver-system"]);
    let applied = cluster.kubectl(&["apply", "-k", &monitoring("").display().to_string()]).unwrap();
    for what in ["podmonitor", "prometheusrule", "configmap/consul-resolver-operator-dashboard"] {
        assert!(applied.contains(what), "{applied}");
    }
    let ns = ["-n", "consul-resolver-system"];
    let rule =
        cluster.kubectl(&[ns[0], ns[1], "get", "prometheusrule", "consul-resolver-operator", "-o", "json"]).unwrap();
    let rule: Value = serde_json::from_str(&rule).unwrap();
    let stored: BTreeSet<String> = rule["spec"]["groups"][0]["rules"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["alert"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(stored, alert_names().unwrap());
    let pm = cluster.kubectl(&[ns[0], ns[1], "get", "podmonitor", "consul-resolver-operator", "-o", "json"]).unwrap();
    let pm: Value = serde_json::from_str(&pm).unwrap();
    assert_eq!(pm["spec"]["podMetricsEndpoints"][0]["path"], "/metrics");
    let jp = "jsonpath={.data.consul-resolver-operator\\.json}";
    let dashboard =
        cluster.kubectl(&[ns[0], ns[1], "get", "configmap", "consul-resolver-operator-dashboard", "-o", jp]).unwrap();
    let file: Value = serde_json::from_str(&std::fs::read_to_string(monitoring("dashboard.json")).unwrap()).unwrap();
    assert_eq!(serde_json::from_str::<Value>(&dashboard).unwrap(), file);
}

/// A Prometheus server of our own, on loopback, killed (by pid) on drop.
struct Prometheus {
    child: Child,
    base: String,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Scrapes `target` every second as job `consul-resolver-operator` with the labels a
    /// PodMonitor would add (`namespace`, `pod`), and evaluates `rules` every second.
    fn start(target: &str, rules: impl FnOnce(&Path) -> anyhow::Result<PathBuf>) -> anyhow::Result<Prometheus> {
        let dir = tempfile::Builder::new().prefix("cro-prometheus-").tempdir()?;
        let rules = rules(dir.path())?;
        let config = format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\nrule_files: [{rules:?}]\nscrape_configs:\n  - job_name: consul-resolver-operator\n    static_configs:\n      - targets: [{target:?}]\n        labels: {{namespace: e2e, pod: operator-0}}\n",
            rules = rules.display().to_string(),
        );
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config)?;
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log"))?;
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting prometheus")?;
        let p = Prometheus { child, base: format!("http://127.0.0.1:{port}"), _dir: dir };
        wait_for("Prometheus to be ready", T, || {
            let ready = e2e::harness::http_get(&format!("{}/-/ready", p.base));
            matches!(ready, Some((200, _))).then_some(())
        })
        .map_err(|e| anyhow::anyhow!("{e}\n{}", p.log()))?;
        Ok(p)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// `GET /api/v1/query`: the result vector, or the error Prometheus gives (a query
    /// that does not parse, say).
    fn query(&self, expr: &str) -> anyhow::Result<Vec<Value>> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let body: Value = rt.block_on(async {
            let resp = http_client()
                .get(format!("{}/api/v1/query", self.base))
                .query(&[("query", expr)])
                .timeout(Duration::from_secs(10))
                .send()
                .await?;
            anyhow::Ok(resp.json().await?)
        })?;
        if body["status"] != "success" {
            bail!("query {expr:?}: {} {}", body["errorType"], body["error"]);
        }
        Ok(body["data"]["result"].as_array().cloned().unwrap_or_default())
    }

    /// The value of the one series `expr` selects, once there is exactly one.
    fn value(&self, expr: &str) -> Option<f64> {
        let result = self.query(expr).ok()?;
        match result.as_slice() {
            [one] => one["value"][1].as_str()?.parse().ok(),
            _ => None,
        }
    }

    /// Waits until the one series of `expr` satisfies `cond`; returns its value.
    fn wait(&self, what: &str, expr: &str, cond: impl Fn(f64) -> bool) -> f64 {
        wait_for(what, T, || self.value(expr).filter(|v| cond(*v)))
            .unwrap_or_else(|e| panic!("{e}: {expr} = {:?}", self.query(expr)))
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A hook that fails its first run and succeeds after: one publication fails, and is
/// retried (the failure metrics move, the operator still converges).
fn flaky_hook(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let marker = dir.join("failed-once");
    let path = dir.join("hook.sh");
    let script = format!(
        "#!/bin/sh\nif [ -e {m} ]; then exit 0; fi\ntouch {m}\necho 'first run fails' >&2\nexit 1\n",
        m = marker.display()
    );
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// In a namespace of its own: a resolver `consul` of the shared Consul behind Mapping
/// `web`, its service with two passing instances, and a resolver `dead` nobody answers
/// for behind Mapping `ghost`. Returns the namespace and the service.
fn a_live_and_a_dead_resolver(cluster: &Cluster, consul: &Consul) -> (String, String) {
    let ns = cluster.namespace("prom").unwrap();
    let svc = format!("web{}", unique());
    consul.register("node-1", "127.0.0.1", &svc, &format!("{svc}-1"), 22001, "passing").unwrap();
    consul.register("node-2", "127.0.0.1", &svc, &format!("{svc}-2"), 22002, "passing").unwrap();
    cluster.apply(&resolver_yaml(&ns, "consul", &consul.address(), "")).unwrap();
    // A Consul nobody answers at: its watch fails and stays unsynced.
    cluster.apply(&resolver_yaml(&ns, "dead", &format!("127.0.0.1:{}", free_port()), "")).unwrap();
    cluster.apply(&mapping_yaml(&ns, "web", &svc, Some("consul"))).unwrap();
    cluster.apply(&mapping_yaml(&ns, "ghost", "ghost", Some("dead"))).unwrap();
    (ns, svc)
}

/// The operator for `ns`, with a ConfigMap and a lease of its own and `hook` run on every
/// snapshot.
fn start_operator(cluster: &Cluster, ns: &str, hook: &str) -> Operator {
    let (cm, lease) =
        (format!("consul-resolver-system/prom-{}", unique()), format!("consul-resolver-system/prom-{}", unique()));
    let args = [
        "--namespace",
        ns,
        "--snapshot-configmap",
        &cm,
        "--leader-election-lease",
        &lease,
        "--on-snapshot",
        hook,
        "--bootstrap-timeout",
        "2s",
        "--coalesce-window",
        "100ms",
        // Blocking queries answer every 2s at the latest: a Consul index that goes back
        // is seen within that.
        "--consul-wait",
        "2s",
    ];
    Operator::start(cluster, &args).unwrap()
}

/// Scraped, leading, watching both resolvers: Consul's answers and the dead one's failures
/// counted and timed per resolver, and the alert rule pending for the dead one only.
fn assert_the_watches_and_contact_series(prom: &Prometheus, ns: &str) {
    let up = r#"up{job="consul-resolver-operator"}"#;
    prom.wait("the operator scraped", up, |v| v == 1.0);
    prom.wait("bootstrapped", "consul_resolver_bootstrapped", |v| v == 1.0);
    prom.wait("this replica leads", "consul_resolver_leader", |v| v == 1.0);
    prom.wait("one acquisition", r#"consul_resolver_leader_transitions_total{transition="acquired"}"#, |v| v == 1.0);
    prom.wait("two Consul watches", r#"consul_resolver_watches{source="consul"}"#, |v| v == 2.0);
    prom.wait("the dead one unsynced", r#"consul_resolver_unsynced_watches{source="consul"}"#, |v| v == 1.0);
    prom.wait("Consul answered", r#"sum(consul_resolver_consul_requests_total{query="service",outcome="ok"})"#, |v| {
        v >= 1.0
    });
    prom.wait(
        "the dead Consul failed",
        r#"sum(consul_resolver_watch_errors_total{source="consul",reason="transport"})"#,
        |v| v >= 1.0,
    );
    let contact = |what: &str, resolver: &str| {
        format!(
            r#"consul_resolver_consul_last_{what}_timestamp_seconds{{resolver_namespace="{ns}",resolver_name="{resolver}"}}"#
        )
    };
    prom.wait("the resolver's Consul answered lately", &format!("time() - {}", contact("success", "consul")), |v| {
        v < 60.0
    });
    prom.wait("the dead resolver's Consul failed lately", &format!("time() - {}", contact("failure", "dead")), |v| {
        v < 60.0
    });
    assert!(prom.query(&contact("success", "dead")).unwrap().is_empty(), "the dead Consul never answered");
    // The rule sees the real series: the dead resolver's alert is pending, the other's not.
    let pending = r#"ALERTS{alertname="ConsulResolverConsulUnreachable",alertstate="pending"}"#;
    wait_for("the dead resolver's alert pending", T, || {
        let alerts = prom.query(pending).ok()?;
        let names: Vec<&str> = alerts.iter().filter_map(|a| a["metric"]["resolver_name"].as_str()).collect();
        (names == ["dead"]).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}: {:?}", prom.query(pending)));
}

/// The failed first hook run counted, the snapshot measured, everything published.
fn assert_the_publication_series(prom: &Prometheus) {
    prom.wait("the first hook run failed", r#"consul_resolver_hook_failures_total{reason="hook_exit"}"#, |v| v >= 1.0);
    prom.wait(
        "... and failed that publication",
        r#"consul_resolver_publish_failures_total{publisher="hook",reason="hook_exit"}"#,
        |v| v >= 1.0,
    );
    prom.wait("the ConfigMap in one part", "consul_resolver_snapshot_configmap_parts", |v| v == 0.0);
    prom.wait("the snapshot's size", "consul_resolver_snapshot_bytes", |v| v > 100.0);
    prom.wait("the process metrics", r#"process_resident_memory_bytes{job="consul-resolver-operator"}"#, |v| v > 0.0);
    prom.wait("nothing left unpublished", "consul_resolver_unpublished_change_timestamp_seconds", |v| v == 0.0);
}

/// A change (a health check flips): published, counted and timed.
fn assert_a_change_is_published_and_timed(consul: &Consul, op: &Operator, prom: &Prometheus, ns: &str, svc: &str) {
    let published = prom.value("consul_resolver_snapshots_published_total").unwrap();
    let timed = prom.value("consul_resolver_publication_latency_seconds_count").unwrap();
    consul.register("node-2", "127.0.0.1", svc, &format!("{svc}-2"), 22002, "critical").unwrap();
    op.wait_snapshot("the critical instance gone", T, |s| ports(s, ns, "consul", svc) == Some(vec![22001])).unwrap();
    prom.wait("one more publication", "consul_resolver_snapshots_published_total", |v| v > published);
    prom.wait("its latency observed", "consul_resolver_publication_latency_seconds_count", |v| v > timed);
    prom.wait(
        "within seconds",
        "consul_resolver_publication_latency_seconds_sum / consul_resolver_publication_latency_seconds_count",
        |v| v < 10.0,
    );
}

/// Consul's index goes back (a restored snapshot): the blocking watch starts over.
fn assert_an_index_gone_back_restarts_the_watch(sim: &RunningSim, prom: &Prometheus) {
    let reset = format!("{}/_sim/reset-index", sim.base_url());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let status = rt.block_on(async { http_client().post(&reset).send().await.map(|r| r.status().as_u16()) }).unwrap();
    assert_eq!(status, 200);
    prom.wait(
        "a Consul restart",
        r#"consul_resolver_watch_restarts_total{source="consul",reason="index_went_back"}"#,
        |v| v >= 1.0,
    );
}

/// Every dashboard query parses and returns data, with Grafana's variables replaced.
fn assert_every_dashboard_query_answers(prom: &Prometheus) {
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(monitoring("dashboard.json")).unwrap()).unwrap();
    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .filter_map(|t| t["expr"].as_str())
        .map(|e| e.replace("$namespace", "e2e").replace("$__rate_interval", "1m"))
        .collect();
    assert!(exprs.len() >= 25, "{} queries", exprs.len());
    let mut empty = Vec::new();
    for expr in &exprs {
        match prom.query(expr) {
            Ok(result) if result.is_empty() => empty.push(expr.clone()),
            Ok(_) => {}
            Err(e) => panic!("a dashboard query does not parse: {e}"),
        }
    }
    assert!(empty.is_empty(), "dashboard queries without data: {empty:#?}");
}

/// The series move as the world changes, through a real Prometheus: watches come and go,
/// Consul requests and contact are counted per outcome and per resolver, a failing hook
/// and a dead Consul show, a change is published and timed, the alert rules evaluate on
/// the real series, and every dashboard query parses and returns data.
#[test]
#[cfg_attr(e2e_no_prometheus, ignore = "needs prometheus (Debian's prometheus package; .ci/run installs it)")]
#[cfg_attr(e2e_real_consul, ignore = "moves the Consul index back (the simulator's /_sim/reset-index)")]
fn a_real_prometheus_sees_the_series_move_and_answers_every_dashboard_query() {
    let cluster = Cluster::shared();
    let consul = Consul::shared();
    let sim = consul.sim.as_ref().expect("the simulator");
    let (ns, svc) = a_live_and_a_dead_resolver(cluster, consul);
    let hooks = tempfile::tempdir().unwrap();
    let mut op = start_operator(cluster, &ns, &flaky_hook(hooks.path()).display().to_string());
    let prom = Prometheus::start(&format!("127.0.0.1:{}", op.port), rules_file).unwrap();
    op.wait_ready(T).unwrap();
    op.wait_snapshot("both instances", T, |s| ports(s, &ns, "consul", &svc) == Some(vec![22001, 22002])).unwrap();

    assert_the_watches_and_contact_series(&prom, &ns);
    assert_the_publication_series(&prom);
    assert_a_change_is_published_and_timed(consul, &op, &prom, &ns, &svc);
    assert_an_index_gone_back_restarts_the_watch(sim, &prom);
    assert_every_dashboard_query_answers(&prom);

    // An idle loop still beats every second, so an idle operator is alive.
    prom.wait("the heartbeat moving while idle", "changes(consul_resolver_heartbeat_timestamp_seconds[10s])", |v| {
        v >= 5.0
    });
    assert_eq!(op.get("/healthz").map(|r| r.0), Some(200));

    // The Mappings go: their watches stop, and the gauges come back to 0.
    cluster.kubectl(&["-n", &ns, "delete", "mapping", "web", "ghost"]).unwrap();
    prom.wait("no Consul watch left", r#"consul_resolver_watches{source="consul"}"#, |v| v == 0.0);
    prom.wait("nothing unsynced", r#"consul_resolver_unsynced_watches{source="consul"}"#, |v| v == 0.0);
    prom.wait("two stopped", r#"consul_resolver_watch_stops_total{source="consul"}"#, |v| v == 2.0);
    let status = op.terminate(T).unwrap();
    assert!(status.success(), "{status}\n{}", op.logs());
}
