//! Every inference API through the whole gateway — Chat Completions (with tool calls),
//! Completions (a prompt batch), Responses, Anthropic Messages and embeddings — as their
//! clients call them: real Envoy with the filter → the sidecar → simulator replicas. Each is
//! billed the engine's usage (the answer's, the ledger's and the access log's figures agree, and
//! the key's buckets move by exactly that), refused in its own error shape, settled and cancelled
//! upstream when its client leaves, and answered with the key's rate-limit headers.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use futures::StreamExt;
use reqwest::{RequestBuilder, Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::{Mutex, MutexGuard};
use weir_e2e::{Envoy, Sidecar, Sim, api_key, api_key_limited};

/// Per-minute token limits of the metered keys: slow enough a refill that a bucket's movement
/// is read to within a few tokens.
const METER_LIMIT: u64 = 1200;

/// Every API, with the path its clients call and whether it streams here.
const APIS: [(&str, &str); 5] = [
    ("chat_completions", "/v1/chat/completions"),
    ("completions", "/v1/completions"),
    ("responses", "/v1/responses"),
    ("messages", "/v1/messages"),
    ("embeddings", "/v1/embeddings"),
];

struct Stack {
    sims: Vec<Sim>,
    sidecar: Sidecar,
    envoy: Envoy,
}

fn weir_config() -> Value {
    let meter_limits = json!({
        "input_tokens_per_minute": METER_LIMIT,
        "output_tokens_per_minute": METER_LIMIT,
        "concurrent_requests": 4,
    });
    let mut keys: Vec<Value> = APIS
        .iter()
        .map(|(api, _)| api_key_limited(&format!("meter-{api}"), meter_limits.clone()))
        .collect();
    keys.extend([
        api_key_limited("once", json!({"requests_per_minute": 1})),
        api_key_limited("spent", json!({"requests_per_minute": 1})),
        api_key_limited("unknown-then", json!({"requests_per_minute": 3})),
        api_key_limited("capped", json!({"max_output_tokens": 50})),
        api_key_limited("leaver", json!({"concurrent_requests": 8})),
        api_key("plain"),
        api_key("fair"),
    ]);
    json!({
        "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [
            {"id": "apis", "keys": keys},
            {"id": "narrow", "policy": {"models": ["tiny"]}, "keys": [api_key("restricted")]},
        ]}]}],
        "models": {
            "tiny": {"max_context_tokens": 4096},
            "slow": {"max_context_tokens": 4096},
            "throttled": {"max_context_tokens": 4096},
        },
        // A model none of these lists is refused at the front door.
        "unknown_models": "refuse",
        // Every prompt counted by the one-pass estimate, so the engine's count differs from it
        // and billing the engine's is visible.
        "estimator": {"exact_below_bytes": 0},
    })
}

fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(|| {
        let sims = vec![
            Sim::start_tiny_fast(&["--record-requests", "256"]),
            // Long answers of an 8B model at real speed: a client can leave in the middle of one.
            Sim::start(&[
                "--preset",
                "llama-3.1-8b",
                "--served-model-name",
                "slow",
                "--output-len",
                "fixed:400",
            ]),
            // Refuses every request at once with 429 and its own Retry-After.
            Sim::start_tiny_fast(&["--served-model-name", "throttled", "--throttle-rate", "1"]),
        ];
        let sidecar = Sidecar::start(json!({
            "policy": "fair",
            "pools": [
                {"model": "tiny", "replicas": [sims[0].url]},
                {"model": "slow", "replicas": [sims[1].url]},
                {"model": "throttled", "replicas": [sims[2].url], "cache_isolation": "shared"},
            ],
        }));
        // `/alt/` goes to a port nothing listens on: Envoy answers those itself.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dead_port = closed.local_addr().unwrap().port();
        drop(closed);
        // To the sidecar over HTTP/2, as the shipped configs speak to it.
        let envoy = Envoy::start_http2(&weir_config(), sidecar.port, dead_port);
        sidecar.wait_for_probes(2);
        Stack {
            sims,
            sidecar,
            envoy,
        }
    })
}

/// One test at a time on the shared stack (the meters read whole-stack figures).
async fn turn() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::const_new(());
    let guard = TURN.lock().await;
    stack();
    guard
}

