//! An export's status from what its reconcile found and did. Pure.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use consul_resolver_api::status::export::{self as cond, reason};
use consul_resolver_api::status::{ConsulServiceStatus, ExcludedInstance, StaleStatus};
use consul_resolver_core::export::Desired;

/// Most excluded instances listed (`excluded` is the exact count).
const MAX_EXCLUDED_LISTED: usize = 20;

/// How a reconcile ended, for the status.
pub(crate) enum Outcome<'a> {
    /// The spec cannot be used: nothing was written.
    Invalid(String),
    /// A Service of that name exists and is not ours: untouched, our slices removed.
    Conflict,
    /// No resolver can serve it (`why`): its slices were removed.
    NoResolver(String),
    /// Written (or already as wanted): the Service `service` and `slices` slices.
    Exported { desired: &'a Desired, slices: usize, waiting: bool },
    /// The Service cannot exist yet: no port to expose (no instance, no `spec.ports`).
    NoPorts { desired: &'a Desired },
}

pub(crate) fn status_for(
    name: &str,
    generation: Option<i64>,
    outcome: &Outcome<'_>,
    previous: Option<&ConsulServiceStatus>,
    now: Timestamp,
) -> ConsulServiceStatus {
    let now = Timestamp::from_second(now.as_second()).unwrap_or(now);
    let (ready, exported, conflict) = match outcome {
        Outcome::Invalid(why) => (
            ("False", reason::INVALID_SPEC, why.clone()),
            ("False", reason::INVALID_SPEC, why.clone()),
            ("False", reason::NO_CONFLICT, String::new()),
        ),
        Outcome::Conflict => {
            let why = format!("Service {name} exists and is not managed by this export: it is left alone");
            (
                ("False", reason::SERVICE_EXISTS, why.clone()),
                ("False", reason::SERVICE_EXISTS, why.clone()),
                ("True", reason::SERVICE_EXISTS, why),
            )
        }
        Outcome::NoResolver(why) => (
            ("False", reason::RESOLVER_UNAVAILABLE, why.clone()),
            ("False", reason::RESOLVER_UNAVAILABLE, why.clone()),
            ("False", reason::NO_CONFLICT, String::new()),
        ),
        Outcome::NoPorts { .. } => {
            let why = "no instance yet, so no port to expose: the Service is created with the first instance (or set spec.ports)".to_owned();
            (
                ("False", reason::WAITING, why.clone()),
                ("False", reason::WAITING, why),
                ("False", reason::NO_CONFLICT, String::new()),
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
                ("False", reason::NO_CONFLICT, String::new()),
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
        Outcome::Exported { desired, slices, .. } => {
            status.service = Some(name.to_owned());
            status.slices = Some(u32::try_from(*slices).unwrap_or(u32::MAX));
            Some(*desired)
        }
        Outcome::NoPorts { desired } => Some(*desired),
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
