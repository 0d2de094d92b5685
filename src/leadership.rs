//! Who may write to the cluster, and until when: the Lease edge of leader election
//! ([`consul_resolver_core::election`] decides) and the [`Leadership`] handle every cluster writer
//! holds; [`LeadershipMetrics`], what the event loop reports of it.
//!
//! Leadership is a deadline, not a flag: a replica leads *until* its renew deadline after
//! its last successful renewal. Writers ask for the deadline before each write and bound
//! the write by it (`tokio::time::timeout_at`), so when renewals stop (the API server
//! frozen, the network cut) writing stops at the deadline by a timer, whether or not a
//! request is hung, and well before another replica may take over (after the full lease
//! duration, measured on its own clock from when it saw our last renewal).
//!
//! Lease writes are conditional on the resourceVersion just read, so two replicas racing
//! for a free lease cannot both win: the loser gets a 409 and sees the winner next time.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{PostParams, ResourceExt};
use prometheus::core::Collector;
use prometheus::{IntCounterVec, IntGauge, Registry};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::cli::LeaseRef;
use crate::measure::{counter_vec, int_gauge, register_all};
use crate::vitals::Vitals;
use consul_resolver_core::election::{Action, Election, LeaseRecord};

/// Whether, and until when, this replica may write to the cluster. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Leadership {
    until: watch::Receiver<Option<Instant>>,
    /// What [`Leadership::changed`] last reported through this handle.
    reported: bool,
}

impl Leadership {
    fn new(until: watch::Receiver<Option<Instant>>) -> Leadership {
        let mut l = Leadership { until, reported: false };
        l.reported = l.is_leading();
        l
    }

    /// Without leader election: this process always writes (one replica).
    pub(crate) fn always() -> Leadership {
        // Far enough never to pass, near enough not to overflow the clock.
        let (_, until) = watch::channel(Some(Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600)));
        Leadership::new(until)
    }

    /// The instant this replica must stop writing by, while it leads.
    pub(crate) fn until(&self) -> Option<Instant> {
        (*self.until.borrow()).filter(|&u| u > Instant::now())
    }

    /// A leadership the caller decides, for tests.
    #[cfg(test)]
    pub(crate) fn manual() -> (watch::Sender<Option<Instant>>, Leadership) {
        let (tx, until) = watch::channel(None);
        (tx, Leadership::new(until))
    }

    pub(crate) fn is_leading(&self) -> bool {
        self.until().is_some()
    }

    /// Whether this replica led when this handle was made, or when [`Leadership::changed`]
    /// last returned: a lease won since then is a change still to come through `changed`.
    pub(crate) fn reported(&self) -> bool {
        self.reported
    }

    /// Resolves when this replica starts or stops leading, as last reported through this
    /// handle, and returns whether it leads now. Renewals that change nothing are not
    /// reported; a lapse is, by the deadline alone (the lease task may be stuck in a hung
    /// request), also when it passed while nobody was waiting.
    pub(crate) async fn changed(&mut self) -> bool {
        loop {
            let leading = self.is_leading();
            if leading != self.reported {
                self.reported = leading;
                return leading;
            }
            let until = *self.until.borrow_and_update();
            let lapse = async move {
                match until {
                    Some(u) if u > Instant::now() => tokio::time::sleep_until(u).await,
                    _ => std::future::pending().await,
                }
            };
            tokio::pin!(lapse);
            tokio::select! {
                changed = self.until.changed() => {
                    if changed.is_err() {
                        // The sender is gone (no election, or it stopped): only the
                        // deadline can still change anything.
                        (&mut lapse).await;
                    }
                }
                () = &mut lapse => {}
            }
        }
    }
}

/// What leadership looks like from this replica, as the event loop sees it through its
/// [`Leadership`] handle: whether it leads now, and how often that changed.
#[derive(Clone)]
pub(crate) struct LeadershipMetrics {
    leader: IntGauge,
    transitions: IntCounterVec,
}

