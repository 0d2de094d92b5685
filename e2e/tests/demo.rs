//! `make demo`, the README's first command, run as a user would, non-interactively:
//! `DEMO_TOUR=check bash e2e/demo.sh` builds what it needs (the builds `make test` already
//! made), starts its own control plane, simulator, two replicas, two HTTP backends and an
//! Envoy fed by both replicas over xDS, walks the seven steps of the tour and tears
//! everything down. The test fails when the script fails to start, when any step of the
//! tour fails, or when anything it started is left running or listening.
//!
//! Without Envoy (`bash scripts/real-parts.sh envoy`) the tour skips its Envoy step, and
//! this test expects it to say so; under `CI=true` the build fails instead (e2e/build.rs).

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use e2e::harness::{build_command, free_port};

/// The tour's own waits are 30 s per step at most, the control plane's start 90 s, and the
/// builds are already made: five minutes is a hung script, not a slow one.
const DEADLINE: Duration = Duration::from_secs(300);

/// Every step the tour reports as done, in order (the `ok:` lines of e2e/demo.sh); with
/// Envoy, requests through it reach both backends, then only the one whose check passes,
/// then both again, and still both once the replica it took xDS from may have stopped.
fn steps() -> Vec<&'static str> {
    let mut steps = vec![
        "ok: first snapshot published",
        "ok: billing has 1 endpoint in the snapshot",
        "ok: checkout has 3 endpoints",
        "ok: Ready=False reason InvalidSpec",
        "ok: cart gone from the snapshot's services",
    ];
    if cfg!(e2e_no_envoy) {
        steps.push("5. skipped: Envoy is not installed");
        steps.push("ok: the lease moved from replica-");
    } else {
        steps.extend([
            "ok: both greeter instances answer through Envoy",
            "ok: only greeter-2 answers through Envoy",
            "ok: both greeter instances answer through Envoy again",
            "ok: the lease moved from replica-",
            "ok: Envoy takes xDS from the replica left and still reaches both greeter instances",
        ]);
    }
    steps.push("ok: billing has no endpoints in the ConfigMap");
    steps
}

#[test]
#[cfg_attr(e2e_external_cluster, ignore = "the demo starts its own control plane, built from source")]
fn make_demo_walks_the_whole_tour_and_leaves_nothing_running() {
    let tmp = tempfile::Builder::new().prefix("cro-demo-test-").tempdir().unwrap();
    let (port, port2, xds_port, xds_port2) = (free_port(), free_port(), free_port(), free_port());
    let out_path = tmp.path().join("demo.out");
    let out = std::fs::File::create(&out_path).unwrap();
    let mut child = build_command("bash")
        .arg("e2e/demo.sh")
        .env("DEMO_TOUR", "check")
        .env("DEMO_PORT", port.to_string())
        .env("DEMO_PORT2", port2.to_string())
        .env("DEMO_XDS_PORT", xds_port.to_string())
        .env("DEMO_XDS_PORT2", xds_port2.to_string())
        // The demo's state (cluster, logs) goes under our temporary directory, so that what
        // it leaves behind can be found.
        .env("TMPDIR", tmp.path())
        .env_remove("KUBECONFIG")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        // Its own process group: on a hang, everything it started is stopped at once.
        .process_group(0)
        .spawn()
        .expect("bash runs e2e/demo.sh");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > DEADLINE {
            // Our own child's group, by its pid.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGTERM) };
            let _ = child.wait();
            panic!("the demo did not finish within {DEADLINE:?}:\n{}", read(&out_path));
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let output = read(&out_path);
    println!("{output}");
    assert!(status.success(), "DEMO_TOUR=check exited {status}:\n{output}");
    let mut rest = output.as_str();
    for step in steps() {
        let at = rest.find(step).unwrap_or_else(|| panic!("the tour never reported {step:?} (in order):\n{output}"));
        rest = &rest[at + step.len()..];
    }
    assert!(output.contains("tour passed"), "{output}");

    // Torn down: nothing it started still runs (etcd, the API server, Envoy and the backends
    // name files under our directory on their command lines), its state is gone, and no
    // loopback address it started (replicas, their xDS servers, the simulator, and those it
    // printed: backends, Envoy's listener and admin, the API server) still answers.
    let leftovers = processes_naming(tmp.path());
    assert!(leftovers.is_empty(), "still running after the demo exited: {leftovers:?}");
    let dirs: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(dirs, ["demo.out"], "the demo's state directory is removed");
    let consul = output
        .split_whitespace()
        .find_map(|w| w.strip_prefix("http://").and_then(|w| w.strip_suffix("/v1/catalog/deregister")))
        .expect("the demo shows the simulator's address");
    let mut addrs: Vec<String> = [port, port2, xds_port, xds_port2].iter().map(|p| format!("127.0.0.1:{p}")).collect();
    addrs.push(consul.to_owned());
    addrs.extend(loopback_addrs(&output));
    addrs.sort();
    addrs.dedup();
    for addr in addrs {
        let addr: std::net::SocketAddr = addr.parse().unwrap();
        assert!(
            std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err(),
            "{addr} still accepts connections after the demo exited"
        );
    }
}

/// Every `127.0.0.1:PORT` the output names.
fn loopback_addrs(output: &str) -> Vec<String> {
    output
        .match_indices("127.0.0.1:")
        .filter_map(|(at, prefix)| {
            let digits: String = output[at + prefix.len()..].chars().take_while(char::is_ascii_digit).collect();
            digits.parse::<u16>().ok().filter(|p| *p != 0).map(|p| format!("127.0.0.1:{p}"))
        })
        .collect()
}

fn read(path: &Path) -> String {
    let mut s = String::new();
    std::fs::File::open(path).and_then(|mut f| f.read_to_string(&mut s)).unwrap();
    s
}

/// Processes whose command line names something under `dir`: (pid, command line).
fn processes_naming(dir: &Path) -> Vec<(u32, String)> {
    let needle = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            cmd.contains(&needle).then_some((pid, cmd))
        })
        .collect()
}
