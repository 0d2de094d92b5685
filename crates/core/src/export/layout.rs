//! Laying an export's endpoints out into EndpointSlices, against the slices that exist, so
//! that a change writes only the slices whose content changes (every slice write goes to
//! every node's kube-proxy).
//!
//! An endpoint stays in the slice that holds it; the ones that left are taken out; new ones
//! fill slices of their port set that have room, then slices whose port set is no longer
//! wanted (a slice's ports can change, its address type cannot), then new slices named
//! `<service>-<n>`, the smallest `n` not in use, so a name is deterministic given what
//! exists. Slices left empty are deleted. This is the EndpointSlice controller's own
//! approach (it also favours keeping endpoints where they are over packing slices).

use std::collections::{BTreeMap, BTreeSet};

use consul_resolver_api::export::IpFamily;

use super::{Desired, MAX_ENDPOINTS_PER_SLICE, Port, SliceEndpoint};
use crate::assembler::snapshot::Stale;

/// A slice as it is in the cluster, read back in the terms of [`Desired`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveSlice {
    pub name: String,
    /// Its `addressType`; `None` for one we never write (FQDN): replaced.
    pub family: Option<IpFamily>,
    pub ports: Vec<Port>,
    pub endpoints: Vec<SliceEndpoint>,
    /// Its stale annotations.
    pub stale: Option<Stale>,
    /// It was written with zone hints (an annotation says so): hints absent on its
    /// endpoints were dropped by a server whose feature is off, and are no difference.
    pub hinted: bool,
    /// Its labels, owner and managed fields are as we write them; if not, it is written
    /// even when its endpoints are right.
    pub intact: bool,
}

/// A slice the export should have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlicePlan {
    pub name: String,
    pub ports: Vec<Port>,
    /// Sorted by address.
    pub endpoints: Vec<SliceEndpoint>,
}

/// What to do to an export's slices.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Every slice the export should have, sorted by name.
    pub slices: Vec<SlicePlan>,
    /// The names of those to write: new, or not as they should be.
    pub write: Vec<String>,
    /// Slices to delete, sorted.
    pub delete: Vec<String>,
}

/// The slices `desired` needs, given the `live` ones of the Service `service`.
pub fn plan(service: &str, desired: &Desired, live: &[LiveSlice]) -> Plan {
    let mut remaining: BTreeMap<&Vec<Port>, BTreeMap<&str, &SliceEndpoint>> =
        desired.groups.iter().map(|(ports, eps)| (ports, eps.iter().map(|(a, e)| (a.as_str(), e)).collect())).collect();
    let mut live_sorted: Vec<&LiveSlice> = live.iter().collect();
    live_sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut kept: Vec<SlicePlan> = Vec::new();
    // Names of our slices of the right family whose port set is no longer wanted.
    let mut free: Vec<&str> = Vec::new();
    let mut delete: BTreeSet<String> = BTreeSet::new();
    for l in &live_sorted {
        if l.family != Some(desired.family) {
            delete.insert(l.name.clone());
            continue;
        }
        let Some(wanted) = remaining.get_mut(&l.ports) else {
            free.push(&l.name);
            continue;
        };
        let endpoints: Vec<SliceEndpoint> = l
            .endpoints
            .iter()
            .filter_map(|e| wanted.remove(e.address.as_str()).cloned())
            .take(MAX_ENDPOINTS_PER_SLICE)
            .collect();
        kept.push(SlicePlan { name: l.name.clone(), ports: l.ports.clone(), endpoints });
    }
    let mut used: BTreeSet<String> = live.iter().map(|l| l.name.clone()).collect();
    let mut free = free.into_iter();
    let mut next = 0usize;
    for (ports, mut left) in remaining {
        // Existing slices of this port set with room, in name order.
        for slice in kept.iter_mut().filter(|s| &s.ports == ports) {
            while slice.endpoints.len() < MAX_ENDPOINTS_PER_SLICE {
                let Some((_, e)) = left.pop_first() else { break };
                slice.endpoints.push(e.clone());
            }
        }
        while !left.is_empty() {
            let name = match free.next() {
                Some(n) => n.to_owned(),
                None => loop {
                    let n = format!("{service}-{next}");
                    next += 1;
                    if used.insert(n.clone()) {
                        break n;
                    }
                },
            };
            let mut endpoints = Vec::new();
            while endpoints.len() < MAX_ENDPOINTS_PER_SLICE {
                let Some((_, e)) = left.pop_first() else { break };
                endpoints.push(e.clone());
            }
            kept.push(SlicePlan { name, ports: ports.clone(), endpoints });
        }
    }
    delete.extend(free.map(str::to_owned));
    let mut slices = Vec::new();
    for mut s in kept {
        if s.endpoints.is_empty() {
            delete.insert(s.name);
            continue;
        }
        s.endpoints.sort();
        slices.push(s);
    }
    slices.sort_by(|a, b| a.name.cmp(&b.name));
    let write = to_write(&slices, desired, live);
    Plan { slices, write, delete: delete.into_iter().collect() }
}

