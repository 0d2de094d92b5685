//! The command line. Every flag can also come from the environment variable named in
//! `--help`, so the Deployment can be configured either way.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use consul_resolver_api::names::{self, NamespacedName};
use consul_resolver_core::assembler::{self, ResolverName};
use consul_resolver_core::keys::KubeKey;

#[derive(Debug, Parser)]
#[command(
    name = "consul-resolver-operator",
    version,
    about = "Keeps Ambassador's view of its Consul and Kubernetes upstreams complete and current",
    long_about = "Watches ConsulResolvers and Ambassador Mappings, watches exactly the Consul services and \
Kubernetes endpoints they reference, and publishes one consistent snapshot to a ConfigMap, each \
resolver's status, HTTP and an optional hook."
)]
pub(crate) struct Cli {
    /// Log format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run the operator.
    Run(Box<RunArgs>),
    /// Print a CRD as YAML: `consulresolver` (the default) or `consulservice`.
    Crd {
        #[command(flatten)]
        kind: CrdChoice,
    },
    /// Print the version.
    Version,
}

/// The custom resources the operator defines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum CrdKind {
    Consulresolver,
    Consulservice,
}

/// Which CRD to print, and for which API servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Args)]
pub(crate) struct CrdChoice {
    #[arg(value_enum, default_value_t = CrdKind::Consulresolver)]
    pub kind: CrdKind,
    /// Leave out the CEL validation rules (`x-kubernetes-validations`), for API servers
    /// before Kubernetes 1.25: before 1.23 kubectl refuses the unknown field, and 1.23-1.24
    /// do not enforce it. Without the rules the operator still reports a bad spec in its
    /// status (`InvalidSpec`).
    #[arg(long)]
    pub without_validation_rules: bool,
}

/// `run`'s flags, in the groups `--help` shows; each group becomes its subsystem's settings
/// in one place ([`crate::runtime`]). The flags and their variables are flat on the command line.
#[derive(Debug, Clone, Args)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub kube: KubeArgs,
    #[command(flatten)]
    pub resolution: ResolutionArgs,
    #[command(flatten)]
    pub consul: ConsulArgs,
    #[command(flatten)]
    pub publication: PublicationArgs,
    #[command(flatten)]
    pub leadership: LeadershipArgs,
    #[command(flatten)]
    pub ops: OpsArgs,
    #[command(flatten)]
    pub xds: XdsArgs,
}

/// What is watched in Kubernetes and how its requests are bounded.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Kubernetes")]
pub(crate) struct KubeArgs {
    /// Namespace to watch ConsulResolvers and Mappings in; repeat for several. Default: all.
    #[arg(long = "namespace", env = "WATCH_NAMESPACES", value_delimiter = ',', value_parser = parse_namespace)]
    pub namespaces: Vec<String>,

    /// Extra Kubernetes watch, KIND[.GROUP][/NAMESPACE][?LABELSELECTOR]; its objects
    /// appear in the snapshot. Repeatable.
    #[arg(long = "watch", env = "STATIC_WATCHES", value_delimiter = ',', value_parser = parse_watch)]
    pub watches: Vec<KubeKey>,

    /// Past this many Kubernetes Services of one namespace routed to by Mappings, their
    /// endpoints come from one watch of the namespace's EndpointSlices (or Endpoints)
    /// instead of one watch each; one each again at half of it. One watch per Service costs
    /// the API server a list, a watch and a connection each (docs/operations.md).
    #[arg(long, env = "ENDPOINTS_NAMESPACE_WATCH_ABOVE", default_value_t = assembler::DEFAULT_ENDPOINTS_NAMESPACE_WATCH_ABOVE)]
    pub endpoints_namespace_watch_above: usize,

