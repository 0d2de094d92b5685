//! An export's status from what its reconcile found and did. Pure.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use consul_resolver_api::status::export::{self as cond, reason};
use consul_resolver_api::status::{ConsulServiceStatus, ExcludedInstance, StaleStatus};
use consul_resolver_core::export::Desired;

/// Most excluded instances listed (`excluded` is the exact count).
const MAX_EXCLUDED_LISTED: usize = 20;

/// How a reconcile ended, for the status.
pub(crate) enum Outcome {
    /// The spec cannot be used (why); the live slices, if any, held as they were
    /// (`held`), marked stale.
    Invalid(String, Option<Desired>),
    /// A Service of that name exists and is not ours: untouched, our slices removed.
    Conflict,
    /// No resolver can serve it (`why`): its slices were removed.
    NoResolver(String),
    /// Written (or already as wanted): the Service `service` and `slices` slices.
    Exported { desired: Desired, slices: usize, waiting: bool },
    /// Nothing says what to hold (no answer yet, or the resolver cannot be used now): the
    /// live slices are held as they were, marked stale.
    Held { desired: Desired, slices: usize },
    /// The Service cannot exist yet: no port to expose (no instance, no `spec.ports`).
    NoPorts { desired: Desired },
    /// A write failed (`why`: the API server's answer, e.g. forbidden without the export
    /// role in this namespace); retried with backoff.
    Failed(String),
}

pub(crate) fn status_for(
    name: &str,
    generation: Option<i64>,
    outcome: &Outcome,
    previous: Option<&ConsulServiceStatus>,
    now: Timestamp,
) -> ConsulServiceStatus {
    let now = Timestamp::from_second(now.as_second()).unwrap_or(now);
    // Messages are never empty: metav1.Condition requires one (an empty one is sent as null).
    let no_conflict = || ("False", reason::NO_CONFLICT, format!("no Service {name} but ours"));
    let (ready, exported, conflict) = match outcome {
        Outcome::Invalid(why, _) => (
            ("False", reason::INVALID_SPEC, why.clone()),
            ("False", reason::INVALID_SPEC, why.clone()),
            ("Unknown", reason::INVALID_SPEC, "not checked: the spec cannot be used".to_owned()),
        ),
        Outcome::Conflict => {
            let why = format!("Service {name} exists and is not managed by this export: it is left alone");
            (
                ("False", reason::SERVICE_EXISTS, why.clone()),
                ("False", reason::SERVICE_EXISTS, why.clone()),
                ("True", reason::SERVICE_EXISTS, why),
            )
        }
        Outcome::Failed(why) => (
            ("False", reason::WRITE_FAILED, why.clone()),
            ("False", reason::WRITE_FAILED, why.clone()),
            ("Unknown", reason::WRITE_FAILED, "not known: the Service could not be read or written".to_owned()),
        ),
        Outcome::NoResolver(why) => (
            ("False", reason::RESOLVER_UNAVAILABLE, why.clone()),
            ("False", reason::RESOLVER_UNAVAILABLE, why.clone()),
            no_conflict(),
        ),
        Outcome::NoPorts { .. } => {
            let why = "no instance yet, so no port to expose: the Service is created with the first instance (or set spec.ports)".to_owned();
            (("False", reason::WAITING, why.clone()), ("False", reason::WAITING, why), no_conflict())
        }
        Outcome::Held { desired, slices } => {
            let stale = desired.stale.as_ref().map(|s| format!("since {}: {}", s.since, s.reason)).unwrap_or_default();
            (
                ("False", reason::STALE, format!("endpoints held from the EndpointSlices, stale {stale}")),
                ("True", reason::EXPORTED, format!("Service {name} and {slices} EndpointSlices held as last written")),
                no_conflict(),
            )
        }
        Outcome::Exported { desired, slices, waiting } => {
            let n = desired.endpoint_count();
            let ready = match (&desired.stale, waiting) {
                (Some(s), _) => {
                    ("False", reason::STALE, format!("endpoints last obtained, stale since {}: {}", s.since, s.reason))
                }
                (None, true) => ("False", reason::WAITING, "Consul has not answered for this service yet".to_owned()),
                (None, false) => ("True", reason::EXPORTED, format!("{n} endpoints in {slices} slices")),
            };
            (
                ready,
                ("True", reason::EXPORTED, format!("Service {name} and {slices} EndpointSlices written")),
                no_conflict(),
            )
        }
    };
    let conditions = [(cond::READY, ready), (cond::EXPORTED, exported), (cond::CONFLICT, conflict)]
        .into_iter()
        .map(|(type_, (status, reason, message))| {
            let kept = previous
                .and_then(|p| p.conditions.iter().find(|c| c.type_ == type_))
                .filter(|c| c.status == status)
                .map(|c| c.last_transition_time.clone());
            Condition {
                type_: type_.into(),
                status: status.into(),
                reason: reason.into(),
                message,
                observed_generation: generation,
                last_transition_time: kept.unwrap_or(Time(now)),
            }
        })
        .collect();
    let mut status = ConsulServiceStatus { observed_generation: generation, conditions, ..Default::default() };
    let desired = match outcome {
        Outcome::Exported { desired, slices, .. } | Outcome::Held { desired, slices } => {
            status.service = Some(name.to_owned());
            status.slices = Some(u32::try_from(*slices).unwrap_or(u32::MAX));
            Some(desired)
        }
        Outcome::NoPorts { desired } | Outcome::Invalid(_, Some(desired)) => Some(desired),
        _ => None,
    };
    if let Some(d) = desired {
        status.endpoints = Some(u32::try_from(d.endpoint_count()).unwrap_or(u32::MAX));
        status.excluded = Some(u32::try_from(d.excluded.len()).unwrap_or(u32::MAX));
        status.excluded_instances = d
            .excluded
            .iter()
            .take(MAX_EXCLUDED_LISTED)
            .map(|x| ExcludedInstance {
                node: x.node.clone(),
                service_id: x.service_id.clone(),
                address: x.address.clone(),
                reason: x.reason.clone(),
            })
            .collect();
        status.stale = d.stale.as_ref().map(|s| StaleStatus { since: s.since.clone(), reason: s.reason.clone() });
    }
    status
}

