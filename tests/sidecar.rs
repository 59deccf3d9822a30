//! The dispatcher sidecar end to end: real Envoy with the filter → the sidecar → simulator
//! replicas, on loopback. The stack is shared by the tests of this binary, which take turns
//! (they measure ordering and shares, so they must not load the pool at the same time).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use reqwest::{Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::{Mutex, MutexGuard};
use weir_e2e::{
    Envoy, Sidecar, Sim, api_key, chat_body, keep_backlogged, kept_latency, p95, post_json, vouched,
};

struct Stack {
    sims: Vec<Sim>,
    sidecar: Sidecar,
    /// The same pool behind a FIFO sidecar, on Envoy's `/alt/` route: the baseline.
    _fifo: Sidecar,
    envoy: Envoy,
}

/// One key per test role.
const TENANTS: [&str; 16] = [
    "aff-a", "aff-b", "retry", "flood", "crash", "bulk", "chat", "heavy", "light", "late", "hog",
    "calm", "small-1", "small-2", "small-3", "noisy",
];

fn weir_config() -> Value {
    let keys: Vec<Value> = TENANTS
        .iter()
        .map(|id| {
            let mut key = api_key(id);
            match *id {
                "bulk" => key["policy"] = json!({"priority": "batch"}),
                "heavy" => key["policy"] = json!({"weight": 2}),
                "hog" => key["limits"] = json!({"active_kv_tokens": 4000}),
                _ => {}
            }
            key
        })
        .collect();
    // `hog` and `late` are orgs of their own: metrics show tenants at the org level, and the
    // tests read their KV and counters there.
    let (own, acme): (Vec<Value>, Vec<Value>) = keys
        .into_iter()
        .partition(|k| ["hog", "late"].contains(&k["id"].as_str().unwrap_or_default()));
    let org = |id: &str, keys: Vec<Value>| json!({"id": id, "workspaces": [{"id": "lab", "projects": [{"id": "e2e", "keys": keys}]}]});
    let mut orgs = vec![org("acme", acme)];
    for key in own {
        let id = key["id"].as_str().unwrap_or_default().to_owned();
        orgs.push(org(&id, vec![key]));
    }
    json!({
        "orgs": orgs,
        "models": {"tiny": {"max_context_tokens": 4096}},
    })
}

fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(|| {
        let sims = vec![
            Sim::start_tiny_fast(&[]),
            Sim::start_tiny_fast(&[]),
            Sim::start_tiny_fast(&["--served-model-name", "crashy", "--exit-after", "1"]),
            Sim::start_tiny_fast(&["--served-model-name", "crashy"]),
        ];
        let sidecar_config = |policy: &str| {
            json!({
                "policy": policy,
                "queue": {"max_per_tenant": 32, "deadline_ms": 20000, "batch_aging_ms": 60000},
                "pools": [
                    {"model": "tiny", "replicas": [sims[0].url, sims[1].url]},
                    // Not probed for cache isolation: the probe's requests would count
                    // towards --exit-after.
                    {"model": "crashy", "replicas": [sims[2].url, sims[3].url], "cache_isolation": "shared"},
                ],
            })
        };
        let sidecar = Sidecar::start(sidecar_config("fair"));
        let fifo = Sidecar::start(sidecar_config("fifo"));
        let envoy = Envoy::start(&weir_config(), sidecar.port, fifo.port);
        // The sidecar admits nothing until its probes have read every replica.
        sidecar.wait_for_probes(4);
        Stack {
            sims,
            sidecar,
            _fifo: fifo,
            envoy,
        }
    })
}

/// One test at a time on the shared pool, starting once the previous test's work has drained
/// from every replica and the sidecar's probes have seen it (so no test routes on stale load).
async fn turn() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::const_new(());
    let guard = TURN.lock().await;
    for sim in &stack().sims[..2] {
        sim.wait_idle().await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    guard
}

fn chat(content: &str, extra: Value) -> String {
    chat_body("tiny", content, extra).to_string()
}

async fn post(key: &str, body: String, request_id: Option<&str>) -> Response {
    post_to("/v1/chat/completions", key, body, request_id).await
}

