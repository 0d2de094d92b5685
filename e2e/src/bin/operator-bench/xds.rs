//! `BENCH_XDS=1`: the operators serve xDS (`--xds-listen` on a free loopback port), and once
//! the measured one has its first snapshot a real Envoy (delta ADS, `--concurrency 1`, no
//! routes) subscribes to every cluster: CDS wildcard, then EDS for each. Timed from its
//! spawn until the operator's `/xds/clients` says it ACKed every cluster and every
//! `ClusterLoadAssignment` the operator serves, then until Envoy counts them all active.
//!
//! Then, for each spaced change (port changes, health flips, node check flips), besides the
//! ConfigMap: from the Consul write's HTTP 200 until Envoy ACKed an EDS response carrying
//! it (its EDS `ackedNonce` on `/xds/clients` moved, polled every 2 ms; Envoy ACKs only
//! what it applied); the xDS bytes pushed (`consul_resolver_xds_response_bytes_total`, CDS
//! and EDS) and the operator's CPU (its threads' run time, /proc/<pid>/task/*/schedstat)
//! from before the write to the end of the quiet window after it. Before each write the
//! bench waits until every EDS response sent has been ACKed, so the first ACK after the
//! write is that of a response sent after it, i.e. carrying it. The polls are the operator's
//! CPU too: their cost is measured alone first, and each sample counts its polls.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use e2e::envoy::{Envoy, EnvoyConfig, XdsSource};
use e2e::harness::{Operator, metric_sample};
use serde::Deserialize;

use crate::report::{cpu_ms, ms, secs};
use e2e::procfs::{memory_kib, thread_cpu_ns, thread_cpu_since};

/// Envoy's node id.
const NODE: &str = "operator-bench";
/// How often a change's ACK is asked for.
const POLL: Duration = Duration::from_millis(2);
/// Envoy's start, from spawn to every cluster active.
const ENVOY_LIMIT: Duration = Duration::from_secs(600);
/// A change's ACK, and the wait for every EDS response to be ACKed before a write.
const ACK_LIMIT: Duration = Duration::from_secs(60);

/// `/xds/clients`: the upstreams served, and per client what it ACKed.
#[derive(Deserialize)]
struct ClientsPage {
    upstreams: usize,
    clients: Vec<ClientPage>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ClientPage {
    node_id: String,
    #[serde(default)]
    types: BTreeMap<String, TypeAck>,
}

#[derive(Deserialize, Clone, Default)]
#[serde(rename_all = "camelCase")]
struct TypeAck {
    acked_nonce: Option<String>,
    #[serde(default)]
    resources: usize,
}

impl ClientsPage {
    /// What our Envoy ACKed of the type whose URL ends with `suffix`.
    fn ours(&self, suffix: &str) -> Option<&TypeAck> {
        let client = self.clients.iter().find(|c| c.node_id == NODE)?;
        client.types.iter().find(|(url, _)| url.ends_with(suffix)).map(|(_, t)| t)
    }

    fn eds(&self) -> Option<&TypeAck> {
        self.ours(".ClusterLoadAssignment")
    }

    fn cds(&self) -> Option<&TypeAck> {
        self.ours(".Cluster")
    }

