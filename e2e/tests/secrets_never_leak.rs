//! Consul ACL tokens never leave the operator except towards Consul, black box.
//!
//! The whole loop runs with known tokens: one Consul accepts, one it rejects, one rotated
//! in, one in a Secret no resolver names, and one under a key the resolver does not name.
//! Then every output is searched for each token (raw, and base64 as in a Secret's `data`):
//! the operator's log at debug level for every crate, resolver statuses, Events, metrics,
//! every snapshot (HTTP, ConfigMap, the hook's file), the hook's arguments and environment,
//! and every path of the HTTP port. A token in the operator's own environment cannot be
//! drawn into a published address by a resolver's `${VAR}` (only `--address-env` variables
//! expand). The API server's audit log shows that the operator read
//! only the Secrets a resolver names, in the resolver's namespace. And TLS to Consul
//! verifies the server's certificate unless told otherwise: without the CA, a TLS Consul
//! is refused; with it (from a Secret), it answers.
//!
//! The simulator is the test's own (ACLs with these tokens, and a TLS one), so this runs
//! only against it.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use consul_resolver_api::status::{condition, reason};
use consul_sim::tls::TestPki;
use consul_sim::{AclConfig, AclToken, Config, RunningSim, Simulator};
use e2e::fixtures::{mapping_yaml, ports, resolver_yaml};
use e2e::harness::{Cluster, Operator, http_client, unique, wait_for};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(30);
const SYSTEM: &str = "consul-resolver-system";

fn random_token(label: &str) -> String {
    format!("{label}-{:016x}{:016x}", rand::random::<u64>(), rand::random::<u64>())
}

/// Standard base64, as the API server shows a Secret's `data`.
fn base64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// A Secret with `data` (values base64-encoded here, so any bytes can be stored).
fn secret_yaml(ns: &str, name: &str, data: &[(&str, &[u8])]) -> String {
    let data: serde_json::Map<String, Value> =
        data.iter().map(|(k, v)| ((*k).to_owned(), Value::from(base64(v)))).collect();
    serde_json::to_string(&json!({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": ns}, "data": data,
    }))
    .unwrap()
}

/// Registers `service` at `port` on `sim` (TLS verified against `ca` when given).
fn register(sim: &RunningSim, ca: Option<&str>, admin: &str, service: &str, port: u16) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let body = json!({
            "Node": "node-leak", "Address": "127.0.0.1",
            "Service": {"ID": format!("{service}-1"), "Service": service, "Port": port},
            "Check": {"CheckID": format!("check-{service}"), "Name": "c", "Status": "passing", "ServiceID": format!("{service}-1")},
        });
        let client = match ca {
            Some(pem) => reqwest::Client::builder()
                .tls_certs_only(reqwest::Certificate::from_pem_bundle(pem.as_bytes()).unwrap())
                .build()
                .unwrap(),
            None => http_client(),
        };
        let resp = client
            .put(format!("{}/v1/catalog/register", sim.base_url()))
            .header("X-Consul-Token", admin)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert!(resp.status().is_success(), "{}", resp.status());
    });
}

/// A hook that keeps its arguments, environment and snapshot file per run.
fn recording_hook(dir: &Path) -> std::path::PathBuf {
    let script = dir.join("hook.sh");
    let out = dir.join("runs");
    std::fs::create_dir_all(&out).unwrap();
    let body = format!(
        "#!/bin/sh\nset -e\nout={}\necho \"$@\" > \"$out/args.$1\"\nenv > \"$out/env.$1\"\ncp \"$2\" \"$out/snapshot.$1\"\n",
        out.display()
    );
    std::fs::write(&script, body).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

/// Where each token was found, as `(token label, output)`.
fn leaks(tokens: &[(&str, &str)], outputs: &[(String, String)]) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for (label, token) in tokens {
        let forms = [token.to_string(), base64(token.as_bytes())];
        for (name, text) in outputs {
            if forms.iter().any(|f| text.contains(f.as_str())) {
                found.push(((*label).to_owned(), name.clone()));
            }
        }
    }
    found
}

