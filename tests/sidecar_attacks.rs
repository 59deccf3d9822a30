//! Attacks on the sidecar through the real gateway: an engine that accepts a request and never
//! answers, and engines that refuse work, checked against what the sidecar holds (admin
//! metrics) and what it bills (the ledger). Real Envoy with the filter → (HTTP/2) the sidecar →
//! simulator replicas, one stack per test binary.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use reqwest::{Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::{Mutex, MutexGuard};
use weir_e2e::{Envoy, Sidecar, Sim, api_key, chat_body, post_json};

struct Stack {
    sims: Vec<Sim>,
    /// An engine with a lax request parser (as vLLM's pydantic models are): `"stream": "true"`
    /// streams.
    lax: String,
    sidecar: Sidecar,
    envoy: Envoy,
}

/// Longest a request may hold a replica in this stack (`relay.max_stream_ms` and
/// `relay.max_response_ms`).
const MAX_STREAM_MS: u64 = 1500;

/// Idempotency keys the sidecar remembers at once in this stack.
const MAX_KEYS: usize = 16;

const TENANTS: [&str; 6] = ["stalled", "refused", "normal", "term", "victim", "flooder"];

fn weir_config() -> Value {
    let keys: Vec<Value> = TENANTS.iter().map(|id| api_key(id)).collect();
    json!({
        "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "atk", "keys": keys}]}]}],
        "models": {
            "tiny": {"max_context_tokens": 8192},
            "stall": {"max_context_tokens": 8192},
            "throttled": {"max_context_tokens": 8192},
            "narrow": {"max_context_tokens": 8192},
            "lax": {"max_context_tokens": 8192},
        },
    })
}

/// An OpenAI-compatible engine whose `/metrics` is empty and that reads `stream` leniently, as
/// pydantic's lax mode does (`"true"`, `1` and `true` all stream): a streamed answer of three
/// tokens without a usage chunk (none was asked for), else a JSON one. Serves until the test
/// binary exits.
fn lax_engine() -> String {
    weir_e2e::serve_engine(|head, body| {
        let request: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let streams = matches!(&request["stream"], Value::Bool(true))
            || request["stream"] == "true"
            || request["stream"] == 1;
        if !head.starts_with("POST") {
            ("text/plain", String::new())
        } else if streams {
            let chunk = |text: &str| {
                let c = json!({"id": "chatcmpl-lax", "object": "chat.completion.chunk",
                    "created": 0, "model": "lax", "choices": [{"index": 0,
                    "delta": {"content": text}, "finish_reason": null}]});
                format!("data: {c}\n\n")
            };
            let prompt = request.to_string();
            if prompt.contains("cut short") {
                // An engine that died mid-answer but closed the stream cleanly: no [DONE].
                return ("text/event-stream", chunk("one"));
            }
            let events = if prompt.contains("fail mid-stream") {
                // As vLLM reports an engine error once a stream has started.
                let error = json!({"error": {"object": "error", "type":
                    "InternalServerError", "message": "engine failed", "code": 500}});
                format!("{}data: {error}\n\n", chunk("one"))
            } else {
                ["one", " two", " three"].map(chunk).concat()
            };
            ("text/event-stream", format!("{events}data: [DONE]\n\n"))
        } else {
            let answer = json!({"id": "chatcmpl-lax", "object": "chat.completion",
                "created": 0, "model": "lax", "choices": [{"index": 0,
                "finish_reason": "stop", "message": {"role": "assistant",
                "content": "one two three"}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}});
            ("application/json", answer.to_string())
        }
    })
}

fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(|| {
        let sims = vec![
            Sim::start_tiny_fast(&["--record-requests", "64"]),
            // Accepts every request and then says nothing for ten minutes.
            Sim::start_tiny_fast(&[
                "--served-model-name",
                "stall",
                "--stall-after",
                "0",
                "--stall-for",
                "600000",
            ]),
            // Refuses every request at once with 429, as an engine out of capacity would.
            Sim::start_tiny_fast(&["--served-model-name", "throttled", "--throttle-rate", "1"]),
            Sim::start_tiny_fast(&["--served-model-name", "narrow"]),
        ];
        let lax = lax_engine();
        let (sidecar, envoy) = start_sidecar(&sims, sidecar_config(&sims, &lax));
        Stack {
            sims,
            lax,
            sidecar,
            envoy,
        }
    })
}