    /// Whether our Envoy has ACKed every upstream served, as a cluster and as endpoints.
    fn complete(&self) -> bool {
        let all = |t: Option<&TypeAck>| t.is_some_and(|t| t.acked_nonce.is_some() && t.resources == self.upstreams);
        self.upstreams > 0 && all(self.cds()) && all(self.eds())
    }
}

/// What Envoy's start measured, and its memory at the end.
#[derive(Clone, Copy)]
pub(crate) struct EnvoyFigures {
    pub(crate) upstreams: usize,
    /// Spawn -> the operator saw CDS and EDS ACKed with every upstream.
    pub(crate) to_ack: Duration,
    /// Spawn -> `cluster_manager.active_clusters` counts every upstream, none warming.
    pub(crate) to_active: Duration,
    /// Envoy's VmHWM at the end, in KiB.
    pub(crate) peak_kib: u64,
}

/// The Envoy following the measured operator.
pub(crate) struct Follower {
    envoy: Envoy,
    figures: EnvoyFigures,
}

/// Starts Envoy on the operator's xDS address `addr` and waits until it holds every cluster.
pub(crate) fn follow(op: &Operator, addr: SocketAddr) -> anyhow::Result<Follower> {
    let config = EnvoyConfig { log_level: "warning".into(), ..EnvoyConfig::new(NODE, "bench") };
    let spawned = Instant::now();
    let envoy = Envoy::start(&config.with_xds(XdsSource::new(addr, true)))?;
    let deadline = spawned + ENVOY_LIMIT;
    let upstreams = envoy.wait_until(deadline, "the operator to see every cluster ACKed", |_| {
        let (code, body) = op.get("/xds/clients").context("GET /xds/clients")?;
        anyhow::ensure!(code == 200, "GET /xds/clients: {code}");
        let page: ClientsPage = serde_json::from_str(&body)?;
        Ok(page.complete().then_some(page.upstreams))
    })?;
    let to_ack = spawned.elapsed();
    envoy.wait_until(deadline, "every cluster active in Envoy", |e| {
        let stats = e.stats("^cluster_manager\\.(active|warming)_clusters$")?;
        let (active, warming) =
            (stats.get("cluster_manager.active_clusters"), stats.get("cluster_manager.warming_clusters"));
        // The xDS cluster is a static one besides.
        Ok((active.copied() == Some(upstreams as u64 + 1) && warming.copied().unwrap_or(0) == 0).then_some(()))
    })?;
    let to_active = spawned.elapsed();
    let peak_kib = envoy.pid().map(memory_kib).transpose()?.map_or(0, |m| m.0);
    println!(
        "  Envoy (delta): every one of {upstreams} clusters ACKed {} after its spawn, all active after {}; VmHWM {} KiB",
        secs(to_ack),
        secs(to_active),
        peak_kib
    );
    Ok(Follower { envoy, figures: EnvoyFigures { upstreams, to_ack, to_active, peak_kib } })
}

impl Follower {
    /// Envoy's figures with its VmHWM now; Envoy is stopped (killed, by its pid).
    pub(crate) fn finish(self) -> anyhow::Result<EnvoyFigures> {
        let peak_kib = self.envoy.pid().map(memory_kib).transpose()?.map_or(0, |m| m.0);
        Ok(EnvoyFigures { peak_kib, ..self.figures })
    }
}

/// The xDS counters of `/metrics` a change moves (delta variant).
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
struct Counters {
    cds_bytes: u64,
    eds_bytes: u64,
    eds_responses: u64,
    eds_acks: u64,
}

impl Counters {
    fn of(text: &str) -> Counters {
        let sample = |name: &str, kind: &str| {
            metric_sample(text, &format!("{name}{{type=\"{kind}\",variant=\"delta\"}}")).unwrap_or(0.0) as u64
        };
        Counters {
            cds_bytes: sample("consul_resolver_xds_response_bytes_total", "cds"),
            eds_bytes: sample("consul_resolver_xds_response_bytes_total", "eds"),
            eds_responses: sample("consul_resolver_xds_responses_total", "eds"),
            eds_acks: sample("consul_resolver_xds_acks_total", "eds"),
        }
    }
}

/// Where a change starts from: the EDS nonce last ACKed, the counters, the operator's
/// threads' CPU.
pub(crate) struct Mark {
    nonce: Option<String>,
    counters: Counters,
    cpu: BTreeMap<u32, u64>,
}

/// One spaced change, over xDS.
#[derive(Clone, Copy)]
pub(crate) struct Sample {
    /// The Consul write's HTTP 200 -> the ACK seen.
    pub(crate) ack: Duration,
    pub(crate) cds_bytes: u64,
    pub(crate) eds_bytes: u64,
    /// The operator's CPU from before the write to the end of the quiet window after it;
    /// `None` when a thread ended meanwhile.
    pub(crate) cpu: Option<Duration>,
    /// `/xds/clients` polls made for it.
    pub(crate) polls: u32,
}

/// Reads the operator's xDS state for the change measurements.
#[derive(Clone)]
pub(crate) struct Probe {
    http: reqwest::Client,
    clients: String,
    metrics: String,
    pid: u32,
}

impl Probe {
    pub(crate) fn new(op: &Operator, pid: u32) -> anyhow::Result<Probe> {
        let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build()?;
        Ok(Probe { http, clients: op.url("/xds/clients"), metrics: op.url("/metrics"), pid })
    }

    async fn get(&self, url: &str) -> anyhow::Result<String> {
        let resp = self.http.get(url).send().await?.error_for_status()?;
        Ok(resp.text().await?)
    }

    async fn counters(&self) -> anyhow::Result<Counters> {
        Ok(Counters::of(&self.get(&self.metrics).await?))
    }

    async fn eds_nonce(&self) -> anyhow::Result<Option<String>> {
        let page: ClientsPage = serde_json::from_str(&self.get(&self.clients).await?)?;
        Ok(page.eds().and_then(|t| t.acked_nonce.clone()))
    }

    /// Once every EDS response sent has been ACKed (and nothing moved while looking): the
    /// nonce ACKed last, the counters and the CPU.
    pub(crate) async fn mark(&self) -> anyhow::Result<Mark> {
        let started = Instant::now();
        loop {
            let cpu = thread_cpu_ns(self.pid)?;
            let before = self.counters().await?;
            let nonce = self.eds_nonce().await?;
            let after = self.counters().await?;
            if before == after && after.eds_responses == after.eds_acks {
                return Ok(Mark { nonce, counters: after, cpu });
            }
            if started.elapsed() > ACK_LIMIT {
                bail!("EDS responses still unACKed after {ACK_LIMIT:?}: {after:?}");
            }
            tokio::time::sleep(POLL).await; // the interval between two looks, not a wait
        }
    }

