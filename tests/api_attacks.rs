//! Attacks on the metered APIs. Through the front door alone: real Envoy with the filter in
//! front of an upstream that behaves as weir must not assume engines do — one that puts its own
//! rate-limit headers on every answer (a hosted API's figures are its whole account's, every
//! tenant's), and one that answers a stream as a single JSON body or a plain request as a stream.
//! Through the whole gateway: a request that the engine runs as several sequences (a completions
//! batch) in front of an engine with few slots.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::io::{BufRead, BufReader, Read, Write};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{Value, json};
use weir_e2e::{Envoy, Sidecar, Sim, api_key, api_key_limited};

/// What the upstream reports of its own account on every answer.
const PLATFORM_REMAINING: &str = "424242";
/// The usage the upstream reports, whatever it was asked.
const PROMPT: u64 = 11;
const COMPLETION: u64 = 33;

/// A request carrying this header is answered as an event stream, any other as one JSON body.
const ANSWER_AS_STREAM: &str = "x-test-answer-as-stream";

fn chat_answer() -> String {
    json!({
        "id": "c", "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello there"},
            "finish_reason": "stop"}],
        "usage": {"prompt_tokens": PROMPT, "completion_tokens": COMPLETION,
            "total_tokens": PROMPT + COMPLETION},
    })
    .to_string()
}

fn chat_stream() -> String {
    let chunk = json!({"id": "c", "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": "hello there"}, "finish_reason": null}]});
    let usage = json!({"id": "c", "object": "chat.completion.chunk", "choices": [],
        "usage": {"prompt_tokens": PROMPT, "completion_tokens": COMPLETION,
            "total_tokens": PROMPT + COMPLETION}});
    format!("data: {chunk}\n\ndata: {usage}\n\ndata: [DONE]\n\n")
}

/// Serves the upstream on a free loopback port until the test binary exits; returns the port.
fn upstream() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || serve(conn));
        }
    });
    port
}

fn serve(conn: std::net::TcpStream) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut conn = conn;
    loop {
        let (mut length, mut as_stream) = (0, false);
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let lower = line.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
            as_stream |= lower.starts_with(ANSWER_AS_STREAM);
            if line == "\r\n" {
                break;
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let (content_type, answer) = if as_stream {
            ("text/event-stream", chat_stream())
        } else {
            ("application/json", chat_answer())
        };
        let response = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\
             x-ratelimit-limit-tokens: 1000000\r\n\
             x-ratelimit-remaining-tokens: {PLATFORM_REMAINING}\r\n\
             x-ratelimit-reset-tokens: 6s\r\n\
             anthropic-ratelimit-tokens-remaining: {PLATFORM_REMAINING}\r\n\r\n{answer}",
            answer.len()
        );
        if conn.write_all(response.as_bytes()).is_err() {
            return;
        }
    }
}

fn envoy() -> &'static Envoy {
    static ENVOY: OnceLock<Envoy> = OnceLock::new();
    ENVOY.get_or_init(|| {
        let port = upstream();
        let config = json!({
            "orgs": [{"id": "acme", "workspaces": [{"id": "w", "projects": [{"id": "p", "keys": [
                api_key("unlimited"),
                api_key_limited("limited", json!({"output_tokens_per_minute": 100000})),
            ]}]}]}],
            "routes": {"default": {"mode": "enforce"}, "by_name": {"shadowed": {"mode": "shadow"}}},
        });
        Envoy::start(&config, port, port)
    })
}

async fn post(path: &str, key: &str, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut req = reqwest::Client::new()
        .post(format!("{}{path}", envoy().url))
        .header("content-type", "application/json")
        .body(body.to_string());
    req = if path.ends_with("/v1/messages") {
        req.header("x-api-key", format!("key-{key}"))
            .header("anthropic-version", "2023-06-01")
    } else {
        req.bearer_auth(format!("key-{key}"))
    };
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    req.send().await.unwrap()
}

fn chat(stream: bool) -> Value {
    json!({"model": "m", "stream": stream, "max_tokens": 50,
        "messages": [{"role": "user", "content": "hello"}]})
}

#[tokio::test]
async fn an_upstream_s_own_rate_limit_figures_never_reach_a_tenant() {
    let messages = json!({"model": "m", "max_tokens": 50,
        "messages": [{"role": "user", "content": "hello"}]});
    for (path, key, body) in [
        // A key with no limits of its own: nothing of weir's to report in their place.
        ("/v1/chat/completions", "unlimited", chat(false)),
        ("/v1/messages", "unlimited", messages.clone()),
        // Shadow routes report no standing (they hold none) but meter for the tenant all the same.
        ("/shadow/v1/chat/completions", "limited", chat(false)),
        ("/shadow/v1/messages", "limited", messages),
    ] {
        let resp = post(path, key, &body, &[]).await;
        assert_eq!(resp.status(), StatusCode::OK, "{path} {key}");
        for (name, value) in resp.headers() {
            let name = name.as_str();
            assert!(
                !(name.starts_with("x-ratelimit-") || name.starts_with("anthropic-ratelimit-")),
                "{path} {key}: the upstream's {name}: {value:?} reached the tenant"
            );
        }
    }
    // Where weir holds limits, its own figures stand in the upstream's place.
    let resp = post("/v1/chat/completions", "limited", &chat(false), &[]).await;
    let remaining = resp.headers()["x-ratelimit-remaining-tokens"]
        .to_str()
        .unwrap();
    assert_ne!(remaining, PLATFORM_REMAINING);
}

