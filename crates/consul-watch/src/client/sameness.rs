//! A sameness group walked member by member, for the Consul that picks the answering
//! member before the health filter.
//!
//! Consul answers `?sameness-group=` from the first member with instances. Whether health
//! (`?passing`) counts in that choice is Consul's to decide, and agents do not say which
//! they do: one that chooses first answers nothing when its first member's instances all
//! fail, although the next member has healthy ones. So an empty answer is checked: the
//! group's members are read in order (`GET /v1/config/sameness-group/<name>`), each with
//! the watch's own query, and the first with instances the watch keeps answers. The
//! group's own answer keeps its index, which is what the watch blocks on: a change in any
//! member moves it. A Consul that chooses after the filter gives an empty answer only when
//! every member is empty, and the walk confirms it.

use serde::Deserialize;
use tracing::warn;

use super::{Answer, HttpClient, Instances, encode_segment, request_timeout, scope_params};
use crate::error::QueryError;
use consul_resolver_core::keys::{ConsulKey, Remote};

/// One member of a sameness group: a partition of this cluster or a cluster peer.
#[derive(Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "PascalCase", default)]
struct Member {
    partition: String,
    peer: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase", default)]
struct GroupEntry {
    members: Vec<Member>,
}

impl Member {
    /// The watch's key read from this member alone.
    fn key_of(&self, key: &ConsulKey) -> ConsulKey {
        let mut key = key.clone();
        let scope = key.scope_mut();
        if self.peer.is_empty() {
            (scope.partition, scope.remote) = (Some(self.partition.clone()), None);
        } else {
            scope.remote = Some(Remote::Peer(self.peer.clone()));
        }
        key
    }
}

impl HttpClient {
    /// `answer`, the group's empty one, or the first member's with instances the watch
    /// keeps, under the group's index. A member's failed read fails the whole read (it is
    /// retried, the last answer kept); a group entry the token may not read, or that is
    /// gone, leaves Consul's answer as it was, with a warning.
    pub(super) async fn walk_members(
        &self,
        key: &ConsulKey,
        group: &str,
        answer: Answer<Instances>,
    ) -> Result<Answer<Instances>, QueryError> {
        let members = match self.sameness_members(key, group).await {
            Ok(members) => members,
            Err(e) if e.refused() => {
                warn!(service = %key.service, group, error = %e, "cannot read the sameness group's members: Consul's answer stands");
                return Ok(answer);
            }
            Err(e) => return Err(e),
        };
        for member in &members {
            let found = self.read_health(&member.key_of(key), None).await?;
            if !found.value.endpoints.is_empty() {
                return Ok(Answer { value: found.value, ..answer });
            }
        }
        Ok(answer)
    }

    /// `GET /v1/config/sameness-group/<group>`: the group's members in order.
    async fn sameness_members(&self, key: &ConsulKey, group: &str) -> Result<Vec<Member>, QueryError> {
        let url = format!("{}/v1/config/sameness-group/{}", self.base, encode_segment(group));
        let mut query: Vec<(&str, String)> = Vec::new();
        scope_params(&mut query, key.scope.datacenter.as_deref(), None, key.scope.partition.as_deref());
        let got = self.get(&url, &query, key.scope.server.token.as_ref(), request_timeout(None)).await?;
        let body = self.whole(&got.body)?;
        let entry: GroupEntry =
            serde_json::from_slice(&body).map_err(|e| self.body_error(format!("sameness group {group:?}: {e}")))?;
        Ok(entry.members)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_reads_its_partition_or_its_peer_with_the_watchs_query() {
        let mut key = crate::test_support::key("web", None);
        key.scope_mut().partition = Some("ap1".into());
        key.scope_mut().remote = Some(Remote::SamenessGroup("g".into()));
        let partition = Member { partition: "ap2".into(), peer: String::new() };
        let peer = Member { partition: String::new(), peer: "east".into() };
        let by_partition = partition.key_of(&key);
        assert_eq!((by_partition.scope.partition.as_deref(), by_partition.scope.remote.clone()), (Some("ap2"), None));
        let by_peer = peer.key_of(&key);
        assert_eq!(
            (by_peer.scope.partition.as_deref(), by_peer.scope.remote.clone()),
            (Some("ap1"), Some(Remote::Peer("east".into())))
        );
        assert_eq!((by_peer.service.as_str(), &by_peer.scope.query), ("web", &key.scope.query));
    }

    #[test]
    fn the_group_entry_names_its_members_in_order() {
        let body = br#"{"Kind":"sameness-group","Name":"g","DefaultForFailover":true,
            "Members":[{"Partition":"default"},{"Peer":"east"}],"CreateIndex":7,"ModifyIndex":7}"#;
        let entry: GroupEntry = serde_json::from_slice(body).unwrap();
        let expected = [
            Member { partition: "default".into(), peer: String::new() },
            Member { partition: String::new(), peer: "east".into() },
        ];
        assert_eq!(entry.members, expected);
    }
}
