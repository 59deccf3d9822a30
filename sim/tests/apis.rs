//! The Responses, Messages and Embeddings APIs, prompt batches and tool calls, against the real
//! binary on loopback: shapes, usage against the prompt's tokens and the tokens generated,
//! streamed and not, errors in Anthropic's shape, disconnects and faults.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

mod common;

use common::{Sim, chat, data_chunks, named_events};
use serde_json::{Value, json};
use weir_sim::wire::embeddings::base64;

/// A user message "hello" as the engine sees it: `<|im_start|>user<|im_sep|>hello<|im_end|>`
/// and the assistant's priming `<|im_start|>assistant<|im_sep|>`.
const HELLO_TOKENS: u64 = 8;

fn names(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(e, _)| e.as_str()).collect()
}

async fn text_of(sim: &Sim, path: &str, body: Value) -> String {
    let resp = sim.post(path, body.to_string()).await;
    assert_eq!(resp.status(), 200, "{path} {body}");
    resp.text().await.unwrap()
}

async fn json_of(sim: &Sim, path: &str, body: Value) -> Value {
    serde_json::from_str(&text_of(sim, path, body).await).unwrap()
}

fn messages(extra: Value) -> Value {
    let mut body = json!({
        "model": "tiny", "max_tokens": 6,
        "messages": [{"role": "user", "content": "hello"}],
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

fn responses(extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "input": "hello"});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

#[tokio::test]
async fn responses_stream_named_events_and_bodies_with_usage() {
    let sim = Sim::start(&[
        "--preset",
        "tiny",
        "--time-scale",
        "50",
        "--reasoning-tokens",
        "3",
    ]);
    let text = text_of(
        &sim,
        "/v1/responses",
        responses(json!({"stream": true, "max_output_tokens": 10, "ignore_eos": true})),
    )
    .await;
    assert!(!text.contains("[DONE]"));
    let events = named_events(&text);
    for (i, (event, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], event.as_str());
        assert_eq!(data["sequence_number"], i);
    }
    let names = names(&events);
    assert_eq!(
        names[..4],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added"
        ]
    );
    assert_eq!(events[2].1["item"]["type"], "reasoning");
    assert_eq!(
        names
            .iter()
            .filter(|n| **n == "response.reasoning_text.delta")
            .count(),
        3
    );
    let text_deltas: Vec<&str> = events
        .iter()
        .filter(|(e, _)| e == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap())
        .collect();
    assert_eq!(text_deltas.len(), 7);
    let done = events
        .iter()
        .find(|(e, _)| e == "response.output_text.done")
        .unwrap();
    assert_eq!(done.1["text"], text_deltas.concat());
    let (last, completed) = events.last().unwrap();
    assert_eq!(last, "response.completed");
    let response = &completed["response"];
    assert_eq!(response["status"], "incomplete");
    assert_eq!(
        response["incomplete_details"]["reason"],
        "max_output_tokens"
    );
    assert_eq!(response["output"][0]["type"], "reasoning");
    assert_eq!(
        response["output"][1]["content"][0]["text"],
        text_deltas.concat()
    );
    assert_eq!(
        response["usage"],
        json!({
            "input_tokens": HELLO_TOKENS, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 10, "output_tokens_details": {"reasoning_tokens": 3},
            "total_tokens": HELLO_TOKENS + 10,
        })
    );

    // Whole: the same items; instructions count in the prompt and are echoed.
    let body = json_of(
        &sim,
        "/v1/responses",
        responses(json!({"instructions": "Be brief.", "max_output_tokens": 5, "ignore_eos": true})),
    )
    .await;
    assert_eq!(body["object"], "response");
    assert!(body["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(body["instructions"], "Be brief.");
    assert_eq!(body["usage"]["output_tokens"], 5);
    // A system turn: `<|im_start|>system<|im_sep|>Be brief.<|im_end|>`, "Be brief." 3 tokens.
    assert_eq!(body["usage"]["input_tokens"], HELLO_TOKENS + 7);
    assert_eq!(body["output"][1]["type"], "message");
    assert_eq!(body["output"][1]["status"], "completed");
}

#[tokio::test]
async fn messages_stream_and_body_in_anthropic_shape_with_a_salted_cache() {
    let sim = Sim::start(&[
        "--preset",
        "tiny",
        "--time-scale",
        "50",
        "--reasoning-tokens",
        "2",
    ]);
    let body = json_of(&sim, "/v1/messages", messages(json!({"ignore_eos": true}))).await;
    assert!(body["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(
        (body["type"].as_str(), body["role"].as_str()),
        (Some("message"), Some("assistant"))
    );
    assert_eq!(body["content"][0]["type"], "thinking");
    assert!(
        body["content"][0]["signature"]
            .as_str()
            .is_some_and(|s| !s.is_empty())
    );
    assert_eq!(body["content"][1]["type"], "text");
    assert_eq!(body["stop_reason"], "max_tokens");
    assert_eq!(
        body["usage"],
        json!({"input_tokens": HELLO_TOKENS, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0, "output_tokens": 6})
    );

    let text = text_of(
        &sim,
        "/v1/messages",
        messages(json!({"stream": true, "ignore_eos": true})),
    )
    .await;
    let events = named_events(&text);
    assert!(events.iter().all(|(e, d)| d["type"] == e.as_str()));
    let deltas: Vec<&Value> = events
        .iter()
        .filter(|(e, _)| e == "content_block_delta")
        .map(|(_, d)| &d["delta"])
        .collect();
    let kinds: Vec<&str> = deltas.iter().map(|d| d["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "thinking_delta",
            "thinking_delta",
            "signature_delta",
            "text_delta",
            "text_delta",
            "text_delta",
            "text_delta"
        ]
    );
    let names = names(&events);
    assert_eq!(names.first(), Some(&"message_start"));
    assert_eq!(names[names.len() - 2..], ["message_delta", "message_stop"]);
    assert_eq!(
        names.iter().filter(|n| **n == "content_block_stop").count(),
        2
    );
    let delta = &events[events.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "max_tokens");
    assert_eq!(delta["usage"]["output_tokens"], 6);

    // `cache_salt` scopes the prefix cache here too; `input_tokens` leaves out what was read.
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(30);
    let salted = |salt: &str| {
        json!({
            "model": "tiny", "max_tokens": 2, "cache_salt": salt, "stream": true,
            "messages": [{"role": "user", "content": prompt}],
        })
    };
    let start_usage = |text: String| named_events(&text)[0].1["message"]["usage"].clone();
    let cold = start_usage(text_of(&sim, "/v1/messages", salted("a")).await);
    let warm = start_usage(text_of(&sim, "/v1/messages", salted("a")).await);
    let other = start_usage(text_of(&sim, "/v1/messages", salted("b")).await);
    assert_eq!(cold["cache_read_input_tokens"], 0);
    let read = warm["cache_read_input_tokens"].as_u64().unwrap();
    assert!(read > 300, "{warm}");
    assert_eq!(
        warm["input_tokens"].as_u64().unwrap() + read,
        cold["input_tokens"].as_u64().unwrap()
    );
    assert_eq!(
        other["cache_read_input_tokens"], 0,
        "another salt never hits"
    );
}

async fn anthropic_error(sim: &Sim, body: impl Into<reqwest::Body>) -> (u16, Value) {
    let resp = sim.post("/v1/messages", body).await;
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["type"], "error", "{body}");
    assert!(body["error"]["message"].is_string(), "{body}");
    assert!(
        body["error"].get("code").is_none(),
        "not OpenAI's shape: {body}"
    );
    (status, body["error"].clone())
}

#[tokio::test]
async fn messages_errors_use_anthropic_s_envelope_in_every_dialect() {
    let sim = Sim::start(&["--preset", "tiny", "--max-body-bytes", "65536"]);
    let cases: Vec<(Vec<u8>, u16, &str)> = vec![
        (
            br#"{"model":"tiny","messages":[{"role":"user","content":"hi"}]}"#.to_vec(),
            400,
            "invalid_request_error",
        ),
        (b"{\"model\": ".to_vec(), 400, "invalid_request_error"),
        (
            messages(json!({"model": "nope"})).to_string().into_bytes(),
            404,
            "not_found_error",
        ),
        (
            messages(json!({"max_tokens": 5000}))
                .to_string()
                .into_bytes(),
            400,
            "invalid_request_error",
        ),
        (vec![b' '; 100_000], 413, "request_too_large"),
    ];
    for (body, status, kind) in cases {
        let (got, err) = anthropic_error(&sim, body).await;
        assert_eq!((got, err["type"].as_str()), (status, Some(kind)), "{err}");
    }
    let failing = Sim::start(&["--preset", "tiny", "--error-rate", "1"]);
    let (status, err) = anthropic_error(&failing, messages(json!({})).to_string()).await;
    assert_eq!((status, err["type"].as_str()), (500, Some("api_error")));
    let throttled = Sim::start(&["--preset", "tiny", "--throttle-rate", "1"]);
    let resp = throttled
        .post("/v1/messages", messages(json!({})).to_string())
        .await;
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["retry-after"], "1");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["type"], "rate_limit_error");

    // llama.cpp's own error bodies stay off the Messages API.
    let llama = Sim::start(&["--preset", "tiny", "--metrics-dialect", "llamacpp"]);
    let long = json!({
        "model": "x", "max_tokens": 5,
        "messages": [{"role": "user", "content": "word ".repeat(4000)}],
    });
    let (status, err) = anthropic_error(&llama, long.to_string()).await;
    assert_eq!(
        (status, err["type"].as_str()),
        (400, Some("invalid_request_error"))
    );
    let ok = json_of(&llama, "/v1/messages", messages(json!({"model": "x"}))).await;
    assert_eq!(ok["model"], "x");
    let streamed = text_of(
        &llama,
        "/v1/messages",
        messages(json!({"model": "x", "stream": true})),
    )
    .await;
    let events = named_events(&streamed);
    assert_eq!(
        events[0].0, "message_start",
        "a slot's start opens the message"
    );
    assert_eq!(
        events[0].1["message"]["usage"]["input_tokens"],
        HELLO_TOKENS
    );
    assert_eq!(events.last().unwrap().0, "message_stop");
    // The OpenAI APIs keep the engine's shape.
    let resp = llama.post("/v1/responses", r#"{"model":"x"}"#).await;
    assert_eq!(resp.status(), 400);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["code"], 400);
}

