//! How long a catalog move waits for the change feed's checks view before it is judged
//! (docs/consul.md, "Services without a blocking query of their own").
//!
//! A registration writes the catalog and its check at one raft index, and the feed's
//! queries of every check and of the catalog race to report it. The checks answer is every
//! check of the group: a few kilobytes at a thousand services, tens of megabytes at 75,000
//! instances, where it arrives hundreds of milliseconds after the catalog's 70 KB answer. A fixed wait shorter
//! than that judged nearly every move "not accounted for" at that size and re-read every
//! fed service (thousands of requests for one port change). So the wait follows how far
//! the checks view has been seen to run behind: the time a checks request takes when it
//! does not block, and the lag of each move the checks view accounted for, in time or late.
//! Bounded both ways: never shorter than a loopback round trip needs, never so long that a
//! move the checks cannot explain (a check-less registration, an agent that does not
//! rewrite unchanged checks) waits seconds before everyone re-reads.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

/// The shortest wait: what a small catalog's checks answer needs, with room.
pub(crate) const MIN_WAIT: Duration = Duration::from_millis(250);
/// The longest wait: past it, re-reading everything is the cheaper way to be fresh.
pub(crate) const MAX_WAIT: Duration = Duration::from_secs(3);

/// How many moves judged early wait to teach their lag.
const MAX_LATE: usize = 64;

/// The checks view's lag behind the catalog, as seen.
#[derive(Debug, Default)]
pub(crate) struct CatchUp {
    /// The largest lag seen, decaying by an eighth per observation so one slow answer is
    /// forgotten after a few quick ones.
    worst: Duration,
    /// Moves judged before the checks caught up: `upto -> (after, judged at)`. When the
    /// checks view later accounts for one, its lag is learnt.
    late: BTreeMap<u64, (u64, Instant)>,
}

impl CatchUp {
    /// How long a move waits now: twice the worst lag and a little. A load spike on a
    /// shared machine stretched a 400 ms lag past one and a half times it in the scale
    /// benchmark, and each such miss re-read every fed service (more load).
    pub(crate) fn wait(&self) -> Duration {
        (self.worst * 2 + Duration::from_millis(100)).clamp(MIN_WAIT, MAX_WAIT)
    }

    /// A lag seen: a checks request's time when it did not block (the answer's cost
    /// alone), or how long after the catalog answer the checks view covered a move.
    pub(crate) fn observe(&mut self, lag: Duration) {
        self.worst = lag.max(self.worst - self.worst / 8);
    }

    /// A move over `(after, upto]` judged at `at` without the checks view's answer. Only
    /// the latest few are kept: the checks query answers at least every `wait`, which
    /// forgets the old ones anyway, but catalog moves may come ten a second until then.
    pub(crate) fn judged_early(&mut self, after: u64, upto: u64, at: Instant) {
        self.late.insert(upto, (after, at));
        while self.late.len() > MAX_LATE {
            self.late.pop_first();
        }
    }

    /// The checks view has a new answer: learns the lag of every move judged early that it
    /// now accounts for (`accounts_for(after, upto)`). A move it never accounts for (not a
    /// check write) is forgotten once older than the longest wait.
    pub(crate) fn checks_answered(&mut self, now: Instant, accounts_for: impl Fn(u64, u64) -> bool) {
        let mut learnt = Vec::new();
        self.late.retain(|&upto, &mut (after, at)| {
            if accounts_for(after, upto) {
                learnt.push(now - at);
                false
            } else {
                now - at <= MAX_WAIT
            }
        });
        for lag in learnt {
            self.observe(lag);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_wait_follows_the_lag_within_bounds() {
        let mut c = CatchUp::default();
        assert_eq!(c.wait(), MIN_WAIT, "nothing seen: the shortest wait");
        c.observe(3 * MS);
        assert_eq!(c.wait(), MIN_WAIT, "a small catalog's answer");
        c.observe(700 * MS);
        assert_eq!(c.wait(), 1500 * MS, "twice the lag, and a little");
        c.observe(10 * 1000 * MS);
        assert_eq!(c.wait(), MAX_WAIT);
        let mut c = CatchUp::default();
        c.observe(800 * MS);
        for _ in 0..40 {
            c.observe(2 * MS);
        }
        assert_eq!(c.wait(), MIN_WAIT, "quick answers forget a slow one");
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_accounting_teaches_the_lag() {
        let mut c = CatchUp::default();
        let t0 = Instant::now();
        c.judged_early(10, 11, t0);
        c.judged_early(11, 12, t0);
        tokio::time::advance(600 * MS).await;
        // Index 11 was a check write; 12 was not (a catalog-only write).
        c.checks_answered(Instant::now(), |after, upto| (after, upto) == (10, 11));
        assert_eq!(c.wait(), 1300 * MS);
        assert_eq!(c.late.keys().copied().collect::<Vec<_>>(), [12], "12 waits for an accounting");
        tokio::time::advance(MAX_WAIT).await;
        c.checks_answered(Instant::now(), |_, _| false);
        assert!(c.late.is_empty(), "never accounted for: forgotten, teaching nothing");
        // An unrelated write much later never inflates the lag with a stale move.
        c.checks_answered(Instant::now(), |_, _| true);
        assert_eq!(c.wait(), 1300 * MS);
        for i in 0..1000 {
            c.judged_early(100 + i, 101 + i, Instant::now());
        }
        assert_eq!(c.late.len(), MAX_LATE, "bounded");
        assert_eq!(c.late.keys().next(), Some(&(1101 - MAX_LATE as u64)), "the latest kept");
    }
}
