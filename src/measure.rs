//! What every group of metrics shares (docs/metrics.md, "Conventions"): the buckets of work
//! done in memory, constructors for definitions that are valid as written (a bad name or
//! label is a bug, caught by the first test that builds the group), and Unix timestamps for
//! `_timestamp_seconds` gauges.
//!
//! A leaf: each subsystem's metrics use it, and it uses none of them, so a subsystem
//! defines its metrics without reaching into the ops server that exposes them.

use std::time::{SystemTime, UNIX_EPOCH};

use prometheus::core::Collector;
use prometheus::{Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge};
use prometheus::{IntGaugeVec, Opts, Registry};

/// Buckets for work done in memory (assembly, one publisher, a reconcile): 1 ms to 1 min.
pub(crate) const WORK_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

pub(crate) fn counter(name: &str, help: &str) -> IntCounter {
    IntCounter::new(name, help).expect("valid metric")
}

pub(crate) fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
}

pub(crate) fn histogram(name: &str, help: &str, buckets: &[f64]) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec())).expect("valid metric")
}

pub(crate) fn histogram_vec(name: &str, help: &str, labels: &[&str], buckets: &[f64]) -> HistogramVec {
    HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets.to_vec()), labels).expect("valid metric")
}

pub(crate) fn gauge(name: &str, help: &str) -> Gauge {
    Gauge::new(name, help).expect("valid metric")
}

pub(crate) fn gauge_vec(name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    GaugeVec::new(Opts::new(name, help), labels).expect("valid metric")
}

pub(crate) fn int_gauge(name: &str, help: &str) -> IntGauge {
    IntGauge::new(name, help).expect("valid metric")
}

pub(crate) fn int_gauge_vec(name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric")
}

/// Registers a group's `collectors` in `registry`.
pub(crate) fn register_all(registry: &Registry, collectors: Vec<Box<dyn Collector>>) -> prometheus::Result<()> {
    collectors.into_iter().try_for_each(|c| registry.register(c))
}

/// Seconds since the Unix epoch, for `_timestamp_seconds` gauges.
pub(crate) fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}
