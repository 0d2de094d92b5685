//! What a resolver's status says, computed from its part of the published snapshot. Pure:
//! the controller compares the result with the live object and writes the difference.
//!
//! `lastSnapshot` is left out of that comparison: otherwise every publication would
//! rewrite every resolver's status, even those the change was not about. It names the
//! snapshot in which the status last changed.

use k8s_openapi::jiff::Timestamp;

use crate::controller::conditions::ConditionStatus::{False, True, Unknown};
use crate::controller::conditions::{Said, conditions, whole_seconds};
use consul_resolver_api::status::{ConsulResolverStatus, ServiceStatus, SnapshotRef, StaleStatus, condition, reason};
use consul_resolver_core::assembler::snapshot::{Part, ResolverEntry, ServiceEntry, Stale, UnusableReason};

/// Most entries in `serviceDetails`; the counts stay exact beyond it.
pub(crate) const MAX_SERVICE_DETAILS: usize = 50;
/// Most services named in one condition message.
const MAX_NAMED: usize = 5;

/// `a, b, c and 4 more`.
fn name_some<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    let names: Vec<&str> = names.into_iter().collect();
    let shown = names.iter().take(MAX_NAMED).copied().collect::<Vec<_>>().join(", ");
    match names.len().saturating_sub(MAX_NAMED) {
        0 => shown,
        more => format!("{shown} and {more} more"),
    }
}

/// The condition reason for an unusable resolver. The same names as the snapshot's
/// `unusable.reason` (`UnusableReason::as_str`; a test checks they agree), spelled here
/// from the constants so every reason the status carries comes from `api::status::reason`.
pub(crate) fn unusable_reason(r: UnusableReason) -> &'static str {
    match r {
        UnusableReason::InvalidSpec => reason::INVALID_SPEC,
        UnusableReason::SecretUnavailable => reason::SECRET_UNAVAILABLE,
        UnusableReason::WaitingForSecret => reason::WAITING_FOR_SECRET,
    }
}

/// The status `entry` gives its resolver in snapshot `snapshot_id` published at `now`.
/// `previous` (the status on the object, or the one last written) keeps each condition's
/// `lastTransitionTime` unless that condition's status flipped.
pub(crate) fn status_for(
    entry: &ResolverEntry,
    snapshot_id: u64,
    now: Timestamp,
    previous: Option<&ConsulResolverStatus>,
) -> ConsulResolverStatus {
    let now = whole_seconds(now);
    let services = &entry.services;
    let endpoints: usize = services.iter().map(|s| s.endpoints.len()).sum();
    let unsynced: Vec<&str> = services.iter().filter(|s| !s.synced).map(|s| s.name.as_str()).collect();

    let reachable = consul_reachable_condition(entry, &unsynced);
    let bootstrapped = bootstrapped_condition(entry, &unsynced);
    // Ready summarises the other two, so it is built from them.
    let ready = ready_condition(entry, &reachable, &bootstrapped, endpoints);
    let said =
        [(condition::READY, ready), (condition::CONSUL_REACHABLE, reachable), (condition::BOOTSTRAPPED, bootstrapped)];
    let conditions = conditions(said, entry.generation, previous.map_or(&[], |p| &p.conditions), now);
    let (service_details, services_truncated) = service_details(services, previous, now);

    ConsulResolverStatus {
        observed_generation: entry.generation,
        conditions,
        services: Some(u32::try_from(services.len()).unwrap_or(u32::MAX)),
        endpoints: Some(u32::try_from(endpoints).unwrap_or(u32::MAX)),
        last_snapshot: Some(SnapshotRef { id: snapshot_id, time: now.to_string() }),
        service_details,
        services_truncated,
    }
}

