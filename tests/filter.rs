//! The weir filter in real Envoy (`--concurrency 2`), in front of the real simulator, on
//! loopback. One Envoy and its upstreams serve every test in this binary; each test uses its
//! own API key so they can run in parallel.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use reqwest::{Response, StatusCode};
use serde_json::{Value, json};
use weir_core::keys::hash_key;
use weir_e2e::{Envoy, Sim, api_key_limited, chat_body, metric_sum, post_json};

struct Stack {
    sim: Sim,
    _flaky: Sim,
    envoy: Envoy,
}

/// Keys and their limits. Each test owns one key.
fn weir_config() -> Value {
    let key = api_key_limited;
    json!({
        "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "e2e", "keys": [
            key("plain", json!({})),
            key("budget", json!({"input_tokens_per_minute": 3000})),
            key("neighbour", json!({"input_tokens_per_minute": 3000})),
            key("exactly", json!({"input_tokens_per_minute": 1000})),
            key("refund", json!({"output_tokens_per_minute": 600})),
            key("slots", json!({"concurrent_requests": 3})),
            key("single", json!({"concurrent_requests": 1})),
            key("reset", json!({"concurrent_requests": 1})),
            key("shadowed", json!({"requests_per_minute": 1})),
            {"id": "narrow", "sha256": hash_key("key-narrow"), "policy": {"models": ["other-model"]}},
        ]}]}]}],
        "models": {"tiny": {"max_context_tokens": 4096}},
        "routes": {"default": {"mode": "enforce"}, "by_name": {"shadowed": {"mode": "shadow"}}},
        "max_body_bytes": 65536,
    })
}

fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(|| {
        let sim = Sim::start(&[
            "--preset",
            "tiny",
            "--time-scale",
            "5",
            "--output-len",
            "fixed:20",
            "--record-requests",
            "500",
        ]);
        let flaky = Sim::start(&["--preset", "tiny", "--time-scale", "5", "--drop-after", "5"]);
        let envoy = Envoy::start(&weir_config(), sim.port, flaky.port);
        Stack {
            sim,
            _flaky: flaky,
            envoy,
        }
    })
}

fn chat(content: &str, extra: Value) -> Value {
    chat_body("tiny", content, extra)
}

async fn post(path: &str, key: Option<&str>, body: impl Into<reqwest::Body>) -> Response {
    post_with(path, key, body, &[]).await
}

async fn post_with(
    path: &str,
    key: Option<&str>,
    body: impl Into<reqwest::Body>,
    headers: &[(&str, &str)],
) -> Response {
    post_json(&format!("{}{path}", stack().envoy.url), key, body, headers).await
}

async fn error_body(resp: Response) -> Value {
    resp.json::<Value>().await.unwrap()["error"].clone()
}

const CHAT: &str = "/v1/chat/completions";

#[tokio::test]
async fn requests_without_a_valid_key_get_401() {
    let body = chat("hello", json!({"max_tokens": 1})).to_string();
    for key in [None, Some("nobody")] {
        let resp = post(CHAT, key, body.clone()).await;
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
        let err = error_body(resp).await;
        assert_eq!(err["code"], "invalid_api_key");
        assert!(err["message"].is_string());
    }
}

/// The filter's header edits touch only the headers it owns: the caller's others reach the
/// upstream as sent — repeated ones each in order, bytes that are not UTF-8 unchanged.
#[tokio::test]
async fn the_callers_other_headers_reach_the_upstream_as_sent() {
    let id = "headers-as-sent-1";
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert("x-request-id", id.parse().unwrap());
    headers.append("x-repeated", "one".parse().unwrap());
    headers.append("x-repeated", "two".parse().unwrap());
    let raw = b"caf\xe9 \xff";
    headers.insert(
        "x-latin1",
        reqwest::header::HeaderValue::from_bytes(raw).unwrap(),
    );
    let resp = reqwest::Client::new()
        .post(format!("{}{CHAT}", stack().envoy.url))
        .bearer_auth("key-plain")
        .headers(headers)
        .header("content-type", "application/json")
        .body(chat("as sent", json!({"max_tokens": 1})).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);

    let received = stack().sim.received().await;
    let seen = received
        .iter()
        .find(|r| r["headers"]["x-request-id"] == id)
        .expect("the upstream saw the request");
    assert_eq!(seen["path"], CHAT);
    let pairs = seen["header_pairs"].as_array().unwrap();
    let values = |name: &str| -> Vec<Vec<u8>> {
        pairs
            .iter()
            .filter(|p| p[0] == name)
            .map(|p| serde_json::from_value(p[1].clone()).unwrap())
            .collect()
    };
    assert_eq!(values("x-repeated"), [b"one".to_vec(), b"two".to_vec()]);
    assert_eq!(values("x-latin1"), [raw.to_vec()]);
    assert_eq!(values("x-weir-tenant"), [b"acme/lab/e2e/plain".to_vec()]);
    assert!(
        values("authorization").is_empty(),
        "the key stops at the gateway"
    );
    assert_eq!(values("accept-encoding"), [b"identity".to_vec()]);
}

