//! Warning Events on ConsulResolvers that cannot be used (`kubectl describe cres` shows
//! them beside the condition): an invalid spec, or a Secret that is missing or unreadable.
//!
//! One Warning per resolver generation, reason and message, not one per snapshot: a
//! resolver that stays broken while its endpoints churn must not flood the namespace with
//! Events. An Event that cannot be written is logged, counted and tried again at the
//! resolver's next reconcile; it never fails the status write.

use std::collections::BTreeSet;
use std::sync::Mutex;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::DynamicObject;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::time::Instant;

use super::metrics::ControllerMetrics;
use consul_resolver_core::assembler::snapshot::{ResolverEntry, UnusableReason};

/// Events hold at most 1 kB of note.
pub(crate) const MAX_NOTE: usize = 1000;

/// A resolver, its generation, and the problem reported for it.
type Reported = (String, String, Option<i64>, UnusableReason, String);

pub(crate) struct Events {
    recorder: Recorder,
    reported: Mutex<BTreeSet<Reported>>,
    metrics: ControllerMetrics,
}

/// `s` cut to at most `max` bytes, on a character boundary, marked with `...`.
pub(crate) fn truncate(mut s: String, max: usize) -> String {
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

impl Events {
    /// `instance` names this replica in the Events' `reportingInstance`.
    pub(crate) fn new(client: kube::Client, controller: &str, instance: String, metrics: ControllerMetrics) -> Self {
        let reporter = Reporter { controller: controller.into(), instance: Some(instance) };
        Events { recorder: Recorder::new(client, reporter), reported: Mutex::default(), metrics }
    }

    /// Forgets what was reported: a new leader reports still-broken resolvers once more
    /// (the recorder folds the repeat into the Event's series).
    pub(crate) fn forget(&self) {
        self.reported.lock().expect("reported lock").clear();
    }

    /// Reports `entry`'s problem on `object`, once per generation, reason and message;
    /// writing stops at `until`.
    pub(crate) async fn report(&self, object: &DynamicObject, entry: &ResolverEntry, until: Instant) {
        let (namespace, name) = (entry.namespace.clone(), entry.name.clone());
        let problem = entry
            .unusable
            .as_ref()
            .filter(|u| matches!(u.reason, UnusableReason::InvalidSpec | UnusableReason::SecretUnavailable));
        let Some(problem) = problem else {
            // Fixed (or never broken): a relapse is reported again.
            self.reported.lock().expect("reported lock").retain(|r| (&r.0, &r.1) != (&namespace, &name));
            return;
        };
        let key: Reported =
            (namespace.clone(), name.clone(), entry.generation, problem.reason, problem.message.clone());
        {
            let mut reported = self.reported.lock().expect("reported lock");
            if reported.contains(&key) {
                return;
            }
            // Only the latest problem of a resolver is remembered.
            reported.retain(|r| (&r.0, &r.1) != (&namespace, &name));
        }
        let reference = ObjectReference {
            api_version: Some("consulresolver.io/v1alpha1".into()),
            kind: Some("ConsulResolver".into()),
            namespace: Some(namespace.clone()),
            name: Some(name.clone()),
            uid: object.metadata.uid.clone(),
            ..Default::default()
        };
        let event = Event {
            type_: EventType::Warning,
            reason: problem.reason.as_str().into(),
            note: Some(truncate(problem.message.clone(), MAX_NOTE)),
            action: "Validate".into(),
            secondary: None,
        };
        match tokio::time::timeout_at(until, self.recorder.publish(&event, &reference)).await {
            Ok(Ok(())) => {
                self.reported.lock().expect("reported lock").insert(key);
            }
            Ok(Err(e)) => {
                tracing::warn!(resolver = %format!("{namespace}/{name}"), error = %e, "cannot write an Event; trying again at the next reconcile");
                self.metrics.event_failures.inc();
            }
            Err(_) => {
                tracing::warn!(resolver = %format!("{namespace}/{name}"), "leadership lapsed while writing an Event");
                self.metrics.event_failures.inc();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::{resolver_entry, serve};
    use consul_resolver_core::assembler::snapshot::Unusable;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn long_notes_are_cut_on_a_character_boundary() {
        assert_eq!(truncate("short".into(), 10), "short");
        let cut = truncate("é".repeat(600), MAX_NOTE);
        assert!(cut.len() <= MAX_NOTE && cut.ends_with("..."), "{}", cut.len());
    }

    fn object() -> DynamicObject {
        serde_json::from_value(serde_json::json!({"apiVersion": "consulresolver.io/v1alpha1", "kind": "ConsulResolver",
            "metadata": {"namespace": "shop", "name": "consul", "uid": "u-1"}, "spec": {"address": "x"}}))
        .unwrap()
    }

    fn entry(generation: i64, problem: Option<(UnusableReason, &str)>) -> ResolverEntry {
        let mut r = resolver_entry("shop", "consul");
        r.generation = Some(generation);
        r.unusable = problem.map(|(reason, m)| Unusable { reason, message: m.into() });
        r
    }

    fn until() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }

    #[tokio::test]
    async fn one_warning_per_generation_and_problem_and_again_after_a_fix() {
        let api = serve(Arc::new(|method: &str, path: &str, body: &[u8]| match method {
            "POST" if path.ends_with("/events") => {
                let e: serde_json::Value = serde_json::from_slice(body).unwrap();
                assert_eq!(e["regarding"]["uid"], "u-1");
                assert_eq!(e["type"], "Warning");
                assert!(e["note"].as_str().unwrap().contains("X is not set"));
                (201, e)
            }
            // The recorder turns a repeat of the same Event into a series (a patch).
            "PATCH" => (200, serde_json::from_slice(body).unwrap()),
            _ => (405, serde_json::json!({})),
        }))
        .await;
        let events = Events::new(api.client.clone(), "test", "test".into(), ControllerMetrics::unregistered());
        let broken = Some((UnusableReason::InvalidSpec, "spec.address: environment variable X is not set"));
        events.report(&object(), &entry(1, broken), until()).await;
        assert_eq!(api.take(), ["POST events"]);
        events.report(&object(), &entry(1, broken), until()).await;
        assert_eq!(api.take(), Vec::<String>::new(), "the same problem is not reported twice");
        events.report(&object(), &entry(2, broken), until()).await;
        let log = api.take();
        assert!(log.len() == 1 && log[0].starts_with("PATCH consul."), "a new generation, still broken: {log:?}");
        events.report(&object(), &entry(2, None), until()).await;
        events.report(&object(), &entry(2, broken), until()).await;
        let log = api.take();
        assert!(log.len() == 1 && log[0].starts_with("PATCH consul."), "broken again after a fix: {log:?}");
        // Waiting a moment for a Secret is not worth an Event.
        events.report(&object(), &entry(3, Some((UnusableReason::WaitingForSecret, "waiting"))), until()).await;
        assert!(api.take().is_empty());
    }

    #[tokio::test]
    async fn a_failed_event_is_counted_and_tried_again() {
        let api = serve(Arc::new(|_: &str, _: &str, _: &[u8]| {
            (
                403,
                serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "Forbidden", "code": 403, "message": "events is forbidden"}),
            )
        }))
        .await;
        let metrics = ControllerMetrics::unregistered();
        let events = Events::new(api.client.clone(), "test", "test".into(), metrics.clone());
        let broken = Some((UnusableReason::SecretUnavailable, "Secret shop/acl not found"));
        events.report(&object(), &entry(1, broken), until()).await;
        events.report(&object(), &entry(1, broken), until()).await;
        assert_eq!(api.take(), ["POST events", "POST events"]);
        assert_eq!(metrics.event_failures.get(), 2);
    }
}
