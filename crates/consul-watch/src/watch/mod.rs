//! The watch of one Consul key: [`machine`] decides, [`run`] performs.
//!
//! A watch reads its service once, then takes the place its server's plan gives it
//! ([`crate::server`]): a dedicated blocking query, a membership of its group's change feed,
//! or (when neither fits the budget) the sweep alone. Over HTTP/2 it blocks on its own
//! stream, outside the plan. It follows its place as the plan changes, and its server's
//! reachability ([`crate::reach`]): while the server is down it sends nothing. Its blocking
//! queries, dedicated or over HTTP/2, wait while the source holds them
//! (`ConsulSource::hold_blocking`: the operator's cold start).

mod machine;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::{OwnedSemaphorePermit, watch};
use tokio::time::Instant;

use crate::EventSink;
use crate::client::{Answer, Heard, HttpClient, Instances};
use crate::error::QueryError;
use crate::feed::Membership;
use crate::observe::{self, Query};
use crate::reach::Reach;
use crate::reads::ReadPermit;
use crate::server::{Assignment, Seat, Server};
use crate::timing::Backoff;
use consul_resolver_core::keys::ConsulKey;
use consul_resolver_core::model::{ConsulEvent, Event};
use machine::{Machine, Mode, Next, Timing};

/// What a watch holds while it runs, besides its machine.
struct Held {
    server: Arc<Server>,
    client: Arc<HttpClient>,
    key: ConsulKey,
    /// Its place in the plan, once it has answered (never over HTTP/2).
    seat: Option<Seat>,
    /// Its lane, while dedicated.
    lane: Option<OwnedSemaphorePermit>,
    /// Its feed, while fed.
    membership: Option<Membership>,
    /// What its last answer asked about, shared with its feed member and kept while answers
    /// hear the same. A copy each cost about 17 MB at 10,000 fed services, and a fresh copy
    /// per read, made among the read's short-lived allocations, fragmented the heap
    /// (docs/benchmarks.md, "The doubled scale profile").
    heard: Arc<Heard>,
    /// When its last read was sent: a feed whose view is newer needs no re-read from it.
    last_read: Option<Instant>,
    /// `consul_watches{mode}`, counted while the watch runs.
    counted: ModeGauge,
}

/// Runs the watch until the future is dropped or the event channel closes.
pub(crate) async fn run(server: Arc<Server>, key: ConsulKey, events: EventSink) {
    let timing =
        Timing { wait: server.settings.wait, min_interval: server.settings.min_interval, sweep: server.settings.sweep };
    let mut machine = Machine::new(timing);
    let client = {
        // A client that cannot be built (an invalid address or TLS setup) is reported and
        // retried with backoff: the Secret it names may be fixed.
        let mut backoff = Backoff::default();
        let mut last = None;
        loop {
            match server.client(&key.scope.server.address, key.scope.server.tls.as_ref()) {
                Ok(c) => break c,
                Err(e) => {
                    if last.as_ref() != Some(&e) && !send(&events, &key, ConsulEvent::Failed(e.clone())).await {
                        return;
                    }
                    last = Some(e);
                    let delay = backoff.failure(&mut rand::rng());
                    tokio::time::sleep(delay).await;
                }
            }
        }
    };
    let mut reach = server.reach.subscribe();
    let counted = ModeGauge::new(&server, machine.mode());
    let mut held = Held {
        server,
        client,
        key,
        seat: None,
        lane: None,
        membership: None,
        heard: Arc::default(),
        last_read: None,
        counted,
    };
    loop {
        // Its server's state first: while down, nothing goes out.
        let state = reach.borrow_and_update().clone();
        match state {
            Reach::Down { cause } => {
                let message =
                    QueryError::Network { address: held.client.address().to_owned(), cause: cause.to_string() };
                if let Some(ev) = machine.server_down(message.to_string())
                    && !send(&events, &held.key, ev).await
                {
                    return;
                }
            }
            Reach::Up => machine.server_up(Instant::now(), &mut rand::rng()),
        }
        held.follow_assignment(&mut machine);
        match machine.next(Instant::now()) {
            Next::Query(block) => {
                // Boxed: the request's state (most of a watch's size) is allocated only
                // while it queries, not held by every idle fed watch (see the size test).
                let Some(ev) = Box::pin(held.query(&mut machine, block, &mut reach)).await else { continue };
                if !send(&events, &held.key, ev).await {
                    return;
                }
            }
            Next::Sleep(at) => {
                tokio::select! {
                    () = tokio::time::sleep_until(at) => {}
                    () = changed(&mut held.seat, &mut reach) => {}
                    () = woken(&mut held.membership) => machine.woken(),
                }
            }
            Next::Idle => {
                tokio::select! {
                    () = changed(&mut held.seat, &mut reach) => {}
                    () = woken(&mut held.membership) => machine.woken(),
                }
            }
        }
    }
}