fn sidecar_config(sims: &[Sim], lax: &str) -> Value {
    json!({
        "policy": "fair",
        "queue": {"max_per_tenant": 64, "deadline_ms": 20000},
        "relay": {"max_stream_ms": MAX_STREAM_MS, "max_response_ms": MAX_STREAM_MS},
        // Few enough that a test can fill the map of remembered keys.
        "idempotency": {"max_keys": MAX_KEYS},
        "pools": [
            {"model": "tiny", "replicas": [sims[0].url]},
            // These engines stall or refuse every request, the probe's too: not probed for
            // cache isolation (its tests are in isolation.rs).
            {"model": "stall", "replicas": [sims[1].url], "cache_isolation": "shared"},
            {"model": "throttled", "replicas": [sims[2].url], "cache_isolation": "shared"},
            // Room for one long prompt at a time: easy to fill, so the next one queues.
            {"model": "narrow", "replicas": [sims[3].url], "kv_tokens_per_replica": 3000},
            // Reports no cached tokens: its isolation could not be verified.
            {"model": "lax", "replicas": [lax], "cache_isolation": "shared"},
        ],
    })
}

/// Starts a sidecar, and an Envoy in front of it speaking HTTP/2 to it as the shipped configs
/// do, once its probes have read every replica.
fn start_sidecar(sims: &[Sim], config: Value) -> (Sidecar, Envoy) {
    let sidecar = Sidecar::start(config);
    let envoy = Envoy::start_http2(&weir_config(), sidecar.port, sidecar.port);
    // Every simulator, and the lax engine.
    sidecar.wait_for_probes(sims.len() + 1);
    (sidecar, envoy)
}

/// One test at a time on the shared stack.
async fn turn() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::const_new(());
    let guard = TURN.lock().await;
    stack();
    guard
}

fn chat(model: &str, content: &str, extra: Value) -> String {
    chat_body(model, content, extra).to_string()
}

async fn post(key: &str, body: String, headers: &[(&str, &str)]) -> Response {
    post_to(&stack().envoy, key, body, headers).await
}

async fn post_to(envoy: &Envoy, key: &str, body: String, headers: &[(&str, &str)]) -> Response {
    let url = format!("{}/v1/chat/completions", envoy.url);
    post_json(&url, Some(key), body, headers).await
}