/// `ConsulReachable`: the first of an unusable resolver (nothing was queried), a failed
/// query, no services, services not answered yet, or all answered.
fn consul_reachable_condition(entry: &ResolverEntry, unsynced: &[&str]) -> Said {
    let services = &entry.services;
    let failing: Vec<&ServiceEntry> = services.iter().map(|s| &**s).filter(|s| s.error.is_some()).collect();
    let (status, reason, message) = match &entry.unusable {
        // A Secret that cannot be read stops every query: Consul is as good as unreachable.
        Some(u) if u.reason == UnusableReason::SecretUnavailable => {
            (False, unusable_reason(u.reason), format!("cannot query Consul at {}: {}", entry.address, u.message))
        }
        // A spec in error (or a Secret not read yet) says nothing about Consul.
        Some(u) => (Unknown, unusable_reason(u.reason), format!("not queried: {}", u.message)),
        None if !failing.is_empty() => (False, reason::QUERY_FAILED, query_failed_message(entry, &failing)),
        None if services.is_empty() => (
            Unknown,
            reason::NO_SERVICES,
            "no Mapping uses this resolver and spec.services is empty: nothing to query".into(),
        ),
        None if !unsynced.is_empty() => (
            Unknown,
            reason::WAITING,
            format!("waiting for Consul at {} to answer for {}", entry.address, name_some(unsynced.iter().copied())),
        ),
        None => (
            True,
            reason::QUERIES_SUCCEEDED,
            format!("Consul at {} answered for all {} services", entry.address, services.len()),
        ),
    };
    Said::new(status, reason, message)
}

/// Names the address, the first failing service and its error, and how many others fail.
fn query_failed_message(entry: &ResolverEntry, failing: &[&ServiceEntry]) -> String {
    let first = failing[0];
    // The errors come from the Consul source, which never puts the token in them.
    let error = first.error.as_deref().unwrap_or_default();
    let others = match failing.len() - 1 {
        0 => String::new(),
        n => format!(" (and {n} other services: {})", name_some(failing[1..].iter().map(|s| s.name.as_str()))),
    };
    format!(
        "querying Consul at {} for service {:?} failed: {error}{others}; check the address, the network policy and \
         the ACL token",
        entry.address, first.name
    )
}

/// `Bootstrapped`: whether every service has answered at least once.
fn bootstrapped_condition(entry: &ResolverEntry, unsynced: &[&str]) -> Said {
    let services = &entry.services;
    let (status, reason, message) = if let Some(u) = &entry.unusable {
        (
            False,
            unusable_reason(u.reason),
            "nothing is queried until the resolver is usable (see the Ready condition)".into(),
        )
    } else if unsynced.is_empty() {
        (True, reason::ALL_SERVICES_ANSWERED, "every service of this resolver has answered at least once".into())
    } else {
        (
            False,
            reason::SERVICES_UNSYNCED,
            format!(
                "{} of {} services have not answered yet ({}); the snapshot was published without their current endpoints",
                unsynced.len(),
                services.len(),
                name_some(unsynced.iter().copied())
            ),
        )
    };
    Said::new(status, reason, message)
}

/// `Ready`: false for the first problem among an unusable spec, `reachable` false and
/// `bootstrapped` false, with that problem's message and the endpoints still published
/// from before; true otherwise, with the counts.
fn ready_condition(entry: &ResolverEntry, reachable: &Said, bootstrapped: &Said, endpoints: usize) -> Said {
    let services = &entry.services;
    let kept = kept_endpoints(services);
    let (status, reason, message) = if let Some(u) = &entry.unusable {
        (False, unusable_reason(u.reason), format!("{}{kept}", u.message))
    } else if reachable.status == False {
        (False, reason::CONSUL_UNREACHABLE, format!("{}{kept}", reachable.message))
    } else if bootstrapped.status == False {
        (False, reason::BOOTSTRAP_INCOMPLETE, format!("{}{kept}", bootstrapped.message))
    } else {
        (True, reason::PUBLISHED, format!("{} services with {endpoints} endpoints are in the snapshot", services.len()))
    };
    Said::new(status, reason, message)
}

/// What Ready says about endpoints kept from before: empty when none are.
fn kept_endpoints(services: &[Part<ServiceEntry>]) -> String {
    let stale: Vec<(&str, &Stale)> =
        services.iter().filter_map(|s| Some((s.name.as_str(), s.stale.as_ref()?))).collect();
    match stale.as_slice() {
        [] => String::new(),
        [(_, first), ..] => format!(
            "; the endpoints last obtained are still published for {} (stale since {})",
            name_some(stale.iter().map(|(name, _)| *name)),
            first.since
        ),
    }
}

