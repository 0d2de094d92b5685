//! An export's status from what its reconcile found and did. Pure.

use k8s_openapi::jiff::Timestamp;

use crate::controller::conditions::ConditionStatus::{False, True, Unknown};
use crate::controller::conditions::{Said, conditions};
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

/// The status of export `name` after `outcome`. `previous` (the live status) keeps each
/// condition's `lastTransitionTime` unless that condition's status flipped.
pub(crate) fn status_for(
    name: &str,
    generation: Option<i64>,
    outcome: &Outcome,
    previous: Option<&ConsulServiceStatus>,
    now: Timestamp,
) -> ConsulServiceStatus {
    let [ready, exported, conflict] = said(name, outcome);
    let said = [(cond::READY, ready), (cond::EXPORTED, exported), (cond::CONFLICT, conflict)];
    let conditions = conditions(said, generation, previous.map_or(&[], |p| &p.conditions), now);
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
        held_endpoints(&mut status, d);
    }
    status
}

/// What Ready, Exported and Conflict say after `outcome`, in that order.
fn said(name: &str, outcome: &Outcome) -> [Said; 3] {
    match outcome {
        Outcome::Invalid(why, _) => invalid(why),
        Outcome::Conflict => conflict(name),
        Outcome::Failed(why) => failed(why),
        Outcome::NoResolver(why) => no_resolver(name, why),
        Outcome::NoPorts { .. } => no_ports(name),
        Outcome::Held { desired, slices } => held(name, desired, *slices),
        Outcome::Exported { desired, slices, waiting } => exported(name, desired, *slices, *waiting),
    }
}

/// Conflict when the Service is ours.
fn no_conflict(name: &str) -> Said {
    Said::new(False, reason::NO_CONFLICT, format!("no Service {name} but ours"))
}

fn invalid(why: &str) -> [Said; 3] {
    [
        Said::new(False, reason::INVALID_SPEC, why),
        Said::new(False, reason::INVALID_SPEC, why),
        Said::new(Unknown, reason::INVALID_SPEC, "not checked: the spec cannot be used"),
    ]
}

fn conflict(name: &str) -> [Said; 3] {
    let why = format!("Service {name} exists and is not managed by this export: it is left alone");
    [
        Said::new(False, reason::SERVICE_EXISTS, why.clone()),
        Said::new(False, reason::SERVICE_EXISTS, why.clone()),
        Said::new(True, reason::SERVICE_EXISTS, why),
    ]
}

fn failed(why: &str) -> [Said; 3] {
    [
        Said::new(False, reason::WRITE_FAILED, why),
        Said::new(False, reason::WRITE_FAILED, why),
        Said::new(Unknown, reason::WRITE_FAILED, "not known: the Service could not be read or written"),
    ]
}

fn no_resolver(name: &str, why: &str) -> [Said; 3] {
    [
        Said::new(False, reason::RESOLVER_UNAVAILABLE, why),
        Said::new(False, reason::RESOLVER_UNAVAILABLE, why),
        no_conflict(name),
    ]
}

fn no_ports(name: &str) -> [Said; 3] {
    let why = "no instance yet, so no port to expose: the Service is created with the first instance (or set \
               spec.ports)";
    [Said::new(False, reason::WAITING, why), Said::new(False, reason::WAITING, why), no_conflict(name)]
}

fn held(name: &str, desired: &Desired, slices: usize) -> [Said; 3] {
    let stale = desired.stale.as_ref().map(|s| format!("since {}: {}", s.since, s.reason)).unwrap_or_default();
    [
        Said::new(False, reason::STALE, format!("endpoints held from the EndpointSlices, stale {stale}")),
        Said::new(True, reason::EXPORTED, format!("Service {name} and {slices} EndpointSlices held as last written")),
        no_conflict(name),
    ]
}

fn exported(name: &str, desired: &Desired, slices: usize, waiting: bool) -> [Said; 3] {
    let ready = match (&desired.stale, waiting) {
        (Some(s), _) => {
            Said::new(False, reason::STALE, format!("endpoints last obtained, stale since {}: {}", s.since, s.reason))
        }
        (None, true) => Said::new(False, reason::WAITING, "Consul has not answered for this service yet"),
        (None, false) => {
            Said::new(True, reason::EXPORTED, format!("{} endpoints in {slices} slices", desired.endpoint_count()))
        }
    };
    let written = format!("Service {name} and {slices} EndpointSlices written");
    [ready, Said::new(True, reason::EXPORTED, written), no_conflict(name)]
}

/// The endpoints `desired` holds, the instances it leaves out and since when it is stale.
fn held_endpoints(status: &mut ConsulServiceStatus, desired: &Desired) {
    status.endpoints = Some(u32::try_from(desired.endpoint_count()).unwrap_or(u32::MAX));
    status.excluded = Some(u32::try_from(desired.excluded.len()).unwrap_or(u32::MAX));
    status.excluded_instances = desired
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
    status.stale = desired.stale.as_ref().map(|s| StaleStatus { since: s.since.clone(), reason: s.reason.clone() });
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
        assert_eq!((ready.status.as_str(), ready.last_transition_time.0), (False.as_str(), later));
    }
}
