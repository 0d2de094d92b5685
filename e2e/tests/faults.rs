//! The operator survives the faults of its environment, black box: the API server killed
//! and restarted, a watch whose resourceVersion was compacted away (410 Gone), a slow hook
//! and a slow API server, and the operator itself stopped (SIGTERM) or killed (SIGKILL) in
//! the middle of writing a snapshot split over ConfigMaps.
//!
//! In a binary of its own: it kills and freezes the control plane of its test process. Its
//! tests share that control plane one at a time (`SERIAL`), so that one test's fault is not
//! another's.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use consul_resolver_api::status::condition;
use consul_sim::{Budget, FaultsPatch};
use e2e::consul::{Consul, Instance};
use e2e::fixtures::{mapping_yaml, ports, resolver_yaml};
use e2e::harness::{Cluster, Operator, free_port, http_client, unique, wait_for};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);
const SYSTEM: &str = "consul-resolver-system";

/// One fault at a time on the shared control plane.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A `--on-snapshot` command that keeps every snapshot it is given as `DIR/<id>.json`,
/// and the time it started and ended each run in `DIR/<id>.times`, after sleeping
/// `sleep` (a slow hook).
fn recording_hook(dir: &Path, sleep: &str) -> PathBuf {
    let script = dir.join("hook.sh");
    let out = dir.join("published");
    std::fs::create_dir_all(&out).unwrap();
    let body = format!(
        "#!/bin/sh\nset -e\nout={}\nstart=$(date +%s.%N)\nsleep {sleep}\ncp \"$2\" \"$out/$1.json.tmp\"\nmv \"$out/$1.json.tmp\" \"$out/$1.json\"\necho \"$start $(date +%s.%N)\" > \"$out/$1.times\"\n",
        out.display()
    );
    std::fs::write(&script, body).unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

/// The snapshots the hook was given, by id.
fn published(dir: &Path) -> BTreeMap<u64, Value> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir.join("published")).unwrap() {
        let path = entry.unwrap().path();
        let Some(id) = path.file_name().and_then(|n| n.to_str()?.strip_suffix(".json")?.parse().ok()) else {
            continue;
        };
        out.insert(id, serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap());
    }
    out
}

/// The names of the Mappings of namespace `ns` in a snapshot.
fn mapping_names(snapshot: &Value, ns: &str) -> BTreeSet<String> {
    snapshot["mappings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["namespace"] == ns)
        .filter_map(|m| m["name"].as_str().map(str::to_owned))
        .collect()
}

fn configmap_json(cluster: &Cluster, name: &str) -> Option<Value> {
    let data =
        cluster.kubectl(&["-n", SYSTEM, "get", "configmap", name, "-o", "jsonpath={.data.snapshot\\.json}"]).ok()?;
    serde_json::from_str(&data).ok()
}

/// Waits until the simulator holds exactly one blocking query for `svc`: the operator's.
fn one_blocking_query(sim: &consul_sim::RunningSim, svc: &str) {
    wait_for("the operator's blocking query", T, || (sim.stats().blocking.get(svc).copied() == Some(1)).then_some(()))
        .unwrap();
}

/// etcd's v3 JSON gateway: `POST path` with `body`.
fn etcd(cluster: &Cluster, path: &str, body: Value) -> Value {
    let url = format!("{}{path}", cluster.env_value("ETCD_URL").expect("our own etcd"));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let resp = http_client().post(&url).json(&body).send().await.unwrap();
        assert!(resp.status().is_success(), "{url}: {}", resp.status());
        resp.json().await.unwrap()
    })
}

/// Compacts etcd's history up to its current revision, physically: every watch from an
/// older resourceVersion is gone.
fn compact_etcd(cluster: &Cluster) -> u64 {
    // Any key: the header carries the store's revision.
    let header = &etcd(cluster, "/v3/kv/range", json!({"key": "AA=="}))["header"];
    let revision: u64 = header["revision"].as_str().and_then(|r| r.parse().ok()).expect("a revision");
    etcd(cluster, "/v3/kv/compaction", json!({"revision": revision.to_string(), "physical": true}));
    revision
}

/// Starts the operator on namespace `ns`, publishing to ConfigMap `cm` and to `hook`.
fn start_publishing(cluster: &Cluster, ns: &str, cm: &str, hook: &Path) -> Operator {
    let cm_arg = format!("{SYSTEM}/{cm}");
    let hook = hook.to_str().unwrap();
    let mut op =
        Operator::start(cluster, &["--namespace", ns, "--snapshot-configmap", &cm_arg, "--on-snapshot", hook]).unwrap();
    op.wait_ready(T).unwrap();
    op
}

/// A namespace whose Mapping `m` routes to Consul service `svc` through resolver `consul`.
struct Routed<'a> {
    cluster: &'a Cluster,
    ns: String,
    svc: String,
}

impl<'a> Routed<'a> {
    /// A new namespace, named after `prefix`, for service `svc`; nothing routed yet.
    fn new(cluster: &'a Cluster, prefix: &str, svc: String) -> Self {
        Routed { cluster, ns: cluster.namespace(prefix).unwrap(), svc }
    }

    /// Resolver `consul` for `consul`, and Mapping `m` to the service through it.
    fn route(&self, consul: &Consul) {
        self.cluster.apply(&resolver_yaml(&self.ns, "consul", &consul.address(), "")).unwrap();
        self.cluster.apply(&mapping_yaml(&self.ns, "m", &self.svc, Some("consul"))).unwrap();
    }

    /// The service's ports in `snapshot`.
    fn ports(&self, snapshot: &Value) -> Option<Vec<u64>> {
        ports(snapshot, &self.ns, "consul", &self.svc)
    }

    /// The service's entry in `snapshot` (null without one).
    fn entry(&self, snapshot: &Value) -> Value {
        e2e::fixtures::service(snapshot, &self.ns, "consul", &self.svc).cloned().unwrap_or_default()
    }

