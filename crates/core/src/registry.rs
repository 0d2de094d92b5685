//! The registry's bookkeeping: which keys are wanted, and by whom.
//!
//! Each consumer (the static `--watch` flags, the assembler's reading of the world, ...)
//! states the whole set of keys it wants; the registry answers with the minimal change to
//! the running watches. A key runs while at least one consumer wants it, so identical keys
//! are one watch whoever asks, and a watch stops when its last consumer goes. Keys that
//! did not change are never restarted. The registry is generic over the key type: it does
//! not know what a key means, so new kinds of sources need no change here.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::delta::Delta;

/// Who wants a key.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConsumerId(String);

impl ConsumerId {
    pub fn new(id: impl Into<String>) -> Self {
        ConsumerId(id.into())
    }
}

impl fmt::Display for ConsumerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Debug, Clone)]
pub struct Registry<K: Ord + Clone> {
    consumers_by_key: BTreeMap<K, BTreeSet<ConsumerId>>,
    keys_by_consumer: BTreeMap<ConsumerId, BTreeSet<K>>,
}

impl<K: Ord + Clone> Default for Registry<K> {
    fn default() -> Self {
        Registry { consumers_by_key: BTreeMap::new(), keys_by_consumer: BTreeMap::new() }
    }
}

impl<K: Ord + Clone> Registry<K> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Replaces everything `consumer` wants with `desired`, returning the watches to start
    /// (keys nobody wanted before: `added`) and to stop (keys nobody wants any more:
    /// `removed`), each sorted.
    pub fn set(&mut self, consumer: &ConsumerId, desired: BTreeSet<K>) -> Delta<K> {
        let empty = BTreeSet::new();
        let current = self.keys_by_consumer.get(consumer).unwrap_or(&empty);
        let mut diff = Delta::default();
        for key in current.difference(&desired) {
            let consumers = self
                .consumers_by_key
                .get_mut(key)
                .expect("registry indexes agree: a consumer's key has a consumer set");
            consumers.remove(consumer);
            if consumers.is_empty() {
                self.consumers_by_key.remove(key);
                diff.removed.push(key.clone());
            }
        }
        for key in desired.difference(current) {
            let consumers = self.consumers_by_key.entry(key.clone()).or_default();
            if consumers.is_empty() {
                diff.added.push(key.clone());
            }
            consumers.insert(consumer.clone());
        }
        if desired.is_empty() {
            self.keys_by_consumer.remove(consumer);
        } else {
            self.keys_by_consumer.insert(consumer.clone(), desired);
        }
        diff
    }

    /// Changes what `consumer` wants by `wanted` (keys it starts and stops wanting), without
    /// restating the rest: the cost is that of the change, not of everything the consumer
    /// wants. Returns the watches to start and to stop, sorted and disjoint.
    pub fn change(&mut self, consumer: &ConsumerId, wanted: Delta<K>) -> Delta<K> {
        let mut diff = Delta::default();
        let mine = self.keys_by_consumer.entry(consumer.clone()).or_default();
        for key in wanted.removed {
            if !mine.remove(&key) {
                continue;
            }
            let consumers = self.consumers_by_key.get_mut(&key).expect("registry indexes agree");
            consumers.remove(consumer);
            if consumers.is_empty() {
                self.consumers_by_key.remove(&key);
                diff.removed.push(key);
            }
        }
        for key in wanted.added {
            if !mine.insert(key.clone()) {
                continue;
            }
            let consumers = self.consumers_by_key.entry(key.clone()).or_default();
            if consumers.is_empty() {
                diff.added.push(key);
            }
            consumers.insert(consumer.clone());
        }
        if mine.is_empty() {
            self.keys_by_consumer.remove(consumer);
        }
        // A key removed and added back in one change nets out.
        diff.added.retain(|k| !diff.removed.contains(k));
        diff.removed.retain(|k| !self.consumers_by_key.contains_key(k));
        diff.added.sort();
        diff.removed.sort();
        diff
    }

    /// Everything `consumer` wanted is released.
    pub fn remove_consumer(&mut self, consumer: &ConsumerId) -> Delta<K> {
        self.set(consumer, BTreeSet::new())
    }

    /// Every key that runs, in key order.
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.consumers_by_key.keys()
    }

    pub fn contains(&self, key: &K) -> bool {
        self.consumers_by_key.contains_key(key)
    }

    /// Who wants `key` (empty when nobody does).
    pub fn consumers(&self, key: &K) -> impl Iterator<Item = &ConsumerId> {
        self.consumers_by_key.get(key).into_iter().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(keys: &[&'static str]) -> BTreeSet<&'static str> {
        keys.iter().copied().collect()
    }

    #[test]
    fn first_consumer_starts_and_last_consumer_stops() {
        let mut r = Registry::new();
        let (a, b) = (ConsumerId::new("a"), ConsumerId::new("b"));
        assert_eq!(r.set(&a, set(&["k1", "k2"])), Delta { added: vec!["k1", "k2"], removed: vec![] });
        // b shares k2 with a: nothing new starts for it.
        assert_eq!(r.set(&b, set(&["k2", "k3"])), Delta { added: vec!["k3"], removed: vec![] });
        assert_eq!(r.keys().count(), 3);
        // a leaves k2: b still wants it, so it keeps running; k1 had only a.
        assert_eq!(r.set(&a, set(&[])), Delta { added: vec![], removed: vec!["k1"] });
        assert!(r.contains(&"k2"));
        assert_eq!(r.consumers(&"k2").collect::<Vec<_>>(), [&b]);
        assert_eq!(r.remove_consumer(&b), Delta { added: vec![], removed: vec!["k2", "k3"] });
        assert_eq!(r.keys().count(), 0);
    }

    #[test]
    fn a_consumer_leaving_one_of_two_shared_keys_does_not_stop_it() {
        let mut r = Registry::new();
        let (a, b) = (ConsumerId::new("a"), ConsumerId::new("b"));
        r.set(&a, set(&["shared1", "shared2"]));
        r.set(&b, set(&["shared1", "shared2"]));
        let diff = r.set(&a, set(&["shared2"]));
        assert!(diff.is_empty(), "shared1 is still wanted by b: {diff:?}");
        assert!(r.contains(&"shared1"));
    }

    #[test]
    fn diffs_are_minimal() {
        let mut r = Registry::new();
        let a = ConsumerId::new("a");
        r.set(&a, set(&["k1", "k2", "k3"]));
        // Same set again: nothing restarts.
        assert!(r.set(&a, set(&["k1", "k2", "k3"])).is_empty());
        // One key swapped: exactly that key stops and its replacement starts.
        assert_eq!(r.set(&a, set(&["k1", "k2", "k4"])), Delta { added: vec!["k4"], removed: vec!["k3"] });
    }

    #[test]
    fn changes_by_delta_agree_with_stating_the_whole_set() {
        let mut by_set = Registry::new();
        let mut by_delta = Registry::new();
        let (a, b) = (ConsumerId::new("a"), ConsumerId::new("b"));
        by_set.set(&b, set(&["shared"]));
        by_delta.set(&b, set(&["shared"]));
        let change = |added: &[&'static str], removed: &[&'static str]| Delta {
            added: added.to_vec(),
            removed: removed.to_vec(),
        };
        assert_eq!(by_set.set(&a, set(&["k1", "shared"])), by_delta.change(&a, change(&["k1", "shared"], &[])));
        assert_eq!(by_set.set(&a, set(&["k2"])), by_delta.change(&a, change(&["k2"], &["k1", "shared"])));
        assert_eq!(by_delta.change(&a, change(&["k2"], &[])), Delta::default(), "already wanted: nothing");
        assert_eq!(by_delta.change(&a, change(&[], &["nope"])), Delta::default(), "never wanted: nothing");
        assert_eq!(by_set.set(&a, set(&[])), by_delta.change(&a, change(&[], &["k2"])));
        assert_eq!(by_set.keys().collect::<Vec<_>>(), by_delta.keys().collect::<Vec<_>>());
    }

    #[test]
    fn removing_an_unknown_consumer_is_a_no_op() {
        let mut r: Registry<&str> = Registry::new();
        assert!(r.remove_consumer(&ConsumerId::new("nobody")).is_empty());
    }

    #[test]
    fn many_consumers_one_key_is_one_start_and_one_stop() {
        let mut r = Registry::new();
        let consumers: Vec<_> = (0..100).map(|i| ConsumerId::new(format!("c{i}"))).collect();
        let starts: usize = consumers.iter().map(|c| r.set(c, set(&["k"])).added.len()).sum();
        assert_eq!(starts, 1);
        let stops: usize = consumers.iter().map(|c| r.remove_consumer(c).removed.len()).sum();
        assert_eq!(stops, 1);
    }
}
