//! Publishers: the edge that writes whole snapshots out (HTTP, the hook, the ConfigMap).
//! The runtime publishes to all of them in turn, one snapshot at a time, each within a
//! deadline; a publication that fails anywhere is retried later with whatever is current
//! then. Resolver statuses and Events are per resolver, written by the resolver controller
//! (`crate::controller`), so one resolver's failing status never holds back a publication.

pub(crate) mod configmap;
pub(crate) mod hook;
pub(crate) mod http;

use std::sync::Arc;

use futures::future::BoxFuture;

use consul_resolver_core::assembler::Snapshot;

pub(crate) trait Publisher: Send + Sync + 'static {
    fn name(&self) -> &'static str;
    fn publish(&self, snapshot: Arc<Snapshot>) -> BoxFuture<'static, Result<(), String>>;

    /// Forgets what this publisher believes it has already written, so the next
    /// publication writes everything: another writer (an earlier leader) may have written
    /// since.
    fn forget(&self) {}
}

/// gzip at the level measured for snapshots (docs/benchmarks.md): level 1 compresses a
/// 2.1 MB snapshot to 75 KB in 1.2 ms, where the default level takes 10 ms for 48 KB. Both
/// fit a ConfigMap many times over; the time is paid on every publication.
pub(crate) fn gzip(bytes: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut enc = flate2::write::GzEncoder::new(Vec::with_capacity(bytes.len() / 8), flate2::Compression::fast());
    enc.write_all(bytes).and_then(|_| enc.finish()).expect("gzip into memory cannot fail")
}

pub(crate) fn gunzip(bytes: &[u8]) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes).read_to_end(&mut out).map_err(|e| format!("gunzip: {e}"))?;
    Ok(out)
}