/// The known tokens the whole loop runs with.
struct Tokens {
    /// In the operator's own environment.
    in_env: String,
    /// Accepted by Consul, in Secret `acl` under `token`.
    token: String,
    /// Accepted by Consul, rotated into `acl` in place of `token`.
    rotated: String,
    /// Refused by Consul, in Secret `rejected`.
    rejected: String,
    /// In Secret `unrelated`, which no resolver names.
    unnamed: String,
    /// In `acl` under a key no resolver names.
    other_key: String,
    /// In the other namespace's `acl`.
    foreign: String,
    /// Consul's management token, the test's own.
    admin: String,
}

impl Tokens {
    fn random() -> Tokens {
        Tokens {
            in_env: random_token("env"),
            token: random_token("tok"),
            rotated: random_token("rot"),
            rejected: random_token("rej"),
            unnamed: random_token("unn"),
            other_key: random_token("key"),
            foreign: random_token("for"),
            admin: random_token("adm"),
        }
    }

    /// The Consul ACLs: the admin token, and read access for `token` and `rotated`.
    fn acl(&self) -> AclConfig {
        AclConfig {
            tokens: vec![
                AclToken::management(&self.admin),
                AclToken::service_read(&self.token, [""]),
                AclToken::service_read(&self.rotated, [""]),
            ],
            anonymous_read: false,
        }
    }

    /// The tokens no output may hold, each with what it is.
    fn never_shown(&self) -> [(&'static str, &str); 6] {
        [
            ("token", self.token.as_str()),
            ("rotated token", self.rotated.as_str()),
            ("rejected token", self.rejected.as_str()),
            ("unnamed Secret's token", self.unnamed.as_str()),
            ("other key's value", self.other_key.as_str()),
            ("other namespace's token", self.foreign.as_str()),
        ]
    }
}

/// The test's state: two namespaces granting Secrets, a plain and a TLS Consul with ACLs
/// and the service `svc` registered, the Secrets and resolvers, and where the operator's
/// hook and ConfigMap publish.
struct Scene {
    cluster: &'static Cluster,
    ns: String,
    elsewhere: String,
    tokens: Tokens,
    consul: RunningSim,
    tls_consul: RunningSim,
    pki: TestPki,
    svc: String,
    /// The hook's script and, under `runs/`, what each of its runs saw.
    dir: tempfile::TempDir,
    cm: String,
}

impl Scene {
    fn set_up() -> Scene {
        let cluster = Cluster::shared();
        let ns = cluster.namespace("leak").unwrap();
        let elsewhere = cluster.namespace("leak-other").unwrap();
        cluster.grant_secrets(&ns).unwrap();
        cluster.grant_secrets(&elsewhere).unwrap();
        let tokens = Tokens::random();
        let _ = rustls::crypto::ring::default_provider().install_default();
        let consul = Simulator::start_background(Config { acl: Some(tokens.acl()), ..Config::default() }).unwrap();
        let pki = TestPki::generate().unwrap();
        let tls_consul = Simulator::start_background(Config {
            acl: Some(tokens.acl()),
            tls: Some(pki.server_tls()),
            ..Config::default()
        })
        .unwrap();
        let svc = format!("leak{}", unique());
        register(&consul, None, &tokens.admin, &svc, 23001);
        register(&tls_consul, Some(&pki.ca_cert_pem), &tokens.admin, &svc, 23002);
        let dir = tempfile::Builder::new().prefix("cro-leak-").tempdir().unwrap();
        let cm = format!("leak-{}", unique());
        let scene = Scene { cluster, ns, elsewhere, tokens, consul, tls_consul, pki, svc, dir, cm };
        scene.apply_secrets();
        scene.apply_resolvers();
        scene
    }

    /// `acl` holds the token and another key; `unrelated` is named by nobody; `ca` is the CA
    /// bundle of the TLS Consul. The namespace next door holds a Secret named like ours.
    fn apply_secrets(&self) {
        let (cluster, ns, t) = (self.cluster, &self.ns, &self.tokens);
        cluster
            .apply(&secret_yaml(ns, "acl", &[("token", t.token.as_bytes()), ("other", t.other_key.as_bytes())]))
            .unwrap();
        cluster.apply(&secret_yaml(ns, "rejected", &[("token", t.rejected.as_bytes())])).unwrap();
        cluster.apply(&secret_yaml(ns, "unrelated", &[("token", t.unnamed.as_bytes())])).unwrap();
        cluster.apply(&secret_yaml(ns, "ca", &[("ca.crt", self.pki.ca_cert_pem.as_bytes())])).unwrap();
        cluster.apply(&secret_yaml(&self.elsewhere, "acl", &[("token", t.foreign.as_bytes())])).unwrap();
    }

