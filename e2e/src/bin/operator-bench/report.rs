//! The report: the tables docs/benchmarks.md quotes, the targets a run is held to and
//! their verdicts (met / MISSED), and the figures' formats.

use std::time::{Duration, Instant};

use e2e::bench::loadavg;

use crate::cold_start::{Neighbours, ROUNDS};
use crate::profile::{Profile, Settings};
use crate::run::{Audit, Run};
use crate::xds;
use consul_resolver_core::assembler::DEFAULT_ENDPOINTS_WATCH_BUDGET;

/// A ceiling on a measure: `<=` when `inclusive`, else `<`.
#[derive(Clone, Copy)]
struct Limit<T> {
    max: T,
    inclusive: bool,
}

impl<T: PartialOrd + Copy> Limit<T> {
    fn at_most(max: T) -> Limit<T> {
        Limit { max, inclusive: true }
    }

    fn below(max: T) -> Limit<T> {
        Limit { max, inclusive: false }
    }

    fn holds(&self, value: T) -> bool {
        if self.inclusive { value <= self.max } else { value < self.max }
    }

    fn text(&self, show: impl Fn(T) -> String) -> String {
        format!("{} {}", if self.inclusive { "<=" } else { "<" }, show(self.max))
    }
}

/// The targets a run is held to: its profile's. They go with the profile, not with the
/// sizes: a scale run made smaller is still held to the scale targets, which is why the
/// output names the set.
pub(crate) struct Targets {
    pub(crate) name: &'static str,
    /// Median of the cold starts.
    cold_start: Option<Limit<Duration>>,
    /// Median cold start / median bare reflector.
    overhead: Option<Limit<f64>>,
    spaced_p50: Option<Limit<Duration>>,
    spaced_p99: Option<Limit<Duration>>,
    back_to_back_p99: Option<Limit<Duration>>,
    /// A health flip of any service, fed or not, to the ConfigMap.
    flip_p99: Limit<Duration>,
    /// VmHWM at the end, in KiB.
    peak_rss_kib: Limit<u64>,
    /// Kubernetes endpoints watches running at once (the audit log).
    endpoints_watches: Option<Limit<usize>>,
    /// The operator's connections to the API server after the changes.
    api_connections: Option<Limit<usize>>,
    /// The operator's CPU per change, spaced and back to back alike.
    cpu_per_change: Option<Limit<Duration>>,
    /// Consul requests per change (of a changed service during its change, and the feed's).
    requests_per_change: Option<Limit<f64>>,
    /// Changes of each kind, for the per-change figures.
    changes: usize,
}

