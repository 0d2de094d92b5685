//! Endpoints of referenced Kubernetes Services: which watch brings them (EndpointSlices,
//! `discovery.k8s.io/v1`, or, on API servers that do not serve that, core `Endpoints`), and
//! a Service's endpoints from what its watch holds (decoded at ingestion:
//! `crate::ingest::endpoints`).

use std::collections::{BTreeMap, BTreeSet};

use crate::ingest::endpoints::SERVICE_NAME_LABEL;
use crate::keys::KubeKey;
use crate::model::{Decoded, KubeEndpoint, Stored};

/// Which API carries Service endpoints on this API server (found by discovery).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EndpointsApi {
    /// `discovery.k8s.io/v1` EndpointSlices, selected by `kubernetes.io/service-name`.
    #[default]
    EndpointSlices,
    /// Core `v1` Endpoints, selected by `metadata.name` (API servers before 1.21).
    Endpoints,
}

impl EndpointsApi {
    /// The API group of the objects that carry endpoints.
    pub(crate) fn group(self) -> &'static str {
        match self {
            EndpointsApi::EndpointSlices => "discovery.k8s.io",
            EndpointsApi::Endpoints => "",
        }
    }

    /// The kind of the objects that carry endpoints.
    pub(crate) fn kind(self) -> &'static str {
        match self {
            EndpointsApi::EndpointSlices => "EndpointSlice",
            EndpointsApi::Endpoints => "Endpoints",
        }
    }

    /// The watch that brings the endpoints of Service `namespace/name` and nothing else
    /// (see [`Scoping`] for when its namespace's watch serves it instead).
    pub fn key(self, namespace: &str, name: &str) -> KubeKey {
        match self {
            EndpointsApi::EndpointSlices => KubeKey::new(self.group(), "v1", self.kind())
                .in_namespace(namespace)
                .with_labels(format!("kubernetes.io/service-name={name}")),
            EndpointsApi::Endpoints => KubeKey::new(self.group(), "v1", self.kind())
                .in_namespace(namespace)
                .with_fields(format!("metadata.name={name}")),
        }
    }
}

impl EndpointsApi {
    /// The one watch that brings the endpoints of every Service of `namespace`: used once
    /// more than [`Scoping`]'s threshold of its Services are routed to. EndpointSlices are
    /// selected by the presence of the Service label (slices of a Service only).
    pub fn namespace_key(self, namespace: &str) -> KubeKey {
        let key = KubeKey::new(self.group(), "v1", self.kind()).in_namespace(namespace);
        match self {
            EndpointsApi::EndpointSlices => key.with_labels(SERVICE_NAME_LABEL),
            EndpointsApi::Endpoints => key,
        }
    }

    /// Whether `key` is a watch of this API shared by several Services (a namespace's or the
    /// cluster's, [`EndpointsApi::namespace_key`], [`EndpointsApi::cluster_key`]), not one
    /// Service's own.
    pub(crate) fn is_shared(self, key: &KubeKey) -> bool {
        let shared_labels = match self {
            EndpointsApi::EndpointSlices => Some(SERVICE_NAME_LABEL),
            EndpointsApi::Endpoints => None,
        };
        key.is(self.group(), self.kind())
            && key.field_selector.is_none()
            && key.label_selector.as_deref() == shared_labels
    }

    /// The one watch that brings the endpoints of every Service of the cluster: used when
    /// even one watch per namespace would exceed [`WatchLimits::budget`].
    pub fn cluster_key(self) -> KubeKey {
        let key = KubeKey::new(self.group(), "v1", self.kind());
        match self {
            EndpointsApi::EndpointSlices => key.with_labels(SERVICE_NAME_LABEL),
            EndpointsApi::Endpoints => key,
        }
    }
}

/// The bounds on endpoints watches ([`Scoping`]), from the operator's flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchLimits {
    /// Past this many routed-to Services in one namespace, one watch serves the namespace.
    pub namespace_above: usize,
    /// Endpoints watches in total: past it, the namespaces with the most routed-to Services
    /// are watched whole first, then (where allowed) the whole cluster.
    pub budget: usize,
    /// Whether one watch of every namespace may serve all: not when `--namespace` confines
    /// the operator (its RBAC may not reach beyond).
    pub cluster_wide: bool,
}

impl Default for WatchLimits {
    fn default() -> Self {
        WatchLimits {
            namespace_above: DEFAULT_ENDPOINTS_NAMESPACE_WATCH_ABOVE,
            budget: DEFAULT_ENDPOINTS_WATCH_BUDGET,
            cluster_wide: true,
        }
    }
}