    /// Waits `within` for the resolver's `ConsulReachable` to be `status`, its message saying
    /// `says` when given; on a timeout, the condition and the operator's log say why.
    fn wait_reachable(&self, op: &Operator, status: &str, says: Option<&str>, within: Duration) {
        let current = || self.cluster.resolver_condition(&self.ns, "consul", condition::CONSUL_REACHABLE);
        let what = match says {
            Some(says) => format!("ConsulReachable={status} saying {says:?}"),
            None => format!("ConsulReachable={status}"),
        };
        let saying = |c: &Value| says.is_none_or(|says| c["message"].as_str().is_some_and(|m| m.contains(says)));
        wait_for(&what, within, || current().filter(|c| c["status"] == status && saying(c)))
            .unwrap_or_else(|e| panic!("{e}: {:?}\n{}", current(), op.logs()));
    }
}

/// The API server killed (SIGKILL) mid-run; while it is away, Mappings are deleted and
/// created through a stand-in API server the operator does not know, and etcd is compacted,
/// so the operator's watches come back to a resourceVersion that is gone.
#[test]
#[cfg_attr(e2e_external_cluster, ignore = "kills the API server: needs the suite's own control plane")]
fn the_api_server_killed_and_restarted_and_a_compacted_gap_are_survived() {
    let _serial = serial();
    let cluster = Cluster::shared();
    let consul = Consul::shared();
    let ns = cluster.namespace("apikill").unwrap();
    let svc = format!("ak{}", unique());
    let register = |port| consul.register("node-ak", "127.0.0.1", &svc, &format!("{svc}-1"), port, "passing");
    register(25001).unwrap();
    cluster.apply(&resolver_yaml(&ns, "consul", &consul.address(), "")).unwrap();
    let before: BTreeSet<String> = (0..100).map(|i| format!("m-{i}")).collect();
    let all: String = before.iter().map(|m| format!("---\n{}", mapping_yaml(&ns, m, &svc, Some("consul")))).collect();
    cluster.apply(&all).unwrap();

    let dir = tempfile::Builder::new().prefix("cro-apikill-").tempdir().unwrap();
    let cm = format!("apikill-{}", unique());
    let mut op = start_publishing(cluster, &ns, &cm, &recording_hook(dir.path(), "0"));
    op.wait_snapshot("the 100 Mappings", T, |s| mapping_names(s, &ns) == before).unwrap();
    wait_for("the ConfigMap", T, || configmap_json(cluster, &cm).filter(|s| mapping_names(s, &ns) == before)).unwrap();
    let pid = op.pid().unwrap();

    // Killed. The operator keeps serving its last snapshot, and keeps following Consul.
    cluster.kill_apiserver().unwrap();
    let killed = Instant::now();
    let last = op.snapshot().unwrap();
    assert_eq!(mapping_names(&last, &ns), before);
    register(25002).unwrap();
    op.wait_snapshot("a Consul change published while the API server is away", T, |s| {
        ports(s, &ns, "consul", &svc) == Some(vec![25002]) && mapping_names(s, &ns) == before
    })
    .unwrap();
    assert_eq!(op.get("/readyz").map(|r| r.0), Some(200), "still ready");
    assert_eq!(op.get("/healthz").map(|r| r.0), Some(200), "still alive");

    // The gap: through a stand-in API server on another port, 30 Mappings go and 10 come;
    // then etcd forgets the history the operator's watches would resume from.
    let stand_in = free_port();
    cluster.start_apiserver(Some(stand_in)).unwrap();
    let server = format!("https://127.0.0.1:{stand_in}");
    let gone: Vec<String> = (0..30).map(|i| format!("m-{i}")).collect();
    let mut delete = vec!["--server", &server, "-n", &ns, "delete", "mappings.getambassador.io"];
    delete.extend(gone.iter().map(String::as_str));
    cluster.kubectl(&delete).unwrap();
    let new: Vec<String> = (0..10).map(|i| format!("new-{i}")).collect();
    let created: String = new.iter().map(|m| format!("---\n{}", mapping_yaml(&ns, m, &svc, Some("consul")))).collect();
    cluster.kubectl_stdin(&["--server", &server, "apply", "-f", "-"], Some(&created)).unwrap();
    let revision = compact_etcd(cluster);
    cluster.kill_apiserver().unwrap();
    let after: BTreeSet<String> =
        before.iter().filter(|m| !gone.contains(m)).cloned().chain(new.iter().cloned()).collect();
    assert_eq!(mapping_names(&op.snapshot().unwrap(), &ns), before, "nothing seen through the stand-in");

    // Back on its own port: the watches find their resourceVersion gone, list again, and the
    // deletes of the gap reach the snapshot and the ConfigMap.
    cluster.start_apiserver(None).unwrap();
    eprintln!("API server away for {:?}; etcd compacted at revision {revision}", killed.elapsed());
    let back = Instant::now();
    op.wait_snapshot("the world after the gap", T, |s| {
        mapping_names(s, &ns) == after && ports(s, &ns, "consul", &svc) == Some(vec![25002])
    })
    .unwrap();
    eprintln!("the gap's changes published {:?} after the API server came back", back.elapsed());
    wait_for("the ConfigMap after the gap", T, || {
        configmap_json(cluster, &cm).filter(|s| mapping_names(s, &ns) == after)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    let gone_410 = r#"consul_resolver_watch_errors_total{reason="gone",source="kubernetes"}"#;
    assert!(op.metric(gone_410).unwrap_or(0.0) >= 1.0, "the watches met 410 Gone: {:?}", op.get("/metrics"));

    // Never a partly listed world: every publication holds the Mappings before the gap, or
    // after it.
    let snapshots = published(dir.path());
    for (id, s) in &snapshots {
        let names = mapping_names(s, &ns);
        assert!(names == before || names == after, "snapshot {id} holds a partial world: {names:?}");
    }
    eprintln!("{} publications, each the world before or after the gap", snapshots.len());
    assert_eq!(op.pid(), Some(pid), "the same process throughout");
    assert!(op.terminate(T).unwrap().success(), "exits cleanly after all that: {}", op.logs());
}

/// The events the audit log gains, as they come. (Polled every few milliseconds: the
/// log is written before each response, so a test can act between two requests.)
struct AuditTail {
    file: std::fs::File,
    pending: String,
}

impl AuditTail {
    fn from_end(path: &Path) -> Self {
        use std::io::Seek;
        let mut file = std::fs::File::open(path).unwrap();
        file.seek(std::io::SeekFrom::End(0)).unwrap();
        AuditTail { file, pending: String::new() }
    }

    fn next_events(&mut self) -> Vec<Value> {
        use std::io::Read;
        std::thread::sleep(Duration::from_millis(2));
        let mut more = String::new();
        self.file.read_to_string(&mut more).unwrap();
        self.pending.push_str(&more);
        let complete = self.pending.rfind('\n').map_or(0, |i| i + 1);
        let lines: String = self.pending.drain(..complete).collect();
        lines.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
    }
}

/// Resumes the API server when dropped, so a failing test never leaves it frozen for the
/// next one.
struct Frozen<'a>(&'a Cluster);

impl<'a> Frozen<'a> {
    fn freeze(cluster: &'a Cluster) -> Self {
        cluster.signal_apiserver(libc::SIGSTOP).unwrap();
        Frozen(cluster)
    }
}

impl Drop for Frozen<'_> {
    fn drop(&mut self) {
        let _ = self.0.signal_apiserver(libc::SIGCONT);
    }
}