/// A request to the gateway with `key-{key}` in the header the API's clients use.
fn request(method: reqwest::Method, path: &str, key: &str) -> RequestBuilder {
    let url = format!("{}{path}", stack().envoy.url);
    let req = reqwest::Client::new().request(method, url);
    if path.ends_with("/v1/messages") {
        req.header("x-api-key", format!("key-{key}"))
            .header("anthropic-version", "2023-06-01")
    } else {
        req.bearer_auth(format!("key-{key}"))
    }
}

async fn post(path: &str, key: &str, body: &Value, idempotency_key: &str) -> Response {
    request(reqwest::Method::POST, path, key)
        .header("content-type", "application/json")
        .header("idempotency-key", idempotency_key)
        .body(body.to_string())
        .send()
        .await
        .unwrap()
}

/// Spends the one request a minute of key `key` on a chat completion.
async fn spend_the_minute(key: &str) {
    let body = body_for("chat_completions", "tiny", false, 5);
    let first = post("/v1/chat/completions", key, &body, &format!("{key}-first")).await;
    assert_eq!(first.status(), StatusCode::OK);
}

/// About `words` words of varied prose: long enough that the one-pass estimate and the
/// engine's exact count of it differ.
fn prose(words: usize) -> String {
    // Words such as "international" are one token to the engine and two to the estimate.
    let text = "Weir schedules international tenants across international pools of engines by \
        tokens, memory and time; international requests queue fairly.";
    text.split(' ')
        .cycle()
        .take(words)
        .collect::<Vec<_>>()
        .join(" ")
}

/// A request body for each API, each bringing a prompt of some length and asking for up to
/// `max_output` tokens (the simulator writes 20).
fn body_for(api: &str, model: &str, stream: bool, max_output: u64) -> Value {
    let text = prose(60);
    // Chat and completions streams show their usage only to a client that asks for it.
    let usage = stream.then(|| json!({"include_usage": true}));
    match api {
        "chat_completions" => json!({
            "model": model, "stream": stream, "max_tokens": max_output,
            "stream_options": usage,
            "messages": [{"role": "user", "content": text}],
            "tools": [{"type": "function", "function": {"name": "lookup",
                "description": "Find a fact", "parameters": {"type": "object",
                "properties": {"query": {"type": "string"}}}}}],
        }),
        "completions" => json!({
            "model": model, "stream": stream, "max_tokens": max_output,
            "stream_options": usage,
            "prompt": [text.clone(), prose(25)],
        }),
        "responses" => json!({
            "model": model, "stream": stream, "max_output_tokens": max_output,
            "instructions": "Answer briefly.", "input": text,
        }),
        "messages" => json!({
            "model": model, "stream": stream, "max_tokens": max_output,
            "system": "Answer briefly.", "messages": [{"role": "user", "content": text}],
        }),
        "embeddings" => json!({
            "model": model,
            "input": (0..32).map(|i| format!("{} {i}", prose(8))).collect::<Vec<_>>(),
        }),
        _ => unreachable!("{api}"),
    }
}

/// Server-sent events as `(event name, data)`.
fn events(text: &str) -> Vec<(Option<String>, Value)> {
    text.split("\n\n")
        .filter_map(|block| {
            let mut name = None;
            let mut data = None;
            for line in block.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = Some(n.to_owned());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data = Some(serde_json::from_str(d).unwrap_or_else(|_| json!(d)));
                }
            }
            Some((name, data?))
        })
        .collect()
}

/// `(prompt, completion)` tokens as the answer of `api` reports them (streamed or not).
fn reported_usage(api: &str, answer: &str, streamed: bool) -> (u64, u64) {
    let n = |v: &Value| v.as_u64().unwrap_or(0);
    let bodies: Vec<Value> = if streamed {
        events(answer).into_iter().map(|(_, data)| data).collect()
    } else {
        vec![serde_json::from_str(answer).unwrap()]
    };
    let mut usage = (0, 0);
    for body in &bodies {
        match api {
            "responses" => {
                let u = if streamed {
                    &body["response"]["usage"]
                } else {
                    &body["usage"]
                };
                if u.is_object() {
                    usage = (n(&u["input_tokens"]), n(&u["output_tokens"]));
                }
            }
            "messages" => {
                let start = &body["message"]["usage"];
                let u = if start.is_object() {
                    start
                } else {
                    &body["usage"]
                };
                if u.is_object() {
                    if u["input_tokens"].is_u64() {
                        usage.0 = n(&u["input_tokens"])
                            + n(&u["cache_read_input_tokens"])
                            + n(&u["cache_creation_input_tokens"]);
                    }
                    if u["output_tokens"].is_u64() {
                        usage.1 = n(&u["output_tokens"]);
                    }
                }
            }
            _ => {
                let u = &body["usage"];
                if u.is_object() {
                    usage = (n(&u["prompt_tokens"]), n(&u["completion_tokens"]));
                }
            }
        }
    }
    usage
}