/// The default of [`WatchLimits::namespace_above`].
pub const DEFAULT_ENDPOINTS_NAMESPACE_WATCH_ABOVE: usize = 100;
/// The default of [`WatchLimits::budget`]: over HTTP/1.1 each watch holds a connection to
/// the API server, so a few hundred, not thousands.
pub const DEFAULT_ENDPOINTS_WATCH_BUDGET: usize = 250;

impl WatchLimits {
    /// Where a move back is allowed: a namespace goes back to one watch per Service, and the
    /// cluster's watch back to the namespaces', only while the watches stay at or below three
    /// quarters of the budget, so a count hovering at the budget does not flip them.
    pub(crate) fn low_water(self) -> usize {
        self.budget.saturating_mul(3) / 4
    }
}

/// Which watch brings the endpoints of each routed-to Service: one watch each, one watch of
/// its namespace, or one of the cluster. One watch per Service reads only what is routed
/// to, but costs the API server a list, a watch and (over HTTP/1.1) a connection per
/// Service: thousands at scale. Two rules widen:
///
/// - per namespace: past `namespace_above` Services in a namespace, one watch of the
///   namespace serves them all; back below half of that, one each again;
/// - in total: past `budget` watches, the namespaces with the most routed-to Services are
///   watched whole first, until the total fits; a namespace goes back to one watch each
///   (fewest Services first) only while the total stays within [`WatchLimits::low_water`].
///   When even one watch per namespace exceeds the budget, one watch of the cluster serves
///   all (where [`WatchLimits::cluster_wide`]); back once the namespaces' watches fit
///   within the low water again. Confined to namespaces, the operator keeps one watch per
///   namespace over the budget, and says so ([`Scoping::over_budget`]).
///
/// A move never publishes an empty answer: the Service's entry stays what the old watch
/// said until the new one has listed (`read::kube`).
#[derive(Debug, Clone, Default)]
pub(crate) struct Scoping {
    wide: BTreeSet<String>,
    cluster: bool,
    /// The watches the namespaces need at the fewest (one each) exceed the budget, and the
    /// cluster may not be watched whole: (namespaces, budget).
    over_budget: Option<(usize, usize)>,
}

impl Scoping {
    /// Decides again from the number of routed-to Services per namespace.
    pub(crate) fn update(&mut self, counts: &BTreeMap<&str, usize>, limits: WatchLimits) {
        let above = limits.namespace_above;
        self.wide.retain(|ns| counts.contains_key(ns.as_str()));
        self.wide.extend(counts.iter().filter(|&(_, &n)| n > above).map(|(ns, _)| (*ns).to_owned()));
        let mut cost = self.cost(counts);
        // Over the budget: the namespaces with the most Services watched whole first.
        let mut widenable: Vec<(usize, &str)> =
            counts.iter().filter(|&(ns, &n)| n > 1 && !self.wide.contains(*ns)).map(|(ns, &n)| (n, *ns)).collect();
        widenable.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
        for (n, ns) in widenable {
            if cost <= limits.budget {
                break;
            }
            self.wide.insert(ns.to_owned());
            cost -= n - 1;
        }
        // Back to one watch each, the smallest first, only within the low water.
        let mut narrowable: Vec<(usize, &str)> = counts
            .iter()
            .filter(|&(ns, &n)| n <= above / 2 && self.wide.contains(*ns))
            .map(|(ns, &n)| (n, *ns))
            .collect();
        narrowable.sort_unstable();
        for (n, ns) in narrowable {
            if cost + n - 1 > limits.low_water() {
                break;
            }
            self.wide.remove(ns);
            cost += n - 1;
        }
        self.cluster =
            limits.cluster_wide && if self.cluster { cost > limits.low_water() } else { cost > limits.budget };
        self.over_budget = (!self.cluster && cost > limits.budget).then_some((counts.len(), limits.budget));
    }

    /// The endpoints watches of the namespaces' layout (without the cluster's).
    fn cost(&self, counts: &BTreeMap<&str, usize>) -> usize {
        counts.iter().map(|(ns, &n)| if self.wide.contains(*ns) { 1 } else { n }).sum()
    }

    /// Whether the watch of Services of `namespace` holds other Services' objects too.
    pub(crate) fn is_shared(&self, namespace: &str) -> bool {
        self.cluster || self.wide.contains(namespace)
    }

    /// See [`Scoping`]: `Some((namespaces, budget))` while confined over the budget.
    pub(crate) fn over_budget(&self) -> Option<(usize, usize)> {
        self.over_budget
    }

