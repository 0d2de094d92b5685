//! The run's profile: its sizes and knobs, read from the environment (`BENCH_*`, see the
//! crate's documentation). `BENCH_PROFILE` gives the defaults; each variable set overrides
//! its own.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use consul_sim::tls::TestPki;
use e2e::bench::env_usize;

/// `BENCH_PROFILE`: the defaults of the sizes, and the targets (see `Targets`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Profile {
    /// Unset or `default`: 1,000 services, 10,000 Mappings in 5 namespaces.
    Default,
    /// `scale`: 5,000 services x 15 instances, 50,000 Mappings, 5,000 Kubernetes Services.
    Scale,
    /// `double`: the scale profile twice over: 10,000 services x 15 instances, 100,000
    /// Mappings, 10,000 Kubernetes Services.
    Double,
    /// `tenants`: the default Consul side beside 10,000 Kubernetes Services routed to, 50 in
    /// each of 200 namespaces, with the operator over the whole cluster (no `--namespace`),
    /// as a many-tenant cluster runs it.
    Tenants,
}

#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) profile: Profile,
    pub(crate) services: usize,
    /// Consul instances per service (`BENCH_INSTANCES_PER_SERVICE`).
    pub(crate) instances: usize,
    pub(crate) per_service: usize,
    pub(crate) namespaces: usize,
    pub(crate) changes: usize,
    /// Node check flips (`BENCH_NODE_FLIPS`, 50).
    pub(crate) node_flips: usize,
    /// Kubernetes Services routed to (`BENCH_KUBE_SERVICES`: 5,000 at scale, 10,000 in the
    /// tenants profile, else 0): each an Endpoints object with three addresses and one
    /// Mapping, spread over the namespaces.
    pub(crate) kube_services: usize,
    /// Consul scopes (`BENCH_SCOPES`, 1): with 2, the resolvers of every other namespace
    /// name a token (a Secret), which is another scope with a change feed of its own.
    pub(crate) scopes: usize,
    pub(crate) modes: Vec<u32>,
    /// Bare reflector lists made and thrown away after the setup (`BENCH_WARM_UP_LISTS`, 2).
    pub(crate) warm_up: usize,
    /// `BENCH_PIN=1`: the control plane on a CPU of its own (`setup::place`).
    pub(crate) pin: bool,
    /// `BENCH_SELF_COMPARED=<trials>`: instead of operators, that many comparisons of the
    /// bare reflector with itself (`cold_start::self_compared`); 0 (unset) for none.
    pub(crate) self_compared: usize,
    /// `BENCH_AGAINST=<operator binary>`: instead of the measurements, the cold starts of
    /// the operator under test and of this other build, alternating
    /// (`cold_start::against`), `BENCH_AGAINST_ROUNDS` (10) of each.
    pub(crate) against: Option<(PathBuf, usize)>,
    pub(crate) window: String,
    /// `BENCH_SIZES`: (services, instances per service) of each row of the cost table;
    /// empty without it.
    pub(crate) sizes: Vec<(usize, usize)>,
    /// `BENCH_XDS=1`: the operators serve xDS, and a real Envoy follows the one measured
    /// (`xds.rs`).
    pub(crate) xds: bool,
    /// `BENCH_CONSUL_TLS=1`: the simulator serves HTTPS with this throw-away PKI, so the
    /// operator reaches it over HTTP/2 (a blocking query per watch, no change feed), and
    /// the resolvers trust its CA (`tls.caSecretRef`). Unset: plain HTTP/1.1.
    pub(crate) consul_tls: Option<Arc<TestPki>>,
}

impl Settings {
    /// The profile gives the defaults; each variable set overrides its own.
    pub(crate) fn from_env() -> anyhow::Result<Settings> {
        let profile = profile()?;
        let tenants = profile == Profile::Tenants;
        // Double is the scale profile twice over.
        let (scale, twice) =
            (matches!(profile, Profile::Scale | Profile::Double), 1 + usize::from(profile == Profile::Double));
        let s = Settings {
            profile,
            // Scale: 75,000 endpoints and 50,000 Mappings.
            services: env_usize("BENCH_SERVICES", if scale { 5000 * twice } else { 1000 }),
            instances: env_usize("BENCH_INSTANCES_PER_SERVICE", if scale { 15 } else { 1 }),
            per_service: env_usize("BENCH_MAPPINGS_PER_SERVICE", 10),
            namespaces: env_usize("BENCH_NAMESPACES", if tenants { 200 } else { 5 }),
            changes: env_usize("BENCH_CHANGES", 200),
            node_flips: env_usize("BENCH_NODE_FLIPS", 50),
            kube_services: env_usize(
                "BENCH_KUBE_SERVICES",
                if scale {
                    5000 * twice
                } else if tenants {
                    10_000
                } else {
                    0
                },
            ),
            scopes: env_usize("BENCH_SCOPES", 1).max(1),
            warm_up: env_usize("BENCH_WARM_UP_LISTS", 2),
            pin: env_usize("BENCH_PIN", 0) == 1,
            self_compared: env_usize("BENCH_SELF_COMPARED", 0),
            against: against()?,
            modes: modes(profile)?,
            window: std::env::var("BENCH_COALESCE_WINDOW").unwrap_or_else(|_| "250ms".into()),
            sizes: sizes()?,
            xds: env_usize("BENCH_XDS", 0) == 1,
            consul_tls: consul_tls()?,
        };
        ensure!(!s.modes.is_empty(), "BENCH_MODES is empty");
        s.check()?;
        for &(services, instances) in &s.sizes {
            let size = Settings { services, instances, ..s.clone() };
            size.check().with_context(|| format!("BENCH_SIZES: {services}x{instances}"))?;
        }
        humantime::parse_duration(&s.window).context("BENCH_COALESCE_WINDOW")?;
        Ok(s)
    }