    /// Endpoints watches in total, whatever the namespaces: past it, the namespaces with the
    /// most Services routed to are watched whole first, then (without --namespace) one watch
    /// of the cluster serves all; back below three quarters of it (docs/operations.md).
    #[arg(long, env = "ENDPOINTS_WATCH_BUDGET", default_value_t = assembler::DEFAULT_ENDPOINTS_WATCH_BUDGET,
        value_parser = parse_watch_budget)]
    pub endpoints_watch_budget: usize,

    /// Deadline of every Kubernetes request that is not a watch (lists, discovery, the
    /// ConfigMap, statuses, Events, the Lease): a silent API server fails it instead of
    /// holding it for minutes.
    #[arg(long, env = "KUBE_TIMEOUT", default_value = "10s", value_parser = parse_positive_duration)]
    pub kube_timeout: Duration,

    /// How often the snapshot ConfigMap and each resolver's status are compared with the
    /// cluster and repaired when deleted or edited.
    #[arg(long, env = "RESYNC_PERIOD", default_value = "5m", value_parser = parse_positive_duration)]
    pub resync_period: Duration,
}

/// Which resolvers and Mappings are read, and what a resolver may name.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Resolution")]
pub(crate) struct ResolutionArgs {
    /// Only resolvers and Mappings whose ambassador_id contains this are read.
    #[arg(long, env = "AMBASSADOR_ID", default_value = "default", value_parser = parse_ambassador_id)]
    pub ambassador_id: String,

    /// Resolver (NAME or NAMESPACE/NAME) for Mappings that name none. Without it, such
    /// Mappings route to Kubernetes Services, whose endpoints are watched.
    #[arg(long, env = "DEFAULT_RESOLVER", value_parser = ResolverName::from_str)]
    pub default_resolver: Option<ResolverName>,

    /// Environment variable a resolver's `address` may name as `${VAR}`; repeatable. Any
    /// other is refused (InvalidSpec): an expanded address is published in the snapshot and
    /// statuses, and the operator's environment may hold secrets.
    #[arg(long = "address-env", env = "ADDRESS_ENV", value_delimiter = ',', default_value = "HOST_IP", value_parser = parse_env_name)]
    pub address_env: Vec<String>,
}

/// How Consul is queried: the consul_watch settings.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Consul")]
pub(crate) struct ConsulArgs {
    /// Most connections the operator opens to one Consul address (Consul refuses more
    /// than 200 per client by default).
    #[arg(long, env = "CONSUL_MAX_CONNECTIONS", default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub consul_max_connections: u32,

    /// `wait` of Consul blocking queries (Consul caps it at 10m).
    #[arg(long, env = "CONSUL_WAIT", default_value = "5m", value_parser = parse_duration)]
    pub consul_wait: Duration,

    /// Longest time a Consul service without a blocking query of its own (beyond the
    /// connection budget) goes without being re-read; the change feed re-reads it as soon
    /// as its checks or registrations change, this is the safety net (docs/consul.md).
    #[arg(long, env = "CONSUL_SWEEP", default_value = "5m", value_parser = parse_positive_duration)]
    pub consul_sweep: Duration,

    /// Largest Consul answer accepted (after decompression); a larger one is an error on
    /// the watch instead of unbounded memory.
    #[arg(long, env = "CONSUL_MAX_RESPONSE_BYTES", default_value_t = 64 << 20, value_parser = clap::value_parser!(u64).range(1024..=(1 << 32)))]
    pub consul_max_response_bytes: u64,
}

/// Where and how often snapshots are published.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Publication")]
pub(crate) struct PublicationArgs {
    /// ConfigMap (NAMESPACE/NAME) the snapshot is written to. Default: none.
    #[arg(long, env = "SNAPSHOT_CONFIGMAP", value_parser = NamespacedName::from_str)]
    pub snapshot_configmap: Option<NamespacedName>,

    /// Changes within this window after a publication are coalesced into one trailing
    /// publication (e.g. 250ms, 1s).
    #[arg(long, env = "COALESCE_WINDOW", default_value = "250ms", value_parser = parse_duration)]
    pub coalesce_window: Duration,

    /// How long the first snapshot waits for Consul services to answer before it is
    /// published with the silent ones marked unsynced. Kubernetes kinds always wait.
    #[arg(long, env = "BOOTSTRAP_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub bootstrap_timeout: Duration,

    /// Command run after each publication, with SNAPSHOT_ID and SNAPSHOT_FILE in its
    /// environment; never two at once.
    #[arg(long, env = "ON_SNAPSHOT")]
    pub on_snapshot: Option<PathBuf>,

