//! Publishing over HTTP: keeping the latest snapshots for the ops server's `/snapshot`
//! (latest) and `/snapshots/<id>` (the last few).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use consul_resolver_core::assembler::Snapshot;
use consul_resolver_core::assembler::gzip::Gzipped;

/// How many snapshots `/snapshots/<id>` keeps.
pub(crate) const KEPT: usize = 10;

/// The latest snapshots, as the bytes served: the latest as published (the same bytes
/// every publisher writes), older ones gzipped in segments that consecutive snapshots
/// share where they are equal, so keeping ten costs about one gzip and what changed.
#[derive(Default)]
pub(crate) struct SnapshotStore {
    kept: Mutex<Kept>,
    /// Readers held until the next snapshot (`/snapshot?wait=`).
    published: tokio::sync::Notify,
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
    /// The latest, served from its segments.
    Latest(Arc<Snapshot>),
    Json(Bytes),
    Gzip(Arc<Gzipped>),
}

/// Snapshots smaller than this stay uncompressed in the history (not worth it).
const COMPRESS_FROM: usize = 16 * 1024;

impl SnapshotStore {
    /// Keeps `snapshot` as the latest. Its gzip is started now, off the caller's thread (the
    /// event loop's), rather than when the next one pushes it into the history. (With a
    /// ConfigMap publisher, whichever asks first compresses; the other gets the same
    /// segments.)
    pub(crate) fn push(&self, snapshot: &Arc<Snapshot>) {
        if snapshot.len() >= COMPRESS_FROM {
            let snapshot = snapshot.clone();
            let gzip = move || drop(snapshot.gzipped());
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn_blocking(gzip)),
                Err(_) => gzip(),
            }
        }
        let mut kept = self.kept.lock().expect("store lock");
        if let Some(previous) = kept.latest.replace(snapshot.clone()) {
            let body = if previous.len() >= COMPRESS_FROM {
                Body::Gzip(previous.gzipped())
            } else {
                Body::Json(previous.to_json())
            };
            kept.older.push_back((previous.id, body));
            while kept.older.len() >= KEPT {
                kept.older.pop_front();
            }
        }
        drop(kept);
        self.published.notify_waiters();
    }

    /// Completes at the next [`push`](Self::push) after it is enabled (or first polled).
    pub(crate) fn published(&self) -> tokio::sync::futures::Notified<'_> {
        self.published.notified()
    }

    pub(crate) fn latest(&self) -> Option<Arc<Snapshot>> {
        self.kept.lock().expect("store lock").latest.clone()
    }

    pub(crate) fn get(&self, id: u64) -> Option<Body> {
        let kept = self.kept.lock().expect("store lock");
        match &kept.latest {
            Some(latest) if latest.id == id => Some(Body::Latest(latest.clone())),
            _ => kept.older.iter().find(|(i, _)| *i == id).map(|(_, b)| b.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::content;
    use consul_resolver_core::assembler::segment::Cutter;
    use consul_resolver_core::assembler::snapshot::{Content, Problem};

    /// Content of `n` problems (Mappings `m00000`...), problem `i` saying `message(i)`.
    fn problems(n: usize, message: impl Fn(usize) -> String) -> Content {
        let mut c = content(vec![]);
        c.problems = (0..n)
            .map(|i| Problem {
                kind: "Mapping".into(),
                namespace: "shop".into(),
                name: format!("m{i:05}"),
                message: message(i),
            })
            .collect();
        c
    }

    #[test]
    fn the_history_keeps_the_latest_as_published_and_older_ones_gzipped() {
        let store = SnapshotStore::default();
        let big = problems(400, |_| "resolver \"nope\": no ConsulResolver of that name in shop".into());
        let first = Arc::new(big.clone().into_snapshot(1));
        let second = Arc::new(big.into_snapshot(2));
        assert!(first.to_json().len() >= COMPRESS_FROM, "{}", first.to_json().len());
        store.push(&first);
        store.push(&second);
        assert!(Arc::ptr_eq(&store.latest().unwrap(), &second), "the very snapshot published");
        assert!(matches!(store.get(2), Some(Body::Latest(s)) if Arc::ptr_eq(&s, &second)));
        let Some(Body::Gzip(gz)) = store.get(1) else { panic!("the older one is compressed") };
        assert!(gz.len() * 10 < first.to_json().len());
        assert_eq!(super::super::gunzip(&gz.to_bytes()).unwrap(), first.to_json());
        for id in 3..20 {
            store.push(&Arc::new(content(vec![]).into_snapshot(id)));
        }
        assert!(store.get(2).is_none(), "only the last ten");
        assert!(matches!(store.get(18), Some(Body::Json(_))), "small ones kept as they are");
    }

    /// Large snapshots that differ in one place cost one gzip and, per snapshot, the
    /// segment that changed: the history's entries share the deflated segments they have in
    /// common.
    #[test]
    fn the_history_shares_what_consecutive_snapshots_have_in_common() {
        let store = SnapshotStore::default();
        // ~3 MB of problems, one of them saying which snapshot this is, made one after the
        // other as the pipeline makes them (by one cutter).
        let content = |id: u64| {
            problems(20_000, |i| match i {
                10_000 => format!("changed in snapshot {id}"),
                _ => format!("resolver \"nope-{i}\": no ConsulResolver of that name in shop, {}", i * 7919),
            })
        };
        let cutter = std::cell::RefCell::new(Cutter::default());
        let big = |id: u64| {
            let c = content(id);
            let cut = c.cut(&mut cutter.borrow_mut());
            Arc::new(Snapshot::new(id, c, cut))
        };
        for id in 1..=KEPT as u64 {
            store.push(&big(id));
        }
        let older: Vec<Arc<Gzipped>> = (1..KEPT as u64)
            .map(|id| match store.get(id) {
                Some(Body::Gzip(gz)) => gz,
                other => panic!("snapshot {id}: {other:?}"),
            })
            .collect();
        let mut bodies = std::collections::HashMap::new();
        for gz in &older {
            for s in gz.segments() {
                bodies.insert(s.body().as_ptr(), s.body().len());
            }
        }
        let held: usize = bodies.values().sum();
        let one = older[0].len();
        let json = content(1).into_snapshot(1).len();
        eprintln!("{} snapshots of {json} bytes of JSON: {held} bytes of gzip held, {one} for one", older.len());
        assert!(older[0].segments().len() >= 3, "{} segments", older[0].segments().len());
        let largest = older.iter().flat_map(|gz| gz.segments()).map(|s| s.body().len()).max().unwrap();
        let n = older.len();
        assert!(held <= one + n * largest, "{held} bytes held for {n} gzips of {one} (segments up to {largest})");
        // Each snapshot after the first holds two bodies of its own: its header (id, hash)
        // and the segment with the changed problem; all others are the first one's.
        assert_eq!(bodies.len(), older[0].segments().len() + 2 * (n - 1), "bodies held");
        for (gz, id) in older.iter().zip(1..) {
            assert_eq!(
                super::super::gunzip(&gz.to_bytes()).unwrap(),
                content(id).into_snapshot(id).to_json(),
                "snapshot {id}"
            );
        }
    }
}
