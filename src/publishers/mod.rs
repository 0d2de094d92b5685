//! Publishers: the edge that writes whole snapshots out (HTTP, the hook, the ConfigMap),
//! and xDS, which tells Envoy what each one changed.
//! The HTTP store is filled at hand-off; the hook and the ConfigMap each have an outlet of
//! their own in the runtime (`runtime::publication`): one delivery at a time, within a
//! deadline, retried alone with backoff and whatever snapshot is current then, so one
//! failing publisher never holds back another. Resolver statuses and Events are per resolver, written by the resolver controller
//! (`crate::controller`), so one resolver's failing status never holds back a publication.

pub(crate) mod configmap;
pub(crate) mod hook;
pub(crate) mod http;
pub(crate) mod metrics;
pub(crate) mod xds;

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::kube_client::error_reason;
use consul_resolver_core::assembler::Snapshot;

/// Why a publisher's part of a publication failed. `reason` labels the failure in
/// `consul_resolver_publish_failures_total`.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PublishError {
    #[error("not leading: {0} is not written")]
    NotLeading(&'static str),
    #[error("leadership lapsed while writing {0}")]
    LeadershipLapsed(&'static str),
    #[error("did not finish within {} (--publish-timeout)", humantime::format_duration(*.0))]
    Timeout(Duration),
    #[error("{what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("ConfigMap {0}: written by someone else twice in a row")]
    Conflict(String),
    #[error("{0}")]
    Encode(String),
    #[error("--on-snapshot {command}: cannot start: {source}")]
    HookStart {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "--on-snapshot {command} did not finish within {} (--on-snapshot-timeout); killed",
        humantime::format_duration(*timeout)
    )]
    HookTimeout { command: String, timeout: Duration },
    #[error("--on-snapshot {command} failed ({status}){tail}")]
    HookExit { command: String, status: std::process::ExitStatus, tail: String },
    #[error("{0}")]
    Io(String),
}

impl PublishError {
    /// A short, bounded label for metrics.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            PublishError::NotLeading(_) => "not_leading",
            PublishError::LeadershipLapsed(_) => "leadership_lapsed",
            PublishError::Timeout(_) => "timeout",
            PublishError::Kube { source, .. } => error_reason(source),
            PublishError::Conflict(_) => "conflict",
            PublishError::Encode(_) => "encode",
            PublishError::HookStart { .. } => "hook_start",
            PublishError::HookTimeout { .. } => "hook_timeout",
            PublishError::HookExit { .. } => "hook_exit",
            PublishError::Io(_) => "io",
        }
    }

    fn kube(what: impl Into<String>) -> impl FnOnce(kube::Error) -> PublishError {
        let what = what.into();
        move |source| PublishError::Kube { what, source }
    }
}

pub(crate) trait Publisher: Send + Sync + 'static {
    fn name(&self) -> &'static str;
    fn publish(&self, snapshot: Arc<Snapshot>) -> BoxFuture<'static, Result<(), PublishError>>;

    /// Forgets what this publisher believes it has already written, so the next
    /// publication writes everything: another writer (an earlier leader) may have written
    /// since.
    fn forget(&self) {}
}

#[cfg(test)]
pub(crate) fn gunzip(bytes: &[u8]) -> Result<Vec<u8>, String> {
    gunzip_limited(bytes, usize::MAX)
}

/// Inflates `bytes`, refusing an output over `limit` bytes (a gzip bomb) before it is in
/// memory.
pub(crate) fn gunzip_limited(bytes: &[u8], limit: usize) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let mut out = Vec::new();
    let cap = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
    flate2::read::GzDecoder::new(bytes).take(cap).read_to_end(&mut out).map_err(|e| format!("gunzip: {e}"))?;
    if out.len() > limit {
        return Err(format!("gunzip: the snapshot is larger than {limit} bytes"));
    }
    Ok(out)
}
