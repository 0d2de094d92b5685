//! Delivery of snapshots to the publishers that can fail (the hook, the ConfigMap), each
//! on its own.
//!
//! The event loop serves a new snapshot over HTTP itself (keeping it is all HTTP takes) and
//! hands it to every outlet at once ([`Outlets::offer`]), then goes on. An outlet is one
//! task per publisher with its own state: the last snapshot it delivered, its own deadline
//! per attempt, its own backoff after a failure, and its own metrics. It always delivers
//! the latest snapshot it was offered, never one it already delivered, one at a time: so a
//! failing or slow publisher delays no other, a retry never re-runs a publisher that
//! already has that snapshot, and what each one delivered last is the final state.
//!
//! The ConfigMap outlet writes only while this replica leads, and only snapshots numbered
//! above what the previous leader wrote (the event loop arms it on takeover, once it knows
//! that number): a publication in flight at the takeover cannot write an older id after
//! the new leader's. It also repairs the ConfigMap every resync period. It says how far it
//! has got ([`Outlets::configmap_holds`]): the resolver statuses follow the ConfigMap, so a
//! status never names a snapshot its readers cannot find there yet, and its writes do not
//! compete with the ConfigMap's for the API server.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant as StdInstant};

use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::publisher_events::PublisherEvents;
use crate::leadership::Leadership;
use crate::publishers::configmap::{self, ConfigMapPublisher};
use crate::publishers::metrics::PublisherMetrics;
use crate::publishers::{PublishError, Publisher};
use crate::vitals::Vitals;
use consul_resolver_core::assembler::Snapshot;

/// The first retry after a failure; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// What an outlet delivers: the latest snapshot offered.
type Latest = watch::Receiver<Option<Arc<Snapshot>>>;

/// How far the ConfigMap outlet has got.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Written {
    /// The last snapshot it wrote (0: none yet).
    id: u64,
    /// Its last attempt failed: it retries on its own, holding nothing else back.
    failing: bool,
}

/// The publishers fed on their own, and what the event loop tells them.
pub(super) struct Outlets {
    latest: watch::Sender<Option<Arc<Snapshot>>>,
    configmap: Option<Arc<ConfigMapPublisher>>,
    /// The ConfigMap outlet's permission to write: `Some(floor)` while this replica leads
    /// and has read the id the previous leader wrote (`floor`); `None` otherwise.
    armed: Arc<Mutex<Option<u64>>>,
    /// Wakes the ConfigMap outlet when it is armed.
    armed_changed: Arc<Notify>,
    /// What the ConfigMap outlet wrote last.
    written: watch::Receiver<Written>,
    stop: CancellationToken,
    tasks: Vec<Running>,
}

/// One outlet's task, and what it is delivering (for the log line when shutdown cuts it
/// off).
struct Running {
    name: &'static str,
    delivering: Delivering,
    task: JoinHandle<()>,
}

/// The id of the snapshot an outlet is delivering, if any (none while the ConfigMap outlet
/// repairs).
type Delivering = Arc<Mutex<Option<u64>>>;

/// How one outlet works.
pub(super) struct OutletConfig {
    /// Each attempt's deadline.
    pub(super) timeout: Duration,
    /// How often the ConfigMap is compared with what was written, and repaired.
    pub(super) resync_period: Duration,
    pub(super) metrics: PublisherMetrics,
    /// A task that ends before shutdown fails `/healthz`.
    pub(super) vitals: Arc<Vitals>,
    /// Events when a publisher starts failing and when it recovers.
    pub(super) events: Option<Arc<PublisherEvents>>,
}

impl Outlets {
    /// Starts an outlet per publisher: `local` ones deliver on every replica, the ConfigMap
    /// only once armed by a takeover ([`Outlets::took_over`], also at start when leading).
    pub(super) fn start(
        local: Vec<Arc<dyn Publisher>>,
        configmap: Option<Arc<ConfigMapPublisher>>,
        leadership: &Leadership,
        config: OutletConfig,
    ) -> Outlets {
        let (latest, _) = watch::channel(None);
        let armed = Arc::new(Mutex::new(None));
        let armed_changed = Arc::new(Notify::new());
        let stop = CancellationToken::new();
        let config = Arc::new(config);
        let (wrote, written) = watch::channel(Written::default());
        let spawn = |publisher: Arc<dyn Publisher>, gate: Gate, config: Arc<OutletConfig>| {
            let (name, delivering) = (publisher.name(), Delivering::default());
            let vitals = config.vitals.clone();
            let outlet = Outlet { publisher, latest: latest.subscribe(), gate, config, delivering: delivering.clone() };
            Running { name, delivering, task: tokio::spawn(vitals.watch(name, outlet.run(stop.clone()))) }
        };
        let mut tasks: Vec<Running> = local.into_iter().map(|p| spawn(p, Gate::Always, config.clone())).collect();
        if let Some(c) = &configmap {
            let gate = Gate::Leading {
                leadership: leadership.clone(),
                armed: armed.clone(),
                armed_changed: armed_changed.clone(),
                repair: c.clone(),
                wrote,
            };
            tasks.push(spawn(c.clone(), gate, config));
        }
        Outlets { latest, configmap, armed, armed_changed, written, stop, tasks }
    }