    fn check(&self) -> anyhow::Result<()> {
        let s = self;
        ensure!(s.services > 0 && s.services <= 50_000, "BENCH_SERVICES must be 1..50000");
        // Registered ports are 10000-19999, distinct within a service.
        ensure!(s.instances > 0 && s.instances <= 10_000, "BENCH_INSTANCES_PER_SERVICE must be 1..10000");
        ensure!(s.per_service > 0 && s.namespaces > 0, "BENCH_MAPPINGS_PER_SERVICE and BENCH_NAMESPACES must be > 0");
        // Changes take ports from 20000 up, a fresh one each, both series together.
        ensure!(s.changes > 0 && 20_000 + 2 * s.changes <= 65_535, "BENCH_CHANGES must be 1..22767");
        ensure!(s.kube_services <= 40_000, "BENCH_KUBE_SERVICES must be at most 40000");
        Ok(())
    }

    /// Whether the operator (and the bare reflector) is confined to the setup's namespaces
    /// with `--namespace`: not in the tenants profile, where one operator serves the cluster.
    pub(crate) fn confined(&self) -> bool {
        self.profile != Profile::Tenants
    }

    /// Every Mapping: those to Consul services and one per Kubernetes Service.
    pub(crate) fn mappings(&self) -> usize {
        self.services * self.per_service + self.kube_services
    }

    pub(crate) fn endpoints(&self) -> usize {
        self.services * self.instances
    }

    pub(crate) fn window(&self) -> Duration {
        humantime::parse_duration(&self.window).expect("checked in from_env")
    }

    /// How the resolvers reach Consul, as the report says it.
    pub(crate) fn consul_transport(&self) -> &'static str {
        match self.consul_tls {
            Some(_) => "HTTPS (HTTP/2: a blocking query per watch, no change feed)",
            None => "plain HTTP/1.1",
        }
    }

    /// One row of the cost table: these settings at another size.
    pub(crate) fn at_size(&self, services: usize, instances: usize) -> Settings {
        Settings { services, instances, sizes: Vec::new(), ..self.clone() }
    }
}

/// `BENCH_AGAINST`: another operator binary, and `BENCH_AGAINST_ROUNDS` cold starts of each
/// (10; even, so that each build runs first as often as second).
fn against() -> anyhow::Result<Option<(PathBuf, usize)>> {
    let Some(bin) = std::env::var_os("BENCH_AGAINST").map(PathBuf::from) else {
        return Ok(None);
    };
    ensure!(bin.is_file(), "BENCH_AGAINST={} is not a file", bin.display());
    let rounds = env_usize("BENCH_AGAINST_ROUNDS", 10);
    ensure!(rounds >= 2 && rounds.is_multiple_of(2), "BENCH_AGAINST_ROUNDS must be even and at least 2");
    Ok(Some((bin, rounds)))
}

/// `BENCH_PROFILE`.
fn profile() -> anyhow::Result<Profile> {
    match std::env::var("BENCH_PROFILE").as_deref() {
        Ok("scale") => Ok(Profile::Scale),
        Ok("double") => Ok(Profile::Double),
        Ok("tenants") => Ok(Profile::Tenants),
        Ok("" | "default") | Err(_) => Ok(Profile::Default),
        Ok(other) => bail!("BENCH_PROFILE={other}: the profiles are `default`, `scale`, `double` and `tenants`"),
    }
}

/// `BENCH_CONSUL_TLS`: a PKI for the simulator's HTTPS when `1`.
fn consul_tls() -> anyhow::Result<Option<Arc<TestPki>>> {
    if env_usize("BENCH_CONSUL_TLS", 0) != 1 {
        return Ok(None);
    }
    Ok(Some(Arc::new(TestPki::generate().context("BENCH_CONSUL_TLS=1: making the test certificates")?)))
}

/// `BENCH_MODES`: the `--consul-max-connections` budgets, one operator run each.
fn modes(profile: Profile) -> anyhow::Result<Vec<u32>> {
    let default = if profile == Profile::Default { "100,1200" } else { "100" };
    let modes = std::env::var("BENCH_MODES").unwrap_or_else(|_| default.into());
    Ok(modes.split(',').map(|m| m.trim().parse::<u32>()).collect::<Result<Vec<_>, _>>()?)
}

/// `BENCH_SIZES`: `SERVICESxINSTANCES,...`, empty when unset or blank.
fn sizes() -> anyhow::Result<Vec<(usize, usize)>> {
    let sizes = match std::env::var("BENCH_SIZES") {
        Ok(sizes) if !sizes.trim().is_empty() => sizes,
        _ => return Ok(Vec::new()),
    };
    sizes
        .split(',')
        .map(|size| {
            let (services, instances) = size
                .trim()
                .split_once('x')
                .with_context(|| format!("BENCH_SIZES: {size:?} is not SERVICESxINSTANCES"))?;
            let number = |n: &str| n.trim().parse::<usize>().with_context(|| format!("BENCH_SIZES: {size:?}"));
            Ok((number(services)?, number(instances)?))
        })
        .collect()
}