impl Targets {
    pub(crate) fn of(s: &Settings) -> Targets {
        let window = s.window();
        let default = Targets {
            name: "the default profile's (BENCH_PROFILE unset)",
            cold_start: None,
            overhead: Some(Limit::at_most(1.2)),
            spaced_p50: Some(Limit::at_most(Duration::from_millis(50))),
            spaced_p99: Some(Limit::at_most(Duration::from_millis(100))),
            back_to_back_p99: Some(Limit::at_most(window + Duration::from_millis(100))),
            flip_p99: Limit::at_most(window + Duration::from_millis(250)),
            peak_rss_kib: Limit::at_most(100 * 1024),
            endpoints_watches: None,
            api_connections: None,
            cpu_per_change: None,
            requests_per_change: None,
            changes: s.changes,
        };
        match s.profile {
            Profile::Default => default,
            Profile::Scale => {
                let change = Limit::below(window + Duration::from_millis(250));
                Targets {
                    name: "the scale profile's (BENCH_PROFILE=scale)",
                    cold_start: Some(Limit::below(Duration::from_secs(10))),
                    overhead: None,
                    spaced_p50: None,
                    spaced_p99: Some(change),
                    back_to_back_p99: Some(change),
                    peak_rss_kib: Limit::below(400 * 1024),
                    ..default
                }
            }
            // The scale profile twice over, held to tighter targets than the scale one
            // itself: a change's cost must not grow with the world.
            Profile::Double => {
                let change = Limit::below(window + Duration::from_millis(250));
                Targets {
                    name: "the doubled scale profile's (BENCH_PROFILE=double)",
                    overhead: Some(Limit::at_most(1.3)),
                    spaced_p50: Some(Limit::below(Duration::from_millis(200))),
                    spaced_p99: Some(change),
                    back_to_back_p99: Some(change),
                    peak_rss_kib: Limit::below(600 * 1024),
                    cpu_per_change: Some(Limit::below(Duration::from_millis(100))),
                    requests_per_change: Some(Limit::at_most(5.0)),
                    ..default
                }
            }
            // Twice the default's Mappings and 30,000 Kubernetes endpoints besides: the
            // default's change targets, twice its memory, and the API server's load within
            // the endpoints watch budget (the rest of the connections: the fixed watches and
            // pooled requests).
            Profile::Tenants => Targets {
                name: "the tenants profile's (BENCH_PROFILE=tenants)",
                peak_rss_kib: Limit::at_most(200 * 1024),
                endpoints_watches: Some(Limit::at_most(DEFAULT_ENDPOINTS_WATCH_BUDGET)),
                api_connections: Some(Limit::at_most(DEFAULT_ENDPOINTS_WATCH_BUDGET + 20)),
                ..default
            },
        }
    }

    /// Every target that applies: what it is about, the target, the run's value, met.
    fn verdicts(&self, r: &Run) -> Vec<(&'static str, String, String, bool)> {
        let mut out = Vec::new();
        let mut duration = |what, limit: Option<Limit<Duration>>, value: Duration| {
            if let Some(l) = limit {
                out.push((what, l.text(ms_or_secs), ms_or_secs(value), l.holds(value)));
            }
        };
        let c = &r.changes;
        duration("cold start (median)", self.cold_start, median(&r.starts.cold));
        duration("spaced change p50", self.spaced_p50, c.spaced.percentile(0.5));
        duration("spaced change p99", self.spaced_p99, c.spaced.percentile(0.99));
        duration("back-to-back change p99", self.back_to_back_p99, c.back_to_back.percentile(0.99));
        duration("health flip p99", Some(self.flip_p99), c.flips.percentile(0.99));
        if !c.node_flips.0.is_empty() {
            duration("node check flip p99", Some(self.flip_p99), c.node_flips.percentile(0.99));
        }
        if let Some(l) = self.overhead {
            let ratio = overhead(r);
            out.push(("cold start / bare reflector", l.text(ratio_x), ratio_x(ratio), l.holds(ratio)));
        }
        if let Some(l) = self.cpu_per_change {
            let cpu = c.cpu_spaced.max(c.cpu_back_to_back);
            out.push(("CPU per change, the larger series", l.text(cpu_ms), cpu_ms(cpu), l.holds(cpu)));
        }
        if let Some(l) = self.requests_per_change {
            let n = c.change_requests.per_change(2 * self.changes);
            let shown = |n: f64| format!("{n:.1}");
            out.push(("Consul requests per change", l.text(shown), shown(n), l.holds(n)));
        }
        let rss = r.memory_end.0;
        out.push(("peak RSS (VmHWM)", self.peak_rss_kib.text(mib), mib(rss), self.peak_rss_kib.holds(rss)));
        if let Some(l) = self.endpoints_watches {
            // Without our own API server's audit log it is not measured, and not met.
            let n = r.audit.as_ref().map(Audit::endpoints_at_once);
            let shown = n.map_or_else(|| "not measured (no audit log)".to_owned(), count);
            out.push(("endpoints watches at once", l.text(count), shown, n.is_some_and(|n| l.holds(n))));
        }
        if let Some(l) = self.api_connections {
            let n = r.api_connections;
            out.push(("connections to the API server", l.text(count), count(n), l.holds(n)));
        }
        out
    }
}

