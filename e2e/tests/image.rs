//! The container image, as `make image` builds it (Containerfile, image/build.sh): FROM
//! scratch with a static release binary, CA certificates and a non-root user. Checked
//! through podman as a cluster would see it: its entrypoint and user, its size, exactly
//! which files it holds, that the binary runs from the image's own filesystem, that name
//! resolution works in it, and that it is the image manifests/deployment.yaml runs.
//!
//! Needs podman: compiled as ignored without it (e2e/build.rs); `make image-deps`, which
//! `.ci/run` runs, installs it. The image is built once per run of this test binary (the
//! static release build is cached under target/, so a rebuild without changes takes
//! seconds).
#![cfg_attr(e2e_no_podman, allow(dead_code, unused_imports))]

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Output};
use std::sync::OnceLock;

use e2e::harness::{build_command, repo_root};
use serde_json::Value;

/// The image size limit (bytes, uncompressed as podman stores it).
const MAX_SIZE: u64 = 30_000_000;
const UID: u32 = 65532;

/// `make image`, once: the name of the image it built.
fn image() -> &'static str {
    static IMAGE: OnceLock<String> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let out =
            build_command("make").args(["--no-print-directory", "-s", "image"]).output().expect("make is required");
        assert!(out.status.success(), "make image failed:\n{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8_lossy(&out.stdout);
        stdout.lines().last().unwrap_or_else(|| panic!("make image printed no image name")).trim().to_owned()
    })
}

fn podman(args: &[&str]) -> Output {
    Command::new("podman").args(args).output().expect("podman is installed")
}

fn podman_ok(args: &[&str]) -> String {
    let out = podman(args);
    assert!(out.status.success(), "podman {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `podman run --rm` of the image with `args`: no network, and settings that let it run in
/// CI sandboxes too: runc where installed (crun refuses cgroups mounted in hybrid v1/v2
/// mode), and explicit rlimits (podman's default raises them past what a sandbox may allow).
fn run_image(podman_args: &[&str], args: &[&str]) -> Output {
    let mut cmd = Command::new("podman");
    if Path::new("/usr/bin/runc").exists() || Path::new("/usr/sbin/runc").exists() {
        cmd.args(["--runtime", "runc"]);
    }
    cmd.args(["run", "--rm", "--network=none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]);
    cmd.args(podman_args).arg(image()).args(args);
    cmd.output().expect("podman is installed")
}

fn inspect() -> Value {
    let out = podman_ok(&["image", "inspect", image()]);
    let list: Value = serde_json::from_str(&out).unwrap();
    list[0].clone()
}

/// The image tag manifests/deployment.yaml runs.
fn deployment_image() -> String {
    let text = std::fs::read_to_string(repo_root().join("manifests/deployment.yaml")).unwrap();
    let deploy: Value = serde_yaml::from_str(&text).unwrap();
    deploy["spec"]["template"]["spec"]["containers"][0]["image"].as_str().unwrap().to_owned()
}

#[test]
#[cfg_attr(e2e_no_podman, ignore = "podman is not installed (make image-deps installs it)")]
fn the_image_is_small_runs_as_non_root_and_its_binary_runs() {
    let config = inspect();
    assert_eq!(config["Config"]["Entrypoint"], serde_json::json!(["/consul-resolver-operator"]), "{config}");
    assert_eq!(config["Config"]["Cmd"], serde_json::json!(["run"]));
    assert_eq!(config["Config"]["User"], format!("{UID}:{UID}"), "a numeric non-root user (runAsNonRoot checks it)");
    let size = config["Size"].as_u64().unwrap();
    eprintln!("image {}: {size} bytes", image());
    assert!(size < MAX_SIZE, "the image is {size} bytes, over {MAX_SIZE}");

    // The binary runs from the image's filesystem (nothing but itself: it is static), as
    // the image's user.
    let out = run_image(&[], &["version"]);
    assert!(out.status.success(), "podman run {} version: {}", image(), String::from_utf8_lossy(&out.stderr));
    let printed = String::from_utf8_lossy(&out.stdout);
    let version = printed.trim().strip_prefix("consul-resolver-operator ").unwrap_or_else(|| panic!("{printed:?}"));
    assert_eq!(config["Config"]["Labels"]["org.opencontainers.image.version"], version);

    // The image the Deployment runs is this one: same name, same version.
    assert_eq!(deployment_image(), format!("consul-resolver-operator:{version}"));
    assert_eq!(image(), deployment_image(), "make image builds the Deployment's image");
}

#[test]
#[cfg_attr(e2e_no_podman, ignore = "podman is not installed (make image-deps installs it)")]
fn the_image_holds_only_the_binary_certificates_and_user() {
    let root = podman_ok(&["image", "mount", image()]).trim().to_owned();
    let mut files = BTreeMap::new();
    let mut stack = vec![std::path::PathBuf::from(&root)];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            if meta.is_dir() {
                stack.push(path);
            } else {
                let rel = path.strip_prefix(&root).unwrap().display().to_string();
                files.insert(rel, (meta.uid(), meta.permissions().mode() & 0o7777, meta.len()));
            }
        }
    }
    let read = |p: &str| std::fs::read_to_string(Path::new(&root).join(p)).unwrap();
    let (passwd, nsswitch, certs) =
        (read("etc/passwd"), read("etc/nsswitch.conf"), read("etc/ssl/certs/ca-certificates.crt"));
    podman_ok(&["image", "unmount", image()]);

    let names: Vec<&str> = files.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "consul-resolver-operator",
            "etc/group",
            "etc/nsswitch.conf",
            "etc/passwd",
            "etc/ssl/certs/ca-certificates.crt"
        ],
        "the image's files"
    );
    // Root owns everything; the non-root user can change none of it.
    for (name, (uid, mode, _)) in &files {
        assert_eq!(*uid, 0, "{name} is owned by uid {uid}");
        assert_eq!(mode & 0o022, 0, "{name} is writable by others: {mode:o}");
    }
    assert_eq!(files["consul-resolver-operator"].1, 0o755);
    assert!(passwd.lines().any(|l| l.starts_with(&format!("nonroot:x:{UID}:{UID}:"))), "{passwd}");
    assert!(
        nsswitch.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["hosts:", "files", "dns"]),
        "{nsswitch}"
    );
    assert!(certs.matches("-----BEGIN CERTIFICATE-----").count() > 50, "a CA bundle: {} bytes", certs.len());
}