async fn post_to(path: &str, key: &str, body: String, request_id: Option<&str>) -> Response {
    let url = format!("{}{path}", stack().envoy.url);
    // A trace id, and the idempotency key that deduplicates and names the ledger rows.
    let headers: &[(&str, &str)] = match request_id {
        Some(id) => &[("x-request-id", id), ("idempotency-key", id)],
        None => &[],
    };
    post_json(&url, Some(key), body, headers).await
}

/// Ledger rows, read from the sidecar's SQLite file.
fn ledger() -> Vec<weir_sidecar::ledger::UsageRecord> {
    stack().sidecar.ledger_rows(None)
}

fn ledger_rows(key: &str) -> Vec<weir_sidecar::ledger::UsageRecord> {
    stack().sidecar.attempts(key)
}

/// A prompt of about `tokens` tokens, distinct per `tag`.
fn prompt(tag: &str, tokens: usize) -> String {
    format!("{tag}: {}", "pack the cache ".repeat(tokens / 3))
}

#[tokio::test]
async fn requests_without_the_filter_are_refused() {
    let _turn = turn().await;
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", stack().sidecar.url))
        .body(chat("hi", json!({})))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn a_model_no_pool_serves_gets_openai_s_own_404_and_is_counted_as_such() {
    let _turn = turn().await;
    // This front door serves unlisted models: the sidecar is the one to refuse it.
    let resp = post("chat", chat_body("nope", "hi", json!({})).to_string(), None).await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let error: Value = resp.json().await.unwrap();
    assert_eq!(
        error,
        json!({"error": {
            "message": "The model `nope` does not exist or you do not have access to it.",
            "type": "invalid_request_error", "param": null, "code": "model_not_found",
        }})
    );
    let body = json!({"model": "nope", "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}]});
    let resp = post_to("/v1/messages", "chat", body.to_string(), None).await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let error: Value = resp.json().await.unwrap();
    assert_eq!(error["type"], "error", "{error}");
    assert_eq!(error["error"]["type"], "not_found_error", "{error}");
    let metrics = stack().sidecar.metrics().await;
    let counted = metrics
        .lines()
        .filter(|l| {
            l.starts_with("weir_rejections_total{") && l.contains("reason=\"model_not_found\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>();
    assert_eq!(counted, 2.0, "{metrics}");
}

#[tokio::test]
async fn tenant_prefixes_stick_to_one_replica_and_never_cross_tenants() {
    let _turn = turn().await;
    let s = stack();
    let shared = prompt("a shared system prompt", 600);
    let hits = |i: usize| s.sims[i].metric("vllm:prefix_cache_hits_total");
    let before = [hits(0).await, hits(1).await];
    let mut cached = Vec::new();
    for _ in 0..4 {
        // The previous request's hold is given back before the next is placed: a replica still
        // counted busy would send it elsewhere, which is the load rule, not affinity.
        replicas_idle().await;
        let v: Value = post("aff-a", chat(&shared, json!({"max_tokens": 1})), None)
            .await
            .json()
            .await
            .unwrap();
        cached.push(
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
        );
    }
    assert_eq!(cached[0], 0);
    assert!(
        cached[1..].iter().all(|&c| c > 500),
        "the affine replica's cache is warm: {cached:?}"
    );
    let gained = [hits(0).await - before[0], hits(1).await - before[1]];
    assert!(
        gained.iter().filter(|&&g| g > 0.0).count() == 1,
        "all hits on one replica: {gained:?}"
    );

    let v: Value = post("aff-b", chat(&shared, json!({"max_tokens": 1})), None)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "another tenant's identical prefix gets no hits"
    );
}

#[tokio::test]
async fn a_retried_idempotency_key_is_billed_once() {
    let _turn = turn().await;
    let body = || chat("bill me once", json!({"max_tokens": 3}));
    let resp = post("retry", body(), Some("retry-42")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    resp.bytes().await.unwrap();
    assert_eq!(ledger_rows("retry-42").len(), 1);
    // A retry of a request that already completed gets its outcome again, not run or billed.
    let again = post("retry", body(), Some("retry-42")).await;
    assert_eq!(again.status(), StatusCode::OK);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rows = ledger_rows("retry-42");
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].tenant, "acme/lab/e2e/retry");
    assert_eq!(
        (rows[0].completion_tokens, rows[0].source.as_str()),
        (3, "engine")
    );
}

#[tokio::test]
async fn a_flood_past_the_queue_bound_gets_fast_429s_while_admitted_work_completes() {
    let _turn = turn().await;
    let start = Instant::now();
    let attempts = (0..64).map(|i| async move {
        let body = chat(
            &prompt(&format!("flood {i}"), 2000),
            json!({"max_tokens": 100, "ignore_eos": true, "stream": true}),
        );
        let resp = post("flood", body, None).await;
        let status = resp.status();
        let retry_after = resp.headers().get("retry-after").is_some();
        let text = resp.text().await.unwrap_or_default();
        (status, retry_after, text, start.elapsed())
    });
    let results = futures::future::join_all(attempts).await;
    let refused: Vec<_> = results
        .iter()
        .filter(|r| r.0 == StatusCode::TOO_MANY_REQUESTS)
        .collect();
    let served: Vec<_> = results.iter().filter(|r| r.0 == StatusCode::OK).collect();
    assert!(
        !refused.is_empty(),
        "the bound of 16 queued per tenant was hit"
    );
    assert!(refused.iter().all(|r| r.1 && r.2.contains("queue_full")));
    assert_eq!(served.len() + refused.len(), results.len());
    assert!(
        served.iter().all(|r| r.2.ends_with("data: [DONE]\n\n")),
        "admitted requests complete"
    );
    let last_refusal = refused.iter().map(|r| r.3).max().unwrap();
    let first_completion = served.iter().map(|r| r.3).min().unwrap();
    assert!(
        last_refusal < first_completion,
        "refusals are immediate, not queued"
    );
}

#[tokio::test]
async fn a_replica_lost_mid_stream_ends_cleanly_and_later_requests_go_elsewhere() {
    let _turn = turn().await;
    let mut failure = None;
    for i in 0..20 {
        let id = format!("crash-{i}");
        let body = json!({"model": "crashy", "stream": true, "max_tokens": 50, "ignore_eos": true,
            "messages": [{"role": "user", "content": format!("attempt {i}")}]})
        .to_string();
        let text = post("crash", body, Some(&id))
            .await
            .text()
            .await
            .unwrap_or_default();
        if text.contains("\"error\"") {
            failure = Some((id, text));
            break;
        }
        assert!(text.ends_with("data: [DONE]\n\n"));
    }
    let (id, text) = failure.expect("one request landed on the replica that dies");
    let error_event = text
        .split("\n\n")
        .find(|e| e.contains("\"error\""))
        .unwrap();
    let event: Value = serde_json::from_str(error_event.trim_start_matches("data: ")).unwrap();
    assert_eq!(event["error"]["type"], "server_error");
    assert!(
        text.ends_with("data: [DONE]\n\n"),
        "the stream is closed properly"
    );
    let rows = ledger_rows(&id);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].outcome, "failed");
    // Billed its prompt and what was relayed before the replica died.
    assert!(rows[0].prompt_tokens > 0, "{rows:?}");
    assert_eq!(rows[0].source, "counted", "{rows:?}");
    for i in 0..6 {
        let body = json!({"model": "crashy", "max_tokens": 5,
            "messages": [{"role": "user", "content": format!("after {i}")}]})
        .to_string();
        assert_eq!(
            post("crash", body, None).await.status(),
            StatusCode::OK,
            "healthy replica serves"
        );
    }
}

#[tokio::test]
async fn interactive_requests_overtake_queued_batch_work() {
    let _turn = turn().await;
    let start = Instant::now();
    let bulk = (0..14).map(|i| async move {
        let body = chat(
            &prompt(&format!("bulk {i}"), 2000),
            json!({"max_tokens": 60, "ignore_eos": true}),
        );
        let resp = post("bulk", body, None).await;
        assert_eq!(resp.status(), StatusCode::OK);
        resp.bytes().await.unwrap();
        start.elapsed()
    });
    let chat_reqs = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let sent = start.elapsed();
        let done = futures::future::join_all((0..3).map(|i| async move {
            let resp = post(
                "chat",
                chat(&format!("quick question {i}"), json!({"max_tokens": 5})),
                None,
            )
            .await;
            assert_eq!(resp.status(), StatusCode::OK);
            resp.bytes().await.unwrap();
            start.elapsed()
        }))
        .await;
        (sent, done)
    };
    let (bulk_done, (chat_sent, chat_done)) =
        tokio::join!(futures::future::join_all(bulk), chat_reqs);
    let last_chat = chat_done.iter().max().unwrap();
    let bulk_after_chat = bulk_done.iter().filter(|t| *t > last_chat).count();
    let bulk_queued_at_chat = bulk_done.iter().filter(|t| **t > chat_sent).count();
    assert!(
        bulk_queued_at_chat >= 6,
        "the pool was saturated with batch work"
    );
    assert!(
        bulk_after_chat >= 4,
        "interactive went ahead of {bulk_after_chat} queued batch requests"
    );
}

#[tokio::test]
async fn weights_divide_service_two_to_one_and_returning_tenants_are_lifted() {
    let _turn = turn().await;
    // Enough clients that both tenants stay backlogged: VTC shares service among backlogged
    // tenants, and one whose queue keeps emptying is (rightly) lifted each time it returns.
    // The pool runs about 12 of these at once; the rest of each tenant's clients are queued or
    // on their way (gateway and sidecar each count a 1,500-token prompt), so the heavy tenant,
    // served faster, needs that many more to stay backlogged on a busy machine: with 24 each
    // its queue ran dry and it got less than its share. Clients the queue's bound turns away
    // (429 queue_full) retry. Two to one, not three: a tenant served 3x as fast holds 75% of
    // the pool's KV, right at the 80% the headroom rule lets one tenant take while others are
    // active, and it got 2.6x in one run where its share was capped (`tests/fair_share.rs`
    // shows 3:1 between keys that each hold a small part of the pool).
    let window = Duration::from_secs(6);
    let until = Instant::now() + window;
    let started_ms = weir_sidecar::support::clock::now_ms();
    let url = format!("{}/v1/chat/completions", stack().envoy.url);
    let client = |key: &'static str| {
        keep_backlogged(&url, key, until, move |n| {
            chat(
                &prompt(&format!("{key} {n}"), 1500),
                json!({"max_tokens": 40, "ignore_eos": true}),
            )
        })
    };
    let loops = (0..90).map(|i| client(if i % 3 == 2 { "light" } else { "heavy" }));
    let late = async {
        tokio::time::sleep(Duration::from_secs(4)).await;
        let counters = vtc_counters().await;
        // Both are keys of acme: its counter is theirs together.
        let floor = counters["acme"];
        let resp = post(
            "late",
            chat("back from idle", json!({"max_tokens": 1})),
            None,
        )
        .await;
        assert_eq!(resp.status(), StatusCode::OK);
        resp.bytes().await.unwrap();
        (floor, vtc_counters().await["late"])
    };
    let (_, (floor, late_counter)) = tokio::join!(futures::future::join_all(loops), late);
    assert!(
        floor > 100_000.0,
        "both tenants ran up their counters: {floor}"
    );
    assert!(
        late_counter >= floor,
        "lifted to the backlogged minimum: {late_counter} < {floor}"
    );

    // Count the steady state: after the queues filled, before the clients stopped.
    let steady = (started_ms + 1_000)..(started_ms + window.as_millis() as u64);
    let served = |tenant: &str| -> u64 {
        ledger()
            .iter()
            .filter(|r| {
                r.tenant == tenant && r.outcome == "ok" && steady.contains(&r.finished_at_ms)
            })
            .map(|r| r.prompt_tokens + r.completion_tokens)
            .sum()
    };
    let (heavy, light) = (served("acme/lab/e2e/heavy"), served("acme/lab/e2e/light"));
    let ratio = heavy as f64 / light as f64;
    println!("weights 2:1 -> served heavy:light = {ratio:.3} ({heavy} vs {light} tokens)");
    assert!(
        (ratio / 2.0 - 1.0).abs() <= 0.10,
        "heavy:light = {ratio:.2} ({heavy} vs {light} tokens)"
    );
}

