//! One Consul server (its resolved socket addresses, however the resolvers spell them): the
//! connection budget its watches share, the clients that talk to it, where each watch stands
//! in the budget ([`crate::plan`]), the change feeds the plan runs, and whether it answers
//! ([`crate::reach`]). See docs/consul.md, "Staying within --consul-max-connections".
//!
//! Every request holds a permit for its whole life, and the permits of one server add up to
//! `--consul-max-connections`, so no more requests are in flight than the budget allows
//! (open connections follow: the HTTP/1.1 client opens one only when none is idle):
//! - `reads`, a tenth (at least one): short non-blocking reads (first answers, re-reads of
//!   fed watches) and probes;
//! - `lanes`, the rest: the blocking queries of dedicated watches (one each) and of change
//!   feeds (two each, and a third while the group is large and the plan gives it), as the
//!   plan shares them; over HTTP/2, its connections. A lane no blocking query holds serves
//!   reads too ([`crate::reads`]).
//!
//! The plan is made again, for all the server's watches at once, whenever a watch joins or
//! leaves or a feed asks for its status lanes or gives them up (a burst of those is one
//! plan): a freed lane goes to a fed watch at once, and a
//! group that needs a feed gets one, a dedicated watch giving up its lane if need be. A
//! watch holds its lane permit only while the plan says it is dedicated, so the permits
//! enforce what the plan decided even while watches move.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::{Notify, Semaphore, watch};
use tokio_util::task::AbortOnDropHandle;

use crate::client::HttpClient;
use crate::feed::{Feed, FeedEnv, FeedKey};
use crate::metrics::{GaugeShare, Metrics};
use crate::plan::{Plan, Planner, Role, WatchId};
use crate::reach::Reachability;
use crate::reads::ReadPool;
use crate::settings::Settings;
use consul_resolver_core::keys::{ConsulKey, TlsSettings};

/// How the budget is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Split {
    pub lanes: usize,
    pub reads: usize,
}

impl Split {
    /// A tenth (at least one) for reads, the rest for blocking queries.
    pub(crate) fn of(budget: usize) -> Split {
        let budget = budget.max(1);
        let reads = (budget / 10).max(1);
        Split { lanes: budget - reads, reads }
    }
}

/// Plans wait at least this long for more joins and leaves before they are made: a thousand
/// watches joining at start-up are a few plans, not a thousand, and a freed lane still moves
/// within a moment.
const PLAN_COALESCING: Duration = Duration::from_millis(10);

/// ... and at least this many times what the last plan took. A plan is linear in the
/// watches, and at a cold start watches join for as long as the Mappings list: at 10,000
/// watches, plans every 10 ms took 6 % of the operator's CPU to its first snapshot
/// (docs/benchmarks.md). Waiting a hundred times a plan's time keeps plans to about 1 % of
/// a core, and a freed lane still moves within tens of milliseconds.
const PLAN_SHARE: u32 = 100;

/// ... but never longer than this: a plan slowed by a busy machine (its time is wall time)
/// does not hold a freed lane for long.
const PLAN_COALESCING_AT_MOST: Duration = Duration::from_millis(500);

/// How long a plan waits for more joins and leaves, the last plan having taken `last`.
fn coalescing(last: Duration) -> Duration {
    last.saturating_mul(PLAN_SHARE).clamp(PLAN_COALESCING, PLAN_COALESCING_AT_MOST)
}

/// Where a watch stands, as its server told it.
#[derive(Clone)]
pub(crate) enum Assignment {
    /// Not placed yet.
    Pending,
    Dedicated,
    Fed(Arc<Feed>),
    Swept,
}

/// Clients are shared by the watches with one address spelling and TLS settings, and
/// dropped (closing their connections) when the last of them ends.
type ClientKey = (String, Option<TlsSettings>);

pub(crate) struct Server {
    pub settings: Settings,
    pub metrics: Metrics,
    pub lanes: Arc<Semaphore>,
    pub reads: ReadPool,
    pub reach: Arc<Reachability>,
    /// Whether dedicated watches may block yet (`ConsulSource::hold_blocking`).
    pub blocking: watch::Receiver<bool>,
    clients: Mutex<HashMap<ClientKey, Weak<HttpClient>>>,
    seats: Mutex<Seats>,
    replan: Arc<Notify>,
    _planner: AbortOnDropHandle<()>,
}

/// The watches placed in the plan, and the feeds it runs.
struct Seats {
    planner: Planner<FeedKey>,
    next_id: WatchId,
    watches: HashMap<WatchId, Seated>,
    feeds: BTreeMap<FeedKey, RunningFeed>,
    /// Watches swept at the last plan (to say so when it changes).
    swept: usize,
    /// This server's part of `consul_feeds`.
    feeds_counted: GaugeShare,
    /// Feeds that asked for their status lanes and did not get them, at the last plan: this
    /// server's part of `consul_feeds_short_of_status_lanes`.
    short_of_status_lanes: GaugeShare,
}