    /// How long the --on-snapshot command may run before it is killed.
    #[arg(long, env = "ON_SNAPSHOT_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub on_snapshot_timeout: Duration,

    /// Deadline of each publisher's part of one publication (the hook has its own,
    /// --on-snapshot-timeout): a hung publisher fails the publication, which is retried.
    #[arg(long, env = "PUBLISH_TIMEOUT", default_value = "60s", value_parser = parse_positive_duration)]
    pub publish_timeout: Duration,
}

/// Leader election: who writes to the cluster.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Leader election")]
pub(crate) struct LeadershipArgs {
    /// Lease (NAMESPACE/NAME) for leader election. Every replica watches and serves HTTP;
    /// only the lease holder writes the ConfigMap, statuses and Events. Without it this
    /// process always writes: run a single replica.
    #[arg(long, env = "LEADER_ELECTION_LEASE", value_parser = NamespacedName::from_str)]
    pub leader_election_lease: Option<LeaseRef>,

    /// This replica's name in the lease (the pod name). Default: HOSTNAME-PID.
    #[arg(long, env = "POD_NAME")]
    pub leader_election_identity: Option<String>,

    /// How long a lease lasts without renewal before another replica takes over; the
    /// holder stops writing after two thirds of it without a successful renewal.
    #[arg(long, env = "LEADER_ELECTION_DURATION", default_value = "15s", value_parser = parse_lease_duration)]
    pub leader_election_duration: Duration,
}

/// The ops server and the process's lifetime.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Operations")]
pub(crate) struct OpsArgs {
    /// Address for /metrics, /healthz, /readyz, /snapshot and /snapshots/<id>.
    #[arg(long, env = "LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,

    /// /healthz fails when the event loop has not turned for this long (it turns at least
    /// every second while idle; its longest legitimate step is a Kubernetes read bounded by
    /// --kube-timeout). A wedged loop then gets the pod restarted by its liveness probe.
    #[arg(long, env = "HEARTBEAT_TIMEOUT", default_value = "60s", value_parser = parse_positive_duration)]
    pub heartbeat_timeout: Duration,

    /// Longest time from SIGTERM to exit; keep it below the pod's
    /// terminationGracePeriodSeconds. Publications and status writes in flight get what the
    /// Lease release leaves of it and are cut off past that; the release always has its own
    /// time at the end, so a slow API server never gets the pod killed before it.
    #[arg(long, env = "SHUTDOWN_TIMEOUT", default_value = "20s", value_parser = parse_positive_duration)]
    pub shutdown_timeout: Duration,
}

/// The xDS server: Envoy reads the clusters and endpoints over ADS (docs/xds.md).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "xDS")]
pub(crate) struct XdsArgs {
    /// Serve Envoy's Aggregated Discovery Service (gRPC; state of the world and delta) on
    /// this address: a cluster per upstream the snapshot holds, with its endpoints. Off
    /// unless set. Every replica serves it.
    #[arg(long, env = "XDS_LISTEN")]
    pub xds_listen: Option<SocketAddr>,

    /// Most Envoys connected at once; one more is refused (RESOURCE_EXHAUSTED).
    #[arg(long, env = "XDS_MAX_CLIENTS", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub xds_max_clients: u32,

    /// Serve xDS over TLS with this certificate chain (PEM); needs --xds-tls-key.
    #[arg(long, env = "XDS_TLS_CERT", requires = "xds_tls_key")]
    pub xds_tls_cert: Option<PathBuf>,

    /// The private key (PEM) of --xds-tls-cert.
    #[arg(long, env = "XDS_TLS_KEY", requires = "xds_tls_cert")]
    pub xds_tls_key: Option<PathBuf>,

    /// Require client certificates signed by these CAs (PEM): mutual TLS.
    #[arg(long, env = "XDS_TLS_CLIENT_CA", requires = "xds_tls_cert")]
    pub xds_tls_client_ca: Option<PathBuf>,

    /// Serve only Envoys whose node id is one of these (comma-separated); others are
    /// refused (PERMISSION_DENIED). Unset: any node id.
    #[arg(long = "xds-allow-node", env = "XDS_ALLOW_NODES", value_delimiter = ',')]
    pub xds_allow_nodes: Vec<String>,
}

