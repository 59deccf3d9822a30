//! Metering and estimation through real Envoy with the built filter, in front of simulators
//! that answer the way reasoning models and batching engines do: the first tokens of a chat
//! answer as `reasoning_content`, three tokens per chunk. The `/alt/` upstream is such an
//! engine that never reports usage, so the filter's own count is all there is.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::sync::OnceLock;

use reqwest::{Response, StatusCode};
use serde_json::{Value, json};
use weir_core::keys::hash_key;
use weir_e2e::{Envoy, Sim};

/// Output of every answer: `ignore_eos` with this `max_tokens`, so the engine's count is known.
const ANSWER_TOKENS: u64 = 30;
const REASONING_TOKENS: &str = "8";

struct Stack {
    _sim: Sim,
    _silent: Sim,
    envoy: Envoy,
}

fn weir_config() -> Value {
    let key = |id: &str, limits: Value| json!({"id": id, "sha256": hash_key(&format!("key-{id}")), "limits": limits});
    json!({
        "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "meter", "keys": [
            key("plain", json!({})),
            key("tooled", json!({"input_tokens_per_minute": 3000})),
        ]}]}]}],
        "models": {"tiny": {"max_context_tokens": 4096}},
        "max_body_bytes": 2 << 20,
    })
}

fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(|| {
        let shape = [
            "--preset",
            "tiny",
            "--time-scale",
            "5",
            "--reasoning-tokens",
            REASONING_TOKENS,
            "--tokens-per-chunk",
            "3",
        ];
        let sim = Sim::start(&shape);
        let silent = Sim::start(&[&shape[..], &["--omit-usage"]].concat());
        let envoy = Envoy::start(&weir_config(), sim.port, silent.port);
        Stack {
            _sim: sim,
            _silent: silent,
            envoy,
        }
    })
}

fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": content}]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

async fn post(path: &str, key: &str, body: &Value, request_id: &str) -> Response {
    reqwest::Client::new()
        .post(format!("{}{path}", stack().envoy.url))
        .header("content-type", "application/json")
        .header("x-request-id", request_id)
        .bearer_auth(format!("key-{key}"))
        .body(body.to_string())
        .send()
        .await
        .unwrap()
}