/// The targets line the run starts with: the profile's set, or none for the cost table.
pub(crate) fn targets_line(s: &Settings) {
    if s.sizes.is_empty() {
        println!("Targets: {}.", Targets::of(s).name);
    } else {
        println!("Targets: none (BENCH_SIZES: the cost table).");
    }
}

/// Median cold start / median bare reflector.
fn overhead(r: &Run) -> f64 {
    median(&r.starts.cold).as_secs_f64() / median(&r.starts.reflector).as_secs_f64()
}

pub(crate) fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

fn ms_f(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// Seconds from 10 s up (a cold-start target), else milliseconds.
fn ms_or_secs(d: Duration) -> String {
    if d >= Duration::from_secs(10) { secs(d) } else { ms(d) }
}

/// With thousands separators: 50,000.
fn count(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn ratio_x(r: f64) -> String {
    format!("{r:.2}x")
}

pub(crate) fn mib(kib: u64) -> String {
    format!("{:.0} MiB", kib as f64 / 1024.0)
}

/// CPU time, to a tenth of a millisecond (per change, it is a mean).
pub(crate) fn cpu_ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

pub(crate) fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// The middle value; of an even count, the mean of the two middle ones.
pub(crate) fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    let n = v.len();
    if n.is_multiple_of(2) { (v[n / 2 - 1] + v[n / 2]) / 2 } else { v[n / 2] }
}

/// Min / median / max of `v` (not empty), each shown by `f`.
pub(crate) fn min_med_max(v: &[Duration], f: fn(Duration) -> String) -> String {
    let mut sorted = v.to_vec();
    sorted.sort();
    format!("{} / {} / {}", f(sorted[0]), f(median(v)), f(sorted[sorted.len() - 1]))
}

/// The table of the compared runs (one column per budget), the verdicts of each against
/// the profile's targets, and gzip on the first run's snapshot.
pub(crate) fn compared(s: &Settings, runs: &[Run], load_start: &str, load_end: &str, placement: &str) {
    let targets = Targets::of(s);
    println!();
    println!(
        "{} Consul services x {} instances ({} endpoints), {} Mappings ({} per service) in {} namespaces, \
         {} Kubernetes Services routed to, a ConsulResolver per namespace reaching Consul over {}; --coalesce-window {}; \
         {} changes of each kind; load average {} at start, {} at end; placement: {placement}",
        s.services,
        s.instances,
        s.endpoints(),
        s.mappings(),
        s.per_service,
        s.namespaces,
        s.kube_services,
        s.consul_transport(),
        s.window,
        s.changes,
        load_start,
        load_end
    );
    println!("Targets: {}.", targets.name);
    println!();
    let table = Table { runs };
    table.header();
    cold_start_rows(&table, &targets);
    change_rows(&table, &targets);
    xds_rows(&table);
    cost_rows(&table, &targets, s);
    println!();
    println!("Against {} targets:", targets.name);
    for r in runs {
        let verdicts = targets
            .verdicts(r)
            .into_iter()
            .map(|(what, target, value, met)| {
                format!("{what} {value} ({target}) {}", if met { "met" } else { "MISSED" })
            })
            .collect::<Vec<_>>();
        println!("--consul-max-connections {}: {}", r.max_connections, verdicts.join(", "));
    }
    if let Some(r) = runs.first() {
        println!();
        println!("{}", gzip_levels(&r.snapshot));
    }
}

/// A markdown table with a row per measure and a column per run.
struct Table<'a> {
    runs: &'a [Run],
}

impl Table<'_> {
    fn header(&self) {
        let mut header = "| measure | target |".to_owned();
        let mut sep = "|---|---|".to_owned();
        for r in self.runs {
            header += &format!(" --consul-max-connections {} |", r.max_connections);
            sep += "---|";
        }
        println!("{header}\n{sep}");
    }

    fn row(&self, name: &str, target: &str, f: impl Fn(&Run) -> String) {
        let mut line = format!("| {name} | {target} |");
        for r in self.runs {
            line += &format!(" {} |", f(r));
        }
        println!("{line}");
    }
}

