//! The e2e harness: a real control plane (etcd + kube-apiserver via `e2e/cluster.sh`),
//! the Consul simulator, and the operator binary run as its own process with the
//! ServiceAccount kubeconfig bound to the real RBAC in manifests/.
//!
//! One control plane serves every test of a test binary (tests isolate themselves by
//! unique namespaces and names); it is torn down when the process exits, including after
//! failed tests. `E2E_KUBECONFIG` runs the tests against an existing cluster instead
//! (the operator then uses that kubeconfig too), and `E2E_CONSUL_ADDR` (with optional
//! `E2E_CONSUL_TOKEN`) against a real Consul agent instead of the simulator.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::Value;

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("e2e/ is inside the repo").to_path_buf()
}

/// Waits for `cond` to hold, polling every 100 ms, failing after `timeout` with `what`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut cond: impl FnMut() -> Option<T>) -> anyhow::Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = cond() {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A control plane: ours (started by cluster.sh) or an existing one.
pub struct Cluster {
    /// State dir of a cluster we started; `None` for `E2E_KUBECONFIG`.
    pub dir: Option<PathBuf>,
    pub admin_kubeconfig: PathBuf,
    pub operator_kubeconfig: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

static CLUSTER: OnceLock<Cluster> = OnceLock::new();
static STARTED_DIR: Mutex<Option<PathBuf>> = Mutex::new(None);

extern "C" fn teardown_at_exit() {
    if let Some(dir) = STARTED_DIR.lock().ok().and_then(|mut d| d.take()) {
        let _ = Command::new("bash")
            .arg(repo_root().join("e2e/cluster.sh"))
            .arg("down")
            .arg(&dir)
            .stdout(Stdio::null())
            .status();
        // The shared cluster lives in a static, which is never dropped: its temporary
        // directory (etcd's data, about 65 MB) went with it only at exit, that is never.
        // Every test binary left one in /tmp, and the disk of a machine running the suite
        // again and again filled up. `E2E_KEEP_CLUSTER_DIR=1` keeps it for a post-mortem.
        if std::env::var_os("E2E_KEEP_CLUSTER_DIR").is_none()
            && let Some(tmp) = dir.parent()
        {
            let _ = std::fs::remove_dir_all(tmp);
        }
    }
}

impl Cluster {
    /// The shared control plane of this test process, started on first use, with our
    /// CRDs and the test Ambassador CRDs applied.
    pub fn shared() -> &'static Cluster {
        CLUSTER.get_or_init(|| Cluster::start().expect("cannot start the e2e control plane"))
    }

    fn start() -> anyhow::Result<Cluster> {
        let cluster = if let Ok(kc) = std::env::var("E2E_KUBECONFIG") {
            Cluster { dir: None, admin_kubeconfig: kc.clone().into(), operator_kubeconfig: kc.into(), _tmp: None }
        } else {
            let tmp = tempfile::Builder::new().prefix("cro-e2e-").tempdir()?;
            let dir = tmp.path().join("cluster");
            // Register teardown before starting, so a half-started cluster is also stopped.
            *STARTED_DIR.lock().expect("lock") = Some(dir.clone());
            // SAFETY: registering a plain extern "C" fn with no captured state.
            unsafe { libc::atexit(teardown_at_exit) };
            let status = Command::new("bash")
                .arg(repo_root().join("e2e/cluster.sh"))
                .arg("up")
                .arg(&dir)
                .status()
                .context("running e2e/cluster.sh up")?;
            if !status.success() {
                bail!("e2e/cluster.sh up {} failed ({status})", dir.display());
            }
            Cluster {
                admin_kubeconfig: dir.join("admin.kubeconfig"),
                operator_kubeconfig: dir.join("operator.kubeconfig"),
                dir: Some(dir),
                _tmp: Some(tmp),
            }
        };
        if let Err(e) = cluster.install_crds() {
            // Stopped now, while its directory exists: dropping `cluster` removes it, and
            // the exit-time teardown would find nothing to stop (each test retries the
            // start, so a broken CRD once left a running control plane per test).
            if let Some(dir) = &cluster.dir {
                let _ = Command::new("bash").arg(repo_root().join("e2e/cluster.sh")).arg("down").arg(dir).status();
                STARTED_DIR.lock().expect("lock").take_if(|d| d == dir);
            }
            return Err(e);
        }
        Ok(cluster)
    }

