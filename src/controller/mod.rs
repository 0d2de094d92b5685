//! The two controllers fed from the published snapshot: ConsulResolver statuses and Events
//! (`resolver`), and ConsulService exports (`export`), on one driver.
//!
//! The snapshot and the watch set come from one reading of the whole world (the pipeline);
//! what a controller adds is per-object delivery: each object is reconciled on its own, so
//! one object's failing write (a conflict, a webhook, a missing grant) retries with its own
//! backoff and never fails the ConfigMap or another object. Writes happen only while this
//! replica leads, each bounded by the leadership deadline.
//!
//! No second list or watch: a controller's store is fed from the world, which already
//! watches both kinds (`feed`; the runtime calls [`Driver::sync`] after each batch of
//! events). An object is reconciled when it changes, after each publication when its part
//! of the snapshot changed ([`Driver::published`]), on gaining leadership
//! ([`Driver::leading`]), and every `--resync-period`.

pub(crate) mod conditions;
pub(crate) mod export;
pub(crate) mod feed;
pub(crate) mod resolver;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{ApiResource, DynamicObject};
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::kube_client::error_reason;
use crate::leadership::Leadership;
use crate::vitals::Vitals;
use consul_resolver_core::assembler::Snapshot;
use consul_resolver_core::assembler::snapshot::Part;
use consul_resolver_core::world::World;
use feed::{Backoff, Feed, Ref, Running};

/// Why a reconcile failed; the object is retried alone, with its own backoff.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReconcileError {
    #[error("leadership lapsed while writing {0}")]
    LeadershipLapsed(String),
    #[error("writing {0}: {1}")]
    Write(String, #[source] kube::Error),
}

impl ReconcileError {
    /// A bounded label for the metrics and the logs.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            ReconcileError::LeadershipLapsed(_) => "leadership_lapsed",
            ReconcileError::Write(_, e) => error_reason(e),
        }
    }
}

/// A request about `what`, within the leadership deadline `until`.
pub(crate) async fn within<T>(
    until: Instant,
    what: &str,
    f: impl Future<Output = kube::Result<T>>,
) -> Result<T, ReconcileError> {
    match tokio::time::timeout_at(until, f).await {
        Err(_) => Err(ReconcileError::LeadershipLapsed(what.to_owned())),
        Ok(r) => r.map_err(|e| ReconcileError::Write(what.to_owned(), e)),
    }
}

/// One kind's part of the latest snapshot, by namespace and name: all its reconciles read,
/// kept without the rest of the snapshot (at scale, Mappings are most of it). The entries
/// are shared with the snapshot, not copied.
struct Published<E> {
    snapshot_id: u64,
    entries: BTreeMap<(String, String), Part<E>>,
}

impl<E> Published<E> {
    fn get(&self, namespace: &str, name: &str) -> Option<&E> {
        self.entries.get(&(namespace.to_owned(), name.to_owned())).map(|e| &**e)
    }
}

impl<E: PartialEq> Published<E> {
    fn of<R: Reconciler<Entry = E>>(snapshot: &Snapshot) -> Published<E> {
        let entries = R::entries(snapshot)
            .iter()
            .map(|e| {
                let (namespace, name) = R::object_of(e);
                ((namespace.to_owned(), name.to_owned()), e.clone())
            })
            .collect();
        Published { snapshot_id: snapshot.id, entries }
    }

    /// The objects whose entry is not the same in `before` (new ones included).
    fn changed_since<'a>(&'a self, before: Option<&'a Published<E>>) -> impl Iterator<Item = &'a (String, String)> {
        self.entries.iter().filter(move |(at, e)| before.and_then(|b| b.entries.get(*at)) != Some(*e)).map(|(at, _)| at)
    }
}

/// What the driver hands one reconcile.
pub(crate) struct Job<E> {
    /// The object, as the store knows it.
    pub(crate) at: Ref,
    /// The leadership deadline: every write stops there.
    pub(crate) until: Instant,
    /// `None` before the first publication.
    published: Option<Arc<Published<E>>>,
}

impl<E> Job<E> {
    /// The object's entry in the latest snapshot, and that snapshot's id. `None`: not in
    /// one yet, or not this operator's (another Ambassador ID).
    pub(crate) fn entry(&self, namespace: &str, name: &str) -> Option<(u64, &E)> {
        let published = self.published.as_deref()?;
        Some((published.snapshot_id, published.get(namespace, name)?))
    }
}