/// The targets of a row that apply, joined.
fn target(parts: &[Option<String>]) -> String {
    parts.iter().flatten().cloned().collect::<Vec<_>>().join(", ")
}

/// A percentile's target: `p99 <= 100 ms`.
fn p(name: &str, l: Limit<Duration>) -> String {
    format!("{name} {}", l.text(ms))
}

fn cold_start_rows(table: &Table<'_>, targets: &Targets) {
    let median_of = |l: Limit<Duration>| format!("median {}", l.text(ms_or_secs));
    table.row(
        &format!("cold start: spawn -> complete snapshot at GET /snapshot (min / median / max of {ROUNDS})"),
        &target(&[targets.cold_start.map(median_of)]),
        |r| min_med_max(&r.starts.cold, secs),
    );
    table.row(&format!("bare reflector on the same objects (min / median / max of {ROUNDS})"), "", |r| {
        min_med_max(&r.starts.reflector, secs)
    });
    table.row("CPU (user + system) to the end: operator to its first snapshot / bare reflector (medians)", "", |r| {
        let reflector: Vec<Duration> = r.starts.reflector_neighbours.iter().map(|n| n.bench).collect();
        format!("{} / {}", ms(median(&r.starts.cold_cpu)), ms(median(&reflector)))
    });
    table.row(
        "CPU meanwhile, kube-apiserver / etcd / this process (medians): cold start (simulator, reader); bare reflector",
        "",
        |r| {
            let (cold, reflector) = (&r.starts.cold_neighbours, &r.starts.reflector_neighbours);
            format!("{}; {}", Neighbours::median(cold), Neighbours::median(reflector))
        },
    );
    table.row("cold start / bare reflector (medians)", &target(&[targets.overhead.map(|l| l.text(ratio_x))]), |r| {
        ratio_x(overhead(r))
    });
    let or_na = |d: Option<Duration>| d.map_or("n/a".into(), ms);
    table.row("last cold start: spawn -> `starting` (client, discovery)", "", |r| or_na(r.last.starting));
    table.row("last cold start: spawn -> first / last Consul watch started (Mappings listed)", "", |r| {
        format!("{} / {}", or_na(r.last.first_consul_watch), or_na(r.last.last_consul_watch))
    });
    table.row("last cold start: spawn -> `snapshot published` (HTTP + ConfigMap + statuses)", "", |r| {
        or_na(r.last.published)
    });
    table.row("snapshot size; ConfigMap encoding", "", |r| {
        format!("{} bytes; {}", r.snapshot.len(), r.changes.encoding)
    });
}

fn change_rows(table: &Table<'_>, targets: &Targets) {
    table.row(
        "Consul change -> ConfigMap, spaced (leading edge)",
        &target(&[targets.spaced_p50.map(|l| p("p50", l)), targets.spaced_p99.map(|l| p("p99", l))]),
        |r| r.changes.spaced.summary(),
    );
    table.row(
        "Consul change -> ConfigMap, back to back (inside the window)",
        &target(&[targets.back_to_back_p99.map(|l| p("p99", l))]),
        |r| r.changes.back_to_back.summary(),
    );
    table.row(
        "Consul health flip -> ConfigMap, spaced (critical and back; fed services included)",
        &p("p99", targets.flip_p99),
        |r| {
            let c = &r.changes;
            format!("{}; Consul requests per flip {}", c.flips.summary(), c.flip_requests.summary(c.flips.0.len()))
        },
    );
    table.row(
        "Consul node check flip -> ConfigMap, spaced (critical and back; fed services included)",
        &p("p99", targets.flip_p99),
        |r| {
            let n = &r.changes.node_flips;
            if n.0.is_empty() { "not run (BENCH_NODE_FLIPS=0)".into() } else { n.summary() }
        },
    );
}

