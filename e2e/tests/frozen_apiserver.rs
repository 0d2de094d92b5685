//! The API server frozen (SIGSTOP) for longer than the leader lease, with two replicas.
//!
//! The leader must stop writing at its renew deadline by a timer, while its requests hang;
//! no two replicas may ever both write; after SIGCONT everything converges. "Never two
//! writers" is checked on the API server's own record: in the audit log, every successful
//! write of a replica (ConfigMap, status, Event) must come after that replica's latest
//! successful Lease write, with no other replica's Lease write in between. A write sent
//! before the deadline but applied late, after the other replica took the lease, would
//! break it (the ConfigMap and status writes are conditional on resourceVersion for this).
//!
//! A second phase freezes the leader *process* instead (a long pause) past the lease: the
//! other replica takes over and writes, and the old leader, woken, must not write again.
//!
//! In a binary of its own: it freezes the control plane of its test process.

use std::time::{Duration, Instant};

use consul_resolver_api::status::condition;
use e2e::consul::Consul;
use e2e::fixtures::{mapping_yaml, resolver_yaml};
use e2e::harness::{Cluster, Operator, unique, wait_for};
use serde_json::Value;

const T: Duration = Duration::from_secs(40);
const SYSTEM: &str = "consul-resolver-system";
/// `--leader-election-duration`: renew deadline two thirds of it.
const LEASE: Duration = Duration::from_secs(3);
const RENEW_DEADLINE: Duration = Duration::from_secs(2);

/// Sends `signal` to the API server this test process started (by its recorded pid).
fn signal_apiserver(cluster: &Cluster, signal: i32) {
    let dir = cluster.dir.as_ref().expect("our own cluster");
    let pid: i32 = std::fs::read_to_string(dir.join("apiserver.pid")).unwrap().trim().parse().unwrap();
    // SAFETY: kill(2) on the pid of the kube-apiserver this process started.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "signal {signal} to the apiserver");
}

/// The snapshot in the ConfigMap, read as admin (the JSON encoding: it is small).
fn configmap_ports(cluster: &Cluster, cm: &str, ns: &str, svc: &str) -> Option<Vec<u64>> {
    let data =
        cluster.kubectl(&["-n", SYSTEM, "get", "configmap", cm, "-o", "jsonpath={.data.snapshot\\.json}"]).ok()?;
    e2e::fixtures::ports(&serde_json::from_str(&data).ok()?, ns, "consul", svc)
}

fn holder(cluster: &Cluster, lease: &str) -> Option<String> {
    cluster.kubectl(&["-n", SYSTEM, "get", "lease", lease, "-o", "jsonpath={.spec.holderIdentity}"]).ok()
}

/// Which replica sent a request, from the User-Agent the operator sets.
fn replica(event: &Value) -> Option<&'static str> {
    let agent = event["userAgent"].as_str()?;
    ["replica-a", "replica-b"].into_iter().find(|r| agent.contains(&format!("({r})")))
}

fn succeeded(event: &Value) -> bool {
    event["responseStatus"]["code"].as_u64().is_some_and(|c| (200..300).contains(&c))
}

fn is_write(event: &Value) -> bool {
    matches!(event["verb"].as_str(), Some("create" | "update" | "patch" | "delete"))
}

/// The test's world: the service `svc` of the shared Consul behind a resolver and a
/// Mapping in `ns`, and the ConfigMap and Lease the two replicas share.
struct Frozen {
    cluster: &'static Cluster,
    consul: &'static Consul,
    ns: String,
    svc: String,
    lease: String,
    cm: String,
}

impl Frozen {
    fn set_up() -> Frozen {
        let cluster = Cluster::shared();
        let consul = Consul::shared();
        let ns = cluster.namespace("frozen").unwrap();
        let svc = format!("frz{}", unique());
        let (lease, cm) = (format!("lease-{}", unique()), format!("snap-{}", unique()));
        let f = Frozen { cluster, consul, ns, svc, lease, cm };
        f.register(21001);
        cluster.apply(&resolver_yaml(&f.ns, "consul", &consul.address(), "")).unwrap();
        cluster.apply(&mapping_yaml(&f.ns, "m", &f.svc, Some("consul"))).unwrap();
        f
    }