/// A read in a line: which kind, and for a whole snapshot its id and port count (not the
/// 2,500 ports).
fn summary(read: Option<&Read>) -> String {
    match read {
        None => "none".into(),
        Some(Read::Whole { id, ports, .. }) => format!("whole snapshot id {id} with {} ports", ports.len()),
        Some(Read::Raced(why)) => format!("raced: {why}"),
        Some(Read::Absent) => "no ConfigMap".into(),
    }
}

/// What a reader of the snapshot ConfigMaps got.
#[derive(Debug)]
enum Read {
    /// A whole snapshot: its hash, and the ports of the service.
    Whole {
        hash: String,
        id: u64,
        ports: Vec<u64>,
    },
    /// Parts and index of different writes (or a part missing): read again.
    Raced(String),
    Absent,
}

/// Reads the snapshot ConfigMaps straight from the API server, as admin, as fast as it can,
/// and decodes them with the crate's reader (which checks each part's sha256).
struct Reader {
    http: reqwest::Client,
    base: String,
    token: String,
    rt: tokio::runtime::Runtime,
}

impl Reader {
    fn new(cluster: &Cluster) -> Reader {
        let kc: Value = serde_yaml::from_str(&std::fs::read_to_string(&cluster.admin_kubeconfig).unwrap()).unwrap();
        let ca =
            e2e::harness::base64_decode(kc["clusters"][0]["cluster"]["certificate-authority-data"].as_str().unwrap())
                .unwrap();
        let _ = http_client();
        let http = reqwest::Client::builder()
            .tls_certs_only(reqwest::Certificate::from_pem_bundle(&ca).unwrap())
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap();
        Reader {
            http,
            base: kc["clusters"][0]["cluster"]["server"].as_str().unwrap().to_owned(),
            token: kc["users"][0]["user"]["token"].as_str().unwrap().to_owned(),
            rt: tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap(),
        }
    }

    fn get(&self, name: &str) -> Option<Value> {
        let url = format!("{}/api/v1/namespaces/{SYSTEM}/configmaps/{name}", self.base);
        self.rt.block_on(async {
            let resp = self.http.get(&url).bearer_auth(&self.token).send().await.ok()?;
            if !resp.status().is_success() {
                return None;
            }
            resp.json().await.ok()
        })
    }

    /// The names of the ConfigMaps of the operator's namespace that start with `prefix`.
    fn names_starting(&self, prefix: &str) -> Option<Vec<String>> {
        let url = format!("{}/api/v1/namespaces/{SYSTEM}/configmaps", self.base);
        let list: Value = self.rt.block_on(async {
            let resp = self.http.get(&url).bearer_auth(&self.token).send().await.ok()?;
            if !resp.status().is_success() {
                return None;
            }
            resp.json().await.ok()
        })?;
        let items = list["items"].as_array()?;
        let names = items.iter().filter_map(|i| i["metadata"]["name"].as_str());
        Some(names.filter(|n| n.starts_with(prefix)).map(str::to_owned).collect())
    }

    /// One read of the ConfigMap `name` and its parts.
    fn read(&self, name: &str, svc: &str, ns: &str) -> Read {
        use consul_resolver_operator::snapshot_configmap as configmap;
        let Some(main) = self.get(name) else { return Read::Absent };
        let index: Option<Value> = main["data"]["index.json"].as_str().and_then(|t| serde_json::from_str(t).ok());
        let parts: Vec<Value> = index
            .iter()
            .flat_map(|i| i["parts"].as_array().cloned().unwrap_or_default())
            .filter_map(|p| self.get(p["name"].as_str()?))
            .collect();
        let main_cm = serde_json::from_value(main.clone()).unwrap();
        let part_cms: Vec<_> = parts.into_iter().map(|p| serde_json::from_value(p).unwrap()).collect();
        let json = match configmap::decode(&main_cm, &part_cms) {
            Ok(json) => json,
            Err(e) => return Read::Raced(e),
        };
        // Whole means whole: the document's hash is its content's, and the index's.
        let doc = consul_resolver_core::assembler::Snapshot::parse(&json).expect("a decoded snapshot parses");
        assert_eq!(doc.content.hash(), doc.hash, "the decoded document's hash is not its content's: a mix");
        if let Some(index) = &index {
            assert_eq!(index["snapshotHash"], doc.hash.as_str(), "a whole snapshot under another snapshot's index");
        }
        let value: Value = serde_json::from_slice(&json).unwrap();
        Read::Whole { hash: doc.hash, id: doc.id, ports: ports(&value, ns, "consul", svc).unwrap_or_default() }
    }
}

/// Reads the ConfigMaps in a loop on a thread of its own until stopped; every whole read
/// must be one of the states Consul went through, by its ports.
struct Polling {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: std::thread::JoinHandle<(usize, usize)>,
}

