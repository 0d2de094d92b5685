//! The desired watches: every watch the routes and resolvers imply, counted, because one
//! watch can be implied several times (a query shared by resolvers with the same settings,
//! a Secret named twice, a namespace's endpoints serving many Services).
//!
//! The counts change one way only: whatever holds a watch (a resolver its Secrets, a
//! resolver's service its query, a Kubernetes target its endpoints' watch) adds it when it
//! starts holding it and removes it when it stops, on every path, incremental or not. So
//! the counts cannot drift from what the passes hold; a test recounts them from scratch.

use std::collections::BTreeMap;

use super::resolvers::{self, Resolver};
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

    /// The resolvers in scope changed from `old` to `new`: their own watches follow.
    pub(crate) fn resolvers_changed(&mut self, old: &[Resolver], new: &[Resolver]) {
        for key in resolver_watches(new) {
            self.add(key);
        }
        for key in resolver_watches(old) {
            self.remove(key);
        }
    }

    /// The desired watches, in key order.
    pub(crate) fn keys(&self) -> impl Iterator<Item = &WatchKey> {
        self.counts.keys()
    }

    /// Each desired watch with its count.
    #[cfg(test)]
    pub(crate) fn counts(&self) -> &BTreeMap<WatchKey, usize> {
        &self.counts
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

/// The watches resolvers imply by themselves: the Secrets they name, and Namespaces (their
/// labels) while some resolver selects the namespaces it serves by label.
fn resolver_watches(resolvers: &[Resolver]) -> impl Iterator<Item = WatchKey> + '_ {
    let secrets = resolvers.iter().flat_map(|r| r.secrets.iter().cloned().map(WatchKey::Kube));
    let namespaces = resolvers.iter().any(Resolver::selects_namespaces).then(resolvers::namespaces_key);
    secrets.chain(namespaces.map(WatchKey::Kube))
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
        assert_eq!(d.counts().iter().map(|(k, n)| (k.clone(), *n)).collect::<Vec<_>>(), [(key("b"), 1)]);
    }
}