/// The leader-election Lease.
pub(crate) type LeaseRef = NamespacedName;

fn parse_namespace(s: &str) -> Result<String, String> {
    names::dns1123_label(s).map(|()| s.to_owned()).map_err(|why| format!("{s:?} is not a valid namespace: it {why}"))
}

/// An Ambassador ID is only compared with the `ambassador_id` of Mappings and resolvers, never
/// sent to the API server; it keeps the rule the flag always had (lowercase letters, digits,
/// '-' and '.'), checked as the RFC 1123 subdomain that rule approximated.
fn parse_ambassador_id(s: &str) -> Result<String, String> {
    names::dns1123_subdomain(s)
        .map(|()| s.to_owned())
        .map_err(|why| format!("{s:?} is not a valid Ambassador ID: it {why}"))
}

fn parse_env_name(s: &str) -> Result<String, String> {
    let mut chars = s.chars();
    let valid = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if valid { Ok(s.to_owned()) } else { Err(format!("{s:?} is not an environment variable name")) }
}

fn parse_lease_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_secs(2) || d.subsec_nanos() != 0 {
        return Err(format!("{s:?}: a lease lasts whole seconds, at least 2s"));
    }
    Ok(d)
}

fn parse_watch_budget(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("the budget must allow at least one watch".to_owned()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{s:?} is not a number of watches: {e}")),
    }
}

fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    match parse_duration(s)? {
        d if d.is_zero() => Err(format!("{s:?} must be more than zero")),
        d => Ok(d),
    }
}

pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{s:?} is not a duration like 250ms, 30s or 5m: {e}"))
}

/// `KIND[.GROUP][/NAMESPACE][?LABELSELECTOR]`; the version is the one the API server
/// prefers.
pub(crate) fn parse_watch(s: &str) -> Result<KubeKey, String> {
    let (rest, labels) = match s.split_once('?') {
        Some((r, l)) if !l.is_empty() => (r, Some(l)),
        Some(_) => return Err(format!("{s:?}: empty label selector after '?'")),
        None => (s, None),
    };
    let (kind_group, namespace) = match rest.split_once('/') {
        Some((kg, ns)) if names::dns1123_label(ns).is_ok() => (kg, Some(ns)),
        Some((_, ns)) => return Err(format!("{s:?}: {ns:?} is not a namespace name")),
        None => (rest, None),
    };
    let (kind, group) = kind_group.split_once('.').unwrap_or((kind_group, ""));
    let kind_ok =
        kind.chars().next().is_some_and(|c| c.is_ascii_uppercase()) && kind.chars().all(|c| c.is_ascii_alphanumeric());
    if !kind_ok {
        return Err(format!("{s:?}: kind {kind:?} must be a Kind name such as Service or Mapping"));
    }
    if !group.is_empty() && names::dns1123_subdomain(group).is_err() {
        return Err(format!("{s:?}: {group:?} is not an API group"));
    }
    if group.is_empty() && kind == "Secret" {
        return Err(format!("{s:?}: Secrets cannot be watched into the snapshot"));
    }
    if labels.is_some_and(|l| l.chars().any(char::is_whitespace)) {
        return Err(format!("{s:?}: the label selector must not contain spaces"));
    }
    let mut key = KubeKey::new(group, "", kind);
    key.namespace = namespace.map(str::to_owned);
    key.label_selector = labels.map(str::to_owned);
    Ok(key)
}

