//! The adaptive concurrency limit finds the knee, not the floor: on real llama.cpp
//! `llama-server` replicas (2 × 4 slots of 2,048 tokens, the tiny random-weight model, one CPU
//! thread each: CPU-bound, their per-token time rising with the batch and a request's time to
//! first byte with it), a flood of long streamed generations through real Envoy and a sidecar
//! with the adaptive limit gets at least 0.9× the output tokens/s of the same flood through a
//! sidecar whose limit is fixed at the engines' slots (`adaptive_concurrency: false`, on
//! Envoy's `/alt/` route), measured side by side on the same engines.
//!
//! llama.cpp reports its own queue (`llamacpp:requests_deferred`) and slots (`/props`), so the
//! adaptive limit is the slots unless the engine queues; before, the TTFB rule read the batch's
//! cost as a queue and cut (to 6–7 of the 8 slots here, on a 2-core machine; to 1 and 3 of 4
//! where it was first seen).
//!
//! Eight short phases alternate adaptive, fixed, fixed, adaptive (twice), each on idle engines,
//! and each side is judged by its median phase: a machine that slows or speeds up during the
//! run weighs on both alike, and a phase that met a burst of someone else's work on the machine
//! does not decide. Run with `--nocapture` for the figures.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;
use weir_e2e::llama::{LlamaServer, MODEL};
use weir_e2e::{Envoy, Sidecar, api_key, chat_body, metric_sum, post_json};

const SLOTS: u32 = 4;
const CONTEXT: u32 = 2048;
/// Streams kept in flight: three times the pool's 8 slots.
const FLOOD: usize = 24;
/// Forty times over (about 500 prompt tokens): a prefill long enough that its time, and how it
/// grows with the batch, is above the limiter's 10 ms floor.
const PROMPT: &str = "tell me a story about a river, a mill and the water over the weir. ";
/// Output tokens of each stream (`ignore_eos`): long generations.
const MAX_TOKENS: u32 = 400;
/// Flooding before the measurement starts: the adaptive limit settles meanwhile.
const WARM_UP: Duration = Duration::from_secs(2);
const MEASURED: Duration = Duration::from_secs(6);
const ADAPTIVE: &str = "/v1/chat/completions";
const FIXED: &str = "/alt/v1/chat/completions";

/// What one phase measured.
struct Phase {
    /// Output tokens the clients received while measuring.
    tokens: u64,
    /// Streams that ended, and refusals (429/503: the client waits 100 ms and asks again).
    streams: u64,
    refused: u64,
    /// The sidecar's effective limits over both replicas while measuring, polled every 100 ms.
    limits: Vec<f64>,
}

impl Phase {
    fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / MEASURED.as_secs_f64()
    }

    fn mean_limit(&self) -> f64 {
        self.limits.iter().sum::<f64>() / self.limits.len().max(1) as f64
    }

    fn least_limit(&self) -> f64 {
        self.limits.iter().copied().fold(f64::INFINITY, f64::min)
    }
}

/// Content tokens in the complete server-sent events of `text` (llama.cpp streams one token
/// an event), and what is left of it after the last complete event.
fn count_tokens(text: &str) -> (u64, &str) {
    let end = text.rfind("\n\n").map_or(0, |i| i + 2);
    let tokens = text[..end]
        .split("\n\n")
        .filter(|e| e.contains("\"content\":\""))
        .count();
    (tokens as u64, &text[end..])
}

