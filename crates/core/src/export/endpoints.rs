//! The core `Endpoints` object of an export (`spec.endpoints: true`), for the consumers
//! that read Endpoints rather than EndpointSlices (Emissary's KubernetesEndpointResolver,
//! Prometheus `role: endpoints`, Traefik before 3.1). Planned from the same [`Desired`] as
//! the slices, so it holds what they hold, held and marked stale as they are.
//!
//! - one subset per port set (every address of a subset serves its ports, as in a slice);
//! - an endpoint the slices mark ready is in `addresses`, any other in `notReadyAddresses`;
//! - at most [`MAX_ADDRESSES`] addresses in all, as the control plane's own Endpoints
//!   controller and mirroring controller cap them (consumers and the API's users expect no
//!   more), and `truncated` when some were cut, so the object says it is not the whole
//!   truth. Which are kept is deterministic ([`plan`]): the same instances make the cut
//!   whatever order Consul answers in, so a cut list is not rewritten for nothing.

use std::cmp::Ordering;
use std::collections::BTreeSet;
use std::net::IpAddr;

use super::{Desired, Port};
use crate::assembler::snapshot::Stale;

/// Most addresses (ready and not ready, over all subsets) in one Endpoints object.
pub const MAX_ADDRESSES: usize = 1000;

/// One subset: addresses serving the same ports.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Subset {
    /// The instances' ports, named as the Service's (as a slice's).
    pub ports: Vec<Port>,
    /// Sorted by address (numerically).
    pub ready: Vec<String>,
    /// Sorted by address (numerically).
    pub not_ready: Vec<String>,
}

/// What the export's Endpoints object should hold, or (read back) holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointsPlan {
    /// Sorted by ports.
    pub subsets: Vec<Subset>,
    /// Some addresses were left out by the cap.
    pub truncated: bool,
    /// The addresses are the ones last obtained (as the slices' marks).
    pub stale: Option<Stale>,
}

impl EndpointsPlan {
    /// Addresses in all subsets, ready or not.
    pub fn address_count(&self) -> usize {
        self.subsets.iter().map(|s| s.ready.len() + s.not_ready.len()).sum()
    }

    /// The same content, whatever order each list is in (the API server keeps the order
    /// written, another writer may not): subsets by ports, addresses sorted, empty subsets
    /// dropped.
    pub fn normalized(&self) -> EndpointsPlan {
        let mut subsets: Vec<Subset> = self
            .subsets
            .iter()
            .filter(|s| !s.ready.is_empty() || !s.not_ready.is_empty())
            .map(|s| {
                let mut s = s.clone();
                s.ready.sort_by(|a, b| by_address(a, b));
                s.not_ready.sort_by(|a, b| by_address(a, b));
                s
            })
            .collect();
        subsets.sort();
        EndpointsPlan { subsets, truncated: self.truncated, stale: self.stale.clone() }
    }
}

/// Addresses in numeric order (IPv4 before IPv6); anything unparsable after, as text.
fn by_address(a: &str, b: &str) -> Ordering {
    match (a.parse::<IpAddr>(), b.parse::<IpAddr>()) {
        (Ok(x), Ok(y)) => x.cmp(&y),
        (Ok(_), Err(_)) => Ordering::Less,
        (Err(_), Ok(_)) => Ordering::Greater,
        (Err(_), Err(_)) => a.cmp(b),
    }
}

/// The Endpoints `desired` asks for. Over [`MAX_ADDRESSES`], the ones kept are: ready
/// before not ready (consumers route only to ready ones), then by address in numeric order,
/// then by port set; the rest are cut and the plan says `truncated`.
pub fn plan(desired: &Desired) -> EndpointsPlan {
    // (not ready, address, port set): the order of the choice.
    let mut all: Vec<(bool, &str, &Vec<Port>)> = desired
        .groups
        .iter()
        .flat_map(|(ports, eps)| eps.values().map(move |e| (!e.ready, e.address.as_str(), ports)))
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| by_address(a.1, b.1)).then_with(|| a.2.cmp(b.2)));
    let truncated = all.len() > MAX_ADDRESSES;
    all.truncate(MAX_ADDRESSES);
    let port_sets: BTreeSet<&Vec<Port>> = all.iter().map(|(_, _, p)| *p).collect();
    let subsets = port_sets
        .into_iter()
        .map(|ports| {
            let of = |not_ready: bool| -> Vec<String> {
                all.iter().filter(|e| e.2 == ports && e.0 == not_ready).map(|e| e.1.to_owned()).collect()
            };
            Subset { ports: ports.clone(), ready: of(false), not_ready: of(true) }
        })
        .collect();
    EndpointsPlan { subsets, truncated, stale: desired.stale.clone() }.normalized()
}