    /// A new snapshot for every outlet; returns at once.
    pub(super) fn offer(&self, snapshot: Arc<Snapshot>) {
        self.latest.send_replace(Some(snapshot));
    }

    /// Whether a ConfigMap is written.
    pub(super) fn has_configmap(&self) -> bool {
        self.configmap.is_some()
    }

    /// Resolves once the ConfigMap holds snapshot `id` or a later one, or once its outlet
    /// is failing (it retries alone, and holds nothing back meanwhile); at once when no
    /// ConfigMap is written. Holds no borrow of the outlets.
    pub(super) fn configmap_holds(&self, id: u64) -> impl Future<Output = ()> + Send + 'static {
        let mut written = self.written.clone();
        let none = self.configmap.is_none();
        async move {
            if !none {
                // An error: the outlet is gone (shutdown), there is nothing to wait for.
                let _ = written.wait_for(|w| w.id >= id || w.failing).await;
            }
        }
    }

    /// This replica just became leader. Another one may have written since we last did
    /// (or we never did): forget what we wrote, so everything is written again, and
    /// return the id of the snapshot in the ConfigMap now, so ours continue after it. The
    /// ConfigMap outlet writes nothing numbered at or below it.
    pub(super) async fn took_over(&self) -> u64 {
        let Some(c) = &self.configmap else { return 0 };
        c.forget();
        let floor = match c.published_id().await {
            Ok(id) => id.unwrap_or(0),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the last snapshot id; continuing from ours");
                0
            }
        };
        *self.armed.lock().expect("armed lock") = Some(floor);
        self.armed_changed.notify_one();
        floor
    }

    /// This replica no longer leads: the ConfigMap outlet stops writing until the next
    /// takeover has read the floor again.
    pub(super) fn lost_leadership(&self) {
        *self.armed.lock().expect("armed lock") = None;
    }

    /// Lets each outlet finish the delivery it has in flight until `deadline` (the
    /// shutdown's budget for it), starts no other, and cuts off, with a log line, what is
    /// still running then. A cut-off delivery is no loss worth the pod being killed before
    /// the Lease is released: the next leader writes the current snapshot again at its
    /// takeover, and the next process runs the hook on its first snapshot.
    pub(super) async fn shutdown(self, deadline: Instant) {
        self.stop.cancel();
        for mut running in self.tasks {
            if tokio::time::timeout_at(deadline, &mut running.task).await.is_ok() {
                continue;
            }
            let id = *running.delivering.lock().expect("delivering lock");
            tracing::warn!(
                publisher = running.name,
                id,
                "shutdown: delivery cut off at the end of its share of --shutdown-timeout (the next leader writes \
                 the current snapshot again; the next process runs the hook on its first snapshot)"
            );
            running.task.abort();
            // Waits until the task is dropped: its request is abandoned (the hook killed)
            // before the Lease is released.
            let _ = running.task.await;
        }
    }
}

/// When an outlet may deliver.
enum Gate {
    /// Always (HTTP-side publishers every replica runs: the hook).
    Always,
    /// While leading and armed, only snapshots above the floor; repairs what it wrote.
    Leading {
        leadership: Leadership,
        armed: Arc<Mutex<Option<u64>>>,
        armed_changed: Arc<Notify>,
        repair: Arc<ConfigMapPublisher>,
        /// Told each attempt's outcome.
        wrote: watch::Sender<Written>,
    },
}

impl Gate {
    /// Whether `snapshot` may be delivered now.
    fn admits(&self, snapshot: &Snapshot) -> bool {
        match self {
            Gate::Always => true,
            Gate::Leading { leadership, armed, .. } => {
                leadership.is_leading() && armed.lock().expect("armed lock").is_some_and(|floor| snapshot.id > floor)
            }
        }
    }

    /// Resolves when the gate may have opened.
    async fn opened(&self) {
        match self {
            Gate::Always => std::future::pending().await,
            Gate::Leading { armed_changed, .. } => armed_changed.notified().await,
        }
    }
}

