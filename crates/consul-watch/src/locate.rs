//! Naming what a catalog move wrote when the checks do not say (docs/consul.md, "Services
//! without a blocking query of their own").
//!
//! A move of `/v1/catalog/services` over raft indexes `(after, upto]` that no check write
//! accounts for would wake every member of the feed: a port or address change on agents
//! that keep an unchanged check (Consul 1.8 through its agent API does), a check-less
//! instance. Before that, the feed lists the nodes (`/v1/catalog/nodes`) and, when they are
//! few beside its members, reads each node's instances (`/v1/catalog/node-services/<node>`,
//! Consul 1.7+). Every node and instance whose `ModifyIndex` lies in the move was written by
//! it, and names what the feed wakes: the instance's service (and a proxy's destination,
//! whose Connect watch may not have heard of the proxy yet), or the members that asked
//! about the node.
//!
//! That is only trusted when every index of the move is explained, by a check write the
//! checks view saw or by a located write. A deregistration leaves no `ModifyIndex` behind,
//! an instance written again since shows its later index, and other raft writes (KV,
//! sessions, coordinates, another namespace's catalog, what the token may not see) use
//! indexes too: an index nothing explains still wakes everyone. So does any failure of the
//! locate step (an error, an answer not within [`LOCATE_WITHIN`]).
//!
//! It costs a request, and one per node: it is taken only while the nodes are at most a
//! quarter of the members and at most [`MOST_NODES`], so it never costs more than a
//! quarter of the re-reads it may save. A node list found too long is not read again for
//! [`RELIST_AFTER`], and a token refused (403: no `node:read`) is not tried again for the
//! feed's life.

use std::collections::BTreeSet;
use std::time::Duration;

use tokio::time::Instant;

use crate::changes::{ChecksView, Stale, checked_index_by_index};
use crate::client::parse::{NodeRow, NodeServices};
use crate::error::QueryError;

/// The most nodes whose instances are read to locate one move.
pub(crate) const MOST_NODES: usize = 64;

/// Members per node read, at least: the locate step costs at most a quarter of waking
/// everyone.
const MEMBERS_PER_NODE: usize = 4;

/// How long a node list found too long is trusted to still be: nodes come and go slowly,
/// and listing thousands of them for every move would cost bytes for nothing.
pub(crate) const RELIST_AFTER: Duration = Duration::from_secs(60);

/// The longest a locate step may take: past it, waking everyone is the quicker way to be
/// fresh (the catch-up's own bound, [`crate::catch_up::MAX_WAIT`]).
pub(crate) const LOCATE_WITHIN: Duration = crate::catch_up::MAX_WAIT;

/// Whether reading the instances of `nodes` nodes is worth it for a feed of `members`.
pub(crate) fn worth_it(nodes: usize, members: usize) -> bool {
    nodes <= MOST_NODES && nodes * MEMBERS_PER_NODE <= members
}

/// What a feed remembers of its locate steps, for its life.
#[derive(Debug, Default)]
pub(crate) struct Locator {
    /// The token was refused: one without `node:read` is refused every time.
    refused: bool,
    /// The node list was too long for the members: not read again before then.
    relist_at: Option<Instant>,
}

impl Locator {
    pub(crate) fn may_try(&self, now: Instant) -> bool {
        !self.refused && self.relist_at.is_none_or(|at| now >= at)
    }

    pub(crate) fn failed(&mut self, e: &QueryError) {
        if matches!(e, QueryError::Forbidden { .. }) {
            self.refused = true;
        }
    }

    pub(crate) fn too_many_nodes(&mut self, now: Instant) {
        self.relist_at = Some(now + RELIST_AFTER);
    }
}

/// The writes found in a move over `(after, upto]`.
#[derive(Debug)]
pub(crate) struct Located {
    after: u64,
    upto: u64,
    /// What the writes name.
    stale: Stale,
    /// The raft indexes they were made at.
    indexes: BTreeSet<u64>,
}

impl Located {
    pub(crate) fn new(after: u64, upto: u64) -> Located {
        Located { after, upto, stale: Stale::default(), indexes: BTreeSet::new() }
    }

    fn moved(&self, modify_index: u64) -> bool {
        (self.after + 1..=self.upto).contains(&modify_index)
    }

    /// A node of the list: written in the move, it concerns every instance on it.
    pub(crate) fn node(&mut self, node: &NodeRow) {
        if self.moved(node.modify_index) {
            self.indexes.insert(node.modify_index);
            self.stale.nodes.insert(node.node.clone());
        }
    }

    /// A node's instances: those written in the move name their service, and a proxy its
    /// destination too.
    pub(crate) fn instances(&mut self, node: &NodeServices) {
        for s in &node.services {
            if !self.moved(s.modify_index) {
                continue;
            }
            self.indexes.insert(s.modify_index);
            self.stale.services.insert(s.name.clone());
            self.stale.services.extend(s.destination.clone());
        }
    }

