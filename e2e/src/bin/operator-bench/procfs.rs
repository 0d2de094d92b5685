//! What /proc says of a process: whether it still runs, its memory, its CPU time.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, ensure};

pub(crate) fn process_exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/status")) {
        Ok(status) => status.lines().any(|l| l.starts_with("State:") && l.contains('Z')),
        Err(_) => true,
    }
}

/// `VmHWM` and `VmRSS` of a process, in KiB.
pub(crate) fn memory_kib(pid: u32) -> anyhow::Result<(u64, u64)> {
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

/// Numeric fields of /proc/<pid>/stat, from field 3 on (`stat_fields(pid)?[0]` is field 3).
fn stat_fields(pid: u32) -> anyhow::Result<Vec<u64>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command (field 2) is in parentheses and may hold spaces: count from the last `)`.
    let rest = stat.rsplit_once(')').with_context(|| format!("/proc/{pid}/stat: {stat}"))?.1;
    // Field 3, the state, is a letter: 0 keeps the positions.
    Ok(rest.split_whitespace().map(|v| v.parse::<u64>().unwrap_or(0)).collect())
}

/// The page faults a process took without reading a disk (`minflt`, field 10 of
/// /proc/<pid>/stat): at a cold start, fresh memory touched for the first time.
pub(crate) fn minor_faults(pid: u32) -> anyhow::Result<u64> {
    stat_fields(pid)?.get(7).copied().with_context(|| format!("no minflt in /proc/{pid}/stat"))
}

/// The CPU time (user + system) a process has used so far: utime + stime of
/// /proc/<pid>/stat, in clock ticks.
pub(crate) fn cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let fields = stat_fields(pid)?;
    // utime (14) and stime (15) are the 12th and 13th from field 3.
    let ticks = |i: usize| fields.get(i).copied().with_context(|| format!("no field {} in /proc/{pid}/stat", i + 3));
    let ticks = ticks(11)? + ticks(12)?;
    // SAFETY: sysconf only reads a system constant.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    ensure!(per_second > 0, "sysconf(_SC_CLK_TCK) = {per_second}");
    Ok(Duration::from_secs_f64(ticks as f64 / per_second as f64))
}

/// The CPU time each thread of a process has run so far, in nanoseconds (the first field
/// of /proc/<pid>/task/<tid>/schedstat), by thread id: finer than [`cpu_time`]'s clock
/// ticks, so one change's CPU can be read.
pub(crate) fn thread_cpu_ns(pid: u32) -> anyhow::Result<BTreeMap<u32, u64>> {
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
pub(crate) fn thread_cpu_since(before: &BTreeMap<u32, u64>, after: &BTreeMap<u32, u64>) -> Option<Duration> {
    let mut ns = 0u64;
    for (tid, now) in after {
        ns += now.saturating_sub(before.get(tid).copied().unwrap_or(0));
    }
    before.keys().all(|tid| after.contains_key(tid)).then(|| Duration::from_nanos(ns))
}
