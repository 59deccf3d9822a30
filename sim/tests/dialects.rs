//! Each engine dialect over HTTP, against the real binary: its metric names and info endpoints,
//! llama.cpp's slots and in-engine queue, and which engines let a prefix cache cross tenants.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{Sim, chat};
use serde_json::{Value, json};

/// The metric families a `/metrics` text declares.
fn families(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

async fn status_of(sim: &Sim, path: &str) -> u16 {
    sim.http
        .get(sim.url(path))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test]
async fn vllm_is_the_default_dialect() {
    let sim = Sim::start(&["--preset", "tiny", "--time-scale", "50"]);
    let names = families(&sim.metrics().await);
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config",
    ] {
        assert!(names.contains(name), "{name} missing from {names:?}");
    }
    assert!(names.iter().all(|n| n.starts_with("vllm:")), "{names:?}");
    assert_eq!(status_of(&sim, "/health").await, 200);
    assert_eq!(status_of(&sim, "/server_info").await, 404);
    assert_eq!(status_of(&sim, "/props").await, 404);
}

#[tokio::test]
async fn sglang_exports_its_metric_names_and_server_info() {
    let sim = Sim::start(&[
        "--preset",
        "tiny",
        "--time-scale",
        "5",
        "--metrics-dialect",
        "sglang",
        "--max-num-seqs",
        "7",
    ]);
    let text = sim.metrics().await;
    let names = families(&text);
    for name in [
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:num_used_tokens",
        "sglang:token_usage",
        "sglang:max_total_num_tokens",
        "sglang:cache_hit_rate",
        "sglang:gen_throughput",
        "sglang:prompt_tokens",
        "sglang:generation_tokens",
        "sglang:cached_tokens",
        "sglang:num_requests",
        "sglang:time_to_first_token_seconds",
    ] {
        assert!(names.contains(name), "{name} missing from {names:?}");
    }
    assert!(names.iter().all(|n| n.starts_with("sglang:")), "{names:?}");
    assert!(
        text.contains(
            "sglang:num_running_reqs{model_name=\"tiny\",engine_type=\"unified\",tp_rank=\"0\",pp_rank=\"0\",moe_ep_rank=\"0\"} 0"
        ),
        "{text}"
    );
    assert!(
        text.contains("sglang:prompt_tokens_total{model_name=\"tiny\",engine_type=\"unified\"} 0"),
        "{text}"
    );
    // tiny: 610 blocks of 16 tokens.
    assert_eq!(sim.metric("sglang:max_total_num_tokens").await, 9760.0);

    for path in ["/server_info", "/get_server_info"] {
        let info = sim.get_json(path).await;
        assert_eq!(info["max_running_requests"], 7, "{path}: {info}");
        assert_eq!(info["max_total_num_tokens"], 9760, "{path}: {info}");
        assert_eq!(
            info["internal_states"][0]["effective_max_running_requests_per_dp"], 7,
            "{path}: {info}"
        );
    }

    // The gauges follow the engine: a long stream holds a running slot and KV.
    let body = chat(
        "tiny",
        &"a long prompt ".repeat(50),
        json!({"stream": true, "max_tokens": 500, "ignore_eos": true}),
    );
    let mut stream = sim.post("/v1/chat/completions", body).await;
    stream.chunk().await.unwrap().expect("a chunk");
    assert_eq!(sim.metric("sglang:num_running_reqs").await, 1.0);
    let usage = sim.metric("sglang:token_usage").await;
    assert!(usage > 0.0 && usage < 1.0, "token_usage {usage}");
    assert!(sim.metric("sglang:num_used_tokens").await > 0.0);
    let throughput = sim
        .wait_for_metric("sglang:gen_throughput", |v| v > 0.0)
        .await;
    assert!(throughput > 0.0, "gen_throughput stayed {throughput}");
    drop(stream);
    let aborted = sim
        .wait_for_metric("sglang:num_aborted_requests_total", |v| v == 1.0)
        .await;
    assert_eq!(aborted, 1.0);
}

/// Runs the same prompt under salts and `cache_prompt` and reports the cached tokens of each.
async fn cached_tokens(sim: &Sim, extra: Value) -> u64 {
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(20);
    let mut body = json!({"max_tokens": 2});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let v: Value = sim
        .post("/v1/chat/completions", chat("tiny", &prompt, body))
        .await
        .json()
        .await
        .unwrap();
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {v}"))
}