impl Polling {
    fn start(
        cluster: &Cluster,
        cm: String,
        svc: String,
        ns: String,
        states: std::sync::Arc<Mutex<Vec<Vec<u64>>>>,
    ) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let reader = Reader::new(cluster);
        let handle = std::thread::spawn(move || {
            let (mut whole, mut raced) = (0, 0);
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                match reader.read(&cm, &svc, &ns) {
                    Read::Whole { ports, hash, id } => {
                        whole += 1;
                        let known = states.lock().unwrap().contains(&ports);
                        assert!(known, "snapshot {id} ({hash}) holds a state Consul never had: {} ports", ports.len());
                    }
                    Read::Raced(why) => {
                        raced += 1;
                        if raced == 1 {
                            eprintln!("a read raced two publications and is told: {why}");
                        }
                    }
                    Read::Absent => {}
                }
            }
            (whole, raced)
        });
        Polling { stop, handle }
    }

    /// Stops it; (whole reads, raced reads). Panics if the reader saw a mix.
    fn finish(self) -> (usize, usize) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.handle.join().expect("the reader saw a mix of two snapshots")
    }
}

/// The names of the parts the index in snapshot ConfigMap `main` names.
fn part_names(main: &Value) -> Vec<String> {
    let index: Value = serde_json::from_str(main["data"]["index.json"].as_str().expect("an index")).unwrap();
    index["parts"].as_array().expect("parts").iter().map(|p| p["name"].as_str().unwrap().to_owned()).collect()
}

/// A service whose snapshot is split over ConfigMaps `cm`, and a reader of those.
struct SplitPublication<'a> {
    cluster: &'a Cluster,
    consul: &'a Consul,
    ns: String,
    svc: String,
    cm: String,
    instances: Vec<Instance>,
    reader: Reader,
    /// The operator's user name, in the audit log.
    user: String,
}

impl<'a> SplitPublication<'a> {
    /// Random hex meta defeats gzip: 2,500 instances with 1 KiB of it make ~3 MiB of JSON,
    /// ~1.4 MiB of gzip, two ConfigMap parts.
    const INSTANCES: usize = 2500;

    /// The instances registered, Mapping `big` routed to them, the operator built.
    fn create(cluster: &'a Cluster, consul: &'a Consul) -> Self {
        let ns = cluster.namespace("split").unwrap();
        let svc = format!("sp{}", unique());
        let hex = |n: usize| (0..n).map(|_| format!("{:02x}", rand::random::<u8>())).collect::<String>();
        let instance = |i: usize, port: u16| Instance {
            node: format!("{svc}-node-{}", i % 20),
            address: "127.0.0.1".into(),
            service: svc.clone(),
            id: format!("{svc}-{i}"),
            port,
            status: "passing".into(),
            tags: vec![],
            meta: BTreeMap::from([("build".into(), hex(256)), ("commit".into(), hex(256))]),
            zone: None,
        };
        let instances: Vec<Instance> = (0..Self::INSTANCES).map(|i| instance(i, 20_000 + i as u16)).collect();
        consul.register_many(&instances, 16).unwrap();
        cluster.apply(&resolver_yaml(&ns, "consul", &consul.address(), "")).unwrap();
        cluster.apply(&mapping_yaml(&ns, "big", &svc, Some("consul"))).unwrap();
        let cm = format!("split-{}", unique());
        e2e::harness::operator_binary().unwrap();
        let reader = Reader::new(cluster);
        let user = cluster.operator_username().unwrap();
        SplitPublication { cluster, consul, ns, svc, cm, instances, reader, user }
    }

    /// The state Consul starts in, by its ports.
    fn first_state(&self) -> Vec<u64> {
        (0..Self::INSTANCES as u64).map(|i| 20_000 + i).collect()
    }

    /// Instance 0 moves to `port`: the state Consul is then in.
    fn move_first(&self, port: u16) -> Vec<u64> {
        self.consul.register_many(&[Instance { port, ..self.instances[0].clone() }], 1).unwrap();
        let mut s: Vec<u64> = self.first_state()[1..].to_vec();
        s.push(u64::from(port));
        s.sort();
        s
    }

    fn start_operator(&self) -> Operator {
        let cm_arg = format!("{SYSTEM}/{}", self.cm);
        let mut op =
            Operator::start(self.cluster, &["--namespace", &self.ns, "--snapshot-configmap", &cm_arg]).unwrap();
        op.wait_ready(T).unwrap();
        op
    }

    fn read(&self) -> Read {
        self.reader.read(&self.cm, &self.svc, &self.ns)
    }

    /// The parts the index names now.
    fn named_parts(&self) -> Vec<String> {
        part_names(&self.reader.get(&self.cm).unwrap())
    }

    /// Waits for the ConfigMaps to hold state `want` whole. On a timeout, what the reader last
    /// got says which side is behind: no ConfigMap, parts of different writes, or a whole
    /// snapshot of another state.
    fn in_configmap(&self, want: &Vec<u64>) -> anyhow::Result<()> {
        let mut last = None;
        wait_for("the state in the ConfigMaps", T, || match self.read() {
            Read::Whole { ports, .. } if &ports == want => Some(()),
            other => {
                last = Some(other);
                None
            }
        })
        .map_err(|e| e.context(format!("the last read: {}", summary(last.as_ref()))))
    }

    /// SIGTERM while the ConfigMap write of state `next` hangs (the API server frozen
    /// meanwhile): the process finishes that write before it exits.
    fn sigterm_while_the_write_hangs(&self, mut op: Operator, next: &Vec<u64>) {
        let frozen = Frozen::freeze(self.cluster);
        op.wait_snapshot("the new state published over HTTP, its ConfigMap write pending", T, |s| {
            ports(s, &self.ns, "consul", &self.svc).as_ref() == Some(next)
        })
        .unwrap();
        op.signal(libc::SIGTERM).unwrap();
        std::thread::sleep(Duration::from_millis(300)); // the fault's own length: let SIGTERM land first
        drop(frozen);
        let status = op.terminate(T).unwrap();
        assert!(status.success(), "{status}\n{}", op.logs());
        assert!(op.logs().contains("shutting down"), "{}", op.logs());
        match self.read() {
            Read::Whole { ports, .. } => {
                assert!(&ports == next, "SIGTERM left the previous snapshot, not the one in flight")
            }
            other => panic!("after SIGTERM the ConfigMaps hold no whole snapshot: {other:?}\n{}", op.logs()),
        }
    }

