//! Long prompts through the filter: the time to first token a 220 KB prompt gains at 20 in
//! flight (Envoy with vs without the filter, the same simulated engine with a 1M-token
//! context), and how long one 1 MB prompt keeps an Envoy worker in weir code (the
//! stage-profile build).

use std::time::Duration;

use serde_json::json;
use weir_e2e::{Envoy, Sim};

use super::filter::{envoy, profile_stats};
use super::{Row, Target, bench_config, one_token_chat, percentiles, timed_chat};

/// Concurrent callers, and the requests each sends per side per round.
const IN_FLIGHT: usize = 20;
const PER_CALLER: usize = 5;
const ROUNDS: usize = 3;
const MODEL: &str = "glm-5.2";

/// A one-token chat request of about `bytes` of English prose for [`MODEL`].
fn long_request(bytes: usize) -> String {
    let sentence = "The capacity review found that prefill dominates the cost of long prompts. ";
    one_token_chat(MODEL, &sentence.repeat(bytes / sentence.len() + 1))
}

/// `IN_FLIGHT` callers sending `body` in turn to `url`, `PER_CALLER` each: every latency.
async fn in_flight(
    client: &reqwest::Client,
    url: &str,
    body: &str,
) -> anyhow::Result<Vec<Duration>> {
    let callers = (0..IN_FLIGHT).map(|_| async move {
        let mut took = Vec::new();
        for _ in 0..PER_CALLER {
            let (status, t) = timed_chat(client, url, body).await?;
            anyhow::ensure!(status.is_success(), "status {status}");
            took.push(t);
        }
        Ok::<_, anyhow::Error>(took)
    });
    Ok(futures::future::try_join_all(callers)
        .await?
        .into_iter()
        .flatten()
        .collect())
}

/// Milliseconds one request of `body` spent in weir code, by the stage profile: its
/// admission (one callback) and all of its body callbacks together (which bound the longest).
async fn weir_ms(
    client: &reqwest::Client,
    envoy: &Envoy,
    body: &str,
) -> anyhow::Result<(f64, f64)> {
    let before = profile_stats(envoy).await;
    let (status, _) = timed_chat(client, &envoy.url, body).await?;
    anyhow::ensure!(status.is_success(), "status {status}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let after = profile_stats(envoy).await;
    let ms = |name: &str| {
        let name = format!("weir.profile.{name}.ns");
        (after.get(&name).copied().unwrap_or(0) - before.get(&name).copied().unwrap_or(0)) as f64
            / 1e6
    };
    Ok((ms("admission"), ms("request_body")))
}

pub fn long_prompts(
    sim_bin: &std::path::Path,
    profile_wasm: &std::path::Path,
) -> anyhow::Result<Vec<Row>> {
    let sim = Sim::start_from(
        sim_bin,
        &[
            "--preset",
            MODEL,
            "--time-scale",
            "1000",
            "--max-num-seqs",
            "64",
        ],
    );
    let config = bench_config(
        json!({}),
        json!({"models": {MODEL: {"max_context_tokens": 1_048_576}}}),
    );
    let without = envoy(&config, sim.port, None);
    let with = envoy(&config, sim.port, Some(&weir_e2e::filter_wasm()));
    let profiled = envoy(&config, sim.port, Some(profile_wasm));
    let (medium, large) = (long_request(220 * 1024), long_request(1024 * 1024));

    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let client = reqwest::Client::new();
        for url in [&without.url, &with.url] {
            in_flight(&client, url, &medium).await?;
        }
        let (mut base, mut filtered) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            base.extend(in_flight(&client, &without.url, &medium).await?);
            filtered.extend(in_flight(&client, &with.url, &medium).await?);
        }
        let (base50, _) = percentiles(&mut base);
        let (with50, _) = percentiles(&mut filtered);
        let max_us = |v: &[Duration]| v.last().map_or(0.0, |d| d.as_secs_f64() * 1e6);
        let added50 = (with50 - base50) / 1000.0;
        let added_max = (max_us(&filtered) - max_us(&base)) / 1000.0;

        let mut longest = (0.0f64, 0.0f64);
        for _ in 0..3 {
            weir_ms(&client, &profiled, &large).await?;
        }
        for _ in 0..10 {
            let (admission, body) = weir_ms(&client, &profiled, &large).await?;
            longest = (longest.0.max(admission), longest.1.max(body));
        }

        println!(
            "\nlong prompts: a ~220 KB prompt ({MODEL} preset, time-scaled), {IN_FLIGHT} in flight, {} requests per side",
            ROUNDS * IN_FLIGHT * PER_CALLER
        );
        println!("{:<16} {:>14} {:>14}", "", "TTFT p50 ms", "TTFT max ms");
        println!(
            "{:<16} {:>14.2} {:>14.2}",
            "without filter",
            base50 / 1000.0,
            max_us(&base) / 1000.0
        );
        println!(
            "{:<16} {:>14.2} {:>14.2}",
            "with filter",
            with50 / 1000.0,
            max_us(&filtered) / 1000.0
        );
        println!(
            "a ~1 MB prompt, one at a time (stage-profile build): admission {:.2} ms, all of its body callbacks {:.2} ms (the most of 10)",
            longest.0, longest.1
        );
        const BASELINE: &str = "Envoy without the filter";
        Ok(vec![
            Row::new(
                "filter, 220 KB prompt at 20 in flight, +TTFT p50",
                BASELINE,
                added50, Target::AtMost(3.0),
                "ms"),
            Row::new(
                "filter, 220 KB prompt at 20 in flight, +TTFT max",
                BASELINE,
                added_max, Target::AtMost(10.0),
                "ms"),
            Row::new(
                "filter, 1 MB prompt, longest callback in weir code",
                "-",
                longest.0, Target::AtMost(2.0),
                "ms")
            .noting(format!("all body callbacks together: {:.2} ms", longest.1)),
        ])
    })
}