/// Sum of a sidecar metric's series starting with `series` (0 when none exists yet).
async fn metric_sum(series: &str) -> f64 {
    stack()
        .sidecar
        .metrics()
        .await
        .lines()
        .filter(|l| l.starts_with(series))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Waits up to `limit` for every hold the sidecar keeps on replicas to be given back.
async fn holds_released(limit: Duration) -> Option<(f64, f64, f64)> {
    let started = Instant::now();
    loop {
        let held = (
            metric_sum("weir_replica_in_flight").await,
            metric_sum("weir_replica_reserved_kv_tokens").await,
            metric_sum("weir_active_kv_tokens").await,
        );
        if held == (0.0, 0.0, 0.0) {
            return None;
        }
        if started.elapsed() > limit {
            return Some(held);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn ledger() -> Vec<weir_sidecar::ledger::UsageRecord> {
    stack().sidecar.ledger_rows(None)
}

/// The ledger's records of one tenant's idempotency key, once the writer has caught up.
async fn records_of(tenant: &str, key: &str) -> Vec<weir_sidecar::ledger::UsageRecord> {
    records_at_least(tenant, key, 1).await
}

/// The ledger rows of a tenant's idempotency key, once there are at least `n` (a record is
/// written as its attempt ends, just after the client has the answer), waiting up to five
/// seconds; whatever there is then.
async fn records_at_least(
    tenant: &str,
    key: &str,
    n: usize,
) -> Vec<weir_sidecar::ledger::UsageRecord> {
    let tenant = format!("acme/lab/atk/{tenant}");
    let mut rows = Vec::new();
    for _ in 0..50 {
        rows = ledger()
            .into_iter()
            .filter(|r| r.tenant == tenant && r.idempotency_key == key)
            .collect();
        if rows.len() >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    rows
}

#[tokio::test]
async fn a_non_streamed_request_to_an_engine_that_never_answers_is_ended_and_releases_its_hold() {
    let _turn = turn().await;
    // An engine that accepted the request and went silent: `relay.max_response_ms` bounds how
    // long it may hold the replica before answering.
    let sent = Instant::now();
    let answer = tokio::time::timeout(
        Duration::from_millis(MAX_STREAM_MS * 5),
        post(
            "stalled",
            chat("stall", "are you there?", json!({"max_tokens": 5})),
            &[
                ("idempotency-key", "stall-1"),
                ("x-request-id", "stall-1-log"),
            ],
        ),
    )
    .await;
    let resp = answer.unwrap_or_else(|_| {
        panic!(
            "no answer {:?} after sending to a silent engine (max_response_ms is {MAX_STREAM_MS})",
            sent.elapsed()
        )
    });
    let status = resp.status();
    let text = resp.text().await.unwrap();
    assert!(
        status.is_server_error() || status == StatusCode::REQUEST_TIMEOUT,
        "{status}: {text}"
    );
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["code"], "response_deadline", "{text}");
    if let Some(held) = holds_released(Duration::from_secs(3)).await {
        panic!("still held (in flight, reserved KV, active KV): {held:?}");
    }
    let rows = records_of("stalled", "stall-1").await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].outcome, "response_deadline");
    // The engine took the prompt: the ledger bills it (no output: weir's deadline cut an answer
    // a hung engine may never have produced), the answer says so, and the filter charges the
    // tenant's quota the same (before, an error without usage was charged nothing).
    let billed = (rows[0].prompt_tokens, rows[0].completion_tokens);
    assert!(billed.0 > 0, "{rows:?}");
    assert_eq!(
        (billed.1, rows[0].source.as_str()),
        (0, "counted"),
        "{rows:?}"
    );
    assert_eq!(
        (
            error["usage"]["prompt_tokens"].as_u64(),
            error["usage"]["completion_tokens"].as_u64()
        ),
        (Some(billed.0), Some(billed.1)),
        "{text}"
    );
    let log = stack().envoy.access_log_fields("stall-1-log");
    assert_eq!(
        (log["tokens_in"].as_str(), log["tokens_out"].as_str()),
        (billed.0.to_string().as_str(), billed.1.to_string().as_str()),
        "{log:?}"
    );
    // The key was not completed: a retry runs (and meets the same silence) instead of a 409.
    let retry = tokio::time::timeout(
        Duration::from_millis(MAX_STREAM_MS * 5),
        post(
            "stalled",
            chat("stall", "are you there?", json!({"max_tokens": 5})),
            &[("idempotency-key", "stall-1")],
        ),
    )
    .await
    .expect("the retry is answered too");
    let body = retry.text().await.unwrap();
    assert!(body.contains("response_deadline"), "{body}");
    assert_eq!(records_at_least("stalled", "stall-1", 2).await.len(), 2);
}

#[tokio::test]
async fn an_attempt_the_engine_refused_bills_nothing() {
    let _turn = turn().await;
    // The engine answers 429 at once: nothing ran, and the filter charges the tenant nothing.
    let resp = post(
        "refused",
        chat(
            "throttled",
            &"a long prompt the engine never read ".repeat(40),
            json!({"max_tokens": 5}),
        ),
        &[("idempotency-key", "refused-1")],
    )
    .await;
    let status = resp.status();
    let text = resp.text().await.unwrap();
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{text}");
    let rows = records_of("refused", "refused-1").await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].outcome, "upstream_error");
    assert_eq!(
        (rows[0].prompt_tokens, rows[0].completion_tokens),
        (0, 0),
        "an attempt the engine refused is billed: {:?}",
        rows[0]
    );
    // And the key is free for the retry.
    let retry = post(
        "refused",
        chat(
            "throttled",
            &"a long prompt the engine never read ".repeat(40),
            json!({"max_tokens": 5}),
        ),
        &[("idempotency-key", "refused-1")],
    )
    .await;
    assert_eq!(retry.status(), StatusCode::TOO_MANY_REQUESTS);
}

