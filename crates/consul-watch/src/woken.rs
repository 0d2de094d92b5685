//! Which check writes a change feed has already woken members for (docs/consul.md,
//! "Services without a blocking query of their own").
//!
//! A feed reads checks through two queries: every check (`/v1/health/state/any`), whose
//! answer is the whole group's and takes a real agent a second at 150,000 checks, and the
//! critical ones (`/v1/health/state/critical`), a few checks answered in a millisecond. A
//! check turning critical, or passing again, shows in both. Its members should re-read once,
//! at the first answer that shows it, not again at the second.
//!
//! Answers name checks as they were at some index: a member woken by an answer re-reads
//! after it, so its read shows every write up to that answer's index (Consul answers a
//! query with its data and its index from one read of the state store, and an index only
//! grows). A check another answer names again, written at an index no later than that, was
//! seen by that re-read already.

use std::collections::HashMap;

use crate::changes::{Stale, Written};
use crate::client::CheckState;

/// Entries past this are dropped all at once: the cost is a duplicate re-read, never a
/// missed one.
const REMEMBERED_CHECKS: usize = 65_536;

/// What the feed woke members for, per check, shared by its two checks queries.
#[derive(Debug, Default)]
pub(crate) struct Woken {
    /// Per node and check ID: the index of the answer that woke its members last.
    by_check: HashMap<(Box<str>, Box<str>), u64>,
    /// The latest index each query answered, every check and critical ones.
    any: Option<u64>,
    critical: Option<u64>,
}

impl Woken {
    /// What `written` (an answer of `from` at `index`) names that no answer woke its
    /// members for already: each check written after the index its members were last woken
    /// at, or gone (at some index up to this answer's) when they were woken at an earlier one.
    pub(crate) fn name(&mut self, from: CheckState, written: Written, index: u64) -> Stale {
        let Written::Checks(checks) = written else {
            // A first answer, or a restored cluster whose indexes start again lower:
            // nothing remembered holds for it.
            self.by_check.clear();
            self.any = None;
            self.critical = None;
            return Stale::everything();
        };
        let mut stale = Stale::default();
        for c in checks {
            let key = (c.node, c.check_id);
            let seen_by_then = c.at.unwrap_or(index);
            if self.by_check.get(&key).is_some_and(|woken_at| *woken_at >= seen_by_then) {
                continue;
            }
            stale.check(&key.0, &c.service);
            self.by_check.insert(key, index);
        }
        self.answered(from, index);
        stale
    }

    /// The critical checks' query stopped (its group shrank): only every check's answers
    /// come, and what they answered past is forgotten.
    pub(crate) fn critical_stopped(&mut self) {
        self.critical = None;
    }

    /// Forgets the checks the queries running have answered past: none can show them
    /// written at an index up to that again. (Forgetting too soon costs a second re-read,
    /// never a missed one.)
    fn answered(&mut self, from: CheckState, index: u64) {
        match from {
            CheckState::Any => self.any = Some(index),
            CheckState::Critical => self.critical = Some(index),
        }
        let past = match (self.any, self.critical) {
            (Some(any), Some(critical)) => Some(any.min(critical)),
            (Some(any), None) => Some(any),
            (None, _) => None,
        };
        if let Some(past) = past {
            self.by_check.retain(|_, woken_at| *woken_at > past);
        }
        if self.by_check.len() > REMEMBERED_CHECKS {
            self.by_check.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::changes::WrittenCheck;

    fn check(node: &str, id: &str, service: &str, at: Option<u64>) -> WrittenCheck {
        WrittenCheck { node: node.into(), check_id: id.into(), service: service.into(), at }
    }

    fn names(stale: &Stale) -> Vec<&str> {
        stale.services.iter().chain(&stale.nodes).map(String::as_str).collect()
    }

    #[test]
    fn a_check_is_named_once_whichever_query_shows_it_first() {
        let mut w = Woken::default();
        // web's check turns critical at 11: the critical query shows it first.
        let s = w.name(CheckState::Critical, Written::Checks(vec![check("n1", "c-web", "Web", Some(11))]), 11);
        assert_eq!(names(&s), ["web"]);
        // Every check's answer, at 12, shows that write and a new one of api's.
        let every = vec![check("n1", "c-web", "web", Some(11)), check("n2", "c-api", "api", Some(12))];
        assert_eq!(names(&w.name(CheckState::Any, Written::Checks(every), 12)), ["api"]);

        // db's check passes again at 14: every check's answer shows it first (at 15), then
        // the critical one shows it gone at 15.
        let s = w.name(CheckState::Any, Written::Checks(vec![check("n3", "serfHealth", "", Some(14))]), 15);
        assert_eq!(names(&s), ["n3"], "a node check names its node");
        let s = w.name(CheckState::Critical, Written::Checks(vec![check("n3", "serfHealth", "", None)]), 15);
        assert!(s.is_empty(), "gone by 15, and woken at 15");
    }

    #[test]
    fn a_later_write_or_a_removal_after_the_wake_is_named_again() {
        let mut w = Woken::default();
        w.name(CheckState::Critical, Written::Checks(vec![check("n1", "c-web", "web", Some(11))]), 11);
        // Written again at 13 (passing, which the critical query does not show).
        let s = w.name(CheckState::Any, Written::Checks(vec![check("n1", "c-web", "web", Some(13))]), 13);
        assert_eq!(names(&s), ["web"]);
        // Gone from an answer at 16, after the wake at 13: removed at 14, 15 or 16.
        let s = w.name(CheckState::Critical, Written::Checks(vec![check("n1", "c-web", "web", None)]), 16);
        assert_eq!(names(&s), ["web"]);
    }

    #[test]
    fn a_first_answer_or_a_restored_cluster_forgets_what_was_woken() {
        let mut w = Woken::default();
        w.name(CheckState::Critical, Written::Checks(vec![check("n1", "c-web", "web", Some(500))]), 500);
        assert!(w.name(CheckState::Any, Written::Everything, 20).everything);
        // The restored cluster writes the check at 30, below the 500 it was woken at.
        let s = w.name(CheckState::Any, Written::Checks(vec![check("n1", "c-web", "web", Some(30))]), 30);
        assert_eq!(names(&s), ["web"]);
    }

    #[test]
    fn what_both_queries_answered_past_is_forgotten() {
        let mut w = Woken::default();
        w.name(CheckState::Critical, Written::Checks(vec![check("n1", "a", "a", Some(5))]), 5);
        w.name(CheckState::Any, Written::Checks(vec![check("n1", "b", "b", Some(8))]), 8);
        let kept: Vec<&str> = w.by_check.keys().map(|(_, id)| &**id).collect();
        assert_eq!(kept, ["b"], "both are past 5; the critical query may still show b written at 8");
        w.name(CheckState::Critical, Written::Checks(vec![]), 9);
        assert!(w.by_check.is_empty(), "both are past 8");
    }
}
