//! The filter's cost: Envoy with vs without it in front of the same simulator (added latency,
//! requests/s), where that time goes (the stage-profile build: each callback's time in weir
//! code and its host calls), and long prompts (added time to first token at 220 KB, the
//! longest callback at 1 MB).

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;
use weir_core::endpoint::Endpoint;
use weir_core::estimate::{self, Counting};
use weir_core::request::InferenceRequest;
use weir_core::tokens::Encoding;
use weir_e2e::{Envoy, EnvoyOptions, Sim};

use super::{Row, Target, bench_config, chat_request, percentiles, timed_chat};

/// Requests per side per round, rounds alternating between the Envoys.
const LATENCY_ROUNDS: usize = 5;
const LATENCY_REQUESTS: usize = 300;
const THROUGHPUT_CONCURRENCY: usize = 16;
const THROUGHPUT_WINDOW: Duration = Duration::from_secs(3);
/// Requests the stage profile averages over, after as many to warm up.
const PROFILED_REQUESTS: u64 = 500;
/// The stages the profile build reports, in request order, each a callback or (indented) a
/// part of the callback above it.
const STAGES: [(&str, bool); 11] = [
    ("request_headers", false),
    ("shape", true),
    ("route", true),
    ("authenticate", true),
    ("reserve", true),
    ("sign", true),
    ("request_body", false),
    ("admission", true),
    ("response_headers", false),
    ("response_body", false),
    ("log", false),
];

/// A launched Envoy in front of `upstream_port`: `wasm` the filter build (none: no filter).
pub(super) fn envoy(config: &serde_json::Value, upstream_port: u16, wasm: Option<&Path>) -> Envoy {
    let opts = EnvoyOptions {
        weir_config: config,
        upstream_port,
        alt_port: upstream_port,
        listen_port: 0,
        with_filter: wasm.is_some(),
    };
    match wasm {
        Some(wasm) => Envoy::launch_with(opts, wasm, |template| template),
        None => Envoy::launch(opts),
    }
}

/// The exact token count of `body`'s prompt (a chat request for `tiny`).
fn exact_prompt_tokens(body: &str) -> anyhow::Result<u64> {
    let req = InferenceRequest::parse(Endpoint::ChatCompletions, body.as_bytes())
        .map_err(|e| anyhow::anyhow!("{}", e.message))?;
    Ok(estimate::prompt_tokens(&req, Encoding::Cl100kBase, usize::MAX, Counting::Exact).tokens)
}

/// Where a request's time in weir code goes, per request: stage → (µs, host calls).
type Profile = HashMap<&'static str, (f64, f64)>;

pub(super) async fn profile_stats(envoy: &Envoy) -> HashMap<String, u64> {
    envoy
        .stats()
        .await
        .into_iter()
        .filter(|(name, _)| name.starts_with("weir.profile."))
        .collect()
}

/// `requests` sequential requests of `body` through a stage-profile Envoy after a warm-up:
/// each stage's time and host calls per request.
async fn profile(
    client: &reqwest::Client,
    envoy: &Envoy,
    body: &str,
    requests: u64,
) -> anyhow::Result<Profile> {
    for _ in 0..requests {
        timed_chat(client, &envoy.url, body).await?;
    }
    let before = profile_stats(envoy).await;
    for _ in 0..requests {
        let (status, _) = timed_chat(client, &envoy.url, body).await?;
        anyhow::ensure!(status.is_success(), "status {status}");
    }
    // Counters are reported in each request's last callback, after its answer went out.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after = profile_stats(envoy).await;
    let per_request = |stage: &str, what: &str| {
        let name = format!("weir.profile.{stage}.{what}");
        let delta =
            after.get(&name).copied().unwrap_or(0) - before.get(&name).copied().unwrap_or(0);
        delta as f64 / requests as f64
    };
    Ok(STAGES
        .into_iter()
        .map(|(stage, _)| {
            (
                stage,
                (
                    per_request(stage, "ns") / 1000.0,
                    per_request(stage, "calls"),
                ),
            )
        })
        .collect())
}

/// Time and host calls per request in weir code, over every stage (admission is within the
/// body's).
fn total(profile: &Profile) -> (f64, f64) {
    STAGES
        .iter()
        .filter(|(_, part)| !part)
        .filter_map(|(stage, _)| profile.get(stage))
        .fold((0.0, 0.0), |(us, calls), (u, c)| (us + u, calls + c))
}