/// A prompt of about `tokens` tokens, distinct per `tag`.
fn prompt(tag: &str, tokens: usize) -> String {
    format!("{tag}: {}", "pack the cache ".repeat(tokens / 3))
}

#[tokio::test]
async fn a_request_still_queued_when_the_grace_period_ends_is_not_billed() {
    let _turn = turn().await;
    let s = stack();
    let mut config = sidecar_config(&s.sims, &s.lax);
    config["shutdown_grace_ms"] = json!(1000);
    config["relay"] = json!({"max_stream_ms": 60_000, "max_response_ms": 60_000});
    let (mut sidecar, envoy) = start_sidecar(&s.sims, config);
    let envoy = &envoy;
    // The first fills the narrow pool well past the grace period; the second waits for room.
    let long = |tag: &str| {
        chat(
            "narrow",
            &prompt(tag, 1500),
            json!({"max_tokens": 1400, "ignore_eos": true}),
        )
    };
    let running = tokio::spawn({
        let body = long("running");
        let url = envoy.url.clone();
        async move {
            reqwest::Client::new()
                .post(format!("{url}/v1/chat/completions"))
                .bearer_auth("key-term")
                .header("content-type", "application/json")
                .header("idempotency-key", "term-running")
                .body(body)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let queued = post_to(
        envoy,
        "term",
        long("queued"),
        &[("idempotency-key", "term-queued")],
    );
    let signal = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        tokio::task::spawn_blocking(move || {
            let status = sidecar.terminate(Duration::from_secs(10));
            (sidecar, status)
        })
        .await
        .unwrap()
    };
    let (queued, (sidecar, status)) = tokio::join!(queued, signal);
    let queued_status = queued.status();
    let queued_text = queued.text().await.unwrap();
    let running = running.await.unwrap();
    assert!(status.expect("exits").success());
    assert!(running.contains("shutting_down"), "{running}");
    assert_eq!(
        queued_status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{queued_text}"
    );
    assert!(queued_text.contains("shutting_down"), "{queued_text}");
    let records = sidecar.ledger_rows(None);
    let record = |key: &str| {
        records
            .iter()
            .filter(|r| r.idempotency_key == key)
            .cloned()
            .collect::<Vec<_>>()
    };
    let ran = record("term-running");
    assert_eq!(ran.len(), 1, "{records:?}");
    assert!(ran[0].prompt_tokens > 0, "{ran:?}");
    // weir's restart cut the answer nobody had read yet: billed its prompt, not the bound.
    assert_eq!(
        (ran[0].completion_tokens, ran[0].source.as_str()),
        (0, "counted"),
        "{ran:?}"
    );
    // Never sent to an engine: whatever it is recorded as, it is billed nothing.
    for r in record("term-queued") {
        assert_eq!(
            (r.prompt_tokens, r.completion_tokens),
            (0, 0),
            "a request that never reached an engine is billed: {r:?}"
        );
    }
}

#[tokio::test]
async fn a_client_that_leaves_a_silent_non_streamed_request_frees_the_replica_and_the_key() {
    let _turn = turn().await;
    let body = || chat("stall", "anyone?", json!({"max_tokens": 5}));
    let left = tokio::time::timeout(
        Duration::from_millis(300),
        post(
            "stalled",
            body(),
            &[
                ("idempotency-key", "leave-1"),
                ("x-request-id", "leave-1-log"),
            ],
        ),
    )
    .await;
    assert!(left.is_err(), "the silent engine answered");
    let gone = Instant::now();
    // Well before max_response_ms would end it: the client's leaving is what frees it.
    if let Some(held) = holds_released(Duration::from_millis(800)).await {
        panic!(
            "still held {:?} after the client left: {held:?}",
            gone.elapsed()
        );
    }
    let rows = records_of("stalled", "leave-1").await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].outcome, "cancelled");
    // Nobody read the answer the engine was working on: the ledger bills the prompt and the
    // answer's bound (its max_tokens), and so does the filter, with no word from the sidecar
    // (the client is gone). Before, the ledger billed no output and the filter the bound.
    assert!(rows[0].prompt_tokens > 0, "{rows:?}");
    assert_eq!(
        (rows[0].completion_tokens, rows[0].source.as_str()),
        (5, "bound"),
        "{rows:?}"
    );
    let log = stack().envoy.access_log_fields("leave-1-log");
    println!(
        "ledger {} + {}, filter {:?} + {:?}",
        rows[0].prompt_tokens, rows[0].completion_tokens, log["tokens_in"], log["tokens_out"]
    );
    assert_eq!(log["tokens_out"], "5", "{log:?}");
    // The key is free: the retry runs (to the deadline) as attempt 2, not 409.
    let retry = post("stalled", body(), &[("idempotency-key", "leave-1")]).await;
    let text = retry.text().await.unwrap();
    assert!(text.contains("response_deadline"), "{text}");
    let rows = records_of("stalled", "leave-1").await;
    let attempts: Vec<u32> = rows.iter().map(|r| r.attempt).collect();
    assert_eq!(attempts, [1, 2], "{rows:?}");
}