/// A field `name=value ` of the request's access log line, once Envoy has written it.
fn logged(request_id: &str, name: &str) -> u64 {
    let line = stack()
        .envoy
        .access_log_for(request_id)
        .pop()
        .unwrap_or_else(|| panic!("{request_id} not logged"));
    line.split_whitespace()
        .find_map(|f| f.strip_prefix(&format!("{name}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {line}"))
}

async fn events(resp: Response) -> Vec<String> {
    assert_eq!(resp.status(), StatusCode::OK);
    let text = resp.text().await.unwrap();
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(str::to_owned)
        .collect()
}

const CHAT: &str = "/v1/chat/completions";

/// Every way a client can say "no usage chunk": each is still billed the engine's count, and
/// the usage chunk stays hidden from it.
#[tokio::test]
async fn clients_cannot_turn_off_the_engines_usage_report() {
    let refusals = [
        json!({}),
        json!({"stream_options": null}),
        json!({"stream_options": {"include_usage": false}}),
        json!({"stream_options": {"include_usage": null}}),
        json!({"stream_options": {}}),
    ];
    for (i, options) in refusals.iter().enumerate() {
        let id = format!("no-usage-{i}");
        let mut extra = json!({"stream": true, "max_tokens": ANSWER_TOKENS, "ignore_eos": true});
        extra
            .as_object_mut()
            .unwrap()
            .extend(options.as_object().unwrap().clone());
        let events = events(post(CHAT, "plain", &chat("think first", extra), &id).await).await;
        assert_eq!(events.last().map(String::as_str), Some("data: [DONE]"));
        assert!(
            events.iter().all(|e| !e.contains("\"usage\"")),
            "{options}: the usage chunk is hidden"
        );
        assert!(
            events.iter().any(|e| e.contains("reasoning_content")),
            "the engine streams reasoning"
        );
        assert_eq!(
            logged(&id, "tokens_out"),
            ANSWER_TOKENS,
            "{options}: billed the engine's count, reasoning included"
        );
    }
}

/// An engine that never reports usage: the filter counts the tokens of every generated field
/// (reasoning and answer, several tokens per chunk), not the events that carried them.
#[tokio::test]
async fn without_engine_usage_every_generated_token_is_counted() {
    for (id, stream) in [("silent-stream", true), ("silent-body", false)] {
        let body = chat(
            "think first",
            json!({"stream": stream, "max_tokens": ANSWER_TOKENS, "ignore_eos": true}),
        );
        let resp = post("/alt/v1/chat/completions", "plain", &body, id).await;
        assert_eq!(resp.status(), StatusCode::OK);
        let text = resp.text().await.unwrap();
        assert!(!text.contains("\"usage\""), "the engine reports nothing");
        let counted = logged(id, "tokens_out");
        // The simulator's pieces are single tokens; the count may only stray where a piece
        // merges with its neighbour (`..`).
        assert!(
            counted.abs_diff(ANSWER_TOKENS) <= 3,
            "{id}: counted {counted} of {ANSWER_TOKENS} generated tokens"
        );
    }
}

/// `n` tool definitions of about 110 tokens each, as an agent framework would send them.
fn tools(n: usize) -> Value {
    let description = "the quick brown fox jumps over the lazy dog ".repeat(10);
    (0..n)
        .map(|i| {
            json!({"type": "function", "function": {
                "name": format!("tool_{i}"),
                "description": description,
                "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
            }})
        })
        .collect()
}

/// One short message with about 100k tokens beside it, wherever an engine (or a chat template)
/// would put them into the prompt: each is over the 4,096-token context, as the engine would
/// find, and refused before it gets there.
#[tokio::test]
async fn prompts_hidden_beside_the_messages_are_counted_against_the_context() {
    let bulk = tools(900);
    let text = bulk.to_string();
    let carriers = [
        ("tools", json!({"tools": bulk})),
        (
            "functions",
            json!({"functions": bulk.as_array().unwrap().iter().map(|t| t["function"].clone()).collect::<Vec<_>>()}),
        ),
        (
            "response_format",
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"enum": bulk}}}}),
        ),
        ("guided_json", json!({"guided_json": {"enum": bulk}})),
        ("guided_regex", json!({"guided_regex": text})),
        (
            "an invented field",
            json!({"context_for_my_template": text}),
        ),
        (
            "assistant tool calls",
            json!({"messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "lookup", "arguments": text}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"},
            ]}),
        ),
    ];
    for (what, extra) in carriers {
        let mut body = chat("hi", json!({"max_tokens": 1}));
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let resp = post(CHAT, "plain", &body, &format!("hidden-{what}")).await;
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{what}");
        let err = resp.json::<Value>().await.unwrap()["error"].clone();
        assert_eq!(err["code"], "context_length_exceeded", "{what}: {err}");
    }
}

/// Tools that fit are charged: the estimate counts them as the engine does, so a 3,000 input
/// tokens/min budget admits one 2,000-token request, not a hundred.
#[tokio::test]
async fn tool_definitions_that_fit_are_charged() {
    let body = chat("which tool?", json!({"max_tokens": 1, "tools": tools(18)}));
    let first = post(CHAT, "tooled", &body, "tools-charged-1").await;
    assert_eq!(first.status(), StatusCode::OK);
    let engine = first.json::<Value>().await.unwrap()["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap();
    assert!(engine > 1_900, "the engine renders the tools: {engine}");
    let estimate = logged("tools-charged-1", "estimate");
    // Over 8 KiB of text, so the fast estimator's count: within its error on JSON.
    assert!(
        estimate.abs_diff(engine) * 5 <= engine,
        "estimate {estimate} vs engine {engine}"
    );
    let second = post(CHAT, "tooled", &body, "tools-charged-2").await;
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    let err = second.json::<Value>().await.unwrap()["error"].clone();
    assert!(
        err["message"]
            .as_str()
            .unwrap()
            .contains("input_tokens_per_minute"),
        "{err}"
    );
}