#[tokio::test]
async fn embeddings_prefill_like_prompts_and_return_deterministic_vectors() {
    let sim = Sim::start(&["--preset", "tiny", "--time-scale", "50"]);
    let inputs = ["the first document", "a second one, longer than the first"];
    let body = json_of(
        &sim,
        "/v1/embeddings",
        json!({"model": "tiny", "input": inputs}),
    )
    .await;
    assert!(body["id"].as_str().unwrap().starts_with("embd-"));
    assert_eq!(body["object"], "list");
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    for (i, d) in data.iter().enumerate() {
        assert_eq!(
            (d["index"].as_u64(), d["object"].as_str()),
            (Some(i as u64), Some("embedding"))
        );
        let v: Vec<f64> = d["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(v.len(), 64);
        assert!((v.iter().map(|x| x * x).sum::<f64>() - 1.0).abs() < 1e-4);
    }
    assert_ne!(data[0]["embedding"], data[1]["embedding"]);
    // "the first document" is 3 tokens, the second input 8.
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 11, "total_tokens": 11, "completion_tokens": 0, "prompt_tokens_details": null})
    );

    // The same input gives the same vector; `dimensions` sets its length; base64 is its
    // little-endian f32s.
    let floats = json_of(
        &sim,
        "/v1/embeddings",
        json!({"model": "tiny", "input": inputs[0], "dimensions": 5}),
    )
    .await;
    let vector: Vec<f32> = floats["data"][0]["embedding"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    assert_eq!(vector.len(), 5);
    let packed = json_of(
        &sim,
        "/v1/embeddings",
        json!({"model": "tiny", "input": [inputs[0]], "dimensions": 5, "encoding_format": "base64"}),
    )
    .await;
    let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
    assert_eq!(packed["data"][0]["embedding"], base64(&bytes));
    for bad in [
        json!({"dimensions": 0}),
        json!({"encoding_format": "int8"}),
        json!({"input": []}),
    ] {
        let mut body = json!({"model": "tiny", "input": "x"});
        body.as_object_mut()
            .unwrap()
            .extend(bad.as_object().unwrap().clone());
        assert_eq!(
            sim.post("/v1/embeddings", body.to_string()).await.status(),
            400,
            "{body}"
        );
    }

    // Engine physics: prompt tokens prefilled, nothing generated, the salt ignored.
    let generated = sim.metric("vllm:generation_tokens_total").await;
    let prompts = sim.metric("vllm:prompt_tokens_total").await;
    let hits = sim.metric("vllm:prefix_cache_hits_total").await;
    // 101 tokens: the second input finds its 6 full blocks cached under the other salt.
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(10);
    for salt in ["a", "b"] {
        json_of(
            &sim,
            "/v1/embeddings",
            json!({"model": "tiny", "input": long, "cache_salt": salt}),
        )
        .await;
    }
    assert_eq!(sim.metric("vllm:generation_tokens_total").await, generated);
    assert_eq!(
        sim.metric("vllm:prompt_tokens_total").await,
        prompts + 202.0
    );
    assert_eq!(
        sim.metric("vllm:prefix_cache_hits_total").await,
        hits + 96.0,
        "the second salt still hits"
    );
    assert_eq!(sim.metric("vllm:kv_cache_usage_perc").await, 0.0);
}

