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

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

use crate::client::parse::{self, CheckRow};

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
pub(crate) const WIDEST_ACCOUNTED_MOVE: u64 = 1024;

/// Whether a catalog move over `(after, upto]` is checked index by index: by the checks
/// view's accounting, and by locating its writes ([`crate::locate`]).
pub(crate) fn checked_index_by_index(after: u64, upto: u64) -> bool {
    upto > after && upto - after <= WIDEST_ACCOUNTED_MOVE
}

/// Hashes the view's keys, which are hashes already (xxh3 of a check's bytes), by folding
/// them: hashing 75,000 of them again with the default SipHash twice per answer was a
/// tenth of what the answer cost.
#[derive(Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u128` keys are hashed here; anything else still gets a fair hash.
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
    }

    fn write_u128(&mut self, n: u128) {
        self.0 ^= n as u64 ^ (n >> 64) as u64;
    }
}

/// The last answer of `/v1/health/state/any`.
#[derive(Debug, Default)]
pub(crate) struct ChecksView {
    index: Option<u64>,
    /// Each check by the hash of its bytes in the answers ([`CheckBytes`]): a check whose
    /// bytes come back is unchanged and is neither read nor looked up by name. At 75,000
    /// checks, reading each and finding it by node and ID in every answer was most of what
    /// an answer cost the feed.
    checks: HashMap<u128, Known, BuildHasherDefault<Prehashed>>,
    /// Which answer `Known::seen` refers to.
    generation: u64,
    /// Raft indexes at which the view saw a check written or removed.
    writes: BTreeSet<u64>,
}

#[derive(Debug)]
struct Known {
    /// Node, check ID and service name, one after the other in one allocation: at 75,000
    /// checks, three strings each were 5 MB more of the operator's peak memory.
    names: Box<str>,
    node_end: usize,
    check_end: usize,
    modify_index: u64,
    /// The last answer (generation) that had it: those not in the latest were removed.
    seen: u64,
}

impl Known {
    fn new(row: &CheckRow<'_>, seen: u64) -> Known {
        let names = [&*row.node, &*row.check_id, &*row.service].concat().into_boxed_str();
        let (node_end, check_end) = (row.node.len(), row.node.len() + row.check_id.len());
        Known { names, node_end, check_end, modify_index: row.modify_index, seen }
    }

    fn node(&self) -> &str {
        &self.names[..self.node_end]
    }

    fn check_id(&self) -> &str {
        &self.names[self.node_end..self.check_end]
    }

    fn service(&self) -> &str {
        &self.names[self.check_end..]
    }
}

impl ChecksView {
    pub(crate) fn index(&self) -> Option<u64> {
        self.index
    }

    /// Takes a new answer's body, as it is read (see [`parse::StateSplit`]); returns what
    /// changed since the previous answer. The first answer, and one whose index went
    /// backwards (a restored or rebuilt cluster), change everything. A malformed answer is
    /// an error, and the view is left as it was.
    pub(crate) fn apply(&mut self, index: u64, body: impl std::io::Read) -> Result<Stale, String> {
        let base = self.index.filter(|base| index >= *base);
        // This answer's generation, taken even if the answer turns out malformed: the checks
        // it marked seen before failing then carry a generation that never comes again.
        self.generation += 1;
        let seen = self.generation;
        // The checks not known by their bytes, read; the known ones marked seen.
        let mut new = Vec::new();
        let mut split = parse::StateSplit::new(body);
        while let Some(check) = split.next()? {
            if base.is_some()
                && let Some(known) = self.checks.get_mut(&check.hash)
            {
                known.seen = seen;
                continue;
            }
            match check.read().map(|row| Known::new(&row, seen)) {
                Ok(known) => new.push((check.hash, known)),
                // A quick split's piece that is no check: split again, exactly, from there.
                Err(e) if !split.split_exactly() => return Err(e),
                Err(_) => {}
            }
        }
        drop(split);

        self.index = Some(index);
        let mut stale = Stale::default();
        if base.is_none() {
            stale.everything = true;
            self.writes.clear();
            self.checks.clear();
        }
        // A check whose bytes changed comes back under a new hash: its old entry is replaced,
        // not removed.
        let mut rewritten = HashSet::new();
        for (hash, known) in new {
            if let Some(base) = base {
                if known.modify_index > base {
                    stale.check(known.node(), known.service());
                    self.writes.insert(known.modify_index);
                }
                rewritten.insert((Cow::Owned(known.node().to_owned()), Cow::Owned(known.check_id().to_owned())));
            }
            self.checks.insert(hash, known);
        }
        let mut removed = false;
        self.checks.retain(|_, k| {
            let kept = k.seen == seen;
            if !kept && !rewritten.contains(&(Cow::Borrowed(k.node()), Cow::Borrowed(k.check_id()))) {
                stale.check(k.node(), k.service());
                removed = true;
            }
            kept
        });
        // The table's index is its latest write; when no remaining check carries it, that
        // write was a removal, and the removals above account for it.
        if removed && !self.checks.values().any(|k| k.modify_index == index) {
            self.writes.insert(index);
        }
        while self.writes.len() > REMEMBERED_WRITES {
            self.writes.pop_first();
        }
        Ok(stale)
    }

