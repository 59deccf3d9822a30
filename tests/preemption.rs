//! Batch preemption end to end (invariant 7): real Envoy with the filter → two sidecars, one
//! preempting (`queue.preempt_batch_after_ms: 20`) and one not (0), on Envoy's main and `/alt/`
//! routes → one simulator replica at a fifth of real speed, whose four slots batch streams
//! keep full. Interactive requests' time to first token is measured idle, then through each
//! sidecar; every batch stream must still complete with all its tokens, billed once.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use weir_e2e::{Envoy, Sidecar, Sim, api_key, chat_body, p95, post_json};

/// Tokens each batch stream generates (`ignore_eos`): about 3 s at the simulator's speed.
const BATCH_TOKENS: u64 = 60;

/// Batch tenants, one stream each at a time: together they fill the replica's four slots (one
/// tenant alone would leave a slot to the active interactive tenant: the headroom rule).
const BULK: [&str; 4] = ["bulk-0", "bulk-1", "bulk-2", "bulk-3"];

fn weir_config() -> Value {
    let mut keys: Vec<Value> = BULK
        .iter()
        .map(|id| {
            let mut key = api_key(id);
            key["policy"] = json!({"priority": "batch"});
            key
        })
        .collect();
    keys.push(api_key("chat"));
    json!({
        "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "e2e",
            "keys": keys}]}]}],
        "models": {"tiny": {"max_context_tokens": 4096}},
    })
}

fn sidecar_config(sim: &Sim, preempt_after_ms: u64) -> Value {
    json!({
        "queue": {"deadline_ms": 30000, "batch_aging_ms": 60000,
                  "preempt_batch_after_ms": preempt_after_ms},
        "pools": [{"model": "tiny", "replicas": [sim.url], "max_concurrency_per_replica": 4}],
    })
}

/// A prompt of about `tokens` tokens, distinct per `tag` from its first block (no prefix-cache
/// hits between requests).
fn prompt(tag: &str, tokens: usize) -> String {
    format!("{tag}: {}", "pack the cache ".repeat(tokens / 3))
}

