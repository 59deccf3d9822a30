//! The tool policy through real Envoy and the built filter: a blocked tool offered is refused
//! or removed; a call the model makes to a blocked tool, a tool it was not offered, or an
//! `approval` tool is withheld — from a stream with an error event in the API's shape, every
//! token still billed; from a whole answer by replacing its body with the error (its status
//! stays the engine's: Envoy sends a module's response headers before its body is seen).
//! The simulator makes the calls (`call deploy`); an upstream of canned answers on `/alt/`
//! stands for a model calling a tool it was not offered.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::io::Write;
use std::sync::OnceLock;

use serde_json::{Value, json};
use weir_e2e::{Envoy, Sim, api_key};

struct Stack {
    sim: Sim,
    envoy: Envoy,
}

/// Key `agent` blocks `shell_*` and needs an approver for `deploy`; key `strict` refuses a
/// blocked tool offered, key `agent` has it removed.
fn weir_config() -> Value {
    let policy = |remove: bool| {
        json!({"tools": {"blocked": ["shell_*"], "classes": {"deploy": "approval"},
                         "on_blocked_offered": if remove { "remove" } else { "refuse" }}})
    };
    json!({
        "orgs": [
            {"id": "agentco", "policy": policy(true), "workspaces": [{"id": "w", "projects": [
                {"id": "p", "keys": [api_key("agent")]}]}]},
            {"id": "strictco", "policy": policy(false), "workspaces": [{"id": "w", "projects": [
                {"id": "p", "keys": [api_key("strict")]}]}]},
        ],
        "models": {"tiny": {"max_context_tokens": 4096}},
        "routes": {"default": {"mode": "enforce"}},
    })
}

/// A chat stream calling `shell_rm` (blocked, and never offered): what a model that ignores
/// its tools sends.
fn rogue_stream() -> String {
    let chunk = |delta: Value, finish: Value| {
        let c = json!({"id": "c", "object": "chat.completion.chunk", "model": "tiny",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        format!("data: {c}\n\n")
    };
    let call = |f: Value| json!({"tool_calls": [{"index": 0, "id": "call_x", "type": "function", "function": f}]});
    let usage = json!({"id": "c", "object": "chat.completion.chunk", "model": "tiny",
        "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21}});
    [
        chunk(json!({"role": "assistant", "content": "ok"}), Value::Null),
        chunk(call(json!({"name": "shell_"})), Value::Null),
        chunk(call(json!({"name": "rm"})), Value::Null),
        chunk(call(json!({"arguments": "{\"path\":\"/\"}"})), Value::Null),
        chunk(json!({}), json!("tool_calls")),
        format!("data: {usage}\n\n"),
        "data: [DONE]\n\n".to_owned(),
    ]
    .concat()
}

/// An upstream answering every request with [`rogue_stream`], in pieces of 7 bytes.
fn rogue_upstream() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let Ok(read_half) = conn.try_clone() else {
                    return;
                };
                let mut reader = std::io::BufReader::new(read_half);
                if weir_e2e::read_http_request(&mut reader).is_none() {
                    return;
                }
                let mut wire = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                                 transfer-encoding: chunked\r\n\r\n"
                    .to_vec();
                for piece in rogue_stream().as_bytes().chunks(7) {
                    wire.extend(format!("{:x}\r\n", piece.len()).bytes());
                    wire.extend_from_slice(piece);
                    wire.extend(b"\r\n");
                }
                wire.extend(b"0\r\n\r\n");
                let _ = conn.write_all(&wire);
            });
        }
    });
    port
}

fn stack() -> &'static Stack {
    static STACK: OnceLock<Stack> = OnceLock::new();
    STACK.get_or_init(|| {
        let sim = Sim::start(&[
            "--preset",
            "tiny",
            "--time-scale",
            "10",
            "--output-len",
            "fixed:8",
            "--record-requests",
            "100",
        ]);
        let envoy = Envoy::start(&weir_config(), sim.port, rogue_upstream());
        Stack { sim, envoy }
    })
}

const OFFERED: [&str; 3] = ["search", "deploy", "shell_rm"];