struct Outlet {
    publisher: Arc<dyn Publisher>,
    latest: Latest,
    gate: Gate,
    config: Arc<OutletConfig>,
    delivering: Delivering,
}

impl Outlet {
    async fn run(mut self, stop: CancellationToken) {
        let name = self.publisher.name();
        let mut delivered: Option<u64> = None;
        let mut failures: u32 = 0;
        let mut retry_at: Option<Instant> = None;
        let mut repair_at = Instant::now() + self.config.resync_period;
        self.config.metrics.publisher_failing.with_label_values(&[name]).set(0);
        // Stopping lets a delivery in flight finish (the loop is not cancelled inside one),
        // and starts no other.
        while !stop.is_cancelled() {
            let latest = self.latest.borrow_and_update().clone();
            let due = latest.filter(|s| Some(s.id) != delivered && self.gate.admits(s));
            let waiting = retry_at.is_some_and(|at| Instant::now() < at);
            if let Some(snapshot) = due.filter(|_| !waiting) {
                *self.delivering.lock().expect("delivering lock") = Some(snapshot.id);
                let delivered_now = self.deliver(&snapshot).await;
                *self.delivering.lock().expect("delivering lock") = None;
                match delivered_now {
                    Ok(()) => {
                        if failures > 0
                            && let Some(events) = &self.config.events
                        {
                            events.recovered(name, snapshot.id);
                        }
                        delivered = Some(snapshot.id);
                        failures = 0;
                        retry_at = None;
                    }
                    Err(e) => {
                        // Once per streak: retries of a publisher that keeps failing are
                        // in its metric and log, not a stream of Events.
                        if failures == 0
                            && let Some(events) = &self.config.events
                        {
                            events.failing(name, e.to_string());
                        }
                        failures = failures.saturating_add(1);
                        let delay =
                            FIRST_BACKOFF.saturating_mul(1 << failures.min(16).saturating_sub(1)).min(MAX_BACKOFF);
                        tracing::warn!(
                            publisher = name,
                            id = snapshot.id,
                            error = %e,
                            retry_in = %humantime::format_duration(delay),
                            "publication failed; this publisher alone retries, with the latest snapshot by then"
                        );
                        retry_at = Some(Instant::now() + delay);
                    }
                }
                continue;
            }
            let repairs = matches!(self.gate, Gate::Leading { .. });
            tokio::select! {
                _ = stop.cancelled() => break,
                changed = self.latest.changed() => if changed.is_err() { break },
                () = self.gate.opened() => {}
                () = tokio::time::sleep_until(retry_at.unwrap_or_else(Instant::now)), if waiting => {}
                () = tokio::time::sleep_until(repair_at), if repairs => {
                    repair_at = Instant::now() + self.config.resync_period;
                    self.repair().await;
                }
            }
        }
    }

    /// One attempt, within the deadline, measured and counted.
    async fn deliver(&self, snapshot: &Arc<Snapshot>) -> Result<(), PublishError> {
        let name = self.publisher.name();
        let metrics = &self.config.metrics;
        let started = StdInstant::now();
        let timeout = self.config.timeout;
        let result = match tokio::time::timeout(timeout, self.publisher.publish(snapshot.clone())).await {
            Ok(r) => r,
            Err(_) => Err(PublishError::Timeout(timeout)),
        };
        metrics.publisher_seconds.with_label_values(&[name]).observe(started.elapsed().as_secs_f64());
        if let Gate::Leading { wrote, .. } = &self.gate {
            let failing = result.is_err();
            wrote.send_modify(|w| *w = Written { id: if failing { w.id } else { snapshot.id }, failing });
        }
        match &result {
            Ok(()) => {
                metrics.publisher_failing.with_label_values(&[name]).set(0);
                metrics.publisher_snapshot_id.with_label_values(&[name]).set(snapshot.id as i64);
                if let Gate::Leading { repair: c, .. } = &self.gate
                    && let Some(parts) = c.parts_written()
                {
                    metrics.configmap_parts.set(parts as i64);
                }
            }
            Err(e) => {
                metrics.publisher_failing.with_label_values(&[name]).set(1);
                metrics.publish_failures.with_label_values(&[name, e.reason()]).inc();
            }
        }
        result
    }

