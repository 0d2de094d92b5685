//! Publishing over HTTP: keeping the latest snapshots for the ops server's `/snapshot`
//! (latest) and `/snapshots/<id>` (the last few).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use consul_resolver_core::assembler::Snapshot;
use consul_resolver_core::assembler::gzip::{Compressor, Gzipped};

/// How many snapshots `/snapshots/<id>` keeps.
pub(crate) const KEPT: usize = 10;

/// The latest snapshots, as the bytes served: the latest as published (the same bytes
/// every publisher writes), older ones gzipped in segments that consecutive snapshots
/// share where they are equal, so keeping ten costs about one gzip and what changed.
pub(crate) struct SnapshotStore {
    kept: Mutex<Kept>,
    compressor: Arc<Compressor>,
}

#[derive(Default)]
struct Kept {
    /// The latest snapshot, served as its own bytes.
    latest: Option<Arc<Snapshot>>,
    /// The ones before it, oldest first, gzipped when large: its gzip is usually made
    /// already, by the ConfigMap publisher.
    older: VecDeque<(u64, Body)>,
}

/// A kept snapshot's bytes.
#[derive(Debug, Clone)]
pub(crate) enum Body {
    Json(Bytes),
    Gzip(Arc<Gzipped>),
}

/// Snapshots smaller than this stay uncompressed in the history (not worth it).
const COMPRESS_FROM: usize = 16 * 1024;

impl Default for SnapshotStore {
    /// A store with a compressor of its own (tests).
    fn default() -> Self {
        SnapshotStore::new(Arc::default())
    }
}

impl SnapshotStore {
    /// A store gzipping with `compressor`, the one the ConfigMap publisher uses.
    pub(crate) fn new(compressor: Arc<Compressor>) -> Self {
        SnapshotStore { kept: Mutex::default(), compressor }
    }

    pub(crate) fn push(&self, snapshot: &Arc<Snapshot>) {
        let mut kept = self.kept.lock().expect("store lock");
        if let Some(previous) = kept.latest.replace(snapshot.clone()) {
            let json = previous.to_json();
            let body = if json.len() >= COMPRESS_FROM {
                Body::Gzip(previous.gzipped(&self.compressor))
            } else {
                Body::Json(json)
            };
            kept.older.push_back((previous.id, body));
            while kept.older.len() >= KEPT {
                kept.older.pop_front();
            }
        }
    }

    pub(crate) fn latest(&self) -> Option<Bytes> {
        self.kept.lock().expect("store lock").latest.as_ref().map(|s| s.to_json())
    }

    pub(crate) fn get(&self, id: u64) -> Option<Body> {
        let kept = self.kept.lock().expect("store lock");
        match &kept.latest {
            Some(latest) if latest.id == id => Some(Body::Json(latest.to_json())),
            _ => kept.older.iter().find(|(i, _)| *i == id).map(|(_, b)| b.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::content;

    #[test]
    fn the_history_keeps_the_latest_as_published_and_older_ones_gzipped() {
        let store = SnapshotStore::new(Arc::default());
        let mut big = content(vec![]);
        big.problems = (0..400)
            .map(|i| consul_resolver_core::assembler::snapshot::Problem {
                kind: "Mapping".into(),
                namespace: "shop".into(),
                name: format!("m{i}"),
                message: "resolver \"nope\": no ConsulResolver of that name in shop".into(),
            })
            .collect();
        let first = Arc::new(big.clone().into_snapshot(1));
        let second = Arc::new(big.into_snapshot(2));
        assert!(first.to_json().len() >= COMPRESS_FROM, "{}", first.to_json().len());
        store.push(&first);
        store.push(&second);
        assert_eq!(store.latest(), Some(second.to_json()), "the very bytes published");
        let Some(Body::Gzip(gz)) = store.get(1) else { panic!("the older one is compressed") };
        assert!(gz.len() * 10 < first.to_json().len());
        assert_eq!(super::super::gunzip(&gz.to_bytes()).unwrap(), first.to_json());
        for id in 3..20 {
            store.push(&Arc::new(content(vec![]).into_snapshot(id)));
        }
        assert!(store.get(2).is_none(), "only the last ten");
        assert!(matches!(store.get(19), Some(Body::Json(_))));
    }
}