/// A request to `api` offering `tools`, asking the model to `call` one, streamed or not.
fn request(api: &str, tools: &[&str], call: &str, stream: bool) -> (&'static str, Value) {
    let prompt = format!("call {call}");
    match api {
        "responses" => {
            let tools: Vec<Value> = (tools.iter())
                .map(|n| json!({"type": "function", "name": n, "parameters": {"type": "object", "properties": {"env": {"type": "string"}}}}))
                .collect();
            let body = json!({"model": "tiny", "input": prompt, "tools": tools, "stream": stream,
                              "max_output_tokens": 16});
            ("/v1/responses", body)
        }
        "messages" => {
            let tools: Vec<Value> = (tools.iter())
                .map(|n| json!({"name": n, "input_schema": {"type": "object", "properties": {"env": {"type": "string"}}}}))
                .collect();
            let body = json!({"model": "tiny", "max_tokens": 16, "tools": tools, "stream": stream,
                "messages": [{"role": "user", "content": prompt}]});
            ("/v1/messages", body)
        }
        _ => {
            let tools: Vec<Value> = (tools.iter())
                .map(|n| json!({"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {"env": {"type": "string"}}}}}))
                .collect();
            let body = json!({"model": "tiny", "tools": tools, "stream": stream, "max_tokens": 16,
                "messages": [{"role": "user", "content": prompt}]});
            ("/v1/chat/completions", body)
        }
    }
}

async fn send(prefix: &str, path: &str, key: &str, id: &str, body: &Value) -> reqwest::Response {
    let request = reqwest::Client::new()
        .post(format!("{}{prefix}{path}", stack().envoy.url))
        .timeout(std::time::Duration::from_secs(30))
        .header("x-request-id", id);
    let request = if path == "/v1/messages" {
        (request.header("x-api-key", format!("key-{key}")))
            .header("anthropic-version", "2023-06-01")
    } else {
        request.bearer_auth(format!("key-{key}"))
    };
    request.json(body).send().await.unwrap()
}

/// The data of each event of a stream, as JSON where it is.
fn events(text: &str) -> Vec<Value> {
    (text.split("\n\n"))
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect()
}

/// The error object of a stream's error event.
fn stream_error(api: &str, text: &str) -> Value {
    let event = (events(text).into_iter())
        .find(|d| d.get("error").is_some() || d["type"] == "error")
        .unwrap_or_else(|| panic!("{api}: no error event in {text}"));
    if api == "responses" {
        event
    } else {
        event["error"].clone()
    }
}

/// Output tokens the access log charged for a request id.
fn tokens_out(id: &str) -> u64 {
    stack().envoy.access_log_fields(id)["tokens_out"]
        .parse()
        .unwrap()
}

#[tokio::test]
async fn a_blocked_tool_offered_is_refused_or_removed_as_configured() {
    let (path, body) = request("chat", &OFFERED, "search", false);
    let refused = send("", path, "strict", "offered-refused", &body).await;
    assert_eq!(refused.status(), 403);
    assert_eq!(refused.headers()["x-should-retry"], "false");
    let error = refused.json::<Value>().await.unwrap()["error"].clone();
    assert_eq!(error["code"], "tool_blocked", "{error}");
    assert_eq!(error["param"], "tools[2]", "{error}");
    assert_eq!(error["tool"], "shell_rm", "{error}");
    assert_eq!(error["policy"], "blocked", "{error}");
    assert!(
        stack()
            .sim
            .received_with_id("offered-refused")
            .await
            .is_empty()
    );

    let removed = send("", path, "agent", "offered-removed", &body).await;
    assert_eq!(removed.status(), 200);
    let seen = stack().sim.received_with_id("offered-removed").await;
    let tools = seen[0]["body"]["tools"].to_string();
    assert!(
        !tools.contains("shell_rm") && tools.contains("search"),
        "{tools}"
    );
}

#[tokio::test]
async fn a_blocked_call_in_a_stream_ends_it_with_the_error_and_every_token_is_billed() {
    let (path, body) = request("chat", &["search"], "search", true);
    let resp = send("/alt", path, "agent", "rogue-call", &body).await;
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    assert!(
        !text.contains(r#""name":"shell_""#),
        "the call is withheld: {text}"
    );
    let error = stream_error("chat", &text);
    assert_eq!(error["code"], "tool_blocked", "{text}");
    assert_eq!(error["tool"], "shell_rm", "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert_eq!(tokens_out("rogue-call"), 9, "the engine's count, all of it");
}

#[tokio::test]
async fn an_approval_call_is_withheld_with_approval_required_in_each_api_s_stream() {
    for api in ["chat", "responses", "messages"] {
        let id = format!("approval-{api}");
        let (path, body) = request(api, &["search", "deploy"], "deploy", true);
        let resp = send("", path, "agent", &id, &body).await;
        assert_eq!(resp.status(), 200, "{api}");
        let text = resp.text().await.unwrap();
        let error = stream_error(api, &text);
        assert_eq!(error["code"], "approval_required", "{api}: {text}");
        assert_eq!(error["tool"], "deploy", "{api}: {text}");
        let approval = error["approval_id"].as_str().unwrap();
        assert!(
            approval.starts_with("apr_") && approval.len() == 28,
            "{approval}"
        );
        let digest = error["arguments_sha256"].as_str().unwrap();
        assert_eq!(digest.len(), 64, "{digest}");
        // No event carries the call's arguments to the client.
        for event in events(&text) {
            let kind = event["type"].as_str().unwrap_or("");
            assert!(
                !kind.contains("function_call_arguments") && !kind.contains("content_block_delta")
                    || !event.to_string().contains("partial_json"),
                "{api}: {event}"
            );
            let deltas = &event["choices"][0]["delta"]["tool_calls"];
            assert!(deltas.is_null(), "{api}: {event}");
        }
        assert!(tokens_out(&id) > 0, "{api}: billed");
    }
}

#[tokio::test]
async fn a_whole_answer_making_a_withheld_call_is_answered_with_the_error() {
    for api in ["chat", "responses", "messages"] {
        let id = format!("whole-approval-{api}");
        let (path, body) = request(api, &["search", "deploy"], "deploy", false);
        let resp = send("", path, "agent", &id, &body).await;
        // The headers went before the body could be judged: the engine's status stays.
        assert_eq!(resp.status(), 200, "{api}");
        let body: Value = resp.json().await.unwrap();
        let error = &body["error"];
        assert_eq!(error["code"], "approval_required", "{api}: {body}");
        assert_eq!(error["tool"], "deploy", "{api}: {body}");
        assert!(tokens_out(&id) > 0, "{api}: billed");

        let id = format!("whole-allowed-{api}");
        let (path, body) = request(api, &["search", "deploy"], "search", false);
        let resp = send("", path, "agent", &id, &body).await;
        assert_eq!(resp.status(), 200, "{api}");
        let text = resp.text().await.unwrap();
        assert!(text.contains("search"), "{api}: the call passes: {text}");
    }
}

#[tokio::test]
async fn a_tool_name_split_over_events_is_judged_whole() {
    for api in ["chat", "responses", "messages"] {
        // An allowed call passes whole; an approval call is withheld, however it is split.
        for (call, withheld) in [("search", false), ("deploy", true)] {
            let id = format!("split-{api}-{call}");
            let (path, body) = request(api, &["search", "deploy"], call, true);
            let resp = reqwest::Client::new()
                .post(format!("{}{path}", stack().envoy.url))
                .timeout(std::time::Duration::from_secs(30))
                .bearer_auth("key-agent")
                .header("x-api-key", "key-agent")
                .header("x-request-id", &id)
                .header("x-sim-fault", "split-tool-name")
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200, "{api}");
            let text = resp.text().await.unwrap();
            let error = (events(&text).into_iter())
                .find(|d| d.get("error").is_some() || d["type"] == "error");
            assert_eq!(error.is_some(), withheld, "{api} {call}: {text}");
            if !withheld {
                // Chat sends the name as `sea` then `rch`; the others split the arguments.
                assert!(text.contains("rch\""), "{api}: the call passes: {text}");
            }
        }
    }
}