#[tokio::test]
async fn a_stream_the_engine_took_in_and_never_started_is_billed_its_prompt() {
    let _turn = turn().await;
    // The engine sends the stream's headers and then nothing: its first-byte deadline (here
    // the stream's whole life) ends it with a retryable 503 that bills the prompt it took in,
    // so a prefill longer than the deadline is not free to retry without end.
    let resp = tokio::time::timeout(
        Duration::from_millis(MAX_STREAM_MS * 5),
        post(
            "stalled",
            chat(
                "stall",
                "start, please",
                json!({"max_tokens": 5, "stream": true}),
            ),
            &[
                ("idempotency-key", "unstarted-1"),
                ("x-request-id", "unstarted-1-log"),
            ],
        ),
    )
    .await
    .expect("answered by the first-byte deadline");
    let status = resp.status();
    let text = resp.text().await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["code"], "first_byte_deadline", "{text}");
    let rows = records_of("stalled", "unstarted-1").await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    let r = &rows[0];
    assert!(r.prompt_tokens > 0, "{r:?}");
    assert_eq!(
        (r.outcome.as_str(), r.completion_tokens, r.source.as_str()),
        ("first_byte_deadline", 0, "counted"),
        "{r:?}"
    );
    assert_eq!(
        error["usage"]["prompt_tokens"].as_u64(),
        Some(r.prompt_tokens)
    );
    let log = stack().envoy.access_log_fields("unstarted-1-log");
    assert_eq!(
        (log["tokens_in"].as_str(), log["tokens_out"].as_str()),
        (r.prompt_tokens.to_string().as_str(), "0"),
        "the filter charges what the ledger bills: {log:?}"
    );
    if let Some(held) = holds_released(Duration::from_secs(3)).await {
        panic!("still held (in flight, reserved KV, active KV): {held:?}");
    }
}

