//! A network namespace a test creates and deletes, for running node-level networking
//! (kube-proxy in iptables mode) without touching the host's network: its iptables rules,
//! conntrack table, routes, addresses and per-namespace sysctls all live and die with the
//! namespace.
//!
//! - [`NetNs::create`]: `ip netns add` under a unique name (`cro-e2e-PID-N`), `lo` up, and
//!   one interface, [`NetNs::IFACE`], that holds test addresses ([`NetNs::add_address`]) and
//!   carries routes ([`NetNs::add_route`]). Deleted (`ip netns del`) on drop.
//! - [`NetNs::spawn`]: a process inside it (`ip netns exec NAME ...`), killed by pid on drop.
//! - [`NetNs::bind_tcp`]: a listener created inside it from this process (`setns(2)` in a
//!   dedicated thread); [`NetNs::forward`]: a TCP forwarder from a port on the namespace's
//!   127.0.0.1 to a host address, such as the API server that listens on the host's loopback.
//!
//! Needs root (`CAP_SYS_ADMIN` for `ip netns add` and `setns`, `CAP_NET_ADMIN` for links,
//! addresses and iptables) and `ip` (iproute2).

use std::fs::File;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, bail};

/// The prefix of every namespace this module creates; the pid of the creating process
/// follows it, so a namespace left behind by a killed test run can be told apart.
const PREFIX: &str = "cro-e2e-";

/// A network namespace of this process, deleted on drop.
pub struct NetNs {
    name: String,
}

impl NetNs {
    /// The interface that holds the test's addresses and routes.
    pub const IFACE: &'static str = "cro0";

