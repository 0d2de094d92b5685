//! The command line's groups turned into their subsystems' settings, each in one place.

use std::time::Duration;

use crate::cli::{ConsulArgs, LeadershipArgs, PublicationArgs, RunArgs};
use crate::leadership::LeaseConfig;
use consul_resolver_core::assembler::{self, EndpointsApi, WatchLimits};
use consul_watch::Settings as ConsulSettings;

impl ConsulArgs {
    pub(super) fn settings(&self) -> ConsulSettings {
        ConsulSettings {
            wait: self.consul_wait,
            max_connections: self.consul_max_connections as usize,
            sweep: self.consul_sweep,
            max_response_bytes: usize::try_from(self.consul_max_response_bytes).unwrap_or(usize::MAX),
            ..ConsulSettings::default()
        }
    }
}

impl LeadershipArgs {
    /// This replica's name in the lease, in Events' `reportingInstance` and in its
    /// User-Agent.
    pub(super) fn identity(&self) -> String {
        self.leader_election_identity.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            let host = host.trim();
            format!("{}-{}", if host.is_empty() { "consul-resolver-operator" } else { host }, std::process::id())
        })
    }

    /// The Lease to campaign for, if any (else this process always writes).
    pub(super) fn lease(&self, identity: &str) -> Option<LeaseConfig> {
        let lease = self.leader_election_lease.clone()?;
        Some(LeaseConfig { lease, identity: identity.to_owned(), duration: self.leader_election_duration })
    }
}

impl PublicationArgs {
    /// Each publisher's deadline: the hook has its own limit, which kills it, so it gets
    /// that plus a moment to reap.
    pub(super) fn publish_timeout(&self) -> Duration {
        self.publish_timeout.max(self.on_snapshot_timeout + Duration::from_secs(5))
    }
}

impl RunArgs {
    /// The pipeline's configuration, with the endpoints API the start-up found.
    pub(super) fn pipeline_config(&self, endpoints_api: EndpointsApi) -> assembler::Config {
        let address_env = &self.resolution.address_env;
        assembler::Config {
            ambassador_id: self.resolution.ambassador_id.clone(),
            default_resolver: self.resolution.default_resolver.clone(),
            endpoints_api,
            endpoint_watches: WatchLimits {
                namespace_above: self.kube.endpoints_namespace_watch_above,
                budget: self.kube.endpoints_watch_budget,
                // Confined to namespaces, its RBAC may not reach every namespace's endpoints.
                cluster_wide: self.kube.namespaces.is_empty(),
            },
            // Only the variables an address may name: the rest of the environment may hold
            // secrets, and an expanded address is published.
            env: std::env::vars().filter(|(name, _)| address_env.contains(name)).collect(),
            static_watches: self.kube.watches.clone(),
        }
    }
}
