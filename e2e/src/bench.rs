//! What the benchmark binaries share (consul-bench, operator-bench, sim-bench).

/// A `BENCH_*` knob: its value, or `default` when unset or not a number.
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The load average over 1, 5 and 15 minutes, as `/proc/loadavg` gives it (for the record
/// each run prints).
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The `p` quantile (0 to 1, nearest rank) of `sorted`, which must not be empty.
pub fn percentile<T: Copy>(sorted: &[T], p: f64) -> T {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// The CPUs this process may run on.
pub fn allowed_cpus() -> std::io::Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is an empty set; sched_getaffinity writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: CPU_ISSET reads the set filled above, for indices within its size.
    Ok((0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect())
}

/// Puts every thread of process `pid` on `cpus`. Threads it starts later inherit that (a
/// thread starts with its creator's affinity), so a Go runtime's later threads follow too.
/// A thread started during a pass by one not yet moved is caught by the next: passes repeat
/// until one finds no thread it had not seen. Returns how many threads were moved; a thread
/// that ended meanwhile is skipped.
pub fn pin(pid: u32, cpus: &[usize]) -> std::io::Result<usize> {
    // SAFETY: as above: an empty set, then CPU_SET for indices below CPU_SETSIZE.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut moved = 0;
    loop {
        let mut new = 0;
        for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
            let Some(tid) = task?.file_name().to_str().and_then(|t| t.parse::<libc::pid_t>().ok()) else { continue };
            if !seen.insert(tid) {
                continue;
            }
            new += 1;
            // SAFETY: sched_setaffinity reads the set, of the size given, for one of pid's threads.
            if unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) } == 0 {
                moved += 1;
            } else {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::ESRCH) {
                    return Err(e);
                }
            }
        }
        if new == 0 {
            return Ok(moved);
        }
    }
}
