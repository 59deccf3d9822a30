//! The simulator over HTTP: errors, prefix-cache salting, disconnects, preemption and faults,
//! against the real binary on loopback.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

mod common;

use common::{Sim, chat};
use serde_json::{Value, json};

async fn error_of(resp: reqwest::Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.expect("JSON error body");
    (status, body["error"].clone())
}

#[tokio::test]
async fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let sim = Sim::start(&[
        "--preset",
        "tiny",
        "--time-scale",
        "50",
        "--max-body-bytes",
        "65536",
    ]);
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "malformed JSON",
            b"{\"model\": ".to_vec(),
            400,
            "malformed JSON",
        ),
        (
            "wrong type",
            br#"{"model":"tiny","messages":"hi"}"#.to_vec(),
            400,
            "invalid type",
        ),
        (
            "invalid UTF-8",
            b"{\"model\":\"tiny\",\"prompt\":\"\xff\xfe\"}".to_vec(),
            400,
            "malformed JSON",
        ),
        (
            "unknown model",
            chat("nope", "hi", json!({})).into_bytes(),
            404,
            "does not exist",
        ),
        (
            "n=2",
            chat("tiny", "hi", json!({"n": 2})).into_bytes(),
            400,
            "n=2",
        ),
        (
            "empty messages",
            br#"{"model":"tiny","messages":[]}"#.to_vec(),
            400,
            "non-empty",
        ),
        (
            "over context",
            chat("tiny", "hi", json!({"max_tokens": 5000})).into_bytes(),
            400,
            "maximum context length",
        ),
        ("too large", vec![b' '; 100_000], 413, "exceeds the limit"),
    ];
    for (what, body, status, needle) in cases {
        let (got, err) = error_of(sim.post("/v1/chat/completions", body).await).await;
        assert_eq!(got, status, "{what}: {err}");
        let message = err["message"].as_str().unwrap_or_default();
        assert!(message.contains(needle), "{what}: {message}");
        assert!(err["type"].is_string(), "{what}: {err}");
    }
    let (_, err) = error_of(
        sim.post(
            "/v1/chat/completions",
            chat("tiny", "hi", json!({"max_tokens": 5000})),
        )
        .await,
    )
    .await;
    assert_eq!(err["code"], "context_length_exceeded");

    let ok = sim
        .post(
            "/v1/chat/completions",
            chat("tiny", "still there?", json!({"max_tokens": 3})),
        )
        .await;
    assert_eq!(ok.status(), 200);
    let body: Value = ok.json().await.unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 3);
}

#[tokio::test]
async fn prefix_cache_is_scoped_by_cache_salt() {
    let sim = Sim::start(&["--preset", "tiny", "--time-scale", "50"]);
    let prefix = "The quick brown fox jumps over the lazy dog. ".repeat(40);
    let cached = |salt: &'static str| {
        let body = chat(
            "tiny",
            &prefix,
            json!({"max_tokens": 2, "cache_salt": salt}),
        );
        let sim = &sim;
        async move {
            let v: Value = sim
                .post("/v1/chat/completions", body)
                .await
                .json()
                .await
                .unwrap();
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        }
    };
    assert_eq!(cached("tenant-a").await, 0, "cold cache");
    let warm = cached("tenant-a").await;
    let other = cached("tenant-b").await;
    assert!(warm > 300, "same salt reuses the prefix: {warm}");
    assert_eq!(other, 0, "another salt must not hit");
    assert!(sim.metric("vllm:prefix_cache_hits_total").await >= warm as f64);
}

