//! The view every client is served from: the encoded resources of each upstream, and a log
//! of each upstream's latest change by number, so a client catches up at the cost of what
//! changed rather than of everything served.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use crate::resources::{self, Kind, Rejection, Resource, Upstream};

/// What changed since the last update.
#[derive(Clone, Debug, Default)]
pub struct Changes {
    /// Upstreams added or changed, each whole.
    pub upserts: Vec<Upstream>,
    /// Names of upstreams gone.
    pub removals: Vec<String>,
    /// `upserts` is everything: any upstream served and not in it is removed. This costs
    /// a pass over everything served; an incremental update costs what it changes.
    pub complete: bool,
}

/// What an update left out, because Envoy would refuse it.
#[derive(Clone, Debug, Default)]
pub struct UpdateReport {
    pub rejections: Vec<Rejection>,
}

/// One upstream's resources.
#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) cluster: Arc<Resource>,
    pub(crate) endpoints: Arc<Resource>,
    /// What was left out of it, for `rejections()`.
    rejections: Vec<Rejection>,
}

impl Entry {
    pub(crate) fn get(&self, kind: Kind) -> &Arc<Resource> {
        match kind {
            Kind::Cluster => &self.cluster,
            Kind::Endpoints => &self.endpoints,
        }
    }
}

/// The most removals remembered; a client further behind compares everything it holds.
const MAX_TOMBSTONES: usize = 4096;

#[derive(Debug, Default)]
pub(crate) struct View {
    /// Whether an update arrived: nothing is served before the first.
    ready: bool,
    /// The number of the latest change; a client's position in the log.
    seq: u64,
    entries: HashMap<String, Entry>,
    /// Each upstream's latest change (an upsert or a removal) by its number, and back.
    log: BTreeMap<u64, String>,
    changed_at: HashMap<String, u64>,
    /// The latest changes that are removals, so the oldest can be forgotten.
    removals: BTreeMap<u64, String>,
    /// Changes before this number may have been forgotten.
    floor: u64,
}

/// What a client should look at since a change number.
pub(crate) enum Since<'a> {
    /// These upstreams changed (or went away).
    Changed(Vec<&'a str>),
    /// Removals were forgotten since: compare everything.
    Everything,
}

impl View {
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    pub(crate) fn ready(&self) -> bool {
        self.ready
    }

