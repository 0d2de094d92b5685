//! One client's book-keeping for one resource type, common to both protocol variants: what
//! it asked for, what it holds, what is on its way to it, and what it refused.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use tokio::time::Instant;

use crate::resources::{Kind, Resource};
use crate::state::{Since, View};

/// A resource a client holds: its version, and the resource itself when it was sent on
/// this stream (a reconnecting delta client only says the version it has).
#[derive(Clone, Debug)]
pub(crate) struct Held {
    pub(crate) version: String,
    pub(crate) resource: Option<Arc<Resource>>,
}

/// What differs between the view and what a client holds.
#[derive(Debug, Default)]
pub(crate) struct Diff {
    pub(crate) changed: Vec<Arc<Resource>>,
    pub(crate) removed: Vec<String>,
}

impl Diff {
    pub(crate) fn is_empty(&self) -> bool {
        self.changed.is_empty() && self.removed.is_empty()
    }
}

/// A response the client has not answered yet.
#[derive(Debug)]
struct InFlight {
    nonce: String,
    diff: Diff,
    sent_at: Instant,
}

/// How a client answered a response.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    Ack,
    /// Refused: these resources are quarantined at the version sent; `whole` when Envoy's
    /// message named none of them, so everything the response changed was.
    Nack {
        quarantined: Vec<String>,
        whole: bool,
    },
}

#[derive(Debug)]
pub(crate) struct Tracker {
    pub(crate) kind: Kind,
    /// The client asked for this type on this stream.
    pub(crate) requested: bool,
    /// The client's first request is answered even when there is nothing to send, so a
    /// client served no clusters knows it and completes its start.
    pub(crate) owes_answer: bool,
    wildcard: bool,
    names: HashSet<String>,
    held: HashMap<String, Held>,
    /// XOR of the `mix` of everything held: the version of the set.
    held_mix: u128,
    /// Resources the client refused, by name, at the version it refused.
    quarantine: HashMap<String, String>,
    in_flight: Option<InFlight>,
    /// The view's change number this tracker has compared up to.
    seen: u64,
    /// Compare everything at the next look (first request, forgotten removals).
    full: bool,
    /// Newly subscribed names to compare at the next look.
    fresh: HashSet<String>,
}

impl Tracker {
    pub(crate) fn new(kind: Kind) -> Tracker {
        Tracker {
            kind,
            requested: false,
            owes_answer: false,
            wildcard: false,
            names: HashSet::new(),
            held: HashMap::new(),
            held_mix: 0,
            quarantine: HashMap::new(),
            in_flight: None,
            seen: 0,
            full: true,
            fresh: HashSet::new(),
        }
    }

    pub(crate) fn held_count(&self) -> usize {
        self.held.len()
    }

    /// The version of the set the client holds.
    pub(crate) fn held_version(&self) -> String {
        crate::resources::set_version(self.held_mix)
    }

    pub(crate) fn held(&self, name: &str) -> Option<&Held> {
        self.held.get(name)
    }

    pub(crate) fn quarantined(&self, name: &str) -> Option<&str> {
        self.quarantine.get(name).map(String::as_str)
    }

    pub(crate) fn set_wildcard(&mut self, wildcard: bool) {
        if wildcard && !self.wildcard {
            self.full = true;
        }
        self.wildcard = wildcard;
    }

    pub(crate) fn subscribe(&mut self, name: &str) {
        if name == "*" {
            self.set_wildcard(true);
        } else if self.names.insert(name.to_owned()) {
            self.fresh.insert(name.to_owned());
        }
    }

    /// The client no longer wants `name`, and drops what it had of it.
    pub(crate) fn unsubscribe(&mut self, name: &str) {
        if name == "*" {
            self.wildcard = false;
            return;
        }
        self.names.remove(name);
        self.fresh.remove(name);
        if !self.wildcard {
            self.forget(name);
        }
    }