/// Sends `ev` of `key`'s watch; whether the event loop is still there. Boxed: an event is
/// rare for a watch, and its state (the event and the channel's wait) would otherwise be
/// held by every idle watch's future (see the size test).
fn send(events: &EventSink, key: &ConsulKey, ev: ConsulEvent) -> Pin<Box<dyn Future<Output = bool> + Send>> {
    let (events, event) = (events.clone(), Event::Consul(key.clone(), ev));
    Box::pin(async move { events.send(event).await.is_ok() })
}

impl Held {
    /// Takes the place the plan gives, if it changed: lanes and memberships follow.
    fn follow_assignment(&mut self, machine: &mut Machine) {
        let Some(seat) = self.seat.as_mut() else { return };
        if !seat.assignment.has_changed().unwrap_or(false) {
            return;
        }
        let assignment = seat.assignment.borrow_and_update().clone();
        let mode = match &assignment {
            Assignment::Pending => return,
            Assignment::Dedicated => Mode::Dedicated,
            Assignment::Fed(_) => Mode::Fed,
            Assignment::Swept => Mode::Swept,
        };
        if mode != Mode::Dedicated {
            self.lane = None;
        }
        self.membership = match assignment {
            Assignment::Fed(feed) => {
                let last_read = self.last_read.unwrap_or_else(Instant::now);
                let m = feed.join(self.heard.clone(), &self.key.scope.query, last_read);
                if m.changes.has_changed().unwrap_or(false) {
                    machine.woken();
                }
                Some(m)
            }
            _ => None,
        };
        machine.place(mode, Instant::now(), &mut rand::rng());
        self.counted.set(mode);
    }

    /// Sends the query the machine asked for and feeds it the outcome. `None` when the
    /// query was dropped (the watch's place changed or its server went down) or changed
    /// nothing worth an event.
    async fn query(
        &mut self,
        machine: &mut Machine,
        block: Option<(u64, Duration)>,
        reach: &mut watch::Receiver<Reach>,
    ) -> Option<ConsulEvent> {
        let _read = self.permit(machine, block, reach).await?;
        let now = Instant::now();
        machine.sent(now, &mut rand::rng());
        if block.is_none() {
            self.last_read = Some(now);
            // Wakes before this read are answered by it; those during it call for another.
            if let Some(m) = self.membership.as_mut() {
                m.changes.mark_unchanged();
            }
        }
        let server = self.server.clone();
        let (client, key) = (&self.client, &self.key);
        let request = observe::request(&server.metrics, Query::Service, Some(key), block, || client.health(key, block));
        let result = tokio::select! {
            r = request => r,
            () = changed(&mut self.seat, reach) => return None,
        };
        match result {
            Ok(answer) => self.answered(machine, block, answer),
            Err(e) => {
                if machine.blocking() {
                    restarted(&server, "error");
                }
                server.reach.suspect(&self.client, &e);
                let event = machine.failed(&e, Instant::now(), &mut rand::rng());
                if event.is_some() {
                    tracing::warn!(watch = %self.key, error = %e, "Consul query failed; keeping the last endpoints");
                }
                event
            }
        }
    }

    /// What the query may be sent with: `Some(None)` when it needs no read permit (a
    /// dedicated watch holds its lane for as long as it is dedicated, and may wait for a
    /// watch that was just moved to give one back; an HTTP/2 stream needs none), a read
    /// permit for its own life otherwise; `None` when the watch's place changed meanwhile.
    async fn permit(
        &mut self,
        machine: &Machine,
        block: Option<(u64, Duration)>,
        reach: &mut watch::Receiver<Reach>,
    ) -> Option<Option<ReadPermit>> {
        // Only blocking queries are held (dedicated or over HTTP/2: no other watch blocks).
        // A stream costs no connection, but every waiting query costs Consul and us CPU
        // while a cold start shares it (10,000 streams at the doubled scale profile).
        if block.is_some() {
            self.released(reach).await?;
        }
        if machine.holds_lane() {
            if self.lane.is_none() {
                let lanes = self.server.lanes.clone();
                tokio::select! {
                    p = lanes.acquire_owned() => self.lane = Some(p.ok()?),
                    () = changed(&mut self.seat, reach) => return None,
                }
            }
            return Some(None);
        }
        if machine.mode() == Mode::Multiplexed {
            return Some(None);
        }
        let reads = self.server.reads.clone();
        tokio::select! {
            p = reads.permit() => Some(Some(p?)),
            () = changed(&mut self.seat, reach) => None,
        }
    }