    /// Whether every raft index in `(after, upto]` was a check write this view saw.
    pub(crate) fn accounts_for(&self, after: u64, upto: u64) -> bool {
        checked_index_by_index(after, upto) && (after + 1..=upto).all(|i| self.wrote(i))
    }

    /// Whether raft index `index` was a check write (or removal) this view saw.
    pub(crate) fn wrote(&self, index: u64) -> bool {
        self.writes.contains(&index)
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
    /// A hash of the last body: most moves (a port change, a check written with its
    /// registration) leave the names and tags as they were, and then the body, 70 KB at
    /// 5,000 services, is not read and compared again.
    body: u128,
}

impl CatalogView {
    /// Takes a new answer's body. A malformed one is an error, and the view is left as it was.
    pub(crate) fn apply(&mut self, index: u64, body: &[u8]) -> Result<CatalogMove, String> {
        let hash = xxhash_rust::xxh3::xxh3_128(body);
        if let Some(previous) = self.index
            && hash == self.body
        {
            // Names and tags as they were: only the index says anything.
            self.index = Some(index);
            return Ok(match index.cmp(&previous) {
                std::cmp::Ordering::Less => CatalogMove::Restarted,
                std::cmp::Ordering::Equal => CatalogMove::Unchanged,
                std::cmp::Ordering::Greater => CatalogMove::Moved {
                    named: BTreeSet::new(),
                    appeared: BTreeSet::new(),
                    after: previous,
                    upto: index,
                },
            });
        }
        let services = parse::catalog_services(body)?;
        self.body = hash;
        Ok(self.services_moved(index, services))
    }

