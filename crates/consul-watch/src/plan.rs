//! How one server's connection budget is shared between its watches: the pure planning
//! behind [`crate::server`] (docs/consul.md, "Staying within --consul-max-connections").
//!
//! Over HTTP/1.1 every blocking query holds a connection, and the budget's "lanes" (what is
//! left after the non-blocking reads) are fewer than the watches at scale. A watch is then
//! one of:
//! - **dedicated**: its own blocking query, one lane;
//! - **fed**: a member of its group's change feed, which holds two lanes for the whole group
//!   ([`FEED_LANES`]) and names which members to re-read; as prompt as a dedicated query,
//!   one round trip later. A feed whose group is large asks for two more, for its queries of
//!   the critical and the warning checks ([`STATUS_LANES`]);
//! - **swept**: neither could be given; re-read at the sweep only. Surfaced (metric, log),
//!   never silent.
//!
//! The plan covers as many watches promptly as the lanes allow: while every watch fits,
//! each is dedicated; beyond that the largest groups get feeds first (two lanes for a whole
//! group), then single watches get dedicated lanes (those that cannot be fed first, then the
//! members of groups too small to be worth a feed). A group whose every member could then be
//! dedicated gives its feed's lanes back. What remains goes first to the feeds that asked
//! for their status lanes, the largest groups first, then to members of fed groups, so that
//! fewer re-reads go through the feed. Within a group the watches that already hold a lane
//! keep it, then the oldest: a change of plan moves as few watches as it can.

use std::collections::{BTreeMap, BTreeSet};

/// The lanes a change feed holds: its queries of every check and of the catalog
/// ([`crate::feed`]).
pub(crate) const FEED_LANES: usize = 2;

/// The lanes of a feed's queries of the critical and the warning checks, which run only
/// while its group is large (`Settings::status_queries_from_checks`): only such a feed asks
/// for them, and gets both or neither, after every watch that would otherwise be swept.
/// Counted for every feed, they would keep idle lanes per group from the watches wherever
/// the queries do not run. Both or neither, so that what reaches the snapshot at once does
/// not depend on which status a check moves to.
pub(crate) const STATUS_LANES: usize = 2;

/// A watch, as the plan knows it: an id the server gave it.
pub(crate) type WatchId = u64;

/// What a watch is told to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Role {
    Dedicated,
    Fed,
    Swept,
}

/// The planner of one server: its watches, their groups and their current roles.
#[derive(Debug)]
pub(crate) struct Planner<G> {
    lanes: usize,
    /// In joining order (ids grow).
    watches: BTreeMap<WatchId, Entry<G>>,
    /// The groups whose running feed asks for its status lanes.
    statuses: BTreeSet<G>,
}

#[derive(Debug)]
struct Entry<G> {
    /// The change feed that can serve it; `None` when none can (its answers come from
    /// elsewhere than the feed sees, e.g. another cluster).
    group: Option<G>,
    role: Option<Role>,
}

/// A plan: every watch's role, the groups whose feeds run, and those of them given their
/// status lanes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan<G: Ord> {
    pub roles: BTreeMap<WatchId, Role>,
    pub feeds: BTreeSet<G>,
    pub statuses: BTreeSet<G>,
}

impl<G: Ord + Clone> Planner<G> {
    pub(crate) fn new(lanes: usize) -> Self {
        Planner { lanes, watches: BTreeMap::new(), statuses: BTreeSet::new() }
    }

    /// The groups whose feeds ask for their status lanes, replacing the last.
    pub(crate) fn want_status_lanes(&mut self, groups: BTreeSet<G>) {
        self.statuses = groups;
    }

    pub(crate) fn join(&mut self, id: WatchId, group: Option<G>) {
        self.watches.insert(id, Entry { group, role: None });
    }

    pub(crate) fn leave(&mut self, id: WatchId) {
        self.watches.remove(&id);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.watches.is_empty()
    }

    /// Plans, and remembers the roles it gave (the next plan keeps them where it can).
    pub(crate) fn plan(&mut self) -> Plan<G> {
        let plan = self.decide();
        // Both in id order, over the same watches.
        for (e, role) in self.watches.values_mut().zip(plan.roles.values()) {
            e.role = Some(*role);
        }
        plan
    }

