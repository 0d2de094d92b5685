//! The limiter: when to publish.
//!
//! The first change after a quiet window goes out at once (leading edge); changes inside
//! the window are merged into one trailing publication at the window's end. Publications
//! never overlap: changes during a slow publication pile up into exactly one follow-up,
//! which starts as soon as the slow one finishes if the window has already passed. The
//! limiter holds no state of the world, only "something changed": whatever is current
//! when a publication starts is what goes out, so the latest state always wins and the
//! last publication always equals the final state.

use std::time::Duration;

use tokio::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Start a publication now, then call [`Limiter::finished`].
    Publish,
    /// Ask again at this instant (or sooner if something changes).
    WaitUntil(Instant),
    /// Nothing to do until something changes or the publication in flight finishes.
    Idle,
}

#[derive(Debug, Clone)]
pub struct Limiter {
    window: Duration,
    last_start: Option<Instant>,
    /// `last_start` before the publication in flight, restored if that one is skipped.
    previous_start: Option<Instant>,
    in_flight: bool,
    pending: bool,
}

impl Limiter {
    pub fn new(window: Duration) -> Self {
        Limiter { window, last_start: None, previous_start: None, in_flight: false, pending: false }
    }

    /// Something changed since the last publication started.
    pub fn changed(&mut self) {
        self.pending = true;
    }

    pub fn poll(&mut self, now: Instant) -> Next {
        if !self.pending || self.in_flight {
            return Next::Idle;
        }
        let earliest = self.last_start.map_or(now, |t| t + self.window);
        if now >= earliest {
            self.pending = false;
            self.in_flight = true;
            self.previous_start = self.last_start.replace(now);
            Next::Publish
        } else {
            Next::WaitUntil(earliest)
        }
    }

    /// The publication in flight finished (whether it succeeded or not).
    pub fn finished(&mut self) {
        self.in_flight = false;
    }

    /// A publication was skipped (content unchanged): it does not consume the window.
    pub fn skipped(&mut self) {
        self.in_flight = false;
        self.last_start = self.previous_start;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_millis(250);

    #[tokio::test(start_paused = true)]
    async fn leading_edge_is_immediate_after_quiet() {
        let mut l = Limiter::new(W);
        assert_eq!(l.poll(Instant::now()), Next::Idle);
        l.changed();
        assert_eq!(l.poll(Instant::now()), Next::Publish);
        l.finished();
        tokio::time::advance(W).await;
        l.changed();
        assert_eq!(l.poll(Instant::now()), Next::Publish, "quiet for a window: at once again");
    }

    #[tokio::test(start_paused = true)]
    async fn changes_inside_the_window_trail_at_its_end() {
        let mut l = Limiter::new(W);
        let t0 = Instant::now();
        l.changed();
        assert_eq!(l.poll(t0), Next::Publish);
        l.finished();
        tokio::time::advance(Duration::from_millis(10)).await;
        l.changed();
        assert_eq!(l.poll(Instant::now()), Next::WaitUntil(t0 + W));
        tokio::time::advance(W).await;
        assert_eq!(l.poll(Instant::now()), Next::Publish);
    }

    #[tokio::test(start_paused = true)]
    async fn never_two_at_once_and_one_follow_up_for_a_slow_publisher() {
        let mut l = Limiter::new(W);
        l.changed();
        assert_eq!(l.poll(Instant::now()), Next::Publish);
        // The publication takes ten windows; a thousand changes arrive meanwhile.
        for _ in 0..1000 {
            tokio::time::advance(W / 100).await;
            l.changed();
            assert_eq!(l.poll(Instant::now()), Next::Idle, "never while one is in flight");
        }
        l.finished();
        assert_eq!(l.poll(Instant::now()), Next::Publish, "exactly one follow-up, at once");
        l.finished();
        assert_eq!(l.poll(Instant::now()), Next::Idle);
    }

    #[tokio::test(start_paused = true)]
    async fn a_skipped_publication_does_not_delay_the_next() {
        let mut l = Limiter::new(W);
        l.changed();
        assert_eq!(l.poll(Instant::now()), Next::Publish);
        l.skipped();
        l.changed();
        assert_eq!(l.poll(Instant::now()), Next::Publish);
    }
}