    fn apply_resolvers(&self) {
        let (cluster, ns, svc) = (self.cluster, &self.ns, &self.svc);
        let plain = self.consul.base_url().trim_start_matches("http://").to_owned();
        let tls = self.tls_consul.base_url();
        let token_ref = |secret: &str, key: &str| format!("  tokenSecretRef: {{name: {secret}, key: {key}}}\n");
        let ca_ref = "  tls: {caSecretRef: {name: ca, key: ca.crt}}\n";
        for (name, address, extra) in [
            ("good", plain.as_str(), token_ref("acl", "token")),
            ("rejected", plain.as_str(), token_ref("rejected", "token")),
            ("wrongkey", plain.as_str(), token_ref("acl", "missing")),
            ("tls-unverified", tls.as_str(), token_ref("acl", "token")),
            ("tls-verified", tls.as_str(), format!("{}{ca_ref}", token_ref("acl", "token"))),
        ] {
            cluster.apply(&resolver_yaml(ns, name, address, &extra)).unwrap();
            cluster.apply(&mapping_yaml(ns, &format!("m-{name}"), svc, Some(name))).unwrap();
        }
        // A resolver in the other namespace naming no Secret: that namespace's `acl` is not ours.
        cluster.apply(&resolver_yaml(&self.elsewhere, "open", &plain, "")).unwrap();
        // One that would put the operator's own environment into its published address.
        cluster.apply(&resolver_yaml(ns, "envleak", "${OPERATOR_SECRET}:8500", "")).unwrap();
        cluster.apply(&mapping_yaml(ns, "m-envleak", svc, Some("envleak"))).unwrap();
    }

    /// The operator at debug level, with a recording hook and a token in its environment.
    fn start_operator(&self) -> Operator {
        let hook = recording_hook(self.dir.path());
        let args = [
            "--namespace",
            &self.ns,
            "--namespace",
            &self.elsewhere,
            "--snapshot-configmap",
            &format!("{SYSTEM}/{}", self.cm),
            "--on-snapshot",
            hook.to_str().unwrap(),
            // The rejected token and the unverified TLS never answer: publish without them.
            "--bootstrap-timeout",
            "2s",
        ];
        let env = [("RUST_LOG", "debug"), ("OPERATOR_SECRET", self.tokens.in_env.as_str())];
        Operator::start_with_env(self.cluster, &args, &env).unwrap()
    }

    /// The whole loop ran: answers through the token, the rejected token and the missing
    /// key reported, TLS refused without the CA and verified with it.
    fn assert_every_resolver_as_expected(&self, op: &Operator) {
        let (cluster, ns, svc) = (self.cluster, &self.ns, &self.svc);
        op.wait_snapshot("answers through the token, plain and verified TLS", T, |s| {
            ports(s, ns, "good", svc) == Some(vec![23001]) && ports(s, ns, "tls-verified", svc) == Some(vec![23002])
        })
        .unwrap();
        let condition = |name: &str, type_: &str, status: &str, reason: &str| {
            wait_for(&format!("{name} {type_}={status}/{reason}"), T, || {
                cluster.resolver_condition(ns, name, type_).filter(|c| c["status"] == status && c["reason"] == reason)
            })
            .unwrap_or_else(|e| panic!("{e}: {:?}\n{}", cluster.resolver_condition(ns, name, type_), op.logs()))
        };
        let rejected_msg = condition("rejected", condition::CONSUL_REACHABLE, "False", reason::QUERY_FAILED);
        assert!(rejected_msg["message"].as_str().unwrap().contains("ACL token rejected"), "{rejected_msg}");
        let missing = condition("wrongkey", condition::CONSUL_REACHABLE, "False", reason::SECRET_UNAVAILABLE);
        assert!(missing["message"].as_str().unwrap().contains("missing"), "the key is named: {missing}");
        let unverified = condition("tls-unverified", condition::CONSUL_REACHABLE, "False", reason::QUERY_FAILED);
        let why = unverified["message"].as_str().unwrap().to_ascii_lowercase();
        assert!(why.contains("certificate") || why.contains("unknownissuer"), "refused for its certificate: {why}");
        condition("tls-verified", condition::READY, "True", reason::PUBLISHED);
        let env_refused = condition("envleak", condition::READY, "False", reason::INVALID_SPEC);
        assert!(env_refused["message"].as_str().unwrap().contains("--address-env"), "{env_refused}");
        condition("good", condition::READY, "True", reason::PUBLISHED);
    }

