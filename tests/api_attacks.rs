//! Attacks on the metered APIs through the front door alone: real Envoy with the filter in front
//! of an upstream that behaves as weir must not assume engines do — one that puts its own
//! rate-limit headers on every answer (a hosted API's figures are its whole account's, every
//! tenant's), and one that answers a stream as a single JSON body or a plain request as a stream.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::OnceLock;

use reqwest::StatusCode;
use serde_json::{Value, json};
use weir_e2e::{Envoy, api_key, api_key_limited};

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
            "routes": {"by_name": {"shadowed": {"mode": "shadow"}}},
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

/// `name=value` fields of the access-log line of the request with trace id `trace`.
fn logged(trace: &str) -> HashMap<String, String> {
    let lines = envoy().access_log_for(trace);
    assert_eq!(lines.len(), 1, "{trace}: {lines:?}");
    lines[0]
        .split(' ')
        .filter_map(|f| f.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
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
    let log = logged("asked-a-stream");
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
    let log = logged("asked-a-body");
    assert_eq!(
        (log["tokens_in"].as_str(), log["tokens_out"].as_str()),
        (PROMPT.to_string().as_str(), COMPLETION.to_string().as_str()),
        "billed the usage the stream reports: {log:?}"
    );
}
