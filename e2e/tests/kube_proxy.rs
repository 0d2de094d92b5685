//! A real consumer of an export: kube-proxy routes the ClusterIP of the Service the
//! operator writes for a `ConsulService` to the Consul instance in its EndpointSlice, takes
//! the instance out of rotation when Consul says it is critical and back when it passes,
//! and stops routing when the export is deleted (docs/export.md).
//!
//! Everything node-side runs in a network namespace the test creates (`e2e::netns`):
//! kube-proxy 1.20.2 in iptables mode (built with the API server by `e2e/cluster.sh build`),
//! an HTTP server on an address that exists only there (10.96.99.10), registered in Consul
//! (the simulator, on the host's loopback, changed through its HTTP API) at that address,
//! and the `curl`s. The operator runs as its own process on the host, as in every e2e test. The
//! API server of the shared control plane listens on the host's 127.0.0.1; kube-proxy
//! reaches it through a forwarder listening on the namespace's 127.0.0.1. kube-proxy's
//! iptables rules live in the namespace's own tables and go with it: the test checks that
//! the host's tables never saw them.
//!
//! The API server is 1.20: EndpointSlices are discovery.k8s.io/v1beta1, which is also the
//! version kube-proxy 1.20 watches (EndpointSliceProxying is on by default since 1.19).
//!
//! Compiled ignored, with the reason as a build warning, without root, iproute2, iptables,
//! curl, python3 or the cached kube-proxy (under `CI=true` the build fails instead); ignored
//! against an existing cluster (`E2E_KUBECONFIG`). A network namespace that cannot be
//! created is a failure.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use e2e::consul::Consul;
use e2e::fixtures::{export_yaml, resolver_yaml};
use e2e::harness::{Cluster, Operator, repo_root, unique, wait_for};
use e2e::netns::{NetNs, NsChild};
use serde_json::Value;

/// The endpoint's address: it exists only inside the test's namespace. Outside the API
/// server's service range (cluster.sh `--service-cluster-ip-range=10.0.0.0/24`, from which
/// ClusterIPs are allocated), so it is never mistaken for a ClusterIP.
const ENDPOINT_IP: &str = "10.96.99.10";
/// cluster.sh's `--service-cluster-ip-range`: routed to the namespace's interface, so that a
/// connection to a ClusterIP gets as far as iptables (a node's default route does this).
const SERVICE_RANGE: &str = "10.0.0.0/24";
const SERVICE_PORT: u16 = 80;
const BACKEND_PORT: u16 = 8080;
/// The Service port's name, which the slice's port must carry for kube-proxy to match them.
const PORT_NAME: &str = "http";
/// kube-proxy's own ports, on the namespace's loopback (a fresh namespace: always free).
const HEALTHZ_PORT: u16 = 10256;
const METRICS_PORT: u16 = 10249;

#[test]
#[cfg_attr(
    e2e_external_cluster,
    ignore = "runs kube-proxy against the API server of e2e/cluster.sh on the host's loopback"
)]
#[cfg_attr(
    e2e_no_kube_proxy,
    ignore = "needs root, iproute2, iptables, curl, python3 and a cached kube-proxy (the build's warning says which is missing)"
)]
fn kube_proxy_routes_an_exported_consul_service_and_follows_its_health() {
    let kube_proxy = preflight();
    let started = Instant::now();
    let host_before = HostState::read();
    let ns = NetNs::create().unwrap_or_else(|e| panic!("setting up the network namespace: {e:#}"));
    let netns_name = ns.name().to_owned();
    // Outlives run(): the logs in it are printed when run() fails.
    let tmp = tempfile::Builder::new().prefix("cro-kube-proxy-").tempdir().expect("a temporary directory");
    let mut logs = Vec::new();
    let result = run(&ns, &kube_proxy, tmp.path(), &mut logs);
    // The namespace goes (with every iptables rule kube-proxy wrote into it) after the
    // processes inside it, which run() killed, or whose NsChild it dropped on the way out.
    drop(ns);
    let k8s_ns = match result {
        Ok(k8s_ns) => k8s_ns,
        Err(e) => {
            for log in &logs {
                eprintln!("--- {} ---\n{}", log.display(), std::fs::read_to_string(log).unwrap_or_default());
            }
            panic!("{e:#}");
        }
    };
    assert_host_untouched(&netns_name, &k8s_ns, &host_before);
    eprintln!("kube_proxy: passed in {:?}", started.elapsed());
}

