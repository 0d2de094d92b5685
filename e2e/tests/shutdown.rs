//! Shutdown fits the pod: SIGTERM to the leader while the API server is slow, and the
//! process must exit, and the Lease be released, within the grace period that
//! manifests/deployment.yaml gives the pod (read from it, not copied). Past the grace
//! period the kubelet kills the process; a leader killed before it released the Lease
//! leaves the standby waiting out the whole lease duration.
//!
//! The slow API server: frozen (SIGSTOP) while a publication is in flight, from before the
//! SIGTERM until half the grace period after it, longer than the renew deadline of the
//! lease (so the leader's leadership lapses meanwhile and its writes are cut off by their
//! deadline), then answering again. Twice: with the Deployment's own flags, and with a
//! hook that does not return, allowed longer than the whole grace period.
//!
//! In a binary of its own: it freezes the control plane of its test process.

use std::path::Path;
use std::time::{Duration, Instant};

use e2e::consul::Consul;
use e2e::fixtures::{mapping_yaml, ports, resolver_yaml};
use e2e::harness::{Cluster, Operator, repo_root, unique, wait_for};

const T: Duration = Duration::from_secs(40);
const SYSTEM: &str = "consul-resolver-system";
/// The flags that time the shutdown: the Deployment's values of them (none: the defaults)
/// are passed on, so the operator here shuts down as the pod does.
const TIMING_FLAGS: [&str; 5] = [
    "--shutdown-timeout",
    "--kube-timeout",
    "--publish-timeout",
    "--leader-election-duration",
    "--on-snapshot-timeout",
];

/// The Deployment's terminationGracePeriodSeconds, and the timing flags among its args.
fn deployment() -> (Duration, Vec<String>) {
    let path = repo_root().join("manifests/deployment.yaml");
    let doc: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let pod = &doc["spec"]["template"]["spec"];
    let grace = pod["terminationGracePeriodSeconds"].as_u64().expect("terminationGracePeriodSeconds");
    let args = pod["containers"][0]["args"].as_sequence().expect("the container's args");
    let timing = args
        .iter()
        .filter_map(|a| a.as_str())
        .filter(|a| TIMING_FLAGS.contains(&a.split('=').next().unwrap_or_default()))
        .map(str::to_owned)
        .collect();
    (Duration::from_secs(grace), timing)
}

/// The API server frozen until thawed, or dropped (a failed assertion never leaves the
/// control plane stopped).
struct Frozen<'a>(&'a Cluster);

impl<'a> Frozen<'a> {
    fn freeze(cluster: &'a Cluster) -> Self {
        cluster.signal_apiserver(libc::SIGSTOP).unwrap();
        Frozen(cluster)
    }

    fn thaw(self) {}
}

impl Drop for Frozen<'_> {
    fn drop(&mut self) {
        let _ = self.0.signal_apiserver(libc::SIGCONT);
    }
}

fn holder(cluster: &Cluster, lease: &str) -> Option<String> {
    cluster.kubectl(&["-n", SYSTEM, "get", "lease", lease, "-o", "jsonpath={.spec.holderIdentity}"]).ok()
}

/// Whether our child `pid` has exited (gone, or a zombie not reaped yet).
fn exited(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.is_empty() || stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z'))
}

/// What one shutdown did, timed from the SIGTERM.
#[derive(Debug)]
struct Outcome {
    case: &'static str,
    resumed: Duration,
    exited: Option<Duration>,
    success: Option<bool>,
    released: Option<Duration>,
    logs: String,
}

impl Outcome {
    /// What is wrong with it, if anything, within `grace`.
    fn failure(&self, grace: Duration) -> Option<String> {
        let mut wrong = Vec::new();
        if self.exited.is_none() {
            wrong.push(format!("did not exit within the grace period ({grace:?})"));
        }
        if self.success == Some(false) {
            wrong.push("exited with a failure".to_owned());
        }
        if self.released.is_none() {
            wrong.push(format!("the Lease was not released within the grace period ({grace:?})"));
        }
        (!wrong.is_empty()).then(|| {
            format!(
                "{} (the API server answering again {:?} after SIGTERM): {}",
                self.case,
                self.resumed,
                wrong.join("; ")
            )
        })
    }
}