/// With `BENCH_XDS=1`: Envoy's start and memory, and each spaced series over xDS
/// (`xds.rs`): the write's 200 -> Envoy's ACK, the bytes pushed and the operator's CPU.
fn xds_rows(table: &Table<'_>) {
    let Some(first) = table.runs.iter().find(|r| r.envoy.is_some()) else { return };
    table.row(
        "xDS: Envoy (delta, --concurrency 1) spawn -> every cluster and its endpoints ACKed; -> all active (clusters)",
        "",
        |r| {
            r.envoy
                .map_or("n/a".into(), |e| format!("{}; {} ({})", secs(e.to_ack), secs(e.to_active), count(e.upstreams)))
        },
    );
    table.row("xDS: Envoy VmHWM at the end; operator VmHWM at the end (xDS on)", "", |r| {
        r.envoy.map_or("n/a".into(), |e| format!("{}; {}", mib(e.peak_kib), mib(r.memory_end.0)))
    });
    let names: Vec<&'static str> = first.changes.xds.iter().map(|x| x.name).collect();
    for name in &names {
        table.row(
            &format!("xDS: Consul write's 200 -> Envoy ACKed the EDS response, {name} (min / median / p99 / max)"),
            "",
            |r| xds_series(r, name).map_or("n/a".into(), xds::Series::acks),
        );
    }
    let joined = names.join("; ");
    table.row(&format!("xDS bytes pushed per change, median CDS / EDS: {joined}"), "", |r| {
        let each = names.iter().filter_map(|n| xds_series(r, n)).map(xds::Series::bytes);
        each.map(|(cds, eds)| format!("{} / {}", count(cds as usize), count(eds as usize)))
            .collect::<Vec<_>>()
            .join("; ")
    });
    table.row(
        &format!(
            "operator CPU per change with xDS on, median (its threads, write to the window's end, net of the bench's reads): {joined}"
        ),
        "",
        |r| {
            let each = names.iter().filter_map(|n| xds_series(r, n)).map(|x| cpu_ms(x.cpu(r.changes.poll_cost).0));
            each.collect::<Vec<_>>().join("; ")
        },
    );
}

/// The run's series over xDS named `name`.
fn xds_series<'r>(r: &'r Run, name: &str) -> Option<&'r xds::Series> {
    r.changes.xds.iter().find(|x| x.name == name)
}

/// What a run cost: Kubernetes and Consul requests, CPU, connections, memory.
fn cost_rows(table: &Table<'_>, targets: &Targets, s: &Settings) {
    table.row("Kubernetes watches opened (audit log, verb watch)", "one per key", |r| match &r.audit {
        Some(a) => format!(
            "{} for {} keys (max {} per key)",
            a.watches.values().sum::<usize>(),
            a.watches.len(),
            a.watches.values().max().unwrap_or(&0)
        ),
        None => "n/a (no audit log)".into(),
    });
    table.row("Kubernetes requests by the operator, by verb", "", |r| match &r.audit {
        Some(a) => a.verbs.iter().map(|(v, n)| format!("{v} {n}")).collect::<Vec<_>>().join(", "),
        None => "n/a".into(),
    });
    table.row("Consul blocking queries held after start", "one per key", |r| {
        let h = &r.held;
        format!(
            "{} services (max {} per service) + {} on /v1/catalog/services",
            h.services, h.max_per_service, h.catalog
        )
    });
    table.row("Consul requests sent before the first snapshot was served (services queried)", "", |r| {
        format!("{} ({})", r.bootstrap_requests, r.bootstrap_services_queried)
    });
    table.row(
        "Consul requests per change (of a changed service during its change, and the feed's); the background (the sweep)",
        "",
        |r| r.changes.change_requests.summary(2 * s.changes),
    );
    table.row("operator CPU per change (utime + stime over the series / changes): spaced; back to back", "", |r| {
        format!("{}; {}", cpu_ms(r.changes.cpu_spaced), cpu_ms(r.changes.cpu_back_to_back))
    });
    table.row("mean publication (HTTP + ConfigMap + statuses) during the changes", "", |r| {
        r.changes.publish_mean.map_or("n/a".into(), ms)
    });
    table.row("peak connections to the simulator: to the first snapshot + 2 s; whole run", "", |r| {
        format!("{}; {}", r.held.peak_sim_connections_start, r.peak_sim_connections)
    });
    table.row("operator peak RSS (VmHWM) at the end", &targets.peak_rss_kib.text(mib), |r| mib(r.memory_end.0));
    table.row("operator VmHWM / VmRSS at the first snapshot; VmRSS at the end", "", |r| {
        format!("{} / {}; {}", mib(r.memory_first.0), mib(r.memory_first.1), mib(r.memory_end.1))
    });
    table.row("warnings in the operator log; exit", "", |r| format!("{}; {}", r.last.warnings, r.exit));
}