impl LeadershipMetrics {
    /// Metrics counted but exported nowhere (tests).
    pub(crate) fn unregistered() -> LeadershipMetrics {
        LeadershipMetrics {
            leader: int_gauge(
                "leader",
                "1 while this replica writes to the cluster (holds the lease, or runs without one)",
            ),
            transitions: counter_vec(
                "leader_transitions_total",
                "This replica's leadership changes (transition=acquired, lost)",
                &["transition"],
            ),
        }
    }

    pub(crate) fn register(registry: &Registry) -> prometheus::Result<LeadershipMetrics> {
        let m = LeadershipMetrics::unregistered();
        register_all(registry, m.collectors())?;
        Ok(m)
    }

    /// What [`LeadershipMetrics::register`] registers.
    pub(crate) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![Box::new(self.leader.clone()), Box::new(self.transitions.clone())]
    }

    /// Whether this replica leads when the event loop starts (no transition).
    pub(crate) fn started(&self, leading: bool) {
        self.leader.set(i64::from(leading));
    }

    /// This replica just started (`leading`) or stopped leading.
    pub(crate) fn changed(&self, leading: bool) {
        self.leader.set(i64::from(leading));
        let transition = if leading { "acquired" } else { "lost" };
        self.transitions.with_label_values(&[transition]).inc();
    }
}

#[derive(Debug, Clone)]
pub(crate) struct LeaseConfig {
    pub lease: LeaseRef,
    pub identity: String,
    /// Written into the lease; others take over this long after our last renewal.
    pub duration: Duration,
}

impl LeaseConfig {
    /// We stop writing this long after our last renewal: two thirds of the duration, as
    /// client-go's defaults (15 s / 10 s), leaving a third as margin for slow writes.
    fn renew_deadline(&self) -> Duration {
        self.duration * 2 / 3
    }

    /// How often the lease is read (and renewed while held).
    fn retry_period(&self) -> Duration {
        (self.duration / 5).max(Duration::from_millis(100))
    }

    /// Each Lease request's own limit: half the renew deadline, so a hung request leaves
    /// time for another attempt before leadership lapses.
    fn request_timeout(&self) -> Duration {
        self.renew_deadline() / 2
    }
}

/// The running election. Dropping it without [`Campaign::release`] lets the lease
/// expire on its own.
pub(crate) struct Campaign {
    stop: CancellationToken,
    /// Ends with the lease as last seen, when it names us: what [`Campaign::release`] hands
    /// back.
    task: JoinHandle<Option<Lease>>,
    api: Api<Lease>,
    config: LeaseConfig,
}

impl Campaign {
    /// Starts campaigning.
    pub(crate) fn spawn(client: kube::Client, config: LeaseConfig, vitals: &Arc<Vitals>) -> (Leadership, Campaign) {
        let (tx, until) = watch::channel(None);
        let stop = CancellationToken::new();
        let api: Api<Lease> = Api::namespaced(client, &config.lease.namespace);
        let task =
            tokio::spawn(vitals.watch("leader election", campaign(api.clone(), config.clone(), tx, stop.clone())));
        (Leadership::new(until), Campaign { stop, task, api, config })
    }

    /// How long one release request may take: a Lease request's own limit. The shutdown
    /// keeps at least this much of its budget for [`Campaign::release`].
    pub(crate) fn release_time(&self) -> Duration {
        self.config.request_timeout()
    }

    /// Stops campaigning at once (a Lease request in flight is abandoned: it would only
    /// renew what is about to be released) and, if the lease as last seen names us, hands
    /// it back so another replica takes over at once instead of after the lease duration.
    /// That is tried even when our leadership has lapsed (a slow API server): the write is
    /// conditional on the version we saw, so it can never take the lease from a replica
    /// that has acquired it since. Tried again after a quick failure, until `deadline`;
    /// whatever happens, this returns by then.
    pub(crate) async fn release(self, deadline: Instant) {
        self.stop.cancel();
        let Ok(Some(lease)) = self.task.await else { return };
        hand_back(&self.api, &self.config, lease, deadline).await;
    }
}