/// Starts a leader writing the snapshot ConfigMap (`extra` flags and `env` added), freezes
/// the API server, makes a change (its ConfigMap write then hangs), sends SIGTERM, thaws
/// the API server half the grace period later (or as soon as the process has exited), and
/// times the exit and the Lease's release, until the grace period is over.
fn shutdown_while_slow(
    cluster: &Cluster,
    case: &'static str,
    grace: Duration,
    timing: &[String],
    extra: &[&str],
    env: &[(&str, &str)],
    before_the_change: impl FnOnce(),
) -> Outcome {
    let consul = Consul::shared();
    let ns = cluster.namespace("shutdown").unwrap();
    let svc = format!("sd{}", unique());
    let register = |port| consul.register("node-sd", "127.0.0.1", &svc, &format!("{svc}-1"), port, "passing");
    register(22001).unwrap();
    cluster.apply(&resolver_yaml(&ns, "consul", &consul.address(), "")).unwrap();
    cluster.apply(&mapping_yaml(&ns, "m", &svc, Some("consul"))).unwrap();
    let (lease, cm) = (format!("lease-{}", unique()), format!("snap-{}", unique()));
    let (cm_arg, lease_arg) = (format!("{SYSTEM}/{cm}"), format!("{SYSTEM}/{lease}"));
    let mut args = vec![
        "--namespace",
        &ns,
        "--snapshot-configmap",
        &cm_arg,
        "--leader-election-lease",
        &lease_arg,
        "--leader-election-identity",
        "replica-a",
    ];
    args.extend(timing.iter().map(String::as_str));
    args.extend_from_slice(extra);
    let mut op = Operator::start_with_env(cluster, &args, env).unwrap();
    op.wait_ready(T).unwrap();
    wait_for("replica-a to hold the lease", T, || (holder(cluster, &lease)? == "replica-a").then_some(())).unwrap();
    wait_for("the first snapshot in the ConfigMap", T, || {
        let data =
            cluster.kubectl(&["-n", SYSTEM, "get", "configmap", &cm, "-o", "jsonpath={.data.snapshot\\.json}"]).ok()?;
        (ports(&serde_json::from_str(&data).ok()?, &ns, "consul", &svc)? == [22001]).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));

    // A publication in flight on a frozen API server: served over HTTP at once and handed
    // to the publishers, its ConfigMap write (and the resolver's status) hanging.
    before_the_change();
    let frozen = Frozen::freeze(cluster);
    register(22002).unwrap();
    op.wait_snapshot("the change served, its ConfigMap write pending", T, |s| {
        ports(s, &ns, "consul", &svc) == Some(vec![22002])
    })
    .unwrap();
    let pid = op.pid().unwrap();
    op.signal(libc::SIGTERM).unwrap();
    let sigterm = Instant::now();
    // The API server answers again half the grace period later; sooner once the process is
    // gone (then nothing it could still do depends on it).
    let _ = wait_for("the operator to exit", grace / 2, || exited(pid).then_some(()));
    frozen.thaw();
    let resumed = sigterm.elapsed();
    let left = || (sigterm + grace).saturating_duration_since(Instant::now());
    let exited_after = wait_for("the operator to exit", left(), || exited(pid).then(|| sigterm.elapsed())).ok();
    let released =
        wait_for("the Lease released", left(), || holder(cluster, &lease)?.is_empty().then(|| sigterm.elapsed())).ok();
    // Reaps it (a zombie ignores the signal), or kills it if it is still running.
    let success = match exited_after {
        Some(_) => op.terminate(T).ok().map(|s| s.success()),
        None => {
            let _ = op.kill();
            None
        }
    };
    let outcome = Outcome { case, resumed, exited: exited_after, success, released, logs: op.logs() };
    eprintln!(
        "{case}: API server answering again {resumed:?} after SIGTERM; exited after {exited:?} (success: {success:?}); \
         Lease released after {released:?}; grace period {grace:?}",
        exited = exited_after
    );
    outcome
}

#[test]
#[cfg_attr(e2e_external_cluster, ignore = "freezes the API server: needs the suite's own control plane")]
fn a_leader_stopped_on_a_slow_api_server_exits_and_releases_the_lease_within_the_grace_period() {
    let cluster = Cluster::shared();
    let (grace, timing) = deployment();
    eprintln!("manifests/deployment.yaml: terminationGracePeriodSeconds {grace:?}, timing flags {timing:?}");

    let with_the_deployments_flags =
        shutdown_while_slow(cluster, "the Deployment's flags", grace, &timing, &[], &[], || {});

    // A hook that returns at once until the marker exists, then hangs until it is killed,
    // allowed longer than the grace period: only the shutdown's budget can cut it off. (Its
    // sleep ends on its own a while later, should a failed run leave it behind.)
    let dir = tempfile::tempdir().unwrap();
    let (hook, marker) = (dir.path().join("hook.sh"), dir.path().join("hang"));
    let hook_timeout = grace + Duration::from_secs(15);
    let script = format!("#!/bin/sh\n[ -e \"$HANG_MARKER\" ] || exit 0\nexec sleep {}\n", hook_timeout.as_secs() * 2);
    std::fs::write(&hook, script).unwrap();
    make_executable(&hook);
    let (hook_arg, marker_env) = (hook.display().to_string(), marker.display().to_string());
    let hook_timeout = format!("{}s", hook_timeout.as_secs());
    let with_a_hanging_hook = shutdown_while_slow(
        cluster,
        "a hook that hangs",
        grace,
        &timing,
        &["--on-snapshot", &hook_arg, "--on-snapshot-timeout", &hook_timeout],
        &[("HANG_MARKER", &marker_env)],
        || std::fs::write(&marker, "").unwrap(),
    );

    let failures: Vec<String> =
        [&with_the_deployments_flags, &with_a_hanging_hook].iter().filter_map(|o| o.failure(grace)).collect();
    assert!(
        failures.is_empty(),
        "{}\n--- the Deployment's flags ---\n{}\n--- a hook that hangs ---\n{}",
        failures.join("\n"),
        with_the_deployments_flags.logs,
        with_a_hanging_hook.logs
    );
    // What the scenario is about: the freeze outlasted the leader's renew deadline (its
    // writes were cut off by it), and the budget, not the hook's own limit, ended the hook.
    assert!(
        with_the_deployments_flags.logs.contains("leadership lapsed"),
        "the freeze outlasted the renew deadline:\n{}",
        with_the_deployments_flags.logs
    );
    let cut_off = |line: &&str| line.contains("delivery cut off") && line.contains("\"hook\"");
    assert!(
        with_a_hanging_hook.logs.lines().any(|l| cut_off(&l)),
        "the hook in flight is cut off, and the log says so:\n{}",
        with_a_hanging_hook.logs
    );
}

fn make_executable(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}