    /// What to wake, when every index of the move was a check write `checks` saw or a
    /// write located here; `None` (wake everyone) when any is unexplained.
    pub(crate) fn explained(self, checks: &ChecksView) -> Option<Stale> {
        let explained = |i: u64| self.indexes.contains(&i) || checks.wrote(i);
        (checked_index_by_index(self.after, self.upto) && (self.after + 1..=self.upto).all(explained))
            .then_some(self.stale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::changes::WIDEST_ACCOUNTED_MOVE;
    use crate::client::parse::NodeService;

    fn node(name: &str, modify_index: u64) -> NodeRow {
        NodeRow { node: name.into(), modify_index }
    }

    fn instances(on: &[(&str, Option<&str>, u64)]) -> NodeServices {
        let services = on
            .iter()
            .map(|&(name, destination, modify_index)| NodeService {
                name: name.into(),
                destination: destination.map(Into::into),
                modify_index,
            })
            .collect();
        NodeServices { node: None, services }
    }

    fn names(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// The checks view of an agent whose check writes were at `writes` (one check each).
    fn checks(writes: &[u64]) -> ChecksView {
        let mut view = ChecksView::default();
        let row = |i: u64| serde_json::json!({"Node": "n1", "CheckID": format!("c{i}"), "ServiceName": format!("s{i}"), "ModifyIndex": i});
        view.apply(1, &b"[]"[..]).unwrap();
        let body = serde_json::to_vec(&writes.iter().map(|&i| row(i)).collect::<Vec<_>>()).unwrap();
        view.apply(writes.iter().copied().max().unwrap_or(1), &body[..]).unwrap();
        view
    }

    #[test]
    fn every_index_explained_names_what_was_written() {
        // 11: web's port (no check rewritten); 12: a check write; 13: node n2's address.
        let mut located = Located::new(10, 13);
        located.node(&node("n1", 5));
        located.instances(&instances(&[("web", None, 11), ("api", None, 9)]));
        located.node(&node("n2", 13));
        located.instances(&instances(&[("db", None, 4)]));
        let stale = located.explained(&checks(&[12])).expect("every index explained");
        assert_eq!(stale.services, names(&["web"]), "api was written before the move");
        assert_eq!(stale.nodes, names(&["n2"]));
        assert!(!stale.everything);
    }

    #[test]
    fn an_unexplained_index_wakes_everyone() {
        // 11: web's port; 12: a deregistration (nothing left to show it), or a KV write.
        let mut located = Located::new(10, 12);
        located.node(&node("n1", 5));
        located.instances(&instances(&[("web", None, 11)]));
        assert_eq!(located.explained(&checks(&[])), None);
        // An instance written again since shows its later index only: its first write is
        // unexplained.
        let mut located = Located::new(10, 11);
        located.instances(&instances(&[("web", None, 14)]));
        assert_eq!(located.explained(&checks(&[])), None);
        // An empty move, or one too wide to check index by index.
        assert_eq!(Located::new(10, 10).explained(&checks(&[])), None);
        let mut wide = Located::new(1, 2 + WIDEST_ACCOUNTED_MOVE);
        wide.instances(&instances(&[("web", None, 2)]));
        assert_eq!(wide.explained(&checks(&[])), None);
    }

    #[test]
    fn a_proxy_names_its_destination_too() {
        let mut located = Located::new(10, 11);
        located.instances(&instances(&[("edge", Some("web"), 11)]));
        let stale = located.explained(&checks(&[])).unwrap();
        assert_eq!(stale.services, names(&["edge", "web"]), "web's Connect watch has not heard of edge yet");
    }

    #[test]
    fn the_locate_step_costs_at_most_a_quarter_of_waking_everyone() {
        assert!(!worth_it(1, 3), "one node, three members: not worth a request");
        assert!(worth_it(1, 4));
        assert!(worth_it(250 / 4, 250));
        assert!(!worth_it(250 / 4 + 1, 250));
        assert!(worth_it(MOST_NODES, 100_000));
        assert!(!worth_it(MOST_NODES + 1, 100_000), "capped whatever the members");
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_is_remembered_and_a_long_node_list_for_a_while() {
        let mut l = Locator::default();
        let t0 = Instant::now();
        assert!(l.may_try(t0));
        l.failed(&QueryError::Network { address: "a".into(), cause: "reset".into() });
        assert!(l.may_try(t0), "a network error is this move's only");
        l.too_many_nodes(t0);
        assert!(!l.may_try(t0));
        tokio::time::advance(RELIST_AFTER).await;
        assert!(l.may_try(Instant::now()), "listed again after a while");
        l.failed(&QueryError::Forbidden { address: "a".into(), body: "Permission denied".into() });
        tokio::time::advance(RELIST_AFTER * 100).await;
        assert!(!l.may_try(Instant::now()), "refused: never again for the feed's life");
    }
}