/// Writes `lease` with no holder (conditional on its resourceVersion) until it lands, the
/// lease turns out not to be ours, or `deadline` passes.
async fn hand_back(api: &Api<Lease>, config: &LeaseConfig, mut lease: Lease, deadline: Instant) {
    let name = config.lease.name.as_str();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            tracing::warn!(lease = %config.lease, "out of time to release the leader lease; another replica takes over when it expires");
            return;
        }
        let spec = lease.spec.get_or_insert_with(Default::default);
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        match tokio::time::timeout(left, api.replace(name, &PostParams::default(), &lease)).await {
            Ok(Ok(_)) => {
                tracing::info!(lease = %config.lease, "released the leader lease");
                return;
            }
            // Written since we saw it: our own renewal abandoned in flight may have landed
            // late. Read it again, and release it if it still names us.
            Ok(Err(kube::Error::Api(s))) if s.code == 409 => {
                match tokio::time::timeout(left, api.get_opt(name)).await {
                    Ok(Ok(Some(current))) if holds(&current, &config.identity) => lease = current,
                    Ok(Ok(_)) => {
                        tracing::info!(lease = %config.lease, "the leader lease is no longer ours; nothing to release");
                        return;
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(lease = %config.lease, error = %e, "cannot read the leader lease to release it");
                        tokio::time::sleep(RELEASE_RETRY.min(left)).await;
                    }
                    Err(_) => {}
                }
            }
            Ok(Err(kube::Error::Api(s))) if s.code == 404 => {
                tracing::info!(lease = %config.lease, "the leader lease is gone; nothing to release");
                return;
            }
            Ok(Err(e)) => {
                tracing::warn!(lease = %config.lease, error = %e, "cannot release the leader lease; trying again");
                // A quick failure (connection refused, 5xx): the API server may be back in
                // a moment, and the remaining time is the release's anyway.
                tokio::time::sleep(RELEASE_RETRY.min(left)).await;
            }
            Err(_) => {}
        }
    }
}

/// The pause between two release attempts after a quick failure.
const RELEASE_RETRY: Duration = Duration::from_millis(250);

/// Whether `lease` names `identity` as its holder.
fn holds(lease: &Lease, identity: &str) -> bool {
    lease.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) == Some(identity)
}

fn record(lease: &Lease) -> LeaseRecord {
    let spec = lease.spec.clone().unwrap_or_default();
    LeaseRecord {
        holder: spec.holder_identity,
        version: lease.resource_version().unwrap_or_default(),
        duration: Duration::from_secs(spec.lease_duration_seconds.unwrap_or(0).max(0) as u64),
        transitions: spec.lease_transitions.unwrap_or(0),
    }
}

fn seconds(d: Duration) -> i32 {
    d.as_secs().clamp(1, i32::MAX as u64) as i32
}

/// The spec of a lease we have just taken, at `now`.
fn held(config: &LeaseConfig, now: Option<MicroTime>, transitions: i32) -> LeaseSpec {
    LeaseSpec {
        holder_identity: Some(config.identity.clone()),
        lease_duration_seconds: Some(seconds(config.duration)),
        acquire_time: now.clone(),
        renew_time: now,
        lease_transitions: Some(transitions),
        ..Default::default()
    }
}