/// Parses the command line; bad values give one line naming the flag, and exit code 2.
pub(crate) fn parse() -> Cli {
    match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                e.exit();
            }
            let rendered = e.render().to_string();
            let line = rendered.lines().find(|l| !l.trim().is_empty()).unwrap_or("error: invalid arguments");
            eprintln!("{line}");
            std::process::exit(2);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(args: &[&str]) -> Result<RunArgs, clap::Error> {
        let mut argv = vec!["consul-resolver-operator", "run"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).map(|c| match c.command {
            Command::Run(r) => *r,
            other => panic!("{other:?}"),
        })
    }

    #[test]
    fn defaults() {
        let r = run(&[]).unwrap();
        assert_eq!(r.publication.coalesce_window, Duration::from_millis(250));
        assert_eq!(r.publication.bootstrap_timeout, Duration::from_secs(30));
        assert_eq!(r.consul.consul_max_connections, 100);
        assert_eq!(r.kube.endpoints_namespace_watch_above, 100);
        assert_eq!(r.kube.endpoints_watch_budget, 250);
        assert_eq!(r.resolution.ambassador_id, "default");
        assert!(r.kube.namespaces.is_empty() && r.kube.watches.is_empty());
        assert_eq!(
            (r.kube.kube_timeout, r.publication.publish_timeout),
            (Duration::from_secs(10), Duration::from_secs(60))
        );
        assert_eq!(r.kube.resync_period, Duration::from_secs(300));
        assert_eq!(r.ops.shutdown_timeout, Duration::from_secs(20));
        assert_eq!(r.resolution.address_env, ["HOST_IP"]);
    }

    #[test]
    fn values_parse() {
        let r = run(&[
            "--namespace",
            "a",
            "--namespace",
            "b",
            "--snapshot-configmap",
            "ops/snap",
            "--coalesce-window",
            "1s",
            "--default-resolver",
            "ops/consul",
            "--watch",
            "Service/shop?app=web",
            "--watch",
            "Mapping.getambassador.io",
        ])
        .unwrap();
        assert_eq!(r.kube.namespaces, ["a", "b"]);
        assert_eq!(
            r.publication.snapshot_configmap,
            Some(NamespacedName { namespace: "ops".into(), name: "snap".into() })
        );
        assert_eq!(r.publication.coalesce_window, Duration::from_secs(1));
        assert_eq!(
            r.resolution.default_resolver,
            Some(ResolverName { namespace: Some("ops".into()), name: "consul".into() })
        );
        assert_eq!(r.kube.watches[0], KubeKey::new("", "", "Service").in_namespace("shop").with_labels("app=web"));
        assert_eq!(r.kube.watches[1], KubeKey::new("getambassador.io", "", "Mapping"));
        let r = run(&["--address-env", "HOST_IP,CONSUL_HOST", "--address-env", "_X1"]).unwrap();
        assert_eq!(r.resolution.address_env, ["HOST_IP", "CONSUL_HOST", "_X1"]);
    }

    #[test]
    fn bad_values_name_the_flag() {
        for (args, flag) in [
            (&["--coalesce-window", "soon"][..], "--coalesce-window"),
            (&["--snapshot-configmap", "nonamespace"][..], "--snapshot-configmap"),
            (&["--consul-max-connections", "0"][..], "--consul-max-connections"),
            (&["--watch", "service"][..], "--watch"),
            (&["--watch", "Secret/shop"][..], "--watch"),
            (&["--listen", "localhost"][..], "--listen"),
            (&["--leader-election-lease", "lease"][..], "--leader-election-lease"),
            (&["--leader-election-duration", "1500ms"][..], "--leader-election-duration"),
            (&["--kube-timeout", "0s"][..], "--kube-timeout"),
            (&["--shutdown-timeout", "0s"][..], "--shutdown-timeout"),
            (&["--resync-period", "never"][..], "--resync-period"),
            (&["--address-env", "HOST-IP"][..], "--address-env"),
            // Kubernetes' own rules (api::names): a namespace is a label, no dots.
            (&["--namespace", "a.b"][..], "--namespace"),
            (&["--snapshot-configmap", "ops.x/snap"][..], "--snapshot-configmap"),
            (&["--snapshot-configmap", "ops/a..b"][..], "--snapshot-configmap"),
            (&["--watch", "Service/a.b"][..], "--watch"),
            (&["--default-resolver", "Ops/consul"][..], "--default-resolver"),
            (&["--ambassador-id", "a..b"][..], "--ambassador-id"),
        ] {
            let e = run(args).unwrap_err();
            let first = e.render().to_string();
            let first = first.lines().next().unwrap();
            assert!(first.contains(flag), "{args:?}: {first}");
            assert_eq!(e.exit_code(), 2);
        }
    }
}