/// The key's input and output buckets, as the gateway reports them on its model list (in
/// Anthropic's headers, which report the two apart), and when they were read.
async fn buckets(key: &str) -> (u64, u64, Instant) {
    let resp = request(reqwest::Method::GET, "/v1/models", key)
        .header("anthropic-version", "2023-06-01")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let header = |name: &str| -> u64 {
        resp.headers()
            .get(name)
            .unwrap_or_else(|| panic!("{name} missing"))
            .to_str()
            .unwrap()
            .parse()
            .unwrap()
    };
    (
        header("anthropic-ratelimit-input-tokens-remaining"),
        header("anthropic-ratelimit-output-tokens-remaining"),
        Instant::now(),
    )
}

/// The ledger's record of an idempotency key, once written.
fn record(idempotency_key: &str) -> weir_sidecar::ledger::UsageRecord {
    let rows = stack().sidecar.attempts(idempotency_key);
    assert_eq!(rows.len(), 1, "{idempotency_key}: {rows:?}");
    rows.into_iter().next().unwrap()
}

#[tokio::test]
async fn every_api_is_billed_the_engine_s_usage_and_moves_the_key_s_buckets_by_exactly_that() {
    let _turn = turn().await;
    for (api, path) in APIS {
        for stream in [false, true] {
            if stream && api == "embeddings" {
                continue;
            }
            let key = format!("meter-{api}");
            let trace = format!("meter-{api}-{stream}");
            let (in_before, out_before, before) = buckets(&key).await;
            let resp = request(reqwest::Method::POST, path, &key)
                .header("content-type", "application/json")
                .header("idempotency-key", &trace)
                .header("x-request-id", &trace)
                .body(body_for(api, "tiny", stream, 200).to_string())
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), StatusCode::OK, "{trace}");
            let answer = resp.text().await.unwrap();
            let (prompt, completion) = reported_usage(api, &answer, stream);
            let (in_after, out_after, after) = buckets(&key).await;

            assert!(prompt > 0, "{trace}: no usage in {answer}");
            if api == "embeddings" {
                assert_eq!(completion, 0, "{trace}");
            } else {
                // The answers are 20 tokens each (40 for the batch of two prompts), of 200
                // reserved per answer: the buckets move by what was used, not what was reserved.
                let answers = if api == "completions" { 2 } else { 1 };
                assert_eq!(completion, 20 * answers, "{trace}");
            }
            let row = record(&trace);
            assert_eq!(row.api, api, "{trace}");
            assert_eq!(
                (
                    row.prompt_tokens,
                    row.completion_tokens,
                    row.source.as_str()
                ),
                (prompt, completion, "engine"),
                "{trace}: the ledger bills the engine's usage"
            );
            let log = stack().envoy.access_log_fields(&trace);
            assert_eq!(log["api"], api, "{trace}");
            assert_eq!(log["tokens_in"], prompt.to_string(), "{trace}");
            assert_eq!(log["tokens_out"], completion.to_string(), "{trace}");
            // What the buckets refilled while the request ran (20 tokens a second), rounded up.
            let refill =
                (METER_LIMIT as f64 / 60.0 * (after - before).as_secs_f64()).ceil() as u64 + 1;
            let estimate: u64 = log["estimate"].parse().unwrap();
            assert!(
                estimate.abs_diff(prompt) > refill + 1,
                "{trace}: the estimate ({estimate}) must differ from the engine's count \
                 ({prompt}) by more than the refill ({refill}) for the buckets to tell them apart"
            );
            eprintln!(
                "{trace}: engine {prompt} in / {completion} out, estimate {estimate} in; \
                 buckets moved {} in / {} out (refill up to {refill})",
                in_before.saturating_sub(in_after),
                out_before.saturating_sub(out_after)
            );
            for (what, was, is, used) in [
                ("input", in_before, in_after, prompt),
                ("output", out_before, out_after, completion),
            ] {
                let moved = was.saturating_sub(is);
                assert!(
                    moved <= used + 1 && moved + refill >= used,
                    "{trace}: the {what} bucket moved by {moved}, the engine used {used} \
                     (refill up to {refill})"
                );
            }
        }
    }
}

