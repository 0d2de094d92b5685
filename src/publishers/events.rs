//! Kubernetes Events on ConsulResolvers whose spec cannot be used (`kubectl describe cres`
//! shows them beside the `InvalidSpec` condition).
//!
//! One Warning per resolver generation and message, not one per snapshot: a resolver that
//! stays broken while its endpoints churn must not flood the namespace with Events. An
//! Event that cannot be written is logged and tried again with the next snapshot; it never
//! fails the publication (the ConfigMap and statuses must not wait on Events).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::Api;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

use super::Publisher;
use crate::api::resolver::{ConsulResolver, condition};
use crate::core::assembler::Snapshot;
use crate::metrics::Metrics;

/// Events hold at most 1 kB of note.
const MAX_NOTE: usize = 1000;

/// A resolver, its generation, and the problem reported for it.
type Reported = (String, String, Option<i64>, String);

pub struct EventPublisher {
    client: kube::Client,
    recorder: Recorder,
    reported: Arc<Mutex<BTreeSet<Reported>>>,
    metrics: Metrics,
}

impl EventPublisher {
    /// `instance` names this replica in the Events' `reportingInstance`.
    pub fn new(client: kube::Client, instance: String, metrics: Metrics) -> Self {
        let reporter = Reporter { controller: super::configmap::FIELD_MANAGER.into(), instance: Some(instance) };
        EventPublisher { recorder: Recorder::new(client.clone(), reporter), client, reported: Arc::default(), metrics }
    }
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max.saturating_sub(3);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str("...");
    }
    s
}