/// `serviceDetails` and whether it was truncated. Only the first services by name are
/// detailed: just those are built.
fn service_details(
    services: &[Part<ServiceEntry>],
    previous: Option<&ConsulResolverStatus>,
    now: Timestamp,
) -> (Vec<ServiceStatus>, bool) {
    let mut shown: Vec<&ServiceEntry> = services.iter().map(|s| &**s).collect();
    shown.sort_by(|a, b| a.name.cmp(&b.name));
    let truncated = shown.len() > MAX_SERVICE_DETAILS;
    shown.truncate(MAX_SERVICE_DETAILS);
    let now_text = now.to_string();
    let details = shown
        .into_iter()
        .map(|s| {
            let endpoints = u32::try_from(s.endpoints.len()).unwrap_or(u32::MAX);
            // The snapshot's index only moves when the endpoints did (an answer with the
            // same endpoints is not a change), so an equal index and count mean no change
            // since the previous status; a service we have no record of changed now.
            let last_change = previous
                .and_then(|p| p.service_details.iter().find(|old| old.name == s.name))
                .filter(|old| old.index == s.index && old.endpoints == endpoints)
                .and_then(|old| old.last_change.clone())
                .unwrap_or_else(|| now_text.clone());
            ServiceStatus {
                name: s.name.clone(),
                endpoints,
                index: s.index,
                last_change: Some(last_change),
                last_error: s.error.clone(),
                stale: s.stale.as_ref().map(|st| StaleStatus { since: st.since.clone(), reason: st.reason.clone() }),
            }
        })
        .collect();
    (details, truncated)
}