#[tokio::test]
async fn over_quota_over_context_and_over_the_output_cap_get_each_api_s_own_error() {
    let _turn = turn().await;
    // The one request a minute of key `once` goes to chat; every API after it is over quota.
    spend_the_minute("once").await;
    for (api, path) in APIS {
        let cases = [
            ("over quota", "once", 5, StatusCode::TOO_MANY_REQUESTS),
            ("over context", "plain", 5000, StatusCode::BAD_REQUEST),
            ("over the output cap", "capped", 51, StatusCode::BAD_REQUEST),
        ];
        for (case, key, max_output, status) in cases {
            if api == "embeddings" && case != "over quota" {
                // Embeddings generate nothing: neither cap applies.
                continue;
            }
            let mut body = body_for(api, "tiny", false, max_output);
            if api == "embeddings" && case == "over context" {
                body["input"] = json!(prose(5000));
            }
            let idempotency_key = format!("{api}-{}", case.replace(' ', "-"));
            let resp = post(path, key, &body, &idempotency_key).await;
            assert_eq!(resp.status(), status, "{api} {case}");
            let headers = resp.headers().clone();
            let error: Value = resp.json().await.unwrap();
            if api == "messages" {
                assert_eq!(error["type"], "error", "{api} {case}: {error}");
                let kind = if status == StatusCode::TOO_MANY_REQUESTS {
                    "rate_limit_error"
                } else {
                    "invalid_request_error"
                };
                assert_eq!(error["error"]["type"], kind, "{api} {case}: {error}");
            } else {
                assert!(
                    error["error"]["message"].is_string(),
                    "{api} {case}: {error}"
                );
                let code = match case {
                    "over quota" => "rate_limit_exceeded",
                    "over context" => "context_length_exceeded",
                    _ => "max_tokens_over_limit",
                };
                if case != "over the output cap" {
                    assert_eq!(error["error"]["code"], code, "{api} {case}: {error}");
                }
            }
            if status == StatusCode::TOO_MANY_REQUESTS {
                assert!(headers.contains_key("retry-after"), "{api}");
                let limit = if api == "messages" {
                    "anthropic-ratelimit-requests-limit"
                } else {
                    "x-ratelimit-limit-requests"
                };
                assert_eq!(headers[limit], "1", "{api}");
            }
        }
    }
    // Refused at the door: none reached the sidecar (which records every attempt it serves).
    let reached: Vec<_> = stack()
        .sidecar
        .ledger_rows(None)
        .into_iter()
        .filter(|r| r.idempotency_key.contains("-over-"))
        .collect();
    assert!(
        reached.is_empty(),
        "refused requests reached the sidecar: {reached:?}"
    );
}

#[tokio::test]
async fn a_client_leaving_mid_stream_settles_and_cancels_upstream_on_every_streamed_api() {
    let _turn = turn().await;
    let slow = &stack().sims[1];
    for (api, path) in APIS.into_iter().filter(|(api, _)| *api != "embeddings") {
        let idempotency_key = format!("leave-{api}");
        let body = body_for(api, "slow", true, 400);
        let resp = post(path, "leaver", &body, &idempotency_key).await;
        assert_eq!(resp.status(), StatusCode::OK, "{api}");
        let mut stream = resp.bytes_stream();
        let mut seen = 0;
        while seen < 200 {
            seen += stream.next().await.unwrap().unwrap().len();
        }
        // A completions batch of two prompts runs as two sequences.
        let sequences = if api == "completions" { 2.0 } else { 1.0 };
        assert_eq!(
            slow.gauge("vllm:num_requests_running").await,
            sequences,
            "{api}"
        );
        drop(stream);
        // Polled without blocking the runtime, which still has the connection to close.
        let mut rows = Vec::new();
        for _ in 0..100 {
            rows = stack().sidecar.ledger_rows(Some("acme/lab/apis/leaver"));
            rows.retain(|r| r.idempotency_key == idempotency_key);
            if !rows.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let row = match rows.as_slice() {
            [row] if row.outcome == "cancelled" => row.clone(),
            _ => panic!("{api}: no cancelled record: {rows:?}"),
        };
        assert_eq!(row.api, api);
        assert!(
            row.completion_tokens < 400,
            "{api}: billed what streamed: {row:?}"
        );
        slow.wait_idle().await;
        assert_eq!(slow.gauge("vllm:num_requests_running").await, 0.0, "{api}");
    }
    // Each leaving was a reset of an HTTP/2 stream to the sidecar, not a closed connection.
    let envoy = &stack().envoy;
    assert!(envoy.stat("cluster.upstream.upstream_cx_http2_total").await >= Some(1));
    assert_eq!(
        envoy.stat("cluster.upstream.upstream_cx_http1_total").await,
        Some(0)
    );
    assert!(envoy.stat("cluster.upstream.upstream_rq_tx_reset").await >= Some(4));
    // Every slot of the key came back.
    let resp = request(reqwest::Method::GET, "/v1/models", "leaver")
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.headers()["x-ratelimit-remaining-concurrent-requests"],
        "8"
    );
}