/// The whole scenario; returns the Kubernetes namespace it used.
fn run(ns: &NetNs, kube_proxy: &Path, tmp: &Path, logs: &mut Vec<PathBuf>) -> anyhow::Result<String> {
    let cluster = Cluster::shared();
    let api_port: u16 =
        cluster.env_value("APISERVER_PORT").context("no APISERVER_PORT in the cluster's env")?.parse()?;
    let ca = cluster.env_value("APISERVER_CA").context("no APISERVER_CA in the cluster's env")?;
    let k8s_ns = cluster.namespace("kube-proxy")?;
    let token = format!("token-{}-{}", unique(), SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos());

    ns.add_address(&format!("{ENDPOINT_IP}/32"))?;
    ns.add_route(SERVICE_RANGE)?;

    // The backend: a file with the token, served on the namespace-only address.
    let www = tmp.join("www");
    std::fs::create_dir(&www)?;
    std::fs::write(www.join("token"), &token)?;
    let http_log = tmp.join("http-server.log");
    logs.push(http_log.clone());
    let mut http = ns.command("python3");
    http.args(["-m", "http.server", "--bind", ENDPOINT_IP, &BACKEND_PORT.to_string(), "--directory"]).arg(&www);
    let mut http = ns.spawn(http, "the HTTP server", &http_log)?;
    let direct = format!("http://{ENDPOINT_IP}:{BACKEND_PORT}/token");
    wait_answer(ns, &mut http, &direct, "the HTTP server to serve the token", |a| a.body() == Some(&token))?;

    // kube-proxy inside the namespace, reaching the API server through the forwarder.
    let forwarder = ns.forward(([127, 0, 0, 1], api_port).into())?;
    let kubeconfig = tmp.join("kube-proxy.kubeconfig");
    write_kubeconfig(&kubeconfig, forwarder.port(), &ca, &admin_token(cluster)?)?;
    let proxy_log = tmp.join("kube-proxy.log");
    logs.push(proxy_log.clone());
    let mut cmd = ns.command(kube_proxy);
    cmd.args(kube_proxy_args(&kubeconfig, &format!("cro-e2e-node-{}", unique())));
    let mut proxy = ns.spawn(cmd, "kube-proxy", &proxy_log)?;
    // Its healthz answering means it started, in the namespace. The objects below are
    // created after that, so it sees them through its watches, as it will the operator's.
    let healthz = format!("http://127.0.0.1:{HEALTHZ_PORT}/healthz");
    let t = Instant::now();
    wait_answer(ns, &mut proxy, &healthz, "kube-proxy's healthz", |a| matches!(a, Answer::Body(_)))?;
    eprintln!("kube_proxy: healthy {:?} after it started", t.elapsed());

    // The export: the instance registered in Consul at the namespace-only address, a
    // resolver, and a ConsulService; the operator writes the Service and its slice.
    let consul = Consul::shared();
    let svc = format!("web{}", unique());
    let node = format!("node-{svc}");
    let register = |status: &str| consul.register(&node, ENDPOINT_IP, &svc, &format!("{svc}-1"), BACKEND_PORT, status);
    register("passing")?;
    cluster.grant_exports(&k8s_ns)?;
    cluster.apply(&resolver_yaml(&k8s_ns, "consul", &consul.address(), ""))?;
    let ports = format!("  ports: [{{name: {PORT_NAME}, port: {SERVICE_PORT}}}]\n");
    cluster.apply(&export_yaml(&k8s_ns, "web", &svc, "consul", &ports))?;
    let mut operator = Operator::start(cluster, &["--namespace", &k8s_ns])?;
    logs.push(operator.log.clone());
    let cluster_ip = wait_for("the exported Service's ClusterIP", Duration::from_secs(60), || {
        let ip = cluster.kubectl(&["-n", &k8s_ns, "get", "service", "web", "-o", "jsonpath={.spec.clusterIP}"]).ok()?;
        (!ip.is_empty()).then_some(ip)
    })?;
    if !cluster_ip.starts_with("10.0.0.") {
        bail!("ClusterIP {cluster_ip:?} is not in {SERVICE_RANGE}, the range routed inside the namespace");
    }
    let url = format!("http://{cluster_ip}:{SERVICE_PORT}/token");
    let t = Instant::now();
    wait_answer(ns, &mut proxy, &url, "the ClusterIP to answer with the token", |a| a.body() == Some(&token))?;
    eprintln!("kube_proxy: {url} answered {:?} after the Service was written", t.elapsed());

    // Critical in Consul: the resolver admits passing instances only, so the slice loses
    // it, and kube-proxy rejects connections to a Service without endpoints (a REJECT rule:
    // refused at once; without any rule the connection would time out, see NetNs::create).
    register("critical")?;
    let t = Instant::now();
    wait_answer(ns, &mut proxy, &url, "the ClusterIP to refuse (instance critical)", |a| *a == Answer::Refused)?;
    eprintln!("kube_proxy: refused {:?} after the instance turned critical", t.elapsed());
    let rules = iptables_save(ns)?;
    if !rules.contains(&format!("{k8s_ns}/web:{PORT_NAME} has no endpoints")) {
        bail!("no REJECT rule for {k8s_ns}/web:{PORT_NAME} in the namespace's iptables:\n{rules}");
    }

    register("passing")?;
    let t = Instant::now();
    wait_answer(ns, &mut proxy, &url, "the ClusterIP to answer again (passing)", |a| a.body() == Some(&token))?;
    eprintln!("kube_proxy: answered again {:?} after the instance passed", t.elapsed());

    // The export deleted: the operator deletes the Service and its slice (this cluster
    // runs no garbage collector); no DNAT and no REJECT any more, the packet is routed to
    // the namespace's interface, which delivers nothing, so the connection times out.
    cluster.kubectl(&["-n", &k8s_ns, "delete", "consulservice", "web"])?;
    let t = Instant::now();
    wait_answer(ns, &mut proxy, &url, "the ClusterIP to stop answering (export deleted)", |a| *a == Answer::TimedOut)?;
    eprintln!("kube_proxy: no answer {:?} after the export was deleted", t.elapsed());
    let rules = iptables_save(ns)?;
    if rules.contains(&format!("{k8s_ns}/web")) {
        bail!("rules for {k8s_ns}/web remain in the namespace's iptables after the deletion:\n{rules}");
    }
    operator.terminate(Duration::from_secs(30))?;

    // By pid, before the namespace is deleted; the forwarder's connections end with them.
    proxy.kill()?;
    http.kill()?;
    drop(forwarder);
    Ok(k8s_ns)
}