impl Publisher for EventPublisher {
    fn name(&self) -> &'static str {
        "events"
    }

    fn forget(&self) {
        self.reported.lock().expect("reported lock").clear();
    }

    fn publish(&self, snapshot: Arc<Snapshot>) -> BoxFuture<'static, Result<(), String>> {
        let (client, recorder, reported, metrics) =
            (self.client.clone(), self.recorder.clone(), self.reported.clone(), self.metrics.clone());
        async move {
            let current: BTreeSet<Reported> = snapshot
                .content
                .resolvers
                .iter()
                .filter_map(|r| Some((r.namespace.clone(), r.name.clone(), r.generation, r.invalid.clone()?)))
                .collect();
            // A fixed resolver that breaks again later is reported again.
            reported.lock().expect("reported lock").retain(|r| current.contains(r));
            for r in current {
                if reported.lock().expect("reported lock").contains(&r) {
                    continue;
                }
                let (namespace, name, _, message) = &r;
                // The uid makes `kubectl describe` find the Event; a resolver deleted
                // meanwhile needs none.
                let api: Api<ConsulResolver> = Api::namespaced(client.clone(), namespace);
                let uid = match api.get_opt(name).await {
                    Ok(Some(o)) => o.metadata.uid,
                    Ok(None) => continue,
                    Err(e) => {
                        tracing::warn!(resolver = %format!("{namespace}/{name}"), error = %e, "cannot read the resolver to report its invalid spec");
                        metrics.publish_failures.with_label_values(&["events"]).inc();
                        continue;
                    }
                };
                let reference = ObjectReference {
                    api_version: Some("consulresolver.io/v1alpha1".into()),
                    kind: Some("ConsulResolver".into()),
                    namespace: Some(namespace.clone()),
                    name: Some(name.clone()),
                    uid,
                    ..Default::default()
                };
                let event = Event {
                    type_: EventType::Warning,
                    reason: condition::REASON_INVALID_SPEC.into(),
                    note: Some(truncate(message.clone(), MAX_NOTE)),
                    action: "Validate".into(),
                    secondary: None,
                };
                match recorder.publish(&event, &reference).await {
                    Ok(()) => {
                        reported.lock().expect("reported lock").insert(r);
                    }
                    Err(e) => {
                        tracing::warn!(resolver = %format!("{namespace}/{name}"), error = %e, "cannot write an Event; trying again with the next snapshot");
                        metrics.publish_failures.with_label_values(&["events"]).inc();
                    }
                }
            }
            Ok(())
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publishers::test_api::{content, resolver_entry, serve};

    #[test]
    fn long_notes_are_cut_on_a_character_boundary() {
        assert_eq!(truncate("short".into(), 10), "short");
        let cut = truncate("é".repeat(600), MAX_NOTE);
        assert!(cut.len() <= MAX_NOTE && cut.ends_with("..."), "{}", cut.len());
    }

    #[tokio::test]
    async fn one_warning_per_generation_and_problem_and_again_after_a_fix() {
        let api = serve(Arc::new(|method: &str, path: &str, body: &[u8]| match method {
            "GET" => (
                200,
                serde_json::json!({"apiVersion": "consulresolver.io/v1alpha1", "kind": "ConsulResolver",
                    "metadata": {"namespace": "shop", "name": "consul", "uid": "u-1"},
                    "spec": {"address": "${X}:8500"}}),
            ),
            "POST" if path.ends_with("/events") => {
                let e: serde_json::Value = serde_json::from_slice(body).unwrap();
                assert_eq!(e["regarding"]["uid"], "u-1");
                assert_eq!((e["type"].as_str(), e["reason"].as_str()), (Some("Warning"), Some("InvalidSpec")));
                assert!(e["note"].as_str().unwrap().contains("X is not set"));
                (201, e)
            }
            // The recorder turns a repeat of the same Event into a series (a patch).
            "PATCH" => (200, serde_json::from_slice(body).unwrap()),
            _ => (405, serde_json::json!({})),
        }))
        .await;
        let publisher = EventPublisher::new(api.client.clone(), "test".into(), Metrics::new());
        let snap = |id, generation, invalid: Option<&str>| {
            let mut r = resolver_entry("shop", "consul");
            r.generation = Some(generation);
            r.invalid = invalid.map(str::to_owned);
            Arc::new(content(vec![r]).into_snapshot(id))
        };
        let broken = Some("address: environment variable X is not set");
        publisher.publish(snap(1, 1, broken)).await.unwrap();
        assert_eq!(api.take(), ["GET consul", "POST events"]);
        publisher.publish(snap(2, 1, broken)).await.unwrap();
        assert_eq!(api.take(), Vec::<String>::new(), "the same problem is not reported twice");
        // Reported again (as a repeat of the same Event, counted in its series) for a new
        // generation still broken, and when broken again after a fix.
        let repeated =
            |log: Vec<String>| log.len() == 2 && log[0] == "GET consul" && log[1].starts_with("PATCH consul.");
        publisher.publish(snap(3, 2, broken)).await.unwrap();
        let log = api.take();
        assert!(repeated(log.clone()), "a new generation, still broken: {log:?}");
        publisher.publish(snap(4, 2, None)).await.unwrap();
        publisher.publish(snap(5, 2, broken)).await.unwrap();
        let log = api.take();
        assert!(repeated(log.clone()), "broken again after a fix: {log:?}");
    }

    #[tokio::test]
    async fn a_failed_event_does_not_fail_the_publication_and_is_tried_again() {
        let api = serve(Arc::new(|method: &str, _: &str, _: &[u8]| match method {
            "GET" => (
                200,
                serde_json::json!({"apiVersion": "consulresolver.io/v1alpha1", "kind": "ConsulResolver",
                    "metadata": {"namespace": "shop", "name": "consul", "uid": "u-1"}, "spec": {"address": "x"}}),
            ),
            _ => (
                403,
                serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "Forbidden", "code": 403, "message": "events is forbidden"}),
            ),
        }))
        .await;
        let metrics = Metrics::new();
        let publisher = EventPublisher::new(api.client.clone(), "test".into(), metrics.clone());
        let mut r = resolver_entry("shop", "consul");
        r.invalid = Some("bad".into());
        publisher.publish(Arc::new(content(vec![r.clone()]).into_snapshot(1))).await.unwrap();
        publisher.publish(Arc::new(content(vec![r]).into_snapshot(2))).await.unwrap();
        assert_eq!(api.take(), ["GET consul", "POST events", "GET consul", "POST events"]);
        assert_eq!(metrics.publish_failures.with_label_values(&["events"]).get(), 2);
    }
}