/// Envoy with vs without the weir filter in front of the same simulator, on a ~2 KB chat
/// request: added latency (sequential requests), requests/s (16 in flight), and the stage
/// profile of both estimator settings. Returns the targets' rows.
pub fn filter_overhead(
    sim_bin: &Path,
    profile_wasm: &Path,
    noop_wasm: &Path,
) -> anyhow::Result<Vec<Row>> {
    let sim = Sim::start_from(sim_bin, &["--preset", "tiny", "--time-scale", "1000"]);
    let body = chat_request();
    // The filter counts a prompt exactly only where the count decides: with the model's
    // context window a few tokens above the prompt, the estimate comes too near it.
    let window = exact_prompt_tokens(&body)? + 8;
    let settings = [
        ("default", json!({})),
        (
            "exact count",
            json!({"models": {"tiny": {"max_context_tokens": window}}}),
        ),
    ];
    let config = |extra: &serde_json::Value| bench_config(json!({}), extra.clone());
    let filter = weir_e2e::filter_wasm();
    let without = envoy(&config(&json!({})), sim.port, None);
    let with: Vec<Envoy> = settings
        .iter()
        .map(|(_, extra)| envoy(&config(extra), sim.port, Some(&filter)))
        .collect();
    let profiled: Vec<Envoy> = settings
        .iter()
        .map(|(_, extra)| envoy(&config(extra), sim.port, Some(profile_wasm)))
        .collect();
    let noop = envoy(&config(&json!({})), sim.port, Some(noop_wasm));
    let mut sides = vec![
        ("without filter", &without.url),
        ("no-op filter", &noop.url),
    ];
    sides.extend(
        settings
            .iter()
            .zip(&with)
            .map(|((name, _), e)| (*name, &e.url)),
    );

    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let client = reqwest::Client::new();
        let send = |url: String| {
            let (client, body) = (client.clone(), body.clone());
            async move {
                let (status, took) = timed_chat(&client, &url, &body).await?;
                anyhow::ensure!(status.is_success(), "status {status}");
                Ok::<_, anyhow::Error>(took)
            }
        };
        for (_, url) in &sides {
            for _ in 0..200 {
                send(url.to_string()).await?;
            }
        }
        let mut latencies = vec![Vec::new(); sides.len()];
        for _ in 0..LATENCY_ROUNDS {
            for ((_, url), out) in sides.iter().zip(latencies.iter_mut()) {
                for _ in 0..LATENCY_REQUESTS {
                    out.push(send(url.to_string()).await?);
                }
            }
        }
        let mut rates = Vec::new();
        for (_, url) in &sides {
            let deadline = Instant::now() + THROUGHPUT_WINDOW;
            let workers = (0..THROUGHPUT_CONCURRENCY).map(|_| {
                let send = &send;
                async move {
                    let mut done = 0u64;
                    while Instant::now() < deadline {
                        send(url.to_string()).await?;
                        done += 1;
                    }
                    Ok::<_, anyhow::Error>(done)
                }
            });
            let counts = futures::future::try_join_all(workers).await?;
            rates.push(counts.iter().sum::<u64>() as f64 / THROUGHPUT_WINDOW.as_secs_f64());
        }
        let mut profiles = Vec::new();
        for envoy in &profiled {
            profiles.push(profile(&client, envoy, &body, PROFILED_REQUESTS).await?);
        }

        println!(
            "\nfilter overhead: ~2 KB chat request (~400 prompt tokens), Envoy --concurrency 2, one simulator"
        );
        println!(
            "upstream, same run; latency over {} sequential requests per side, added vs the baseline;",
            LATENCY_ROUNDS * LATENCY_REQUESTS
        );
        println!(
            "default: counted by the estimate; exact count: the model's context window at {window} tokens, 8 above"
        );
        println!(
            "the prompt, so the estimate comes near it and the filter counts exactly (its rule); host calls per"
        );
        println!("request from the stage-profile build");
        let rate_header = format!("req/s ({THROUGHPUT_CONCURRENCY} conc)");
        println!(
            "{:<16} {:>8} {:>8} {:>9} {:>9} {rate_header:>16} {:>7} {:>11}",
            "", "p50 µs", "p99 µs", "+p50 µs", "+p99 µs", "ratio", "host calls"
        );
        let (base50, base99) = percentiles(&mut latencies[0]);
        let mut added = Vec::new();
        for (i, (((name, _), lat), rate)) in
            sides.iter().zip(latencies.iter_mut()).zip(&rates).enumerate()
        {
            let (p50, p99) = percentiles(lat);
            let calls = i
                .checked_sub(2)
                .and_then(|i| profiles.get(i))
                .map_or(String::from("-"), |p| format!("{:.0}", total(p).1));
            println!(
                "{name:<16} {p50:>8.0} {p99:>8.0} {:>+9.0} {:>+9.0} {rate:>16.0} {:>6.2}x {calls:>11}",
                p50 - base50,
                p99 - base99,
                rate / rates[0]
            );
            added.push((p50 - base50, p99 - base99, rate / rates[0]));
        }
        println!("\nwhere the filter's time goes (stage-profile build, {PROFILED_REQUESTS} sequential requests):");
        println!("µs in weir code per request (the rest of the added latency is Envoy and the sandbox's crossings)");
        print!("{:<22}", "stage");
        for (name, _) in &settings {
            print!(" {:>14} {:>7}", format!("{name} µs"), "calls");
        }
        println!();
        for (stage, part) in STAGES {
            let label = if part {
                format!("  {stage}")
            } else {
                stage.to_owned()
            };
            print!("{label:<22}");
            for p in &profiles {
                let (us, calls) = p.get(stage).copied().unwrap_or_default();
                print!(" {us:>14.1} {calls:>7.1}");
            }
            println!();
        }
        print!("{:<22}", "total");
        for p in &profiles {
            let (us, calls) = total(p);
            print!(" {us:>14.1} {calls:>7.1}");
        }
        println!();

        let (noop, default, exact) = (added[1], added[2], added[3]);
        const BASELINE: &str = "Envoy without the filter";
        Ok(vec![
            Row::new("filter, 2 KB chat, +p50", BASELINE, default.0, Target::AtMost(30.0), "µs")
                .noting(format!("a no-op filter: {:+.0} µs", noop.0)),
            Row::new("filter, 2 KB chat, +p99", BASELINE, default.1, Target::AtMost(100.0), "µs")
                .noting(format!("a no-op filter: {:+.0} µs", noop.1)),
            Row::new("filter, 2 KB chat, req/s", BASELINE, default.2, Target::AtLeast(0.9), "×")
                .noting(format!("a no-op filter: {:.2}×", noop.2)),
            Row::new(
                "filter, exact count of a 2 KB prompt, +p50",
                BASELINE,
                exact.0, Target::AtMost(60.0),
                "µs")
            .noting("the target's other arm: counted exactly only where the count decides (filter/README.md, admission)"),
        ])
    })
}