    /// Polls `/xds/clients` until the EDS nonce ACKed is no longer `mark`'s: how long after
    /// `written` that was seen, and the polls it took.
    pub(crate) async fn until_acked(&self, mark: &Mark, written: Instant) -> anyhow::Result<(Duration, u32)> {
        let mut polls = 0;
        loop {
            let nonce = self.eds_nonce().await?;
            polls += 1;
            let at = Instant::now();
            if nonce != mark.nonce {
                return Ok((at.duration_since(written), polls));
            }
            if at.duration_since(written) > ACK_LIMIT {
                bail!("no EDS response ACKed {ACK_LIMIT:?} after the write");
            }
            tokio::time::sleep(POLL).await; // the interval between two polls, not a wait
        }
    }

    /// The change begun at `mark`, ACKed after `ack` with `polls` polls: its bytes and CPU
    /// to now (the end of its quiet window).
    pub(crate) async fn sample(&self, mark: Mark, (ack, polls): (Duration, u32)) -> anyhow::Result<Sample> {
        let cpu = thread_cpu_since(&mark.cpu, &thread_cpu_ns(self.pid)?);
        let now = self.counters().await?;
        Ok(Sample {
            ack,
            cds_bytes: now.cds_bytes - mark.counters.cds_bytes,
            eds_bytes: now.eds_bytes - mark.counters.eds_bytes,
            cpu,
            polls,
        })
    }

    /// The operator's CPU for one `/xds/clients` poll and one `/metrics` read, with nothing
    /// changing: the mean of 200 each.
    pub(crate) async fn poll_cost(&self) -> anyhow::Result<PollCost> {
        const N: u32 = 200;
        let mut cost = [Duration::ZERO; 2];
        for (i, url) in [&self.clients, &self.metrics].into_iter().enumerate() {
            let before = thread_cpu_ns(self.pid)?;
            for _ in 0..N {
                self.get(url).await?;
            }
            let spent = thread_cpu_since(&before, &thread_cpu_ns(self.pid)?).context("an operator thread ended")?;
            cost[i] = spent / N;
        }
        let cost = PollCost { clients: cost[0], metrics: cost[1] };
        println!("  operator CPU per /xds/clients poll {}, per /metrics read {}", us(cost.clients), us(cost.metrics));
        Ok(cost)
    }
}

/// The operator's CPU for one `/xds/clients` poll and one `/metrics` read.
#[derive(Clone, Copy)]
pub(crate) struct PollCost {
    pub(crate) clients: Duration,
    pub(crate) metrics: Duration,
}

pub(crate) fn us(d: Duration) -> String {
    format!("{:.0} us", d.as_secs_f64() * 1e6)
}

/// The samples of one series of spaced changes.
pub(crate) struct Series {
    pub(crate) name: &'static str,
    pub(crate) samples: Vec<Sample>,
}

impl Series {
    /// min / median / p99 / max of the ACK times.
    pub(crate) fn acks(&self) -> String {
        let mut v: Vec<Duration> = self.samples.iter().map(|s| s.ack).collect();
        v.sort();
        if v.is_empty() {
            return "n/a".into();
        }
        let p = |q: f64| ms(e2e::bench::percentile(&v, q));
        format!("{} / {} / {} / {}", ms(v[0]), p(0.5), p(0.99), ms(v[v.len() - 1]))
    }

    /// Medians of the CDS and EDS bytes.
    pub(crate) fn bytes(&self) -> (u64, u64) {
        let median = |f: fn(&Sample) -> u64| {
            let mut v: Vec<u64> = self.samples.iter().map(f).collect();
            v.sort_unstable();
            v.get(v.len() / 2).copied().unwrap_or(0)
        };
        (median(|s| s.cds_bytes), median(|s| s.eds_bytes))
    }

    /// Median operator CPU per change (of the samples where no thread ended), and of how
    /// many; with `cost`, net of the bench's reads (two of `/metrics` and one of
    /// `/xds/clients` at the mark, then its polls).
    pub(crate) fn cpu(&self, cost: Option<PollCost>) -> (Duration, usize) {
        let reads = |s: &Sample| cost.map_or(Duration::ZERO, |c| c.metrics * 2 + c.clients * (s.polls + 1));
        let mut v: Vec<Duration> = self.samples.iter().filter_map(|s| Some(s.cpu?.saturating_sub(reads(s)))).collect();
        v.sort();
        (v.get(v.len() / 2).copied().unwrap_or_default(), v.len())
    }

    /// Mean `/xds/clients` polls per change.
    pub(crate) fn polls(&self) -> f64 {
        self.samples.iter().map(|s| f64::from(s.polls)).sum::<f64>() / self.samples.len().max(1) as f64
    }

    pub(crate) fn summary(&self, cost: Option<PollCost>) -> String {
        let (cds, eds) = self.bytes();
        let ((gross, n), (net, _)) = (self.cpu(None), self.cpu(cost));
        format!(
            "{}: write's 200 -> EDS ACKed min / median / p99 / max {}; bytes pushed per change, median: CDS {cds}, \
             EDS {eds}; operator CPU per change, median {} ({} net of the bench's reads; of {n}); {:.1} polls per change",
            self.name,
            self.acks(),
            cpu_ms(gross),
            cpu_ms(net),
            self.polls()
        )
    }
}