#[tokio::test]
async fn an_answer_in_the_other_shape_than_asked_is_billed_the_usage_it_reports() {
    // A stream asked for, one JSON body answered: a stream meter finds no event in it.
    let resp = post(
        "/v1/chat/completions",
        "unlimited",
        &chat(true),
        &[("x-request-id", "asked-a-stream")],
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        resp.text().await.unwrap(),
        chat_answer(),
        "passed on untouched"
    );
    let log = envoy().access_log_fields("asked-a-stream");
    assert_eq!(
        (log["tokens_in"].as_str(), log["tokens_out"].as_str()),
        (PROMPT.to_string().as_str(), COMPLETION.to_string().as_str()),
        "billed the usage the body reports: {log:?}"
    );
    // A plain answer asked for, a stream answered: a body meter cannot parse it.
    let resp = post(
        "/v1/chat/completions",
        "unlimited",
        &chat(false),
        &[("x-request-id", "asked-a-body"), (ANSWER_AS_STREAM, "1")],
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        resp.text().await.unwrap(),
        chat_stream(),
        "passed on untouched"
    );
    let log = envoy().access_log_fields("asked-a-body");
    assert_eq!(
        (log["tokens_in"].as_str(), log["tokens_out"].as_str()),
        (PROMPT.to_string().as_str(), COMPLETION.to_string().as_str()),
        "billed the usage the stream reports: {log:?}"
    );
}

/// An engine with two slots (llama.cpp's, read by the sidecar from its `/props`) behind the
/// sidecar, and the gateway in front.
struct Slots {
    sim: Sim,
    sidecar: Sidecar,
    envoy: Envoy,
}

fn slots() -> &'static Slots {
    static SLOTS: OnceLock<Slots> = OnceLock::new();
    SLOTS.get_or_init(|| {
        // An 8B model at real speed: a batch's 300 tokens take a few seconds.
        let sim = Sim::start(&[
            "--preset",
            "llama-3.1-8b",
            "--metrics-dialect",
            "llamacpp",
            "--slots",
            "2",
            "--served-model-name",
            "two-slots",
            "--output-len",
            "fixed:300",
        ]);
        let sidecar = Sidecar::start(json!({
            "policy": "fair",
            "pools": [{"model": "two-slots", "replicas": [sim.url]}],
        }));
        let config = json!({
            "orgs": [{"id": "acme", "workspaces": [{"id": "w", "projects": [{"id": "p", "keys": [
                api_key("batcher"), api_key("neighbour"), api_key("leaver"),
            ]}]}]}],
            "models": {"two-slots": {"max_context_tokens": 4096}},
        });
        let envoy = Envoy::start(&config, sidecar.port, sidecar.port);
        sidecar.wait_for_probes(1);
        Slots {
            sim,
            sidecar,
            envoy,
        }
    })
}

#[tokio::test]
async fn a_batch_holds_a_slot_per_prompt_so_no_request_queues_inside_the_engine() {
    let stack = slots();
    let url = format!("{}/v1/completions", stack.envoy.url);
    let client = reqwest::Client::new();
    // One request, two prompts: two sequences, each in a slot of its own.
    let batch = client
        .post(&url)
        .bearer_auth("key-batcher")
        .json(
            &json!({"model": "two-slots", "prompt": ["one", "two"], "max_tokens": 300,
            "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(batch.status(), StatusCode::OK);
    let started = Instant::now();
    while stack.sim.gauge("llamacpp:requests_processing").await < 2.0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the batch runs"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Both slots are taken: the neighbour's request must wait in weir, not in the engine.
    let neighbour = tokio::spawn(
        client
            .post(&url)
            .bearer_auth("key-neighbour")
            .json(&json!({"model": "two-slots", "prompt": "three", "max_tokens": 5}))
            .send(),
    );
    let mut most_deferred = 0.0f64;
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_millis(800) {
        most_deferred = most_deferred.max(stack.sim.gauge("llamacpp:requests_deferred").await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        most_deferred, 0.0,
        "a request waited inside the engine behind a batch counted as one sequence"
    );
    drop(batch);
    let neighbour = neighbour.await.unwrap().unwrap();
    assert_eq!(
        neighbour.status(),
        StatusCode::OK,
        "served once the batch is gone"
    );
}

// Several threads: the ledger is read blocking while the runtime closes the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_messages_stream_left_before_its_message_delta_is_billed_what_streamed() {
    let stack = slots();
    // `message_start` carries the prompt's count and a placeholder output of 0; the output's
    // count comes only in `message_delta`, at the end.
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/messages", stack.envoy.url))
        .header("x-api-key", "key-leaver")
        .header("anthropic-version", "2023-06-01")
        .header("idempotency-key", "leave-messages")
        .header("x-request-id", "leave-messages")
        .json(
            &json!({"model": "two-slots", "max_tokens": 300, "stream": true,
            "messages": [{"role": "user", "content": "hello"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut stream = resp.bytes_stream();
    let mut text = String::new();
    while text.matches("text_delta").count() < 10 {
        text.push_str(&String::from_utf8_lossy(
            &stream.next().await.unwrap().unwrap(),
        ));
    }
    drop(stream);
    let mut rows = Vec::new();
    for _ in 0..100 {
        rows = stack.sidecar.attempts("leave-messages");
        if !rows.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let [row] = rows.as_slice() else {
        panic!("one record: {rows:?}")
    };
    assert_eq!(row.outcome, "cancelled", "{row:?}");
    assert!(
        (10..300).contains(&row.completion_tokens),
        "the ledger bills what streamed: {row:?}"
    );
    let line = stack.envoy.access_log_for("leave-messages");
    let tokens_out: u64 = line
        .first()
        .and_then(|l| l.split(' ').find_map(|f| f.strip_prefix("tokens_out=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(
        tokens_out >= 10,
        "the filter charges what streamed: {line:?}"
    );
}