    /// Creates a namespace with `lo` up and [`NetNs::IFACE`] up. Namespaces of earlier runs
    /// of this module whose process is gone (killed before their drop ran) are deleted first.
    ///
    /// [`NetNs::IFACE`] is a `dummy` interface where the kernel has that driver, else a
    /// bridge without ports (kernels without the `dummy` module, such as this repository's
    /// CI VMs): either one holds addresses and accepts routes, and never delivers a packet
    /// anywhere. ARP is off on it, so a packet routed to it that no iptables rule rewrites
    /// simply vanishes (a client times out) instead of failing fast with "no route to host"
    /// once a neighbour entry fails: a fast failure is then always an iptables REJECT.
    pub fn create() -> anyhow::Result<NetNs> {
        remove_stale();
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!("{PREFIX}{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        ip(&["netns", "add", &name])?;
        // From here on, drop deletes it, also when a step below fails.
        let ns = NetNs { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        if let Err(dummy) = ns.ip(&["link", "add", Self::IFACE, "type", "dummy"]) {
            ns.ip(&["link", "add", Self::IFACE, "type", "bridge"])
                .with_context(|| format!("neither a dummy interface ({dummy:#}) nor a bridge"))?;
        }
        ns.ip(&["link", "set", Self::IFACE, "arp", "off"])?;
        ns.ip(&["link", "set", Self::IFACE, "up"])?;
        Ok(ns)
    }

    /// The namespace's name (`ip netns exec NAME`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace's file, for `setns(2)`.
    pub fn path(&self) -> PathBuf {
        Path::new("/var/run/netns").join(&self.name)
    }

    /// `ip ARGS` inside the namespace; an error with ip's stderr when it fails.
    pub fn ip(&self, args: &[&str]) -> anyhow::Result<()> {
        let mut all = vec!["-n", &self.name];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// Adds `cidr` (`10.96.99.10/32`) to [`NetNs::IFACE`]: an address local to the namespace.
    pub fn add_address(&self, cidr: &str) -> anyhow::Result<()> {
        self.ip(&["addr", "add", cidr, "dev", Self::IFACE])
    }

    /// Routes `cidr` to [`NetNs::IFACE`]. A connection to a Service's ClusterIP needs a route
    /// before iptables sees its first packet (without one, `connect` fails with "network
    /// unreachable" and the nat table's OUTPUT chain never runs); on a node the default
    /// route plays this part.
    pub fn add_route(&self, cidr: &str) -> anyhow::Result<()> {
        self.ip(&["route", "add", cidr, "dev", Self::IFACE])
    }

    /// A command that runs `program` inside the namespace (`ip netns exec NAME program`; ip
    /// execs it, so the child's pid is the program's).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).arg(program);
        cmd
    }

    /// Runs `program args` inside the namespace to completion.
    pub fn output(&self, program: &str, args: &[&str]) -> anyhow::Result<Output> {
        self.command(program)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {program} in network namespace {}", self.name))
    }

    /// Starts `cmd` (from [`NetNs::command`]) with stdin closed and stdout and stderr
    /// appended to `log`. The returned [`NsChild`] kills it on drop; it also gets SIGKILL
    /// when the calling thread ends (`PR_SET_PDEATHSIG`), so a test that is itself killed
    /// leaves no process running in a namespace nobody will delete.
    pub fn spawn(&self, mut cmd: Command, what: &str, log: &Path) -> anyhow::Result<NsChild> {
        let out = File::options().create(true).append(true).open(log).with_context(|| format!("{}", log.display()))?;
        cmd.stdin(Stdio::null()).stdout(out.try_clone()?).stderr(out);
        // SAFETY: prctl(2) is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().with_context(|| format!("starting {what} in network namespace {}", self.name))?;
        Ok(NsChild { child: Some(child), what: what.to_owned(), log: log.to_owned() })
    }

    /// A TCP listener bound to `addr` inside the namespace. Sockets keep the namespace they
    /// were created in, so the listener serves the namespace while this process's threads
    /// stay in the host's.
    pub fn bind_tcp(&self, addr: SocketAddr) -> anyhow::Result<TcpListener> {
        in_netns(&self.path(), || TcpListener::bind(addr))
            .with_context(|| format!("binding {addr} in network namespace {}", self.name))
    }

    /// Forwards TCP connections to 127.0.0.1:PORT inside the namespace (PORT is
    /// [`Forwarder::port`], chosen by the kernel) to `upstream`, reached from the host's
    /// namespace. All traffic stays on loopback: the namespace's and the host's.
    pub fn forward(&self, upstream: SocketAddr) -> anyhow::Result<Forwarder> {
        let listener = Arc::new(self.bind_tcp(SocketAddr::from(([127, 0, 0, 1], 0)))?);
        let port = listener.local_addr()?.port();
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let thread = {
            let (listener, stop, conns) = (listener.clone(), stop.clone(), conns.clone());
            // Created here, in the host's namespace, and never moved: its connects reach the host.
            std::thread::Builder::new()
                .name(format!("netns-forward-{port}"))
                .spawn(move || accept_loop(&listener, upstream, &stop, &conns))?
        };
        Ok(Forwarder { port, listener, stop, conns, thread: Some(thread) })
    }
}

impl Drop for NetNs {
    /// Deletes the namespace: its interfaces, addresses, routes, iptables rules and
    /// conntrack entries go with it once no process is left in it (kill those first: the
    /// [`NsChild`]ren of a test are dropped before the namespace they were declared after).
    fn drop(&mut self) {
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("deleting network namespace {}: {e:#}", self.name);
        }
    }
}

/// `ip ARGS`; an error with ip's stderr when it fails.
fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip").args(args).stdin(Stdio::null()).output().context("running ip (iproute2)")?;
    if !out.status.success() {
        bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// Deletes the namespaces of this module whose creating process is gone: a test killed
/// before its drop ran leaves its namespace behind (its processes died with it, see
/// [`NetNs::spawn`]). A namespace whose pid is alive is left alone, whoever has that pid.
fn remove_stale() {
    let Ok(entries) = std::fs::read_dir("/var/run/netns") else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(PREFIX).and_then(|rest| rest.split('-').next()) else { continue };
        if pid.parse::<u32>().is_ok() && !Path::new("/proc").join(pid).exists() {
            let _ = ip(&["netns", "del", &name]);
        }
    }
}

/// Runs `f` with the calling thread's network namespace set to `ns_path`, in a dedicated
/// thread: namespaces are per thread, so no other thread of the test process (the test
/// harness, tokio, the forwarders) ever leaves the host's namespace. The thread returns to
/// its original namespace before it ends (checked), so nothing it might leave behind, such
/// as thread-local state of a library, would believe it is still on the host.
fn in_netns<T: Send>(ns_path: &Path, f: impl FnOnce() -> io::Result<T> + Send) -> anyhow::Result<T> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| -> anyhow::Result<T> {
                // This thread's namespace, opened before leaving it.
                let own_path = "/proc/thread-self/ns/net";
                let own = File::open(own_path).context(own_path)?;
                let target = File::open(ns_path).with_context(|| format!("{}", ns_path.display()))?;
                setns(&target).with_context(|| format!("setns into {}", ns_path.display()))?;
                let result = f();
                // A thread that cannot return must not go on to do anything else: it ends here
                // either way, and the error says so.
                setns(&own).context("setns back into the original network namespace")?;
                let back = std::fs::metadata(own_path)?.ino();
                if back != own.metadata()?.ino() {
                    bail!("setns back did not restore the original network namespace");
                }
                Ok(result?)
            })
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the setns thread panicked")))
    })
}