    /// The CRDs without their CEL validation rules (crds/pre-1.25/): against the suite's own
    /// 1.20 API server kubectl refuses the rules' field, and on any server the tests of bad
    /// specs are of the operator's own checks, which the rules would pre-empt at apply.
    fn install_crds(&self) -> anyhow::Result<()> {
        self.kubectl(&["apply", "-f", &repo_root().join("crds/pre-1.25").display().to_string()])?;
        self.kubectl(&["apply", "-f", &repo_root().join("e2e/crds/ambassador.yaml").display().to_string()])?;
        self.kubectl(&[
            "wait",
            "--for",
            "condition=established",
            "--timeout=60s",
            "crd/consulresolvers.consulresolver.io",
            "crd/consulservices.consulresolver.io",
            "crd/mappings.getambassador.io",
            "crd/tcpmappings.getambassador.io",
        ])?;
        Ok(())
    }

    /// Runs kubectl as admin; returns stdout, or an error with stderr.
    pub fn kubectl(&self, args: &[&str]) -> anyhow::Result<String> {
        self.kubectl_stdin(args, None)
    }

    pub fn kubectl_stdin(&self, args: &[&str], stdin: Option<&str>) -> anyhow::Result<String> {
        use std::io::Write;
        let mut child = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&self.admin_kubeconfig)
            .args(args)
            .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("kubectl is required")?;
        if let Some(input) = stdin {
            child.stdin.take().expect("piped").write_all(input.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!("kubectl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `kubectl apply -f -` of a YAML document.
    pub fn apply(&self, yaml: &str) -> anyhow::Result<String> {
        self.kubectl_stdin(&["apply", "-f", "-"], Some(yaml))
    }

    /// A fresh namespace with a unique name (namespaces never finish deleting here: no
    /// kube-controller-manager runs, so tests never reuse or delete them).
    pub fn namespace(&self, prefix: &str) -> anyhow::Result<String> {
        let n = format!("{prefix}-{}", unique());
        self.kubectl(&["create", "namespace", &n])?;
        Ok(n)
    }

    /// The condition `type_` of resolver `ns/name`'s status, as JSON.
    pub fn resolver_condition(&self, ns: &str, name: &str, type_: &str) -> Option<Value> {
        let out = self.kubectl(&["-n", ns, "get", "cres", name, "-o", "json"]).ok()?;
        let obj: Value = serde_json::from_str(&out).ok()?;
        obj["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == type_).cloned()
    }

    /// The Events in `ns` about the object named `name`.
    pub fn events_about(&self, ns: &str, name: &str) -> Vec<Value> {
        let out = self.kubectl(&["-n", ns, "get", "events", "-o", "json"]).unwrap_or_default();
        let list: Value = serde_json::from_str(&out).unwrap_or_default();
        list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["involvedObject"]["name"] == name)
            .cloned()
            .collect()
    }

    /// Lets the operator read Secrets in `namespace`, as manifests/rbac.yaml documents
    /// (Secrets are not readable cluster-wide).
    pub fn grant_secrets(&self, namespace: &str) -> anyhow::Result<()> {
        self.kubectl(&[
            "-n",
            namespace,
            "create",
            "rolebinding",
            "consul-resolver-operator-secrets",
            "--clusterrole=consul-resolver-operator-secrets",
            "--serviceaccount=consul-resolver-system:consul-resolver-operator",
        ])?;
        Ok(())
    }

    /// Lets the operator carry out exports in `namespace` (write their Services and
    /// EndpointSlices), as manifests/rbac.yaml documents.
    pub fn grant_exports(&self, namespace: &str) -> anyhow::Result<()> {
        self.kubectl(&[
            "-n",
            namespace,
            "create",
            "rolebinding",
            "consul-resolver-operator-exports",
            "--clusterrole=consul-resolver-operator-exports",
            "--serviceaccount=consul-resolver-system:consul-resolver-operator",
        ])?;
        Ok(())
    }

    /// A value `cluster.sh up` wrote to DIR/env (`ETCD_URL`, `APISERVER_PORT`, ...); `None`
    /// for an existing cluster.
    pub fn env_value(&self, name: &str) -> Option<String> {
        let text = std::fs::read_to_string(self.dir.as_ref()?.join("env")).ok()?;
        text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix('=')).map(|v| v.trim_matches('\'').to_owned())
    }

    /// The pid of our kube-apiserver, as its pid file says.
    pub fn apiserver_pid(&self) -> Option<i32> {
        self.pid_file("apiserver.pid")
    }

    /// The pid of our etcd, as its pid file says.
    pub fn etcd_pid(&self) -> Option<i32> {
        self.pid_file("etcd.pid")
    }

    fn pid_file(&self, name: &str) -> Option<i32> {
        std::fs::read_to_string(self.dir.as_ref()?.join(name)).ok()?.trim().parse().ok()
    }

    /// Sends `signal` to our kube-apiserver.
    pub fn signal_apiserver(&self, signal: i32) -> anyhow::Result<()> {
        let pid = self.apiserver_pid().context("no kube-apiserver of ours")?;
        // SAFETY: kill(2) on the pid of the kube-apiserver this process started.
        if unsafe { libc::kill(pid, signal) } != 0 {
            bail!("signal {signal} to the kube-apiserver (pid {pid}): {}", std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Kills our kube-apiserver (SIGKILL: no goodbye to its clients) and waits until it is
    /// gone. etcd keeps running.
    pub fn kill_apiserver(&self) -> anyhow::Result<()> {
        let pid = self.apiserver_pid().context("no kube-apiserver of ours")?;
        self.signal_apiserver(libc::SIGKILL)?;
        let gone = || {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // Gone, or a zombie nobody has reaped yet: either way it serves nothing.
            (stat.is_empty() || stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')))
                .then_some(())
        };
        wait_for("the killed kube-apiserver to be gone", Duration::from_secs(20), gone)
    }

    /// Starts our kube-apiserver again for the running etcd, on `port` (a stand-in nobody's
    /// kubeconfig names) or on its own port, and waits until it is ready.
    pub fn start_apiserver(&self, port: Option<u16>) -> anyhow::Result<()> {
        let dir = self.dir.as_ref().context("not our cluster")?;
        let mut cmd = Command::new("bash");
        cmd.arg(repo_root().join("e2e/cluster.sh")).arg("apiserver").arg(dir);
        if let Some(p) = port {
            cmd.arg(p.to_string());
        }
        let status = cmd.status().context("running e2e/cluster.sh apiserver")?;
        if !status.success() {
            bail!("e2e/cluster.sh apiserver {} failed ({status})", dir.display());
        }
        Ok(())
    }

    /// The apiserver's audit log (ours only).
    pub fn audit_log(&self) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join("audit.log"))
    }

    /// The events of the audit log, one JSON object per line, in the order they were
    /// written; `None` without one (`E2E_KUBECONFIG`). The log is written in blocking mode,
    /// so a request's event is on disk before its response; a last line still being
    /// written is left out.
    pub fn audit_events(&self) -> anyhow::Result<Option<Vec<Value>>> {
        let Some(path) = self.audit_log() else { return Ok(None) };
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let mut events = Vec::new();
        let mut lines = text.lines().peekable();
        while let Some(line) = lines.next() {
            match serde_json::from_str(line) {
                Ok(v) => events.push(v),
                Err(_) if lines.peek().is_none() && !text.ends_with('\n') => {}
                Err(e) => bail!("{}: not a JSON event ({e}): {line}", path.display()),
            }
        }
        Ok(Some(events))
    }

    /// The user name the API server gives the operator's kubeconfig: the `sub` claim of
    /// its bearer token (a ServiceAccount token names `system:serviceaccount:NS:NAME`).
    /// An error for kubeconfigs without a JWT bearer token.
    pub fn operator_username(&self) -> anyhow::Result<String> {
        let path = &self.operator_kubeconfig;
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let kc: Value = serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let token = kc["users"][0]["user"]["token"].as_str().context("the operator kubeconfig has no token")?;
        let payload = token.split('.').nth(1).context("the operator token is not a JWT")?;
        let claims: Value = serde_json::from_slice(&base64_decode(payload)?)?;
        claims["sub"].as_str().map(str::to_owned).context("the operator token has no sub claim")
    }
}

/// Decodes base64, standard (`+/`, as in `binaryData`) or URL-safe (`-_`, as in JWTs)
/// alphabet, padding optional.
pub fn base64_decode(text: &str) -> anyhow::Result<Vec<u8>> {
    use base64::Engine as _;
    use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
    let config = GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent);
    let alphabet = if text.contains(['-', '_']) { &base64::alphabet::URL_SAFE } else { &base64::alphabet::STANDARD };
    Ok(GeneralPurpose::new(alphabet, config).decode(text)?)
}

/// A short unique suffix for names.
pub fn unique() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!("{}{}", std::process::id() % 100_000, N.fetch_add(1, Ordering::Relaxed))
}

/// A free loopback port (bound and released; the operator binds it right after).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free loopback port")
}

/// Builds the operator binary (a no-op when up to date) and returns its path. The debug
/// build, unless `E2E_OPERATOR_PROFILE=release` (benchmarks); `E2E_OPERATOR_BIN` names a
/// binary to use instead (another build, measured beside this one in the same run).
pub fn operator_binary() -> anyhow::Result<PathBuf> {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    if let Some(b) = BIN.get() {
        return Ok(b.clone());
    }
    if let Some(given) = std::env::var_os("E2E_OPERATOR_BIN") {
        let given = PathBuf::from(given);
        if !given.is_file() {
            bail!("E2E_OPERATOR_BIN={} is not a file", given.display());
        }
        return Ok(BIN.get_or_init(|| given).clone());
    }
    let release = std::env::var("E2E_OPERATOR_PROFILE").is_ok_and(|p| p == "release");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut args = vec!["build", "--quiet", "-p", "consul-resolver-operator", "--bin", "consul-resolver-operator"];
    if release {
        args.push("--release");
    }
    let status = build_command(&cargo).args(&args).status().context("building the operator")?;
    if !status.success() {
        bail!("cargo build of the operator failed");
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| repo_root().join("target"));
    let bin = target.join(if release { "release" } else { "debug" }).join("consul-resolver-operator");
    Ok(BIN.get_or_init(|| bin).clone())
}

/// A command that builds with cargo (cargo itself, or make or a script that runs it), in
/// the repository root, without the variables cargo sets for the test process that runs
/// us. Passed on, they look like a changed environment to build scripts that track them
/// (ring's does; `OUT_DIR`, set because e2e has a build script, makes most of the tree
/// dirty), and half the dependency tree is rebuilt on every run, and again by the next
/// plain build.
pub fn build_command(program: &str) -> Command {
    let mut cmd = Command::new(program);
    cmd.current_dir(repo_root());
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        let set_by_cargo_for_us = ["CARGO_MANIFEST_", "CARGO_PKG_", "CARGO_CRATE_", "CARGO_BIN_", "CARGO_PRIMARY_"]
            .iter()
            .any(|p| name.starts_with(p))
            || name == "CARGO_TARGET_TMPDIR"
            || name == "OUT_DIR";
        if set_by_cargo_for_us {
            cmd.env_remove(name.as_ref());
        }
    }
    cmd
}