#[tokio::test]
async fn prompt_batches_run_a_sequence_per_prompt() {
    for dialect in ["vllm", "llamacpp"] {
        let sim = Sim::start(&[
            "--preset",
            "tiny",
            "--time-scale",
            "50",
            "--metrics-dialect",
            dialect,
        ]);
        let body = json_of(
            &sim,
            "/v1/completions",
            json!({"model": "tiny", "prompt": ["Once upon a time", "Hello"], "max_tokens": 3, "ignore_eos": true}),
        )
        .await;
        let choices = body["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 2, "{dialect}: {body}");
        assert_eq!(
            (choices[0]["index"].as_u64(), choices[1]["index"].as_u64()),
            (Some(0), Some(1))
        );
        assert!(choices.iter().all(|c| c["finish_reason"] == "length"));
        assert_eq!(body["usage"]["prompt_tokens"], 5, "{dialect}: 4 + 1 tokens");
        assert_eq!(body["usage"]["completion_tokens"], 6, "{dialect}");

        let text = text_of(
            &sim,
            "/v1/completions",
            json!({
                "model": "tiny", "prompt": [[1, 2, 3], [4, 5], [6]], "max_tokens": 4,
                "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true},
            }),
        )
        .await;
        let chunks = data_chunks(&text);
        let mut pieces = [0, 0, 0];
        let mut finished = [0, 0, 0];
        for chunk in &chunks {
            for c in chunk["choices"].as_array().unwrap() {
                let i = c["index"].as_u64().unwrap() as usize;
                pieces[i] += usize::from(!c["text"].as_str().unwrap().is_empty());
                finished[i] += usize::from(c["finish_reason"] == "length");
            }
        }
        assert_eq!(
            (pieces, finished),
            ([4, 4, 4], [1, 1, 1]),
            "{dialect}: {text}"
        );
        let usage = chunks.iter().rev().find_map(|c| c.get("usage")).unwrap();
        assert_eq!(
            (
                usage["prompt_tokens"].as_u64(),
                usage["completion_tokens"].as_u64()
            ),
            (Some(6), Some(12)),
            "{dialect}"
        );
        let empty = sim
            .post(
                "/v1/completions",
                json!({"model": "tiny", "prompt": [[1], []]}).to_string(),
            )
            .await;
        assert_eq!(empty.status(), 400, "{dialect}: an empty prompt");
    }
}

fn chat_tools(extra: Value) -> String {
    let mut e = json!({
        "tools": [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {"terms": {"type": "string"}}}}}],
        "max_tokens": 1000,
    });
    e.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    chat("tiny", "find it", e)
}