/// The kube-proxy command line, each flag with why it is there.
fn kube_proxy_args(kubeconfig: &Path, node: &str) -> Vec<String> {
    vec![
        // Its own minimal kubeconfig: the forwarder's address and the admin token (see
        // write_kubeconfig).
        format!("--kubeconfig={}", kubeconfig.display()),
        // The mode under test. 1.20's default on Linux is iptables too, but only when the
        // kernel and iptables pass its checks; otherwise it falls back to the userspace
        // proxier, which would pass most of this test without a single iptables DNAT.
        "--proxy-mode=iptables".into(),
        // The node it runs as. No Node object of this name exists (no kubelet runs), and a
        // unique name keeps its Events apart from other runs'.
        format!("--hostname-override={node}"),
        // Its node IP. With the default 0.0.0.0 it reads the Node object's addresses, retrying
        // with backoff for about 33 s before it gives up and assumes 127.0.0.1; a specific
        // address is taken as the node IP at once. In iptables mode the node IP only tells
        // IPv4 from IPv6 and serves NodePorts; it binds nothing.
        "--bind-address=127.0.0.1".into(),
        // Do not set nf_conntrack_max and the nf_conntrack module's hashsize: both are the
        // host's (nf_conntrack_max is read-only in any other network namespace, hashsize is a
        // module parameter), so the writes fail here, and would change the host if they did
        // not. With 0 it leaves them alone.
        "--conntrack-max-per-core=0".into(),
        // Sync at once on each change (1.20's default waits at least 1 s between syncs).
        "--iptables-min-sync-period=0".into(),
        // Its servers on the namespace's loopback (the defaults bind 0.0.0.0 for healthz).
        format!("--healthz-bind-address=127.0.0.1:{HEALTHZ_PORT}"),
        format!("--metrics-bind-address=127.0.0.1:{METRICS_PORT}"),
        // A test's process is not to be shielded from the OOM killer (the default is -999).
        "--oom-score-adj=0".into(),
        // Its syncs and the objects it sees, in its log.
        "--v=2".into(),
    ]
}

