//! One change-set type for keys that start or stop being wanted: what the assembler says
//! of its desired watches, what the registry says of the running ones, what the sources
//! start and stop.

/// Keys that start (`added`) or stop (`removed`) being wanted.
///
/// The core makes both lists sorted and disjoint: the registry (what it tells the sources),
/// the assembler (its desired watches) and [`Delta::then`] all net out a key that is removed
/// and added back, and sort what is left. The fields are public so that tests and the
/// sources can read them; whoever builds one by hand states what it means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delta<K> {
    pub added: Vec<K>,
    pub removed: Vec<K>,
}

impl<K> Default for Delta<K> {
    fn default() -> Self {
        Delta { added: Vec::new(), removed: Vec::new() }
    }
}

impl<K> Delta<K> {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty()
    }
}

impl<K: Ord> Delta<K> {
    /// This delta followed by `later`, as one: a key removed by one and added by the other
    /// nets out.
    pub fn then(mut self, later: Delta<K>) -> Delta<K> {
        for k in later.added {
            match self.removed.iter().position(|s| *s == k) {
                Some(i) => {
                    self.removed.remove(i);
                }
                None => self.added.push(k),
            }
        }
        for k in later.removed {
            match self.added.iter().position(|s| *s == k) {
                Some(i) => {
                    self.added.remove(i);
                }
                None => self.removed.push(k),
            }
        }
        self.added.sort();
        self.removed.sort();
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_stopped_then_started_nets_out() {
        let first = Delta { added: vec!["b", "a"], removed: vec!["x"] };
        let later = Delta { added: vec!["x", "c"], removed: vec!["b"] };
        assert_eq!(first.then(later), Delta { added: vec!["a", "c"], removed: vec![] });
        assert!(Delta::<u8>::default().then(Delta::default()).is_empty());
    }
}
