//! `cargo xtask bench`: overhead benchmarks, each printed against a baseline measured in the
//! same run.

mod affinity;
mod fairness;
mod filter;
mod fleet;
mod idempotency;
mod long_prompt;

use std::time::{Duration, Instant};

use std::path::Path;

use serde_json::{Value, json};
use weir_e2e::{Sidecar, Sim};

pub use affinity::prefix_affinity;
pub use fairness::fairness_cost;
pub use filter::filter_overhead;
pub use fleet::fleet_overhead;
pub use idempotency::idempotency_claims;
pub use long_prompt::long_prompts;

const BENCH_KEY: &str = "wk-bench";

/// The bench's one tenant (`bench/w/p`, key `k`) with `limits` on its key, the `tiny` model,
/// and the top-level fields of `extra` (an object).
fn bench_config(limits: Value, extra: Value) -> Value {
    let mut config = json!({
        "orgs": [{"id": "bench", "workspaces": [{"id": "w", "projects": [{"id": "p", "keys": [
            {"id": "k", "sha256": weir_core::keys::hash_key(BENCH_KEY), "limits": limits}
        ]}]}]}],
        "models": {"tiny": {"max_context_tokens": 4096}},
    });
    if let (Some(config), Some(extra)) = (config.as_object_mut(), extra.as_object()) {
        config.extend(extra.clone());
    }
    config
}

/// A chat request for `model` of one user message, answered with one token (so the answer's
/// arrival is its first token's).
fn one_token_chat(model: &str, content: &str) -> String {
    json!({
        "model": model, "max_tokens": 1,
        "messages": [{"role": "user", "content": content}],
    })
    .to_string()
}

/// A ~2 KB chat request (~400 prompt tokens) for `tiny`, one output token.
fn chat_request() -> String {
    let content =
        "Summarise the quarterly capacity review for the inference platform team. ".repeat(27);
    one_token_chat("tiny", &content)
}

/// POSTs `body` to `url`'s chat completions with the bench key: the answer's status and the
/// time to its last byte.
async fn timed_chat(
    client: &reqwest::Client,
    url: &str,
    body: &str,
) -> anyhow::Result<(reqwest::StatusCode, Duration)> {
    let start = Instant::now();
    let resp = client
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(BENCH_KEY)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await?;
    let status = resp.status();
    resp.bytes().await?;
    Ok((status, start.elapsed()))
}

/// One row of the targets table `cargo xtask bench` ends with: a figure measured against its
/// baseline in the same run, and the target for it.
pub struct Row {
    path: String,
    baseline: &'static str,
    /// None: the machine could not run it (the note says why).
    value: Option<f64>,
    target: Target,
    unit: &'static str,
    /// What else the run measured that explains the figure (the floor under it, say).
    note: String,
}

/// A latency or memory must stay at or below its target; a ratio of throughput reach it.
#[derive(Clone, Copy)]
pub enum Target {
    AtMost(f64),
    AtLeast(f64),
}

impl Row {
    pub fn new(
        path: impl Into<String>,
        baseline: &'static str,
        value: f64,
        target: Target,
        unit: &'static str,
    ) -> Row {
        Row {
            path: path.into(),
            baseline,
            value: Some(value),
            target,
            unit,
            note: String::new(),
        }
    }

    /// A row this machine cannot measure, and why.
    pub fn not_run(
        path: impl Into<String>,
        baseline: &'static str,
        target: Target,
        unit: &'static str,
        why: impl Into<String>,
    ) -> Row {
        Row {
            value: None,
            ..Row::new(path, baseline, 0.0, target, unit).noting(why)
        }
    }

    pub fn noting(self, note: impl Into<String>) -> Row {
        Row {
            note: note.into(),
            ..self
        }
    }

    fn met(&self) -> bool {
        match (self.target, self.value) {
            (_, None) => false,
            (Target::AtMost(t), Some(v)) => v <= t,
            (Target::AtLeast(t), Some(v)) => v >= t,
        }
    }
}