#[tokio::test]
async fn only_llamacpp_lets_the_prefix_cache_cross_salts() {
    for (dialect, crosses_salts, honours_cache_prompt) in [
        ("vllm", false, false),
        ("sglang", false, false),
        ("llamacpp", true, true),
    ] {
        let sim = Sim::start(&[
            "--preset",
            "tiny",
            "--time-scale",
            "50",
            "--metrics-dialect",
            dialect,
        ]);
        let cold = cached_tokens(&sim, json!({"cache_salt": "tenant-a"})).await;
        assert_eq!(cold, 0, "{dialect}: cold cache");
        let same = cached_tokens(&sim, json!({"cache_salt": "tenant-a"})).await;
        assert!(
            same > 100,
            "{dialect}: the same salt reuses the prefix ({same})"
        );
        let other = cached_tokens(&sim, json!({"cache_salt": "tenant-b"})).await;
        assert_eq!(
            other > 0,
            crosses_salts,
            "{dialect}: another salt hit {other}"
        );
        let uncached = cached_tokens(
            &sim,
            json!({"cache_salt": "tenant-a", "cache_prompt": false}),
        )
        .await;
        assert_eq!(
            uncached == 0,
            honours_cache_prompt,
            "{dialect}: cache_prompt false still hit {uncached}"
        );
    }
}

/// The `llamacpp:*` families of `shared/reference/llama.cpp-server/metrics.prom`.
const LLAMACPP_FAMILIES: [&str; 15] = [
    "llamacpp:prompt_tokens_total",
    "llamacpp:prompt_tokens_cached_total",
    "llamacpp:prompt_seconds_total",
    "llamacpp:tokens_predicted_total",
    "llamacpp:tokens_predicted_seconds_total",
    "llamacpp:n_decode_total",
    "llamacpp:n_tokens_max",
    "llamacpp:spec_decode_num_draft_tokens_total",
    "llamacpp:spec_decode_num_accepted_tokens_total",
    "llamacpp:spec_decode_num_drafts_total",
    "llamacpp:prompt_tokens_seconds",
    "llamacpp:predicted_tokens_seconds",
    "llamacpp:requests_processing",
    "llamacpp:requests_deferred",
    "llamacpp:n_busy_slots_per_decode",
];