/// A kubeconfig for kube-proxy: the forwarder on the namespace's 127.0.0.1, the cluster's
/// CA (the API server's self-signed certificate, valid for 127.0.0.1), and the admin token
/// (group system:masters). The test's own API server has no other static user, and a
/// ServiceAccount token would need a ServiceAccount and a ClusterRoleBinding left behind in
/// the shared cluster (namespaces are never deleted there); what kube-proxy may do is not
/// what this test is about.
fn write_kubeconfig(path: &Path, port: u16, ca: &str, token: &str) -> anyhow::Result<()> {
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: netns\n  cluster:\n    server: https://127.0.0.1:{port}\n    \
         certificate-authority: {ca}\nusers:\n- name: admin\n  user:\n    token: {token}\ncontexts:\n- name: kube-proxy\n  \
         context: {{cluster: netns, user: admin}}\ncurrent-context: kube-proxy\n"
    );
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// The bearer token of the cluster's admin kubeconfig.
fn admin_token(cluster: &Cluster) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(&cluster.admin_kubeconfig)?;
    let kc: Value = serde_yaml::from_str(&text)?;
    kc["users"][0]["user"]["token"].as_str().map(str::to_owned).context("the admin kubeconfig has no token")
}

/// What a `curl` from inside the namespace got.
#[derive(Debug, PartialEq)]
enum Answer {
    Body(String),
    /// curl exit code 7: the connection was refused (a RST, or the ICMP port-unreachable
    /// of an iptables REJECT).
    Refused,
    /// curl exit code 28: nothing answered within `--max-time`.
    TimedOut,
    Other(Option<i32>, String),
}

impl Answer {
    fn body(&self) -> Option<&String> {
        match self {
            Answer::Body(b) => Some(b),
            _ => None,
        }
    }
}

fn curl(ns: &NetNs, url: &str) -> anyhow::Result<Answer> {
    let out = ns.output("curl", &["-sS", "--fail", "--max-time", "2", url])?;
    Ok(match out.status.code() {
        Some(0) => Answer::Body(String::from_utf8_lossy(&out.stdout).into_owned()),
        Some(7) => Answer::Refused,
        Some(28) => Answer::TimedOut,
        code => Answer::Other(code, String::from_utf8_lossy(&out.stderr).trim().to_owned()),
    })
}

/// Polls `url` from inside the namespace until `ok` holds of the answer, failing early
/// when `process` exits. The deadline allows for a slow first sync on a loaded machine.
fn wait_answer(
    ns: &NetNs,
    process: &mut NsChild,
    url: &str,
    what: &str,
    ok: impl Fn(&Answer) -> bool,
) -> anyhow::Result<()> {
    let mut last = None;
    let waited = wait_for(what, Duration::from_secs(60), || {
        if let Err(e) = process.check_running() {
            return Some(Err(e));
        }
        match curl(ns, url) {
            Ok(a) if ok(&a) => Some(Ok(())),
            Ok(a) => {
                last = Some(a);
                None
            }
            Err(e) => Some(Err(e)),
        }
    });
    match waited.and_then(|r| r) {
        Ok(()) => Ok(()),
        Err(e) => {
            // What kube-proxy had written, for the post-mortem (the namespace goes next).
            let rules = iptables_save(ns).unwrap_or_else(|e| format!("{e:#}"));
            bail!(
                "{e:#} (GET {url} from inside the namespace: last answer {last:?})\n--- iptables-save in the namespace ---\n{rules}"
            )
        }
    }
}

