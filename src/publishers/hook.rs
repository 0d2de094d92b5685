//! `--on-snapshot`: a command run after each new snapshot, given its id and a file holding
//! it.
//!
//! The command is run directly (no shell), as `CMD ID FILE`, with `SNAPSHOT_ID` and
//! `SNAPSHOT_FILE` in its environment. It must finish within `--on-snapshot-timeout` or it
//! is killed. A non-zero exit, a timeout or a failure to start it fails the publication,
//! which the runtime logs, counts (`publish_failures{publisher="hook"}`) and retries.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::io::AsyncReadExt;
use tokio::process::Command;

use super::metrics::PublisherMetrics;
use super::{PublishError, Publisher};
use consul_resolver_core::assembler::Snapshot;

/// The file the command reads, in the hook's directory.
pub(crate) const FILE_NAME: &str = "snapshot.json";
/// How much of the command's stderr goes into the error message.
const STDERR_TAIL: usize = 2048;

pub(crate) struct HookPublisher {
    command: PathBuf,
    timeout: Duration,
    dir: PathBuf,
    /// The pipeline already publishes one snapshot at a time; this makes "never two
    /// commands at once" hold for this publisher on its own too.
    running: Arc<tokio::sync::Mutex<()>>,
    /// Hash of the last snapshot the command succeeded on: a retry caused by another
    /// publisher does not run it again for the same content.
    last_hash: Arc<Mutex<Option<String>>>,
    /// Runs, failures and durations of the command itself (a publication it skips is none).
    metrics: PublisherMetrics,
}

impl HookPublisher {
    /// `dir` holds the snapshot file; it is created when missing.
    pub(crate) fn new(command: PathBuf, timeout: Duration, dir: PathBuf, metrics: PublisherMetrics) -> Self {
        HookPublisher { command, timeout, dir, running: Arc::default(), last_hash: Arc::default(), metrics }
    }
}

/// Writes the document of `snapshot` to `dir/FILE_NAME` so that a reader sees the old file
/// or the new one, never half of one.
async fn write_atomically(dir: &Path, snapshot: &Snapshot) -> Result<PathBuf, PublishError> {
    use tokio::io::AsyncWriteExt;
    let io = |what: String| move |e: std::io::Error| PublishError::Io(format!("{what}: {e}"));
    tokio::fs::create_dir_all(dir).await.map_err(io(format!("cannot create {}", dir.display())))?;
    let path = dir.join(FILE_NAME);
    let tmp = dir.join(format!(".{FILE_NAME}.tmp"));
    let cannot_write = || io(format!("cannot write {}", tmp.display()));
    // From the document's pieces, through a buffer: never a copy of the whole in memory.
    let file = tokio::fs::File::create(&tmp).await.map_err(cannot_write())?;
    let mut out = tokio::io::BufWriter::with_capacity(256 * 1024, file);
    for chunk in snapshot.chunks() {
        out.write_all(chunk).await.map_err(cannot_write())?;
    }
    out.flush().await.map_err(cannot_write())?;
    drop(out);
    tokio::fs::rename(&tmp, &path).await.map_err(io(format!("cannot rename to {}", path.display())))?;
    Ok(path)
}

/// Runs `command ID FILE` and waits at most `timeout`.
async fn run(command: &Path, id: u64, file: &Path, timeout: Duration) -> Result<(), PublishError> {
    let shown = || command.display().to_string();
    let mut child = Command::new(command)
        .arg(id.to_string())
        .arg(file)
        .env("SNAPSHOT_ID", id.to_string())
        .env("SNAPSHOT_FILE", file)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        // Belt and braces: a child left behind by a dropped future is killed too.
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| PublishError::HookStart { command: shown(), source })?;
    // Read stderr alongside, so a chatty command cannot block on a full pipe.
    let mut stderr = child.stderr.take();
    let reader = tokio::spawn(async move {
        let mut out = Vec::new();
        if let Some(s) = stderr.as_mut() {
            let _ = s.read_to_end(&mut out).await;
        }
        out
    });
    let status = match tokio::time::timeout(timeout, child.wait()).await {
        Ok(Ok(status)) => status,
        Ok(Err(e)) => return Err(PublishError::Io(format!("--on-snapshot {}: waiting for it failed: {e}", shown()))),
        Err(_) => {
            // kill() also reaps it, so nothing outlives the publication.
            let _ = child.kill().await;
            reader.abort();
            return Err(PublishError::HookTimeout { command: shown(), timeout });
        }
    };
    if status.success() {
        reader.abort();
        return Ok(());
    }
    // A grandchild may hold stderr open after the child exits: do not wait for it long.
    let stderr = tokio::time::timeout(Duration::from_millis(100), reader).await.ok().and_then(Result::ok);
    let stderr = stderr.map(|b| String::from_utf8_lossy(&b[b.len().saturating_sub(STDERR_TAIL)..]).trim().to_owned());
    let tail = stderr.filter(|s| !s.is_empty()).map(|t| format!(": {t}")).unwrap_or_default();
    Err(PublishError::HookExit { command: shown(), status, tail })
}