    /// The watch that brings the endpoints of Service `namespace/name` now.
    pub(crate) fn key(&self, api: EndpointsApi, namespace: &str, name: &str) -> KubeKey {
        if self.cluster {
            api.cluster_key()
        } else if self.wide.contains(namespace) {
            api.namespace_key(namespace)
        } else {
            api.key(namespace, name)
        }
    }
}

/// The namespaces to watch whole before every route is known (a cold start's routes still
/// listing): those that the layout of the Services routed to so far (`counts`) watches
/// whole, beyond those watched early already. The counts only grow while the routes list,
/// so a namespace past `namespace_above` stays past it, and past the budget the namespaces
/// with the most Services, widened first, mostly stay the ones widened; a namespace the
/// final layout watches one Service at a time after all has its early watch stopped (one
/// list of the namespace spent). None once the layout is the cluster's watch (it stays
/// so), and at most one fewer than the budget, so that the cluster's watch, should the
/// layout end there, starts within the budget beside them.
pub(crate) fn early_namespaces(
    counts: &BTreeMap<&str, usize>,
    early: &BTreeMap<String, KubeKey>,
    limits: WatchLimits,
) -> Vec<String> {
    let mut layout = Scoping::default();
    layout.update(counts, limits);
    if layout.cluster {
        return Vec::new();
    }
    let room = limits.budget.saturating_sub(1).saturating_sub(early.len());
    layout.wide.into_iter().filter(|ns| !early.contains_key(ns)).take(room).collect()
}