    pub(crate) fn get(&self, name: &str) -> Option<&Entry> {
        self.entries.get(name)
    }

    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// What changed after change number `seq`.
    pub(crate) fn since(&self, seq: u64) -> Since<'_> {
        if seq < self.floor {
            return Since::Everything;
        }
        Since::Changed(self.log.range(seq + 1..).map(|(_, name)| name.as_str()).collect())
    }

    pub(crate) fn rejections(&self) -> Vec<Rejection> {
        let mut all: Vec<Rejection> = self.entries.values().flat_map(|e| e.rejections.iter().cloned()).collect();
        all.sort_by(|a, b| a.upstream.cmp(&b.upstream));
        all
    }

    /// Applies `changes`. Returns what was left out.
    pub(crate) fn apply(&mut self, changes: Changes) -> UpdateReport {
        let mut report = UpdateReport::default();
        if changes.complete {
            let keep: HashSet<&str> = changes.upserts.iter().map(|u| u.name.as_str()).collect();
            let gone: Vec<String> = self.names().filter(|name| !keep.contains(name)).map(str::to_owned).collect();
            for name in gone {
                self.remove(&name);
            }
        }
        for name in &changes.removals {
            self.remove(name);
        }
        for upstream in &changes.upserts {
            self.upsert(upstream, &mut report);
        }
        self.ready = true;
        self.forget_old_removals();
        report
    }

    fn upsert(&mut self, upstream: &Upstream, report: &mut UpdateReport) {
        if let Err(reason) = resources::check_name(&upstream.name) {
            report.rejections.push(Rejection { upstream: upstream.name.clone(), endpoint: None, reason });
            // A name Envoy would refuse was never served, so there is nothing to remove.
            return;
        }
        let mut rejections = Vec::new();
        let endpoints = resources::build_endpoints(upstream, &mut rejections);
        report.rejections.extend(rejections.iter().cloned());
        if let Some(entry) = self.entries.get_mut(&upstream.name)
            && entry.endpoints.version == endpoints.version
        {
            // Unchanged content: nothing to tell anyone, only the reasons to keep current.
            entry.rejections = rejections;
            return;
        }
        // A cluster's resource depends on its name only: built once, so an endpoint change
        // leaves its version, and every client's copy, as they were.
        let cluster = match self.entries.get(&upstream.name) {
            Some(previous) => previous.cluster.clone(),
            None => resources::build_cluster(&upstream.name),
        };
        self.entries.insert(upstream.name.clone(), Entry { cluster, endpoints, rejections });
        self.record(&upstream.name, false);
    }

    fn remove(&mut self, name: &str) {
        if self.entries.remove(name).is_some() {
            self.record(name, true);
        }
    }

    fn record(&mut self, name: &str, removal: bool) {
        self.seq += 1;
        if let Some(previous) = self.changed_at.insert(name.to_owned(), self.seq) {
            self.log.remove(&previous);
            self.removals.remove(&previous);
        }
        self.log.insert(self.seq, name.to_owned());
        if removal {
            self.removals.insert(self.seq, name.to_owned());
        }
    }

    /// Keeps the memory of removals bounded: the oldest are forgotten, and a client that
    /// has not caught up with them compares everything it holds instead.
    fn forget_old_removals(&mut self) {
        while self.removals.len() > MAX_TOMBSTONES {
            let Some((seq, name)) = self.removals.pop_first() else { break };
            self.log.remove(&seq);
            self.changed_at.remove(&name);
            self.floor = self.floor.max(seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{EndpointHealth, UpstreamEndpoint};

    fn upstream(name: &str, port: u16) -> Upstream {
        let endpoint = UpstreamEndpoint {
            address: "10.0.0.1".to_owned(),
            port,
            zone: None,
            health: EndpointHealth::Healthy,
            weight: 1,
        };
        Upstream { name: name.to_owned(), endpoints: vec![endpoint] }
    }

    fn changed(view: &View, seq: u64) -> Vec<String> {
        match view.since(seq) {
            Since::Changed(names) => names.into_iter().map(str::to_owned).collect(),
            Since::Everything => vec!["*".to_owned()],
        }
    }

    #[test]
    fn a_client_catches_up_with_what_changed_only() {
        let mut view = View::default();
        assert!(!view.ready());
        view.apply(Changes { upserts: vec![upstream("a", 80), upstream("b", 80)], ..Default::default() });
        assert!(view.ready());
        let seen = view.seq();
        let cluster_a = view.get("a").unwrap().cluster.version.clone();
        view.apply(Changes { upserts: vec![upstream("a", 81), upstream("b", 80)], ..Default::default() });
        assert_eq!(changed(&view, seen), vec!["a"], "an unchanged upstream is no change");
        assert_eq!(view.get("a").unwrap().cluster.version, cluster_a, "an endpoint change keeps the cluster");
        let seen = view.seq();
        view.apply(Changes { upserts: vec![upstream("c", 80)], complete: true, ..Default::default() });
        let mut names = changed(&view, seen);
        names.sort();
        assert_eq!(names, vec!["a", "b", "c"]);
        assert!(view.get("a").is_none() && view.get("c").is_some());
    }

    #[test]
    fn forgotten_removals_make_a_late_client_compare_everything() {
        let mut view = View::default();
        view.apply(Changes::default());
        let names: Vec<String> = (0..=MAX_TOMBSTONES).map(|i| format!("u{i}")).collect();
        let upserts = names.iter().map(|n| upstream(n, 80)).collect();
        view.apply(Changes { upserts, ..Default::default() });
        let seen = view.seq();
        view.apply(Changes { removals: names.clone(), ..Default::default() });
        assert_eq!(changed(&view, seen), vec!["*"]);
        assert_eq!(changed(&view, view.seq()), Vec::<String>::new());
        assert!(view.removals.len() <= MAX_TOMBSTONES);
    }
}
