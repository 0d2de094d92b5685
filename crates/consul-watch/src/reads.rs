//! The permits of short reads: the budget's reads, and the lanes no blocking query holds
//! (docs/consul.md, "Staying within --consul-max-connections").

use std::sync::Arc;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// Reads in flight at most, counting borrowed lanes: the default budget. At 100, a
/// thousand first reads against a Consul 2 ms away all answer in 64 ms, against 376 ms at
/// 10 (docs/benchmarks.md, "Consul source"); more would mostly open more connections at
/// once (a thousand at a budget of 1,200, while the operator, Consul and the API server
/// share the CPU for the first snapshot). Budgets whose reads' own tenth is this already
/// borrow nothing.
const MOST_READS_IN_FLIGHT: usize = 100;

/// The permits of short reads: the budget's reads, and the lanes no blocking query holds.
///
/// A tenth of the budget is the reads' own, so blocking queries, which hold their lanes
/// for minutes, can never starve them. The other way round nothing needs keeping: a lane
/// left idle serves a read, and comes back when the read ends (its deadline bounds that),
/// up to [`MOST_READS_IN_FLIGHT`] reads in all. Until the first snapshot the dedicated
/// watches hold no lane (their blocking queries are held: docs/consul.md, "Cold start"),
/// so at the default budget a cold start's thousand first reads go 100 at a time instead
/// of 10. A read takes a lane only when nobody waits for one (a semaphore hands a freed
/// permit to its waiters first) and never queues for one: a feed or a newly dedicated
/// watch waits for at most one read, never behind a queue of them. Reads that wait are
/// woken when a borrowed lane comes back.
#[derive(Clone)]
pub(crate) struct ReadPool {
    reads: Arc<Semaphore>,
    lanes: Arc<Semaphore>,
    /// Lanes that may be borrowed at once.
    borrowable: Arc<Semaphore>,
    /// A borrowed lane came back.
    returned: Arc<Notify>,
}

/// One read's permit: the reads' own, or a borrowed lane.
pub(crate) struct ReadPermit {
    permit: Option<OwnedSemaphorePermit>,
    /// A borrowed lane's: its place among the borrowable, and whom to tell it came back.
    borrowed: Option<(OwnedSemaphorePermit, Arc<Notify>)>,
}

impl Drop for ReadPermit {
    fn drop(&mut self) {
        // The lane goes back first: a blocking query waiting for it gets it before any read.
        drop(self.permit.take());
        if let Some((place, returned)) = self.borrowed.take() {
            drop(place);
            returned.notify_one();
        }
    }
}

impl ReadPool {
    pub(crate) fn new(reads: usize, lanes: Arc<Semaphore>) -> Self {
        ReadPool {
            reads: Arc::new(Semaphore::new(reads)),
            lanes,
            borrowable: Arc::new(Semaphore::new(MOST_READS_IN_FLIGHT.saturating_sub(reads))),
            returned: Arc::new(Notify::new()),
        }
    }

    /// A permit for one read: the first free one, of the reads' own or an idle lane. `None`
    /// once the pool is closed (never, while its server lives).
    pub(crate) async fn permit(&self) -> Option<ReadPermit> {
        loop {
            if let Ok(p) = self.reads.clone().try_acquire_owned() {
                return Some(ReadPermit { permit: Some(p), borrowed: None });
            }
            if let Some(permit) = self.borrow() {
                return Some(permit);
            }
            tokio::select! {
                p = self.reads.clone().acquire_owned() => {
                    return Some(ReadPermit { permit: Some(p.ok()?), borrowed: None });
                }
                () = self.returned.notified() => {}
            }
        }
    }

    /// An idle lane, if one is free and the reads in flight are below the most.
    fn borrow(&self) -> Option<ReadPermit> {
        let place = self.borrowable.clone().try_acquire_owned().ok()?;
        let lane = self.lanes.clone().try_acquire_owned().ok()?;
        Some(ReadPermit { permit: Some(lane), borrowed: Some((place, self.returned.clone())) })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A permit, if one comes within a minute (of paused time: at once, or never).
    async fn within_a_minute<T>(f: impl Future<Output = Option<T>>) -> Option<T> {
        tokio::time::timeout(Duration::from_secs(60), f).await.ok().flatten()
    }

    #[tokio::test(start_paused = true)]
    async fn a_read_takes_an_idle_lane_and_a_waiting_read_the_lane_given_back() {
        let lanes = Arc::new(Semaphore::new(2));
        let pool = ReadPool::new(1, lanes.clone());
        let _blocking = lanes.clone().acquire_owned().await.unwrap();
        let _own = within_a_minute(pool.permit()).await.expect("the reads' own permit");
        let borrowed = within_a_minute(pool.permit()).await.expect("the idle lane");
        assert_eq!(lanes.available_permits(), 0);
        assert!(within_a_minute(pool.permit()).await.is_none(), "the lane a blocking query holds is not a read's");
        let waiting = tokio::spawn({
            let pool = pool.clone();
            async move { within_a_minute(pool.permit()).await.is_some() }
        });
        tokio::task::yield_now().await;
        drop(borrowed);
        assert!(waiting.await.unwrap(), "a read waiting is woken by the lane given back");
    }

    #[tokio::test(start_paused = true)]
    async fn a_lane_given_back_goes_to_a_waiting_blocking_query_before_a_read() {
        let lanes = Arc::new(Semaphore::new(1));
        let pool = ReadPool::new(1, lanes.clone());
        let own = pool.permit().await.unwrap();
        let borrowed = pool.permit().await.unwrap();
        let blocking = tokio::spawn({
            let lanes = lanes.clone();
            async move { within_a_minute(async { lanes.acquire_owned().await.ok() }).await }
        });
        let read = tokio::spawn({
            let pool = pool.clone();
            async move { within_a_minute(pool.permit()).await }
        });
        tokio::task::yield_now().await;
        drop(borrowed);
        let lane = blocking.await.unwrap();
        assert!(lane.is_some(), "the blocking query gets the lane");
        assert!(!read.is_finished(), "the read waits for its own permit");
        drop(own);
        assert!(read.await.unwrap().is_some(), "and gets the reads' own once free");
    }

    #[tokio::test(start_paused = true)]
    async fn reads_in_flight_stay_within_the_most_whatever_the_idle_lanes() {
        let lanes = Arc::new(Semaphore::new(500));
        let pool = ReadPool::new(10, lanes.clone());
        let mut held = Vec::new();
        while let Some(p) = within_a_minute(pool.permit()).await {
            held.push(p);
        }
        assert_eq!(held.len(), MOST_READS_IN_FLIGHT);
        assert_eq!(lanes.available_permits(), 500 - (MOST_READS_IN_FLIGHT - 10));
        // A budget whose own reads are the most already borrows nothing.
        let lanes = Arc::new(Semaphore::new(1080));
        let pool = ReadPool::new(120, lanes.clone());
        let mut held = Vec::new();
        while let Some(p) = within_a_minute(pool.permit()).await {
            held.push(p);
        }
        assert_eq!((held.len(), lanes.available_permits()), (120, 1080));
    }
}