/// Waits (up to five seconds) until the sidecar holds nothing on any replica and the engines
/// last reported no KV in use.
async fn replicas_idle() {
    for _ in 0..100 {
        let metrics = stack().sidecar.metrics().await;
        // What weir holds there, and what the engines last said they hold and queue: the affine
        // replica still read as full or queueing (a health read that caught the last request
        // before the engine scheduled it) would send a request elsewhere.
        let held: f64 = metrics
            .lines()
            .filter(|l| {
                ["in_flight", "kv_usage", "waiting"]
                    .iter()
                    .any(|m| l.starts_with(&format!("weir_replica_{m}{{")))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        if held == 0.0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn vtc_counters() -> HashMap<String, f64> {
    stack()
        .sidecar
        .metrics()
        .await
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("weir_vtc_counter{tenant=\"")?;
            let (tenant, value) = rest.split_once("\",pool=\"tiny\"} ")?;
            Some((tenant.to_owned(), value.parse().ok()?))
        })
        .collect()
}

#[tokio::test]
async fn a_long_context_kv_hog_is_capped_and_others_keep_their_deadlines() {
    let _turn = turn().await;
    let hog = (0..8).map(|i| async move {
        let body = chat(
            &prompt(&format!("hog session {i}"), 3000),
            json!({"max_tokens": 40, "ignore_eos": true}),
        );
        post("hog", body, None).await.status()
    });
    let watch = async {
        let mut peak = 0.0f64;
        let mut calm = Vec::new();
        for i in 0..10 {
            let resp = post(
                "calm",
                chat(&format!("calm {i}"), json!({"max_tokens": 5})),
                Some(&format!("calm-{i}")),
            )
            .await;
            calm.push(resp.status());
            resp.bytes().await.unwrap();
            let metrics = stack().sidecar.metrics().await;
            let held = metrics
                .lines()
                .find(|l| l.starts_with("weir_active_kv_tokens{tenant=\"hog\"}"))
                .and_then(|l| l.rsplit(' ').next()?.parse().ok())
                .unwrap_or(0.0);
            peak = peak.max(held);
        }
        (peak, calm)
    };
    let (hog_statuses, (peak, calm)) = tokio::join!(futures::future::join_all(hog), watch);
    assert!(
        hog_statuses.iter().all(|s| *s == StatusCode::OK),
        "the hog is served, one session at a time"
    );
    assert!(
        peak <= 4000.0,
        "the hog never held more than its cap: {peak}"
    );
    assert!(calm.iter().all(|s| *s == StatusCode::OK));
    let waits: Vec<u64> = (0..10)
        .map(|i| ledger_rows(&format!("calm-{i}"))[0].queued_ms)
        .collect();
    assert!(
        waits.iter().all(|&w| w < 1_000),
        "others never wait behind the hog: {waits:?}"
    );
}

/// Small tenants' time to first token while (`flood`) or before a noisy tenant floods the pool.
async fn small_tenant_ttfts(
    path: &'static str,
    flood: bool,
    window: Duration,
) -> (Vec<f64>, usize) {
    let start = Instant::now();
    let small = |key: &'static str| async move {
        let mut ttfts = Vec::new();
        while start.elapsed() < window {
            let body = chat(
                &prompt(&format!("{key} asks"), 250),
                json!({"stream": true, "max_tokens": 30, "ignore_eos": true}),
            );
            let sent = Instant::now();
            let mut resp = post_to(path, key, body, None).await;
            assert_eq!(resp.status(), StatusCode::OK);
            let mut first = None;
            while let Some(chunk) = resp.chunk().await.unwrap() {
                if first.is_none() && String::from_utf8_lossy(&chunk).contains("\"content\":\" ") {
                    first = Some(sent.elapsed().as_secs_f64());
                }
            }
            ttfts.extend(first);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        ttfts
    };
    // About three times what the pool serves: 40 clients of 1,500-token prompts and 500-token
    // answers, against room for 9 of them at once.
    let noisy = || async move {
        let mut served = 0;
        while flood && start.elapsed() < window {
            let body = chat(
                &prompt("noisy bulk", 1500),
                json!({"max_tokens": 500, "ignore_eos": true}),
            );
            let resp = post_to(path, "noisy", body, None).await;
            if resp.status() == StatusCode::OK && resp.bytes().await.is_ok() {
                served += 1;
            }
        }
        served
    };
    let smalls = futures::future::join_all(["small-1", "small-2", "small-3"].map(small));
    let floods = futures::future::join_all((0..40).map(|_| noisy()));
    let (ttfts, served) = tokio::join!(smalls, floods);
    (ttfts.concat(), served.iter().sum())
}

#[tokio::test]
async fn small_tenants_keep_their_latency_through_a_noisy_flood_under_fair_scheduling() {
    let _turn = turn().await;
    let mut kept = Vec::new();
    for path in ["/v1/chat/completions", "/alt/v1/chat/completions"] {
        let (quiet, _) = small_tenant_ttfts(path, false, Duration::from_secs(3)).await;
        let (flooded, noisy_served) = small_tenant_ttfts(path, true, Duration::from_secs(5)).await;
        let ratio = p95(flooded.clone()) / p95(quiet.clone());
        println!(
            "{path}: small TTFT p95 {:.1} ms -> {:.1} ms under the flood ({ratio:.2}x; {} vs {} samples), noisy served {noisy_served}",
            p95(quiet.clone()) * 1e3,
            p95(flooded.clone()) * 1e3,
            quiet.len(),
            flooded.len()
        );
        assert!(noisy_served > 10, "the noisy tenant is still served");
        kept.push(kept_latency(p95(quiet), p95(flooded)));
    }
    assert!(kept[0], "fair: small tenants keep their latency");
    assert!(!kept[1], "FIFO: small tenants queue behind the flood");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_of_a_run_lands_in_the_ledger_with_its_run_agent_and_tool_calls() {
    let _turn = turn().await;
    let schema = json!({"type": "object", "properties": {"query": {"type": "string"}}});
    let names = ["get_weather", "search"];
    let ask = "call get_weather, search";
    let chat_tools: Vec<Value> = names
        .iter()
        .map(|n| json!({"type": "function", "function": {"name": n, "parameters": schema}}))
        .collect();
    let responses_tools: Vec<Value> = names
        .iter()
        .map(|n| json!({"type": "function", "name": n, "parameters": schema}))
        .collect();
    let messages_tools: Vec<Value> = names
        .iter()
        .map(|n| json!({"name": n, "input_schema": schema}))
        .collect();
    let apis = [
        (
            "/v1/chat/completions",
            chat_body("tiny", ask, json!({"tools": chat_tools, "max_tokens": 8})),
        ),
        (
            "/v1/responses",
            json!({"model": "tiny", "input": ask, "tools": responses_tools,
                   "max_output_tokens": 8}),
        ),
        (
            "/v1/messages",
            json!({"model": "tiny", "max_tokens": 8, "tools": messages_tools,
                   "messages": [{"role": "user", "content": ask}]}),
        ),
    ];
    let client = reqwest::Client::new();
    // Signed as the filter signs a call that names a run, straight to the sidecar: streamed
    // (the calls counted event by event) and read whole, in each API's shape.
    for (path, body) in apis {
        for stream in [true, false] {
            let request_id = format!("weir-run-e2e{}-{stream}", path.replace('/', "-"));
            let run = [("x-weir-run-id", "run-e2e"), ("x-weir-agent", "planner")];
            let mut body = body.clone();
            body["stream"] = json!(stream);
            let mut req = client
                .post(format!("{}{path}", stack().sidecar.url))
                .header("content-type", "application/json")
                .body(body.to_string());
            for (name, value) in vouched("acme/lab/e2e/chat", &request_id, &run) {
                req = req.header(name, value);
            }
            let resp = req.send().await.unwrap();
            assert_eq!(resp.status(), StatusCode::OK, "{path}");
            let answer = resp.text().await.unwrap();
            assert!(names.iter().all(|n| answer.contains(n)), "{answer}");
            let rows = ledger_rows(&request_id);
            assert_eq!(rows.len(), 1, "{path} stream {stream}: {rows:?}");
            let row = &rows[0];
            assert_eq!(
                (
                    row.run_id.as_deref(),
                    row.agent_id.as_deref(),
                    row.tool_calls
                ),
                (Some("run-e2e"), Some("planner"), 2),
                "{path} stream {stream}"
            );
            assert!(row.started_at_ms.is_some_and(|t| t <= row.finished_at_ms));
        }
    }
}