#[tokio::test]
async fn a_continued_final_message_is_prompted_open_as_vllm_frames_it() {
    let sim = Sim::start(&["--preset", "tiny", "--time-scale", "50"]);
    let usage = |body: Value| {
        let sim = &sim;
        async move {
            let resp = sim.post("/v1/chat/completions", body.to_string()).await;
            assert_eq!(resp.status(), 200);
            let v: Value = resp.json().await.unwrap();
            v["usage"]["prompt_tokens"].as_u64().unwrap()
        }
    };
    let user = json!({"role": "user", "content": "tell me of caches"});
    let asked = usage(json!({"model": "tiny", "messages": [user], "max_tokens": 2})).await;
    let continued = usage(json!({
        "model": "tiny", "max_tokens": 2,
        "messages": [user, {"role": "assistant", "content": " the cache"}],
        "continue_final_message": true, "add_generation_prompt": false,
    }))
    .await;
    assert_eq!(
        continued,
        asked + 2,
        "the reply opened, its two tokens, left open"
    );
    let closed = usage(json!({
        "model": "tiny", "max_tokens": 2,
        "messages": [user, {"role": "assistant", "content": " the cache"}],
        "add_generation_prompt": false,
    }))
    .await;
    assert_eq!(closed, continued + 1, "its end-of-turn token");
    let both = json!({"model": "tiny", "messages": [user], "continue_final_message": true});
    let (status, error) = error_of(sim.post("/v1/chat/completions", both.to_string()).await).await;
    assert_eq!(status, 400);
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("Cannot set both"),
        "{error}"
    );
}

#[tokio::test]
async fn client_disconnect_aborts_and_frees_kv() {
    let sim = Sim::start(&["--preset", "tiny", "--time-scale", "5"]);
    let before = sim.metric("vllm:kv_cache_usage_perc").await;
    let body = json!({
        "model": "tiny", "prompt": "tell me everything", "max_tokens": 3000,
        "ignore_eos": true, "stream": true,
    });
    let mut resp = sim.post("/v1/completions", body.to_string()).await;
    for _ in 0..5 {
        resp.chunk().await.unwrap().expect("a chunk");
    }
    assert!(sim.metric("vllm:kv_cache_usage_perc").await > before);
    assert_eq!(sim.metric("vllm:num_requests_running").await, 1.0);
    drop(resp);

    let usage = sim
        .wait_for_metric("vllm:kv_cache_usage_perc", |v| v == before)
        .await;
    assert_eq!(usage, before, "blocks freed after disconnect");
    assert_eq!(sim.metric("vllm:num_requests_running").await, 0.0);
    let generated = sim.metric("vllm:generation_tokens_total").await;
    assert!(generated < 3000.0, "generation stopped early: {generated}");
}

#[tokio::test]
async fn oversubscribed_kv_preempts_and_every_request_completes() {
    let sim = Sim::start(&["--preset", "tiny", "--time-scale", "100"]);
    let requests = (0..16).map(|i| {
        let body = json!({
            "model": "tiny", "prompt": format!("request {i}: ").repeat(40),
            "max_tokens": 800, "ignore_eos": true,
        });
        let sim = &sim;
        async move {
            let v: Value = sim
                .post("/v1/completions", body.to_string())
                .await
                .json()
                .await
                .unwrap();
            v["usage"]["completion_tokens"].as_u64()
        }
    });
    let done = futures::future::join_all(requests).await;
    assert!(done.iter().all(|c| *c == Some(800)), "{done:?}");
    assert!(sim.metric("vllm:num_preemptions_total").await > 0.0);
    // The last answers can go out a step before their blocks are freed: on a loaded machine the
    // metric was read in between.
    let usage = sim
        .wait_for_metric("vllm:kv_cache_usage_perc", |v| v == 0.0)
        .await;
    assert_eq!(usage, 0.0, "every block freed");
}

#[tokio::test]
async fn streams_report_usage_equal_to_streamed_tokens() {
    let sim = Sim::start(&["--preset", "tiny", "--time-scale", "50"]);
    let body = chat(
        "tiny",
        "count with me",
        json!({
            "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 40,
        }),
    );
    let text = sim
        .post("/v1/chat/completions", body)
        .await
        .text()
        .await
        .unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e.trim_start_matches("data: ")).unwrap())
        .collect();
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(chunks.last().unwrap()["choices"], json!([]));
    let token_chunks = chunks
        .iter()
        .filter(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|s| !s.is_empty())
        })
        .count() as u64;
    assert_eq!(usage["completion_tokens"].as_u64(), Some(token_chunks));
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 3);
}

