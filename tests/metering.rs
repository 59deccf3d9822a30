//! Metering and estimation through real Envoy with the built filter, in front of simulators
//! that answer the way reasoning models and batching engines do: the first tokens of a chat
//! answer as `reasoning_content`, three tokens per chunk. The `/alt/` upstream is such an
//! engine that never reports usage, so the filter's own count is all there is.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::sync::OnceLock;

use reqwest::{Response, StatusCode};
use serde_json::{Value, json};
use weir_e2e::{Envoy, Sim, api_key_limited, chat_body, post_json};

/// Output of every answer: `ignore_eos` with this `max_tokens`, so the engine's count is known.
const ANSWER_TOKENS: u64 = 30;
const REASONING_TOKENS: &str = "8";

struct Stack {
    /// Records what it receives, so tests can see what weir sent on (or did not).
    sim: Sim,
    _silent: Sim,
    envoy: Envoy,
}

fn weir_config() -> Value {
    let key = api_key_limited;
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
        let sim = Sim::start(&[&shape[..], &["--record-requests", "1000"]].concat());
        let silent = Sim::start(&[&shape[..], &["--omit-usage"]].concat());
        let envoy = Envoy::start(&weir_config(), sim.port, silent.port);
        Stack {
            sim,
            _silent: silent,
            envoy,
        }
    })
}

fn chat(content: &str, extra: Value) -> Value {
    chat_body("tiny", content, extra)
}

async fn post(path: &str, key: &str, body: &Value, request_id: &str) -> Response {
    post_to(&stack().envoy, path, key, body, request_id).await
}

/// A request on a connection of its own.
async fn post_to(envoy: &Envoy, path: &str, key: &str, body: &Value, request_id: &str) -> Response {
    let url = format!("{}{path}", envoy.url);
    post_json(
        &url,
        Some(key),
        body.to_string(),
        &[("x-request-id", request_id)],
    )
    .await
}

/// A field `name=value ` of the request's access log line, once Envoy has written it.
fn logged_text(request_id: &str, name: &str) -> String {
    let fields = stack().envoy.access_log_fields(request_id);
    fields
        .get(name)
        .cloned()
        .unwrap_or_else(|| panic!("no {name} in {fields:?}"))
}

/// A numeric field of the request's access log line.
fn logged(request_id: &str, name: &str) -> u64 {
    let value = logged_text(request_id, name);
    value
        .parse()
        .unwrap_or_else(|_| panic!("{request_id}: {name}={value} is not a number"))
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

/// Every way a client can say "no usage chunk": the engine is asked for usage all the same
/// (what it received is checked, since its count and weir's own fallback count agree), each is
/// billed the engine's count, and the usage chunk stays hidden from the client.
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
        let received = stack().sim.received_with_id(&id).await;
        assert_eq!(received.len(), 1, "{options}: reached the engine once");
        assert_eq!(
            received[0]["body"]["stream_options"],
            json!({"include_usage": true}),
            "{options}: the engine must be asked for the usage chunk whatever the client sent"
        );
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
/// find, and refused before it gets there. The simulator would refuse it with the same 400, so
/// the test checks that weir did: the engine never received it, and weir logged it rejected.
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
        let id = format!("hidden-{}", what.replace(' ', "-"));
        let resp = post(CHAT, "plain", &body, &id).await;
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{what}");
        let err = resp.json::<Value>().await.unwrap()["error"].clone();
        assert_eq!(err["code"], "context_length_exceeded", "{what}: {err}");
        assert!(
            stack().sim.received_with_id(&id).await.is_empty(),
            "{what}: weir let it through to the engine (which refused it itself)"
        );
        assert_eq!(
            logged_text(&id, "outcome"),
            "rejected",
            "{what}: refused by weir"
        );
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

/// An Envoy of its own for the tests that hold a stream while something else runs beside it:
/// exact token counts up to 2 MiB (so the exact tokenizer meets [`poison`]), and slot leases of
/// two seconds.
fn lease_stack() -> &'static (Sim, Envoy) {
    static STACK: OnceLock<(Sim, Envoy)> = OnceLock::new();
    STACK.get_or_init(|| {
        let sim = Sim::start(&["--preset", "tiny", "--time-scale", "5"]);
        let key = api_key_limited;
        let config = json!({
            "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "lease", "keys": [
                key("plain", json!({})),
                key("long", json!({"concurrent_requests": 1})),
            ]}]}]}],
            "models": {"tiny": {"max_context_tokens": 4096}},
            "estimator": {"exact_below_bytes": 2 << 20},
            "max_body_bytes": 2 << 20,
            "slot_lease_ms": 2000,
        });
        let envoy = Envoy::start(&config, sim.port, sim.port);
        (sim, envoy)
    })
}

