//! The pure timing and index rules of a watch (docs/consul-protocol.md, "What every client
//! does"), kept free of I/O so they are unit tested directly.

use std::time::Duration;

use rand::Rng;

/// The blocking-query index of one watch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct IndexState {
    /// `None` until the first answer, and again after a reset: the next query answers at once.
    index: Option<u64>,
    /// The last answer had no `X-Consul-Index` (something between us and Consul strips
    /// it): nothing can block until an answer has one again.
    unindexed: bool,
}

impl IndexState {
    /// The `(index, wait)` of the next query, or `None` for a non-blocking read. Never
    /// blocks on an index below 1.
    pub(crate) fn block(&self, wait: Duration) -> Option<(u64, Duration)> {
        self.index.map(|i| (i.max(1), wait))
    }

    #[cfg(test)]
    pub(crate) fn index(&self) -> Option<u64> {
        self.index
    }

    /// Forgets the index after a failed request: the server may have been replaced by one
    /// with a lower index, on which a blocking query would wait the full `wait`.
    pub(crate) fn reset(&mut self) {
        self.index = None;
    }

    /// Records an answer to a query that sent `sent` (`None`: non-blocking), carrying
    /// `returned` (`None`: no `X-Consul-Index`, so the next query cannot block). An index
    /// lower than the one sent means the server's history restarted (snapshot restore, new
    /// cluster): forget ours so the next query re-reads at once instead of blocking on an
    /// index the server may never reach again.
    pub(crate) fn observe(&mut self, sent: Option<u64>, returned: Option<u64>) {
        self.unindexed = returned.is_none();
        match returned {
            Some(r) if sent.is_none_or(|s| r >= s) => self.index = Some(r.max(1)),
            _ => self.index = None,
        }
    }

    /// The last answer had no index: a query cannot block, so it must not be sent as one
    /// (it would answer at once, in a loop paced only by the minimum interval).
    pub(crate) fn cannot_block(&self) -> bool {
        self.unindexed
    }
}

/// Exponential backoff with jitter: 250 ms doubling to a cap of 1 min, reset by a success
/// (consul-template's values).
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    base: Duration,
    cap: Duration,
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::new(Duration::from_millis(250), Duration::from_secs(60))
    }
}

impl Backoff {
    pub(crate) fn new(base: Duration, cap: Duration) -> Self {
        Backoff { base, cap, next: base }
    }

    /// The delay after one more failure: the current step with up to 25% shaved off at
    /// random, so watches failing together do not retry in lockstep.
    pub(crate) fn failure(&mut self, rng: &mut impl Rng) -> Duration {
        let step = self.next;
        self.next = (self.next * 2).min(self.cap);
        let shave = rng.random_range(0.0..0.25);
        step.mul_f64(1.0 - shave)
    }

    pub(crate) fn reset(&mut self) {
        self.next = self.base;
    }
}

/// The least time between two queries of one watch: `min` plus up to half of it at random.
pub(crate) fn pace(min: Duration, rng: &mut impl Rng) -> Duration {
    min + min.mul_f64(rng.random_range(0.0..0.5))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_query_does_not_block() {
        let s = IndexState::default();
        assert_eq!(s.block(Duration::from_secs(5)), None);
    }

    #[test]
    fn index_follows_answers_and_never_goes_below_one() {
        let mut s = IndexState::default();
        s.observe(None, Some(0));
        assert_eq!(s.block(Duration::from_secs(5)), Some((1, Duration::from_secs(5))));
        s.observe(Some(1), Some(10));
        assert_eq!(s.index(), Some(10));
        s.observe(Some(10), Some(10)); // timeout: same index
        assert_eq!(s.index(), Some(10));
    }

    #[test]
    fn index_going_backwards_resets() {
        let mut s = IndexState::default();
        s.observe(None, Some(100));
        s.observe(Some(100), Some(7));
        assert_eq!(s.block(Duration::from_secs(1)), None, "re-read without blocking");
        s.observe(None, Some(7));
        assert_eq!(s.index(), Some(7));
        // A non-blocking read reporting a lower index is simply the current one.
        s.observe(None, Some(3));
        assert_eq!(s.index(), Some(3));
    }

    #[test]
    fn a_failure_forgets_the_index() {
        let mut s = IndexState::default();
        s.observe(None, Some(100));
        s.reset();
        assert_eq!(s.block(Duration::from_secs(1)), None, "the next query does not block");
    }

    #[test]
    fn an_answer_without_an_index_cannot_be_blocked_on_until_one_has_one() {
        let mut s = IndexState::default();
        s.observe(None, Some(100));
        assert!(!s.cannot_block());
        s.observe(Some(100), None);
        assert!(s.cannot_block());
        assert_eq!(s.block(Duration::from_secs(1)), None, "no index to block on");
        s.observe(None, Some(120));
        assert!(!s.cannot_block());
        assert_eq!(s.block(Duration::from_secs(1)), Some((120, Duration::from_secs(1))));
    }

    #[test]
    fn backoff_doubles_caps_and_resets() {
        let mut rng = rand::rng();
        let mut b = Backoff::default();
        let mut steps = Vec::new();
        for _ in 0..12 {
            steps.push(b.failure(&mut rng));
        }
        let ms = |d: Duration| d.as_millis() as u64;
        assert!((187..=250).contains(&ms(steps[0])), "{steps:?}");
        assert!((375..=500).contains(&ms(steps[1])), "{steps:?}");
        assert!((750..=1000).contains(&ms(steps[2])), "{steps:?}");
        assert!(steps.iter().all(|d| *d <= Duration::from_secs(60)));
        assert!(ms(steps[11]) >= 45_000, "capped near 1 min: {steps:?}");
        b.reset();
        assert!(b.failure(&mut rng) <= Duration::from_millis(250));
    }

    #[test]
    fn pacing_is_at_least_the_minimum() {
        let mut rng = rand::rng();
        for _ in 0..100 {
            let d = pace(Duration::from_millis(100), &mut rng);
            assert!(d >= Duration::from_millis(100) && d < Duration::from_millis(150), "{d:?}");
        }
    }
}