fn setns(ns: &File) -> io::Result<()> {
    // SAFETY: setns(2) on an open namespace file; it changes only the calling thread.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A TCP forwarder from 127.0.0.1:[`Forwarder::port`] inside a namespace to a host address.
/// Stopped on drop: the listener is shut down and every open connection cut.
pub struct Forwarder {
    port: u16,
    listener: Arc<TcpListener>,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    thread: Option<JoinHandle<()>>,
}

impl Forwarder {
    /// The port on the namespace's 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // On Linux, shutdown(2) of a listening socket wakes a thread blocked in accept(2)
        // (EINVAL); the loop then sees `stop`. The Arc keeps the fd open until then.
        // SAFETY: shutdown(2) on a socket this struct keeps open.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Both directions of each connection end, so their copying threads end too.
        for c in self.conns.lock().map(|mut c| std::mem::take(&mut *c)).unwrap_or_default() {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

fn accept_loop(listener: &TcpListener, upstream: SocketAddr, stop: &AtomicBool, conns: &Mutex<Vec<TcpStream>>) {
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok((down, _)) = accepted else {
            // EMFILE and the like: try again shortly rather than spin.
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        // A connection the upstream refuses is closed at once: the client sees the same
        // failure as when the upstream (a stopped API server) is not there.
        let Ok(up) = TcpStream::connect_timeout(&upstream, Duration::from_secs(5)) else { continue };
        let _ = (down.set_nodelay(true), up.set_nodelay(true));
        if let Ok(mut list) = conns.lock() {
            // Forget connections that have fully closed (no peer any more), then track these two.
            list.retain(|c| c.peer_addr().is_ok());
            list.extend([down.try_clone(), up.try_clone()].into_iter().flatten());
        }
        copy_thread(&down, &up);
        copy_thread(&up, &down);
    }
}

/// Copies `from` to `to` in a thread until `from` ends, then ends `to`'s sending half (so
/// each side sees the other's close, as with a direct connection).
fn copy_thread(from: &TcpStream, to: &TcpStream) {
    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else { return };
    std::thread::spawn(move || {
        let _ = io::copy(&mut from, &mut to);
        let _ = to.shutdown(Shutdown::Write);
    });
}

/// A process running inside a [`NetNs`], killed (SIGKILL, by pid) and reaped on drop.
pub struct NsChild {
    child: Option<Child>,
    what: String,
    log: PathBuf,
}

impl NsChild {
    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Its log so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// An error with its log when it has exited.
    pub fn check_running(&mut self) -> anyhow::Result<()> {
        let child = self.child.as_mut().with_context(|| format!("{} was stopped", self.what))?;
        if let Some(status) = child.try_wait()? {
            bail!("{} exited ({status})\n--- {} ---\n{}", self.what, self.log.display(), self.logs());
        }
        Ok(())
    }

    /// Kills it (SIGKILL) and reaps it.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill().with_context(|| format!("killing {} (pid {})", self.what, child.id()))?;
            child.wait()?;
        }
        Ok(())
    }
}

impl Drop for NsChild {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}