#[test]
#[cfg_attr(e2e_no_podman, ignore = "podman is not installed (make image-deps installs it)")]
fn the_static_binary_resolves_names_inside_the_image() {
    // The operator is started with a kubeconfig naming its API server by a host name that
    // only the container's /etc/hosts knows, pointing at the operator's own HTTP port. The
    // static binary's getaddrinfo must resolve it through the image's nsswitch.conf: the
    // start-up then reaches that server and fails on its 404 for the CRD's API group.
    let tmp = tempfile::tempdir().unwrap();
    let kubeconfig = "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: 'http://cro-apiserver.test:8080'}\nusers:\n- name: u\n  user: {token: t}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\n";
    let path = tmp.path().join("kubeconfig");
    std::fs::write(&path, kubeconfig).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let volume = format!("{}:/kubeconfig:ro", path.display());
    let start = |extra: &[&str]| {
        let mut podman_args = vec!["-v", volume.as_str(), "-e", "KUBECONFIG=/kubeconfig"];
        podman_args.extend(extra);
        let out = run_image(&podman_args, &["run", "--listen=127.0.0.1:8080", "--kube-timeout=5s"]);
        assert!(!out.status.success(), "the operator cannot start against its own HTTP port");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let resolved = start(&["--add-host", "cro-apiserver.test:127.0.0.1"]);
    assert!(resolved.contains("code: 404"), "the name resolved and its server answered:\n{resolved}");
    // Without the hosts entry the same start-up fails at the connection (no address), so
    // the check above tells a working lookup from a broken one.
    let unresolved = start(&[]);
    assert!(unresolved.contains("client error (Connect)") && !unresolved.contains("code: 404"), "{unresolved}");
}