#[tokio::test]
async fn the_same_key_and_body_from_another_tenant_is_not_a_replay() {
    let _turn = turn().await;
    let body = || {
        chat(
            "tiny",
            "the same words",
            json!({"max_tokens": 4, "seed": 7}),
        )
    };
    let first = post("normal", body(), &[("idempotency-key", "shared-key")]).await;
    assert_eq!(first.status(), StatusCode::OK);
    let first = first.text().await.unwrap();
    let again = post("normal", body(), &[("idempotency-key", "shared-key")]).await;
    assert_eq!(
        again
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap()),
        Some("true")
    );
    assert_eq!(again.text().await.unwrap(), first);
    let other = post("refused", body(), &[("idempotency-key", "shared-key")]).await;
    assert_eq!(other.status(), StatusCode::OK);
    assert!(
        other.headers().get("idempotent-replayed").is_none(),
        "another tenant got a replay of the first tenant's response"
    );
    let other = other.text().await.unwrap();
    let id = |t: &str| serde_json::from_str::<Value>(t).unwrap()["id"].clone();
    assert_ne!(
        id(&other),
        id(&first),
        "the other tenant's request ran on its own"
    );
    assert_eq!(
        records_of("normal", "shared-key").await.len(),
        1,
        "the replay is not billed"
    );
    assert_eq!(records_of("refused", "shared-key").await.len(), 1);
}