/// A million spaces before a word: tiktoken's pre-tokenizer regex gives up on it (sent on a
/// fresh connection each time, so both workers get some).
fn poison() -> Value {
    chat(
        &format!("{}x", " ".repeat(1_000_000)),
        json!({"max_tokens": 1}),
    )
}

/// A prompt the exact tokenizer cannot handle is estimated instead: it is answered by weir like
/// any other (here, over the context), and the streams in flight beside it run to the end.
#[tokio::test]
async fn a_prompt_the_tokenizer_cannot_handle_disturbs_nothing() {
    let _alone = LEASE_STACK_TURN.lock().await;
    let (_, envoy) = lease_stack();
    let body = chat(
        "go on",
        json!({"stream": true, "max_tokens": 300, "ignore_eos": true}),
    );
    let mut held = post_to(envoy, CHAT, "plain", &body, "beside-1").await;
    assert_eq!(held.status(), StatusCode::OK);
    held.chunk().await.unwrap().unwrap();
    for i in 0..12 {
        let resp = post_to(envoy, CHAT, "plain", &poison(), &format!("estimated-{i}")).await;
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "poison {i}");
        let err = resp.json::<Value>().await.unwrap()["error"].clone();
        assert_eq!(err["code"], "context_length_exceeded", "{err}");
    }
    let mut seen = String::new();
    while let Ok(Some(chunk)) = held.chunk().await {
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(
        seen.ends_with("data: [DONE]\n\n"),
        "the stream beside ran to its end"
    );
    assert!(!seen.contains("\"usage\""), "and stayed metered");
}

/// The lease stack's tests take turns: each times a stream that the other's load would slow.
static LEASE_STACK_TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Whether a one-token request of `key` gets through (a slot is free) within ten seconds.
async fn slot_comes_back(envoy: &Envoy, key: &str) -> bool {
    let body = chat("ping", json!({"max_tokens": 1}));
    for i in 0..100 {
        let resp = post_to(envoy, CHAT, key, &body, &format!("ping-{key}-{i}")).await;
        if resp.status() == StatusCode::OK {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    false
}

/// `slot_lease_ms` of [`fault_stack`].
const FAULT_STACK_LEASE: std::time::Duration = std::time::Duration::from_secs(2);

/// An Envoy of its own running the filter's fault-injection build (`filter/src/fault.rs`), so
/// the VMs it traps hold no other test's requests: one key with a single concurrency slot, and
/// slot leases of [`FAULT_STACK_LEASE`].
fn fault_stack() -> &'static (Sim, Envoy) {
    static STACK: OnceLock<(Sim, Envoy)> = OnceLock::new();
    STACK.get_or_init(|| {
        let sim = Sim::start(&["--preset", "tiny", "--time-scale", "5"]);
        let key = api_key_limited;
        let config = json!({
            "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "fault", "keys": [
                key("leaky", json!({"concurrent_requests": 1})),
            ]}]}]}],
            "models": {"tiny": {"max_context_tokens": 4096}},
            "slot_lease_ms": FAULT_STACK_LEASE.as_millis() as u64,
        });
        let envoy = Envoy::start_fault_injecting(&config, sim.port, sim.port);
        (sim, envoy)
    })
}