struct Seated {
    group: Option<FeedKey>,
    /// A key and client of the watch, should a feed of its group have to start.
    key: ConsulKey,
    client: Arc<HttpClient>,
    role: Option<Role>,
    assignment: watch::Sender<Assignment>,
}

struct RunningFeed {
    feed: Arc<Feed>,
    _task: AbortOnDropHandle<()>,
}

/// A watch's place in its server's plan; leaving is dropping it.
pub(crate) struct Seat {
    server: Arc<Server>,
    id: WatchId,
    /// What the server tells the watch to be.
    pub assignment: watch::Receiver<Assignment>,
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.server.leave(self.id);
    }
}

impl Server {
    pub(crate) fn new(settings: Settings, metrics: Metrics, blocking: watch::Receiver<bool>) -> Arc<Server> {
        let split = Split::of(settings.max_connections);
        let lanes = Arc::new(Semaphore::new(split.lanes));
        let reads = ReadPool::new(split.reads, lanes.clone());
        Arc::new_cyclic(|me: &Weak<Server>| {
            let replan = Arc::new(Notify::new());
            let (weak, told) = (me.clone(), replan.clone());
            let planner = crate::restart::spawn_restarting("planner", &metrics, move || {
                plan_when_told(weak.clone(), told.clone())
            });
            Server {
                lanes,
                reach: Reachability::new(reads.clone(), metrics.clone()),
                reads,
                blocking,
                clients: Mutex::new(HashMap::new()),
                seats: Mutex::new(Seats {
                    planner: Planner::new(split.lanes),
                    next_id: 0,
                    watches: HashMap::new(),
                    feeds: BTreeMap::new(),
                    swept: 0,
                    feeds_counted: GaugeShare::new(metrics.feeds.clone()),
                    short_of_status_lanes: GaugeShare::new(metrics.feeds_short_of_status_lanes.clone()),
                }),
                replan,
                _planner: AbortOnDropHandle::new(planner),
                settings,
                metrics,
            }
        })
    }

    /// The client for this address spelling and TLS settings, shared while anyone holds it.
    pub(crate) fn client(&self, address: &str, tls: Option<&TlsSettings>) -> Result<Arc<HttpClient>, String> {
        let mut clients = self.clients.lock().expect("client map poisoned");
        let key = (address.to_owned(), tls.cloned());
        if let Some(c) = clients.get(&key).and_then(Weak::upgrade) {
            return Ok(c);
        }
        clients.retain(|_, c| c.strong_count() > 0);
        let s = &self.settings;
        let c = Arc::new(HttpClient::new(address, tls, s.max_connections, s.max_response_bytes, self.lanes.clone())?);
        clients.insert(key, Arc::downgrade(&c));
        Ok(c)
    }