#[tokio::test]
async fn spoofed_identity_and_cache_salt_never_reach_the_upstream() {
    let id = "spoof-check-1";
    let body = chat(
        "who am I?",
        json!({"max_tokens": 1, "cache_salt": "peek-at-others"}),
    );
    let headers = [
        ("x-weir-tenant", "victim/corp/x/y"),
        ("X-Weir-Priority", "interactive"),
        ("x-request-id", id),
    ];
    let resp = post_with(CHAT, Some("plain"), body.to_string(), &headers).await;
    assert_eq!(resp.status(), StatusCode::OK);

    let received = stack().sim.received().await;
    let seen = received
        .iter()
        .find(|r| r["headers"]["x-request-id"] == id)
        .expect("the upstream saw the request");
    let h = &seen["headers"];
    assert_ne!(h["x-weir-request-id"], id, "weir ids its own attempts");
    assert!(
        h["x-weir-signature"].is_string(),
        "what weir vouches for is signed"
    );
    assert_eq!(
        h["x-weir-tenant"], "acme/lab/e2e/plain",
        "tenant comes from the key"
    );
    assert_eq!(
        h["x-weir-org"], "acme",
        "and its org, which Envoy hashes on to pick the org's sidecar"
    );
    assert_eq!(h["x-weir-priority"], "interactive");
    assert!(
        h.get("authorization").is_none(),
        "the key stops at the gateway"
    );
    let logged = stack().envoy.access_log_fields(id);
    assert_eq!(logged["outcome"], "ok", "metered: {logged:?}");
    assert!(logged["estimate"].parse::<u64>().unwrap() > 0, "{logged:?}");
    assert!(seen["body"].get("cache_salt").is_none());
    assert_eq!(seen["body"]["messages"][0]["content"], "who am I?");
}

#[tokio::test]
async fn a_tenant_over_its_input_budget_gets_429_while_another_is_served() {
    // ~100-token prompts against 3,000 input tokens/min: about 30 fit, then 429s.
    let body = chat(
        &"tokens and more tokens ".repeat(24),
        json!({"max_tokens": 1}),
    )
    .to_string();
    let mut denied = None;
    for _ in 0..60 {
        let resp = post(CHAT, Some("budget"), body.clone()).await;
        if resp.status() == StatusCode::TOO_MANY_REQUESTS {
            denied = Some(resp);
            break;
        }
        assert_eq!(resp.status(), StatusCode::OK);
    }
    let denied = denied.expect("the budget runs out");
    let retry_after = weir_e2e::retry_after(&denied);
    assert!((1..=3).contains(&retry_after), "{retry_after}");
    assert!(
        denied
            .headers()
            .contains_key("x-ratelimit-remaining-tokens")
    );
    let err = error_body(denied).await;
    assert_eq!(err["code"], "rate_limit_exceeded");
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("input_tokens_per_minute")
    );

    // The neighbour, same Envoy, same moment: served.
    assert_eq!(
        post(CHAT, Some("neighbour"), body.clone()).await.status(),
        StatusCode::OK
    );

    // Served once the bucket refills, by following Retry-After. A refusal before the body is
    // read (the bucket in debt: the last answer's exact count was above its estimate) names
    // when the debt is repaid, which is all it knows; the request may then wait once more, for
    // its own tokens. A ~100-token prompt at 50 tokens/s is served within a few seconds.
    let mut waits = vec![retry_after];
    loop {
        tokio::time::sleep(Duration::from_secs(*waits.last().unwrap())).await;
        let again = post(CHAT, Some("budget"), body.clone()).await;
        if again.status() == StatusCode::OK {
            break;
        }
        let headers = format!("{:?}", again.headers());
        assert_eq!(again.status(), StatusCode::TOO_MANY_REQUESTS, "{headers}");
        let wait = weir_e2e::retry_after(&again);
        waits.push(wait);
        assert!(
            waits.len() <= 3 && waits.iter().sum::<u64>() <= 5,
            "still refused after waiting {waits:?} s: {headers} {}",
            again.text().await.unwrap_or_default()
        );
    }
}