    /// Linear in the watches (but for a lookup of each one's group): a plan follows the
    /// joins at start-up, while thousands of watches join (docs/benchmarks.md, "The
    /// doubled scale profile").
    fn decide(&self) -> Plan<G> {
        let (mut feeds, mut statuses) = (BTreeSet::new(), BTreeSet::new());
        if self.watches.len() <= self.lanes {
            let roles = self.watches.keys().map(|id| (*id, Role::Dedicated)).collect();
            return Plan { roles, feeds, statuses };
        }
        // Watches by position in id order: roles are then a list, not a map.
        let entries: Vec<(&WatchId, &Entry<G>)> = self.watches.iter().collect();
        let mut roles: Vec<Option<Role>> = vec![None; entries.len()];
        // Members by group, each with current lane holders first, then the oldest.
        let mut groups: BTreeMap<&G, Members> = BTreeMap::new();
        let mut loners = Members::default();
        for (i, (_, e)) in entries.iter().enumerate() {
            let members = match &e.group {
                Some(g) => groups.entry(g).or_default(),
                None => &mut loners,
            };
            members.push(i, e.role == Some(Role::Dedicated));
        }
        let groups: BTreeMap<&G, Vec<usize>> = groups.into_iter().map(|(g, m)| (g, m.in_order())).collect();
        let loners = loners.in_order();

        let mut free = self.lanes;
        // 1. Feeds for the groups a feed serves best: those larger than a feed's lanes,
        //    the largest first.
        let mut by_size: Vec<(&G, usize)> = groups.iter().map(|(g, m)| (*g, m.len())).collect();
        by_size.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        for (g, size) in &by_size {
            if *size > FEED_LANES && free >= FEED_LANES {
                feeds.insert((*g).clone());
                free -= FEED_LANES;
            }
        }
        // 2. One lane each: the watches no feed can serve, then the members of groups too
        //    small for a feed (or that got none), smallest groups first.
        let mut unfed: Vec<(&G, &Vec<usize>)> =
            groups.iter().filter(|(g, _)| !feeds.contains(**g)).map(|(g, m)| (*g, m)).collect();
        unfed.sort_by_key(|(g, m)| (m.len(), *g));
        for i in loners.iter().chain(unfed.iter().flat_map(|(_, m)| m.iter())) {
            if free == 0 {
                break;
            }
            roles[*i] = Some(Role::Dedicated);
            free -= 1;
        }
        // 3. A group whose members can all get one gives its feed's lanes back (smallest
        //    groups first, where that is likeliest).
        let mut fed: Vec<(&G, &Vec<usize>)> =
            groups.iter().filter(|(g, _)| feeds.contains(**g)).map(|(g, m)| (*g, m)).collect();
        fed.sort_by_key(|(g, m)| (m.len(), *g));
        for (g, members) in &fed {
            if members.len() <= free + FEED_LANES {
                feeds.remove(*g);
                free = free + FEED_LANES - members.len();
                members.iter().for_each(|i| roles[*i] = Some(Role::Dedicated));
            }
        }
        // 4. Status lanes for the feeds that ask, the largest groups first: two serve every
        //    member's health at once.
        for (g, _) in fed.iter().rev().filter(|(g, _)| feeds.contains(*g) && self.statuses.contains(*g)) {
            if free < STATUS_LANES {
                break;
            }
            statuses.insert((*g).clone());
            free -= STATUS_LANES;
        }
        // 5. What remains: dedicated members of fed groups.
        for (_, members) in fed.iter().filter(|(g, _)| feeds.contains(*g)) {
            for i in members.iter().take(free) {
                roles[*i] = Some(Role::Dedicated);
            }
            free -= members.len().min(free);
        }
        let roles = entries
            .iter()
            .zip(roles)
            .map(|((id, e), role)| {
                let role = role.unwrap_or(match &e.group {
                    Some(g) if feeds.contains(g) => Role::Fed,
                    _ => Role::Swept,
                });
                (**id, role)
            })
            .collect();
        Plan { roles, feeds, statuses }
    }
}

/// Positions of watches, in id order, split by whether each holds a lane now.
#[derive(Default)]
struct Members {
    holders: Vec<usize>,
    others: Vec<usize>,
}

impl Members {
    fn push(&mut self, i: usize, holds_lane: bool) {
        if holds_lane { &mut self.holders } else { &mut self.others }.push(i);
    }