    /// Rotation: the new token is used, and the old one with it is no longer needed; the
    /// change it reads reaches the hook and the ConfigMap.
    fn rotate_the_token(&self, op: &Operator) {
        let (cluster, ns, svc, t) = (self.cluster, &self.ns, &self.svc, &self.tokens);
        cluster
            .apply(&secret_yaml(ns, "acl", &[("token", t.rotated.as_bytes()), ("other", t.other_key.as_bytes())]))
            .unwrap();
        wait_for("the rotated token in use", T, || {
            self.consul.requests().iter().any(|r| r.token.as_deref() == Some(t.rotated.as_str())).then_some(())
        })
        .unwrap();
        self.consul.clear_requests();
        register(&self.consul, None, &t.admin, svc, 23003);
        op.wait_snapshot("a change read with the rotated token", T, |s| ports(s, ns, "good", svc) == Some(vec![23003]))
            .unwrap();
        wait_for("the hook to have run on the latest snapshot", T, || {
            let id = op.snapshot()?["id"].as_u64()?;
            self.dir.path().join(format!("runs/snapshot.{id}")).exists().then_some(())
        })
        .unwrap();
        wait_for("the ConfigMap with the latest snapshot", T, || {
            let hash = op.snapshot()?["hash"].as_str()?.to_owned();
            let cm = cluster.kubectl(&["-n", SYSTEM, "get", "configmap", &self.cm, "-o", "json"]).ok()?;
            cm.contains(&hash).then_some(())
        })
        .unwrap();
    }

    /// Every output of the running operator, as `(name, text)`: each path of its HTTP port,
    /// what it wrote to the API server, what its hook saw, and its environment.
    fn outputs_while_running(&self, op: &Operator) -> Vec<(String, String)> {
        let mut outputs: Vec<(String, String)> = Vec::new();
        let latest = op.snapshot().unwrap()["id"].as_u64().unwrap();
        for path in ["/", "/healthz", "/readyz", "/metrics", "/snapshot", "/snapshots", "/debug/vars", "/secrets"]
            .into_iter()
            .map(str::to_owned)
            .chain((1..=latest).map(|id| format!("/snapshots/{id}")))
        {
            if let Some((code, body)) = op.get(&path) {
                outputs.push((format!("GET {path} ({code})"), body));
            }
        }
        for (what, args) in [
            ("resolvers (status)", vec!["get", "cres", "-A", "-o", "json"]),
            ("events", vec!["get", "events", "-A", "-o", "json"]),
            ("snapshot configmaps", vec!["-n", SYSTEM, "get", "configmaps", "-o", "json"]),
        ] {
            outputs.push((what.to_owned(), self.cluster.kubectl(&args).unwrap()));
        }
        let runs: Vec<_> =
            std::fs::read_dir(self.dir.path().join("runs")).unwrap().map(|e| e.unwrap().path()).collect();
        assert!(runs.iter().any(|p| p.to_string_lossy().contains("env.")), "the hook ran: {runs:?}");
        for path in runs {
            outputs.push((format!("hook {}", path.display()), std::fs::read_to_string(&path).unwrap()));
        }
        outputs.push(("the operator's environment".into(), {
            let pid = op.pid().unwrap();
            String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/environ")).unwrap()).into_owned()
        }));
        outputs
    }

