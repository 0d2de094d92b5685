//! The desired watches: every watch the routes and resolvers imply, counted, because one
//! watch can be implied several times (a query shared by resolvers with the same settings,
//! a Secret named twice, a namespace's endpoints serving many Services).
//!
//! An incremental update changes the counts by what starts or stops holding a watch (a
//! resolver's service its query, a Kubernetes target its endpoints' watch); after the
//! resolvers changed, they are derived anew ([`Desired::replace`]).

use std::collections::BTreeMap;

use crate::delta::Delta;
use crate::keys::WatchKey;

/// A counted multiset of watches, and how its keys changed since the last [`Desired::take`].
#[derive(Debug, Clone, Default)]
pub(crate) struct Desired {
    /// Each desired watch with how many things imply it (never zero).
    counts: BTreeMap<WatchKey, usize>,
    /// The keys whose count went to or from zero since the last `take`, each with whether
    /// it was desired then.
    flipped: BTreeMap<WatchKey, bool>,
}

impl Desired {
    pub(crate) fn add(&mut self, key: WatchKey) {
        match self.counts.get_mut(&key) {
            Some(n) => *n += 1,
            None => {
                self.flipped.entry(key.clone()).or_insert(false);
                self.counts.insert(key, 1);
            }
        }
    }

    pub(crate) fn remove(&mut self, key: WatchKey) {
        let Some(n) = self.counts.get_mut(&key) else {
            debug_assert!(false, "{key} removed from the desired watches more often than added");
            return;
        };
        *n -= 1;
        if *n == 0 {
            self.counts.remove(&key);
            self.flipped.entry(key).or_insert(true);
        }
    }

    /// Replaces every count with `counts`, derived anew.
    pub(crate) fn replace(&mut self, counts: BTreeMap<WatchKey, usize>) {
        for key in self.counts.keys().filter(|k| !counts.contains_key(k)) {
            self.flipped.entry(key.clone()).or_insert(true);
        }
        for key in counts.keys().filter(|k| !self.counts.contains_key(k)) {
            self.flipped.entry(key.clone()).or_insert(false);
        }
        self.counts = counts;
    }

    /// The desired watches, in key order.
    pub(crate) fn keys(&self) -> impl Iterator<Item = &WatchKey> {
        self.counts.keys()
    }

    /// The watches that became desired, and those no longer desired, since the last call:
    /// sorted, and disjoint (a key removed and added back is in neither).
    pub(crate) fn take(&mut self) -> Delta<WatchKey> {
        let mut delta = Delta::default();
        for (key, was) in std::mem::take(&mut self.flipped) {
            match (was, self.counts.contains_key(&key)) {
                (false, true) => delta.added.push(key),
                (true, false) => delta.removed.push(key),
                _ => {}
            }
        }
        delta
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::KubeKey;

    fn key(name: &str) -> WatchKey {
        WatchKey::Kube(KubeKey::new("", "v1", "Secret").in_namespace("ns").with_fields(format!("metadata.name={name}")))
    }

    #[test]
    fn a_watch_is_desired_while_anything_implies_it() {
        let mut d = Desired::default();
        d.add(key("a"));
        d.add(key("a"));
        d.add(key("b"));
        assert_eq!(d.take(), Delta { added: vec![key("a"), key("b")], removed: vec![] });
        d.remove(key("a"));
        assert!(d.take().is_empty(), "a is still implied once");
        d.remove(key("a"));
        d.remove(key("b"));
        d.add(key("b"));
        assert_eq!(d.take(), Delta { added: vec![], removed: vec![key("a")] }, "b went and came back: nothing");
        d.replace(BTreeMap::from([(key("c"), 1), (key("b"), 2)]));
        assert_eq!(d.take(), Delta { added: vec![key("c")], removed: vec![] });
    }
}