/// The names of the planned `slices` that are new or not as they should be in the cluster.
fn to_write(slices: &[SlicePlan], desired: &Desired, live: &[LiveSlice]) -> Vec<String> {
    let by_name: BTreeMap<&str, &LiveSlice> = live.iter().map(|l| (l.name.as_str(), l)).collect();
    slices
        .iter()
        .filter(|s| {
            by_name.get(s.name.as_str()).is_none_or(|l| {
                !l.intact
                    || l.family != Some(desired.family)
                    || l.ports != s.ports
                    || !same_endpoints(l, &s.endpoints)
                    || l.hinted != s.hinted()
                    || l.stale != desired.stale
            })
        })
        .map(|s| s.name.clone())
        .collect()
}

impl SlicePlan {
    /// Whether any of its endpoints carries a zone hint.
    pub fn hinted(&self) -> bool {
        self.endpoints.iter().any(|e| e.hint.is_some())
    }
}

/// Whether the live slice holds `planned` (sorted). A hint absent on a slice written with
/// hints was dropped by the server: rewriting it would be dropped again, on every pass.
fn same_endpoints(live: &LiveSlice, planned: &[SliceEndpoint]) -> bool {
    let mut endpoints = live.endpoints.clone();
    endpoints.sort();
    endpoints.len() == planned.len()
        && endpoints.iter().zip(planned).all(|(l, p)| {
            let dropped = live.hinted && l.hint.is_none();
            let hint_ok = l.hint == p.hint || dropped;
            (&l.address, l.ready, l.serving, &l.zone) == (&p.address, p.ready, p.serving, &p.zone) && hint_ok
        })
}

#[cfg(test)]
mod tests {
    use super::super::tests::{desired, endpoint, web};
    use super::*;

    /// The cluster after `plan` is carried out on `live`.
    fn apply(plan: &Plan, d: &Desired) -> Vec<LiveSlice> {
        plan.slices
            .iter()
            .map(|s| LiveSlice {
                name: s.name.clone(),
                family: Some(d.family),
                ports: s.ports.clone(),
                endpoints: s.endpoints.clone(),
                stale: d.stale.clone(),
                hinted: s.hinted(),
                intact: true,
            })
            .collect()
    }

    #[test]
    fn two_hundred_fifty_instances_are_three_slices_and_a_second_pass_writes_nothing() {
        let d = desired(serde_json::json!({"service": "web"}), web(250, 80));
        let p = plan("web", &d, &[]);
        let sizes: Vec<_> = p.slices.iter().map(|s| (s.name.as_str(), s.endpoints.len())).collect();
        assert_eq!(sizes, [("web-0", 100), ("web-1", 100), ("web-2", 50)]);
        assert_eq!(p.write, ["web-0", "web-1", "web-2"]);
        let again = plan("web", &d, &apply(&p, &d));
        assert!(again.write.is_empty() && again.delete.is_empty(), "{again:?}");
        assert_eq!(again.slices, p.slices);
    }

    #[test]
    fn one_instance_leaving_and_another_arriving_rewrite_one_slice() {
        let mut eps = web(250, 80);
        let d = desired(serde_json::json!({"service": "web"}), eps.clone());
        let live = apply(&plan("web", &d, &[]), &d);
        // One that web-1 holds leaves.
        let gone = live[1].endpoints[40].address.clone();
        eps.retain(|e| e.address != gone);
        eps.push(endpoint("10.9.9.9", 80));
        let d2 = desired(serde_json::json!({"service": "web"}), eps);
        let p = plan("web", &d2, &live);
        // The newcomer takes the place freed in web-1: one write, nothing moves.
        assert_eq!(p.write, ["web-1"]);
        assert!(p.delete.is_empty());
        assert_eq!(p.slices.iter().map(|s| s.endpoints.len()).sum::<usize>(), 250);
    }

