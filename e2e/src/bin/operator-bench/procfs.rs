//! What /proc says of a process: whether it still runs, its memory, its CPU time.

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

/// The CPU time (user + system) a process has used so far: utime + stime of
/// /proc/<pid>/stat, in clock ticks.
pub(crate) fn cpu_time(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command (field 2) is in parentheses and may hold spaces: count from the last `)`.
    // What follows starts at field 3, so utime (14) and stime (15) are its 12th and 13th.
    let rest = stat.rsplit_once(')').with_context(|| format!("/proc/{pid}/stat: {stat}"))?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields.get(i).and_then(|v| v.parse::<u64>().ok()).with_context(|| format!("/proc/{pid}/stat: {stat}"))
    };
    let ticks = ticks(11)? + ticks(12)?;
    // SAFETY: sysconf only reads a system constant.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    ensure!(per_second > 0, "sysconf(_SC_CLK_TCK) = {per_second}");
    Ok(Duration::from_secs_f64(ticks as f64 / per_second as f64))
}
