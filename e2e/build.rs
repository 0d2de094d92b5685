//! Which Consul the e2e tests run against is known at build time (`E2E_CONSUL_ADDR`), so a
//! test that cannot run against it is compiled as `#[ignore]` and shows as ignored, never as
//! a silent pass.

fn main() {
    println!("cargo::rerun-if-env-changed=E2E_CONSUL_ADDR");
    println!("cargo::rerun-if-env-changed=E2E_CONSUL_TOKEN");
    println!("cargo::rerun-if-env-changed=E2E_KUBECONFIG");
    println!("cargo::rustc-check-cfg=cfg(e2e_consul_without_acls)");
    println!("cargo::rustc-check-cfg=cfg(e2e_external_cluster)");
    println!("cargo::rustc-check-cfg=cfg(e2e_real_consul)");
    println!("cargo::rustc-check-cfg=cfg(e2e_no_podman)");
    // Someone else's cluster: its API server is not ours to freeze or read the audit log of.
    if std::env::var_os("E2E_KUBECONFIG").is_some() {
        println!("cargo::rustc-cfg=e2e_external_cluster");
    }
    // The image test builds and runs the image with podman (image/build.sh deps installs it).
    if !podman_on_path() {
        println!("cargo::rustc-cfg=e2e_no_podman");
    }
    // A real agent: the simulator's fault injection and request log are not there.
    if std::env::var_os("E2E_CONSUL_ADDR").is_some() {
        println!("cargo::rustc-cfg=e2e_real_consul");
    }
    // A real agent without a token given: ACLs cannot be exercised.
    if std::env::var_os("E2E_CONSUL_ADDR").is_some() && std::env::var_os("E2E_CONSUL_TOKEN").is_none() {
        println!("cargo::rustc-cfg=e2e_consul_without_acls");
    }
}

/// Whether `podman` is on PATH. Cargo reruns this script when PATH changes, or when one of
/// the directories packages install it into changes (a directory's own mtime moves when a
/// file is added or removed), so installing podman turns the image test on at the next
/// build. Only those system directories are watched: a user directory that changes often
/// (pip's shims) would rebuild the e2e tests each time.
fn podman_on_path() -> bool {
    println!("cargo::rerun-if-env-changed=PATH");
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs: Vec<_> = std::env::split_paths(&path).collect();
    for dir in &dirs {
        if ["/usr/bin", "/usr/local/bin", "/bin"].iter().any(|d| dir.as_os_str() == *d) && dir.is_dir() {
            println!("cargo::rerun-if-changed={}", dir.display());
        }
    }
    dirs.iter().any(|d| d.join("podman").is_file())
}