    /// How the catalog moved to `index`, where it holds `services`.
    fn services_moved(&mut self, index: u64, services: BTreeMap<String, Vec<String>>) -> CatalogMove {
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

    /// The answer an agent would send for `rows`.
    fn answer(rows: &[CheckRow<'_>]) -> Vec<u8> {
        serde_json::to_vec(
            &rows
                .iter()
                .map(|r| {
                    serde_json::json!({"Node": r.node, "CheckID": r.check_id, "Name": "n", "Status": "passing",
                        "ServiceName": r.service, "CreateIndex": 1, "ModifyIndex": r.modify_index})
                })
                .collect::<Vec<_>>(),
        )
        .unwrap()
    }

    /// That answer, through the feed's reader.
    fn apply(v: &mut ChecksView, index: u64, rows: &[CheckRow<'_>]) -> Stale {
        v.apply(index, &answer(rows)[..]).unwrap()
    }

    fn names(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn checks_name_the_services_and_nodes_that_changed() {
        let mut v = ChecksView::default();
        let base = vec![row("n1", "serfHealth", "", 5), row("n1", "svc:web", "Web", 6), row("n2", "svc:api", "api", 7)];
        assert!(apply(&mut v, 7, &base).everything, "the first answer is a baseline: everything");

        // web's check flips at 8.
        let mut next = base.clone();
        next[1].modify_index = 8;
        let s = apply(&mut v, 8, &next);
        assert_eq!(s, Stale { services: names(&["web"]), ..Stale::default() });
        assert!(v.accounts_for(7, 8));

        // A node check flips at 9: the node, not a service.
        next[0].modify_index = 9;
        assert_eq!(apply(&mut v, 9, &next), Stale { nodes: names(&["n1"]), ..Stale::default() });

        // api's check is removed at 10 (its instance deregistered).
        next.remove(2);
        assert_eq!(apply(&mut v, 10, &next), Stale { services: names(&["api"]), ..Stale::default() });
        assert!(v.accounts_for(9, 10), "a removal is the table's latest write");

        // A timeout: same index, nothing changed.
        assert!(apply(&mut v, 10, &next).is_empty());

        // The index goes backwards: everything, and no old write accounts for anything.
        assert!(apply(&mut v, 3, &next).everything);
        assert!(!v.accounts_for(7, 8));
    }

    #[test]
    fn only_writes_seen_one_by_one_account_for_a_move() {
        let mut v = ChecksView::default();
        apply(&mut v, 10, &[row("n", "a", "a", 10), row("n", "b", "b", 10)]);
        // Two check writes at 12 and 13; 11 was something else.
        apply(&mut v, 13, &[row("n", "a", "a", 12), row("n", "b", "b", 13)]);
        assert!(v.accounts_for(11, 13));
        assert!(!v.accounts_for(10, 13), "index 11 is unexplained");
        assert!(!v.accounts_for(13, 13), "an empty move is not accounted for");
        // A check rewritten twice between answers shows only its last write.
        apply(&mut v, 16, &[row("n", "a", "a", 16), row("n", "b", "b", 13)]);
        assert!(v.accounts_for(15, 16));
        assert!(!v.accounts_for(13, 16));
    }

    #[test]
    fn unchanged_checks_are_not_read_again() {
        let mut v = ChecksView::default();
        let base = [row("n1", "serfHealth", "", 5), row("n1", "svc:web", "web", 6)];
        apply(&mut v, 6, &base);
        // The same bytes with a malformed check beside them: only the new one is read, and
        // its error leaves the view as it was.
        let body = br#"[{"Node":"n1","CheckID":"serfHealth","Name":"n","Status":"passing","ServiceName":"","CreateIndex":1,"ModifyIndex":5},
            {"Node":"n1","CheckID":"svc:web","Name":"n","Status":"passing","ServiceName":"web","CreateIndex":1,"ModifyIndex":6},
            {"Node":7}]"#;
        assert!(v.apply(9, &body[..]).unwrap_err().contains("malformed check"));
        assert_eq!(v.index(), Some(6), "a failed answer changes nothing");
        // Not even which checks were seen last: after an answer that failed past both known
        // checks, web's check leaving is a removal still.
        let mut view = ChecksView::default();
        apply(&mut view, 6, &base);
        let mut failing = answer(&base);
        failing.pop();
        failing.extend_from_slice(br#",{"Node":7}]"#);
        assert!(view.apply(9, &failing[..]).is_err());
        assert_eq!(apply(&mut view, 9, &base[..1]), Stale { services: names(&["web"]), ..Stale::default() });
        // Whitespace around a check is not part of it: an agent's indentation is no change.
        let pretty = br#"[ {"Node":"n1","CheckID":"serfHealth","Name":"n","Status":"passing","ServiceName":"","CreateIndex":1,"ModifyIndex":5} ,
            {"Node":"n1","CheckID":"svc:web","Name":"n","Status":"passing","ServiceName":"web","CreateIndex":1,"ModifyIndex":6} ]"#;
        assert!(v.apply(7, &pretty[..]).unwrap().is_empty());
        assert!(!v.accounts_for(6, 7), "index 7 was no check write");
    }

    #[test]
    fn checks_holding_the_separator_are_split_exactly() {
        // `},{` in a string and in a nested value: a quick split cuts inside these checks,
        // and the view must split again rather than read pieces.
        let answer = |web: u64| {
            format!(
                r#"[{{"Node":"n1","CheckID":"svc:api","Output":"x}},{{\"Node\":\"n9\"}}","ServiceName":"api","ModifyIndex":5}},
                {{"Node":"n1","CheckID":"svc:db","Definition":{{"H":[{{}},{{}}]}},"ServiceName":"db","ModifyIndex":5}},
                {{"Node":"n2","CheckID":"svc:web","ServiceName":"web","ModifyIndex":{web}}}]"#
            )
            .replace('\n', "")
            .replace("  ", "")
        };
        let mut v = ChecksView::default();
        assert!(v.apply(6, answer(6).as_bytes()).unwrap().everything);
        assert!(v.apply(6, answer(6).as_bytes()).unwrap().is_empty(), "the same answer again: no change");
        let s = v.apply(8, answer(8).as_bytes()).unwrap();
        assert_eq!(s, Stale { services: names(&["web"]), ..Stale::default() }, "web only, no node n9");
    }

    #[test]
    fn a_check_rewritten_is_changed_not_removed() {
        let mut v = ChecksView::default();
        apply(&mut v, 6, &[row("n1", "svc:web", "web", 6), row("n2", "svc:api", "api", 6)]);
        // web's check rewritten at 8 (its bytes change), api's removed at 9.
        let s = apply(&mut v, 9, &[row("n1", "svc:web", "web", 8)]);
        assert_eq!(s, Stale { services: names(&["web", "api"]), ..Stale::default() });
        assert!(v.accounts_for(7, 9), "8 the rewrite, 9 the removal");
        // Rewritten again with an output that does not move ModifyIndex (not a write Consul
        // would send, but the view must not take it for a removal either).
        let body = br#"[{"Node":"n1","CheckID":"svc:web","Output":"slow","ServiceName":"web","ModifyIndex":8}]"#;
        assert!(v.apply(9, &body[..]).unwrap().is_empty());
        // And web's check is still known: removing it now names web.
        assert_eq!(apply(&mut v, 10, &[]), Stale { services: names(&["web"]), ..Stale::default() });
    }

    #[test]
    fn catalog_moves_name_what_the_body_shows() {
        let mut c = CatalogView::default();
        // The body an agent sends (keys sorted, as Go writes a map).
        let m = |pairs: &[(&str, &[&str])]| -> Vec<u8> {
            let map: BTreeMap<&str, &[&str]> = pairs.iter().copied().collect();
            serde_json::to_vec(&map).unwrap()
        };
        assert_eq!(c.apply(5, &m(&[("web", &["a"]), ("api", &[])])).unwrap(), CatalogMove::Baseline);
        assert_eq!(c.apply(5, &m(&[("web", &["a"]), ("api", &[])])).unwrap(), CatalogMove::Unchanged);
        assert_eq!(
            c.apply(8, &m(&[("Web", &["a", "b"]), ("db", &[])])).unwrap(),
            CatalogMove::Moved {
                named: names(&["web", "api", "db"]),
                appeared: names(&["web", "db"]),
                after: 5,
                upto: 8
            },
            "web's spelling and tags changed (a new spelling is a new key), api left, db came"
        );
        assert_eq!(
            c.apply(9, &m(&[("Web", &["a", "b"]), ("db", &[])])).unwrap(),
            CatalogMove::Moved { named: BTreeSet::new(), appeared: BTreeSet::new(), after: 8, upto: 9 },
            "a port change shows in the index only"
        );
        // The same body again at a lower index: not read, but a restart all the same.
        assert_eq!(c.apply(3, &m(&[("Web", &["a", "b"]), ("db", &[])])).unwrap(), CatalogMove::Restarted);
        // Names and tags as they were, written differently: read, and nothing named.
        assert_eq!(
            c.apply(4, br#"{ "db": [], "Web": ["b", "a"] }"#).unwrap(),
            CatalogMove::Moved { named: BTreeSet::new(), appeared: BTreeSet::new(), after: 3, upto: 4 }
        );
        // A malformed body changes nothing.
        assert!(c.apply(6, b"[]").is_err());
        assert_eq!(
            c.apply(5, &m(&[("Web", &["a", "b"])])).unwrap(),
            CatalogMove::Moved { named: names(&["db"]), appeared: BTreeSet::new(), after: 4, upto: 5 }
        );
        assert_eq!(c.apply(2, &m(&[])).unwrap(), CatalogMove::Restarted);
    }
}