impl Publisher for HookPublisher {
    fn name(&self) -> &'static str {
        "hook"
    }

    fn publish(&self, snapshot: Arc<Snapshot>) -> BoxFuture<'static, Result<(), PublishError>> {
        let (command, timeout, dir) = (self.command.clone(), self.timeout, self.dir.clone());
        let (running, last_hash, metrics) = (self.running.clone(), self.last_hash.clone(), self.metrics.clone());
        async move {
            let _one_at_a_time = running.lock().await;
            if last_hash.lock().expect("last_hash lock").as_deref() == Some(snapshot.hash.as_str()) {
                return Ok(());
            }
            let started = std::time::Instant::now();
            let ran = async {
                let file = write_atomically(&dir, &snapshot).await?;
                run(&command, snapshot.id, &file, timeout).await
            }
            .await;
            metrics.hook_runs.inc();
            metrics.hook_seconds.observe(started.elapsed().as_secs_f64());
            if let Err(e) = &ran {
                metrics.hook_failures.with_label_values(&[e.reason()]).inc();
            }
            ran?;
            *last_hash.lock().expect("last_hash lock") = Some(snapshot.hash.clone());
            Ok(())
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::test_fixtures::content;

    /// Held by each test: a script written by one test while another forks can make
    /// exec fail with ETXTBSY (the fork briefly holds the write descriptor).
    static EXCLUSIVE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> Self {
            let n = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
            let dir = std::env::temp_dir().join(format!("cro-hook-{tag}-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }
        fn script(&self, name: &str, body: &str) -> PathBuf {
            let path = self.0.join(name);
            std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            path
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn snapshot(id: u64, unsynced: &[&str]) -> Arc<Snapshot> {
        let mut content = content(vec![]);
        content.bootstrap.complete = unsynced.is_empty();
        content.bootstrap.unsynced = unsynced.iter().map(|s| s.to_string()).collect();
        Arc::new(content.into_snapshot(id))
    }

    #[tokio::test]
    async fn the_command_gets_the_id_and_a_file_holding_the_snapshot() {
        let _exclusive = EXCLUSIVE.lock().await;
        let tmp = TempDir::new("ok");
        let record = tmp.0.join("record");
        let script = tmp.script(
            "record.sh",
            &format!(
                "{{ echo \"env $SNAPSHOT_ID $SNAPSHOT_FILE\"; echo \"args $1 $2\"; cat \"$SNAPSHOT_FILE\"; }} > {}",
                record.display()
            ),
        );
        let metrics = PublisherMetrics::unregistered();
        let hook = HookPublisher::new(script, Duration::from_secs(10), tmp.0.join("out"), metrics.clone());
        let snap = snapshot(17, &[]);
        hook.publish(snap.clone()).await.unwrap();

        let recorded = std::fs::read_to_string(&record).unwrap();
        let file = tmp.0.join("out").join(FILE_NAME);
        let mut lines = recorded.lines();
        assert_eq!(lines.next().unwrap(), format!("env 17 {}", file.display()));
        assert_eq!(lines.next().unwrap(), format!("args 17 {}", file.display()));
        let body: String = lines.collect::<Vec<_>>().join("\n");
        assert_eq!(Snapshot::parse(body.as_bytes()).unwrap(), *snap, "the file held the snapshot");
        assert!(!tmp.0.join("out").join(format!(".{FILE_NAME}.tmp")).exists(), "no temp file left");

        // Same content again (a retry): not run again.
        std::fs::remove_file(&record).unwrap();
        hook.publish(snapshot(18, &[])).await.unwrap();
        assert!(!record.exists());
        // New content: run.
        hook.publish(snapshot(19, &["shop/consul/web"])).await.unwrap();
        assert!(std::fs::read_to_string(&record).unwrap().starts_with("env 19 "));
        assert_eq!(metrics.hook_runs.get(), 2, "the skipped retry is no run");
        assert_eq!(metrics.hook_seconds.get_sample_count(), 2);
        assert_eq!(metrics.hook_failures.with_label_values(&["hook_exit"]).get(), 0);
    }

    #[tokio::test]
    async fn a_failing_command_is_an_error_with_its_status_and_stderr() {
        let _exclusive = EXCLUSIVE.lock().await;
        let tmp = TempDir::new("fail");
        let script = tmp.script("fail.sh", "echo 'cannot reach the proxy' >&2; exit 3");
        let metrics = PublisherMetrics::unregistered();
        let hook = HookPublisher::new(script, Duration::from_secs(10), tmp.0.join("out"), metrics.clone());
        let err = hook.publish(snapshot(1, &[])).await.unwrap_err().to_string();
        assert!(err.contains("exit status: 3") && err.contains("cannot reach the proxy"), "{err}");
        // Not recorded as done: the retry runs it again.
        assert!(hook.publish(snapshot(2, &[])).await.is_err());
        assert_eq!((metrics.hook_runs.get(), metrics.hook_failures.with_label_values(&["hook_exit"]).get()), (2, 2));
    }

    #[tokio::test]
    async fn a_missing_command_is_an_error() {
        let _exclusive = EXCLUSIVE.lock().await;
        let tmp = TempDir::new("missing");
        let hook = HookPublisher::new(
            tmp.0.join("nope"),
            Duration::from_secs(10),
            tmp.0.join("out"),
            PublisherMetrics::unregistered(),
        );
        let err = hook.publish(snapshot(1, &[])).await.unwrap_err().to_string();
        assert!(err.contains("cannot start"), "{err}");
    }

    #[tokio::test]
    async fn a_command_past_the_timeout_is_killed_and_is_an_error() {
        let _exclusive = EXCLUSIVE.lock().await;
        let tmp = TempDir::new("slow");
        let pid_file = tmp.0.join("pid");
        // `exec` so the pid recorded is the sleeping process itself.
        let script = tmp.script("slow.sh", &format!("echo $$ > {}\nexec sleep 5", pid_file.display()));
        let metrics = PublisherMetrics::unregistered();
        let hook = HookPublisher::new(script, Duration::from_millis(200), tmp.0.join("out"), metrics.clone());
        let started = std::time::Instant::now();
        let err = hook.publish(snapshot(1, &[])).await.unwrap_err().to_string();
        assert_eq!(metrics.hook_failures.with_label_values(&["hook_timeout"]).get(), 1);
        assert!(err.contains("did not finish within 200ms") && err.contains("killed"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(4), "did not wait for the child");
        let pid = std::fs::read_to_string(&pid_file).unwrap();
        assert!(!Path::new(&format!("/proc/{}", pid.trim())).exists(), "child {pid} was killed and reaped");
    }

    #[tokio::test]
    async fn never_two_at_once() {
        let _exclusive = EXCLUSIVE.lock().await;
        let tmp = TempDir::new("serial");
        let log = tmp.0.join("log");
        // Each run appends start/end; overlapping runs would interleave them.
        let script =
            tmp.script("serial.sh", &format!("echo start >> {l}; sleep 0.1; echo end >> {l}", l = log.display()));
        let hook =
            HookPublisher::new(script, Duration::from_secs(10), tmp.0.join("out"), PublisherMetrics::unregistered());
        let (a, b) = tokio::join!(hook.publish(snapshot(1, &[])), hook.publish(snapshot(2, &["x"])));
        a.unwrap();
        b.unwrap();
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "start\nend\nstart\nend\n");
    }
}
