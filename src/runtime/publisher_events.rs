//! Events about the publishers, for whoever runs `kubectl get events` where the output
//! lives rather than reading the operator's metrics: a Warning `PublishFailed` when a
//! publisher starts failing (once per streak, not per retry), and a Normal
//! `PublishRecovered` when it delivers again. The ConfigMap's Events are about the snapshot
//! ConfigMap; the hook's about this replica's Pod (`POD_NAMESPACE`/`POD_NAME`, from the
//! Deployment), and none when the process does not know its Pod.
//!
//! Written only while leading, like every other cluster write (docs/reliability.md, rule
//! 8), and each within the leadership deadline and `--kube-timeout`. Written beside the
//! outlet, never in its way: a slow Event never delays a delivery.

use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use prometheus::IntCounter;
use tokio::time::Instant;

use crate::controller::resolver::events::{MAX_NOTE, truncate};
use crate::leadership::Leadership;
use consul_resolver_api::names::NamespacedName;

pub(crate) const PUBLISH_FAILED: &str = "PublishFailed";
pub(crate) const PUBLISH_RECOVERED: &str = "PublishRecovered";

pub(crate) struct PublisherEvents {
    recorder: Recorder,
    leadership: Leadership,
    configmap: Option<ObjectReference>,
    pod: Option<ObjectReference>,
    timeout: Duration,
    /// The status controller's `event_failures_total`: one count for every Event not written.
    event_failures: IntCounter,
}

impl PublisherEvents {
    pub(crate) fn new(
        client: kube::Client,
        controller: &str,
        instance: String,
        leadership: Leadership,
        configmap: Option<&NamespacedName>,
        timeout: Duration,
        event_failures: IntCounter,
    ) -> PublisherEvents {
        let reporter = Reporter { controller: controller.into(), instance: Some(instance) };
        let reference = |kind: &str, namespace: &str, name: &str| ObjectReference {
            api_version: Some("v1".into()),
            kind: Some(kind.into()),
            namespace: Some(namespace.into()),
            name: Some(name.into()),
            ..Default::default()
        };
        let pod = match (std::env::var("POD_NAMESPACE"), std::env::var("POD_NAME")) {
            (Ok(ns), Ok(name)) if !ns.is_empty() && !name.is_empty() => Some(reference("Pod", &ns, &name)),
            _ => None,
        };
        PublisherEvents {
            recorder: Recorder::new(client, reporter),
            leadership,
            configmap: configmap.map(|t| reference("ConfigMap", &t.namespace, &t.name)),
            pod,
            timeout,
            event_failures,
        }
    }

    /// `publisher` just failed, after delivering (or from the start).
    pub(crate) fn failing(&self, publisher: &'static str, why: String) {
        self.send(publisher, EventType::Warning, PUBLISH_FAILED, why);
    }

    /// `publisher` delivered snapshot `id` after failing.
    pub(crate) fn recovered(&self, publisher: &'static str, id: u64) {
        self.send(publisher, EventType::Normal, PUBLISH_RECOVERED, format!("delivered snapshot {id}"));
    }

    fn send(&self, publisher: &'static str, type_: EventType, reason: &str, note: String) {
        let regarding = if publisher == crate::publishers::configmap::NAME { &self.configmap } else { &self.pod };
        let (Some(regarding), Some(until)) = (regarding.clone(), self.leadership.until()) else { return };
        let until = until.min(Instant::now() + self.timeout);
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(truncate(format!("{publisher}: {note}"), MAX_NOTE)),
            action: "Publish".into(),
            secondary: None,
        };
        let (recorder, failures) = (self.recorder.clone(), self.event_failures.clone());
        tokio::spawn(async move {
            match tokio::time::timeout_at(until, recorder.publish(&event, &regarding)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(publisher, error = %e, "cannot write an Event about a publisher");
                    failures.inc();
                }
                Err(_) => {
                    tracing::warn!(publisher, "no Event about a publisher within the deadline");
                    failures.inc();
                }
            }
        });
    }
}
