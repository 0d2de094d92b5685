//! The driver's kube-runtime side: a Controller whose store is fed from the world instead
//! of a watch of its own (the world already watches the kind, so no controller adds a list
//! or watch), run until shut down, and each object's own backoff.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::channel::{mpsc, oneshot};
use futures::{FutureExt, StreamExt};
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::reflector::store::{Store, Writer};
use kube::runtime::watcher;
use serde_json::Value;
use tokio::task::JoinHandle;

use crate::vitals::Vitals;
use consul_resolver_core::world::World;

/// Retries of a failing object: doubling from this, capped.
const RETRY_BASE: Duration = Duration::from_millis(500);
const RETRY_CAP: Duration = Duration::from_secs(300);

pub(crate) type Ref = ObjectRef<DynamicObject>;

/// The store and the triggers of one controller.
pub(crate) struct Feed {
    writer: Writer<DynamicObject>,
    resource: ApiResource,
    /// The objects in the store, as the world holds them, by namespace and name.
    fed: BTreeMap<(String, String), (Arc<Value>, DynamicObject)>,
    /// The store is filled (at the first publication: before it, there is nothing to say).
    ready: bool,
    objects: mpsc::UnboundedSender<Arc<DynamicObject>>,
    refs: mpsc::UnboundedSender<Ref>,
}

/// What the Controller is built from: its store, the changed objects, the extra triggers.
pub(crate) struct Streams {
    resource: ApiResource,
    pub(crate) reader: Store<DynamicObject>,
    pub(crate) objects: mpsc::UnboundedReceiver<Arc<DynamicObject>>,
    pub(crate) refs: mpsc::UnboundedReceiver<Ref>,
}

impl Streams {
    /// Runs the Controller on these streams (`name` for the logs and `/healthz`), with at
    /// most `concurrency` reconciles at once, until [`Running::shutdown`].
    pub(crate) fn run<F, E, C>(
        self,
        concurrency: u16,
        reconcile: impl FnMut(Arc<DynamicObject>, Arc<C>) -> F + Send + 'static,
        error_policy: impl Fn(Arc<DynamicObject>, &E, Arc<C>) -> Action + Send + Sync + 'static,
        ctx: Arc<C>,
        name: &'static str,
        vitals: &Arc<Vitals>,
    ) -> Running
    where
        F: Future<Output = Result<Action, E>> + Send + 'static,
        E: std::error::Error + Send + 'static,
        C: Send + Sync + 'static,
    {
        let (stop, stopped) = oneshot::channel::<()>();
        let controller = Controller::for_shared_stream_with(self.objects, self.reader, self.resource)
            .with_config(ControllerConfig::default().concurrency(concurrency))
            .reconcile_on(self.refs)
            .graceful_shutdown_on(stopped.map(|_| ()))
            .run(reconcile, error_policy, ctx)
            .for_each(move |result| async move {
                // Reconcile failures were logged and counted by the error policy; a trigger
                // for an object deleted meanwhile is nothing.
                if let Err(e) = result
                    && !matches!(e, kube::runtime::controller::Error::ReconcilerFailed(..))
                {
                    tracing::debug!(error = %e, "{name}");
                }
            });
        Running { stop: Some(stop), task: tokio::spawn(vitals.watch(name, controller)) }
    }
}

/// A running Controller.
pub(crate) struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Running {
    /// Lets the reconciles in flight finish for at most `within`, starts no other, then
    /// stops. Whether some were still running then and were cut off: the caller says what
    /// that means for its objects. Either way none is running when this returns.
    pub(crate) async fn shutdown(mut self, within: Duration) -> bool {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if tokio::time::timeout(within, &mut self.task).await.is_ok() {
            return false;
        }
        self.stop_now().await;
        true
    }

    /// Stops at once. Waits until the reconciles are dropped, so none is still writing
    /// once the Lease is released.
    pub(crate) async fn stop_now(&mut self) {
        self.task.abort();
        let _ = (&mut self.task).await;
    }
}

/// Each object's consecutive failures, so each one backs off on its own.
#[derive(Default)]
pub(crate) struct Backoff {
    failures: Mutex<HashMap<Ref, u32>>,
}

impl Backoff {
    /// `at` failed again: how long until its retry.
    pub(crate) fn failed(&self, at: Ref) -> Duration {
        let failures = {
            let mut f = self.failures.lock().expect("failures lock");
            let n = f.entry(at).or_insert(0);
            *n = n.saturating_add(1);
            *n
        };
        retry_delay(failures, rand::random_range(0.0..0.2))
    }