/// When an object is reconciled next, besides when it or its entry changes.
pub(crate) enum Next {
    /// At the resync period: it is kept up to date, and checked against edits by hand.
    Resync,
    /// Only on a change: there is nothing to keep up.
    OnChange,
}

/// What each controller brings to the driver: its kind, its entries in the snapshot, and
/// its reconcile with what it alone keeps.
pub(crate) trait Reconciler: Send + Sync + Sized + 'static {
    /// The custom resource reconciled.
    type Object: Resource<DynamicType = ()>;
    /// An object's entry in the snapshot.
    type Entry: PartialEq + Send + Sync + 'static;
    /// In the logs, and `/healthz` when the Controller stops.
    const NAME: &'static str;
    /// What a failed reconcile is logged as (`"resolver"`: "resolver reconcile failed").
    const NOUN: &'static str;
    /// Reconciles running at once.
    const CONCURRENCY: u16;
    /// What the shutdown cutting off reconciles in flight means, for the log.
    const CUT_OFF: &'static str;

    /// The kind's entries in `snapshot`.
    fn entries(snapshot: &Snapshot) -> &[Part<Self::Entry>];

    /// The namespace and name of the object `entry` is about.
    fn object_of(entry: &Self::Entry) -> (&str, &str);

    /// Brings `obj` in line with its entry, while leading.
    fn reconcile(
        &self,
        obj: &DynamicObject,
        job: Job<Self::Entry>,
    ) -> impl Future<Output = Result<Next, ReconcileError>> + Send;

    /// Counts one reconcile: its result (`Err`: the failure's reason) and how long it took.
    fn count(&self, result: Result<(), &'static str>, took: Duration);

    /// `gone` left the world: forget what was kept for it.
    fn gone(self: &Arc<Self>, gone: &DynamicObject, at: &Ref, leadership: &Leadership);

    /// This replica just became leader: whatever it believed written may have been
    /// overwritten since.
    fn leading(&self) {}

    /// The Controller has stopped: what runs beside it stops too.
    fn stopped(&self) {}
}

/// What every reconcile of one controller shares.
struct Shared<R: Reconciler> {
    own: Arc<R>,
    resource: ApiResource,
    leadership: Leadership,
    latest: watch::Receiver<Option<Arc<Published<R::Entry>>>>,
    resync: Duration,
    backoff: Backoff,
}

async fn reconcile<R: Reconciler>(obj: Arc<DynamicObject>, ctx: Arc<Shared<R>>) -> Result<Action, ReconcileError> {
    let started = std::time::Instant::now();
    let at = ObjectRef::from_obj_with(&*obj, ctx.resource.clone());
    // Followers write nothing; gaining leadership triggers every object again.
    let result = match ctx.leadership.until() {
        None => Ok(Next::OnChange),
        Some(until) => {
            let published = ctx.latest.borrow().clone();
            ctx.own.reconcile(&obj, Job { at: at.clone(), until, published }).await
        }
    };
    ctx.own.count(result.as_ref().map(|_| ()).map_err(ReconcileError::reason), started.elapsed());
    if result.is_ok() {
        ctx.backoff.forget(&at);
    }
    result.map(|next| match next {
        Next::Resync => Action::requeue(ctx.resync),
        Next::OnChange => Action::await_change(),
    })
}

fn error_policy<R: Reconciler>(obj: Arc<DynamicObject>, error: &ReconcileError, ctx: Arc<Shared<R>>) -> Action {
    let delay = ctx.backoff.failed(ObjectRef::from_obj_with(&*obj, ctx.resource.clone()));
    tracing::warn!(object = %format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any()),
        error = %error, reason = error.reason(), retry_in = ?delay, "{} reconcile failed", R::NOUN);
    Action::requeue(delay)
}

/// A running controller, and the store it reads, fed from the world.
pub(crate) struct Driver<R: Reconciler> {
    feed: Feed,
    latest: watch::Sender<Option<Arc<Published<R::Entry>>>>,
    ctx: Arc<Shared<R>>,
    running: Running,
}