#[tokio::test]
async fn llamacpp_plays_llama_server() {
    let sim = Sim::start(&[
        "--preset",
        "tiny",
        "--time-scale",
        "50",
        "--metrics-dialect",
        "llamacpp",
        "--slots",
        "3",
    ]);
    assert_eq!(sim.get_json("/health").await, json!({"status": "ok"}));

    let metrics = sim.metrics().await;
    let expected: BTreeSet<String> = LLAMACPP_FAMILIES.iter().map(|&n| n.to_owned()).collect();
    assert_eq!(families(&metrics), expected, "{metrics}");
    assert!(
        !metrics.contains('{') && !metrics.contains("# EOF"),
        "{metrics}"
    );

    let props = sim.get_json("/props").await;
    assert_eq!(props["total_slots"], 3);
    let n_ctx = props["default_generation_settings"]["n_ctx"]
        .as_u64()
        .unwrap();
    // tiny: 9,760 tokens of KV over 3 slots, in whole 16-token blocks.
    assert_eq!(n_ctx, 3248);
    assert_eq!(
        props["default_generation_settings"]["params"]["n_predict"],
        -1
    );
    let slots = sim.get_json("/slots").await;
    let slots = slots.as_array().unwrap();
    assert_eq!(slots.len(), 3);
    for (i, slot) in slots.iter().enumerate() {
        assert_eq!(slot["id"], i);
        assert_eq!(slot["n_ctx"], n_ctx);
        assert_eq!(slot["is_processing"], false);
    }
    let models = sim.get_json("/v1/models").await;
    assert_eq!(models["object"], "list");
    assert_eq!(models["models"][0]["model"], "tiny");
    assert_eq!(models["data"][0]["owned_by"], "llamacpp");
    assert_eq!(models["data"][0]["meta"]["n_ctx"], n_ctx);

    // Any model name is served, and echoed; usage carries cached tokens and llama.cpp timings.
    let answer: Value = sim
        .post(
            "/v1/chat/completions",
            chat(
                "tiny-llama",
                "hello",
                json!({"max_tokens": 5, "ignore_eos": true}),
            ),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(answer["model"], "tiny-llama");
    assert_eq!(answer["object"], "chat.completion");
    assert!(answer["system_fingerprint"].is_string(), "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 5);
    assert_eq!(answer["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(answer["timings"]["predicted_n"], 5);
    assert_eq!(
        answer["timings"]["prompt_n"],
        answer["usage"]["prompt_tokens"]
    );

    // Errors in llama.cpp's shape.
    let bad = sim
        .post("/v1/chat/completions", r#"{"model":"x","messages":"hi"}"#)
        .await;
    assert_eq!(bad.status(), 400);
    let err: Value = bad.json().await.unwrap();
    assert_eq!(err["error"]["code"], 400);
    assert_eq!(err["error"]["type"], "invalid_request_error");
    assert!(err["error"]["message"].is_string());

    // A prompt that fills the slot is refused; output past the slot's end is cut, not refused.
    let long = sim
        .post(
            "/v1/completions",
            json!({"model": "x", "prompt": "word ".repeat(4000)}).to_string(),
        )
        .await;
    assert_eq!(long.status(), 400);
    let err: Value = long.json().await.unwrap();
    assert_eq!(err["error"]["type"], "exceed_context_size_error");
    assert_eq!(err["error"]["n_ctx"], n_ctx);
    let capped: Value = sim
        .post(
            "/v1/completions",
            json!({"model": "x", "prompt": "word ".repeat(3000), "max_tokens": 100_000, "ignore_eos": true})
                .to_string(),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(capped["choices"][0]["finish_reason"], "length");
    let used = capped["usage"]["total_tokens"].as_u64().unwrap();
    assert_eq!(
        used, n_ctx,
        "generation stops at the slot's context: {capped}"
    );
}

/// A stream's timeline as the client sees it.
struct Timeline {
    headers: Instant,
    end: Instant,
    body: String,
}

async fn stream_timeline(sim: Arc<Sim>, max_tokens: u32) -> Timeline {
    let body = chat(
        "tiny",
        "tell me",
        json!({"stream": true, "max_tokens": max_tokens, "ignore_eos": true}),
    );
    let resp = sim.post("/v1/chat/completions", body).await;
    let headers = Instant::now();
    assert_eq!(resp.status(), 200);
    let body = resp.text().await.unwrap();
    Timeline {
        headers,
        end: Instant::now(),
        body,
    }
}

#[tokio::test]
async fn llamacpp_queues_beyond_its_slots_and_sends_headers_when_a_slot_starts() {
    let sim = Arc::new(Sim::start(&[
        "--preset",
        "tiny",
        "--time-scale",
        "1",
        "--metrics-dialect",
        "llamacpp",
        "--slots",
        "2",
    ]));
    let running = [
        tokio::spawn(stream_timeline(sim.clone(), 150)),
        tokio::spawn(stream_timeline(sim.clone(), 150)),
    ];
    let processing = sim
        .wait_for_metric("llamacpp:requests_processing", |v| v == 2.0)
        .await;
    assert_eq!(processing, 2.0);

    let deferred = tokio::spawn(stream_timeline(sim.clone(), 5));
    let queued = sim
        .wait_for_metric("llamacpp:requests_deferred", |v| v == 1.0)
        .await;
    assert_eq!(queued, 1.0, "the third stream waits inside the engine");
    let slots = sim.get_json("/slots").await;
    let busy = slots
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["is_processing"] == true)
        .count();
    assert_eq!(busy, 2);

    // A client that gives up while queued leaves the queue.
    let quitter = tokio::spawn(stream_timeline(sim.clone(), 5));
    let queued = sim
        .wait_for_metric("llamacpp:requests_deferred", |v| v == 2.0)
        .await;
    assert_eq!(queued, 2.0);
    quitter.abort();
    let queued = sim
        .wait_for_metric("llamacpp:requests_deferred", |v| v == 1.0)
        .await;
    assert_eq!(queued, 1.0, "the abandoned request left the queue");

    let mut ends = Vec::new();
    for task in running {
        let t = task.await.unwrap();
        assert!(t.body.ends_with("data: [DONE]\n\n"));
        ends.push(t.end);
    }
    let deferred = deferred.await.unwrap();
    let first_free = ends.into_iter().min().unwrap();
    assert!(
        deferred.headers > first_free,
        "the deferred stream's headers came {:?} before a slot freed",
        first_free - deferred.headers
    );
    assert!(deferred.body.ends_with("data: [DONE]\n\n"));
    assert_eq!(sim.metric("llamacpp:requests_deferred").await, 0.0);
}

#[tokio::test]
async fn llamacpp_serves_its_queue_in_arrival_order() {
    let sim = Arc::new(Sim::start(&[
        "--preset",
        "tiny",
        "--time-scale",
        "1",
        "--metrics-dialect",
        "llamacpp",
        "--slots",
        "1",
    ]));
    let finished = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..4 {
        let (client, finished) = (sim.clone(), finished.clone());
        tasks.push(tokio::spawn(async move {
            let body = chat(
                "tiny",
                &format!("request {i}"),
                json!({"max_tokens": 100, "ignore_eos": true}),
            );
            let resp = client.post("/v1/chat/completions", body).await;
            assert_eq!(resp.status(), 200);
            resp.bytes().await.unwrap();
            finished.fetch_add(1, Ordering::SeqCst)
        }));
        // Each request is in the engine (running or queued) before the next is sent.
        let mut in_engine = 0.0;
        for _ in 0..200 {
            in_engine = sim.metric("llamacpp:requests_processing").await
                + sim.metric("llamacpp:requests_deferred").await;
            if in_engine == f64::from(i + 1) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(in_engine, f64::from(i + 1), "request {i} arrived");
    }
    assert_eq!(sim.metric("llamacpp:requests_deferred").await, 3.0);
    let mut order = Vec::new();
    for task in tasks {
        order.push(task.await.unwrap());
    }
    assert_eq!(
        order,
        [0, 1, 2, 3],
        "each request's place among completions, in arrival order"
    );
}