#[tokio::test]
async fn injected_errors_and_throttling() {
    let failing = Sim::start(&["--preset", "tiny", "--error-rate", "1"]);
    let (status, err) = error_of(
        failing
            .post("/v1/chat/completions", chat("tiny", "x", json!({})))
            .await,
    )
    .await;
    assert_eq!(
        (status, err["type"].as_str()),
        (500, Some("InternalServerError"))
    );

    let throttled = Sim::start(&["--preset", "tiny", "--throttle-rate", "1"]);
    let resp = throttled
        .post("/v1/chat/completions", chat("tiny", "x", json!({})))
        .await;
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["retry-after"], "1");
}

#[tokio::test]
async fn injected_drop_cuts_the_stream() {
    let sim = Sim::start(&[
        "--preset",
        "tiny",
        "--time-scale",
        "50",
        "--drop-after",
        "3",
    ]);
    let body = chat(
        "tiny",
        "x",
        json!({"stream": true, "max_tokens": 50, "ignore_eos": true}),
    );
    let mut resp = sim.post("/v1/chat/completions", body).await;
    let mut received = String::new();
    let outcome = loop {
        match resp.chunk().await {
            Ok(Some(bytes)) => received.push_str(&String::from_utf8_lossy(&bytes)),
            Ok(None) => break "clean end",
            Err(_) => break "cut",
        }
    };
    assert_eq!(outcome, "cut");
    assert!(!received.contains("[DONE]"));
    assert_eq!(
        received.matches("\"content\":\"").count() - 1,
        3,
        "role chunk + 3 tokens"
    );
}

#[tokio::test]
async fn exit_after_crashes_mid_stream() {
    let mut sim = Sim::start(&[
        "--preset",
        "tiny",
        "--time-scale",
        "10",
        "--exit-after",
        "2",
    ]);
    let first = sim
        .post(
            "/v1/chat/completions",
            chat("tiny", "x", json!({"max_tokens": 2})),
        )
        .await;
    assert_eq!(first.status(), 200);
    let body = chat("tiny", "x", json!({"stream": true, "max_tokens": 100}));
    let resp = sim.post("/v1/chat/completions", body).await;
    let streamed = resp.text().await.unwrap_or_default();
    assert!(
        !streamed.contains("[DONE]"),
        "the stream died with the process"
    );
    assert_eq!(sim.wait_exit(), Some(70));
}

#[tokio::test]
async fn profiles_load_from_yaml_files() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/profiles/qwen2.5-32b-a100.yaml"
    );
    let sim = Sim::start(&["--profile", path, "--time-scale", "100"]);
    let models: Value = sim
        .http
        .get(sim.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "qwen2.5-32b");
    assert_eq!(models["data"][0]["max_model_len"], 32768);
    // (2 x 80 GB x 0.9 - 65 GB) / (16 tokens x 2 x 64 layers x 8 heads x 128 x 1 byte) = 37,670.
    let text = sim
        .http
        .get(sim.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("num_gpu_blocks=\"37670\""), "{text}");
    let body = chat("qwen2.5-32b", "hi", json!({"max_tokens": 3}));
    assert_eq!(sim.post("/v1/chat/completions", body).await.status(), 200);
}

#[tokio::test]
async fn injected_stall_pauses_then_resumes() {
    let sim = Sim::start(&[
        "--preset",
        "tiny",
        "--time-scale",
        "50",
        "--stall-after",
        "2",
        "--stall-for",
        "400",
    ]);
    let body = chat(
        "tiny",
        "x",
        json!({"stream": true, "max_tokens": 6, "ignore_eos": true}),
    );
    let mut resp = sim.post("/v1/chat/completions", body).await;
    let mut arrivals = Vec::new();
    while let Some(bytes) = resp.chunk().await.unwrap() {
        let text = String::from_utf8_lossy(&bytes).into_owned();
        arrivals.push((std::time::Instant::now(), text));
    }
    let all: String = arrivals.iter().map(|(_, t)| t.as_str()).collect();
    assert!(
        all.ends_with("data: [DONE]\n\n"),
        "the stream completes after the stall"
    );
    // The longest pause between frames is at least the injected stall (a lower bound only).
    let longest = arrivals.windows(2).map(|w| w[1].0 - w[0].0).max().unwrap();
    assert!(
        longest >= std::time::Duration::from_millis(400),
        "{longest:?}"
    );
}