    /// No token in any output (the one in the operator's environment only where that
    /// environment is), and the search looks where things are.
    fn assert_no_token_in(&self, outputs: &[(String, String)], log_len: usize) {
        let tokens = self.tokens.never_shown();
        let mut found = leaks(&tokens, outputs);
        // The operator's own environment holds it (and the hook inherits that environment): any
        // other output must not.
        let inherited = |name: &str| name.contains("/env.") || name == "the operator's environment";
        found.extend(
            leaks(&[("the operator's environment variable", self.tokens.in_env.as_str())], outputs)
                .into_iter()
                .filter(|(_, output)| !inherited(output)),
        );
        let searched: usize = outputs.iter().map(|(_, t)| t.len()).sum();
        eprintln!(
            "searched {} outputs, {searched} bytes, {log_len} of log, for {} tokens",
            outputs.len(),
            tokens.len()
        );
        assert!(found.is_empty(), "tokens found: {found:?}");
        // The search looks where things are: every output holds something, and the service's
        // name is in the snapshots and the log.
        let empty: Vec<&String> = outputs.iter().filter(|(_, t)| t.is_empty()).map(|(n, _)| n).collect();
        assert!(empty.is_empty(), "outputs with nothing to search: {empty:?}");
        let with_svc = leaks(&[("service", self.svc.as_str())], outputs);
        for place in ["GET /snapshot (200)", "snapshot configmaps", "the operator's log at debug level"] {
            assert!(with_svc.iter().any(|(_, o)| o == place), "{place} searched: {with_svc:?}");
        }
    }

    /// Only the Secrets a resolver names, in its own namespace, each selected by name.
    fn assert_secrets_read_only_where_named(&self) {
        let ns = &self.ns;
        let events = self.cluster.audit_events().unwrap().expect("the audit log of the cluster the tests start");
        let user = self.cluster.operator_username().unwrap();
        let reads: Vec<(String, String)> = events
            .iter()
            .filter(|e| e["user"]["username"] == user.as_str() && e["objectRef"]["resource"] == "secrets")
            .map(|e| {
                let ns = e["objectRef"]["namespace"].as_str().unwrap_or("<cluster-wide>").to_owned();
                let uri = e["requestURI"].as_str().unwrap_or_default().to_owned();
                (ns, uri)
            })
            .collect();
        let named: Vec<&str> = ["acl", "rejected", "ca"].to_vec();
        let mut seen = std::collections::BTreeSet::new();
        for (in_ns, uri) in &reads {
            let url = url::Url::parse(&format!("https://apiserver{uri}")).unwrap();
            let selector: Option<String> =
                url.query_pairs().find(|(k, _)| k == "fieldSelector").map(|(_, v)| v.into_owned());
            let name = selector.as_deref().and_then(|s| s.strip_prefix("metadata.name="));
            assert_eq!(in_ns, ns, "a Secret read outside the resolvers' namespace: {uri}");
            assert!(name.is_some_and(|n| named.contains(&n)), "a Secret read that no resolver names: {uri}");
            seen.insert(name.unwrap().to_owned());
        }
        assert_eq!(seen, named.iter().map(|n| (*n).to_owned()).collect(), "{reads:#?}");
        eprintln!("audit log: {} Secret requests, all in {ns}, selected by name: {seen:?}", reads.len());
    }
}

#[test]
#[cfg_attr(e2e_real_consul, ignore = "needs the test's own simulators (ACL tokens it knows, TLS)")]
#[cfg_attr(e2e_external_cluster, ignore = "reads the API server's audit log: needs the cluster the tests start")]
fn tokens_never_appear_in_any_output_and_secrets_are_read_only_where_named() {
    let began = std::time::Instant::now();
    let scene = Scene::set_up();
    let mut op = scene.start_operator();
    op.wait_ready(T).unwrap();
    eprintln!("{:?}: ready", began.elapsed());
    scene.assert_every_resolver_as_expected(&op);
    eprintln!("{:?}: every resolver as expected", began.elapsed());
    scene.rotate_the_token(&op);
    eprintln!("{:?}: rotated", began.elapsed());

    let mut outputs = scene.outputs_while_running(&op);
    assert!(op.terminate(T).unwrap().success(), "{}", op.logs());
    let log = op.logs();
    assert!(log.contains("DEBUG"), "the log is at debug level");
    outputs.push(("the operator's log at debug level".into(), log.clone()));
    scene.assert_no_token_in(&outputs, log.len());
    scene.assert_secrets_read_only_where_named();
}