#[cfg(test)]
mod tests {
    use super::*;
    use consul_resolver_api::export::ConsulServiceSpec;

    #[test]
    fn every_condition_has_a_message_and_transitions_keep_their_time() {
        let spec: ConsulServiceSpec = serde_json::from_value(serde_json::json!({"service": "web"})).unwrap();
        let d = Desired::of(&spec, None);
        let t0 = Timestamp::from_second(1_795_413_600).unwrap();
        let outcomes = [
            Outcome::Invalid("spec.ports is empty".into(), None),
            Outcome::Conflict,
            Outcome::NoResolver("no resolver".into()),
            Outcome::NoPorts { desired: d.clone() },
            Outcome::Exported { desired: d.clone(), slices: 0, waiting: false },
            Outcome::Failed("forbidden".into()),
            Outcome::Held { desired: d.clone(), slices: 0 },
        ];
        for o in &outcomes {
            let s = status_for("web", Some(2), o, None, t0);
            assert_eq!(s.conditions.len(), 3);
            // The API server refuses an empty message (it is sent as null).
            assert!(s.conditions.iter().all(|c| !c.message.is_empty()), "{s:?}");
        }
        let first = status_for("web", Some(2), &outcomes[4], None, t0);
        let later = Timestamp::from_second(1_795_413_700).unwrap();
        let again = status_for("web", Some(2), &outcomes[4], Some(&first), later);
        assert_eq!(again, first, "nothing changed: the same status, so nothing is written");
        let conflict = status_for("web", Some(2), &outcomes[1], Some(&first), later);
        let ready = conflict.conditions.iter().find(|c| c.type_ == cond::READY).unwrap();
        assert_eq!((ready.status.as_str(), ready.last_transition_time.0), ("False", later));
    }
}
