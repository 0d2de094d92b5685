//! What the change feed's answers say must be re-read: the pure diffing behind the feed
//! (docs/consul.md, "Services without a blocking query of their own"), free of I/O so it
//! is unit tested directly.
//!
//! Two views, one per feed query:
//! - [`ChecksView`] over `/v1/health/state/any`: the checks table's index moves on every
//!   check write, and each check's `ModifyIndex` names the write that last changed it, so a
//!   new answer names exactly the services (and, for node checks, the nodes) whose health
//!   may have changed. It also remembers which raft indexes were check writes.
//! - [`CatalogView`] over `/v1/catalog/services`: its index moves when a service instance
//!   is registered, changed or removed, but its body (names and tags) shows only some of
//!   those changes. A move is accounted for when every raft index it spans was a check
//!   write the checks view saw (a registration that carries its check writes both at one
//!   index); anything else (a port change that does not rewrite its check, a check-less
//!   registration, writes the feed did not see one by one) calls for re-reading everything.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::client::parse::CheckRow;

/// What to re-read. Service names are lower case: Consul compares them case-insensitively.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Stale {
    pub services: BTreeSet<String>,
    /// Nodes whose node checks changed: every instance on them.
    pub nodes: BTreeSet<String>,
    /// Service names new to the catalog. A watch of a service's Connect proxies cannot know
    /// the name of a proxy it has not seen yet (any name may name the service as its
    /// destination): it re-reads when a name appears.
    pub appeared: BTreeSet<String>,
    pub everything: bool,
}

impl Stale {
    pub(crate) fn everything() -> Stale {
        Stale { everything: true, ..Stale::default() }
    }

    pub(crate) fn is_empty(&self) -> bool {
        !self.everything && self.services.is_empty() && self.nodes.is_empty() && self.appeared.is_empty()
    }

    fn check(&mut self, node: &str, service: &str) {
        if service.is_empty() {
            self.nodes.insert(node.to_owned());
        } else {
            self.services.insert(service.to_ascii_lowercase());
        }
    }
}

/// How many recent check-write indexes are remembered, and the widest catalog move that is
/// checked index by index (a wider one is simply not accounted for).
const REMEMBERED_WRITES: usize = 4096;
const WIDEST_ACCOUNTED_MOVE: u64 = 1024;

/// The last answer of `/v1/health/state/any`.
#[derive(Debug, Default)]
pub(crate) struct ChecksView {
    index: Option<u64>,
    /// Node -> check ID -> what the view knows of the check. Updated in place and looked up
    /// by the answer's borrowed strings: at 75,000 checks, building a new map per answer
    /// (and dropping the old one) was a tenth of the operator's CPU per change.
    checks: HashMap<String, HashMap<String, Known>>,
    /// Which answer `Known::seen` refers to.
    generation: u64,
    /// Raft indexes at which the view saw a check written or removed.
    writes: BTreeSet<u64>,
}

#[derive(Debug)]
struct Known {
    service: String,
    modify_index: u64,
    /// The last answer (generation) that had it: those not in the latest were removed.
    seen: u64,
}

impl ChecksView {
    pub(crate) fn index(&self) -> Option<u64> {
        self.index
    }

    /// Takes a new answer; returns what changed since the previous one. The first answer,
    /// and one whose index went backwards (a restored or rebuilt cluster), change everything.
    pub(crate) fn apply(&mut self, index: u64, rows: Vec<CheckRow<'_>>) -> Stale {
        let previous = self.index.replace(index);
        let mut stale = Stale::default();
        let base = match previous {
            Some(base) if index >= base => Some(base),
            _ => {
                stale.everything = true;
                self.writes.clear();
                self.checks.clear();
                None
            }
        };
        self.generation += 1;
        let seen = self.generation;
        for row in rows {
            if let Some(base) = base
                && row.modify_index > base
            {
                stale.check(&row.node, &row.service);
                self.writes.insert(row.modify_index);
            }
            if !self.checks.contains_key(row.node.as_ref()) {
                self.checks.insert(row.node.clone().into_owned(), HashMap::new());
            }
            let on_node = self.checks.get_mut(row.node.as_ref()).expect("inserted above");
            match on_node.get_mut(row.check_id.as_ref()) {
                Some(known) => {
                    known.modify_index = row.modify_index;
                    known.seen = seen;
                    if known.service != row.service {
                        known.service = row.service.into_owned();
                    }
                }
                None => {
                    let known = Known { service: row.service.into_owned(), modify_index: row.modify_index, seen };
                    on_node.insert(row.check_id.into_owned(), known);
                }
            }
        }
        let mut removed = false;
        for (node, on_node) in &mut self.checks {
            on_node.retain(|_, k| {
                let kept = k.seen == seen;
                if !kept && base.is_some() {
                    stale.check(node, &k.service);
                    removed = true;
                }
                kept
            });
        }
        self.checks.retain(|_, on_node| !on_node.is_empty());
        // The table's index is its latest write; when no remaining check carries it, that
        // write was a removal, and the removals above account for it.
        if removed && !self.checks.values().flat_map(HashMap::values).any(|k| k.modify_index == index) {
            self.writes.insert(index);
        }
        while self.writes.len() > REMEMBERED_WRITES {
            self.writes.pop_first();
        }
        stale
    }

    /// Whether every raft index in `(after, upto]` was a check write this view saw.
    pub(crate) fn accounts_for(&self, after: u64, upto: u64) -> bool {
        upto > after && upto - after <= WIDEST_ACCOUNTED_MOVE && (after + 1..=upto).all(|i| self.writes.contains(&i))
    }
}