    #[test]
    fn a_port_change_moves_instances_between_slices() {
        let mut eps = web(150, 80);
        let d = desired(serde_json::json!({"service": "web"}), eps.clone());
        let live = apply(&plan("web", &d, &[]), &d);
        // Ten that web-0 holds move to another port.
        let moving: Vec<String> = live[0].endpoints[..10].iter().map(|e| e.address.clone()).collect();
        for e in eps.iter_mut().filter(|e| moving.contains(&e.address)) {
            e.port = 8080;
        }
        let d2 = desired(serde_json::json!({"service": "web"}), eps);
        let p = plan("web", &d2, &live);
        // The ten leave web-0 for a new slice of their own port set.
        assert_eq!(p.write, ["web-0", "web-2"]);
        let moved = p.slices.iter().find(|s| s.name == "web-2").unwrap();
        assert_eq!((moved.ports[0].port, moved.endpoints.len()), (8080, 10));
        assert_eq!(d2.ports.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["tcp-80", "tcp-8080"]);
        // And back: web-2's port set is gone and it is deleted; web-0 takes them back.
        let p3 = plan("web", &d, &apply(&p, &d2));
        assert_eq!((p3.write.as_slice(), p3.delete.as_slice()), (&["web-0".to_owned()][..], &["web-2".to_owned()][..]));
    }

    #[test]
    fn a_slice_of_ports_no_longer_wanted_is_reused_and_emptied_ones_deleted() {
        let d = desired(serde_json::json!({"service": "web"}), web(30, 80));
        let live = apply(&plan("web", &d, &[]), &d);
        // Every instance moves to 81: web-0 is rewritten in place (ports can change).
        let d2 = desired(serde_json::json!({"service": "web"}), web(30, 81));
        let p = plan("web", &d2, &live);
        assert_eq!((p.write.as_slice(), p.delete.is_empty()), (&["web-0".to_owned()][..], true));
        // No instance at all: the slice goes.
        let none = desired(serde_json::json!({"service": "web"}), vec![]);
        let p = plan("web", &none, &live);
        assert!(p.slices.is_empty());
        assert_eq!(p.delete, ["web-0"]);
    }

    #[test]
    fn staleness_a_foreign_family_and_a_tampered_slice_are_rewritten() {
        let d = desired(serde_json::json!({"service": "web"}), web(5, 80));
        let mut live = apply(&plan("web", &d, &[]), &d);
        let mut stale = d.clone();
        stale.stale = Some(Stale { since: "2026-11-25T00:00:00Z".into(), reason: "down".into() });
        assert_eq!(plan("web", &stale, &live).write, ["web-0"]);
        live[0].intact = false;
        assert_eq!(plan("web", &d, &live).write, ["web-0"]);
        // An FQDN slice cannot become IPv4: a new name, and the old one deleted.
        live[0].family = None;
        let p = plan("web", &d, &live);
        assert_eq!((p.write.as_slice(), p.delete.as_slice()), (&["web-1".to_owned()][..], &["web-0".to_owned()][..]));
    }

    #[test]
    fn hints_dropped_on_read_back_are_no_difference_and_a_real_hint_change_is() {
        let zoned = |zone: &str| -> Vec<crate::model::Endpoint> {
            web(3, 80).into_iter().map(|e| crate::model::Endpoint { zone: Some(zone.into()), ..e }).collect()
        };
        let asked = serde_json::json!({"service": "web", "trafficDistribution": "PreferClose"});
        let d = desired(asked.clone(), zoned("a"));
        let p = plan("web", &d, &[]);
        assert!(p.slices[0].hinted() && p.write == ["web-0"]);
        let live = apply(&p, &d);
        assert!(plan("web", &d, &live).write.is_empty());
        // A server with the feature off kept the slice but not its hints: as written.
        let mut dropped = live.clone();
        dropped[0].endpoints.iter_mut().for_each(|e| e.hint = None);
        assert!(plan("web", &d, &dropped).write.is_empty(), "no rewrite on every pass");
        // Hints asked for a slice written without them: written.
        let mut unhinted = dropped.clone();
        unhinted[0].hinted = false;
        assert_eq!(plan("web", &d, &unhinted).write, ["web-0"]);
        // Another zone: a real change.
        assert_eq!(plan("web", &desired(asked, zoned("b")), &live).write, ["web-0"]);
        // No longer asked: the hints go.
        assert_eq!(plan("web", &desired(serde_json::json!({"service": "web"}), zoned("a")), &live).write, ["web-0"]);
    }

    #[test]
    fn an_endpoint_in_two_live_slices_is_kept_once() {
        let d = desired(serde_json::json!({"service": "web"}), web(3, 80));
        let mut live = apply(&plan("web", &d, &[]), &d);
        let mut dup = live[0].clone();
        dup.name = "web-7".into();
        live.push(dup);
        let p = plan("web", &d, &live);
        assert_eq!(p.slices.iter().map(|s| s.endpoints.len()).sum::<usize>(), 3);
        assert_eq!(p.delete, ["web-7"]);
    }
}