impl<R: Reconciler> Driver<R> {
    /// Starts the controller; each object is reconciled every `resync` at the latest.
    fn start(own: R, leadership: Leadership, resync: Duration, vitals: &Arc<Vitals>) -> Driver<R> {
        let resource = ApiResource::erase::<R::Object>(&());
        let (feed, streams) = Feed::new(resource.clone());
        let (latest, latest_rx) = watch::channel(None);
        let ctx = Arc::new(Shared {
            own: Arc::new(own),
            resource,
            leadership,
            latest: latest_rx,
            resync,
            backoff: Backoff::default(),
        });
        let running = streams.run(R::CONCURRENCY, reconcile, error_policy, ctx.clone(), R::NAME, vitals);
        Driver { feed, latest, ctx, running }
    }

    /// Brings the store up to date with the world's objects of the kind, triggering a
    /// reconcile of each one that changed (a spec edit, a status wiped by hand).
    pub(crate) fn sync(&mut self, world: &World) {
        let (group, kind) = (R::Object::group(&()), R::Object::kind(&()));
        for gone in self.feed.sync(world, &group, &kind) {
            let at = ObjectRef::from_obj_with(&gone, self.feed.resource().clone());
            self.ctx.backoff.forget(&at);
            self.ctx.own.gone(&gone, &at, &self.ctx.leadership);
        }
    }

    /// `snapshot` was published: reconcile the objects whose part of it changed.
    pub(crate) fn published(&mut self, snapshot: &Snapshot) {
        let published = Arc::new(Published::of::<R>(snapshot));
        let previous = self.latest.send_replace(Some(published.clone()));
        if self.feed.fill() {
            return; // The first snapshot: every object is reconciled.
        }
        for (namespace, name) in published.changed_since(previous.as_deref()) {
            self.feed.trigger(namespace, name);
        }
    }

    /// This replica just became leader: every object is reconciled again.
    pub(crate) fn leading(&mut self) {
        self.ctx.own.leading();
        self.feed.trigger_all();
    }

    /// Lets the reconciles in flight finish (each is bounded by the leadership deadline)
    /// for at most `within` (the shutdown's budget for them), starts no other, then stops.
    /// Writes still in flight then are cut off, with a log line: the next leader reconciles
    /// every object at its takeover, so nothing is lost but time, and the Lease release
    /// that follows is what lets it take over at once.
    ///
    /// Before the first publication the store was never filled, and kube's runner starts,
    /// and ends, nothing until its store is ready: nothing is in flight, and a graceful
    /// stop would wait out the whole budget. Such a controller is stopped at once.
    pub(crate) async fn shutdown(mut self, within: Duration) {
        if !self.feed.filled() {
            self.running.stop_now().await;
        } else if self.running.shutdown(within).await {
            tracing::warn!("shutdown: {}", R::CUT_OFF);
        }
        self.ctx.own.stopped();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::{content, resolver_entry};
    use resolver::Resolvers;

    /// The resolvers' part of snapshot `id`, holding shop/a and shop/b (at `generation`).
    fn published(id: u64, generation: i64) -> Published<consul_resolver_core::assembler::snapshot::ResolverEntry> {
        let mut b = resolver_entry("shop", "b");
        b.generation = Some(generation);
        Published::of::<Resolvers>(&content(vec![resolver_entry("shop", "a"), b]).into_snapshot(id))
    }

    #[test]
    fn an_object_is_reconciled_after_a_publication_only_when_its_entry_changed() {
        let at = |name: &str| ("shop".to_owned(), name.to_owned());
        let first = published(1, 1);
        assert_eq!(first.changed_since(None).collect::<Vec<_>>(), [&at("a"), &at("b")], "all, the first time");
        let same = published(2, 1);
        assert_eq!(same.changed_since(Some(&first)).count(), 0, "a new snapshot alone changes no entry");
        let next = published(3, 2);
        assert_eq!(next.changed_since(Some(&same)).collect::<Vec<_>>(), [&at("b")]);

        let resource = ApiResource::erase::<consul_resolver_api::resolver::ConsulResolver>(&());
        let job =
            Job { at: ObjectRef::new_with("b", resource), until: Instant::now(), published: Some(Arc::new(next)) };
        assert_eq!(job.entry("shop", "b").map(|(id, e)| (id, e.generation)), Some((3, Some(2))));
        assert!(job.entry("shop", "c").is_none(), "not in the snapshot: nothing to say");
    }
}