/// How the catalog moved between two answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CatalogMove {
    /// The first answer: nothing to compare with.
    Baseline,
    /// Same index, or an identical body on a new index with nothing in between to explain.
    Unchanged,
    /// The index went backwards: a restored or rebuilt cluster.
    Restarted,
    /// The index moved over `(after, upto]`; `named` are the services whose name or tags
    /// appeared, disappeared or changed, `appeared` those new to the catalog.
    Moved { named: BTreeSet<String>, appeared: BTreeSet<String>, after: u64, upto: u64 },
}

/// The last answer of `/v1/catalog/services`.
#[derive(Debug, Default)]
pub(crate) struct CatalogView {
    index: Option<u64>,
    services: BTreeMap<String, Vec<String>>,
}

impl CatalogView {
    pub(crate) fn apply(&mut self, index: u64, services: BTreeMap<String, Vec<String>>) -> CatalogMove {
        let previous = self.index.replace(index);
        let old = std::mem::replace(&mut self.services, services);
        match previous {
            None => CatalogMove::Baseline,
            Some(p) if index < p => CatalogMove::Restarted,
            Some(p) if index == p => CatalogMove::Unchanged,
            Some(after) => {
                let (mut named, mut appeared) = (BTreeSet::new(), BTreeSet::new());
                for (name, tags) in &self.services {
                    match old.get(name) {
                        Some(was) if was == tags => {}
                        Some(_) => {
                            named.insert(name.to_ascii_lowercase());
                        }
                        None => {
                            named.insert(name.to_ascii_lowercase());
                            appeared.insert(name.to_ascii_lowercase());
                        }
                    }
                }
                named.extend(old.keys().filter(|n| !self.services.contains_key(*n)).map(|n| n.to_ascii_lowercase()));
                CatalogMove::Moved { named, appeared, after, upto: index }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(node: &str, check: &str, service: &str, modify_index: u64) -> CheckRow<'static> {
        let owned = |s: &str| std::borrow::Cow::Owned(s.to_owned());
        CheckRow { node: owned(node), check_id: owned(check), service: owned(service), modify_index }
    }

    fn names(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn checks_name_the_services_and_nodes_that_changed() {
        let mut v = ChecksView::default();
        let base = vec![row("n1", "serfHealth", "", 5), row("n1", "svc:web", "Web", 6), row("n2", "svc:api", "api", 7)];
        assert!(v.apply(7, base.clone()).everything, "the first answer is a baseline: everything");

        // web's check flips at 8.
        let mut next = base.clone();
        next[1].modify_index = 8;
        let s = v.apply(8, next.clone());
        assert_eq!(s, Stale { services: names(&["web"]), ..Stale::default() });
        assert!(v.accounts_for(7, 8));

        // A node check flips at 9: the node, not a service.
        next[0].modify_index = 9;
        assert_eq!(v.apply(9, next.clone()), Stale { nodes: names(&["n1"]), ..Stale::default() });

        // api's check is removed at 10 (its instance deregistered).
        next.remove(2);
        assert_eq!(v.apply(10, next.clone()), Stale { services: names(&["api"]), ..Stale::default() });
        assert!(v.accounts_for(9, 10), "a removal is the table's latest write");

        // A timeout: same index, nothing changed.
        assert!(v.apply(10, next.clone()).is_empty());

        // The index goes backwards: everything, and no old write accounts for anything.
        assert!(v.apply(3, next).everything);
        assert!(!v.accounts_for(7, 8));
    }

    #[test]
    fn only_writes_seen_one_by_one_account_for_a_move() {
        let mut v = ChecksView::default();
        v.apply(10, vec![row("n", "a", "a", 10), row("n", "b", "b", 10)]);
        // Two check writes at 12 and 13; 11 was something else.
        v.apply(13, vec![row("n", "a", "a", 12), row("n", "b", "b", 13)]);
        assert!(v.accounts_for(11, 13));
        assert!(!v.accounts_for(10, 13), "index 11 is unexplained");
        assert!(!v.accounts_for(13, 13), "an empty move is not accounted for");
        // A check rewritten twice between answers shows only its last write.
        v.apply(16, vec![row("n", "a", "a", 16), row("n", "b", "b", 13)]);
        assert!(v.accounts_for(15, 16));
        assert!(!v.accounts_for(13, 16));
    }

    #[test]
    fn catalog_moves_name_what_the_body_shows() {
        let mut c = CatalogView::default();
        let m = |pairs: &[(&str, &[&str])]| -> BTreeMap<String, Vec<String>> {
            pairs.iter().map(|(n, t)| (n.to_string(), t.iter().map(|s| s.to_string()).collect())).collect()
        };
        assert_eq!(c.apply(5, m(&[("web", &["a"]), ("api", &[])])), CatalogMove::Baseline);
        assert_eq!(c.apply(5, m(&[("web", &["a"]), ("api", &[])])), CatalogMove::Unchanged);
        assert_eq!(
            c.apply(8, m(&[("Web", &["a", "b"]), ("db", &[])])),
            CatalogMove::Moved {
                named: names(&["web", "api", "db"]),
                appeared: names(&["web", "db"]),
                after: 5,
                upto: 8
            },
            "web's spelling and tags changed (a new spelling is a new key), api left, db came"
        );
        assert_eq!(
            c.apply(9, m(&[("Web", &["a", "b"]), ("db", &[])])),
            CatalogMove::Moved { named: BTreeSet::new(), appeared: BTreeSet::new(), after: 8, upto: 9 },
            "a port change shows in the index only"
        );
        assert_eq!(c.apply(2, m(&[])), CatalogMove::Restarted);
    }
}