/// The targets table: every row measured in this run, whether it met its target.
pub fn print_targets(rows: &[Row]) {
    if rows.is_empty() {
        return;
    }
    let width = rows
        .iter()
        .map(|r| r.path.chars().count())
        .max()
        .unwrap_or(0);
    let base = rows
        .iter()
        .map(|r| r.baseline.chars().count())
        .max()
        .unwrap_or(0);
    println!(
        "
targets (each figure against its baseline in this run)"
    );
    println!(
        "{:<width$}  {:<base$}  {:>12}  {:>12}  met",
        "path", "baseline", "measured", "target"
    );
    let figure = |v: f64, unit: &str| {
        if v.abs() >= 100.0 || v.fract() == 0.0 {
            format!("{v:.0} {unit}")
        } else {
            format!("{v:.2} {unit}")
        }
    };
    for r in rows {
        let (bound, target) = match r.target {
            Target::AtMost(t) => ("≤", t),
            Target::AtLeast(t) => ("≥", t),
        };
        println!(
            "{:<width$}  {:<base$}  {:>12}  {:>12}  {:<3}  {}",
            r.path,
            r.baseline,
            r.value.map_or("not run".to_owned(), |v| figure(v, r.unit)),
            format!("{bound} {}", figure(target, r.unit)),
            if r.met() { "yes" } else { "NO" },
            r.note
        );
    }
}

/// Criterion's estimate of a bench's mean in the run just made
/// (`target/criterion/<bench>/new/estimates.json`), in ns.
fn criterion_mean_ns(criterion: &Path, bench: &str) -> anyhow::Result<f64> {
    let path = criterion.join(bench).join("new/estimates.json");
    let estimates: Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    estimates["mean"]["point_estimate"]
        .as_f64()
        .ok_or_else(|| anyhow::anyhow!("no mean in {}", path.display()))
}

/// The scheduler's decision at 100,000 backlogged tenants, with FIFO's beside it.
pub fn scheduler_row(criterion: &Path) -> anyhow::Result<Row> {
    let mean_ns = |bench| criterion_mean_ns(criterion, bench);
    let fair = mean_ns("scheduler_decision_fair_100k_tenants")?;
    let fifo = mean_ns("scheduler_decision_fifo_100k_tenants")?;
    Ok(Row::new(
        "scheduler decision, 100,000 backlogged tenants",
        "-",
        fair / 1000.0,
        Target::AtMost(1.0),
        "µs",
    )
    .noting(format!("FIFO: {:.2} µs", fifo / 1000.0)))
}

/// p50 and p99 in microseconds.
fn percentiles(samples: &mut [Duration]) -> (f64, f64) {
    samples.sort_unstable();
    let at = |q: f64| {
        let i = ((samples.len() as f64 * q) as usize).min(samples.len().saturating_sub(1));
        samples.get(i).map_or(0.0, |d| d.as_secs_f64() * 1e6)
    };
    (at(0.50), at(0.99))
}