    /// Replaces the subscription with `names` (the state-of-the-world way).
    pub(crate) fn resubscribe(&mut self, names: &[String]) {
        let wanted: HashSet<&str> = names.iter().map(String::as_str).collect();
        let dropped: Vec<String> = self.names.iter().filter(|n| !wanted.contains(n.as_str())).cloned().collect();
        for name in dropped {
            self.unsubscribe(&name);
        }
        for name in names {
            self.subscribe(name);
        }
        if !self.wildcard {
            // What a wildcard subscription brought and the names do not keep, the client drops.
            let unwanted: Vec<String> = self.held.keys().filter(|n| !wanted.contains(n.as_str())).cloned().collect();
            for name in unwanted {
                self.forget(&name);
            }
        }
    }

    /// The client says it holds `name` at `version` (a delta client resuming).
    pub(crate) fn assume_held(&mut self, name: &str, version: &str) {
        self.insert_held(name, Held { version: version.to_owned(), resource: None });
    }

    /// The client holds everything wanted at its current version (a state-of-the-world
    /// client resuming with the version it would be sent).
    pub(crate) fn assume_current(&mut self, view: &View) {
        for name in self.wanted_names(view) {
            if let Some(entry) = view.get(&name) {
                let resource = entry.get(self.kind).clone();
                self.insert_held(&name, Held { version: resource.version.clone(), resource: Some(resource) });
            }
        }
        self.full = false;
        self.fresh.clear();
        self.seen = view.seq();
        self.owes_answer = false;
    }

    /// The digest of everything wanted, at its current version.
    pub(crate) fn current_mix(&self, view: &View) -> u128 {
        self.wanted_names(view)
            .iter()
            .filter_map(|name| view.get(name))
            .fold(0, |mix, entry| mix ^ entry.get(self.kind).mix)
    }

    pub(crate) fn wants(&self, name: &str) -> bool {
        self.wildcard || self.names.contains(name)
    }

    fn wanted_names(&self, view: &View) -> Vec<String> {
        if self.wildcard {
            view.names().chain(self.held.keys().map(String::as_str)).map(str::to_owned).collect::<HashSet<_>>()
        } else {
            self.names.iter().cloned().collect()
        }
        .into_iter()
        .collect()
    }

    fn insert_held(&mut self, name: &str, held: Held) {
        self.held_mix ^= crate::resources::mix(name, &held.version);
        if let Some(previous) = self.held.insert(name.to_owned(), held) {
            self.held_mix ^= crate::resources::mix(name, &previous.version);
        }
    }

    pub(crate) fn forget(&mut self, name: &str) {
        if let Some(previous) = self.held.remove(name) {
            self.held_mix ^= crate::resources::mix(name, &previous.version);
        }
    }

    /// What to send: `None` while a response is unanswered (the next one then carries
    /// everything that changed meanwhile), or when the client did not ask for this type.
    pub(crate) fn diff(&mut self, view: &View) -> Option<Diff> {
        if !self.requested || self.in_flight.is_some() || !view.ready() {
            return None;
        }
        if !self.full && self.fresh.is_empty() && self.seen == view.seq() {
            return None;
        }
        let candidates: Vec<String> = match (self.full, view.since(self.seen)) {
            (false, Since::Changed(names)) => {
                names.into_iter().map(str::to_owned).chain(self.fresh.iter().cloned()).collect()
            }
            _ => self.wanted_names(view),
        };
        self.full = false;
        self.fresh.clear();
        self.seen = view.seq();
        let mut diff = Diff::default();
        for name in candidates.into_iter().collect::<HashSet<_>>() {
            self.compare(view, name, &mut diff);
        }
        // Sorted, so a response's content does not depend on hashing.
        diff.changed.sort_by(|a, b| a.name.cmp(&b.name));
        diff.removed.sort();
        Some(diff)
    }