/// A binary the set-up scripts cache outside the repo: the path `bash <script> <query>`
/// prints, or an error that says to run `bash <install>` when nothing is there.
pub fn cached_binary(script: &str, query: &str, install: &str) -> anyhow::Result<PathBuf> {
    let out = Command::new("bash")
        .arg(repo_root().join(script))
        .arg(query)
        .output()
        .with_context(|| format!("running {script} {query}"))?;
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !path.is_file() {
        bail!("nothing at {}: run `bash {install}`", path.display());
    }
    Ok(path)
}

/// A real kube-controller-manager (1.20.2, built by `e2e/cluster.sh build`) for the tests
/// that need the cluster's own controllers: the garbage collector of owner references, the
/// namespace controller, the EndpointSlice mirroring controller. Only those that ask for
/// it run one: elsewhere the garbage collector would hide the operator's own deletions,
/// which clusters without one rely on. Killed (by pid) on drop.
pub struct ControllerManager {
    child: Option<Child>,
    pub log: PathBuf,
    _logdir: tempfile::TempDir,
}

impl ControllerManager {
    /// Starts it against `cluster` (ours: it needs the admin kubeconfig) with
    /// `--controllers=CONTROLLERS`. The binary missing is an error that says how to build
    /// it, never a skip.
    pub fn start(cluster: &Cluster, controllers: &str) -> anyhow::Result<ControllerManager> {
        let bin = cached_binary("e2e/cluster.sh", "controller-manager-path", "e2e/cluster.sh build")?;
        let logdir = tempfile::Builder::new().prefix("cro-kcm-").tempdir()?;
        let log = logdir.path().join("kube-controller-manager.log");
        let logfile = std::fs::File::create(&log)?;
        let kubeconfig = cluster.admin_kubeconfig.display().to_string();
        let child = Command::new(bin)
            .arg(format!("--kubeconfig={kubeconfig}"))
            .arg(format!("--controllers={controllers}"))
            // One instance, no serving port: nothing else needs to reach it.
            .args(["--leader-elect=false", "--port=0", "--secure-port=0", "--use-service-account-credentials=false"])
            .stdin(Stdio::null())
            .stdout(logfile.try_clone()?)
            .stderr(logfile)
            .spawn()
            .context("starting kube-controller-manager")?;
        Ok(ControllerManager { child: Some(child), log, _logdir: logdir })
    }

