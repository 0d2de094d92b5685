//! The conditions both controllers write (metav1.Condition): what each one says, and the
//! one rule for its `lastTransitionTime`. Every condition of a status is built here.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use serde::Serialize;

/// A condition's status, spelled as metav1.Condition spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) enum ConditionStatus {
    True,
    False,
    Unknown,
}

impl ConditionStatus {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ConditionStatus::True => "True",
            ConditionStatus::False => "False",
            ConditionStatus::Unknown => "Unknown",
        }
    }
}

/// What one condition says, before it is given its type, generation and transition time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Said {
    pub(crate) status: ConditionStatus,
    pub(crate) reason: &'static str,
    /// Never empty: metav1.Condition requires a message (an empty one is sent as null).
    pub(crate) message: String,
}

impl Said {
    pub(crate) fn new(status: ConditionStatus, reason: &'static str, message: impl Into<String>) -> Said {
        Said { status, reason, message: message.into() }
    }
}

/// `t` in whole seconds, as the API server keeps a condition's time: a finer one would
/// never compare equal to what it reads back, and every status would be written again.
pub(crate) fn whole_seconds(t: Timestamp) -> Timestamp {
    Timestamp::from_second(t.as_second()).unwrap_or(t)
}

/// The conditions saying `said` (each with its type), for `generation`, in that order.
/// Each keeps the `lastTransitionTime` of the `live` condition of the same type when its
/// status is unchanged, and otherwise (a flip, or none before) changes at `now`.
pub(crate) fn conditions(
    said: impl IntoIterator<Item = (&'static str, Said)>,
    generation: Option<i64>,
    live: &[Condition],
    now: Timestamp,
) -> Vec<Condition> {
    let now = Time(whole_seconds(now));
    said.into_iter()
        .map(|(type_, said)| {
            let kept = live
                .iter()
                .find(|old| old.type_ == type_)
                .filter(|old| old.status == said.status.as_str())
                .map(|old| old.last_transition_time.clone());
            Condition {
                type_: type_.into(),
                status: said.status.as_str().into(),
                reason: said.reason.into(),
                message: said.message,
                observed_generation: generation,
                last_transition_time: kept.unwrap_or_else(|| now.clone()),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::ConditionStatus::{False, True, Unknown};
    use super::*;

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).unwrap()
    }

    #[test]
    fn statuses_are_spelled_as_metav1_spells_them() {
        for (status, spelled) in [(True, "True"), (False, "False"), (Unknown, "Unknown")] {
            assert_eq!(status.as_str(), spelled);
            assert_eq!(serde_json::to_value(status).unwrap(), spelled);
        }
    }

    #[test]
    fn the_transition_time_moves_only_when_the_status_of_that_type_does() {
        let first =
            conditions([("A", Said::new(True, "Fine", "a")), ("B", Said::new(False, "Broken", "b"))], None, &[], t(0));
        assert!(first.iter().all(|c| c.last_transition_time == Time(t(0))));
        // A new reason or message, the same status: the time is kept.
        let said = [("A", Said::new(True, "StillFine", "a, again")), ("B", Said::new(True, "Fixed", "b"))];
        let later = conditions(said, Some(2), &first, t(60));
        assert_eq!(later[0].last_transition_time, Time(t(0)));
        assert_eq!((later[0].reason.as_str(), later[0].observed_generation), ("StillFine", Some(2)));
        assert_eq!((later[1].status.as_str(), later[1].last_transition_time.clone()), ("True", Time(t(60))));
        // A type the live status does not have changes now; times are whole seconds.
        let fraction = t(120).checked_add(k8s_openapi::jiff::SignedDuration::from_millis(700)).unwrap();
        let added = conditions([("C", Said::new(Unknown, "New", "c"))], None, &later, fraction);
        assert_eq!(added[0].last_transition_time, Time(t(120)));
    }
}