    fn compare(&mut self, view: &View, name: String, diff: &mut Diff) {
        if view.get(&name).is_none() {
            // Gone: a refusal of it no longer matters, and is not kept.
            self.quarantine.remove(&name);
        }
        if !self.wants(&name) {
            return;
        }
        let held = self.held.get(&name).map(|h| h.version.as_str());
        match view.get(&name) {
            Some(entry) => {
                let current = entry.get(self.kind);
                let refused = self.quarantine.get(&name) == Some(&current.version);
                if held != Some(current.version.as_str()) && !refused {
                    diff.changed.push(current.clone());
                }
            }
            None if held.is_some() => diff.removed.push(name),
            None => {}
        }
    }

    /// The digest of the set the client holds once it accepts `diff`.
    pub(crate) fn mix_after(&self, diff: &Diff) -> u128 {
        let mut mix = self.held_mix;
        for resource in &diff.changed {
            mix ^= resource.mix;
            if let Some(previous) = self.held.get(&resource.name) {
                mix ^= crate::resources::mix(&resource.name, &previous.version);
            }
        }
        for name in &diff.removed {
            if let Some(previous) = self.held.get(name) {
                mix ^= crate::resources::mix(name, &previous.version);
            }
        }
        mix
    }

    pub(crate) fn sent(&mut self, nonce: String, diff: Diff) {
        self.owes_answer = false;
        self.in_flight = Some(InFlight { nonce, diff, sent_at: Instant::now() });
    }

    /// When the response the client has not answered yet was sent.
    pub(crate) fn unanswered_since(&self) -> Option<Instant> {
        self.in_flight.as_ref().map(|f| f.sent_at)
    }

    /// The client answered the response `nonce`; `None` when that is not the latest
    /// response (a stale nonce acknowledges nothing).
    pub(crate) fn answer(&mut self, nonce: &str, error: Option<&str>) -> Option<Answer> {
        if self.in_flight.as_ref().is_none_or(|f| f.nonce != nonce) {
            return None;
        }
        let diff = self.in_flight.take()?.diff;
        let answer = match error {
            None => Answer::Ack,
            Some(message) => {
                let named = named_in(message, diff.changed.iter().map(|r| r.name.as_str()));
                let whole = named.is_empty();
                let quarantined = if whole { diff.changed.iter().map(|r| r.name.clone()).collect() } else { named };
                Answer::Nack { quarantined, whole }
            }
        };
        let refused: HashSet<&str> = match &answer {
            Answer::Ack => HashSet::new(),
            Answer::Nack { quarantined, .. } => quarantined.iter().map(String::as_str).collect(),
        };
        for resource in &diff.changed {
            if refused.contains(resource.name.as_str()) {
                // It keeps what it had; this version is not offered to it again.
                self.quarantine.insert(resource.name.clone(), resource.version.clone());
            } else {
                self.quarantine.remove(&resource.name);
                let held = Held { version: resource.version.clone(), resource: Some(resource.clone()) };
                self.insert_held(&resource.name, held);
            }
        }
        for name in &diff.removed {
            self.forget(name);
            self.quarantine.remove(name);
        }
        Some(answer)
    }
}