/// A VM that traps takes its requests' contexts with it: no `on_log`, no settle, no renewal.
/// The fault-injection build traps on `weir-fault: trap-after-reserve` right after the request
/// took the key's only slot; Envoy (`FAIL_RELOAD`) replaces the VM. The slot stays taken — the
/// next request is refused on `concurrent_requests` — until its lease lapses, then comes back
/// without Envoy restarting.
#[tokio::test]
async fn a_slot_whose_holder_died_with_its_vm_comes_back() {
    let (_, envoy) = fault_stack();
    let ping = chat("ping", json!({"max_tokens": 1}));
    let url = format!("{}{CHAT}", envoy.url);
    let trapped = post_json(
        &url,
        Some("leaky"),
        ping.to_string(),
        &[
            ("x-request-id", "trapped"),
            ("weir-fault", "trap-after-reserve"),
        ],
    )
    .await;
    let trapped_at = std::time::Instant::now();
    assert_eq!(
        trapped.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "the request's VM trapped (Envoy fails the stream)"
    );

    // A request on the trapped worker before Envoy replaced its VM is failed (503) too; the
    // first one a live VM judges finds the slot taken.
    let mut attempt = 0;
    let (status, body) = loop {
        attempt += 1;
        let resp = post_to(envoy, CHAT, "leaky", &ping, &format!("taken-{attempt}")).await;
        if resp.status() == StatusCode::SERVICE_UNAVAILABLE
            && trapped_at.elapsed() < FAULT_STACK_LEASE / 2
        {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        }
        break (resp.status(), resp.json::<Value>().await.unwrap());
    };
    assert_eq!(
        status,
        StatusCode::TOO_MANY_REQUESTS,
        "the trapped request's slot is still taken: {body}"
    );
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("concurrent_requests"), "{body}");
    assert!(
        trapped_at.elapsed() < FAULT_STACK_LEASE,
        "refused within the lease"
    );

    assert!(
        slot_comes_back(envoy, "leaky").await,
        "the slot of a request whose VM trapped must come back once its lease ({} ms) lapses",
        FAULT_STACK_LEASE.as_millis()
    );
    let back_after = trapped_at.elapsed();
    eprintln!(
        "the slot came back {} ms after the trap",
        back_after.as_millis()
    );
    // Measured from the trapped request's answer, a little after its lease was taken.
    assert!(
        back_after >= FAULT_STACK_LEASE * 3 / 4,
        "back when its lease lapsed, not before: {back_after:?}"
    );
    assert!(
        envoy.stat("wasm.weir.vm_reload_success").await >= Some(1),
        "the same Envoy replaced the trapped VM"
    );
}

/// A stream that outlives many lease times keeps its slot: its VM renews the lease while the
/// request lives, and gives it back when the stream ends.
#[tokio::test]
async fn a_long_stream_keeps_its_slot_past_the_lease_time() {
    let _alone = LEASE_STACK_TURN.lock().await;
    let (_, envoy) = lease_stack();
    let body = chat(
        "go on",
        json!({"stream": true, "max_tokens": 3000, "ignore_eos": true}),
    );
    let mut held = post_to(envoy, CHAT, "long", &body, "long-1").await;
    assert_eq!(held.status(), StatusCode::OK);
    let start = std::time::Instant::now();
    // Three lease times (2 s each) of streaming.
    while start.elapsed() < std::time::Duration::from_secs(6) {
        assert!(held.chunk().await.unwrap().is_some(), "still streaming");
    }
    let ping = chat("ping", json!({"max_tokens": 1}));
    let busy = post_to(envoy, CHAT, "long", &ping, "long-2").await;
    assert_eq!(
        busy.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "the slot is still the stream's"
    );
    drop(held);
    assert!(slot_comes_back(envoy, "long").await);
}