/// Streams a chat through `base`; returns the time to its first content token and the
/// content chunks it got.
async fn stream(base: &str, key: &str, body: Value, id: &str) -> (f64, u64, String) {
    let sent = Instant::now();
    let headers = [("x-request-id", id), ("idempotency-key", id)];
    let mut resp = post_json(
        &format!("{base}/v1/chat/completions"),
        Some(key),
        body.to_string(),
        &headers,
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK, "{id}");
    let (mut first, mut tokens, mut text) = (None, 0, String::new());
    while let Some(chunk) = resp.chunk().await.unwrap() {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    for line in text.lines() {
        let Some(event) = line.strip_prefix("data: ") else {
            continue;
        };
        let Ok(event) = serde_json::from_str::<Value>(event) else {
            continue;
        };
        if event["choices"][0]["delta"]["content"]
            .as_str()
            .is_some_and(|c| !c.is_empty())
        {
            tokens += 1;
            first.get_or_insert(sent.elapsed().as_secs_f64());
        }
    }
    (first.unwrap_or(f64::MAX), tokens, text)
}

/// An interactive request, its prompt distinct per run (no prefix-cache hits across runs).
fn interactive(run: &str, n: usize) -> Value {
    chat_body(
        "tiny",
        &prompt(&format!("{run} ask {n}"), 900),
        json!({"stream": true, "max_tokens": 4}),
    )
}

/// Time to first token of interactive requests, one after another.
async fn interactive_ttfts(base: &str, run: &str, count: usize) -> Vec<f64> {
    let mut ttfts = Vec::new();
    for n in 0..count {
        let body = interactive(run, n);
        let (ttft, _, _) = stream(base, "chat", body, &format!("{run}-ask-{n}")).await;
        ttfts.push(ttft);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    ttfts
}

/// Interactive TTFTs while four clients keep the pool's four slots full of batch streams;
/// returns them and the ids and content tokens of every batch stream.
async fn under_batch_load(base: &str, run: &str) -> (Vec<f64>, Vec<(String, u64, String)>) {
    let done = AtomicBool::new(false);
    let batch_client = |c: usize| {
        let done = &done;
        async move {
            let mut streams = Vec::new();
            let mut round = 0;
            while !done.load(Ordering::Relaxed) {
                let id = format!("{run}-bulk-{c}-{round}");
                // A fixed-width round number keeps every batch prompt the same token count, so
                // a billed re-prefill (the prompt plus what was generated) stands out.
                let body = chat_body(
                    "tiny",
                    &prompt(&format!("bulk {c} {round:03}"), 300),
                    json!({"stream": true, "max_tokens": BATCH_TOKENS, "ignore_eos": true,
                           "stream_options": {"include_usage": true}}),
                );
                let (_, tokens, text) = stream(base, BULK[c], body, &id).await;
                streams.push((id, tokens, text));
                round += 1;
            }
            streams
        }
    };
    let asks = async {
        // The batch streams take every slot first.
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        let ttfts = interactive_ttfts(base, run, 6).await;
        done.store(true, Ordering::Relaxed);
        ttfts
    };
    let (ttfts, streams) = tokio::join!(asks, futures::future::join_all((0..4).map(batch_client)));
    (ttfts, streams.concat())
}

fn preemptions(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("weir_preemptions_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |a, b| a + b)
}

/// Every batch stream completed with all its tokens and one ledger record of them.
fn check_batch(sidecar: &Sidecar, streams: &[(String, u64, String)]) -> u64 {
    let mut prompt_tokens = None;
    for (id, tokens, text) in streams {
        assert_eq!(*tokens, BATCH_TOKENS, "{id} streamed every token");
        assert!(text.trim_end().ends_with("data: [DONE]"), "{id} completed");
        // Resumed or not, one stream as the client first saw it.
        let events: Vec<Value> = text
            .lines()
            .filter_map(|l| serde_json::from_str(l.strip_prefix("data: ")?).ok())
            .collect();
        let ids: std::collections::BTreeSet<String> = events
            .iter()
            .map(|e| format!("{}/{}", e["id"], e["created"]))
            .collect();
        assert_eq!(
            ids.len(),
            1,
            "{id}: one chunk id and creation time: {ids:?}"
        );
        let roles = events
            .iter()
            .filter(|e| !e["choices"][0]["delta"]["role"].is_null())
            .count();
        assert_eq!(roles, 1, "{id}: one role delta");
        let usage = events.iter().find(|e| e["usage"].is_object()).unwrap();
        assert_eq!(
            usage["usage"]["completion_tokens"], BATCH_TOKENS,
            "{id}: every token"
        );
        let rows = sidecar.attempts(id);
        assert_eq!(rows.len(), 1, "{id}: one record");
        let row = &rows[0];
        assert_eq!(row.outcome, "ok", "{id}");
        assert_eq!(
            row.completion_tokens, BATCH_TOKENS,
            "{id}: the tokens generated, once"
        );
        assert_eq!(row.source, "engine");
        assert_eq!(
            usage["usage"]["prompt_tokens"], row.prompt_tokens,
            "{id}: as billed"
        );
        // A resumed stream's prompt is billed as the others' are: a re-prefill would add the
        // tokens generated before the preemption (the engine's generated text re-tokenizes to
        // as many tokens as it generated, so the count is exact).
        let p = *prompt_tokens.get_or_insert(row.prompt_tokens);
        assert_eq!(
            row.prompt_tokens, p,
            "{id}: the original prompt, not the re-prefill"
        );
    }
    prompt_tokens.unwrap_or(0)
}

#[tokio::test]
async fn interactive_work_preempts_batch_streams_which_still_complete_billed_once() {
    let sim = Sim::start(&[
        "--preset",
        "tiny",
        "--time-scale",
        "0.2",
        "--output-len",
        "fixed:20",
        "--record-requests",
        "1000",
    ]);
    let preempting = Sidecar::start(sidecar_config(&sim, 20));
    let waiting = Sidecar::start(sidecar_config(&sim, 0));
    let envoy = Envoy::start(&weir_config(), preempting.port, waiting.port);
    preempting.wait_for_probes(1);
    waiting.wait_for_probes(1);
    let base = envoy.url.clone();
    let alt = format!("{}/alt", envoy.url);

    // Warm both routes (connections, the tokenizer) before anything is timed.
    interactive_ttfts(&base, "warm", 1).await;
    interactive_ttfts(&alt, "warm-alt", 1).await;
    let idle = p95(interactive_ttfts(&base, "idle", 6).await);
    let (with, with_streams) = under_batch_load(&base, "preempt").await;
    let with = p95(with);
    let (without, without_streams) = under_batch_load(&alt, "wait").await;
    let without = p95(without);
    let preempted = preemptions(&preempting.metrics().await);
    println!(
        "interactive TTFT p95: idle {:.0} ms; pool full of batch streams: {:.0} ms with \
         preemption ({:.2}x idle, {preempted} preemptions, {} batch streams), {:.0} ms without \
         ({:.2}x idle: waiting for a batch stream to drain, {} batch streams)",
        idle * 1e3,
        with * 1e3,
        with / idle,
        with_streams.len(),
        without * 1e3,
        without / idle,
        without_streams.len(),
    );
    assert!(preempted >= 1.0, "batch streams were preempted");
    // Each preempted stream went on where it stopped: its text as the final assistant message,
    // continued (vLLM's fields), asked for what remained.
    let received = sim.received().await;
    // Each continuation is a new engine request: its engine request id (vLLM takes
    // `x-request-id` as its own) is not the aborted segment's, which the engine may still be
    // aborting (vLLM refuses a running id, or aborts the newcomer with the old one).
    let engine_ids: Vec<&str> = received
        .iter()
        .filter_map(|r| r["headers"]["x-request-id"].as_str())
        .filter(|id| id.contains("-bulk-"))
        .collect();
    let distinct: std::collections::BTreeSet<&str> = engine_ids.iter().copied().collect();
    println!(
        "{} batch engine requests, {} distinct engine request ids",
        engine_ids.len(),
        distinct.len()
    );
    let reused: Vec<&&str> = engine_ids
        .iter()
        .filter(|id| engine_ids.iter().filter(|o| o == id).count() > 1)
        .collect();
    assert!(reused.is_empty(), "engine request ids reused: {reused:?}");
    let continued: Vec<Value> = received
        .into_iter()
        .map(|r| r["body"].clone())
        .filter(|b| b["continue_final_message"] == true)
        .collect();
    assert!(
        continued.len() as f64 >= preempted,
        "{} continuations",
        continued.len()
    );
    for body in &continued {
        assert_eq!(body["add_generation_prompt"], false);
        let messages = body["messages"].as_array().unwrap();
        let last = messages.last().unwrap();
        assert_eq!(last["role"], "assistant");
        let generated = last["content"].as_str().unwrap();
        assert!(!generated.is_empty(), "{body}");
        assert!(
            body["max_tokens"].as_u64().unwrap() < BATCH_TOKENS,
            "the limit lowered by what was generated"
        );
    }
    assert_eq!(preemptions(&waiting.metrics().await), 0.0);
    assert!(
        with <= 2.0 * idle,
        "with preemption: {with:.3} s vs idle {idle:.3} s"
    );
    assert!(
        without > 2.0 * idle,
        "without, interactive work waits for batch to drain"
    );
    let a = check_batch(&preempting, &with_streams);
    let b = check_batch(&waiting, &without_streams);
    assert_eq!(a, b, "preempted prompts billed as unpreempted ones");
    // Every hold came back: nothing in flight, no KV reserved.
    let metrics = preempting.metrics().await;
    for series in ["weir_replica_in_flight{", "weir_replica_reserved_kv{"] {
        let held: f64 = metrics
            .lines()
            .filter(|l| l.starts_with(series))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .fold(0.0, |a, b| a + b);
        assert_eq!(held, 0.0, "{series}");
    }
}