#[tokio::test]
async fn straight_to_the_sidecar_without_a_signature_nothing_is_served_or_billed() {
    let _turn = turn().await;
    let s = stack();
    let before = ledger().len();
    let body = chat("tiny", "free lunch", json!({"max_tokens": 4}));
    for headers in [
        vec![],
        vec![("x-weir-tenant", "acme/lab/atk/normal")],
        vec![
            ("X-WEIR-TENANT", "acme/lab/atk/normal"),
            ("idempotency-key", "k"),
        ],
        vec![
            ("x-weir-signature", "v1:99999999999999:00"),
            ("x-weir-tenant", "acme/lab/atk/normal"),
        ],
        vec![(
            "x-weir-signature",
            "v1:18446744073709551615:0000000000000000000000000000000000000000000000000000000000000000",
        )],
    ] {
        let mut req = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", s.sidecar.url))
            .header("content-type", "application/json");
        for (n, v) in &headers {
            req = req.header(*n, *v);
        }
        let resp = req.body(body.clone()).send().await.unwrap();
        let status = resp.status();
        let text = resp.text().await.unwrap();
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{headers:?}: {text}");
        assert!(!text.contains("acme/lab"), "names a tenant: {text}");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(ledger().len(), before, "an unsigned request was billed");
}

#[tokio::test]
async fn engine_control_fields_never_reach_the_engine_on_any_route() {
    let _turn = turn().await;
    let s = stack();
    // `/dark/` is enforced for 0% of requests: out of the rollout, the filter forwards the body
    // as it came (it must not reject), so the sidecar is the last hop that can strip them.
    for (route, key) in [
        ("/dark/", Some("key-normal")),
        ("/dark/", None),
        ("/", Some("key-normal")),
    ] {
        let marker = format!("steer {route} {key:?}");
        let body = chat(
            "tiny",
            &marker,
            json!({
                "max_tokens": 2,
                "priority": -100,
                "request_id": "chatcmpl-someone-elses",
                "kv_transfer_params": {"remote_block_ids": [1, 2, 3], "remote_engine_id": "prefill-0"},
                "cache_salt": "guessed",
            }),
        );
        let mut req = reqwest::Client::new()
            .post(format!("{}{route}v1/chat/completions", s.envoy.url))
            .header("content-type", "application/json");
        if let Some(key) = key {
            req = req.bearer_auth(key);
        }
        let resp = req.body(body).send().await.unwrap();
        let status = resp.status();
        let text = resp.text().await.unwrap();
        assert_eq!(status, StatusCode::OK, "{route} {key:?}: {text}");
        let received = s.sims[0].received().await;
        let sent = received
            .iter()
            .rev()
            .find(|r| r["body"]["messages"][0]["content"] == marker.as_str())
            .unwrap_or_else(|| panic!("{marker} not received"));
        for field in ["priority", "request_id", "kv_transfer_params"] {
            assert!(
                sent["body"].get(field).is_none(),
                "{route} with key {key:?}: `{field}` reached the engine: {}",
                sent["body"]
            );
        }
        assert_ne!(sent["body"]["cache_salt"], "guessed");
    }
}

#[tokio::test]
async fn stored_state_and_engine_run_tools_are_refused_on_any_route() {
    let _turn = turn().await;
    let s = stack();
    let asks = [
        (
            "previous_response_id",
            json!({"previous_response_id": "resp_someone_elses"}),
        ),
        (
            "conversation",
            json!({"conversation": "conv_someone_elses"}),
        ),
        ("tools", json!({"tools": [{"type": "web_search"}]})),
        (
            "input",
            json!({"input": [{"type": "item_reference", "id": "msg_someone_elses"}]}),
        ),
    ];
    // Out of the `/dark/` route's rollout (0%) the filter passes the body as it came, keyed or
    // not: the sidecar must refuse, or the engine would load another tenant's stored state.
    for (route, key) in [
        ("/dark/", Some("key-normal")),
        ("/dark/", None),
        ("/", Some("key-normal")),
    ] {
        for (param, fields) in &asks {
            let marker = format!("stored {route} {key:?} {param}");
            let mut body = json!({"model": "tiny", "input": marker, "max_output_tokens": 2});
            for (k, v) in fields.as_object().unwrap() {
                body[k] = v.clone();
            }
            let mut req = reqwest::Client::new()
                .post(format!("{}{route}v1/responses", s.envoy.url))
                .header("content-type", "application/json");
            if let Some(key) = key {
                req = req.bearer_auth(key);
            }
            let resp = req.body(body.to_string()).send().await.unwrap();
            let status = resp.status();
            let v: Value = resp.json().await.unwrap_or(Value::Null);
            assert_eq!(status, StatusCode::BAD_REQUEST, "{marker}: {v}");
            assert_eq!(v["error"]["param"], *param, "{marker}: {v}");
            let received = s.sims[0].received().await;
            assert!(
                !received
                    .iter()
                    .any(|r| r["body"].to_string().contains(&marker)),
                "{marker} reached the engine"
            );
        }
    }
}

#[tokio::test]
async fn a_stream_the_engine_chose_is_metered_as_a_stream_whatever_the_body_said() {
    let _turn = turn().await;
    let s = stack();
    // Out of the rollout the body is forwarded as sent, so `stream` may be any JSON the engine
    // reads as true: the sidecar must meter what the engine sends, not what it guessed.
    for (i, stream) in [json!("true"), json!(1)].into_iter().enumerate() {
        let key = format!("lax-{i}");
        let resp = reqwest::Client::new()
            .post(format!("{}/dark/v1/chat/completions", s.envoy.url))
            .bearer_auth("key-normal")
            .header("content-type", "application/json")
            .header("idempotency-key", &key)
            .body(chat("lax", "count to three", json!({"stream": stream})))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let text = resp.text().await.unwrap();
        assert!(text.contains(" three"), "{text}");
        let rows = records_of("normal", &key).await;
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!(
            (rows[0].completion_tokens, rows[0].outcome.as_str()),
            (3, "ok"),
            "`stream: {stream}` streamed three tokens: {:?}",
            rows[0]
        );
    }
}

#[tokio::test]
async fn a_stream_weir_did_not_meter_at_the_front_door_is_billed_the_engines_counts() {
    let _turn = turn().await;
    let s = stack();
    // Out of the rollout the filter neither meters nor asks for the usage chunk; without it the
    // ledger would bill a guess from the body's size (four bytes a token), which a prompt of
    // short words beats by far.
    let words = "a ".repeat(600);
    for (key, asked) in [("unmetered-1", false), ("unmetered-2", true)] {
        let mut extra = json!({"stream": true, "max_tokens": 5});
        if asked {
            extra["stream_options"] = json!({"include_usage": true});
        }
        let resp = reqwest::Client::new()
            .post(format!("{}/dark/v1/chat/completions", s.envoy.url))
            .bearer_auth("key-normal")
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(chat("tiny", &words, extra))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let text = resp.text().await.unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        assert_eq!(
            text.contains("\"usage\""),
            asked,
            "the usage chunk reaches the caller only if it asked for it: {text}"
        );
        let rows = records_of("normal", key).await;
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!(rows[0].source, "engine", "billed a guess: {:?}", rows[0]);
        assert!(rows[0].prompt_tokens >= 600, "{:?}", rows[0]);
        // A replay is what the caller got the first time.
        let again = reqwest::Client::new()
            .post(format!("{}/dark/v1/chat/completions", s.envoy.url))
            .bearer_auth("key-normal")
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(chat("tiny", &words, {
                let mut extra = json!({"stream": true, "max_tokens": 5});
                if asked {
                    extra["stream_options"] = json!({"include_usage": true});
                }
                extra
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(again.text().await.unwrap(), text);
    }
}

#[tokio::test]
async fn another_tenants_flood_of_keys_does_not_evict_a_kept_response() {
    let _turn = turn().await;
    let body = || {
        chat(
            "tiny",
            "keep my answer",
            json!({"max_tokens": 3, "seed": 1}),
        )
    };
    let first = post("victim", body(), &[("idempotency-key", "victim-1")]).await;
    assert_eq!(first.status(), StatusCode::OK);
    let first = first.text().await.unwrap();
    // Another tenant mints keys: cheap one-token requests, each remembered by the sidecar.
    for wave in 0..(2 * MAX_KEYS / 8) {
        let requests = (0..8).map(|i| async move {
            let key = format!("flood-{wave}-{i}");
            let body = chat("tiny", &key, json!({"max_tokens": 1}));
            post("flooder", body, &[("idempotency-key", key.as_str())])
                .await
                .bytes()
                .await
                .unwrap();
        });
        futures::future::join_all(requests).await;
    }
    // The victim's retry of its completed request still gets its answer back.
    let again = post("victim", body(), &[("idempotency-key", "victim-1")]).await;
    let status = again.status();
    let replayed = again.headers().get("idempotent-replayed").cloned();
    let text = again.text().await.unwrap();
    assert_eq!(
        (status, replayed.as_ref().map(|v| v.to_str().unwrap())),
        (StatusCode::OK, Some("true")),
        "another tenant's keys pushed out this tenant's kept response: {text}"
    );
    assert_eq!(text, first);
}

/// Streams `prompt` to the lax engine under `key`, checks the attempt was recorded with
/// `outcome` and that the key's retry runs again as attempt 2 instead of replaying it; returns
/// what the first attempt streamed.
async fn retried_not_replayed(key: &str, prompt: &str, outcome: &str) -> String {
    let s = stack();
    let send = || {
        reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", s.envoy.url))
            .bearer_auth("key-normal")
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(chat("lax", prompt, json!({"stream": true})))
            .send()
    };
    let first = send().await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let text = first.text().await.unwrap();
    let rows = records_of("normal", key).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].outcome, outcome, "{:?}", rows[0]);
    // The retry runs again: the key does not hold the failed attempt's answer for replay.
    let retry = send().await.unwrap();
    assert!(
        retry.headers().get("idempotent-replayed").is_none(),
        "a {outcome} attempt was replayed as the key's completed answer"
    );
    retry.bytes().await.unwrap();
    let rows = records_at_least("normal", key, 2).await;
    assert_eq!(rows.iter().map(|r| r.attempt).collect::<Vec<_>>(), [1, 2]);
    text
}

#[tokio::test]
async fn a_stream_that_ended_in_an_engine_error_is_not_completed_work() {
    let _turn = turn().await;
    let text = retried_not_replayed("errored-1", "please fail mid-stream", "upstream_error").await;
    assert!(text.contains("engine failed"), "{text}");
}

#[tokio::test]
async fn a_stream_cut_short_without_its_done_is_not_completed_work() {
    let _turn = turn().await;
    retried_not_replayed("truncated-1", "please stop: cut short", "failed").await;
}