#[cfg(test)]
mod tests {
    use super::super::tests::{desired, endpoint, web};
    use super::*;

    #[test]
    fn one_subset_per_port_set_with_the_slices_ports_and_addresses_in_numeric_order() {
        let mut eps = web(12, 8080);
        eps.push(endpoint("10.9.0.1", 9090));
        let d = desired(serde_json::json!({"service": "web", "ports": [{"name": "http", "port": 80}]}), eps);
        let p = plan(&d);
        assert!(!p.truncated);
        let sets: Vec<(u16, &str, usize)> =
            p.subsets.iter().map(|s| (s.ports[0].port, s.ports[0].name.as_str(), s.ready.len())).collect();
        assert_eq!(sets, [(8080, "http", 12), (9090, "http", 1)]);
        // 10.1.0.2 before 10.1.0.10: numbers, not text.
        assert_eq!(p.subsets[0].ready[..3], ["10.1.0.1", "10.1.0.2", "10.1.0.3"]);
        assert_eq!(p.subsets[0].ready[11], "10.1.0.12");
        assert!(p.subsets.iter().all(|s| s.not_ready.is_empty()));
        assert_eq!(p.address_count(), 13);
    }

    #[test]
    fn endpoints_the_slices_mark_not_ready_are_not_ready_addresses() {
        let mut d = desired(serde_json::json!({"service": "web"}), web(3, 8080));
        for e in d.groups.values_mut().flat_map(|g| g.values_mut()) {
            e.ready = e.address != "10.1.0.2";
        }
        let p = plan(&d);
        assert_eq!(p.subsets.len(), 1);
        assert_eq!(p.subsets[0].ready, ["10.1.0.1", "10.1.0.3"]);
        assert_eq!(p.subsets[0].not_ready, ["10.1.0.2"]);
    }

    #[test]
    fn over_the_cap_the_lowest_addresses_are_kept_ready_first_and_the_plan_says_truncated() {
        let d = desired(serde_json::json!({"service": "web"}), web(MAX_ADDRESSES + 1, 8080));
        let p = plan(&d);
        assert!(p.truncated);
        assert_eq!(p.address_count(), MAX_ADDRESSES);
        // The highest address is the one cut (10.1.4.1 is the 1,001st).
        assert!(!p.subsets[0].ready.iter().any(|a| a == "10.1.4.1"));
        // The same instances in another order: the same choice.
        let mut shuffled = web(MAX_ADDRESSES + 1, 8080);
        shuffled.reverse();
        assert_eq!(plan(&desired(serde_json::json!({"service": "web"}), shuffled)), p);
        // A not-ready endpoint goes before any ready one, whatever its address.
        let mut d2 = d.clone();
        for e in d2.groups.values_mut().flat_map(|g| g.values_mut()) {
            e.ready = e.address != "10.1.0.1";
        }
        let p2 = plan(&d2);
        assert!(p2.truncated && p2.subsets[0].not_ready.is_empty());
        assert!(p2.subsets[0].ready.iter().any(|a| a == "10.1.4.1"), "the ready one kept instead");
        // Across port sets, the cap counts every address once per subset.
        let mut eps = web(600, 8080);
        eps.extend(web(600, 9090));
        let p3 = plan(&desired(serde_json::json!({"service": "web"}), eps));
        assert_eq!((p3.address_count(), p3.truncated), (MAX_ADDRESSES, true));
        assert_eq!(p3.subsets.len(), 2);
    }

    #[test]
    fn at_the_cap_nothing_is_cut_and_not_truncated() {
        let p = plan(&desired(serde_json::json!({"service": "web"}), web(MAX_ADDRESSES, 8080)));
        assert!(!p.truncated);
        assert_eq!(p.address_count(), MAX_ADDRESSES);
        let none = plan(&desired(serde_json::json!({"service": "web"}), vec![]));
        assert!(none.subsets.is_empty() && !none.truncated);
    }

    #[test]
    fn staleness_is_carried_and_order_does_not_matter_when_compared() {
        let mut d = desired(serde_json::json!({"service": "web"}), web(3, 8080));
        d.stale = Some(Stale { since: "2026-11-25T00:00:00Z".into(), reason: "Consul unreachable".into() });
        let p = plan(&d);
        assert_eq!(p.stale, d.stale);
        let mut shuffled = p.clone();
        shuffled.subsets[0].ready.reverse();
        assert_ne!(shuffled, p);
        assert_eq!(shuffled.normalized(), p);
    }
}