    /// Lane holders first, then the others; each in id order.
    fn in_order(mut self) -> Vec<usize> {
        self.holders.append(&mut self.others);
        self.holders
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(p: &Plan<&'static str>, role: Role) -> usize {
        p.roles.values().filter(|r| **r == role).count()
    }

    /// Lanes used: a feed's per feed, the status lanes, one per dedicated watch.
    fn used(p: &Plan<&'static str>) -> usize {
        FEED_LANES * p.feeds.len() + STATUS_LANES * p.statuses.len() + count(p, Role::Dedicated)
    }

    fn planner(lanes: usize, groups: &[(&'static str, usize)]) -> Planner<&'static str> {
        let mut p = Planner::new(lanes);
        let mut id = 0;
        for (g, n) in groups {
            for _ in 0..*n {
                p.join(id, (!g.is_empty()).then_some(*g));
                id += 1;
            }
        }
        p
    }

    #[test]
    fn while_every_watch_fits_each_is_dedicated() {
        let p = planner(5, &[("a", 3), ("b", 2)]).plan();
        assert_eq!(count(&p, Role::Dedicated), 5);
        assert!(p.feeds.is_empty());
    }

    #[test]
    fn beyond_the_lanes_every_group_gets_a_feed_and_nothing_is_swept() {
        // Three groups of four on seven lanes: three feeds (six lanes), one dedicated.
        let p = planner(7, &[("a", 4), ("b", 4), ("c", 4)]).plan();
        assert_eq!(p.feeds, BTreeSet::from(["a", "b", "c"]));
        assert_eq!(count(&p, Role::Swept), 0);
        assert_eq!(count(&p, Role::Dedicated), 1);
        assert_eq!(used(&p), 7);
    }

    #[test]
    fn the_default_budget_at_scale_runs_one_feed_and_fills_the_rest_with_dedicated_queries() {
        // 1,000 watches of one scope, 90 lanes (a budget of 100 less its 10 reads).
        let p = planner(90, &[("a", 1000)]).plan();
        assert_eq!(p.feeds.len(), 1);
        assert_eq!(count(&p, Role::Dedicated), 88);
        assert_eq!(count(&p, Role::Fed), 912);
        assert!(p.statuses.is_empty(), "no feed asked for its status lanes");
    }

    #[test]
    fn a_feed_that_asks_gets_its_status_lanes_after_what_would_be_swept_largest_group_first() {
        let wanting = |lanes| {
            let mut p = planner(lanes, &[("", 2), ("a", 10), ("b", 8), ("c", 8)]);
            p.want_status_lanes(BTreeSet::from(["a", "b"]));
            p.plan()
        };
        // Three feeds (six lanes) and the two loners: no lane left for the status queries.
        let p = wanting(8);
        assert_eq!(p.feeds, BTreeSet::from(["a", "b", "c"]));
        assert!(p.statuses.is_empty(), "{p:?}");
        assert_eq!((count(&p, Role::Dedicated), count(&p, Role::Swept)), (2, 0));
        // One more: not both of a feed's, so a member's.
        let p = wanting(9);
        assert!(p.statuses.is_empty(), "{p:?}");
        assert_eq!(count(&p, Role::Dedicated), 3);
        // Two more: the largest group's; four more: both that asked, and c, which did not
        // ask, none.
        assert_eq!(wanting(10).statuses, BTreeSet::from(["a"]));
        let p = wanting(13);
        assert_eq!(p.statuses, BTreeSet::from(["a", "b"]));
        assert_eq!((used(&p), count(&p, Role::Dedicated)), (13, 3), "the last lane to a member: {p:?}");
        // The default budget at scale: the status lanes come out of the dedicated watches.
        let mut p = planner(90, &[("a", 1000)]);
        p.want_status_lanes(BTreeSet::from(["a"]));
        let p = p.plan();
        assert_eq!((p.statuses.len(), count(&p, Role::Dedicated)), (1, 86));
    }

    #[test]
    fn what_cannot_be_fed_is_dedicated_first_and_small_groups_take_single_lanes() {
        // Two watches no feed serves, a group of 2, a group of 10, on 5 lanes: the group
        // of 10 gets a feed (2), the loners 2 lanes, one of the pair the last lane.
        let p = planner(5, &[("", 2), ("pair", 2), ("big", 10)]).plan();
        assert_eq!(p.feeds, BTreeSet::from(["big"]));
        assert_eq!([p.roles[&0], p.roles[&1]], [Role::Dedicated; 2]);
        assert_eq!(count(&p, Role::Swept), 1, "one of the pair waits for the sweep: {p:?}");
        assert_eq!(used(&p), 5);
    }

    #[test]
    fn when_lanes_run_out_the_largest_groups_keep_their_feeds_and_the_rest_is_swept() {
        let p = planner(4, &[("a", 3), ("b", 5), ("c", 9)]).plan();
        assert_eq!(p.feeds, BTreeSet::from(["b", "c"]));
        assert_eq!(count(&p, Role::Swept), 3, "{p:?}");
        let p = planner(1, &[("a", 3)]).plan();
        assert!(p.feeds.is_empty());
        assert_eq!((count(&p, Role::Dedicated), count(&p, Role::Swept)), (1, 2));
        let p = planner(0, &[("a", 3)]).plan();
        assert_eq!(count(&p, Role::Swept), 3);
    }

    #[test]
    fn a_group_fully_dedicated_gives_its_feed_back() {
        // 9 lanes, groups of 3 and 8: feeds for both (4 lanes), then the group of 3 can be
        // dedicated entirely for one more lane (its feed's two back): feed only for the 8.
        let p = planner(9, &[("small", 3), ("big", 8)]).plan();
        assert_eq!(p.feeds, BTreeSet::from(["big"]));
        assert_eq!(used(&p), 9);
        assert_eq!(count(&p, Role::Swept), 0);
        for id in 0..3 {
            assert_eq!(p.roles[&id], Role::Dedicated);
        }
    }

    #[test]
    fn lane_holders_keep_their_lanes_and_a_freed_lane_goes_to_a_fed_watch() {
        let mut p = planner(3, &[("a", 4)]);
        let first = p.plan();
        assert_eq!(first.feeds.len(), 1);
        let holder = *first.roles.iter().find(|(_, r)| **r == Role::Dedicated).unwrap().0;
        // A newcomer does not take the holder's lane.
        p.join(100, Some("a"));
        let second = p.plan();
        assert_eq!(second.roles[&holder], Role::Dedicated);
        assert_eq!(second.roles[&100], Role::Fed);
        // The holder leaves: its lane goes to the oldest fed watch.
        p.leave(holder);
        let third = p.plan();
        let promoted: Vec<_> = third.roles.iter().filter(|(_, r)| **r == Role::Dedicated).map(|(id, _)| *id).collect();
        assert_eq!(promoted.len(), 1);
        assert_ne!(promoted[0], 100, "the oldest fed watch, not the newcomer");
        // Down to what fits: everyone dedicated, no feed.
        for id in [0, 1, 2, 3] {
            p.leave(id);
        }
        let last = p.plan();
        assert!(last.feeds.is_empty());
        assert_eq!(last.roles.values().collect::<Vec<_>>(), [&Role::Dedicated]);
    }

    #[test]
    fn plans_never_use_more_lanes_than_there_are() {
        // Every mix of up to four groups and loners on up to 12 lanes.
        for lanes in 0..12 {
            for a in 0..6 {
                for b in 0..6 {
                    for (loners, wanting) in (0..4).flat_map(|l| [(l, vec![]), (l, vec!["a"]), (l, vec!["a", "b"])]) {
                        let mut p = planner(lanes, &[("a", a), ("b", b), ("", loners)]);
                        p.want_status_lanes(wanting.into_iter().collect());
                        let p = p.plan();
                        assert!(used(&p) <= lanes, "{lanes} lanes, a={a} b={b} loners={loners}: {p:?}");
                        assert!(p.statuses.is_subset(&p.feeds), "{p:?}");
                        assert_eq!(p.roles.len(), a + b + loners);
                        // Ids 0..a are group a's, a..a+b group b's.
                        for (g, ids) in [("a", 0..a), ("b", a..a + b)] {
                            let fed = ids.clone().filter(|id| p.roles[&(*id as u64)] == Role::Fed).count();
                            assert_eq!(p.feeds.contains(g), fed > 0, "feed {g} iff a member is fed: {p:?}");
                        }
                    }
                }
            }
        }
    }
}

/// What a plan costs at the doubled scale profile's size (docs/benchmarks.md, "Measured
/// design choices"): `cargo test --release -p consul-watch --lib plan::bench -- --ignored
/// --nocapture`.
#[cfg(test)]
mod bench {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    #[ignore = "a benchmark: run with --ignored --nocapture"]
    fn a_plan_of_ten_thousand_watches_of_one_scope() {
        // 90 lanes: a budget of 100 less its reads. Keys as long as a scope's.
        let scope = "http://127.0.0.1:8500 dc1 default default token-digest".to_owned();
        let mut planner = Planner::new(90);
        for id in 0..10_000 {
            planner.join(id, Some(scope.clone()));
        }
        planner.plan();
        let mut times: Vec<Duration> = (0..101)
            .map(|i| {
                // As at a cold start: one more watch, then a plan.
                planner.join(20_000 + i, Some(scope.clone()));
                let started = Instant::now();
                std::hint::black_box(planner.plan());
                started.elapsed()
            })
            .collect();
        times.sort();
        println!(
            "a plan of 10,000 watches of one scope on 90 lanes: {:?} / {:?} / {:?} (min / median / max of 101)",
            times[0], times[50], times[100]
        );
    }
}
