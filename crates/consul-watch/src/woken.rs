//! Which check writes a change feed has already woken members for (docs/consul.md,
//! "Services without a blocking query of their own").
//!
//! A feed reads checks through up to three queries: every check (`/v1/health/state/any`),
//! whose answer is the whole group's and takes a real agent a second at 150,000 checks, and,
//! in a large group, the critical and the warning ones (`/v1/health/state/critical`,
//! `/v1/health/state/warning`), a few checks each, answered in a millisecond. A check
//! turning critical, or passing again, shows in two of them; one going from warning to
//! critical, in all three. Its members should re-read once, at the first answer that shows
//! it, not again at the others.
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

/// What the feed woke members for, per check, shared by its checks queries.
#[derive(Debug, Default)]
pub(crate) struct Woken {
    /// Per node and check ID: the index of the answer that woke its members last.
    by_check: HashMap<(Box<str>, Box<str>), u64>,
    /// The latest index each query answered: every check, the critical ones, the warning
    /// ones.
    any: Option<u64>,
    critical: Option<u64>,
    warning: Option<u64>,
}

impl Woken {
    /// What `written` (an answer of `from` at `index`) names that no answer woke its
    /// members for already: each check written after the index its members were last woken
    /// at, or gone (at some index up to this answer's) when they were woken at an earlier one.
    pub(crate) fn name(&mut self, from: CheckState, written: Written, index: u64) -> Stale {
        let Written::Checks(checks) = written else {
            // A first answer, or a restored cluster whose indexes start again lower:
            // nothing remembered holds for it.
            *self = Woken::default();
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

    /// The queries of one status stopped (the group shrank, or the plan took their lanes):
    /// only every check's answers come, and what they answered past is forgotten.
    pub(crate) fn statuses_stopped(&mut self) {
        self.critical = None;
        self.warning = None;
    }

    /// Forgets the checks the queries running have answered past: none can show them
    /// written at an index up to that again. (Forgetting too soon costs a second re-read,
    /// never a missed one.)
    fn answered(&mut self, from: CheckState, index: u64) {
        *match from {
            CheckState::Any => &mut self.any,
            CheckState::Critical => &mut self.critical,
            CheckState::Warning => &mut self.warning,
        } = Some(index);
        // A status query that has not answered yet (or stopped) needs nothing kept: its
        // first answer is a baseline, which names nothing.
        let past = self.any.map(|any| [self.critical, self.warning].into_iter().flatten().fold(any, u64::min));
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
    fn a_check_from_warning_to_critical_is_named_once_by_three_queries() {
        let mut w = Woken::default();
        // web's check turns warning at 11: the warning query shows it first.
        let s = w.name(CheckState::Warning, Written::Checks(vec![check("n1", "c-web", "web", Some(11))]), 11);
        assert_eq!(names(&s), ["web"]);
        let s = w.name(CheckState::Any, Written::Checks(vec![check("n1", "c-web", "web", Some(11))]), 12);
        assert!(s.is_empty(), "every check's answer shows the same write");
        // Critical at 13: the critical query shows it first, then the warning query shows it
        // gone and every check's answer written at 13.
        let s = w.name(CheckState::Critical, Written::Checks(vec![check("n1", "c-web", "web", Some(13))]), 13);
        assert_eq!(names(&s), ["web"]);
        assert!(w.name(CheckState::Warning, Written::Checks(vec![check("n1", "c-web", "web", None)]), 13).is_empty());
        assert!(w.name(CheckState::Any, Written::Checks(vec![check("n1", "c-web", "web", Some(13))]), 14).is_empty());
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
    fn what_every_query_answered_past_is_forgotten() {
        let mut w = Woken::default();
        w.name(CheckState::Critical, Written::Checks(vec![check("n1", "a", "a", Some(5))]), 5);
        w.name(CheckState::Warning, Written::Checks(vec![]), 5);
        w.name(CheckState::Any, Written::Checks(vec![check("n1", "b", "b", Some(8))]), 8);
        let kept: Vec<&str> = w.by_check.keys().map(|(_, id)| &**id).collect();
        assert_eq!(kept, ["b"], "all are past 5; the status queries may still show b written at 8");
        w.name(CheckState::Critical, Written::Checks(vec![]), 9);
        assert_eq!(w.by_check.len(), 1, "the warning query may still show b");
        w.name(CheckState::Warning, Written::Checks(vec![]), 9);
        assert!(w.by_check.is_empty(), "all are past 8");
        // Once the status queries stop, every check's answers alone say what is past.
        w.name(CheckState::Critical, Written::Checks(vec![check("n1", "c", "c", Some(10))]), 10);
        w.statuses_stopped();
        w.name(CheckState::Any, Written::Checks(vec![]), 11);
        assert!(w.by_check.is_empty(), "nothing but every check's query runs");
    }
}