    /// Clients alive (for tests of eviction).
    #[cfg(test)]
    pub(crate) fn live_clients(&self) -> usize {
        self.clients.lock().expect("client map poisoned").values().filter(|c| c.strong_count() > 0).count()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Seats> {
        self.seats.lock().expect("seats poisoned")
    }

    /// Places the watch of `key` (reached through `client`) in the plan.
    pub(crate) fn join(self: &Arc<Self>, key: &ConsulKey, client: &Arc<HttpClient>) -> Seat {
        let (assignment, rx) = watch::channel(Assignment::Pending);
        let id = {
            let mut seats = self.lock();
            let id = seats.next_id;
            seats.next_id += 1;
            let group = FeedKey::of(key);
            seats.planner.join(id, group.clone());
            seats
                .watches
                .insert(id, Seated { group, key: key.clone(), client: client.clone(), role: None, assignment });
            id
        };
        self.replan.notify_one();
        Seat { server: self.clone(), id, assignment: rx }
    }

    fn leave(&self, id: WatchId) {
        let mut seats = self.lock();
        seats.planner.leave(id);
        seats.watches.remove(&id);
        if seats.watches.is_empty() {
            // Nobody to plan for: the feeds stop now, not at the next plan.
            seats.feeds.clear();
            seats.feeds_counted.set(0);
            seats.short_of_status_lanes.set(0);
        }
        drop(seats);
        self.replan.notify_one();
    }

    /// Plans again and tells every watch whose place changed; starts and stops feeds.
    fn replan_now(&self) {
        let mut seats = self.lock();
        if seats.planner.is_empty() {
            return;
        }
        let asking: BTreeSet<FeedKey> =
            seats.feeds.iter().filter(|(_, f)| f.feed.asks_for_status_lanes()).map(|(g, _)| g.clone()).collect();
        seats.planner.want_status_lanes(asking.clone());
        let Plan { roles, feeds, statuses } = seats.planner.plan();
        // Judged on what the plan was given: a feed may ask again while it is being made.
        let short_of_status_lanes = asking.iter().filter(|g| feeds.contains(*g) && !statuses.contains(*g)).count();
        let Seats { watches, feeds: running, feeds_counted, .. } = &mut *seats;
        // Feeds the plan no longer runs stop first, giving their lanes back.
        running.retain(|g, _| feeds.contains(g));
        for g in feeds {
            if running.contains_key(&g) {
                continue;
            }
            let Some(seed) = watches.values().find(|w| w.group.as_ref() == Some(&g)) else { continue };
            let feed = Feed::new();
            let env = FeedEnv {
                lanes: self.lanes.clone(),
                reads: self.reads.clone(),
                reach: self.reach.clone(),
                metrics: self.metrics.clone(),
                wait: self.settings.wait,
                statuses_from: self.settings.status_queries_from_checks,
                replan: self.replan.clone(),
            };
            let (running_feed, client, key) = (feed.clone(), seed.client.clone(), seed.key.clone());
            let task = crate::restart::spawn_restarting("feed", &self.metrics, move || {
                running_feed.clone().run(client.clone(), key.clone(), env.clone())
            });
            running.insert(g, RunningFeed { feed, _task: AbortOnDropHandle::new(task) });
        }
        for (g, f) in running.iter() {
            f.feed.give_status_lanes(statuses.contains(g));
        }
        feeds_counted.set(running.len());
        let mut swept = 0;
        for (id, role) in roles {
            let Some(w) = watches.get_mut(&id) else { continue };
            swept += usize::from(role == Role::Swept);
            if w.role == Some(role) {
                continue;
            }
            w.role = Some(role);
            let assignment = match role {
                Role::Dedicated => Assignment::Dedicated,
                Role::Swept => Assignment::Swept,
                Role::Fed => match w.group.as_ref().and_then(|g| running.get(g)) {
                    Some(f) => Assignment::Fed(f.feed.clone()),
                    None => Assignment::Swept,
                },
            };
            w.assignment.send_replace(assignment);
        }
        seats.report(swept, short_of_status_lanes);
    }
}

impl Seats {
    /// Says in the log when the watches the plan sweeps, or the large groups' feeds it gives
    /// no status lanes, change in number.
    fn report(&mut self, swept: usize, short_of_status_lanes: usize) {
        if swept != self.swept {
            if swept > 0 {
                tracing::warn!(
                    swept,
                    "Consul watches beyond the connection budget that get no change feed: \
                    each is re-read every --consul-sweep only; raise --consul-max-connections, or use fewer \
                    distinct tokens, datacenters, namespaces or partitions on this server"
                );
            } else {
                tracing::info!("every Consul watch of this server has a blocking query or a change feed again");
            }
            self.swept = swept;
        }
        if short_of_status_lanes != self.short_of_status_lanes.get() {
            if short_of_status_lanes > 0 {
                tracing::warn!(
                    feeds = short_of_status_lanes,
                    "change feeds of large Consul catalogs without lanes for their critical and warning checks' \
                    queries: a health change of their fed services waits for the answer of every check; raise \
                    --consul-max-connections"
                );
            } else {
                tracing::info!(
                    "every large change feed of this server has its critical and warning checks' queries again"
                );
            }
            self.short_of_status_lanes.set(short_of_status_lanes);
        }
    }
}

/// Plans whenever told, a burst of joins and leaves at a time, for as long as the server
/// lives.
async fn plan_when_told(server: Weak<Server>, replan: Arc<Notify>) {
    let mut last = Duration::ZERO;
    loop {
        replan.notified().await;
        tokio::time::sleep(coalescing(last)).await;
        let Some(server) = server.upgrade() else { return };
        // The plan's own time, not the paused clock's: it is CPU, not waiting.
        let started = std::time::Instant::now();
        server.replan_now();
        last = started.elapsed();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::key;

    #[test]
    fn split_adds_up_to_the_budget() {
        for budget in 1..300 {
            let s = Split::of(budget);
            assert_eq!(s.lanes + s.reads, budget, "{budget}: {s:?}");
            assert!(s.reads >= 1);
        }
        assert_eq!(Split::of(100), Split { lanes: 90, reads: 10 });
        assert_eq!(Split::of(1), Split { lanes: 0, reads: 1 });
        assert_eq!(Split::of(4), Split { lanes: 3, reads: 1 });
    }

    #[test]
    fn plans_wait_a_hundred_times_the_last_ones_time_within_bounds() {
        assert_eq!(coalescing(Duration::ZERO), PLAN_COALESCING);
        assert_eq!(coalescing(Duration::from_micros(50)), PLAN_COALESCING);
        assert_eq!(coalescing(Duration::from_micros(100)), PLAN_COALESCING);
        assert_eq!(coalescing(Duration::from_micros(600)), Duration::from_millis(60));
        assert_eq!(coalescing(Duration::from_millis(20)), PLAN_COALESCING_AT_MOST);
        assert_eq!(coalescing(Duration::MAX), PLAN_COALESCING_AT_MOST);
    }

    #[tokio::test]
    async fn clients_are_shared_and_dropped_with_their_last_user() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let settings = Settings { max_connections: 10, wait: Duration::from_secs(1), ..Settings::default() };
        let server = Server::new(settings, Metrics::unregistered(), watch::channel(true).1);
        let a = server.client("http://127.0.0.1:8500", None).unwrap();
        let b = server.client("http://127.0.0.1:8500", None).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        let c = server.client("http://localhost:8500", None).unwrap();
        assert!(!Arc::ptr_eq(&a, &c), "one client per spelling (the Host header and TLS name differ)");
        assert_eq!(server.live_clients(), 2);
        drop((a, b));
        assert_eq!(server.live_clients(), 1);
        drop(c);
        assert_eq!(server.live_clients(), 0);
    }

    /// The plan reaches the watches: beyond the lanes, each scope's watches are fed by a
    /// feed of their own; when a dedicated watch leaves, a fed one is told to take its lane.
    #[tokio::test(start_paused = true)]
    async fn watches_are_told_their_place_and_a_freed_lane_moves_at_once() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        // A budget of 8: 7 lanes.
        let settings = Settings { max_connections: 8, ..Settings::default() };
        let server = Server::new(settings, Metrics::unregistered(), watch::channel(true).1);
        let client = server.client("http://127.0.0.1:1", None).unwrap();
        let mut seats: Vec<Seat> = Vec::new();
        for team in ["a", "b"] {
            for i in 0..5 {
                seats.push(server.join(&key(&format!("{team}{i}"), Some(team)), &client));
            }
        }
        tokio::time::sleep(PLAN_COALESCING * 2).await;
        let placed = |seats: &[Seat]| -> Vec<&'static str> {
            seats
                .iter()
                .map(|s| match *s.assignment.borrow() {
                    Assignment::Pending => "pending",
                    Assignment::Dedicated => "dedicated",
                    Assignment::Fed(_) => "fed",
                    Assignment::Swept => "swept",
                })
                .collect()
        };
        // Ten watches of two tokens on seven lanes: both teams' groups could have a feed
        // (four lanes); team a is cheaper dedicated whole (five lanes, its feed's two back),
        // team b keeps its feed.
        assert_eq!(placed(&seats), [["dedicated"; 5], ["fed"; 5]].concat());
        assert_eq!(server.metrics.feeds.get(), 1);
        // A dedicated watch leaves: its lane goes to team b's oldest fed watch.
        seats.remove(0);
        // The next plan waits up to a hundred times the last plan's wall time, which a
        // slow or busy machine stretches; never longer than the cap.
        tokio::time::sleep(PLAN_COALESCING_AT_MOST + PLAN_COALESCING).await;
        assert_eq!(placed(&seats), [&["dedicated"; 5][..], &["fed"; 4][..]].concat());
        // All gone: the feeds stop with the last one.
        seats.clear();
        assert_eq!(server.metrics.feeds.get(), 0);
    }

    /// Every Consul server adds its own feeds to the one gauge: a server whose watches all
    /// leave takes its feeds out of the count, not the other servers'.
    #[tokio::test(start_paused = true)]
    async fn each_server_counts_its_own_feeds() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let metrics = Metrics::unregistered();
        // A budget of 4 each: three lanes, five watches of one group, so a feed each.
        let settings = Settings { max_connections: 4, ..Settings::default() };
        let mut servers: Vec<Vec<Seat>> = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
            .into_iter()
            .map(|address| {
                let server = Server::new(settings.clone(), metrics.clone(), watch::channel(true).1);
                let client = server.client(address, None).unwrap();
                (0..5).map(|i| server.join(&key(&format!("s{i}"), Some("team")), &client)).collect()
            })
            .collect();
        tokio::time::sleep(PLAN_COALESCING * 2).await;
        assert_eq!(metrics.feeds(), 2, "a feed of each server");
        servers[0].clear();
        tokio::time::sleep(PLAN_COALESCING_AT_MOST + PLAN_COALESCING).await;
        assert_eq!(metrics.feeds(), 1, "the other server's feed still runs");
        servers.clear();
        assert_eq!(metrics.feeds(), 0);
    }
}
