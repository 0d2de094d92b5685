//! Leader election over a lease record: who may write to the cluster.
//!
//! Every replica watches and assembles; only the holder of the lease writes the ConfigMap,
//! statuses and Events, so two replicas never fight over them. This is the decision logic
//! alone, without Kubernetes types or clock reads: the edge (`crate::lease`) reads and
//! writes the Lease object and tells this module what it saw and whether its write landed.
//!
//! Expiry is judged on this process's monotonic clock, never on the timestamps written in
//! the lease (replicas' wall clocks disagree): a lease is expired when its record has not
//! changed for `duration` since *we* first saw that version. A leader gives up its writes
//! `renew_deadline` after its last successful renewal, which is shorter than `duration`,
//! so it has stopped before any other replica can consider the lease free.

use std::time::Duration;

use tokio::time::Instant;

/// What the lease object says, as far as the election cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRecord {
    /// `None` or empty when released.
    pub holder: Option<String>,
    /// The object's resourceVersion: any write changes it, so it tells renewals apart.
    pub version: String,
    pub duration: Duration,
    pub transitions: i32,
}

/// What to do after looking at the lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// No lease exists: create it holding it.
    Create,
    /// We hold it: write a new renew time (conditional on `version`).
    Renew { version: String, transitions: i32 },
    /// It is free or expired: take it (conditional on `version`), one more transition.
    Acquire { version: String, transitions: i32 },
    /// Someone else holds it and it is live: look again later.
    Wait,
}

#[derive(Debug, Clone)]
pub struct Election {
    identity: String,
    renew_deadline: Duration,
    /// The version of the lease last seen, and when it was first seen.
    observed: Option<(String, Instant)>,
    /// When our last write holding the lease landed.
    renewed_at: Option<Instant>,
}

impl Election {
    /// `duration` is what we write into the lease; we stop acting as leader
    /// `renew_deadline` after our last renewal (must be shorter than `duration`).
    pub fn new(identity: impl Into<String>, duration: Duration, renew_deadline: Duration) -> Self {
        debug_assert!(renew_deadline < duration);
        Election { identity: identity.into(), renew_deadline, observed: None, renewed_at: None }
    }

    /// Decides what to do about the lease as just read (`None`: there is none).
    pub fn observe(&mut self, lease: Option<&LeaseRecord>, now: Instant) -> Action {
        let Some(lease) = lease else {
            self.observed = None;
            return Action::Create;
        };
        let first_seen = match &self.observed {
            Some((version, at)) if *version == lease.version => *at,
            _ => {
                self.observed = Some((lease.version.clone(), now));
                now
            }
        };
        match lease.holder.as_deref() {
            Some(h) if h == self.identity => {
                Action::Renew { version: lease.version.clone(), transitions: lease.transitions }
            }
            Some(h) if !h.is_empty() && now < first_seen + lease.duration => {
                // Another replica's lease we have not seen expire: it may be writing, so
                // we must not (even if our own renewal has not lapsed yet).
                self.renewed_at = None;
                Action::Wait
            }
            _ => Action::Acquire { version: lease.version.clone(), transitions: lease.transitions + 1 },
        }
    }

    /// Our write (create, renew or acquire) landed at `now`.
    pub fn written(&mut self, now: Instant) {
        self.renewed_at = Some(now);
    }

    /// We released the lease, or are about to.
    pub fn released(&mut self) {
        self.renewed_at = None;
    }

    /// Whether we may write to the cluster at `now`.
    pub fn is_leader(&self, now: Instant) -> bool {
        self.renewed_at.is_some_and(|at| now < at + self.renew_deadline)
    }

    /// When leadership lapses unless renewed before.
    pub fn leader_until(&self) -> Option<Instant> {
        self.renewed_at.map(|at| at + self.renew_deadline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Duration = Duration::from_secs(15);
    const R: Duration = Duration::from_secs(10);

    fn lease(holder: Option<&str>, version: &str) -> LeaseRecord {
        LeaseRecord { holder: holder.map(str::to_owned), version: version.into(), duration: D, transitions: 3 }
    }

    #[tokio::test(start_paused = true)]
    async fn no_lease_is_created_and_the_creator_leads_until_the_renew_deadline() {
        let t0 = Instant::now();
        let mut e = Election::new("a", D, R);
        assert!(!e.is_leader(t0));
        assert_eq!(e.observe(None, t0), Action::Create);
        e.written(t0);
        assert!(e.is_leader(t0));
        assert!(e.is_leader(t0 + R - Duration::from_millis(1)));
        assert!(!e.is_leader(t0 + R), "no renewal for the renew deadline: stop writing");
    }

    #[tokio::test(start_paused = true)]
    async fn our_own_lease_is_renewed_with_its_version() {
        let t0 = Instant::now();
        let mut e = Election::new("a", D, R);
        assert_eq!(e.observe(Some(&lease(Some("a"), "7")), t0), Action::Renew { version: "7".into(), transitions: 3 });
    }

    #[tokio::test(start_paused = true)]
    async fn a_live_lease_of_another_is_waited_for_until_unchanged_for_its_duration() {
        let t0 = Instant::now();
        let mut e = Election::new("b", D, R);
        let held = lease(Some("a"), "7");
        assert_eq!(e.observe(Some(&held), t0), Action::Wait);
        assert_eq!(e.observe(Some(&held), t0 + D - Duration::from_millis(1)), Action::Wait);
        // A renewal (new version) restarts the count from when we saw it.
        let renewed = lease(Some("a"), "8");
        assert_eq!(e.observe(Some(&renewed), t0 + D - Duration::from_millis(1)), Action::Wait);
        assert_eq!(e.observe(Some(&renewed), t0 + D + Duration::from_secs(1)), Action::Wait);
        let t1 = t0 + D - Duration::from_millis(1);
        assert_eq!(e.observe(Some(&renewed), t1 + D), Action::Acquire { version: "8".into(), transitions: 4 });
    }

    #[tokio::test(start_paused = true)]
    async fn a_released_lease_is_taken_at_once() {
        let t0 = Instant::now();
        let mut e = Election::new("b", D, R);
        assert_eq!(e.observe(Some(&lease(None, "9")), t0), Action::Acquire { version: "9".into(), transitions: 4 });
        assert_eq!(e.observe(Some(&lease(Some(""), "9")), t0), Action::Acquire { version: "9".into(), transitions: 4 });
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_that_sees_another_holder_stops_at_once() {
        let t0 = Instant::now();
        let mut e = Election::new("a", D, R);
        e.observe(None, t0);
        e.written(t0);
        assert!(e.is_leader(t0 + Duration::from_secs(1)));
        assert_eq!(e.observe(Some(&lease(Some("b"), "10")), t0 + Duration::from_secs(1)), Action::Wait);
        assert!(!e.is_leader(t0 + Duration::from_secs(1)));
    }

    #[tokio::test(start_paused = true)]
    async fn the_old_leader_stops_before_anyone_can_take_over() {
        // Safety: b first sees a's last renewal no earlier than a wrote it, and waits the
        // full duration from then; a stops writing renew_deadline after the write.
        let t0 = Instant::now();
        let (mut a, mut b) = (Election::new("a", D, R), Election::new("b", D, R));
        a.observe(None, t0);
        a.written(t0);
        let record = lease(Some("a"), "1");
        let mut t = t0;
        while b.observe(Some(&record), t) == Action::Wait {
            t += Duration::from_millis(100);
        }
        assert!(!a.is_leader(t), "a still writes when b takes over at {:?}", t - t0);
        assert!(t - t0 >= D);
    }
}