/// The names among `candidates` that `message` mentions as a whole word. Envoy names the
/// resources it refuses ("Error adding/updating cluster(s) web: ..."; EDS names the
/// cluster), but no format is promised, so any mention counts.
pub(crate) fn named_in<'a>(message: &str, candidates: impl Iterator<Item = &'a str>) -> Vec<String> {
    let is_name_char = |c: char| c.is_alphanumeric() || matches!(c, '-' | '_' | '.' | '/' | ':');
    let mut named: Vec<String> = candidates
        .filter(|name| {
            message.match_indices(name).any(|(at, _)| {
                let before = message[..at].chars().next_back();
                let after = message[at + name.len()..].chars().next();
                // A trailing ':' ends a name in Envoy's messages ("web: ...").
                before.is_none_or(|c| !is_name_char(c))
                    && after.is_none_or(|c| !is_name_char(c) || (c == ':' && !name.ends_with(':')))
            })
        })
        .map(str::to_owned)
        .collect();
    named.sort();
    named.dedup();
    named
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{EndpointHealth, Upstream, UpstreamEndpoint};
    use crate::state::Changes;

    fn view(ports: &[(&str, u16)]) -> View {
        let mut view = View::default();
        update(&mut view, ports);
        view
    }

    fn update(view: &mut View, ports: &[(&str, u16)]) {
        let upserts = ports
            .iter()
            .map(|(name, port)| Upstream {
                name: (*name).to_owned(),
                endpoints: vec![UpstreamEndpoint {
                    address: "10.0.0.1".to_owned(),
                    port: *port,
                    zone: None,
                    health: EndpointHealth::Healthy,
                    weight: 1,
                }],
            })
            .collect();
        view.apply(Changes { upserts, ..Default::default() });
    }

    fn subscribed(names: &[&str]) -> Tracker {
        let mut tracker = Tracker::new(Kind::Endpoints);
        tracker.requested = true;
        for name in names {
            tracker.subscribe(name);
        }
        tracker
    }

    fn changed(diff: &Diff) -> Vec<&str> {
        diff.changed.iter().map(|r| r.name.as_str()).collect()
    }

    #[test]
    fn a_stale_nonce_acknowledges_nothing_and_nothing_more_is_sent_until_the_answer() {
        let mut view = view(&[("a", 80), ("b", 80)]);
        let mut tracker = subscribed(&["a", "b"]);
        let diff = tracker.diff(&view).unwrap();
        tracker.sent("1".to_owned(), diff);
        update(&mut view, &[("a", 81)]);
        assert!(tracker.diff(&view).is_none(), "one response of a type at a time");
        assert_eq!(tracker.answer("0", None), None);
        assert_eq!(tracker.held_count(), 0);
        assert_eq!(tracker.answer("1", None), Some(Answer::Ack));
        assert_eq!(tracker.held_count(), 2);
        assert_eq!(changed(&tracker.diff(&view).unwrap()), vec!["a"], "what changed meanwhile");
    }

    #[test]
    fn a_refusal_keeps_the_held_version_and_the_set_version_follows() {
        let mut view = view(&[("a", 80), ("b", 80)]);
        let mut tracker = subscribed(&["a", "b"]);
        let diff = tracker.diff(&view).unwrap();
        tracker.sent("1".to_owned(), diff);
        tracker.answer("1", None);
        let before = tracker.held_version();
        update(&mut view, &[("a", 81), ("b", 81)]);
        let diff = tracker.diff(&view).unwrap();
        let promised = tracker.mix_after(&diff);
        tracker.sent("2".to_owned(), diff);
        let answer = tracker.answer("2", Some("cluster a: no"));
        assert_eq!(answer, Some(Answer::Nack { quarantined: vec!["a".to_owned()], whole: false }));
        assert_ne!(tracker.held("a").unwrap().version, view.get("a").unwrap().endpoints.version, "a kept the old one");
        assert_eq!(tracker.held("b").unwrap().version, view.get("b").unwrap().endpoints.version);
        assert_ne!(tracker.held_version(), before);
        assert_ne!(crate::resources::set_version(promised), tracker.held_version(), "not all of it was taken");
        tracker.full = true;
        assert!(tracker.diff(&view).unwrap().is_empty(), "the refused version is not offered again");
    }

    #[test]
    fn a_name_counts_only_as_a_whole_word() {
        let names = ["web", "web-2", "api", "db.shop"];
        let message = "Error adding/updating cluster(s) web-2: bad, db.shop: worse";
        assert_eq!(named_in(message, names.into_iter()), vec!["db.shop", "web-2"]);
        assert_eq!(named_in("cluster 'api' rejected", names.into_iter()), vec!["api"]);
        assert!(named_in("something failed", names.into_iter()).is_empty());
    }
}