/// One client of the flood: streams, back to back, until `measured` ends (its last stream is
/// then dropped, which cancels it on the engine); tokens that arrive within `measured` count.
async fn client(url: String, n: usize, measured: (Instant, Instant)) -> (u64, u64, u64) {
    let (mut tokens, mut streams, mut refused) = (0, 0, 0);
    let mut i = 0;
    while Instant::now() < measured.1 {
        let body = chat_body(
            MODEL,
            &format!("flood {n}.{i}: {}", PROMPT.repeat(40)),
            json!({"stream": true, "max_tokens": MAX_TOKENS, "ignore_eos": true}),
        );
        i += 1;
        let mut resp = post_json(&url, Some("flood"), body.to_string(), &[]).await;
        match resp.status() {
            StatusCode::OK => {}
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => {
                refused += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            status => panic!("{status}: {}", resp.text().await.unwrap()),
        }
        let mut pending = String::new();
        loop {
            let chunk = tokio::select! {
                chunk = resp.chunk() => chunk,
                () = tokio::time::sleep_until(measured.1.into()) => return (tokens, streams, refused),
            };
            let Ok(Some(chunk)) = chunk else { break };
            pending.push_str(&String::from_utf8_lossy(&chunk));
            let (n, rest) = count_tokens(&pending);
            if Instant::now() >= measured.0 {
                tokens += n;
            }
            pending = rest.to_owned();
        }
        streams += 1;
    }
    (tokens, streams, refused)
}

/// The sidecar's effective limits (`weir_replica_concurrency_limit`), summed over replicas.
async fn limits(sidecar: &Sidecar) -> f64 {
    metric_sum(&sidecar.metrics().await, "weir_replica_concurrency_limit").unwrap_or(0.0)
}

/// A flood through Envoy on `path` (to `sidecar`): `FLOOD` clients for the warm-up and the
/// measurement.
async fn phase(envoy: &Envoy, path: &str, sidecar: &Sidecar) -> Phase {
    let start = Instant::now();
    let measured = (start + WARM_UP, start + WARM_UP + MEASURED);
    let url = format!("{}{path}", envoy.url);
    let clients = (0..FLOOD).map(|n| client(url.clone(), n, measured));
    let watch = async {
        tokio::time::sleep_until(measured.0.into()).await;
        let mut seen = Vec::new();
        while Instant::now() < measured.1 {
            seen.push(limits(sidecar).await);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        seen
    };
    let (counts, limits) = tokio::join!(futures::future::join_all(clients), watch);
    Phase {
        tokens: counts.iter().map(|c| c.0).sum(),
        streams: counts.iter().map(|c| c.1).sum(),
        refused: counts.iter().map(|c| c.2).sum(),
        limits,
    }
}

/// Waits (up to ten seconds per engine) until no slot of any engine is busy.
async fn idle(engines: &[LlamaServer]) {
    for engine in engines {
        for _ in 0..200 {
            if engine.busy_slots().await == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_adaptive_limit_serves_a_flood_as_well_as_a_limit_fixed_at_the_slots() {
    let engines = [
        LlamaServer::start(SLOTS, CONTEXT),
        LlamaServer::start(SLOTS, CONTEXT),
    ];
    let sidecar = |adaptive: bool| {
        Sidecar::start(json!({
            "queue": {"max_per_tenant": 64},
            "pools": [{"model": MODEL, "replicas": [engines[0].url, engines[1].url],
                       "adaptive_concurrency": adaptive}],
        }))
    };
    let (adaptive, fixed) = (sidecar(true), sidecar(false));
    let weir_config = json!({
        "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "llama", "keys": [api_key("flood")]}]}]}],
        "models": {MODEL: {"max_context_tokens": CONTEXT}},
    });
    let envoy = Envoy::start(&weir_config, adaptive.port, fixed.port);
    adaptive.wait_for_probes(2);
    fixed.wait_for_probes(2);
    let slots = f64::from(2 * SLOTS);
    assert_eq!(
        limits(&fixed).await,
        slots,
        "the engines' slots, from /props"
    );

    let mut runs: Vec<(&str, Phase)> = Vec::new();
    let abba = [
        ("adaptive", ADAPTIVE, &adaptive),
        ("fixed", FIXED, &fixed),
        ("fixed", FIXED, &fixed),
        ("adaptive", ADAPTIVE, &adaptive),
    ];
    for (name, path, sidecar) in [abba, abba].concat() {
        idle(&engines).await;
        let run = phase(&envoy, path, sidecar).await;
        println!(
            "{name}: {:.0} output tokens/s ({} tokens in {MEASURED:?}), {} streams ended, {} \
             refused; effective limit over both replicas while measuring: mean {:.2}, least {} \
             (of {slots} slots)",
            run.tokens_per_s(),
            run.tokens,
            run.streams,
            run.refused,
            run.mean_limit(),
            run.least_limit(),
        );
        runs.push((name, run));
    }
    let settled: Vec<String> = (adaptive.metrics().await.lines())
        .filter(|l| l.starts_with("weir_replica_adaptive_limit{"))
        .map(str::to_owned)
        .collect();
    println!("the adaptive sidecar's limits after the floods: {settled:?}");
    let of = |which: &str| -> Vec<&Phase> {
        runs.iter().filter(|r| r.0 == which).map(|r| &r.1).collect()
    };
    let mean = |phases: &[&Phase], figure: fn(&Phase) -> f64| -> f64 {
        phases.iter().map(|p| figure(p)).sum::<f64>() / phases.len() as f64
    };
    let median = |phases: &[&Phase]| -> f64 {
        let mut rates: Vec<f64> = phases.iter().map(|p| p.tokens_per_s()).collect();
        rates.sort_by(f64::total_cmp);
        let mid = rates.len() / 2;
        (rates[mid - 1] + rates[mid]) / 2.0
    };
    let (adaptive_runs, fixed_runs) = (of("adaptive"), of("fixed"));
    let (with_adaptive, with_fixed) = (median(&adaptive_runs), median(&fixed_runs));
    let ratio = with_adaptive / with_fixed;
    println!(
        "pool output under the flood, median phase: adaptive {with_adaptive:.0} tokens/s, fixed \
         at the slots {with_fixed:.0} tokens/s: {ratio:.3}x"
    );
    assert!(with_fixed > 0.0, "the fixed limit's flood served nothing");
    assert!(
        ratio >= 0.9,
        "the adaptive limit served {ratio:.3}x what a limit fixed at the slots did (at least 0.9x)"
    );
    // The engines report their queue, and with weir at their slots they hold none: nothing
    // lowers the limit but a moment's queue (two scrapes in a row), which the next start undoes.
    let held = mean(&adaptive_runs, Phase::mean_limit);
    assert!(
        held >= 0.95 * slots,
        "the adaptive limit averaged {held:.2} of the {slots} slots under the flood"
    );
}