/// Peak resident memory of a process so far, in MB (`VmHWM`).
fn peak_rss_mb(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
            line.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// What a process has used so far: CPU seconds (user and system, from `/proc/<pid>/stat` in
/// USER_HZ ticks, 100 a second on Linux whatever the kernel's HZ) and write system calls
/// (`/proc/<pid>/io`): each write to a socket is a trip through the kernel's TCP stack.
#[derive(Clone, Copy, Default)]
struct Usage {
    cpu: f64,
    writes: f64,
}

fn usage(pid: u32) -> Usage {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name (in parentheses, and it may hold spaces).
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or_else(Vec::new, |(_, rest)| rest.split_whitespace().collect());
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap_or_default();
    let writes = io
        .lines()
        .find_map(|l| l.strip_prefix("syscw:"))
        .and_then(|n| n.trim().parse().ok());
    Usage {
        cpu: (ticks(11).unwrap_or(0.0) + ticks(12).unwrap_or(0.0)) / 100.0,
        writes: writes.unwrap_or(0.0),
    }
}

/// Runs `phase`; with what it returned, what each of `pids` used in it per token of `tokens`
/// (CPU in µs).
fn usage_per_token<T, const N: usize>(
    pids: [u32; N],
    tokens: u64,
    phase: impl FnOnce() -> anyhow::Result<T>,
) -> anyhow::Result<(T, [Usage; N])> {
    let before = pids.map(usage);
    let out = phase()?;
    let mut used = pids.map(usage);
    for (after, before) in used.iter_mut().zip(before) {
        *after = Usage {
            cpu: (after.cpu - before.cpu) * 1e6 / tokens as f64,
            writes: (after.writes - before.writes) / tokens as f64,
        };
    }
    Ok((out, used))
}

/// The median over rounds of what one process used per token: "2.60 µs, 0.10 writes".
fn usage_median(rounds: &[Usage]) -> String {
    let mut cpu: Vec<f64> = rounds.iter().map(|u| u.cpu).collect();
    let mut writes: Vec<f64> = rounds.iter().map(|u| u.writes).collect();
    format!(
        "{:.2} µs, {:.2} writes",
        median(&mut cpu),
        median(&mut writes)
    )
}

const RELAY_TOKENS: u64 = 100;
/// Rounds per stream count, each a direct run then a relayed one: the spread between runs on
/// a shared 2-core machine is wider than most changes to the relay.
const RELAY_ROUNDS: usize = 3;

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// What rounds of a baseline and a measurement, taken in turn, came to: each side's median,
/// the median of the rounds' ratios (measured over baseline) and their range.
struct Rounds {
    baseline: f64,
    measured: f64,
    ratio: f64,
    low: f64,
    high: f64,
}

/// Runs `round` (the baseline's figure and the measured one) `rounds` times.
fn alternate(
    rounds: usize,
    mut round: impl FnMut() -> anyhow::Result<(f64, f64)>,
) -> anyhow::Result<Rounds> {
    let (mut baseline, mut measured, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let (b, m) = round()?;
        baseline.push(b);
        measured.push(m);
        ratios.push(m / b);
    }
    Ok(Rounds {
        low: ratios.iter().copied().fold(f64::INFINITY, f64::min),
        high: ratios.iter().copied().fold(0.0, f64::max),
        baseline: median(&mut baseline),
        measured: median(&mut measured),
        ratio: median(&mut ratios),
    })
}

/// Adds the trusted headers the filter would set, signed with the harness's secret (the
/// sidecar started by the harness verifies with it).
fn signed(
    req: reqwest::RequestBuilder,
    n: usize,
    i: usize,
    start: Instant,
) -> reqwest::RequestBuilder {
    let tenant = format!("bench/w/p/t{}", i % 100);
    let request_id = format!("relay-{n}-{i}-{}", start.elapsed().as_nanos());
    weir_e2e::vouched(&tenant, &request_id, &[])
        .into_iter()
        .fold(req, |req, (k, v)| req.header(k, v))
}

/// How a caller's streams reach a server.
#[derive(Clone, Copy, PartialEq)]
enum Hop {
    /// A connection a stream, as to an engine.
    Http1,
    /// Up to `STREAMS_PER_CONNECTION` streams a connection (HTTP/2 without TLS), as Envoy's
    /// pool to the sidecar can: it opens another connection when one is at the server's limit.
    Http2,
}

const STREAMS_PER_CONNECTION: usize = 100;

/// `n` concurrent streams of `RELAY_TOKENS` tokens; returns tokens received per second.
async fn streams(url: &str, n: usize, trusted: bool, hop: Hop) -> anyhow::Result<f64> {
    let clients = match hop {
        Hop::Http1 => vec![
            reqwest::Client::builder()
                .pool_max_idle_per_host(n)
                .build()?,
        ],
        Hop::Http2 => (0..n.div_ceil(STREAMS_PER_CONNECTION))
            .map(|_| reqwest::Client::builder().http2_prior_knowledge().build())
            .collect::<Result<_, _>>()?,
    };
    let start = Instant::now();
    let one = |i: usize| {
        let client = clients[i % clients.len()].clone();
        async move {
            let mut req = client
                .post(format!("{url}/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(
                    json!({"model": "glm-5.2", "stream": true, "max_tokens": RELAY_TOKENS, "ignore_eos": true,
                        "messages": [{"role": "user", "content": format!("stream {i}")}]})
                    .to_string(),
                );
            if trusted {
                req = signed(req, n, i, start);
            }
            let mut resp = req.send().await?;
            let status = resp.status();
            if !status.is_success() {
                anyhow::bail!("status {status}: {}", resp.text().await.unwrap_or_default());
            }
            let mut tokens = 0u64;
            while let Some(chunk) = resp.chunk().await? {
                let text = String::from_utf8_lossy(&chunk);
                tokens += (text.matches("\"content\":\"").count()
                    - text.matches("\"content\":\"\"").count()) as u64;
            }
            Ok::<_, anyhow::Error>(tokens)
        }
    };
    let counts = futures::future::try_join_all((0..n).map(one)).await?;
    Ok(counts.iter().sum::<u64>() as f64 / start.elapsed().as_secs_f64())
}

/// The sidecar relaying 1,000, 5,000 and 10,000 concurrent streams (those the open-files limit
/// allows) vs the same streams straight from the engine, with the sidecar's peak RSS. Returns
/// the targets' rows.
pub fn relay_throughput(sim_bin: &Path, sidecar_bin: &Path) -> anyhow::Result<Vec<Row>> {
    let engine_args = [
        "--preset",
        "glm-5.2",
        "--time-scale",
        "1000",
        "--max-num-seqs",
        "8192",
    ];
    let direct_sim = Sim::start_from(sim_bin, &engine_args);
    let relayed_sim = Sim::start_from(sim_bin, &engine_args);
    let sidecar = Sidecar::start_from(
        sidecar_bin,
        json!({
            "policy": "fair",
            "queue": {"max_per_tenant": 10000, "max_per_org": 20000, "max_total": 20000, "deadline_ms": 600000},
            // vLLM's metrics do not say `--max-num-seqs`: the config does.
            "pools": [{"model": "glm-5.2", "replicas": [relayed_sim.url],
                "max_concurrency_per_replica": 8192}],
        }),
    );
    std::thread::sleep(Duration::from_millis(500));
    let runtime = tokio::runtime::Runtime::new()?;
    println!(
        "\nsidecar relay: concurrent streams of {RELAY_TOKENS} tokens (glm-5.2 preset, time-scaled),"
    );
    println!("through the sidecar vs straight from an identical engine, same run");
    println!(
        "{RELAY_ROUNDS} rounds alternating direct and relayed; tok/s the median, ratio the median of the rounds' ratios [their range]"
    );
    println!(
        "the callers' streams reach the engine over HTTP/1.1 (a connection each), the sidecar over HTTP/2 ({STREAMS_PER_CONNECTION} a connection,"
    );
    println!(
        "as the shipped gateway configs speak to it) and, where the open-files limit allows, over HTTP/1.1 too"
    );
    println!(
        "{:>8} {:>8} {:>14} {:>14} {:>7} {:>15} {:>16}",
        "streams", "to it", "direct tok/s", "relayed tok/s", "ratio", "range", "sidecar peak RSS"
    );
    let limit = open_files_limit().unwrap_or(u64::MAX);
    let mut rows = Vec::new();
    for n in [1_000usize, 5_000, 10_000] {
        let path = format!("sidecar relay, {n} streams, tokens/s");
        // The sockets the sidecar holds: a replica's for each stream, and a caller's for each
        // stream over HTTP/1.1 or for each connection over HTTP/2.
        let needed = |hop| match hop {
            Hop::Http1 => 2 * n as u64 + 64,
            Hop::Http2 => (n + n.div_ceil(STREAMS_PER_CONNECTION)) as u64 + 64,
        };
        let needed_over_http2 = needed(Hop::Http2);
        if needed_over_http2 > limit {
            println!(
                "{n:>8} not run: a process may hold {limit} files here, the sidecar needs {needed_over_http2}"
            );
            rows.push(Row::not_run(
                path,
                "streams straight from an engine",
                Target::AtLeast(0.8),
                "×",
                format!("open files: {limit} allowed (hard limit), {needed_over_http2} needed"),
            ));
            continue;
        }
        let hops = [Hop::Http1, Hop::Http2]
            .into_iter()
            .filter(|&hop| needed(hop) <= limit);
        for hop in hops {
            let ratio = relay_rounds(&runtime, n, hop, &direct_sim, &relayed_sim, &sidecar)?;
            // The target is the sidecar as the shipped configs reach it.
            if hop == Hop::Http2 {
                rows.push(Row::new(
                    path.clone(),
                    "streams straight from an engine",
                    ratio,
                    Target::AtLeast(0.8),
                    "×",
                ));
            }
        }
        if n == 10_000 {
            rows.push(Row::new(
                "sidecar relay, 10000 streams, peak RSS",
                "-",
                peak_rss_mb(sidecar.pid()),
                Target::AtMost(1024.0),
                "MB",
            ));
        }
    }
    Ok(rows)
}

/// `RELAY_ROUNDS` rounds of `n` streams straight from one engine and through the sidecar (to
/// an identical engine) over `hop`; prints them and returns the median ratio.
fn relay_rounds(
    runtime: &tokio::runtime::Runtime,
    n: usize,
    hop: Hop,
    direct_sim: &Sim,
    relayed_sim: &Sim,
    sidecar: &Sidecar,
) -> anyhow::Result<f64> {
    let tokens = n as u64 * RELAY_TOKENS;
    let me = std::process::id();
    // What the engine, the sidecar and the client (this process) used per token.
    let (mut engine, mut sidecar_used, mut client) = ([vec![], vec![]], vec![], [vec![], vec![]]);
    let r = alternate(RELAY_ROUNDS, || {
        let (direct, [e, c]) = usage_per_token([direct_sim.pid(), me], tokens, || {
            runtime.block_on(streams(&direct_sim.url, n, false, Hop::Http1))
        })?;
        engine[0].push(e);
        client[0].push(c);
        let (relayed, [e, s, c]) =
            usage_per_token([relayed_sim.pid(), sidecar.pid(), me], tokens, || {
                runtime.block_on(streams(&sidecar.url, n, true, hop))
            })?;
        engine[1].push(e);
        sidecar_used.push(s);
        client[1].push(c);
        Ok((direct, relayed))
    })?;
    let protocol = match hop {
        Hop::Http1 => "HTTP/1.1",
        Hop::Http2 => "HTTP/2",
    };
    println!(
        "{n:>8} {protocol:>8} {:>14.0} {:>14.0} {:>6.2}x {:>15} {:>13.0} MB",
        r.baseline,
        r.measured,
        r.ratio,
        format!("[{:.2}–{:.2}]", r.low, r.high),
        peak_rss_mb(sidecar.pid())
    );
    println!(
        "{:>17} a token (CPU, write calls): direct: engine {}, client {}",
        "",
        usage_median(&engine[0]),
        usage_median(&client[0])
    );
    println!(
        "{:>17}   relayed: engine {}, sidecar {}, client {}",
        "",
        usage_median(&engine[1]),
        usage_median(&sidecar_used),
        usage_median(&client[1])
    );
    Ok(r.ratio)
}

/// The hard limit on open files a process here may raise itself to.
fn open_files_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(4)?.parse().ok()
}