#[tokio::test]
async fn tool_calls_stream_as_each_api_streams_them() {
    let sim = Sim::start(&["--preset", "tiny", "--time-scale", "50"]);
    // Chat: the opening delta names the call, fragments follow, `tool_calls` ends it.
    let resp = sim
        .post(
            "/v1/chat/completions",
            chat_tools(json!({"stream": true, "stream_options": {"include_usage": true}})),
        )
        .await;
    let chunks = data_chunks(&resp.text().await.unwrap());
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
        .map(|t| &t[0])
        .collect();
    assert_eq!(calls[0]["function"]["name"], "search");
    assert_eq!(calls[0]["type"], "function");
    assert!(
        calls[0]["id"]
            .as_str()
            .unwrap()
            .starts_with("chatcmpl-tool-")
    );
    assert_eq!(calls[0]["function"]["arguments"], "");
    assert!(
        calls[1..]
            .iter()
            .all(|c| c.get("id").is_none() && c["index"] == 0)
    );
    let arguments: String = calls
        .iter()
        .map(|c| c["function"]["arguments"].as_str().unwrap())
        .collect();
    let parsed: Value = serde_json::from_str(&arguments).unwrap();
    assert!(
        parsed["terms"].as_str().is_some_and(|t| !t.is_empty()),
        "{arguments}"
    );
    let finish = chunks
        .iter()
        .find_map(|c| c["choices"][0]["finish_reason"].as_str())
        .unwrap();
    assert_eq!(finish, "tool_calls");
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(
        usage["completion_tokens"].as_u64(),
        Some(calls.len() as u64 - 1),
        "one fragment per token"
    );

    // The same request whole carries the same arguments.
    let whole: Value = sim
        .post("/v1/chat/completions", chat_tools(json!({})))
        .await
        .json()
        .await
        .unwrap();
    let message = &whole["choices"][0]["message"];
    assert!(message["content"].is_null());
    assert_eq!(
        message["tool_calls"][0]["function"]["arguments"],
        arguments.as_str()
    );
    assert_eq!(whole["choices"][0]["finish_reason"], "tool_calls");
    let none: Value = sim
        .post(
            "/v1/chat/completions",
            chat_tools(json!({"tool_choice": "none", "max_tokens": 3})),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(none["choices"][0]["message"]["tool_calls"], json!([]));
    assert!(none["choices"][0]["message"]["content"].is_string());

    // Responses: a function_call item and its arguments events.
    let tools =
        json!([{"type": "function", "name": "lookup", "parameters": {"properties": {"city": {}}}}]);
    let events = named_events(
        &text_of(
            &sim,
            "/v1/responses",
            responses(json!({"tools": tools, "stream": true})),
        )
        .await,
    );
    let added = events
        .iter()
        .find(|(e, _)| e == "response.output_item.added")
        .unwrap();
    assert_eq!(added.1["item"]["type"], "function_call");
    assert_eq!(added.1["item"]["name"], "lookup");
    assert!(
        added.1["item"]["call_id"]
            .as_str()
            .unwrap()
            .starts_with("call_")
    );
    let fragments: String = events
        .iter()
        .filter(|(e, _)| e == "response.function_call_arguments.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap())
        .collect();
    let done = events
        .iter()
        .find(|(e, _)| e == "response.function_call_arguments.done")
        .unwrap();
    assert_eq!(done.1["arguments"], fragments.as_str());
    assert!(serde_json::from_str::<Value>(&fragments).unwrap()["city"].is_string());
    let completed = &events.last().unwrap().1["response"];
    assert_eq!(completed["output"][0]["arguments"], fragments.as_str());
    assert_eq!(completed["tools"], tools);

    // Messages: a tool_use block of input_json_delta fragments, stop_reason tool_use.
    let body = messages(
        json!({"max_tokens": 1000, "stream": true, "tools": [{"name": "weather", "input_schema": {"type": "object"}}]}),
    );
    let events = named_events(&text_of(&sim, "/v1/messages", body).await);
    let start = events
        .iter()
        .find(|(e, _)| e == "content_block_start")
        .unwrap();
    assert_eq!(start.1["content_block"]["type"], "tool_use");
    assert_eq!(start.1["content_block"]["input"], json!({}));
    let partial: String = events
        .iter()
        .filter(|(e, _)| e == "content_block_delta")
        .map(|(_, d)| {
            assert_eq!(d["delta"]["type"], "input_json_delta");
            d["delta"]["partial_json"].as_str().unwrap()
        })
        .collect();
    assert!(
        serde_json::from_str::<Value>(&partial).unwrap()["query"].is_string(),
        "{partial}"
    );
    assert_eq!(
        events[events.len() - 2].1["delta"]["stop_reason"],
        "tool_use"
    );
}

#[tokio::test]
async fn a_client_leaving_a_new_api_s_stream_frees_its_kv() {
    let sim = Sim::start(&["--preset", "tiny", "--time-scale", "5"]);
    let before = sim.metric("vllm:kv_cache_usage_perc").await;
    for (path, body) in [
        (
            "/v1/responses",
            responses(json!({"stream": true, "max_output_tokens": 3000, "ignore_eos": true})),
        ),
        (
            "/v1/messages",
            messages(json!({"stream": true, "max_tokens": 3000, "ignore_eos": true})),
        ),
        (
            "/v1/completions",
            json!({"model": "tiny", "prompt": ["a", "b"], "stream": true, "max_tokens": 1500, "ignore_eos": true}),
        ),
    ] {
        let mut resp = sim.post(path, body.to_string()).await;
        for _ in 0..5 {
            resp.chunk().await.unwrap().expect("a chunk");
        }
        assert!(
            sim.metric("vllm:kv_cache_usage_perc").await > before,
            "{path}"
        );
        drop(resp);
        let usage = sim
            .wait_for_metric("vllm:kv_cache_usage_perc", |v| v == before)
            .await;
        assert_eq!(usage, before, "{path}: blocks freed after disconnect");
        assert_eq!(sim.metric("vllm:num_requests_running").await, 0.0, "{path}");
    }
    assert!(sim.metric("vllm:generation_tokens_total").await < 3000.0);
}

/// Reads a stream until it ends or is cut.
async fn read_all(mut resp: reqwest::Response) -> (String, bool) {
    let mut text = String::new();
    loop {
        match resp.chunk().await {
            Ok(Some(bytes)) => text.push_str(&String::from_utf8_lossy(&bytes)),
            Ok(None) => return (text, false),
            Err(_) => return (text, true),
        }
    }
}

#[tokio::test]
async fn faults_and_shape_flags_apply_to_the_new_apis() {
    let drop = Sim::start(&[
        "--preset",
        "tiny",
        "--time-scale",
        "50",
        "--drop-after",
        "3",
    ]);
    let resp = drop
        .post(
            "/v1/responses",
            responses(json!({"stream": true, "max_output_tokens": 20, "ignore_eos": true}))
                .to_string(),
        )
        .await;
    let (text, cut) = read_all(resp).await;
    assert!(cut, "{text}");
    assert_eq!(text.matches("event: response.output_text.delta").count(), 3);
    assert!(!text.contains("response.completed"));
    let resp = drop
        .post(
            "/v1/messages",
            messages(json!({"stream": true, "max_tokens": 20, "ignore_eos": true})).to_string(),
        )
        .await;
    let (text, cut) = read_all(resp).await;
    assert!(
        cut && text.matches("text_delta").count() == 3 && !text.contains("message_stop"),
        "{text}"
    );

    // Usage hidden everywhere; three tokens to a chunk.
    let shaped = Sim::start(&[
        "--preset",
        "tiny",
        "--time-scale",
        "50",
        "--omit-usage",
        "--tokens-per-chunk",
        "3",
        "--record-requests",
        "4",
    ]);
    let events = named_events(
        &text_of(
            &shaped,
            "/v1/responses",
            responses(json!({"stream": true, "max_output_tokens": 9, "ignore_eos": true})),
        )
        .await,
    );
    assert!(events.last().unwrap().1["response"]["usage"].is_null());
    assert_eq!(
        events
            .iter()
            .filter(|(e, _)| e == "response.output_text.delta")
            .count(),
        3
    );
    let text = text_of(
        &shaped,
        "/v1/messages",
        messages(json!({"stream": true, "max_tokens": 9, "ignore_eos": true})),
    )
    .await;
    assert!(!text.contains("usage"), "{text}");
    assert_eq!(text.matches("text_delta").count(), 3);
    let body = json_of(&shaped, "/v1/messages", messages(json!({}))).await;
    assert!(body.get("usage").is_none(), "{body}");
    let body = json_of(
        &shaped,
        "/v1/embeddings",
        json!({"model": "tiny", "input": "x"}),
    )
    .await;
    assert!(body.get("usage").is_none(), "{body}");
    let seen = shaped.get_json("/debug/requests").await;
    let paths: Vec<&str> = seen
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["path"].as_str().unwrap())
        .collect();
    assert_eq!(
        paths,
        [
            "/v1/responses",
            "/v1/messages",
            "/v1/messages",
            "/v1/embeddings"
        ]
    );

    // The hang holds every API.
    let hung = Sim::start(&["--preset", "tiny", "--hang"]);
    for (path, body) in [
        ("/v1/messages", messages(json!({}))),
        ("/v1/embeddings", json!({"model": "tiny", "input": "x"})),
    ] {
        let sent = hung
            .http
            .post(hung.url(path))
            .body(body.to_string())
            .timeout(std::time::Duration::from_millis(300))
            .send()
            .await;
        assert!(matches!(sent, Err(e) if e.is_timeout()), "{path}");
    }

    // --exit-after counts the new APIs' requests.
    let mut crashing = Sim::start(&[
        "--preset",
        "tiny",
        "--time-scale",
        "10",
        "--exit-after",
        "2",
    ]);
    json_of(
        &crashing,
        "/v1/embeddings",
        json!({"model": "tiny", "input": "x"}),
    )
    .await;
    let resp = crashing
        .post(
            "/v1/messages",
            messages(json!({"stream": true, "max_tokens": 100})).to_string(),
        )
        .await;
    let (text, _) = read_all(resp).await;
    assert!(!text.contains("message_stop"));
    assert_eq!(crashing.wait_exit(), Some(70));
}