    /// The one instance of the service, now at `port`.
    fn register(&self, port: u16) {
        let svc = &self.svc;
        self.consul.register("node-frz", "127.0.0.1", svc, &format!("{svc}-1"), port, "passing").unwrap();
    }

    /// A replica called `identity`, ready.
    fn start(&self, identity: &str) -> Operator {
        let args = [
            "--namespace",
            &self.ns,
            "--snapshot-configmap",
            &format!("{SYSTEM}/{}", self.cm),
            "--leader-election-lease",
            &format!("{SYSTEM}/{}", self.lease),
            "--leader-election-identity",
            identity,
            "--leader-election-duration",
            &format!("{}s", LEASE.as_secs()),
        ];
        let mut op = Operator::start(self.cluster, &args).unwrap();
        op.wait_ready(T).unwrap();
        op
    }

    fn holder(&self) -> Option<String> {
        holder(self.cluster, &self.lease)
    }

    fn configmap_ports(&self) -> Option<Vec<u64>> {
        configmap_ports(self.cluster, &self.cm, &self.ns, &self.svc)
    }

    /// Waits until the ConfigMap publishes the instance at `port`.
    fn wait_configmap(&self, what: &str, port: u64) -> anyhow::Result<()> {
        wait_for(what, T, || (self.configmap_ports()? == [port]).then_some(()))
    }

    /// Freezes the API server while Consul changes: both replicas want to publish, the
    /// leader's writes hang. The leader `a` stops leading by its renew deadline, and `b`
    /// cannot take the lease while the API server stays frozen past it.
    fn freeze_the_apiserver_past_the_lease(&self, a: &Operator, b: &Operator) {
        signal_apiserver(self.cluster, libc::SIGSTOP);
        let frozen = Instant::now();
        self.register(21002);
        a.wait_snapshot("replica-a sees the change", T, |s| {
            e2e::fixtures::ports(s, &self.ns, "consul", &self.svc) == Some(vec![21002])
        })
        .unwrap();
        // The leader stops by its deadline (two thirds of the lease after its last renewal,
        // which was at most a retry period before the freeze).
        let stopped = wait_for("replica-a to stop leading", RENEW_DEADLINE + Duration::from_millis(1500), || {
            (a.metric("consul_resolver_leader")? == 0.0).then(|| frozen.elapsed())
        });
        let stopped = stopped.unwrap_or_else(|e| panic!("{e}\n{}", a.logs()));
        eprintln!("replica-a stopped leading {stopped:?} after the API server froze");
        // The fault's own length: frozen for longer than the lease.
        std::thread::sleep((LEASE * 2).saturating_sub(frozen.elapsed()));
        assert_eq!(b.metric("consul_resolver_leader"), Some(0.0), "nobody can take a lease from a frozen API server");
        signal_apiserver(self.cluster, libc::SIGCONT);
    }

    /// Converges: one leader, the change in the ConfigMap and in the status. Returns the
    /// leader's identity.
    fn wait_converged(&self, a: &Operator, b: &Operator) -> String {
        self.wait_configmap("the change in the ConfigMap", 21002)
            .unwrap_or_else(|e| panic!("{e}\n--- a ---\n{}\n--- b ---\n{}", a.logs(), b.logs()));
        let leader = wait_for("exactly one leader", T, || {
            let gauges = (a.metric("consul_resolver_leader")?, b.metric("consul_resolver_leader")?);
            let held = self.holder()?;
            match gauges {
                (1.0, 0.0) if held == "replica-a" => Some(held),
                (0.0, 1.0) if held == "replica-b" => Some(held),
                _ => None,
            }
        })
        .unwrap();
        wait_for("the status with the change", T, || {
            let out = self.cluster.kubectl(&["-n", &self.ns, "get", "cres", "consul", "-o", "json"]).ok()?;
            let obj: Value = serde_json::from_str(&out).ok()?;
            (obj["status"]["serviceDetails"][0]["index"].as_u64()? > 0
                && obj["status"]["conditions"]
                    .as_array()?
                    .iter()
                    .any(|c| c["type"] == condition::READY && c["status"] == "True"))
            .then_some(())
        })
        .unwrap();
        leader
    }