    /// Its log so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for ControllerManager {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The operator, running as its own process. Killed (by pid) on drop if still running.
pub struct Operator {
    child: Option<Child>,
    pub port: u16,
    pub log: PathBuf,
    _logdir: tempfile::TempDir,
}

impl Operator {
    /// Starts the operator with the ServiceAccount kubeconfig and `args`.
    pub fn start(cluster: &Cluster, args: &[&str]) -> anyhow::Result<Operator> {
        Operator::start_with_env(cluster, args, &[])
    }

    /// [`Operator::start`] with more environment variables (`RUST_LOG=debug`, say), set
    /// after the defaults.
    pub fn start_with_env(cluster: &Cluster, args: &[&str], env: &[(&str, &str)]) -> anyhow::Result<Operator> {
        Operator::start_binary(&operator_binary()?, cluster, args, env)
    }

    /// [`Operator::start_with_env`] of the operator binary `bin` rather than the one under
    /// test (a benchmark compares two builds).
    pub fn start_binary(
        bin: &Path,
        cluster: &Cluster,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<Operator> {
        let port = free_port();
        let logdir = tempfile::Builder::new().prefix("cro-operator-").tempdir()?;
        let log = logdir.path().join("operator.log");
        let logfile = std::fs::File::create(&log)?;
        let child = Command::new(bin)
            .arg("run")
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .args(args)
            .env("KUBECONFIG", &cluster.operator_kubeconfig)
            .env("RUST_LOG", "info,kube=warn")
            .env_remove("CONSUL_HTTP_TOKEN")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(logfile.try_clone()?)
            .stderr(logfile)
            .spawn()
            .context("starting the operator")?;
        Ok(Operator { child: Some(child), port, log, _logdir: logdir })
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// GET on the operator's HTTP port: (status, body).
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        http_get(&self.url(path))
    }

    /// A sample of `/metrics`: `series` is the metric name with its labels as exposed
    /// (`consul_resolver_leader`, `consul_resolver_repairs_total{object="configmap"}`).
    pub fn metric(&self, series: &str) -> Option<f64> {
        metric_sample(&self.get("/metrics")?.1, series)
    }

    /// The sum of every sample of `/metrics` metric `name`, whatever its labels
    /// (`consul_resolver_consul_requests_total`: every Consul request, of any kind and outcome).
    pub fn metric_sum(&self, name: &str) -> Option<f64> {
        let text = self.get("/metrics")?.1;
        let samples = text.lines().filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let value = match rest.strip_prefix('{') {
                Some(labelled) => labelled.split_once("} ")?.1,
                None => rest.strip_prefix(' ')?,
            };
            value.trim().parse::<f64>().ok()
        });
        Some(samples.sum())
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until /readyz answers 200 (a first snapshot was published).
    pub fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let r = wait_for("the operator to become ready", timeout, || {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                return Some(Err(anyhow::anyhow!("operator exited early ({status})")));
            }
            matches!(self.get("/readyz"), Some((200, _))).then_some(Ok(()))
        });
        match r.and_then(|r| r) {
            Ok(()) => Ok(()),
            Err(e) => bail!("{e}\n--- operator log ---\n{}", self.logs()),
        }
    }

    /// The latest published snapshot.
    pub fn snapshot(&self) -> Option<Value> {
        match self.get("/snapshot") {
            Some((200, body)) => serde_json::from_str(&body).ok(),
            _ => None,
        }
    }

    /// Waits until the latest snapshot satisfies `cond`.
    pub fn wait_snapshot(&self, what: &str, timeout: Duration, cond: impl Fn(&Value) -> bool) -> anyhow::Result<Value> {
        wait_for(what, timeout, || self.snapshot().filter(|s| cond(s))).map_err(|e| {
            anyhow::anyhow!("{e}\nlast snapshot: {:?}\n--- operator log ---\n{}", self.snapshot(), self.logs())
        })
    }

    /// Sends `signal` to the operator, without waiting.
    pub fn signal(&self, signal: i32) -> anyhow::Result<()> {
        let pid = self.pid().context("operator already stopped")?;
        // SAFETY: kill(2) on the pid of our own child.
        if unsafe { libc::kill(pid as i32, signal) } != 0 {
            bail!("signal {signal} to the operator: {}", std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// SIGKILL, then reaps it; returns the exit status.
    pub fn kill(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        let mut child = self.child.take().context("operator already stopped")?;
        child.kill()?;
        Ok(child.wait()?)
    }

    /// SIGTERM, then waits for the exit; returns the exit status.
    pub fn terminate(&mut self, timeout: Duration) -> anyhow::Result<std::process::ExitStatus> {
        let mut child = self.child.take().context("operator already stopped")?;
        // SAFETY: signalling our own child by its pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = wait_for("the operator to exit after SIGTERM", timeout, || child.try_wait().ok().flatten());
        if status.is_err() {
            let _ = child.kill();
            let _ = child.wait();
        }
        status
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The sample of `series` (a metric name with its labels as exposed) in a Prometheus text
/// exposition.
pub fn metric_sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// An HTTP client for tests. reqwest is built without a default TLS provider (the
/// operator installs ring at start-up), so tests install the same one first.
pub fn http_client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

/// A blocking HTTP GET on loopback: (status, body); `None` when nothing answers.
pub fn http_get(url: &str) -> Option<(u16, String)> {
    http_get_within(url, Duration::from_secs(5)).ok()
}

/// A blocking HTTP GET on loopback that takes at most `timeout`: (status, body), or why
/// there is none. From sync code only (it runs a runtime of its own).
pub fn http_get_within(url: &str, timeout: Duration) -> anyhow::Result<(u16, String)> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let resp = http_client().get(url).timeout(timeout).send().await.with_context(|| format!("GET {url}"))?;
        let status = resp.status().as_u16();
        Ok((status, resp.text().await.with_context(|| format!("GET {url}: the body"))?))
    })
}