    /// Compares the ConfigMap with what was last written, and writes again what was
    /// deleted or edited.
    async fn repair(&self) {
        let Gate::Leading { repair: c, leadership, .. } = &self.gate else { return };
        if !leadership.is_leading() {
            return;
        }
        let metrics = &self.config.metrics;
        match c.repair().await {
            Ok(names) if names.is_empty() => {}
            Ok(names) => {
                tracing::warn!(configmaps = ?names, "the snapshot ConfigMap was deleted or edited; written again");
                metrics.repairs.with_label_values(&["configmap"]).inc();
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot check the snapshot ConfigMap; trying again at the next resync");
                metrics.publish_failures.with_label_values(&[configmap::NAME, e.reason()]).inc();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use futures::FutureExt;
    use futures::future::BoxFuture;

    use super::*;
    use crate::test_fixtures::{content, resolver_entry};

    /// A publisher whose every delivery takes `takes`, counting those it finished.
    struct Slow {
        name: &'static str,
        takes: Duration,
        finished: Arc<AtomicU32>,
    }

    impl Publisher for Slow {
        fn name(&self) -> &'static str {
            self.name
        }

        fn publish(&self, _: Arc<Snapshot>) -> BoxFuture<'static, Result<(), PublishError>> {
            let (takes, finished) = (self.takes, self.finished.clone());
            async move {
                tokio::time::sleep(takes).await;
                finished.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
            .boxed()
        }
    }

    fn config() -> OutletConfig {
        OutletConfig {
            timeout: Duration::from_secs(10),
            resync_period: Duration::from_secs(300),
            metrics: PublisherMetrics::unregistered(),
            vitals: Vitals::new(CancellationToken::new()),
            events: None,
        }
    }

    /// What the resolver statuses wait for: the ConfigMap holding their snapshot, or its
    /// outlet failing; never a snapshot it has not written yet.
    #[tokio::test]
    async fn configmap_holds_resolves_once_written_or_failing() {
        use crate::publishers::configmap::tests::{Stored, stored_api, target};
        let stored = Arc::new(Mutex::new(Stored::default()));
        let api = stored_api(stored.clone()).await;
        let publisher = Arc::new(ConfigMapPublisher::new(api.client.clone(), target(), Leadership::always()));
        let outlets = Outlets::start(vec![], Some(publisher), &Leadership::always(), config());
        let floor = outlets.took_over().await;
        let within = Duration::from_secs(10);
        let (first, second) = (floor + 1, floor + 2);
        let mut held = Box::pin(outlets.configmap_holds(first));
        tokio::task::yield_now().await;
        assert!((&mut held).now_or_never().is_none(), "nothing written yet");
        outlets.offer(Arc::new(content(vec![]).into_snapshot(first)));
        tokio::time::timeout(within, held).await.expect("held until written");
        assert!(outlets.configmap_holds(first).now_or_never().is_some(), "written: at once");
        assert!(outlets.configmap_holds(second).now_or_never().is_none(), "not a later one");

        stored.lock().unwrap().refuse_writes = true;
        let held = outlets.configmap_holds(second);
        // Other content: the same would need no write.
        outlets.offer(Arc::new(content(vec![resolver_entry("shop", "a")]).into_snapshot(second)));
        tokio::time::timeout(within, held).await.expect("a failing ConfigMap holds nothing back");
        outlets.shutdown(Instant::now()).await;
    }

    #[test]
    fn without_a_configmap_nothing_is_held() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let outlets = rt.block_on(async { Outlets::start(vec![], None, &Leadership::always(), config()) });
        assert!(outlets.configmap_holds(7).now_or_never().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_lets_deliveries_finish_until_its_deadline_and_cuts_off_the_rest() {
        let quick = Arc::new(AtomicU32::new(0));
        let hung = Arc::new(AtomicU32::new(0));
        let publishers: Vec<Arc<dyn Publisher>> = vec![
            Arc::new(Slow { name: "quick", takes: Duration::from_secs(2), finished: quick.clone() }),
            Arc::new(Slow { name: "hook", takes: Duration::from_secs(3600), finished: hung.clone() }),
        ];
        let config = OutletConfig { timeout: Duration::from_secs(7200), ..config() };
        let outlets = Outlets::start(publishers, None, &Leadership::always(), config);
        outlets.offer(Arc::new(content(vec![]).into_snapshot(1)));
        while outlets.tasks.iter().any(|r| r.delivering.lock().unwrap().is_none()) {
            tokio::task::yield_now().await;
        }
        let started = Instant::now();
        outlets.shutdown(started + Duration::from_secs(5)).await;
        assert_eq!(started.elapsed(), Duration::from_secs(5), "cut off at the deadline, not after the hour");
        assert_eq!(quick.load(Ordering::SeqCst), 1, "the delivery that fits finished");
        assert_eq!(hung.load(Ordering::SeqCst), 0);
    }
}