#[tokio::test]
async fn a_prompt_the_estimate_puts_over_a_token_limit_is_counted_exactly_before_it_is_refused() {
    // ~600 of the key's 1,000 input tokens a minute go to a first prompt (settled at the
    // engine's exact count), leaving ~400.
    let first = chat(&"word ".repeat(590), json!({"max_tokens": 1})).to_string();
    assert_eq!(
        post(CHAT, Some("exactly"), first).await.status(),
        StatusCode::OK
    );
    // Text the one-pass estimate counts high: ~447 tokens by the estimate, more than is left;
    // ~251 counted exactly, which fit.
    let punctuated = chat(&"a-b-c-d-e-f ".repeat(40), json!({"max_tokens": 1})).to_string();
    let resp = post(CHAT, Some("exactly"), punctuated.clone()).await;
    assert_eq!(
        resp.status(),
        StatusCode::OK,
        "{}",
        resp.text().await.unwrap()
    );
    // Counted exactly, the same prompt again does not fit what is left: the limit holds.
    let resp = post(CHAT, Some("exactly"), punctuated).await;
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn header_values_that_are_not_utf8_are_read_not_trapped_on() {
    // HTTP/1.1 lets a value carry bytes that are not UTF-8 (obs-text); the SDK's string reading
    // of them panics, which traps the VM and fails the request with a 5xx.
    let latin1 = reqwest::header::HeaderValue::from_bytes(b"caf\xe9").unwrap();
    let body = chat("hello", json!({"max_tokens": 1})).to_string();
    let resp = reqwest::Client::new()
        .post(format!("{}{CHAT}", stack().envoy.url))
        .header("content-type", "application/json")
        .bearer_auth("key-plain")
        .header("x-note", latin1.clone())
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.status(),
        StatusCode::OK,
        "{}",
        resp.text().await.unwrap()
    );
    // Such a key is no known key: refused as one, by weir.
    let mut bad_key = b"Bearer key-plain".to_vec();
    bad_key.push(0xe9);
    let resp = reqwest::Client::new()
        .post(format!("{}{CHAT}", stack().envoy.url))
        .header("content-type", "application/json")
        .header(
            "authorization",
            reqwest::header::HeaderValue::from_bytes(&bad_key).unwrap(),
        )
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(error_body(resp).await["code"], "invalid_api_key");
    // A header *name* with such bytes would panic the SDK too, but it is no HTTP token: Envoy's
    // codec refuses the request before the filter sees it.
    let addr = stack().envoy.url.trim_start_matches("http://").to_owned();
    let answer = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut conn = std::net::TcpStream::connect(addr).unwrap();
        let mut head =
            format!("POST {CHAT} HTTP/1.1\r\nHost: weir\r\nAuthorization: Bearer key-plain\r\n")
                .into_bytes();
        head.extend_from_slice(b"x-caf\xe9: 1\r\nContent-Length: 2\r\n\r\n{}");
        conn.write_all(&head).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut answer = vec![0u8; 4096];
        let n = conn.read(&mut answer).unwrap_or(0);
        String::from_utf8_lossy(&answer[..n]).into_owned()
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
}

