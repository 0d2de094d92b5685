//! Sources: the edge that watches things and reports events into the pipeline.
//!
//! A [`Source`] says which keys it can watch and runs one watch per key. [`Watches`]
//! applies the registry's diffs: it starts a task per new key on the source that accepts
//! it and aborts the task (cancelling any request in flight) when the key is stopped. A
//! new kind of source is a new `Source` implementation and a `WatchKey` variant; nothing
//! else changes.

pub mod consul;
pub mod kube;

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use tokio::sync::mpsc;
use tokio_util::task::AbortOnDropHandle;

use crate::core::aggregator::Event;
use crate::core::keys::WatchKey;
use crate::core::registry::Diff;

/// Where sources send events. Bounded, so a flood applies backpressure to the sources
/// rather than memory.
pub type EventSink = mpsc::Sender<Event>;

pub trait Source: Send + Sync + 'static {
    /// A short name for logs and metrics (`kubernetes`, `consul`).
    fn name(&self) -> &'static str;
    /// Whether this source watches keys like `key`.
    fn accepts(&self, key: &WatchKey) -> bool;
    /// The watch of `key`: runs until dropped, reporting into `events`.
    fn watch(&self, key: WatchKey, events: EventSink) -> BoxFuture<'static, ()>;
}

/// The running watches, one task per key.
pub struct Watches {
    sources: Vec<Arc<dyn Source>>,
    running: BTreeMap<WatchKey, AbortOnDropHandle<()>>,
    events: EventSink,
}

impl Watches {
    pub fn new(sources: Vec<Arc<dyn Source>>, events: EventSink) -> Self {
        Watches { sources, running: BTreeMap::new(), events }
    }

    pub fn apply(&mut self, diff: &Diff<WatchKey>) {
        for key in &diff.stop {
            if self.running.remove(key).is_some() {
                tracing::info!(watch = %key, "watch stopped");
            }
        }
        for key in &diff.start {
            let Some(source) = self.sources.iter().find(|s| s.accepts(key)) else {
                tracing::error!(watch = %key, "no source can watch this key");
                continue;
            };
            tracing::info!(watch = %key, source = source.name(), "watch started");
            let task = tokio::spawn(source.watch(key.clone(), self.events.clone()));
            self.running.insert(key.clone(), AbortOnDropHandle::new(task));
        }
    }

    pub fn len(&self) -> usize {
        self.running.len()
    }

    pub fn is_empty(&self) -> bool {
        self.running.is_empty()
    }

    /// Running watches per source name.
    pub fn counts(&self) -> BTreeMap<&'static str, usize> {
        let mut out = BTreeMap::new();
        for key in self.running.keys() {
            if let Some(s) = self.sources.iter().find(|s| s.accepts(key)) {
                *out.entry(s.name()).or_default() += 1;
            }
        }
        out
    }
}