/// Campaigns until `stop`; returns the lease as last seen when it names us (for
/// [`Campaign::release`]).
async fn campaign(
    api: Api<Lease>,
    config: LeaseConfig,
    tx: watch::Sender<Option<Instant>>,
    stop: CancellationToken,
) -> Option<Lease> {
    let name = config.lease.name.clone();
    let limit = config.request_timeout();
    let mut election = Election::new(config.identity.clone(), config.duration, config.renew_deadline());
    let mut last: Option<Lease> = None;
    loop {
        // One round: read the lease, and write it when it is ours to keep or take.
        // Stopping abandons a request in flight: the release comes next, and a renewal
        // would only be undone by it (and would delay it, on a slow API server).
        let round = async {
            match tokio::time::timeout(limit, api.get_opt(&name)).await {
                Err(_) => tracing::warn!(lease = %config.lease, timeout = ?limit, "reading the leader lease timed out"),
                Ok(Err(e)) => tracing::warn!(lease = %config.lease, error = %e, "cannot read the leader lease"),
                Ok(Ok(current)) => {
                    // Observed when the answer arrived: a slow read must not make another
                    // replica's lease look older than it is.
                    let action = election.observe(current.as_ref().map(record).as_ref(), Instant::now());
                    let stamp = Some(MicroTime(Timestamp::now()));
                    // Leadership counts from before the write is sent: the others can only
                    // see it later.
                    let sent = Instant::now();
                    let write = match (action, current) {
                        (Action::Wait, current) => {
                            last = current;
                            None
                        }
                        (Action::Create, _) => {
                            let lease = Lease {
                                metadata: ObjectMeta { name: Some(name.clone()), ..Default::default() },
                                spec: Some(held(&config, stamp, 0)),
                            };
                            Some(tokio::time::timeout(limit, api.create(&PostParams::default(), &lease)).await)
                        }
                        (Action::Renew { .. }, Some(mut lease)) => {
                            let spec = lease.spec.get_or_insert_with(Default::default);
                            spec.renew_time = stamp;
                            spec.lease_duration_seconds = Some(seconds(config.duration));
                            Some(tokio::time::timeout(limit, api.replace(&name, &PostParams::default(), &lease)).await)
                        }
                        (Action::Acquire { transitions, .. }, Some(mut lease)) => {
                            lease.spec = Some(held(&config, stamp, transitions));
                            Some(tokio::time::timeout(limit, api.replace(&name, &PostParams::default(), &lease)).await)
                        }
                        (Action::Renew { .. } | Action::Acquire { .. }, None) => None,
                    };
                    match write {
                        Some(Ok(Ok(lease))) => {
                            election.written(sent);
                            last = Some(lease);
                        }
                        Some(Ok(Err(kube::Error::Api(s)))) if s.code == 409 || s.code == 404 => {
                            tracing::debug!(lease = %config.lease, "lost a race for the leader lease")
                        }
                        Some(Ok(Err(e))) => {
                            tracing::warn!(lease = %config.lease, error = %e, "cannot write the leader lease")
                        }
                        Some(Err(_)) => {
                            tracing::warn!(lease = %config.lease, timeout = ?limit, "writing the leader lease timed out")
                        }
                        None => {}
                    }
                }
            }
        };
        tokio::select! {
            _ = stop.cancelled() => break,
            () = round => {}
        }
        let until = election.leader_until();
        if tx.send_if_modified(|u| std::mem::replace(u, until) != until) {
            let holder = last.as_ref().and_then(|l| l.spec.as_ref()?.holder_identity.clone());
            tracing::debug!(lease = %config.lease, identity = %config.identity, leading = until.is_some(), holder, "lease observed");
        }
        let next = Instant::now() + config.retry_period();
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep_until(next) => {}
        }
    }
    // Our writers have stopped (the runtime stops them first); from here we never lead.
    election.released();
    tx.send_replace(None);
    last.filter(|l| holds(l, &config.identity))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    use serde_json::{Value, json};

    use super::*;
    use crate::test_fixtures::{FakeApi, not_found, serve};

    #[tokio::test(start_paused = true)]
    async fn leadership_lapses_by_the_clock_without_any_news() {
        let (tx, mut l) = Leadership::manual();
        assert!(!l.is_leading());
        let started = Instant::now();
        tx.send_replace(Some(started + Duration::from_secs(10)));
        assert!(l.changed().await, "acquired: reported at once");
        // Renewals change nothing worth reporting; the deadline alone ends it (the
        // renewals hang), and wakes whoever waits.
        tx.send_replace(Some(started + Duration::from_secs(12)));
        assert!(!l.changed().await);
        assert_eq!(Instant::now() - started, Duration::from_secs(12));
        assert_eq!(l.until(), None);
        // A renewal is news at once.
        let waiting = tokio::spawn(async move {
            let leading = l.changed().await;
            (leading, l)
        });
        tokio::task::yield_now().await;
        let renewed = Instant::now() + Duration::from_secs(10);
        tx.send_replace(Some(renewed));
        let (leading, l) = waiting.await.unwrap();
        assert!(leading);
        assert_eq!(Instant::now() - started, Duration::from_secs(12), "no wait for the renewal");
        assert_eq!(l.until(), Some(renewed));
    }

    /// The event loop starts from what its handle has reported: a lease won before the loop
    /// ran is still a change for `changed` to report, which counts it as an acquisition
    /// (`leader_transitions_total`) as it counts one won later. Without election the
    /// replica leads from the start, and no change is to come.
    #[tokio::test(start_paused = true)]
    async fn a_lease_won_before_the_handle_is_read_is_still_a_change_to_report() {
        let (tx, l) = Leadership::manual();
        tx.send_replace(Some(Instant::now() + Duration::from_secs(10)));
        let mut handle = l.clone();
        assert!(handle.is_leading());
        assert!(!handle.reported(), "won, not yet reported");
        assert!(handle.changed().await, "reported as a change");
        assert!(handle.reported());
        let always = Leadership::always();
        assert!(always.is_leading() && always.reported());
    }

    #[tokio::test(start_paused = true)]
    async fn a_lapse_while_nobody_waits_is_reported_by_the_next_wait() {
        // The runtime may be busy (handling the publication that the same deadline just
        // failed) at the very moment leadership lapses.
        let (tx, mut l) = Leadership::manual();
        tx.send_replace(Some(Instant::now() + Duration::from_secs(2)));
        assert!(l.changed().await);
        tokio::time::advance(Duration::from_secs(3)).await;
        let reported = tokio::time::timeout(Duration::from_millis(1), l.changed()).await;
        assert_eq!(reported, Ok(false), "the lapse that passed unobserved is reported at once");
    }

    /// A Lease held by a loopback API server: a write naming another resourceVersion is
    /// refused with 409; GETs fail with 500 while `reads_fail`.
    struct StoredLease {
        lease: Mutex<Option<Value>>,
        reads_fail: AtomicBool,
    }

    async fn lease_api(stored: Arc<StoredLease>) -> FakeApi {
        serve(Arc::new(move |method: &str, _path: &str, body: &[u8]| {
            let mut lease = stored.lease.lock().unwrap();
            let version = |l: &Value| l["metadata"]["resourceVersion"].as_str().unwrap_or("0").parse::<u64>().unwrap();
            match method {
                "GET" if stored.reads_fail.load(Ordering::SeqCst) => (500, json!({"kind": "Status", "code": 500})),
                "GET" => lease.clone().map_or_else(|| not_found("lead"), |l| (200, l)),
                "POST" | "PUT" => {
                    let mut sent: Value = serde_json::from_slice(body).unwrap();
                    let current = lease.as_ref().map_or(0, version);
                    if method == "PUT" && version(&sent) != current {
                        return (409, json!({"kind": "Status", "code": 409, "reason": "Conflict"}));
                    }
                    sent["metadata"]["resourceVersion"] = json!((current + 1).to_string());
                    sent["apiVersion"] = json!("coordination.k8s.io/v1");
                    sent["kind"] = json!("Lease");
                    *lease = Some(sent.clone());
                    (if method == "POST" { 201 } else { 200 }, sent)
                }
                _ => (405, json!({})),
            }
        }))
        .await
    }

    fn config(identity: &str) -> LeaseConfig {
        let lease = LeaseRef { namespace: "ops".into(), name: "lead".into() };
        LeaseConfig { lease, identity: identity.into(), duration: Duration::from_secs(2) }
    }

    fn lease_held_by(holder: &str, version: u64) -> Value {
        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "lead", "namespace": "ops", "resourceVersion": version.to_string()},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 2}})
    }

    #[tokio::test]
    async fn a_leader_whose_leadership_lapsed_still_hands_the_lease_back() {
        // The API server stops answering reads (slow, overloaded): renewals stop, and
        // leadership lapses by the clock. The lease still names us, and nobody can have
        // taken it yet: releasing it is what lets the standby take over at once.
        let stored = Arc::new(StoredLease { lease: Mutex::new(None), reads_fail: AtomicBool::new(false) });
        let api = lease_api(stored.clone()).await;
        let (mut leadership, campaign) =
            Campaign::spawn(api.client.clone(), config("a"), &Vitals::new(CancellationToken::new()));
        assert!(tokio::time::timeout(Duration::from_secs(5), leadership.changed()).await.unwrap(), "leads");
        stored.reads_fail.store(true, Ordering::SeqCst);
        assert!(!tokio::time::timeout(Duration::from_secs(5), leadership.changed()).await.unwrap(), "lapsed");
        api.take();
        // Reads still fail: the release needs none (no renewal can sneak in before it).
        campaign.release(Instant::now() + Duration::from_secs(2)).await;
        assert_eq!(api.take(), ["PUT lead"], "one conditional write, on the version last seen");
        let lease = stored.lease.lock().unwrap().clone().unwrap();
        assert_eq!(lease["spec"]["holderIdentity"], Value::Null, "released: {lease}");
        assert_eq!(lease["spec"]["leaseDurationSeconds"], 1);
    }

    #[tokio::test]
    async fn a_release_never_takes_the_lease_from_whoever_holds_it_now() {
        let stored = Arc::new(StoredLease { lease: Mutex::new(None), reads_fail: AtomicBool::new(false) });
        let api = lease_api(stored.clone()).await;
        let config = config("a");
        let api_lease: Api<Lease> = Api::namespaced(api.client.clone(), "ops");
        let ours: Lease = serde_json::from_value(lease_held_by("a", 3)).unwrap();
        let deadline = || Instant::now() + Duration::from_secs(2);
        // Renewed since we saw it (our own renewal, abandoned in flight, landed late): read
        // again, still ours, released.
        *stored.lease.lock().unwrap() = Some(lease_held_by("a", 4));
        hand_back(&api_lease, &config, ours.clone(), deadline()).await;
        assert_eq!(api.take(), ["PUT lead", "GET lead", "PUT lead"]);
        assert_eq!(stored.lease.lock().unwrap().as_ref().unwrap()["spec"]["holderIdentity"], Value::Null);
        // Taken by another replica since: left alone.
        *stored.lease.lock().unwrap() = Some(lease_held_by("b", 7));
        hand_back(&api_lease, &config, ours.clone(), deadline()).await;
        assert_eq!(api.take(), ["PUT lead", "GET lead"]);
        assert_eq!(stored.lease.lock().unwrap().as_ref().unwrap()["spec"]["holderIdentity"], "b");
        // Out of time: nothing is sent.
        hand_back(&api_lease, &config, ours, Instant::now()).await;
        assert!(api.take().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn always_leads_and_never_wakes() {
        let mut l = Leadership::always();
        assert!(l.is_leading());
        let woke = tokio::time::timeout(Duration::from_secs(3600), l.changed()).await;
        assert!(woke.is_err(), "nothing changes without an election");
        assert!(l.is_leading());
    }
}