    /// Waits while the source holds blocking queries (`ConsulSource::hold_blocking`);
    /// `None` when the watch's place or its server's reachability changed meanwhile.
    async fn released(&mut self, reach: &mut watch::Receiver<Reach>) -> Option<()> {
        if *self.server.blocking.borrow() {
            return Some(());
        }
        let mut blocking = self.server.blocking.clone();
        tokio::select! {
            // Released, or the source is gone (and the watch with it).
            _ = blocking.wait_for(|may| *may) => Some(()),
            () = changed(&mut self.seat, reach) => None,
        }
    }

    /// An answer, fed to the machine: the index checked, what was heard shared with the
    /// change feed, an answer without index counted (and said once: the watch cannot block).
    fn answered(
        &mut self,
        machine: &mut Machine,
        block: Option<(u64, Duration)>,
        answer: Answer<Instances>,
    ) -> Option<ConsulEvent> {
        let server = self.server.clone();
        if block.is_some_and(|(sent, _)| answer.index < sent) {
            restarted(&server, "index_went_back");
        }
        let instances = answer.value;
        // Most reads hear what the last one did: the copy the feed shares stays.
        if *self.heard != instances.heard {
            self.heard = Arc::new(instances.heard);
            if let Some(m) = &self.membership {
                m.saw(&self.heard);
            }
        }
        let cut_off = instances.cache_age.map(|age| SystemTime::now() - age);
        if !answer.indexed {
            server.metrics.unindexed.with_label_values(&[Query::Service.label()]).inc();
        }
        let could_block = !machine.cannot_block();
        let index = answer.indexed.then_some(answer.index);
        let event =
            machine.answered(block.map(|b| b.0), index, instances.endpoints, cut_off, Instant::now(), &mut rand::rng());
        if could_block && machine.cannot_block() {
            tracing::warn!(watch = %self.key,
                "Consul's answer carries no X-Consul-Index (a proxy in between strips it?): this watch cannot block and reads every --consul-sweep instead");
        }
        if machine.mode() == Mode::Unplaced {
            self.placed(machine);
        }
        event
    }

    /// After its first answer: over HTTP/2 the watch blocks on its own stream; otherwise it
    /// takes a seat in its server's plan.
    fn placed(&mut self, machine: &mut Machine) {
        if self.client.multiplexed() {
            machine.place(Mode::Multiplexed, Instant::now(), &mut rand::rng());
            self.counted.set(Mode::Multiplexed);
        } else {
            self.seat = Some(self.server.join(&self.key, &self.client));
        }
    }
}

/// Resolves when the watch's place (`seat`) or its server's reachability changes.
async fn changed(seat: &mut Option<Seat>, reach: &mut watch::Receiver<Reach>) {
    let assignment = async {
        let Some(seat) = seat.as_mut() else { return std::future::pending().await };
        if seat.assignment.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
        // `changed` marks the value seen: leave it for `follow_assignment` to take.
        seat.assignment.mark_changed();
    };
    let reachability = async {
        if reach.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        () = assignment => {}
        () = reachability => {}
    }
}

/// Resolves when the watch's feed names it.
async fn woken(membership: &mut Option<Membership>) {
    let Some(m) = membership.as_mut() else { return std::future::pending().await };
    if m.changes.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The watch starts over from a read without index (after an error, or when the server's
/// index went back): counted, as the Kubernetes source counts relists.
fn restarted(server: &Server, reason: &str) {
    server.metrics.restarts.with_label_values(&["consul", reason]).inc();
}

/// A watch counted in `consul_watches{mode}` under its current mode, uncounted when dropped.
struct ModeGauge {
    gauge: prometheus::IntGaugeVec,
    mode: Mode,
}

impl ModeGauge {
    fn new(server: &Server, mode: Mode) -> Self {
        let gauge = server.metrics.watches.clone();
        gauge.with_label_values(&[mode.label()]).inc();
        ModeGauge { gauge, mode }
    }

    fn set(&mut self, mode: Mode) {
        if mode != self.mode {
            self.gauge.with_label_values(&[self.mode.label()]).dec();
            self.gauge.with_label_values(&[mode.label()]).inc();
            self.mode = mode;
        }
    }
}

impl Drop for ModeGauge {
    fn drop(&mut self) {
        self.gauge.with_label_values(&[self.mode.label()]).dec();
    }
}
