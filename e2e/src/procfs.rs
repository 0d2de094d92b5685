//! What /proc says of a process: whether it still runs, its memory, its CPU time (for the
//! benchmarks: operator-bench, and the ignored benchmark tests).

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, ensure};

pub fn process_exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/status")) {
        Ok(status) => status.lines().any(|l| l.starts_with("State:") && l.contains('Z')),
        Err(_) => true,
    }
}

/// `VmHWM` and `VmRSS` of a process, in KiB.
pub fn memory_kib(pid: u32) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .with_context(|| format!("no {name} in /proc/{pid}/status"))
    };
    Ok((field("VmHWM:")?, field("VmRSS:")?))
}

/// /proc/<pid>/stat, read once: a reader of its field `n` (numbered as in proc(5), from 3
/// on) as a number.
fn stat_fields(pid: u32) -> anyhow::Result<impl Fn(usize) -> anyhow::Result<u64>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command (field 2) is in parentheses and may hold spaces: count from the last `)`.
    let rest = stat.rsplit_once(')').with_context(|| format!("/proc/{pid}/stat: {stat}"))?.1.to_owned();
    Ok(move |n: usize| {
        rest.split_whitespace()
            .nth(n - 3)
            .and_then(|v| v.parse::<u64>().ok())
            .with_context(|| format!("no field {n} in /proc/{pid}/stat: {rest}"))
    })
}

/// The page faults a process took without reading a disk (`minflt`, field 10 of
/// /proc/<pid>/stat): at a cold start, fresh memory touched for the first time.
pub fn minor_faults(pid: u32) -> anyhow::Result<u64> {
    stat_fields(pid)?(10)
}

/// The CPU time (user + system) a process has used so far: utime + stime of
/// /proc/<pid>/stat (fields 14 and 15), in clock ticks.
pub fn cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let field = stat_fields(pid)?;
    let ticks = field(14)? + field(15)?;
    // SAFETY: sysconf only reads a system constant.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    ensure!(per_second > 0, "sysconf(_SC_CLK_TCK) = {per_second}");
    Ok(Duration::from_secs_f64(ticks as f64 / per_second as f64))
}

/// The CPU time each thread of a process has run so far, in nanoseconds (the first field
/// of /proc/<pid>/task/<tid>/schedstat), by thread id: finer than [`cpu_time`]'s clock
/// ticks, so one change's CPU can be read.
pub fn thread_cpu_ns(pid: u32) -> anyhow::Result<BTreeMap<u32, u64>> {
    let mut out = BTreeMap::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let task = task?;
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse::<u32>().ok()) else { continue };
        // A thread may end between the listing and the read: left out.
        let Ok(stat) = std::fs::read_to_string(task.path().join("schedstat")) else { continue };
        if let Some(ns) = stat.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()) {
            out.insert(tid, ns);
        }
    }
    Ok(out)
}

/// The CPU the threads ran between two [`thread_cpu_ns`] reads; `None` when a thread of
/// the first has ended by the second (its time would be lost, not counted).
pub fn thread_cpu_since(before: &BTreeMap<u32, u64>, after: &BTreeMap<u32, u64>) -> Option<Duration> {
    let mut ns = 0u64;
    for (tid, now) in after {
        ns += now.saturating_sub(before.get(tid).copied().unwrap_or(0));
    }
    before.keys().all(|tid| after.contains_key(tid)).then(|| Duration::from_nanos(ns))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Memory touched for the first time is counted: 64 MiB are at least 32 faults, even in
    /// huge pages. CPU time is read from the same file.
    #[test]
    fn fresh_memory_touched_is_counted_as_page_faults() {
        let me = std::process::id();
        let before = minor_faults(me).unwrap();
        let mut fresh = vec![0u8; 64 << 20];
        for page in fresh.chunks_mut(4096) {
            page[0] = 1;
        }
        let after = minor_faults(me).unwrap();
        assert!(std::hint::black_box(&fresh).iter().step_by(4096).all(|&b| b == 1));
        assert!(after >= before + 32, "{before} -> {after} page faults");
        assert!(cpu_time(me).unwrap() > Duration::ZERO);
    }
}
