//! The Lease edge of leader election: reads and writes one `coordination.k8s.io/v1` Lease
//! for [`crate::core::election`], and tells the runtime whether this replica leads.
//!
//! Writes are conditional on the resourceVersion just read, so two replicas racing for a
//! free lease cannot both win: the loser gets a 409 and sees the winner on its next read.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{PostParams, ResourceExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::cli::LeaseRef;
use crate::core::election::{Action, Election, LeaseRecord};

#[derive(Debug, Clone)]
pub struct LeaseConfig {
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
}

/// The running election. Dropping it without [`Leadership::release`] lets the lease
/// expire on its own.
pub struct Leadership {
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Leadership {
    /// Starts campaigning; the receiver says whether we lead, now and on every change.
    pub fn spawn(client: kube::Client, config: LeaseConfig) -> (watch::Receiver<bool>, Leadership) {
        let (tx, rx) = watch::channel(false);
        let stop = CancellationToken::new();
        let api: Api<Lease> = Api::namespaced(client, &config.lease.namespace);
        let task = tokio::spawn(campaign(api, config, tx, stop.clone()));
        (rx, Leadership { stop, task })
    }

    /// Stops campaigning and, if we hold the lease, hands it back so another replica
    /// takes over at once instead of after the lease duration.
    pub async fn release(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
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

async fn campaign(api: Api<Lease>, config: LeaseConfig, tx: watch::Sender<bool>, stop: CancellationToken) {
    let name = config.lease.name.clone();
    let mut election = Election::new(config.identity.clone(), config.duration, config.renew_deadline());
    let mut last: Option<Lease> = None;
    loop {
        let now = Instant::now();
        match api.get_opt(&name).await {
            Err(e) => tracing::warn!(lease = %config.lease, error = %e, "cannot read the leader lease"),
            Ok(current) => {
                let action = election.observe(current.as_ref().map(record).as_ref(), now);
                let stamp = Some(MicroTime(Timestamp::now()));
                let written = match (action, current) {
                    (Action::Wait, current) => {
                        last = current;
                        None
                    }
                    (Action::Create, _) => {
                        let lease = Lease {
                            metadata: ObjectMeta { name: Some(name.clone()), ..Default::default() },
                            spec: Some(held(&config, stamp, 0)),
                        };
                        Some(api.create(&PostParams::default(), &lease).await)
                    }
                    (Action::Renew { .. }, Some(mut lease)) => {
                        let spec = lease.spec.get_or_insert_with(Default::default);
                        spec.renew_time = stamp;
                        spec.lease_duration_seconds = Some(seconds(config.duration));
                        Some(api.replace(&name, &PostParams::default(), &lease).await)
                    }
                    (Action::Acquire { transitions, .. }, Some(mut lease)) => {
                        lease.spec = Some(held(&config, stamp, transitions));
                        Some(api.replace(&name, &PostParams::default(), &lease).await)
                    }
                    (Action::Renew { .. } | Action::Acquire { .. }, None) => None,
                };
                match written {
                    // Leadership counts from before the write was sent: the others can
                    // only have seen it later.
                    Some(Ok(lease)) => {
                        election.written(now);
                        last = Some(lease);
                    }
                    Some(Err(kube::Error::Api(s))) if s.code == 409 || s.code == 404 => {
                        tracing::debug!(lease = %config.lease, "lost a race for the leader lease")
                    }
                    Some(Err(e)) => tracing::warn!(lease = %config.lease, error = %e, "cannot write the leader lease"),
                    None => {}
                }
            }
        }
        let leading = election.is_leader(Instant::now());
        if tx.send_if_modified(|l| std::mem::replace(l, leading) != leading) {
            let holder = last.as_ref().and_then(|l| l.spec.as_ref()?.holder_identity.clone());
            tracing::info!(lease = %config.lease, identity = %config.identity, leading, holder, "leadership changed");
        }
        let next = Instant::now() + config.retry_period();
        let wake = election.leader_until().filter(|&u| u > Instant::now()).map_or(next, |u| u.min(next));
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep_until(wake) => {}
        }
    }
    if election.is_leader(Instant::now()) {
        election.released();
        tx.send_replace(false);
        if let Some(mut lease) = last {
            let spec = lease.spec.get_or_insert_with(Default::default);
            spec.holder_identity = None;
            spec.lease_duration_seconds = Some(1);
            match api.replace(&name, &PostParams::default(), &lease).await {
                Ok(_) => tracing::info!(lease = %config.lease, "released the leader lease"),
                Err(e) => {
                    tracing::warn!(lease = %config.lease, error = %e, "cannot release the leader lease; it expires")
                }
            }
        }
    }
}