    /// SIGKILL as soon as the API server has created a part of the next snapshot, before its
    /// index: the audit log (written before each response, blocking mode) says when. Returns
    /// the part's name.
    fn sigkill_on_the_first_part(&self, op: &mut Operator, audit: &mut AuditTail) -> String {
        let part_prefix = format!("{}-", self.cm);
        let deadline = Instant::now() + T;
        let orphan = loop {
            let created = audit.next_events().into_iter().find(|e| {
                e["user"]["username"] == self.user.as_str()
                    && e["verb"] == "create"
                    && e["objectRef"]["name"].as_str().is_some_and(|n| n.starts_with(&part_prefix))
                    && e["responseStatus"]["code"] == 201
            });
            if let Some(created) = created {
                op.signal(libc::SIGKILL).unwrap();
                break created["objectRef"]["name"].as_str().unwrap().to_owned();
            }
            assert!(Instant::now() < deadline, "no part was ever created\n{}", op.logs());
        };
        let status = op.kill().unwrap();
        assert!(!status.success(), "killed: {status}");
        orphan
    }

    /// Waits until every part is named by the index or the one before it, `named_then`;
    /// returns the parts the index names.
    fn wait_every_part_named(&self, op: &Operator, named_then: &[String]) -> Vec<String> {
        let part_prefix = format!("{}-", self.cm);
        let mut last = None;
        wait_for("every part named by the new index or the one before it", T, || {
            let named_now = part_names(&self.reader.get(&self.cm)?);
            let left = self.reader.names_starting(&part_prefix)?;
            let unnamed: Vec<String> =
                left.into_iter().filter(|n| !named_now.contains(n) && !named_then.contains(n)).collect();
            last = Some(unnamed.clone());
            unnamed.is_empty().then_some(named_now)
        })
        .unwrap_or_else(|e| panic!("{e}: parts no index names: {last:?}\n{}", op.logs()))
    }
}

