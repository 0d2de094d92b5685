//! The watch of one Consul key.
//!
//! While the server's budget has a free slot the watch holds it and runs a plain blocking
//! query loop. Otherwise it is "fed": it joins the change feed of its scope (see
//! [`crate::feed`]) and re-reads (without blocking, through the small read pool) when the
//! feed says its service may have changed, or every `sweep` at the latest, a safety net for
//! the few changes neither feed query shows. A fed watch takes a slot as soon as one frees up.
//!
//! Over HTTP/2 (an `https://` server that negotiates it) there is no budget of slots to share:
//! every watch runs its own blocking query as a stream (see [`crate::client::multiplex`]).
//!
//! Either way the protocol rules of docs/consul-protocol.md hold: first query without index,
//! index reset when it goes backwards or a request fails, never below 1, a paced loop,
//! backoff with jitter on errors, and content comparison before anything is called a change.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use crate::EventSink;
use crate::client::{Answer, HttpClient};
use crate::error::QueryError;
use crate::observe::{self, Query};
use crate::pool::{FeedMembership, Pool};
use crate::timing::{Backoff, IndexState, pace};
use consul_resolver_core::keys::ConsulKey;
use consul_resolver_core::model::Endpoint;
use consul_resolver_core::model::{ConsulEvent, Event};

/// Settings shared by every watch.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `wait` of blocking queries.
    pub wait: Duration,
    /// Connection budget per Consul address.
    pub max_connections: usize,
    /// Least time between two queries of one watch (plus up to half of it at random).
    pub min_interval: Duration,
    /// Longest time a fed watch goes without re-reading (a safety net: the change feed
    /// wakes it when its service changes; see docs/consul.md for what only this catches).
    pub sweep: Duration,
    /// Largest answer body accepted from Consul, after decompression.
    pub max_response_bytes: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            wait: Duration::from_secs(300),
            max_connections: 100,
            min_interval: Duration::from_millis(100),
            sweep: Duration::from_secs(300),
            max_response_bytes: 64 << 20,
        }
    }
}

/// What the watch last reported, for content comparison.
#[derive(Default)]
struct Reported {
    endpoints: Option<Vec<Endpoint>>,
    error: Option<String>,
}

impl Reported {
    /// The event an answer calls for: the first answer, a changed one, or any answer after
    /// an error (so the error clears) is sent; an identical one is not.
    fn answer(&mut self, index: u64, endpoints: Vec<Endpoint>) -> Option<ConsulEvent> {
        if self.error.is_none() && self.endpoints.as_ref() == Some(&endpoints) {
            return None;
        }
        self.error = None;
        self.endpoints = Some(endpoints.clone());
        Some(ConsulEvent::Answer { index, endpoints })
    }

    /// A failure is sent when its message differs from the last one sent.
    fn failure(&mut self, message: String) -> Option<ConsulEvent> {
        if self.error.as_ref() == Some(&message) {
            return None;
        }
        self.error = Some(message.clone());
        Some(ConsulEvent::Failed(message))
    }
}