/// The cost table (`BENCH_SIZES`) as markdown: a row per size, then gzip on each size's
/// snapshot.
pub(crate) fn cost_table(s: &Settings, rows: &[(Settings, Run)], load_start: &str) {
    println!();
    println!(
        "Cost by size: --consul-max-connections {} (the first of BENCH_MODES); {} Mappings per service over \
         {} namespaces, a ConsulResolver per namespace; --coalesce-window {}; {} changes of each kind; one operator \
         (one cold start) per size, each with fresh namespaces and simulator; load average {} at start, {} at end",
        s.modes[0],
        s.per_service,
        s.namespaces,
        s.window,
        s.changes,
        load_start,
        loadavg()
    );
    println!();
    println!(
        "| Mappings | services | endpoints | snapshot bytes | cold start | spaced p50 / p99 | \
         CPU per spaced change | CPU per back-to-back change | peak RSS (VmHWM) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (size, r) in rows {
        println!(
            "| {} | {} | {} | {} | {} | {} / {} | {} | {} | {} |",
            count(size.mappings()),
            count(size.services),
            count(size.endpoints()),
            count(r.snapshot.len()),
            secs(r.starts.cold[0]),
            ms(r.changes.spaced.percentile(0.5)),
            ms(r.changes.spaced.percentile(0.99)),
            cpu_ms(r.changes.cpu_spaced),
            cpu_ms(r.changes.cpu_back_to_back),
            mib(r.memory_end.0)
        );
    }
    println!();
    for (size, r) in rows {
        println!("{} Mappings: {}", count(size.mappings()), gzip_levels(&r.snapshot));
    }
}

/// What gzip costs on the real snapshot at the level the operator uses, at level 1 and at
/// the library's default (6): size, and min / median / max time of 20 runs in this process
/// (the operator is stopped by now, so the machine's other load is what the run records).
fn gzip_levels(json: &[u8]) -> String {
    use consul_resolver_core::assembler::gzip::LEVEL;
    use std::io::Write;
    let mut out = format!("gzip of the first snapshot ({} bytes), 20 runs each:", count(json.len()));
    let mut levels = vec![(LEVEL, format!("level {LEVEL} (the operator's)")), (6, "level 6 (the default)".to_owned())];
    if LEVEL != 1 {
        levels.insert(0, (1, "level 1".to_owned()));
    }
    for (level, what) in levels {
        let mut times = Vec::new();
        let mut size = 0;
        for _ in 0..20 {
            let started = Instant::now();
            let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(level));
            enc.write_all(json).expect("gzip into memory");
            size = enc.finish().expect("gzip into memory").len();
            times.push(started.elapsed());
        }
        out += &format!(" {what}: {} bytes in {};", count(size), min_med_max(&times, ms_f));
    }
    out
}