/// SIGTERM and SIGKILL while a snapshot split over ConfigMaps is being written. A reader
/// polling the ConfigMaps all along never assembles a mix of two snapshots (new parts
/// first, under names no index uses, index last, each part checked by its sha256). SIGTERM
/// lets the write finish: the ConfigMaps hold the whole new snapshot when the process is
/// gone. SIGKILL between the new parts and the index leaves the old index naming the old
/// parts, untouched: a reader gets the old snapshot whole. The next process writes the
/// current state whole, and deletes the part the killed one left that no index names.
#[test]
#[cfg_attr(e2e_external_cluster, ignore = "freezes the API server: needs the suite's own control plane")]
fn sigterm_and_sigkill_during_a_split_publication_never_leave_a_mix() {
    let _serial = serial();
    let cluster = Cluster::shared();
    let split = SplitPublication::create(cluster, Consul::shared());
    let state_a = split.first_state();

    let op = split.start_operator();
    split.in_configmap(&state_a).unwrap_or_else(|e| panic!("{e:#}\n{}", op.logs()));
    let main = split.reader.get(&split.cm).unwrap();
    let parts = main["data"]["index.json"].as_str().map(|i| serde_json::from_str::<Value>(i).unwrap()["parts"].clone());
    assert!(parts.as_ref().and_then(Value::as_array).is_some_and(|p| p.len() >= 2), "split over parts: {parts:?}");
    let states = std::sync::Arc::new(Mutex::new(vec![state_a.clone()]));
    let polling = Polling::start(cluster, split.cm.clone(), split.svc.clone(), split.ns.clone(), states.clone());

    let state_b = split.move_first(30_000);
    states.lock().unwrap().push(state_b.clone());
    split.sigterm_while_the_write_hangs(op, &state_b);

    // First the new process publishes what it starts with (its own id: a new first part).
    let before = split.named_parts();
    let mut op = split.start_operator();
    wait_for("the new process's first snapshot", T, || {
        let main = split.reader.get(&split.cm)?;
        (part_names(&main)[0] != before[0]).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    split.in_configmap(&state_b).unwrap();
    let mut audit = AuditTail::from_end(&cluster.audit_log().unwrap());
    let state_c = split.move_first(19_000);
    states.lock().unwrap().push(state_c.clone());
    let orphan = split.sigkill_on_the_first_part(&mut op, &mut audit);
    // A part of the new snapshot is written, the index still names the old one's parts,
    // untouched: a reader gets the old snapshot whole.
    match split.read() {
        Read::Whole { ports, id, .. } => {
            assert!(ports == state_b, "right after SIGKILL the index names snapshot {id}, not the last whole one");
            eprintln!("right after SIGKILL between a part and its index, a reader reads snapshot {id} whole");
        }
        other => panic!("right after SIGKILL between a part and its index: {other:?}"),
    }
    let named_then = split.named_parts();
    assert!(!named_then.contains(&orphan), "the index was not switched");
    assert!(split.reader.get(&orphan).is_some(), "the killed process created part {orphan}");

    // The next process writes the current state whole, and deletes what the killed one
    // left: every part is then named by its index or the one before (state B's, kept for
    // readers still reading it). Parts are named by their content and only the first
    // holds the snapshot id: if the killed process's part was another, the next process
    // writes the same part under the same name, and it is in use, not left over.
    let started = Instant::now();
    let mut op = split.start_operator();
    split.in_configmap(&state_c).unwrap_or_else(|e| panic!("{e:#}\n{}", op.logs()));
    eprintln!("republished whole {:?} after the restart", started.elapsed());
    let named_now = split.wait_every_part_named(&op, &named_then);
    if named_now.contains(&orphan) {
        eprintln!("the killed process's part {orphan} is one of the new snapshot's (the same bytes): in use");
    } else {
        assert!(split.reader.get(&orphan).is_none(), "the killed process's part {orphan} is left");
        eprintln!("the killed process's part {orphan} was deleted");
    }
    let (whole, raced) = polling.finish();
    eprintln!("the polling reader: {whole} whole snapshots, each a state Consul had; {raced} reads raced a write");
    assert!(whole > 0);
    assert!(op.terminate(T).unwrap().success(), "{}", op.logs());
}

/// The operator's resident memory, from /proc.
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")?.trim().strip_suffix("kB")?.trim().parse().ok())
}

/// The peak of a process's resident memory, sampled every 50 ms on a thread of its own.
struct PeakRss {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    peak: std::sync::Arc<std::sync::atomic::AtomicU64>,
    sampler: std::thread::JoinHandle<()>,
}

impl PeakRss {
    fn start(pid: u32, initial: u64) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (peak, flag) = (std::sync::Arc::new(std::sync::atomic::AtomicU64::new(initial)), stop.clone());
        let peak_seen = peak.clone();
        let sampler = std::thread::spawn(move || {
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(rss) = rss_kib(pid) {
                    peak_seen.fetch_max(rss, std::sync::atomic::Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        PeakRss { stop, peak, sampler }
    }

    /// Stops sampling: the peak seen, in KiB.
    fn finish(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.sampler.join().unwrap();
        self.peak.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// When the runs of the recording hook in `dir` on snapshots `ids` started and ended.
fn hook_run_times<'a>(dir: &Path, ids: impl Iterator<Item = &'a u64>) -> Vec<(f64, f64)> {
    ids.filter_map(|id| {
        let t = std::fs::read_to_string(dir.join(format!("published/{id}.times"))).ok()?;
        let mut it = t.split_whitespace().map(|v| v.parse::<f64>().unwrap());
        Some((it.next()?, it.next()?))
    })
    .collect()
}

/// A slow hook (1 s a run) and a slow API server (frozen half of every 800 ms) under a
/// burst of Consul changes: the changes are coalesced (a handful of publications, never two
/// at once), memory stays bounded, and once the burst ends the last publication, to every
/// publisher, is the final state.
#[test]
#[cfg_attr(e2e_external_cluster, ignore = "freezes the API server: needs the suite's own control plane")]
fn a_slow_hook_and_a_slow_api_server_coalesce_changes_and_end_on_the_final_state() {
    let _serial = serial();
    let cluster = Cluster::shared();
    let consul = Consul::shared();
    let routed = Routed::new(cluster, "slow", format!("sl{}", unique()));
    let svc = &routed.svc;
    let register = |port| consul.register("node-sl", "127.0.0.1", svc, &format!("{svc}-1"), port, "passing");
    register(26000).unwrap();
    routed.route(consul);
    let dir = tempfile::Builder::new().prefix("cro-slow-").tempdir().unwrap();
    let cm = format!("slow-{}", unique());
    let mut op = start_publishing(cluster, &routed.ns, &cm, &recording_hook(dir.path(), "1"));
    wait_for("the first snapshot in the ConfigMap", T, || {
        configmap_json(cluster, &cm).filter(|s| routed.ports(s) == Some(vec![26000]))
    })
    .unwrap();
    let pid = op.pid().unwrap();
    let rss_before = rss_kib(pid).unwrap();
    let published_before = published(dir.path()).len();

    // The burst: 100 changes over about 10 s, while the API server is frozen half the time
    // and every hook run takes a second.
    const CHANGES: u16 = 100;
    let peak = PeakRss::start(pid, rss_before);
    let burst = Instant::now();
    for i in 1..=CHANGES {
        let frozen = (i % 8 < 4).then(|| Frozen::freeze(cluster));
        register(26000 + i).unwrap();
        std::thread::sleep(Duration::from_millis(80)); // the burst's own pace
        drop(frozen);
    }
    let final_port = 26000 + CHANGES;
    eprintln!("{CHANGES} changes in {:?}", burst.elapsed());

    // The final state reaches every publisher, the last publication is it.
    let want = Some(vec![u64::from(final_port)]);
    op.wait_snapshot("the final state over HTTP", T, |s| routed.ports(s) == want).unwrap();
    wait_for("the final state in the ConfigMap", T, || {
        configmap_json(cluster, &cm).filter(|s| routed.ports(s) == want)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", op.logs()));
    let last = wait_for("the hook to run on the final state", T, || {
        let all = published(dir.path());
        let (_, last) = all.iter().next_back()?;
        (routed.ports(last) == want).then(|| last.clone())
    })
    .unwrap();
    let peak = peak.finish();
    let settled = burst.elapsed();
    assert_eq!(op.snapshot().unwrap()["hash"], last["hash"], "the last publication is the final state");

    // Coalesced: a handful of publications for a hundred changes, one at a time.
    let all = published(dir.path());
    let runs = all.len() - published_before;
    for pair in hook_run_times(dir.path(), all.keys()).windows(2) {
        assert!(pair[1].0 >= pair[0].1, "two hook runs overlapped: {pair:?}");
    }
    let bound = settled.as_secs() as usize + 2;
    assert!(runs <= bound, "{runs} publications for {CHANGES} changes in {settled:?}: not coalesced");
    eprintln!(
        "{runs} publications (hook runs) for {CHANGES} changes, settled {settled:?} after the burst began; \
         VmRSS {rss_before} KiB before, peak {peak} KiB"
    );
    assert!(peak < rss_before + 64 * 1024, "memory grew by {} KiB", peak - rss_before);
    assert!(op.terminate(T).unwrap().success(), "{}", op.logs());
}

/// A Consul fault: what it is, what the operator's error says of it, and how many requests
/// two seconds of it may see.
struct Fault {
    what: &'static str,
    patch: FaultsPatch,
    says: &'static str,
    most: usize,
}

/// Each way docs/consul-protocol.md names Consul misbehaving, but slowness.
fn consul_faults() -> [Fault; 5] {
    let always = Some(Budget::Always);
    [
        Fault {
            what: "500 No cluster leader",
            patch: FaultsPatch { no_leader: always, ..Default::default() },
            says: "No cluster leader",
            most: 6,
        },
        Fault {
            what: "429 with Retry-After: 2",
            patch: FaultsPatch { too_many_requests: always, retry_after_s: Some(2), ..Default::default() },
            says: "429",
            most: 2,
        },
        Fault {
            what: "429 without Retry-After",
            patch: FaultsPatch { too_many_requests: always, ..Default::default() },
            says: "429",
            most: 6,
        },
        Fault {
            what: "a body that is not JSON",
            patch: FaultsPatch { bad_body: always, ..Default::default() },
            says: "unreadable",
            most: 6,
        },
        Fault {
            what: "a body cut off mid-way",
            patch: FaultsPatch { truncated_body: always, ..Default::default() },
            says: "Consul at",
            most: 6,
        },
    ]
}

/// An operator following a service of the simulator whose one instance moves to another
/// port at each change.
struct UnderFaults<'a> {
    routed: &'a Routed<'a>,
    consul: &'a Consul,
    op: &'a Operator,
    port: u16,
}

impl UnderFaults<'_> {
    fn sim(&self) -> &consul_sim::RunningSim {
        self.consul.sim.as_ref().unwrap()
    }

    /// The instance moves to the next port: the ports Consul then has.
    fn change(&mut self) -> Vec<u64> {
        self.port += 1;
        let svc = &self.routed.svc;
        self.consul.register("node-cf", "127.0.0.1", svc, &format!("{svc}-1"), self.port, "passing").unwrap();
        vec![u64::from(self.port)]
    }

    /// Waits until `want` is published with no error.
    fn wait_published(&self, what: &str, want: &Vec<u64>) {
        self.op
            .wait_snapshot(what, T, |s| {
                self.routed.ports(s).as_ref() == Some(want) && self.routed.entry(s).get("error").is_none()
            })
            .unwrap();
    }

    /// `fault` from one blocking query on: the last endpoints kept, marked stale, the error
    /// published and reported, requests paced; once it ends, the change made during it
    /// published and Consul reachable again.
    fn endure(&mut self, Fault { what, patch, says, most }: Fault) {
        let (routed, sim) = (self.routed, self.sim());
        one_blocking_query(sim, &routed.svc);
        sim.set_faults(patch);
        // Wakes the blocking query sent before the fault: its answer is published.
        let kept = self.change();
        let snap = self
            .op
            .wait_snapshot(&format!("{what}: the error, the last endpoints kept"), T, |s| {
                routed.ports(s).as_ref() == Some(&kept)
                    && routed.entry(s)["error"].as_str().is_some_and(|m| m.contains(says))
            })
            .unwrap();
        let entry = routed.entry(&snap);
        assert!(entry["stale"]["since"].is_string(), "{what}: kept endpoints are marked stale: {entry}");
        routed.wait_reachable(self.op, "False", Some(says), T);
        // Paced: over two seconds of the fault, a handful of requests.
        let sim = self.sim();
        sim.clear_requests();
        std::thread::sleep(Duration::from_secs(2)); // the fault's own length
        let n = sim.requests().iter().filter(|r| r.service.as_deref() == Some(routed.svc.as_str())).count();
        assert!((1..=most).contains(&n), "{what}: {n} requests in 2 s (at most {most})");
        // A change during the fault, then the fault ends: the change is published.
        let want = self.change();
        self.sim().clear_faults();
        let ended = Instant::now();
        self.wait_published(&format!("{what}: the change made during it"), &want);
        eprintln!("{what}: {n} requests in 2 s; the change published {:?} after it ended", ended.elapsed());
        routed.wait_reachable(self.op, "True", Some(""), T);
    }
}

/// Consul misbehaving in each way docs/consul-protocol.md names, one after the other, under
/// a running operator. For each: the last endpoints stay published, marked stale, with the
/// error in the snapshot and `ConsulReachable=False` in the status; requests are paced by
/// the backoff (or the `Retry-After`), not a hot loop; and once the fault ends, the change
/// made during it is published and the resolver is reachable again. Slow answers and a
/// connection dropped mid-block are no failure worth keeping: the next answer is published.
#[test]
#[cfg_attr(e2e_real_consul, ignore = "needs the simulator's fault injection")]
fn consul_faults_keep_the_last_endpoints_are_paced_and_end_on_the_final_state() {
    let _serial = serial();
    let cluster = Cluster::shared();
    let sim = consul_sim::Simulator::start_background(consul_sim::Config::default()).unwrap();
    let consul = Consul { base_url: sim.base_url(), token: None, sim: Some(sim) };
    let routed = Routed::new(cluster, "cfault", format!("cf{}", unique()));
    let svc = &routed.svc;
    consul.register("node-cf", "127.0.0.1", svc, &format!("{svc}-1"), 27000, "passing").unwrap();
    routed.route(&consul);
    let mut op = Operator::start(cluster, &["--namespace", &routed.ns]).unwrap();
    op.wait_ready(T).unwrap();
    op.wait_snapshot("the first answer", T, |s| routed.ports(s) == Some(vec![27000])).unwrap();
    let mut run = UnderFaults { routed: &routed, consul: &consul, op: &op, port: 27000 };
    for fault in consul_faults() {
        run.endure(fault);
    }

    // Slow answers, and a blocking query dropped without an answer: the next answer is
    // published, no error stays.
    run.sim().set_faults(FaultsPatch { latency_ms: Some(1500), ..Default::default() });
    let want = run.change();
    op.wait_snapshot("a slow answer", T, |s| routed.ports(s).as_ref() == Some(&want)).unwrap();
    run.sim().clear_faults();
    one_blocking_query(run.sim(), svc);
    run.sim().drop_blocking();
    let want = run.change();
    run.wait_published("the change after a dropped connection", &want);
    routed.wait_reachable(&op, "True", Some(""), T);
    assert!(op.terminate(T).unwrap().success(), "{}", op.logs());
}

/// Consul's `X-Consul-Index` for service `svc` (a non-blocking read through the HTTP API).
fn consul_index(base_url: &str, svc: &str) -> u64 {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let url = format!("{base_url}/v1/health/service/{svc}");
        let resp = http_client().get(&url).timeout(Duration::from_secs(5)).send().await.unwrap();
        assert!(resp.status().is_success(), "{url}: {}", resp.status());
        let index = resp.headers().get("X-Consul-Index").and_then(|v| v.to_str().ok()?.parse().ok());
        index.unwrap_or_else(|| panic!("{url}: no X-Consul-Index"))
    })
}

/// How soon after Consul's return every service must have converged (docs/consul.md, "When
/// Consul goes away"): the probe notices within 2 s, the watches resume within a second.
const CONVERGENCE: Duration = Duration::from_secs(5);

/// Throughout the first minute since `down`: still ready, still serving `kept`, stale
/// `since` the start.
fn assert_kept_through_the_minute(op: &Operator, routed: &Routed, down: Instant, kept: &[u64], since: &Value) {
    while down.elapsed() < Duration::from_secs(60) {
        let snap = op.snapshot().expect("the operator serves its snapshot");
        assert_eq!(routed.ports(&snap).as_deref(), Some(kept), "{:?} into the outage", down.elapsed());
        assert_eq!(&routed.entry(&snap)["stale"]["since"], since, "{:?} into the outage", down.elapsed());
        assert_eq!(op.get("/readyz").map(|r| r.0), Some(200), "ready {:?} into the outage", down.elapsed());
        std::thread::sleep(Duration::from_secs(1)); // the outage's own length, checked each second
    }
}

/// A fresh simulator on `addr`, once the address is free again: its index starts over.
fn fresh_cluster_at(addr: std::net::SocketAddr) -> consul_sim::RunningSim {
    wait_for("the address to be free again", Duration::from_secs(10), || {
        let config = consul_sim::Config { listen: addr, ..consul_sim::Config::default() };
        consul_sim::Simulator::start_background(config).ok()
    })
    .unwrap()
}

/// Consul gone for a minute (the agent stopped: every connection closed, then refused), then
/// back on the same address as a fresh cluster: other data, and an index far below the one
/// the watch last saw. Through the outage the last endpoints stay published, marked stale,
/// and `ConsulReachable=False` within seconds; the watch waits while one probe a second (then
/// every two) checks for Consul (counted at `consul_resolver_consul_requests_total`), never
/// a loop and never a minute's backoff; and once Consul is back, the new cluster's data is
/// published within 5 s plus one round trip, after which the watch blocks on the new, lower
/// index (a change is published at once, not after a wait for the old index).
#[test]
#[cfg_attr(e2e_real_consul, ignore = "stops and replaces Consul: needs the simulator")]
fn a_minute_without_consul_then_a_fresh_cluster_keeps_the_last_endpoints_probes_and_converges_in_seconds() {
    let _serial = serial();
    let cluster = Cluster::shared();
    // A cluster that has lived a while: its index is in the thousands.
    let first = consul_sim::Config { initial_index: 5000, ..consul_sim::Config::default() };
    let first = consul_sim::Simulator::start_background(first).unwrap();
    let addr = first.addr();
    let mut consul = Consul { base_url: first.base_url(), token: None, sim: Some(first) };
    let routed = Routed::new(cluster, "outage", format!("out{}", unique()));
    let svc = &routed.svc;
    consul.register("node-old", "127.0.0.1", svc, &format!("{svc}-old"), 27500, "passing").unwrap();
    routed.route(&consul);
    let mut op = Operator::start(cluster, &["--namespace", &routed.ns]).unwrap();
    op.wait_ready(T).unwrap();
    op.wait_snapshot("the first answer", T, |s| routed.ports(s) == Some(vec![27500])).unwrap();

    // One round trip while all is well: a change, until it is published.
    let t0 = Instant::now();
    consul.register("node-old", "127.0.0.1", svc, &format!("{svc}-old"), 27501, "passing").unwrap();
    op.wait_snapshot("a change before the outage", T, |s| routed.ports(s) == Some(vec![27501])).unwrap();
    let round_trip = t0.elapsed();
    let old_index = consul_index(&consul.base_url, svc);
    assert!(old_index > 5000, "the first cluster's index: {old_index}");
    one_blocking_query(consul.sim.as_ref().unwrap(), svc);

    // The outage: the agent goes, its connections with it (the blocking query in flight
    // fails at once), and every new connection is refused.
    let requests = || op.metric_sum("consul_resolver_consul_requests_total").expect("the operator's /metrics");
    let before = requests();
    drop(consul.sim.take());
    let down = Instant::now();
    routed.wait_reachable(&op, "False", None, Duration::from_secs(10));
    let noticed = down.elapsed();
    let snap = op
        .wait_snapshot("the error, the last endpoints kept", Duration::from_secs(10), |s| {
            routed.ports(s) == Some(vec![27501]) && routed.entry(s)["error"].is_string()
        })
        .unwrap();
    let since = routed.entry(&snap)["stale"]["since"].clone();
    assert!(since.is_string(), "kept endpoints are marked stale: {}", routed.entry(&snap));
    assert_kept_through_the_minute(&op, &routed, down, &[27501], &since);
    // One probe at once, then after 1 s and every 2 s: about 30 attempts in the minute (the
    // query in flight when Consul went included). At most one a second; at least a probe
    // every two seconds, so the return is noticed; a loop would make thousands.
    let attempts = requests() - before;
    assert!((20.0..=61.0).contains(&attempts), "{attempts} Consul requests in the minute without Consul");

    // Back on the same address, a fresh cluster: its index starts over, and it knows another
    // instance of the service, not the one published.
    consul.sim = Some(fresh_cluster_at(addr));
    consul.register("node-new", "127.0.0.1", svc, &format!("{svc}-new"), 27600, "passing").unwrap();
    let back = Instant::now();
    let new_index = consul_index(&consul.base_url, svc);
    assert!(new_index < old_index, "the new cluster's index {new_index} is below the old {old_index}");
    op.wait_snapshot("the new cluster's data", CONVERGENCE + T, |s| {
        routed.ports(s) == Some(vec![27600]) && routed.entry(s).get("error").is_none()
    })
    .unwrap();
    let converged = back.elapsed();
    let entry = routed.entry(&op.snapshot().unwrap());
    assert!(entry.get("stale").is_none(), "no longer stale: {entry}");
    // Plus one round trip (a publication) on a loaded machine: the one measured above.
    let bound = CONVERGENCE + round_trip;
    assert!(converged <= bound, "converged {converged:?} after Consul came back (at most {bound:?})");
    routed.wait_reachable(&op, "True", None, T);
    eprintln!(
        "ConsulReachable=False {noticed:?} into the outage; {attempts} Consul requests in the minute; \
         the new cluster (index {new_index}, was {old_index}) published {converged:?} after it came back \
         (a round trip before the outage: {round_trip:?})"
    );

    // The watch blocks on the new cluster's index, not the old one: a change is published at
    // once (a query blocking on index {old_index} would hang until its wait ran out).
    one_blocking_query(consul.sim.as_ref().unwrap(), svc);
    let t1 = Instant::now();
    consul.register("node-new", "127.0.0.1", svc, &format!("{svc}-new"), 27601, "passing").unwrap();
    op.wait_snapshot("a change on the new cluster", T, |s| routed.ports(s) == Some(vec![27601])).unwrap();
    assert!(t1.elapsed() < Duration::from_secs(10), "a change on the new cluster took {:?}", t1.elapsed());
    assert!(op.terminate(T).unwrap().success(), "{}", op.logs());
}