/// The virtual token counter of the tenants' org in the `tiny` pool (metrics show orgs, not
/// keys): the calling test's tenant's, as tests take turns on the stack.
async fn counter() -> f64 {
    let metrics = stack().sidecar.metrics().await;
    let series = "weir_vtc_counter{tenant=\"acme\",pool=\"tiny\"} ";
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no counter for acme"))
}

#[tokio::test]
async fn the_fair_share_charges_embeddings_their_input_only() {
    let _turn = turn().await;
    // A long chat first: the tenant's counter is then above everyone's, so no lift moves it.
    let body = json!({"model": "tiny", "max_tokens": 20,
        "messages": [{"role": "user", "content": prose(400)}]});
    assert_eq!(
        post("/v1/chat/completions", "fair", &body, "fair-chat")
            .await
            .status(),
        200
    );
    let before = counter().await;
    let resp = post(
        "/v1/embeddings",
        "fair",
        &body_for("embeddings", "tiny", false, 0),
        "fair-embeddings",
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let prompt = resp.json::<Value>().await.unwrap()["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap();
    // Counted once the answer settles; weight 1, input weighs 1 (output 2, and there is none).
    let mut moved = 0.0;
    for _ in 0..50 {
        moved = counter().await - before;
        if moved >= prompt as f64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        moved, prompt as f64,
        "the counter moves by the engine's input count only"
    );
}

#[tokio::test]
async fn every_answer_carries_the_key_s_rate_limits_and_its_trace_id() {
    let _turn = turn().await;
    let resp = request(
        reqwest::Method::POST,
        "/v1/chat/completions",
        "meter-chat_completions",
    )
    .header("content-type", "application/json")
    .header("x-request-id", "trace-of-the-caller")
    .body(body_for("chat_completions", "tiny", false, 5).to_string())
    .send()
    .await
    .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let h = resp.headers();
    assert_eq!(h["x-request-id"], "trace-of-the-caller");
    assert_eq!(
        h["x-ratelimit-limit-tokens"],
        METER_LIMIT.to_string().as_str()
    );
    let remaining: u64 = h["x-ratelimit-remaining-tokens"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(remaining < METER_LIMIT);
    assert!(
        h["x-ratelimit-reset-tokens"]
            .to_str()
            .unwrap()
            .ends_with('s')
    );
    assert_eq!(h["x-ratelimit-limit-concurrent-requests"], "4");
    assert_eq!(h["x-ratelimit-remaining-concurrent-requests"], "3");

    let resp = post(
        "/v1/messages",
        "meter-messages",
        &body_for("messages", "tiny", false, 5),
        "headers-messages",
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let h = resp.headers();
    assert!(
        h.contains_key("x-request-id"),
        "Envoy names a request that came without an id"
    );
    for family in ["tokens", "input-tokens", "output-tokens"] {
        let reset = h[format!("anthropic-ratelimit-{family}-reset").as_str()]
            .to_str()
            .unwrap();
        assert!(
            reset.ends_with('Z') && reset.contains('T'),
            "RFC 3339: {reset}"
        );
    }
    assert!(
        !h.contains_key("x-ratelimit-limit-tokens"),
        "Anthropic's headers only"
    );
}

#[tokio::test]
async fn the_model_list_shows_only_the_models_the_key_may_use() {
    let _turn = turn().await;
    let ids = |list: &Value| -> Vec<String> {
        let mut ids: Vec<String> = list["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_owned())
            .collect();
        ids.sort();
        ids
    };
    let list = |key: &'static str, anthropic: bool| async move {
        let mut req = request(reqwest::Method::GET, "/v1/models", key);
        if anthropic {
            req = req.header("anthropic-version", "2023-06-01");
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        resp.json::<Value>().await.unwrap()
    };
    let all = list("plain", false).await;
    assert_eq!(all["object"], "list");
    assert_eq!(ids(&all), ["slow", "throttled", "tiny"]);
    assert_eq!(all["data"][0]["object"], "model");
    let narrow = list("restricted", false).await;
    assert_eq!(ids(&narrow), ["tiny"]);
    let anthropic = list("restricted", true).await;
    assert_eq!(ids(&anthropic), ["tiny"]);
    assert_eq!(anthropic["data"][0]["type"], "model");
    assert_eq!(anthropic["has_more"], false);
}

#[tokio::test]
async fn an_engine_s_own_retry_after_reaches_the_caller() {
    let _turn = turn().await;
    for (api, path) in APIS {
        let resp = post(
            path,
            "plain",
            &body_for(api, "throttled", false, 5),
            &format!("throttled-{api}"),
        )
        .await;
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS, "{api}");
        // The engine's 1 s, spread up to half as long again so throttled callers part.
        let retry_after = weir_e2e::retry_after(&resp);
        assert!(
            (1..=2).contains(&retry_after),
            "{api}: the engine's Retry-After, got {retry_after}"
        );
        let row = record(&format!("throttled-{api}"));
        assert_eq!(
            (row.prompt_tokens, row.completion_tokens, row.api.as_str()),
            (0, 0, api),
            "a refused attempt bills nothing"
        );
    }
}

#[tokio::test]
async fn envoy_s_own_refusals_reach_each_client_in_its_api_s_shape() {
    let _turn = turn().await;
    // `/alt/` has no upstream that answers: Envoy's own 503.
    let messages = post(
        "/alt/v1/messages",
        "plain",
        &body_for("messages", "tiny", false, 5),
        "dead-messages",
    )
    .await;
    assert_eq!(messages.status(), StatusCode::SERVICE_UNAVAILABLE);
    let error: Value = messages.json().await.unwrap();
    assert_eq!(error["type"], "error", "{error}");
    assert_eq!(error["error"]["type"], "api_error", "{error}");
    let chat = post(
        "/alt/v1/chat/completions",
        "plain",
        &body_for("chat_completions", "tiny", false, 5),
        "dead-chat",
    )
    .await;
    assert_eq!(chat.status(), StatusCode::SERVICE_UNAVAILABLE);
    let error: Value = chat.json().await.unwrap();
    assert!(error["error"]["message"].is_string(), "{error}");
    assert!(error.get("type").is_none(), "OpenAI's shape: {error}");
    assert_eq!(error["error"]["type"], "server_error", "{error}");
    assert!(error["error"]["code"].is_null(), "{error}");
    // An Anthropic client is recognised by its version header on any path, a bad key included.
    let denied = reqwest::Client::new()
        .get(format!("{}/v1/models", stack().envoy.url))
        .header("x-api-key", "key-nobody")
        .header("anthropic-version", "2023-06-01")
        .send()
        .await
        .unwrap();
    assert_eq!(denied.status(), StatusCode::UNAUTHORIZED);
    let error: Value = denied.json().await.unwrap();
    assert_eq!(error["error"]["type"], "authentication_error", "{error}");
}

/// The `type` and `code` each provider sends for an exit (see `core/tests/error_shapes.rs` for
/// the providers' documentation): OpenAI's for Chat Completions, Anthropic's for Messages.
struct Exit {
    what: &'static str,
    status: StatusCode,
    openai: (&'static str, Option<&'static str>),
    anthropic: &'static str,
}

#[tokio::test]
async fn the_gateway_s_exits_answer_in_each_provider_s_own_error_values() {
    let _turn = turn().await;
    let exits = [
        Exit {
            what: "no key",
            status: StatusCode::UNAUTHORIZED,
            openai: ("invalid_request_error", Some("invalid_api_key")),
            anthropic: "authentication_error",
        },
        Exit {
            what: "over quota",
            status: StatusCode::TOO_MANY_REQUESTS,
            openai: ("requests", Some("rate_limit_exceeded")),
            anthropic: "rate_limit_error",
        },
        Exit {
            what: "too large",
            status: StatusCode::PAYLOAD_TOO_LARGE,
            openai: ("invalid_request_error", None),
            anthropic: "request_too_large",
        },
        Exit {
            what: "unknown model",
            status: StatusCode::NOT_FOUND,
            openai: ("invalid_request_error", Some("model_not_found")),
            anthropic: "not_found_error",
        },
    ];
    // Key `spent`'s one request a minute goes here; both APIs are over quota after it.
    spend_the_minute("spent").await;
    for (api, path) in [
        ("chat_completions", "/v1/chat/completions"),
        ("messages", "/v1/messages"),
    ] {
        for exit in &exits {
            let idempotency_key = format!("exit-{api}-{}", exit.what.replace(' ', "-"));
            let mut body = body_for(api, "tiny", false, 5);
            let key = match exit.what {
                "over quota" => "spent",
                _ => "plain",
            };
            if exit.what == "too large" {
                body["metadata"] = json!({"note": "x".repeat(5 << 20)});
            }
            if exit.what == "unknown model" {
                body["model"] = json!("nope");
            }
            let resp = match exit.what {
                "no key" => reqwest::Client::new()
                    .post(format!("{}{path}", stack().envoy.url))
                    .header("content-type", "application/json")
                    .header("idempotency-key", &idempotency_key)
                    .body(body.to_string())
                    .send()
                    .await
                    .unwrap(),
                _ => post(path, key, &body, &idempotency_key).await,
            };
            let what = format!("{api}, {}", exit.what);
            assert_eq!(resp.status(), exit.status, "{what}");
            let error: Value = resp.json().await.unwrap();
            assert!(error["error"]["message"].is_string(), "{what}: {error}");
            if api == "messages" {
                assert_eq!(error["type"], "error", "{what}: {error}");
                assert_eq!(error["error"]["type"], exit.anthropic, "{what}: {error}");
            } else {
                let (kind, code) = exit.openai;
                assert_eq!(error["error"]["type"], kind, "{what}: {error}");
                assert_eq!(error["error"]["code"], json!(code), "{what}: {error}");
                assert!(error["error"]["param"].is_null(), "{what}: {error}");
            }
            if exit.what == "unknown model" && api == "chat_completions" {
                assert_eq!(
                    error["error"]["message"],
                    "The model `nope` does not exist or you do not have access to it.",
                    "{what}"
                );
            }
        }
    }
}

#[tokio::test]
async fn an_unknown_model_is_refused_at_the_front_door_and_takes_no_quota() {
    let _turn = turn().await;
    let refused_before = stack()
        .envoy
        .stats()
        .await
        .get("weir.rejections.model_not_found")
        .copied()
        .unwrap_or(0);
    // Key `unknown-then` may send three requests a minute: five for a model nobody serves
    // first, then its three.
    for i in 0..5 {
        let idempotency_key = format!("unknown-{i}");
        let resp = post(
            "/v1/chat/completions",
            "unknown-then",
            &body_for("chat_completions", "gpt-none", false, 5),
            &idempotency_key,
        )
        .await;
        assert_eq!(resp.status(), StatusCode::NOT_FOUND, "{idempotency_key}");
        let error: Value = resp.json().await.unwrap();
        assert_eq!(error["error"]["code"], "model_not_found", "{error}");
        assert!(
            stack().sidecar.attempts(&idempotency_key).is_empty(),
            "{idempotency_key} reached the scheduler"
        );
    }
    let refused = stack().envoy.stats().await["weir.rejections.model_not_found"];
    assert_eq!(refused - refused_before, 5);
    let mut statuses = Vec::new();
    for i in 0..3 {
        let body = body_for("chat_completions", "tiny", false, 5);
        let resp = post(
            "/v1/chat/completions",
            "unknown-then",
            &body,
            &format!("known-{i}"),
        )
        .await;
        statuses.push(resp.status());
    }
    assert_eq!(
        statuses,
        [StatusCode::OK; 3],
        "the key's three requests are all left"
    );
}

#[tokio::test]
async fn a_body_the_filter_admits_is_never_too_large_for_the_sidecar() {
    let _turn = turn().await;
    // 3 MiB of a field that stays out of the prompt: under the filter's 4 MiB limit (axum's
    // default limit of 2 MB refused such bodies at the sidecar).
    let body = json!({"model": "tiny", "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"note": "x".repeat(3 << 20)}});
    let resp = post("/v1/chat/completions", "plain", &body, "large-body").await;
    assert_eq!(
        resp.status(),
        StatusCode::OK,
        "{}",
        resp.text().await.unwrap()
    );
}