#[tokio::test]
async fn recording_keeps_what_arrived_only_when_asked() {
    let sim = Sim::start(&[
        "--preset",
        "tiny",
        "--time-scale",
        "50",
        "--record-requests",
        "2",
    ]);
    for i in 0..3 {
        let body = chat(
            "tiny",
            &format!("prompt {i}"),
            json!({"max_tokens": 1, "cache_salt": "s"}),
        );
        sim.http
            .post(sim.url("/v1/chat/completions"))
            .header("x-weir-tenant", format!("t{i}"))
            .body(body)
            .send()
            .await
            .unwrap();
    }
    let seen: Value = sim
        .http
        .get(sim.url("/debug/requests"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let seen = seen.as_array().unwrap();
    assert_eq!(seen.len(), 2, "bounded to the last N");
    assert_eq!(seen[1]["headers"]["x-weir-tenant"], "t2");
    assert_eq!(seen[1]["body"]["cache_salt"], "s");
    assert_eq!(seen[1]["body"]["messages"][0]["content"], "prompt 2");

    let quiet = Sim::start(&["--preset", "tiny"]);
    quiet
        .post(
            "/v1/chat/completions",
            chat("tiny", "secret", json!({"max_tokens": 1})),
        )
        .await;
    let seen: Value = quiet
        .http
        .get(quiet.url("/debug/requests"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(seen, json!([]));
}

/// Whether a request gets no answer at all (not even a status line) within `wait`.
async fn goes_unanswered(sim: &Sim, wait: std::time::Duration) -> bool {
    let body = chat("tiny", "are you there?", json!({"max_tokens": 3}));
    let sent = sim
        .http
        .post(sim.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(body)
        .timeout(wait)
        .send()
        .await;
    matches!(sent, Err(e) if e.is_timeout())
}

#[tokio::test]
async fn hang_holds_new_requests_until_switched_off() {
    let sim = Sim::start(&["--preset", "tiny", "--time-scale", "5", "--hang"]);
    assert_eq!(sim.get_json("/debug/faults").await["hang"], true);
    let wait = std::time::Duration::from_millis(400);

    // Held: no status line, while the probes still say healthy.
    let pending = tokio::spawn({
        let http = sim.http.clone();
        let url = sim.url("/v1/chat/completions");
        async move {
            http.post(url)
                .body(chat("tiny", "held", json!({"max_tokens": 3})))
                .send()
                .await
        }
    });
    let mut held = json!(null);
    for _ in 0..100 {
        held = sim.get_json("/debug/faults").await;
        if held["hung"] == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(held["hung"], 1, "{held}");
    let health = sim.http.get(sim.url("/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    assert_eq!(sim.metric("vllm:num_requests_running").await, 0.0);
    // The client goes away: the request is released.
    pending.abort();
    let mut released = json!(null);
    for _ in 0..100 {
        released = sim.get_json("/debug/faults").await;
        if released["hung"] == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(released["hung"], 0, "{released}");
    assert!(goes_unanswered(&sim, wait).await);

    // Recovered: served again. A request already running rides out the next hang.
    assert_eq!(sim.set_hang(false).await["hang"], false);
    assert!(!goes_unanswered(&sim, std::time::Duration::from_secs(10)).await);
    let body = chat(
        "tiny",
        "long",
        json!({"stream": true, "max_tokens": 200, "ignore_eos": true}),
    );
    let mut running = sim.post("/v1/chat/completions", body).await;
    assert_eq!(running.status(), 200);
    running.chunk().await.unwrap().expect("a first chunk");
    assert_eq!(sim.set_hang(true).await["hang"], true);
    assert!(goes_unanswered(&sim, wait).await);
    let mut rest = String::new();
    while let Some(bytes) = running.chunk().await.unwrap() {
        rest.push_str(&String::from_utf8_lossy(&bytes));
    }
    assert!(
        rest.ends_with("data: [DONE]\n\n"),
        "the running stream finished"
    );
    sim.set_hang(false).await;
    assert!(!goes_unanswered(&sim, std::time::Duration::from_secs(10)).await);

    let refused = sim
        .http
        .put(sim.url("/debug/faults/hang"))
        .body("maybe")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 400);
}