    /// `at` succeeded, or is gone: its next failure is a first one.
    pub(crate) fn forget(&self, at: &Ref) {
        self.failures.lock().expect("failures lock").remove(at);
    }
}

/// The wait before retry `failures` (1-based) of one object: doubling from [`RETRY_BASE`],
/// capped at [`RETRY_CAP`], `shave` (0..1) taken off so objects failing together do not
/// retry in lockstep.
fn retry_delay(failures: u32, shave: f64) -> Duration {
    let step = RETRY_BASE.saturating_mul(2u32.saturating_pow(failures.saturating_sub(1).min(20)));
    step.min(RETRY_CAP).mul_f64(1.0 - shave.clamp(0.0, 0.5))
}

impl Feed {
    pub(crate) fn new(resource: ApiResource) -> (Feed, Streams) {
        let writer = Writer::new(resource.clone());
        let reader = writer.as_reader();
        let (objects, objects_rx) = mpsc::unbounded();
        let (refs, refs_rx) = mpsc::unbounded();
        let streams = Streams { resource: resource.clone(), reader, objects: objects_rx, refs: refs_rx };
        (Feed { writer, resource, fed: BTreeMap::new(), ready: false, objects, refs }, streams)
    }

    pub(crate) fn resource(&self) -> &ApiResource {
        &self.resource
    }

    /// Whether the store has been filled (the first publication came).
    pub(crate) fn filled(&self) -> bool {
        self.ready
    }

    /// Brings the store up to date with the world's objects of `group`/`kind`, triggering a
    /// reconcile of each one that changed. Returns those that are gone.
    pub(crate) fn sync(&mut self, world: &World, group: &str, kind: &str) -> Vec<DynamicObject> {
        let mut seen = BTreeSet::new();
        for (id, stored) in world.objects_of(group, kind) {
            let Some(raw) = &stored.raw else { continue };
            let id = (id.namespace.clone().unwrap_or_default(), id.name.clone());
            seen.insert(id.clone());
            if self.fed.get(&id).is_some_and(|(v, _)| Arc::ptr_eq(v, raw) || v == raw) {
                continue;
            }
            let Ok(dynamic) = serde_json::from_value::<DynamicObject>((**raw).clone()) else { continue };
            if self.ready {
                self.writer.apply_watcher_event(&watcher::Event::Apply(dynamic.clone()));
                let _ = self.objects.unbounded_send(Arc::new(dynamic.clone()));
            }
            self.fed.insert(id, (raw.clone(), dynamic));
        }
        let gone: Vec<_> = self.fed.keys().filter(|id| !seen.contains(*id)).cloned().collect();
        let mut removed = Vec::new();
        for id in gone {
            if let Some((_, dynamic)) = self.fed.remove(&id) {
                if self.ready {
                    self.writer.apply_watcher_event(&watcher::Event::Delete(dynamic.clone()));
                }
                removed.push(dynamic);
            }
        }
        removed
    }

    /// Fills the store with what the world has listed, the first time (the first
    /// publication), and reconciles every object. Whether it was the first time.
    pub(crate) fn fill(&mut self) -> bool {
        if self.ready {
            return false;
        }
        self.writer.apply_watcher_event(&watcher::Event::Init);
        for (_, dynamic) in self.fed.values() {
            self.writer.apply_watcher_event(&watcher::Event::InitApply(dynamic.clone()));
        }
        self.writer.apply_watcher_event(&watcher::Event::InitDone);
        self.ready = true;
        self.trigger_all();
        true
    }

    /// Reconciles the object `namespace/name`.
    pub(crate) fn trigger(&self, namespace: &str, name: &str) {
        let _ = self.refs.unbounded_send(ObjectRef::new_with(name, self.resource.clone()).within(namespace));
    }

    /// Reconciles every object (once the store is filled).
    pub(crate) fn trigger_all(&self) {
        if !self.ready {
            return;
        }
        for (_, dynamic) in self.fed.values() {
            let _ = self.refs.unbounded_send(ObjectRef::from_obj_with(dynamic, self.resource.clone()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_double_per_object_and_are_capped() {
        assert_eq!(retry_delay(1, 0.0), RETRY_BASE);
        assert_eq!(retry_delay(2, 0.0), RETRY_BASE * 2);
        assert_eq!(retry_delay(4, 0.0), RETRY_BASE * 8);
        assert_eq!(retry_delay(40, 0.0), RETRY_CAP);
        assert!(retry_delay(3, 0.2) < retry_delay(3, 0.0));
    }
}
