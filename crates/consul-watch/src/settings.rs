//! What the embedding program sets for the Consul source (a module of its own, so that the
//! watches and their server both read it without reaching into each other).

use std::time::Duration;

/// Settings shared by every watch.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `wait` of blocking queries.
    pub wait: Duration,
    /// Connection budget per Consul server.
    pub max_connections: usize,
    /// Least time between two queries of one watch (plus up to half of it at random).
    pub min_interval: Duration,
    /// Longest time a fed watch goes without re-reading (a safety net: the change feed
    /// wakes it when its service changes; see docs/consul.md for what only this catches).
    pub sweep: Duration,
    /// Largest answer body accepted from Consul, after decompression.
    pub max_response_bytes: usize,
    /// A change feed also watches its group's critical and warning checks once its answer
    /// of every check holds this many, and stops below half of it: there that answer takes
    /// a real agent tens of milliseconds or more, which a check changing status then need
    /// not wait for (docs/consul.md, "Services without a blocking query of their own").
    pub status_queries_from_checks: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            wait: Duration::from_secs(300),
            max_connections: 100,
            min_interval: Duration::from_millis(100),
            sweep: Duration::from_secs(300),
            max_response_bytes: 64 << 20,
            status_queries_from_checks: 10_000,
        }
    }
}