enum Mode {
    /// Holds a slot: blocking queries.
    Dedicated(#[allow(dead_code)] OwnedSemaphorePermit),
    /// Blocking queries as HTTP/2 streams: the client counts streams and connections.
    Multiplexed,
    /// Re-reads on feed changes and sweeps.
    Fed(Box<FeedMembership>),
    /// Not decided yet (before the first answer).
    Starting,
}

/// Runs the watch until the future is dropped or the event channel closes.
pub(crate) async fn run(pool: Arc<Pool>, key: ConsulKey, settings: Settings, events: EventSink) {
    let send = |ev: ConsulEvent| {
        let events = events.clone();
        let key = key.clone();
        async move { events.send(Event::Consul(key, ev)).await.is_ok() }
    };
    let mut reported = Reported::default();
    let mut backoff = Backoff::default();

    let client = loop {
        match pool.client(&key.server.address, key.server.tls.as_ref()) {
            Ok(c) => break c,
            Err(e) => {
                if let Some(ev) = reported.failure(e)
                    && !send(ev).await
                {
                    return;
                }
                let delay = backoff.failure(&mut rand::rng());
                tokio::time::sleep(delay).await;
            }
        }
    };

    let mut state = IndexState::default();
    let mut mode = Mode::Starting;
    let mut last_query: Option<Instant> = None;
    let mut not_before: Option<Instant> = None;
    // When the first read was sent (after waiting for a read permit): a feed whose view is
    // older needs no re-read from us.
    let mut first_read: Option<Instant> = None;
    loop {
        // Pacing and backoff: never two queries closer than the minimum interval.
        let gap = pace(settings.min_interval, &mut rand::rng());
        let mut earliest = last_query.map(|t| t + gap);
        if let Some(nb) = not_before.take() {
            earliest = Some(earliest.map_or(nb, |e| e.max(nb)));
        }
        if let Some(at) = earliest {
            tokio::time::sleep_until(at).await;
        }
        // Over HTTP/2 every watch blocks on its own stream (learnt once the server is
        // reached). Otherwise a fed (or new) watch takes a slot whenever one is free.
        if !matches!(mode, Mode::Multiplexed) && client.multiplexed() {
            mode = Mode::Multiplexed;
        } else if matches!(mode, Mode::Starting | Mode::Fed(_))
            && let Ok(permit) = pool.slots.clone().try_acquire_owned()
        {
            mode = Mode::Dedicated(permit);
        }
        let (sent, result) = match &mut mode {
            Mode::Dedicated(_) | Mode::Multiplexed => {
                let block = state.block(settings.wait);
                last_query = Some(Instant::now());
                let health = client.health(&key, block);
                (block.map(|b| b.0), observe::request(&pool.metrics, Query::Service, &key, block, health).await)
            }
            Mode::Starting => {
                last_query = Some(Instant::now());
                let (sent_at, result) = read(&pool, &client, &key).await;
                first_read = Some(sent_at);
                (None, result)
            }
            Mode::Fed(member) => {
                // Wait for the feed to name our service, or the sweep (spread by up to a
                // tenth, so fed watches do not sweep in step), whichever comes first.
                let sweep = tokio::time::sleep(settings.sweep.mul_f64(rand::random_range(0.9..1.0)));
                tokio::select! {
                    _ = member.changes.changed() => {}
                    () = sweep => {}
                }
                last_query = Some(Instant::now());
                (None, read(&pool, &client, &key).await.1)
            }
        };
        match result {
            Ok(Answer { index, value }) => {
                backoff.reset();
                if sent.is_some_and(|s| index < s) {
                    restarted(&pool, "index_went_back");
                }
                state.observe(sent, index);
                match &mode {
                    Mode::Fed(m) => m.saw(&value),
                    // The first read told us the server speaks HTTP/2: no feed needed.
                    Mode::Starting if client.multiplexed() => mode = Mode::Multiplexed,
                    Mode::Starting => {
                        // No slot was free: join the feed. It marks us for an immediate
                        // re-read unless its view predates our first read.
                        let sent_at = first_read.unwrap_or_else(Instant::now);
                        let m = pool.join_feed(&key, &client, sent_at);
                        m.saw(&value);
                        mode = Mode::Fed(Box::new(m));
                    }
                    Mode::Dedicated(_) | Mode::Multiplexed => {}
                }
                if let Some(ev) = reported.answer(index, value)
                    && !send(ev).await
                {
                    return;
                }
            }
            Err(e) => {
                // The server may come back as another cluster with a lower index: the next
                // query must not block on ours (docs/consul-protocol.md).
                if state.block(settings.wait).is_some() {
                    restarted(&pool, "error");
                }
                state.reset();
                let delay = backoff.failure(&mut rand::rng()).max(e.retry_after().unwrap_or_default());
                log_failure(&key, &e, delay);
                not_before = Some(Instant::now() + delay);
                if let Some(ev) = reported.failure(e.to_string())
                    && !send(ev).await
                {
                    return;
                }
                if let Mode::Fed(m) = &mut mode {
                    // Retry after the backoff rather than waiting for the next change.
                    m.changes.mark_changed();
                }
            }
        }
    }
}

/// A non-blocking read through the server's read pool; returns when it was sent, too.
async fn read(
    pool: &Pool,
    client: &HttpClient,
    key: &ConsulKey,
) -> (Instant, Result<Answer<Vec<Endpoint>>, QueryError>) {
    let Ok(_permit) = pool.reads.acquire().await else {
        // The semaphore is never closed; treat it as a transient failure anyway.
        let closed = QueryError::Network { address: client.address().to_owned(), cause: "shutting down".into() };
        return (Instant::now(), Err(closed));
    };
    (Instant::now(), observe::request(&pool.metrics, Query::Service, key, None, client.health(key, None)).await)
}

/// The watch starts over from a read without index (after an error, or when the server's
/// index went back): counted, as the Kubernetes source counts relists.
fn restarted(pool: &Pool, reason: &str) {
    pool.metrics.restarts.with_label_values(&["consul", reason]).inc();
}

fn log_failure(key: &ConsulKey, e: &QueryError, delay: Duration) {
    tracing::warn!(watch = %key, error = %e, retry_in = ?delay, "Consul query failed; keeping the last endpoints");
}

#[cfg(test)]
mod tests {
    use super::*;
    use consul_resolver_core::model::Health;

    fn ep(port: u16) -> Endpoint {
        Endpoint {
            address: "10.0.0.1".into(),
            port,
            node: "n".into(),
            service_id: "s".into(),
            tags: vec![],
            meta: Default::default(),
            health: Health::Passing,
        }
    }

    #[test]
    fn content_comparison() {
        let mut r = Reported::default();
        assert!(r.answer(1, vec![]).is_some(), "the first answer is always sent, even empty");
        assert!(r.answer(2, vec![]).is_none(), "same content, new index: not a change");
        assert!(r.answer(3, vec![ep(80)]).is_some());
        assert!(r.failure("boom".into()).is_some());
        assert!(r.failure("boom".into()).is_none(), "the same error is not repeated");
        assert!(r.answer(3, vec![ep(80)]).is_some(), "an answer after an error clears it");
        assert!(r.answer(4, vec![ep(80)]).is_none());
    }
}