    /// The leader process `old` pauses past the lease (a stop-the-world pause): `new` takes
    /// over and publishes the next change; `old`, woken, must not write.
    fn pause_the_leader_past_the_lease(&self, old: &Operator, new: &Operator) {
        let old_pid = old.pid().unwrap() as i32;
        // SAFETY: kill(2) on the pid of an operator process this test started.
        assert_eq!(unsafe { libc::kill(old_pid, libc::SIGSTOP) }, 0);
        self.register(21003);
        let took_over = wait_for("the other replica to take over and publish", T, || {
            (new.metric("consul_resolver_leader")? == 1.0 && self.configmap_ports()? == [21003]).then_some(())
        });
        // SAFETY: as above.
        assert_eq!(unsafe { libc::kill(old_pid, libc::SIGCONT) }, 0);
        took_over.unwrap_or_else(|e| panic!("{e}\n{}", new.logs()));
        wait_for("the woken replica to follow", T, || (old.metric("consul_resolver_leader")? == 0.0).then_some(()))
            .unwrap();
        self.register(21004);
        wait_for("the next change, from the new leader", T, || {
            (self.configmap_ports()? == [21004]
                && old.snapshot().and_then(|s| e2e::fixtures::ports(&s, &self.ns, "consul", &self.svc))? == [21004])
            .then_some(())
        })
        .unwrap();
    }

    /// Never two writers, by the API server's own record: every successful write of a
    /// replica comes after its own latest Lease write, with no other replica's in between.
    fn assert_never_two_writers(&self) {
        let events = self.cluster.audit_events().unwrap().expect("our own cluster has an audit log");
        let mut holder_now: Option<&str> = None;
        let (mut writes, mut checked) = (0, 0);
        for e in &events {
            let Some(who) = replica(e) else { continue };
            if !is_write(e) || !succeeded(e) {
                continue;
            }
            let object = &e["objectRef"];
            if object["resource"] == "leases" && object["name"] == self.lease.as_str() {
                holder_now = Some(who);
                continue;
            }
            writes += 1;
            let ours = object["resource"] == "configmaps"
                || object["resource"] == "events"
                || (object["resource"] == "consulresolvers" && object["subresource"] == "status");
            if ours {
                checked += 1;
                assert_eq!(holder_now, Some(who), "{who} wrote while {holder_now:?} held the lease: {e}");
            }
        }
        assert!(checked >= 3, "the audit log shows too few writes to check ({checked} of {writes})");
        let writers: std::collections::BTreeSet<_> =
            events.iter().filter(|e| is_write(e) && succeeded(e)).filter_map(replica).collect();
        assert_eq!(writers.len(), 2, "both replicas led in turn: {writers:?}");
        eprintln!("audit log: {checked} cluster writes checked against the lease holder at the time");
    }
}

#[test]
#[cfg_attr(e2e_external_cluster, ignore = "freezes the API server: needs the suite's own control plane")]
fn a_frozen_api_server_never_gets_two_writers_and_everything_converges() {
    let f = Frozen::set_up();
    let mut a = f.start("replica-a");
    wait_for("replica-a to hold the lease", T, || (f.holder()? == "replica-a").then_some(())).unwrap();
    let mut b = f.start("replica-b");
    f.wait_configmap("the ConfigMap", 21001).unwrap();
    wait_for("resolver status written", T, || {
        (f.cluster.resolver_condition(&f.ns, "consul", condition::READY)?["status"] == "True").then_some(())
    })
    .unwrap();
    assert_eq!((a.metric("consul_resolver_leader"), b.metric("consul_resolver_leader")), (Some(1.0), Some(0.0)));

    f.freeze_the_apiserver_past_the_lease(&a, &b);
    let leader = f.wait_converged(&a, &b);
    eprintln!("after the freeze, {leader} leads");
    let (old, new) = if leader == "replica-a" { (&a, &b) } else { (&b, &a) };
    f.pause_the_leader_past_the_lease(old, new);
    f.assert_never_two_writers();
    for op in [&mut a, &mut b] {
        assert!(op.terminate(T).unwrap().success(), "{}", op.logs());
    }
}