/// The endpoints of Service `service` among the objects of a watch (decoded at ingestion),
/// sorted and de-duplicated across its EndpointSlices. A Service's own watch holds only
/// its objects; a namespace's holds every Service's, told apart by the decoded name.
pub(crate) fn merge<'a>(service: &str, objects: impl Iterator<Item = &'a Stored>) -> Vec<KubeEndpoint> {
    let mut out = BTreeSet::new();
    for obj in objects {
        if let Decoded::Endpoints { service: of, endpoints } = &obj.decoded
            && of == service
        {
            out.extend(endpoints.iter().cloned());
        }
    }
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The per-namespace rule alone (a budget nothing reaches).
    const WIDE_ABOVE_100: WatchLimits = WatchLimits { namespace_above: 100, budget: usize::MAX, cluster_wide: true };

    fn update(s: &mut Scoping, counts: &[(&str, usize)], limits: WatchLimits) {
        s.update(&counts.iter().copied().filter(|(_, n)| *n > 0).collect(), limits);
    }

    #[test]
    fn namespaces_go_wide_past_the_threshold_and_back_at_half() {
        let mut s = Scoping::default();
        update(&mut s, &[("shop", 100), ("blog", 3)], WIDE_ABOVE_100);
        assert!(!s.is_shared("shop"), "at the threshold: one watch each");
        update(&mut s, &[("shop", 101), ("blog", 3)], WIDE_ABOVE_100);
        assert!(s.is_shared("shop") && !s.is_shared("blog"));
        assert_eq!(s.key(EndpointsApi::Endpoints, "shop", "web"), EndpointsApi::Endpoints.namespace_key("shop"));
        assert_eq!(s.key(EndpointsApi::Endpoints, "blog", "web"), EndpointsApi::Endpoints.key("blog", "web"));
        update(&mut s, &[("shop", 51), ("blog", 3)], WIDE_ABOVE_100);
        assert!(s.is_shared("shop"), "above half: still one watch for the namespace");
        update(&mut s, &[("shop", 50), ("blog", 3)], WIDE_ABOVE_100);
        assert!(!s.is_shared("shop"), "at half: one each again");
        update(&mut s, &[("shop", 200)], WIDE_ABOVE_100);
        update(&mut s, &[], WIDE_ABOVE_100);
        assert!(!s.is_shared("shop"), "a namespace no longer routed to is forgotten");
        let k = EndpointsApi::Endpoints.namespace_key("shop");
        assert_eq!((k.label_selector, k.field_selector), (None, None));
    }

    /// The watches `s` implies for `counts` (what the desired watches hold).
    fn watches(s: &Scoping, counts: &[(&str, usize)]) -> BTreeSet<KubeKey> {
        let api = EndpointsApi::EndpointSlices;
        counts.iter().flat_map(|&(ns, n)| (0..n).map(move |i| s.key(api, ns, &format!("svc-{i}")))).collect()
    }

    const BUDGET_10: WatchLimits = WatchLimits { namespace_above: 100, budget: 10, cluster_wide: true };

    #[test]
    fn past_the_budget_the_biggest_namespaces_go_wide_first_and_back_below_three_quarters() {
        let mut s = Scoping::default();
        let mut counts = vec![("a", 2), ("b", 5), ("c", 3)];
        update(&mut s, &counts, BUDGET_10);
        assert_eq!(watches(&s, &counts).len(), 10, "at the budget: one watch each");
        assert!(!s.is_shared("b"));
        counts[0].1 = 3;
        update(&mut s, &counts, BUDGET_10);
        assert!(s.is_shared("b") && !s.is_shared("a") && !s.is_shared("c"), "the biggest first, and enough");
        assert_eq!(watches(&s, &counts).len(), 7);
        // Down to 8 Services: one each would be 8, above three quarters of 10.
        counts[0].1 = 1;
        counts[2].1 = 2;
        update(&mut s, &counts, BUDGET_10);
        assert!(s.is_shared("b"), "kept wide: narrowing would pass the low water");
        counts[1].1 = 4;
        update(&mut s, &counts, BUDGET_10);
        assert!(!s.is_shared("b"), "7 watches fit within the low water: one each again");
        assert_eq!(watches(&s, &counts).len(), 7);
        assert_eq!(s.over_budget(), None);
    }

    #[test]
    fn more_namespaces_than_the_budget_share_one_watch_of_the_cluster_where_allowed() {
        let ns: Vec<String> = (0..12).map(|i| format!("team-{i:02}")).collect();
        let counts: Vec<(&str, usize)> = ns.iter().map(|n| (n.as_str(), 3)).collect();
        let mut s = Scoping::default();
        update(&mut s, &counts, BUDGET_10);
        assert_eq!(watches(&s, &counts), BTreeSet::from([EndpointsApi::EndpointSlices.cluster_key()]));
        let k = EndpointsApi::EndpointSlices.cluster_key();
        assert_eq!((k.namespace, k.label_selector.as_deref()), (None, Some(SERVICE_NAME_LABEL)));
        // Eight namespaces: above the low water of 7, still the cluster's watch.
        update(&mut s, &counts[..8], BUDGET_10);
        assert_eq!(watches(&s, &counts[..8]).len(), 1);
        update(&mut s, &counts[..7], BUDGET_10);
        assert_eq!(watches(&s, &counts[..7]).len(), 7, "one per namespace again");
        assert!(counts[..7].iter().all(|(n, _)| s.is_shared(n)));
        // Back up to 12: the cluster again.
        update(&mut s, &counts, BUDGET_10);
        assert_eq!(watches(&s, &counts).len(), 1);

        // Confined to namespaces: one watch each over the budget, and said.
        let confined = WatchLimits { cluster_wide: false, ..BUDGET_10 };
        update(&mut s, &counts, confined);
        assert_eq!(watches(&s, &counts).len(), 12);
        assert_eq!(s.over_budget(), Some((12, 10)));
        update(&mut s, &counts[..10], confined);
        assert_eq!((watches(&s, &counts[..10]).len(), s.over_budget()), (10, None));
    }

    /// Whatever the counts, the watches stay within the budget once settled (where the cluster
    /// may be watched whole), and a second update with the same counts moves nothing.
    #[test]
    fn any_counts_settle_within_the_budget_and_stay() {
        let mut rng = crate::test_support::Rng(7);
        let names: Vec<String> = (0..30).map(|i| format!("ns-{i}")).collect();
        let mut s = Scoping::default();
        for _ in 0..2_000 {
            let counts: Vec<(&str, usize)> =
                names.iter().map(|n| (n.as_str(), rng.below(12))).filter(|(_, n)| *n > 0).collect();
            let limits = WatchLimits { namespace_above: 8, budget: 4 + rng.below(40), cluster_wide: true };
            update(&mut s, &counts, limits);
            let once = watches(&s, &counts);
            assert!(
                once.len() <= limits.budget,
                "{} watches over a budget of {}: {counts:?}",
                once.len(),
                limits.budget
            );
            update(&mut s, &counts, limits);
            assert_eq!(watches(&s, &counts), once, "settled: {counts:?}");
        }
    }

    #[test]
    fn keys_select_one_service() {
        let k = EndpointsApi::EndpointSlices.key("shop", "billing");
        assert_eq!(k.label_selector.as_deref(), Some("kubernetes.io/service-name=billing"));
        let k = EndpointsApi::Endpoints.key("shop", "billing");
        assert_eq!(k.field_selector.as_deref(), Some("metadata.name=billing"));
        assert_eq!(k.namespace.as_deref(), Some("shop"));
    }
}