/// Whether two statuses say the same, apart from which snapshot said it.
pub(crate) fn same_apart_from_snapshot(a: &ConsulResolverStatus, b: &ConsulResolverStatus) -> bool {
    let strip = |s: &ConsulResolverStatus| ConsulResolverStatus { last_snapshot: None, ..s.clone() };
    strip(a) == strip(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::resolver_entry;
    use consul_resolver_core::assembler::snapshot::Part;
    use consul_resolver_core::assembler::snapshot::{ServiceEntry, Unusable};
    use consul_resolver_core::model::Endpoint;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
    use std::collections::BTreeSet;

    fn ep(i: usize) -> Endpoint {
        consul_resolver_core::test_support::endpoint(&format!("10.0.0.{i}"), 80)
    }
    fn service(name: &str, endpoints: usize) -> ServiceEntry {
        ServiceEntry {
            name: name.into(),
            synced: true,
            index: Some(7),
            error: None,
            stale: None,
            endpoints: (0..endpoints).map(ep).collect(),
        }
    }
    fn entry(services: Vec<ServiceEntry>) -> ResolverEntry {
        ResolverEntry { services: services.into_iter().map(Part::new).collect(), ..resolver_entry("shop", "consul") }
    }
    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).unwrap()
    }
    fn cond<'a>(s: &'a ConsulResolverStatus, type_: &str) -> &'a Condition {
        s.conditions.iter().find(|c| c.type_ == type_).unwrap()
    }

    #[test]
    fn ready_when_every_service_answered() {
        let s = status_for(&entry(vec![service("web", 2), service("api", 1)]), 9, t(0), None);
        assert_eq!(s.observed_generation, Some(3));
        assert_eq!((s.services, s.endpoints), (Some(2), Some(3)));
        assert_eq!(s.last_snapshot, Some(SnapshotRef { id: 9, time: "2023-11-14T22:13:20Z".into() }));
        for c in [condition::READY, condition::CONSUL_REACHABLE, condition::BOOTSTRAPPED] {
            assert_eq!(cond(&s, c).status, True.as_str(), "{c}");
            assert_eq!(cond(&s, c).observed_generation, Some(3));
        }
        let names: Vec<_> = s.service_details.iter().map(|d| (d.name.as_str(), d.endpoints)).collect();
        assert_eq!(names, [("api", 1), ("web", 2)], "sorted by name");
        assert!(!s.services_truncated);
    }

    #[test]
    fn invalid_spec_is_ready_false_with_the_problem() {
        let mut e = entry(vec![]);
        e.unusable = Some(Unusable {
            reason: UnusableReason::InvalidSpec,
            message: "spec.address: \"::\" is not host:port".into(),
        });
        let s = status_for(&e, 1, t(0), None);
        let ready = cond(&s, condition::READY);
        assert_eq!((ready.status.as_str(), ready.reason.as_str()), (False.as_str(), reason::INVALID_SPEC));
        assert_eq!(ready.message, "spec.address: \"::\" is not host:port");
        assert_eq!(cond(&s, condition::CONSUL_REACHABLE).status, Unknown.as_str());
    }

    #[test]
    fn unreachable_consul_names_the_address_and_the_cause() {
        let mut down = service("web", 0);
        down.synced = false;
        down.error = Some("connect 127.0.0.1:8500: connection refused".into());
        let s = status_for(&entry(vec![down, service("api", 1)]), 1, t(0), None);
        let c = cond(&s, condition::CONSUL_REACHABLE);
        assert_eq!((c.status.as_str(), c.reason.as_str()), (False.as_str(), reason::QUERY_FAILED));
        assert!(
            c.message.contains("http://127.0.0.1:8500") && c.message.contains("connection refused"),
            "{}",
            c.message
        );
        assert_eq!(cond(&s, condition::READY).reason, reason::CONSUL_UNREACHABLE);
        let web = s.service_details.iter().find(|d| d.name == "web").unwrap();
        assert_eq!(web.last_error.as_deref(), Some("connect 127.0.0.1:8500: connection refused"));
    }

    #[test]
    fn bootstrap_incomplete_names_the_silent_services() {
        let mut silent = service("web", 0);
        silent.synced = false;
        silent.index = None;
        let s = status_for(&entry(vec![silent, service("api", 1)]), 1, t(0), None);
        let b = cond(&s, condition::BOOTSTRAPPED);
        assert_eq!((b.status.as_str(), b.reason.as_str()), (False.as_str(), reason::SERVICES_UNSYNCED));
        assert!(b.message.contains("1 of 2") && b.message.contains("web"), "{}", b.message);
        assert_eq!(cond(&s, condition::READY).reason, reason::BOOTSTRAP_INCOMPLETE);
        assert_eq!(cond(&s, condition::CONSUL_REACHABLE).status, Unknown.as_str());
    }

    #[test]
    fn service_details_are_bounded_and_counts_stay_exact() {
        let services = (0..MAX_SERVICE_DETAILS + 10).rev().map(|i| service(&format!("svc-{i:03}"), 1)).collect();
        let s = status_for(&entry(services), 1, t(0), None);
        assert_eq!(s.services, Some(60));
        assert_eq!(s.endpoints, Some(60));
        assert_eq!(s.service_details.len(), MAX_SERVICE_DETAILS);
        assert_eq!(s.service_details[0].name, "svc-000");
        assert!(s.services_truncated);
    }

    #[test]
    fn last_change_moves_only_when_the_endpoints_do() {
        let first = status_for(&entry(vec![service("web", 1), service("api", 1)]), 1, t(0), None);
        let changed_at = |s: &ConsulResolverStatus, name: &str| {
            s.service_details.iter().find(|d| d.name == name).unwrap().last_change.clone().unwrap()
        };
        assert_eq!(changed_at(&first, "web"), t(0).to_string());
        let mut next = entry(vec![service("web", 2), service("api", 1)]);
        Part::make_mut(&mut next.services.to_mut()[0]).index = Some(8);
        let second = status_for(&next, 2, t(60), Some(&first));
        assert_eq!(changed_at(&second, "web"), t(60).to_string(), "web's endpoints changed");
        assert_eq!(changed_at(&second, "api"), t(0).to_string(), "api's did not");
        let third = status_for(&next, 3, t(120), Some(&second));
        assert!(same_apart_from_snapshot(&second, &third), "nothing new to write");
    }

    #[test]
    fn transition_time_only_moves_when_a_condition_flips() {
        let healthy = entry(vec![service("web", 1)]);
        let first = status_for(&healthy, 1, t(0), None);
        let again = status_for(&healthy, 2, t(60), Some(&first));
        for c in &again.conditions {
            assert_eq!(c.last_transition_time, Time(t(0)), "{} unchanged", c.type_);
        }
        assert!(same_apart_from_snapshot(&first, &again), "nothing to write");

        let mut broken = healthy.clone();
        Part::make_mut(&mut broken.services.to_mut()[0]).error = Some("timeout".into());
        let flipped = status_for(&broken, 3, t(120), Some(&again));
        assert_eq!(cond(&flipped, condition::READY).last_transition_time, Time(t(120)));
        assert_eq!(cond(&flipped, condition::CONSUL_REACHABLE).last_transition_time, Time(t(120)));
        assert_eq!(cond(&flipped, condition::BOOTSTRAPPED).last_transition_time, Time(t(0)), "still bootstrapped");
        assert!(!same_apart_from_snapshot(&again, &flipped));
    }

    #[test]
    fn no_services_is_ready_with_nothing_to_query() {
        let s = status_for(&entry(vec![]), 1, t(0), None);
        assert_eq!(cond(&s, condition::READY).status, True.as_str());
        assert_eq!(cond(&s, condition::CONSUL_REACHABLE).reason, reason::NO_SERVICES);
    }

    #[test]
    fn unusable_reasons_are_the_snapshots() {
        for r in [UnusableReason::InvalidSpec, UnusableReason::SecretUnavailable, UnusableReason::WaitingForSecret] {
            assert_eq!(unusable_reason(r), r.as_str(), "the snapshot's unusable.reason is the condition reason");
        }
    }

    /// Every (condition, status, reason) `status_for` gives, one case of each.
    fn every_condition_said() -> BTreeSet<(String, String, String)> {
        let mut silent = service("web", 0);
        silent.synced = false;
        let mut failing = service("web", 1);
        failing.error = Some("timeout".into());
        let mut cases = vec![entry(vec![service("web", 1)]), entry(vec![]), entry(vec![silent]), entry(vec![failing])];
        for r in [UnusableReason::InvalidSpec, UnusableReason::SecretUnavailable, UnusableReason::WaitingForSecret] {
            let mut e = entry(vec![]);
            e.unusable = Some(Unusable { reason: r, message: "why".into() });
            cases.push(e);
        }
        cases
            .iter()
            .flat_map(|e| status_for(e, 1, t(0), None).conditions)
            .map(|c| (c.type_, c.status, c.reason))
            .collect()
    }

    #[test]
    fn the_constants_are_every_type_and_reason_said() {
        let said = every_condition_said();
        let types: BTreeSet<&str> = said.iter().map(|(t, _, _)| t.as_str()).collect();
        assert_eq!(types, condition::ALL.into_iter().collect());
        let reasons: BTreeSet<&str> = said.iter().map(|(_, _, r)| r.as_str()).collect();
        assert_eq!(reasons, reason::ALL.into_iter().collect(), "reason::ALL is what the status says");
        assert_eq!(reason::ALL.len(), reasons.len(), "no reason listed twice");
    }

    #[test]
    fn docs_list_every_condition_and_reason() {
        let read = |file: &str| std::fs::read_to_string(format!("{}/docs/{file}", env!("CARGO_MANIFEST_DIR"))).unwrap();
        // snapshot.md's table: `| condition | status / reason, reason | when |`, where
        // "the unusable reason" stands for each of the three.
        let mut documented = BTreeSet::new();
        for line in read("snapshot.md").lines() {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let [_, type_, said, _, _] = cells.as_slice() else { continue };
            let Some((status, reasons)) = said.split_once(" / ").filter(|_| condition::ALL.contains(type_)) else {
                continue;
            };
            for r in reasons.split(", ") {
                let named = match r {
                    "or the unusable reason" => {
                        vec![reason::INVALID_SPEC, reason::SECRET_UNAVAILABLE, reason::WAITING_FOR_SECRET]
                    }
                    r => vec![r],
                };
                for r in named {
                    documented.insert((type_.to_string(), status.to_string(), r.to_string()));
                }
            }
        }
        assert_eq!(documented, every_condition_said(), "docs/snapshot.md's conditions table is what the status says");

        // operations.md's troubleshooting table: every reason Ready=False can give.
        let troubleshooting = read("operations.md");
        let rows: BTreeSet<&str> =
            troubleshooting.lines().filter_map(|l| l.strip_prefix("| `")?.split('`').next()).collect();
        for (type_, status, r) in every_condition_said() {
            if type_ == condition::READY && status == False.as_str() {
                assert!(rows.contains(r.as_str()), "docs/operations.md explains Ready=False/{r}");
            }
        }
    }
}