/// The namespace's iptables rules, every table.
fn iptables_save(ns: &NetNs) -> anyhow::Result<String> {
    let out = ns.output("iptables-save", &[])?;
    if !out.status.success() {
        bail!("iptables-save in the namespace: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether the host's nat table has a KUBE-SERVICES chain (a kube-proxy on the host).
fn host_nat_has_kube_services() -> bool {
    Command::new("iptables-save")
        .args(["-t", "nat"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).lines().any(|l| l.starts_with(":KUBE-SERVICES ")))
}

/// The sysctls kube-proxy 1.20 writes in iptables mode (nf_conntrack_max only without
/// `--conntrack-max-per-core=0`). All but nf_conntrack_max are per network namespace: its
/// writes must change the test's namespace only.
const KUBE_PROXY_SYSCTLS: [&str; 4] = [
    "net/ipv4/conf/all/route_localnet",
    "net/netfilter/nf_conntrack_tcp_timeout_established",
    "net/netfilter/nf_conntrack_tcp_timeout_close_wait",
    "net/netfilter/nf_conntrack_max",
];

/// What of the host's network state kube-proxy could have changed.
#[derive(Debug, PartialEq)]
struct HostState {
    /// Whether the host's nat table has a KUBE-SERVICES chain (a kube-proxy on the host).
    kube_services: bool,
    /// [`KUBE_PROXY_SYSCTLS`] and their values (empty when unreadable).
    sysctls: Vec<(&'static str, String)>,
}

impl HostState {
    /// Read by this thread, which is in the host's namespace (only e2e::netns's dedicated
    /// threads ever leave it).
    fn read() -> HostState {
        let sysctls = KUBE_PROXY_SYSCTLS
            .iter()
            .map(|&name| {
                let value = std::fs::read_to_string(Path::new("/proc/sys").join(name)).unwrap_or_default();
                (name, value.trim().to_owned())
            })
            .collect();
        HostState { kube_services: host_nat_has_kube_services(), sysctls }
    }
}

/// Nothing of the test is left on the host: no namespace, no kube-proxy chain or rule in the
/// host's tables, no sysctl changed (everything ran inside the namespace).
fn assert_host_untouched(netns_name: &str, k8s_ns: &str, before: &HostState) {
    let list = Command::new("ip").args(["netns", "list"]).output().expect("ip netns list");
    let list = String::from_utf8_lossy(&list.stdout);
    assert!(!list.split_whitespace().any(|n| n == netns_name), "network namespace {netns_name} is left: {list}");
    let after = HostState::read();
    assert_eq!(before.sysctls, after.sysctls, "the host's sysctls changed");
    if !before.kube_services {
        assert!(!after.kube_services, "the host's nat table has a KUBE-SERVICES chain after the test");
    }
    let host = Command::new("iptables-save").output().expect("iptables-save on the host");
    let host = String::from_utf8_lossy(&host.stdout);
    assert!(!host.contains(k8s_ns), "the host's iptables mention {k8s_ns}, the namespace of this test:\n{host}");
}

/// The cached kube-proxy. The build checked what the test needs (e2e/build.rs compiles it
/// ignored otherwise), so anything missing now is a failure, never a skip.
fn preflight() -> PathBuf {
    let out = Command::new("bash").arg(repo_root().join("e2e/cluster.sh")).arg("kube-proxy-path").output();
    let path = PathBuf::from(String::from_utf8_lossy(&out.expect("e2e/cluster.sh kube-proxy-path").stdout).trim());
    assert!(path.is_file(), "kube-proxy is not cached at {} (`bash e2e/cluster.sh build` builds it)", path.display());
    for tool in ["ip", "iptables", "iptables-save", "iptables-restore", "curl", "python3"] {
        assert!(on_path(tool), "{tool} is not installed (`bash e2e/cluster.sh deps`)");
    }
    path
}

/// Whether an executable named `tool` is in a directory of `PATH`.
fn on_path(tool: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(tool))
        .any(|p| std::fs::metadata(&p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}
