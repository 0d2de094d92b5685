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

    pub(crate) fn check(&mut self, node: &str, service: &str) {
        if service.is_empty() {
            self.nodes.insert(node.to_owned());
        } else {
            self.services.insert(service.to_ascii_lowercase());
        }
    }
}

/// What one answer of a checks view shows written since the last.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Written {
    /// The view's first answer, or one whose index went backwards: nothing to compare with.
    Everything,
    Checks(Vec<WrittenCheck>),
}

impl Written {
    /// Everything it names, as what to re-read (the feed names what no other answer named
    /// already: [`crate::woken`]).
    #[cfg(test)]
    pub(crate) fn stale(&self) -> Stale {
        match self {
            Written::Everything => Stale::everything(),
            Written::Checks(checks) => {
                let mut stale = Stale::default();
                checks.iter().for_each(|c| stale.check(&c.node, &c.service));
                stale
            }
        }
    }
}

/// A check an answer shows written, or gone.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct WrittenCheck {
    pub node: Box<str>,
    pub check_id: Box<str>,
    /// Empty for a node check.
    pub service: Box<str>,
    /// The index that wrote it (its `ModifyIndex`); `None` when it is gone, removed or no
    /// longer in the queried state, at some index up to the answer's.
    pub at: Option<u64>,
}