/// Reads a stream, returning its events and how many separate reads delivered them.
async fn read_stream(mut resp: Response) -> (Vec<String>, usize, Duration) {
    let start = Instant::now();
    let (mut text, mut reads, mut first, mut last) = (String::new(), 0, None, start);
    while let Some(chunk) = resp.chunk().await.unwrap() {
        reads += 1;
        first.get_or_insert_with(Instant::now);
        last = Instant::now();
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let spread = last - first.unwrap_or(last);
    let events = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(str::to_owned)
        .collect();
    (events, reads, spread)
}

#[tokio::test]
async fn streams_pass_chunk_by_chunk_and_settle_to_engine_usage() {
    let id = "refund-stream-1";
    let body = chat("stream to me", json!({"stream": true, "max_tokens": 500}));
    let resp = post_with(
        CHAT,
        Some("refund"),
        body.to_string(),
        &[("x-request-id", id)],
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let (events, _, _) = read_stream(resp).await;
    assert_eq!(events.last().map(String::as_str), Some("data: [DONE]"));
    assert!(
        events.iter().all(|e| !e.contains("\"usage\"")),
        "no usage chunk unless asked for"
    );
    let tokens = events
        .iter()
        .filter(|e| e.contains("\"content\":\"") && !e.contains("\"content\":\"\""))
        .count();
    assert_eq!(tokens, 20, "the simulator generates 20 tokens");

    // Charged what the engine reported, not the 500 reserved: the unused 480 came back, so a
    // second 500-token reservation fits in the 600/min output budget right away.
    let log = stack().envoy.access_log_for(id);
    assert!(
        log.iter()
            .any(|l| l.contains("tokens_out=20 ") && l.contains("outcome=ok")),
        "{log:?}"
    );
    let again = chat(
        "and again",
        json!({"stream": true, "max_tokens": 500, "stream_options": {"include_usage": true}}),
    );
    let resp = post(CHAT, Some("refund"), again.to_string()).await;
    assert_eq!(resp.status(), StatusCode::OK, "fits only after the refund");
    let (events, _, _) = read_stream(resp).await;
    let usage: Value = serde_json::from_str(
        events
            .iter()
            .find(|e| e.contains("\"usage\""))
            .unwrap()
            .trim_start_matches("data: "),
    )
    .unwrap();
    assert_eq!(
        usage["usage"]["completion_tokens"], 20,
        "asked for, so passed through"
    );
}

#[tokio::test]
async fn long_streams_arrive_incrementally() {
    let body = chat(
        "a long one",
        json!({"stream": true, "max_tokens": 300, "ignore_eos": true}),
    );
    let start = Instant::now();
    let resp = post(CHAT, Some("plain"), body.to_string()).await;
    let (events, reads, spread) = read_stream(resp).await;
    let total = start.elapsed();
    assert!(events.len() > 300);
    assert!(reads > 50, "{reads} reads for 300 tokens");
    // The first token arrives long before the last is generated.
    assert!(
        spread.as_secs_f64() > 0.5 * total.as_secs_f64(),
        "{spread:?} of {total:?}"
    );
}

/// Retries a one-token request for a key until it succeeds (slot free) or ten seconds pass.
async fn slot_comes_back(key: &str) -> bool {
    let body = chat("ping", json!({"max_tokens": 1})).to_string();
    for _ in 0..100 {
        if post(CHAT, Some(key), body.clone()).await.status() == StatusCode::OK {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

#[tokio::test]
async fn client_disconnect_mid_stream_settles_and_releases_the_slot() {
    let body = chat(
        "go on forever",
        json!({"stream": true, "max_tokens": 3000, "ignore_eos": true}),
    );
    let mut resp = post(CHAT, Some("single"), body.to_string()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    for _ in 0..3 {
        resp.chunk().await.unwrap().unwrap();
    }
    // While it streams, the single slot is taken.
    let busy = post(
        CHAT,
        Some("single"),
        chat("me too", json!({"max_tokens": 1})).to_string(),
    )
    .await;
    assert_eq!(busy.status(), StatusCode::TOO_MANY_REQUESTS);
    drop(resp);
    assert!(
        slot_comes_back("single").await,
        "slot released after the client left"
    );
    assert!(stack().envoy.stats().await["weir.requests.cancelled"] >= 1);
}

#[tokio::test]
async fn upstream_reset_mid_stream_settles_and_releases_the_slot() {
    let id = "reset-1";
    let body = chat(
        "cut me off",
        json!({"stream": true, "max_tokens": 100, "ignore_eos": true}),
    );
    let resp = post_with(
        "/alt/v1/chat/completions",
        Some("reset"),
        body.to_string(),
        &[("x-request-id", id)],
    )
    .await;
    let mut resp = resp;
    let mut text = String::new();
    while let Ok(Some(chunk)) = resp.chunk().await {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(!text.contains("[DONE]"), "the upstream died mid-stream");
    assert!(
        slot_comes_back("reset").await,
        "slot released after the upstream reset"
    );
    let log = stack().envoy.access_log_for(id);
    assert!(
        log.iter().any(|l| l.contains("tokens_out=5 ")),
        "charged what was streamed: {log:?}"
    );
}

#[tokio::test]
async fn a_concurrency_limit_holds_under_parallel_load() {
    let body = chat(
        "hold on",
        json!({"stream": true, "max_tokens": 1000, "ignore_eos": true}),
    )
    .to_string();
    let attempts = (0..8).map(|_| {
        let body = body.clone();
        async move {
            let resp = post(CHAT, Some("slots"), body).await;
            let status = resp.status();
            let _ = resp.bytes().await;
            status
        }
    });
    let statuses = futures::future::join_all(attempts).await;
    let ok = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    let limited = statuses
        .iter()
        .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert_eq!((ok, limited), (3, 5), "{statuses:?}");

    // No slot leaked: three at once fit again.
    let short = chat("again", json!({"max_tokens": 1})).to_string();
    let again =
        futures::future::join_all((0..3).map(|_| post(CHAT, Some("slots"), short.clone()))).await;
    assert!(again.iter().all(|r| r.status() == StatusCode::OK));
}

#[tokio::test]
async fn shadow_and_enforce_routes_in_one_envoy_behave_as_configured() {
    let body = chat("one per minute", json!({"max_tokens": 1})).to_string();
    assert_eq!(
        post(CHAT, Some("shadowed"), body.clone()).await.status(),
        StatusCode::OK
    );
    assert_eq!(
        post(CHAT, Some("shadowed"), body.clone()).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );

    let shadow = "/shadow/v1/chat/completions";
    let first = post(shadow, Some("shadowed"), body.clone()).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert!(
        first.headers().get("x-weir-shadow").is_none(),
        "within budget"
    );
    for _ in 0..2 {
        let over = post(shadow, Some("shadowed"), body.clone()).await;
        assert_eq!(over.status(), StatusCode::OK, "shadow never rejects");
        assert_eq!(
            over.headers()["x-weir-shadow"],
            "would-reject; reason=requests_per_minute"
        );
    }
    let stranger = post(shadow, Some("nobody"), body).await;
    assert_eq!(stranger.status(), StatusCode::OK);
    assert_eq!(
        stranger.headers()["x-weir-shadow"],
        "would-reject; reason=invalid_api_key"
    );
    assert!(stack().envoy.stats().await["weir.shadow.would_reject"] >= 3);

    // The decisions by route and mode, as Prometheus scrapes them (the template's stats_tags).
    let text = reqwest::get(format!("{}/stats/prometheus", stack().envoy.admin))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let decisions = |route: &str, mode: &str, decision: &str| {
        let series = format!(
            r#"weir_filter_decisions{{route="{route}",mode="{mode}",decision="{decision}"}}"#
        );
        metric_sum(&text, &series).unwrap_or(0.0)
    };
    assert!(decisions("llm-api", "enforce", "admitted") >= 1.0, "{text}");
    assert!(decisions("llm-api", "enforce", "rejected") >= 1.0, "{text}");
    assert!(decisions("shadowed", "shadow", "admitted") >= 1.0, "{text}");
    assert!(
        decisions("shadowed", "shadow", "would_reject") >= 3.0,
        "{text}"
    );
    assert_eq!(
        decisions("shadowed", "shadow", "rejected"),
        0.0,
        "shadow never rejects"
    );
    // The filter's other stats keep their names; what shadow mode would refuse is counted
    // apart from what enforcement refuses.
    assert!(metric_sum(&text, "weir_shadow_would_reject").unwrap() >= 3.0);
    assert!(metric_sum(&text, "weir_shadow_rejections_requests_per_minute").unwrap() >= 2.0);
    assert!(metric_sum(&text, "weir_shadow_rejections_invalid_api_key").unwrap() >= 1.0);
    assert!(metric_sum(&text, "weir_rejections_requests_per_minute").unwrap() >= 1.0);
}

#[tokio::test]
async fn a_zero_percent_rollout_route_is_not_enforced() {
    let id = "dark-1";
    let body = chat(
        "in the dark",
        json!({"max_tokens": 1, "cache_salt": "mine"}),
    );
    let headers = [
        ("x-request-id", id),
        ("authorization", "Bearer not-a-weir-key"),
    ];
    let resp = post_with(
        "/dark/v1/chat/completions",
        None,
        body.to_string(),
        &headers,
    )
    .await;
    assert_eq!(
        resp.status(),
        StatusCode::OK,
        "no key needed: weir is not in play"
    );
    let received = stack().sim.received().await;
    let seen = received
        .iter()
        .find(|r| r["headers"]["x-request-id"] == id)
        .unwrap();
    assert_eq!(seen["body"]["cache_salt"], "mine", "body untouched");
    assert_eq!(seen["headers"]["authorization"], "Bearer not-a-weir-key");
    // Still signed and identified, as the default tenant, so a sidecar behind it serves it.
    assert_eq!(seen["headers"]["x-weir-tenant"], "anonymous");
    assert!(seen["headers"]["x-weir-signature"].is_string());
}

#[tokio::test]
async fn bad_bodies_get_documented_errors_and_envoy_keeps_serving() {
    let cases: Vec<(&str, &str, Vec<u8>, StatusCode, &str)> = vec![
        (
            "malformed JSON",
            "plain",
            b"{\"model\": ".to_vec(),
            StatusCode::BAD_REQUEST,
            "malformed JSON",
        ),
        (
            "wrong type",
            "plain",
            br#"{"model":"tiny","messages":"hi"}"#.to_vec(),
            StatusCode::BAD_REQUEST,
            "invalid request",
        ),
        (
            "invalid UTF-8",
            "plain",
            b"{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\"}]}"
                .to_vec(),
            StatusCode::BAD_REQUEST,
            "malformed JSON",
        ),
        (
            "over context",
            "plain",
            chat("hi", json!({"max_tokens": 5000}))
                .to_string()
                .into_bytes(),
            StatusCode::BAD_REQUEST,
            "maximum context length",
        ),
        (
            "model not allowed",
            "narrow",
            chat("hi", json!({})).to_string().into_bytes(),
            StatusCode::FORBIDDEN,
            "not allowed",
        ),
        (
            "oversized",
            "plain",
            chat(&"x".repeat(100_000), json!({}))
                .to_string()
                .into_bytes(),
            StatusCode::PAYLOAD_TOO_LARGE,
            "exceeds the limit",
        ),
        (
            "empty",
            "plain",
            Vec::new(),
            StatusCode::BAD_REQUEST,
            "body is required",
        ),
    ];
    for (what, key, body, status, needle) in cases {
        let resp = post(CHAT, Some(key), body).await;
        assert_eq!(resp.status(), status, "{what}");
        let err = error_body(resp).await;
        assert!(
            err["message"].as_str().unwrap_or_default().contains(needle),
            "{what}: {err}"
        );
    }
    let over = post(
        CHAT,
        Some("plain"),
        chat("hi", json!({"max_tokens": 5000})).to_string(),
    )
    .await;
    assert_eq!(error_body(over).await["code"], "context_length_exceeded");
    let ok = post(
        CHAT,
        Some("plain"),
        chat("still serving?", json!({"max_tokens": 1})).to_string(),
    )
    .await;
    assert_eq!(ok.status(), StatusCode::OK);
}

#[tokio::test]
async fn access_log_and_metrics_carry_usage_but_no_content() {
    let id = "logged-1";
    let marker = "zebra-crossing-secret";
    let body = chat(marker, json!({"max_tokens": 30}));
    let resp = post_with(
        CHAT,
        Some("plain"),
        body.to_string(),
        &[("x-request-id", id)],
    )
    .await;
    let usage = resp.json::<Value>().await.unwrap()["usage"].clone();
    let line = stack().envoy.access_log_for(id).pop().unwrap_or_else(|| {
        panic!(
            "not logged: {}",
            std::fs::read_to_string(&stack().envoy.access_log).unwrap_or_default()
        )
    });
    assert!(
        line.contains("tenant=acme/lab/e2e/plain model=tiny"),
        "{line}"
    );
    assert!(
        line.contains(&format!("tokens_in={} ", usage["prompt_tokens"])),
        "{line}"
    );
    assert!(
        line.contains(&format!("tokens_out={} ", usage["completion_tokens"])),
        "{line}"
    );
    assert!(line.contains("outcome=ok"), "{line}");
    assert!(!line.contains(marker), "no prompt content in logs");

    post(CHAT, None, body.to_string()).await;
    let stats = stack().envoy.stats().await;
    assert!(stats["weir.requests.ok"] >= 1);
    assert!(stats["weir.rejections.missing_api_key"] >= 1);
    assert!(stats["weir.tokens.output"] >= 20);
    assert!(stats.keys().all(|k| !k.contains(marker)));
}