#[cfg(test)]
mod stale_tests {
    use super::*;
    use crate::test_fixtures::resolver_entry;
    use consul_resolver_core::assembler::snapshot::Part;
    use consul_resolver_core::assembler::snapshot::{ServiceEntry, Stale, Unusable};
    use consul_resolver_core::model::{Endpoint, Health};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

    fn kept(name: &str, reason: &str) -> ServiceEntry {
        let ep = Endpoint {
            address: "10.0.0.1".into(),
            port: 80,
            node: "n".into(),
            service_id: "s".into(),
            tags: vec![],
            meta: Default::default(),
            health: Health::Passing,
            zone: None,
            weight: None,
        };
        ServiceEntry {
            name: name.into(),
            synced: false,
            index: Some(4),
            error: None,
            stale: Some(Stale { since: "2026-11-23T06:00:00Z".into(), reason: reason.into() }),
            endpoints: vec![ep].into(),
        }
    }

    fn cond<'a>(s: &'a ConsulResolverStatus, type_: &str) -> &'a Condition {
        s.conditions.iter().find(|c| c.type_ == type_).unwrap()
    }

    #[test]
    fn a_missing_secret_is_consul_unreachable_naming_it_and_the_kept_endpoints() {
        let mut e = resolver_entry("shop", "consul");
        let message = "spec.tokenSecretRef: Secret shop/acl not found";
        e.unusable = Some(Unusable { reason: UnusableReason::SecretUnavailable, message: message.into() });
        e.services = vec![Part::new(kept("web", message))].into();
        let s = status_for(&e, 1, Timestamp::from_second(1_800_000_000).unwrap(), None);
        let reachable = cond(&s, condition::CONSUL_REACHABLE);
        assert_eq!(
            (reachable.status.as_str(), reachable.reason.as_str()),
            (False.as_str(), reason::SECRET_UNAVAILABLE)
        );
        assert!(reachable.message.contains("Secret shop/acl not found"), "{}", reachable.message);
        let ready = cond(&s, condition::READY);
        assert_eq!((ready.status.as_str(), ready.reason.as_str()), (False.as_str(), reason::SECRET_UNAVAILABLE));
        assert!(
            ready.message.contains("still published for web (stale since 2026-11-23T06:00:00Z)"),
            "{}",
            ready.message
        );
        assert_eq!(s.endpoints, Some(1), "the kept endpoints are counted: they are published");
        let web = &s.service_details[0];
        assert_eq!(web.stale, Some(StaleStatus { since: "2026-11-23T06:00:00Z".into(), reason: message.into() }));
    }

    #[test]
    fn a_rejected_new_token_is_query_failed_with_the_cause() {
        let mut e = resolver_entry("shop", "consul");
        let mut web =
            kept("web", "the resolver's token changed, and the query with the new settings failed: ACL not found");
        web.error =
            Some("Consul at http://127.0.0.1:8500 rejected the request: ACL token rejected (ACL not found)".into());
        e.services = vec![Part::new(web)].into();
        let s = status_for(&e, 1, Timestamp::from_second(1_800_000_000).unwrap(), None);
        let reachable = cond(&s, condition::CONSUL_REACHABLE);
        assert_eq!((reachable.status.as_str(), reachable.reason.as_str()), (False.as_str(), reason::QUERY_FAILED));
        assert!(reachable.message.contains("ACL token rejected"), "{}", reachable.message);
        assert_eq!(cond(&s, condition::READY).reason, reason::CONSUL_UNREACHABLE);
    }
}