impl WrittenCheck {
    fn of(known: &Known, at: Option<u64>) -> WrittenCheck {
        WrittenCheck {
            node: known.node().into(),
            check_id: known.check_id().into(),
            service: known.service().into(),
            at,
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

/// How far ahead of where it is expected a check of a new answer is looked for in the last
/// answer's order before it is looked up in the view's map: far enough to step over a few
/// removed checks, near enough to stay in eight cache lines read in sequence.
const IN_STEP_AHEAD: usize = 32;

/// A set of the view's keys, hashed as the view hashes them.
type HashSetOfHashes = HashSet<u128, BuildHasherDefault<Prehashed>>;

/// The last answer of `/v1/health/state/any`.
#[derive(Debug, Default)]
pub(crate) struct ChecksView {
    index: Option<u64>,
    /// Each check by the hash of its bytes in the answers ([`CheckBytes`]): a check whose
    /// bytes come back is unchanged and is neither read nor looked up by name. At 75,000
    /// checks, reading each and finding it by node and ID in every answer was most of what
    /// an answer cost the feed. Its keys are exactly the hashes in `order`.
    checks: HashMap<u128, Known, BuildHasherDefault<Prehashed>>,
    /// The last answer's checks by hash, in its order. Agents answer checks in a stable
    /// order (the state store's: by node, then check ID), so a new answer is walked against
    /// the last one in step ([`InStep`]): a check where it was costs a comparison, and only
    /// the checks out of step touch `checks`. At 150,000 checks a map lookup per check was
    /// most of an answer's cost: each misses the cache.
    order: Vec<u128>,
    /// Raft indexes at which the view saw a check written or removed.
    writes: BTreeSet<u64>,
}

#[derive(Debug)]
struct Known {
    /// Node, check ID and service name, one after the other in one allocation: at 75,000
    /// checks, three strings each were 5 MB more of the operator's peak memory.
    names: Box<str>,
    /// Where the node and the check ID end in `names`: 32 bits each keep a map entry at 48
    /// bytes, not 64 (with its 128-bit key), 2.4 MB less at 150,000 checks.
    node_end: u32,
    check_end: u32,
    modify_index: u64,
}

impl Known {
    fn new(row: &CheckRow<'_>) -> Result<Known, String> {
        let names = [&*row.node, &*row.check_id, &*row.service].concat().into_boxed_str();
        let long = || format!("check {:?} of node {:?}: names longer than 4 GiB", row.check_id, row.node);
        let node_end = u32::try_from(row.node.len()).map_err(|_| long())?;
        let check_end = u32::try_from(row.node.len() + row.check_id.len()).map_err(|_| long())?;
        Ok(Known { names, node_end, check_end, modify_index: row.modify_index })
    }

    fn node(&self) -> &str {
        &self.names[..self.node_end as usize]
    }

    fn check_id(&self) -> &str {
        &self.names[self.node_end as usize..self.check_end as usize]
    }

    fn service(&self) -> &str {
        &self.names[self.check_end as usize..]
    }
}

/// A new answer's checks walked against the last answer's ([`ChecksView::order`]), one at
/// a time, in the answer's order. Between two answers almost every check is where it was,
/// so the walk expects each at a cursor in the last answer's order, and a check there is
/// known without a map lookup: sequential memory, no cache miss per check. A check a little
/// ahead steps the cursor over the checks before it (removed, or moved); one nowhere near is
/// looked up in the map, which is what keeps the result independent of the order: a
/// reordered answer costs lookups, never a wrong diff.
///
/// The walk only reads the view: an answer found malformed halfway leaves no trace.
struct InStep<'a> {
    /// The last answer's checks, by hash, in its order.
    last: &'a [u128],
    /// The same checks by hash, for those out of step.
    known: &'a HashMap<u128, Known, BuildHasherDefault<Prehashed>>,
    /// Where in `last` the next check of the answer is expected.
    at: usize,
    /// Checks of `last` the cursor stepped over: gone, unless they turn up out of step.
    passed: Vec<u128>,
    /// Known checks found out of step, by the map.
    moved: HashSetOfHashes,
}

impl<'a> InStep<'a> {
    fn new(view: &'a ChecksView) -> Self {
        InStep { last: &view.order, known: &view.checks, at: 0, passed: Vec::new(), moved: HashSetOfHashes::default() }
    }

    /// Whether the check hashed `hash` is in the last answer (its bytes unchanged). When it
    /// is not, the walk is as it was: a piece the split takes back leaves nothing behind.
    fn known(&mut self, hash: u128) -> bool {
        self.ahead(hash) || self.out_of_step(hash)
    }

    /// Finds `hash` at the cursor or a little ahead of it, and moves the cursor past it.
    fn ahead(&mut self, hash: u128) -> bool {
        let ahead = &self.last[self.at..self.last.len().min(self.at + IN_STEP_AHEAD)];
        let Some(i) = ahead.iter().position(|h| *h == hash) else {
            return false;
        };
        self.passed.extend_from_slice(&ahead[..i]);
        self.at += i + 1;
        true
    }

    /// Finds `hash` anywhere in the last answer, by the map: a check out of step.
    fn out_of_step(&mut self, hash: u128) -> bool {
        let known = self.known.contains_key(&hash);
        if known {
            self.moved.insert(hash);
        }
        known
    }

    /// The hashes of the last answer's checks that the new answer, whose checks are
    /// `answer` in order, no longer has. Only these are looked up in the map to be removed.
    fn gone(mut self, answer: &[u128]) -> Vec<u128> {
        self.passed.extend_from_slice(&self.last[self.at..]);
        let moved = self.moved;
        let mut gone: Vec<u128> = self.passed.into_iter().filter(|h| !moved.contains(h)).collect();
        // A hash twice in the last answer (the same bytes twice) may have been stepped over
        // in one place and met in step in the other: then only the answer itself says
        // whether it is gone. The map holding fewer checks than `last` tells of that.
        if self.known.len() != self.last.len() && !gone.is_empty() {
            let candidates: HashSetOfHashes = gone.iter().copied().collect();
            let still: HashSetOfHashes = answer.iter().copied().filter(|h| candidates.contains(h)).collect();
            gone.retain(|h| !still.contains(h));
        }
        gone
    }
}

impl ChecksView {
    pub(crate) fn index(&self) -> Option<u64> {
        self.index
    }

    /// How many checks the last answer held.
    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }

    /// Takes a new answer's body, as it is read (see [`parse::StateSplit`]); returns what
    /// changed since the previous answer. The first answer, and one whose index went
    /// backwards (a restored or rebuilt cluster), change everything. A malformed answer is
    /// an error, and the view is left as it was.
    pub(crate) fn apply(&mut self, index: u64, body: impl std::io::Read) -> Result<Written, String> {
        let base = self.index.filter(|base| index >= *base);
        // Nothing of the view changes until the whole answer is read. Without a base every
        // check is read: none is compared with the last answer.
        let mut walk = base.map(|_| InStep::new(self));
        // This answer's checks by hash, in its order; the new ones (not known by their
        // bytes), read.
        let mut order = Vec::with_capacity(self.order.len());
        let mut new = Vec::new();
        let mut split = parse::StateSplit::new(body);
        while let Some(check) = split.next()? {
            let hash = check.hash;
            if let Some(walk) = &mut walk
                && walk.known(hash)
            {
                order.push(hash);
                continue;
            }
            match check.read().and_then(|row| Known::new(&row)) {
                Ok(known) => {
                    order.push(hash);
                    new.push((hash, known));
                }
                // A quick split's piece that is no check: split again, exactly, from there.
                Err(e) if !split.split_exactly() => return Err(e),
                Err(_) => {}
            }
        }
        drop(split);
        let gone = walk.map(|walk| walk.gone(&order)).unwrap_or_default();

        self.index = Some(index);
        self.order = order;
        let Some(base) = base else {
            self.writes.clear();
            self.checks.clear();
            self.checks.extend(new);
            return Ok(Written::Everything);
        };
        let mut written = Vec::new();
        let removed = self.forget(gone, &new, &mut written);
        for (hash, known) in new {
            if known.modify_index > base {
                written.push(WrittenCheck::of(&known, Some(known.modify_index)));
                self.writes.insert(known.modify_index);
            }
            self.checks.insert(hash, known);
        }
        // The table's index is its latest write; when no remaining check carries it, that
        // write was a removal, and the removals above account for it.
        if removed && !self.checks.values().any(|k| k.modify_index == index) {
            self.writes.insert(index);
        }
        while self.writes.len() > REMEMBERED_WRITES {
            self.writes.pop_first();
        }
        Ok(Written::Checks(written))
    }

    /// Drops the checks hashed `gone` from the view, adding them to `written`; whether any
    /// was removed. A check whose bytes changed comes back under a new hash (among `new`, by
    /// node and check ID): its old entry is replaced, not removed.
    fn forget(&mut self, gone: Vec<u128>, new: &[(u128, Known)], written: &mut Vec<WrittenCheck>) -> bool {
        if gone.is_empty() {
            return false;
        }
        let rewritten: HashSet<(&str, &str)> = new.iter().map(|(_, k)| (k.node(), k.check_id())).collect();
        let mut removed = false;
        for hash in gone {
            let Some(k) = self.checks.remove(&hash) else {
                continue;
            };
            if !rewritten.contains(&(k.node(), k.check_id())) {
                written.push(WrittenCheck::of(&k, None));
                removed = true;
            }
        }
        removed
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
    use consul_resolver_core::test_support::Rng;

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
        v.apply(index, &answer(rows)[..]).unwrap().stale()
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
        assert!(v.apply(7, &pretty[..]).unwrap().stale().is_empty());
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
        assert_eq!(v.apply(6, answer(6).as_bytes()).unwrap(), Written::Everything);
        assert!(v.apply(6, answer(6).as_bytes()).unwrap().stale().is_empty(), "the same answer again: no change");
        let s = v.apply(8, answer(8).as_bytes()).unwrap().stale();
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
        assert!(v.apply(9, &body[..]).unwrap().stale().is_empty());
        // And web's check is still known: removing it now names web.
        assert_eq!(apply(&mut v, 10, &[]), Stale { services: names(&["web"]), ..Stale::default() });
    }

    /// The hash each check of `rows` stands under in the view, in order.
    fn hashes(rows: &[CheckRow<'_>]) -> Vec<u128> {
        rows.iter()
            .map(|r| {
                let one = answer(std::slice::from_ref(r));
                xxhash_rust::xxh3::xxh3_128(&one[1..one.len() - 1])
            })
            .collect()
    }

    /// The view holds exactly the checks of its last answer, in their order.
    fn holds(v: &ChecksView, rows: &[CheckRow<'_>]) {
        assert_eq!(v.order, hashes(rows));
        let keys: HashSet<u128> = v.checks.keys().copied().collect();
        assert_eq!(keys, v.order.iter().copied().collect::<HashSet<_>>());
    }

    /// Checks `s0`..`s{n-1}`, one per node, and a node check on every tenth node.
    fn cluster(n: usize) -> Vec<CheckRow<'static>> {
        let mut rows = Vec::new();
        for i in 0..n {
            if i % 10 == 0 {
                rows.push(row(&format!("n{i:03}"), "serfHealth", "", 5));
            }
            rows.push(row(&format!("n{i:03}"), &format!("svc:s{i}"), &format!("s{i}"), 5));
        }
        rows
    }

    /// Where `rows` holds the check of service `service`.
    fn at(rows: &[CheckRow<'_>], service: &str) -> usize {
        rows.iter().position(|r| r.service == service).unwrap()
    }

    #[test]
    fn edits_in_place_are_found_in_step() {
        let mut v = ChecksView::default();
        let mut rows = cluster(60);
        assert!(apply(&mut v, 10, &rows).everything);
        holds(&v, &rows);

        // A change in the middle.
        let i = at(&rows, "s30");
        rows[i].modify_index = 11;
        assert_eq!(apply(&mut v, 11, &rows), Stale { services: names(&["s30"]), ..Stale::default() });
        assert!(v.accounts_for(10, 11));
        holds(&v, &rows);

        // An insertion.
        rows.insert(at(&rows, "s30") + 1, row("n030", "svc:extra", "extra", 12));
        assert_eq!(apply(&mut v, 12, &rows), Stale { services: names(&["extra"]), ..Stale::default() });
        holds(&v, &rows);

        // A removal.
        rows.remove(at(&rows, "s5"));
        assert_eq!(apply(&mut v, 13, &rows), Stale { services: names(&["s5"]), ..Stale::default() });
        assert!(v.accounts_for(12, 13), "the removal is the table's latest write");
        holds(&v, &rows);

        // A rewrite at the same place: the check is replaced, not removed, so its old
        // service is not named.
        let i = at(&rows, "s40");
        rows[i] = row("n040", "svc:s40", "renamed", 14);
        assert_eq!(apply(&mut v, 14, &rows), Stale { services: names(&["renamed"]), ..Stale::default() });
        holds(&v, &rows);

        // All of them at once, and a node check, with nothing in between in step.
        let i = at(&rows, "s20");
        rows[i - 1].modify_index = 15; // n020's serfHealth
        rows.remove(at(&rows, "s21"));
        rows.insert(at(&rows, "s22"), row("n021", "svc:late", "late", 15));
        rows.remove(at(&rows, "s58"));
        rows.push(row("n999", "svc:last", "last", 15));
        assert_eq!(
            apply(&mut v, 15, &rows),
            Stale { services: names(&["s21", "late", "s58", "last"]), nodes: names(&["n020"]), ..Stale::default() }
        );
        holds(&v, &rows);
        assert!(apply(&mut v, 15, &rows).is_empty(), "the same answer again: no change");
        holds(&v, &rows);

        // None of it needed a lookup for the checks where they were.
        let mut walk = InStep::new(&v);
        let mut next = rows.clone();
        next.remove(3);
        next.insert(40, row("n500", "svc:new", "new", 16));
        let answer = hashes(&next);
        let new = answer.iter().filter(|h| !walk.known(**h)).count();
        assert_eq!(new, 1);
        assert!(walk.moved.is_empty(), "every known check was found in step");
        assert_eq!(walk.gone(&answer), hashes(&rows[3..4]));
    }

    #[test]
    fn the_order_of_an_answer_changes_nothing() {
        let rows = cluster(100);
        let mut v = ChecksView::default();
        apply(&mut v, 10, &rows);
        let mut reversed = rows.clone();
        reversed.reverse();
        assert!(apply(&mut v, 10, &reversed).is_empty());
        holds(&v, &reversed);
        // Shuffled (a fixed permutation), at a new index: still nothing.
        let mut shuffled = rows.clone();
        let mut random = Rng(7);
        for i in (1..shuffled.len()).rev() {
            shuffled.swap(i, random.below(i + 1));
        }
        assert!(apply(&mut v, 11, &shuffled).is_empty());
        assert!(!v.accounts_for(10, 11), "no check write");
        holds(&v, &shuffled);

        // The same edits, sorted and reversed, say the same.
        let mut sorted = rows.clone();
        let i = at(&sorted, "s50");
        sorted[i].modify_index = 12;
        sorted.remove(at(&sorted, "s7"));
        sorted.insert(at(&sorted, "s70"), row("n070", "svc:extra", "extra", 12));
        let mut in_order = ChecksView::default();
        apply(&mut in_order, 11, &rows);
        let expected = apply(&mut in_order, 12, &sorted);
        assert_eq!(expected, Stale { services: names(&["s50", "s7", "extra"]), ..Stale::default() });
        sorted.reverse();
        assert_eq!(apply(&mut v, 12, &sorted), expected);
        assert_eq!(v.writes, in_order.writes);
        holds(&v, &sorted);
    }

    #[test]
    fn a_malformed_answer_leaves_the_last_good_one_to_compare_with() {
        let rows = cluster(50);
        let mut v = ChecksView::default();
        apply(&mut v, 10, &rows);
        // Edits, some out of order, then a malformed check.
        let mut edited = rows.clone();
        edited.remove(at(&edited, "s3"));
        edited.swap(10, 40);
        let i = at(&edited, "s20");
        edited[i].modify_index = 11;
        let mut body = answer(&edited);
        body.pop();
        body.extend_from_slice(br#",{"Node":7}]"#);
        assert!(v.apply(11, &body[..]).is_err());
        assert_eq!(v.index(), Some(10));
        holds(&v, &rows);
        assert!(v.writes.is_empty());
        // The next good answer is compared with the last good one.
        let mut next = rows.clone();
        next.remove(at(&next, "s3"));
        assert_eq!(apply(&mut v, 12, &next), Stale { services: names(&["s3"]), ..Stale::default() });
        holds(&v, &next);
    }

    #[test]
    fn the_same_check_twice_is_one_check() {
        let rows = cluster(40);
        let mut v = ChecksView::default();
        apply(&mut v, 10, &rows);
        // web's check twice: one check, and nothing changed.
        let mut twice = rows.clone();
        twice.insert(20, rows[3].clone());
        twice.push(rows[30].clone());
        assert!(apply(&mut v, 10, &twice).is_empty());
        holds(&v, &twice);
        // One of the copies gone: still there.
        assert!(apply(&mut v, 10, &rows).is_empty());
        // Both copies of a new check, then both gone.
        let mut new = rows.clone();
        new.insert(5, row("n900", "svc:new", "new", 11));
        new.insert(30, row("n900", "svc:new", "new", 11));
        assert_eq!(apply(&mut v, 11, &new), Stale { services: names(&["new"]), ..Stale::default() });
        assert_eq!(v.checks.len(), rows.len() + 1);
        assert_eq!(apply(&mut v, 12, &rows), Stale { services: names(&["new"]), ..Stale::default() });
        assert!(v.accounts_for(11, 12));
        holds(&v, &rows);
    }

    /// A check as the cluster holds it; `output` changes its bytes without a write.
    #[derive(Clone, Debug)]
    struct Check {
        node: String,
        id: String,
        service: String,
        modify_index: u64,
        output: String,
    }

    impl Check {
        fn bytes(&self) -> Vec<u8> {
            serde_json::to_vec(&serde_json::json!({"Node": self.node, "CheckID": self.id, "Name": "n",
                "Status": "passing", "Output": self.output, "ServiceName": self.service, "CreateIndex": 1,
                "ModifyIndex": self.modify_index}))
            .unwrap()
        }

        fn hash(&self) -> u128 {
            xxhash_rust::xxh3::xxh3_128(&self.bytes())
        }
    }

    /// What the view says, done the plain way: sets of checks by hash, compared whole.
    #[derive(Default)]
    struct Reference {
        index: Option<u64>,
        checks: HashMap<u128, Check>,
        writes: BTreeSet<u64>,
    }

    impl Reference {
        fn apply(&mut self, index: u64, answer: &[Check]) -> Stale {
            let base = self.index.filter(|base| index >= *base);
            self.index = Some(index);
            let now: HashMap<u128, Check> = answer.iter().map(|c| (c.hash(), c.clone())).collect();
            let Some(base) = base else {
                self.writes.clear();
                self.checks = now;
                return Stale::everything();
            };
            let mut stale = Stale::default();
            let new: Vec<&Check> = now.iter().filter(|(h, _)| !self.checks.contains_key(h)).map(|(_, c)| c).collect();
            for c in &new {
                if c.modify_index > base {
                    stale.check(&c.node, &c.service);
                    self.writes.insert(c.modify_index);
                }
            }
            let rewritten: HashSet<(&str, &str)> = new.iter().map(|c| (&*c.node, &*c.id)).collect();
            let mut removed = false;
            for (h, c) in &self.checks {
                if !now.contains_key(h) && !rewritten.contains(&(&*c.node, &*c.id)) {
                    stale.check(&c.node, &c.service);
                    removed = true;
                }
            }
            self.checks = now;
            if removed && !self.checks.values().any(|c| c.modify_index == index) {
                self.writes.insert(index);
            }
            while self.writes.len() > REMEMBERED_WRITES {
                self.writes.pop_first();
            }
            stale
        }
    }

    /// One random edit of the cluster's answer at `index`.
    fn edit(random: &mut Rng, checks: &mut Vec<Check>, index: u64, fresh: &mut u64) {
        let new_check = |random: &mut Rng, fresh: &mut u64| {
            *fresh += 1;
            let node = format!("n{}", random.below(40));
            let service = if random.below(100) < 20 { String::new() } else { format!("s{}", random.below(30)) };
            let output = if random.below(100) < 10 { "x},{y".to_owned() } else { String::new() };
            Check { node, id: format!("c{fresh}"), service, modify_index: index, output }
        };
        let any = |random: &mut Rng, checks: &Vec<Check>| random.below(checks.len().max(1));
        match random.below(10) {
            0 | 1 if !checks.is_empty() => {
                let i = any(random, checks);
                checks[i].modify_index = index;
            }
            2 if !checks.is_empty() => {
                let i = any(random, checks);
                checks[i].output = format!("o{}", random.next_u64() % 4);
            }
            3 | 4 => {
                let at = random.below(checks.len() + 1);
                let check = new_check(random, fresh);
                checks.insert(at, check);
            }
            5 if !checks.is_empty() => {
                let i = any(random, checks);
                checks.remove(i);
            }
            6 if !checks.is_empty() => {
                // A check moves, near or far; sometimes a block of them.
                let i = any(random, checks);
                let len = if random.below(100) < 30 { 1 + random.below(checks.len() - i) } else { 1 };
                let block: Vec<Check> = checks.drain(i..i + len).collect();
                let to = random.below(checks.len() + 1);
                checks.splice(to..to, block);
            }
            7 if !checks.is_empty() => {
                // Rewritten under another service (the check's ID comes back, its old
                // entry is replaced).
                let i = any(random, checks);
                checks[i].service = format!("s{}", random.below(30));
                checks[i].modify_index = index;
            }
            8 if !checks.is_empty() => {
                let i = any(random, checks);
                let copy = checks[i].clone();
                let at = random.below(checks.len() + 1);
                checks.insert(at, copy);
            }
            9 if random.below(100) < 20 => {
                if random.below(100) < 50 {
                    checks.reverse();
                } else {
                    for i in (1..checks.len()).rev() {
                        checks.swap(i, random.below(i + 1));
                    }
                }
            }
            _ => {}
        }
    }

    #[test]
    fn the_diff_in_step_is_the_difference_of_the_sets() {
        let mut random = Rng(0x5eed);
        for sequence in 0..300 {
            let mut view = ChecksView::default();
            let mut reference = Reference::default();
            let mut fresh = 0;
            let mut index = 10;
            let mut checks: Vec<Check> = Vec::new();
            for _ in 0..random.below(120) {
                edit(&mut random, &mut checks, index, &mut fresh);
            }
            for step in 0..15 {
                index = match random.below(100) {
                    0..3 => index.saturating_sub(random.next_u64() % 5),
                    3..10 => index,
                    _ => index + 1 + random.next_u64() % 3,
                };
                let most = if random.below(100) < 20 { 40 } else { 5 };
                for _ in 0..random.below(most) {
                    edit(&mut random, &mut checks, index, &mut fresh);
                }
                let mut elements: Vec<Vec<u8>> = checks.iter().map(Check::bytes).collect();
                let malformed = random.below(100) < 5;
                if malformed {
                    elements.insert(random.below(elements.len() + 1), br#"{"Node":7}"#.to_vec());
                }
                let body = [b"[".to_vec(), elements.join(&b","[..]), b"]".to_vec()].concat();
                let what = format!("sequence {sequence}, step {step}, index {index}");
                let got = view.apply(index, &body[..]);
                if malformed {
                    assert!(got.is_err(), "{what}: a malformed answer is an error");
                } else {
                    assert_eq!(got.unwrap().stale(), reference.apply(index, &checks), "{what}");
                }
                assert_eq!(view.index, reference.index, "{what}");
                assert_eq!(view.writes, reference.writes, "{what}");
                let keys: HashSet<u128> = view.checks.keys().copied().collect();
                assert_eq!(keys, reference.checks.keys().copied().collect::<HashSet<_>>(), "{what}");
                assert_eq!(keys, view.order.iter().copied().collect::<HashSet<_>>(), "{what}");
                for (hash, known) in &view.checks {
                    let c = &reference.checks[hash];
                    let names = (known.node(), known.check_id(), known.service(), known.modify_index);
                    assert_eq!(names, (&*c.node, &*c.id, &*c.service, c.modify_index), "{what}");
                }
            }
        }
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
