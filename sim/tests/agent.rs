//! Agent mode against the real binary on loopback: a tool result last is answered with text,
//! `call A, B` makes parallel calls, and the `split-tool-name` fault splits a streamed call over
//! two events — in the chat, Responses and Messages shapes, streamed and whole.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

mod common;

use std::collections::BTreeMap;

use common::{Sim, data_chunks, named_events};
use serde_json::{Value, json};

/// The three APIs' paths and bodies offering the tools `get_weather` (argument `city`) and
/// `get_time`, with `user` as the last user turn in each shape.
fn bodies(user: &str, extra: Value) -> [(&'static str, Value); 3] {
    let weather = json!({"type": "object", "properties": {"city": {"type": "string"}}});
    let mut out = [
        (
            "/v1/chat/completions",
            json!({
                "model": "tiny", "max_tokens": 400,
                "messages": [{"role": "user", "content": user}],
                "tools": [
                    {"type": "function", "function": {"name": "get_weather", "parameters": weather}},
                    {"type": "function", "function": {"name": "get_time"}},
                ],
            }),
        ),
        (
            "/v1/responses",
            json!({
                "model": "tiny", "max_output_tokens": 400,
                "input": [{"role": "user", "content": user}],
                "tools": [
                    {"type": "function", "name": "get_weather", "parameters": weather},
                    {"type": "function", "name": "get_time", "parameters": {}},
                ],
            }),
        ),
        (
            "/v1/messages",
            json!({
                "model": "tiny", "max_tokens": 400,
                "messages": [{"role": "user", "content": user}],
                "tools": [
                    {"name": "get_weather", "input_schema": weather},
                    {"name": "get_time", "input_schema": {"type": "object"}},
                ],
            }),
        ),
    ];
    for (_, body) in &mut out {
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
    }
    out
}

async fn answer(sim: &Sim, path: &str, body: &Value, fault: Option<&str>) -> String {
    let mut req = sim
        .http
        .post(sim.url(path))
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(fault) = fault {
        req = req.header("x-sim-fault", fault);
    }
    let resp = req.send().await.unwrap();
    assert_eq!(resp.status(), 200, "{path}");
    resp.text().await.unwrap()
}

/// A call as a client reassembles it: its id, name and arguments.
#[derive(Debug, Default)]
struct Call {
    id: String,
    name: String,
    arguments: String,
}

/// The calls of a streamed answer by their index, and the events each one's name and
/// arguments came in.
#[derive(Debug, Default)]
struct Streamed {
    calls: BTreeMap<u64, Call>,
    name_events: Vec<String>,
    argument_events: Vec<String>,
}

fn streamed(path: &str, text: &str) -> Streamed {
    let mut out = Streamed::default();
    match path {
        "/v1/chat/completions" => {
            for chunk in data_chunks(text) {
                let Some(deltas) = chunk["choices"][0]["delta"]["tool_calls"].as_array() else {
                    continue;
                };
                for d in deltas {
                    let call = out.calls.entry(d["index"].as_u64().unwrap()).or_default();
                    call.id += d["id"].as_str().unwrap_or_default();
                    if let Some(name) = d["function"]["name"].as_str() {
                        call.name += name;
                        out.name_events.push(name.to_owned());
                    }
                    let arguments = d["function"]["arguments"].as_str().unwrap();
                    if !arguments.is_empty() {
                        call.arguments += arguments;
                        out.argument_events.push(arguments.to_owned());
                    }
                }
            }
        }
        "/v1/responses" => {
            for (event, data) in named_events(text) {
                let index = data["output_index"].as_u64().unwrap_or_default();
                if event == "response.output_item.added" && data["item"]["type"] == "function_call"
                {
                    let call = out.calls.entry(index).or_default();
                    call.id = data["item"]["call_id"].as_str().unwrap().to_owned();
                    call.name = data["item"]["name"].as_str().unwrap().to_owned();
                    out.name_events.push(call.name.clone());
                }
                if event == "response.function_call_arguments.delta" {
                    let delta = data["delta"].as_str().unwrap();
                    out.calls.get_mut(&index).unwrap().arguments += delta;
                    out.argument_events.push(delta.to_owned());
                }
            }
        }
        _ => {
            for (event, data) in named_events(text) {
                let index = data["index"].as_u64().unwrap_or_default();
                if event == "content_block_start" && data["content_block"]["type"] == "tool_use" {
                    let call = out.calls.entry(index).or_default();
                    call.id = data["content_block"]["id"].as_str().unwrap().to_owned();
                    call.name = data["content_block"]["name"].as_str().unwrap().to_owned();
                    out.name_events.push(call.name.clone());
                }
                if event == "content_block_delta" && data["delta"]["type"] == "input_json_delta" {
                    let delta = data["delta"]["partial_json"].as_str().unwrap();
                    out.calls.get_mut(&index).unwrap().arguments += delta;
                    out.argument_events.push(delta.to_owned());
                }
            }
        }
    }
    out
}

/// The calls of a whole answer, in order.
fn whole(path: &str, text: &str) -> Vec<Call> {
    let v: Value = serde_json::from_str(text).unwrap();
    let call = |id: &Value, name: &Value, arguments: String| Call {
        id: id.as_str().unwrap().to_owned(),
        name: name.as_str().unwrap().to_owned(),
        arguments,
    };
    match path {
        "/v1/chat/completions" => v["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                let arguments = c["function"]["arguments"].as_str().unwrap().to_owned();
                call(&c["id"], &c["function"]["name"], arguments)
            })
            .collect(),
        "/v1/responses" => v["output"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|i| i["type"] == "function_call")
            .map(|i| {
                let arguments = i["arguments"].as_str().unwrap().to_owned();
                call(&i["call_id"], &i["name"], arguments)
            })
            .collect(),
        _ => v["content"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["type"] == "tool_use")
            .map(|b| call(&b["id"], &b["name"], b["input"].to_string()))
            .collect(),
    }
}

/// Each call's name, and the one key of its arguments (which must be a JSON object).
fn names_and_keys<'a>(calls: impl IntoIterator<Item = &'a Call>) -> Vec<(String, String)> {
    calls
        .into_iter()
        .map(|c| {
            let args: Value = serde_json::from_str(&c.arguments)
                .unwrap_or_else(|e| panic!("{}: {e}", c.arguments));
            let keys: Vec<&String> = args.as_object().unwrap().keys().collect();
            assert_eq!(keys.len(), 1, "{args}");
            (c.name.clone(), keys[0].clone())
        })
        .collect()
}

#[tokio::test]
async fn call_a_and_b_makes_two_parallel_calls_in_each_api() {
    let sim = Sim::start(&["--preset", "tiny", "--time-scale", "50"]);
    let expected = [
        ("get_weather".to_owned(), "city".to_owned()),
        ("get_time".to_owned(), "query".to_owned()),
    ];
    for (path, body) in bodies("call get_weather, get_time", json!({})) {
        let calls = whole(path, &answer(&sim, path, &body, None).await);
        assert_eq!(names_and_keys(&calls), expected, "{path}");
        assert_ne!(calls[0].id, calls[1].id, "{path}");

        let mut body = body;
        body["stream"] = json!(true);
        let text = answer(&sim, path, &body, None).await;
        let streamed = streamed(path, &text);
        assert_eq!(names_and_keys(streamed.calls.values()), expected, "{path}");
        let ids: Vec<&str> = streamed.calls.values().map(|c| c.id.as_str()).collect();
        assert!(ids[0] != ids[1] && !ids[1].is_empty(), "{path}: {ids:?}");
        let indexes: Vec<u64> = streamed.calls.keys().copied().collect();
        let want = if path == "/v1/chat/completions" {
            [0, 1]
        } else {
            [indexes[0], indexes[0] + 1]
        };
        assert_eq!(indexes, want, "{path}");
        let stop = ["tool_calls", "tool_use"].iter().any(|s| text.contains(s));
        assert!(stop, "{path}: {text}");
    }
}

#[tokio::test]
async fn a_tool_result_last_turn_is_answered_with_text_in_each_api() {
    let sim = Sim::start(&["--preset", "tiny", "--time-scale", "50"]);
    let [(chat, mut c), (responses, mut r), (messages, mut m)] =
        bodies("call get_weather", json!({}));
    c["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "tool_calls": [{"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}),
        json!({"role": "tool", "tool_call_id": "x", "content": "sunny"}),
    ]);
    r["input"].as_array_mut().unwrap().extend([
        json!({"type": "function_call", "call_id": "x", "name": "get_weather", "arguments": "{}"}),
        json!({"type": "function_call_output", "call_id": "x", "output": "sunny"}),
    ]);
    m["messages"].as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": [{"type": "tool_use", "id": "x", "name": "get_weather", "input": {}}]}),
        json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "sunny"}]}),
    ]);
    let c_text: Value = serde_json::from_str(&answer(&sim, chat, &c, None).await).unwrap();
    assert!(c_text["choices"][0]["message"]["content"].is_string());
    assert_ne!(c_text["choices"][0]["finish_reason"], "tool_calls");
    let r_text: Value = serde_json::from_str(&answer(&sim, responses, &r, None).await).unwrap();
    assert!(
        r_text["output"]
            .as_array()
            .unwrap()
            .iter()
            .all(|i| i["type"] == "message")
    );
    let m_text: Value = serde_json::from_str(&answer(&sim, messages, &m, None).await).unwrap();
    assert_eq!(m_text["content"][0]["type"], "text");
    assert_ne!(m_text["stop_reason"], "tool_use");
    // A forced tool choice still calls, streamed too.
    c["tool_choice"] = json!("required");
    c["stream"] = json!(true);
    let forced = streamed(chat, &answer(&sim, chat, &c, None).await);
    assert_eq!(forced.calls.len(), 1);
}

#[tokio::test]
async fn the_split_tool_name_fault_splits_the_name_over_two_events() {
    let sim = Sim::start(&["--preset", "tiny", "--time-scale", "50"]);
    let fault = Some("split-tool-name");
    for (path, body) in bodies("call get_weather", json!({"stream": true})) {
        let plain = streamed(path, &answer(&sim, path, &body, None).await);
        let split = streamed(path, &answer(&sim, path, &body, fault).await);
        assert_eq!(
            names_and_keys(split.calls.values()),
            [("get_weather".to_owned(), "city".to_owned())],
            "{path}: the pieces add up"
        );
        if path == "/v1/chat/completions" {
            assert_eq!(plain.name_events, ["get_weather"]);
            assert_eq!(split.name_events, ["get_w", "eather"]);
        }
        // The first arguments fragment (`{"city": "` and the first token) over two events.
        let first = |s: &Streamed| s.argument_events[0].clone();
        assert_eq!(
            first(&split) + &split.argument_events[1],
            first(&plain),
            "{path}"
        );
        assert!(!first(&split).is_empty() && !split.argument_events[1].is_empty());
        assert_eq!(split.argument_events.len(), plain.argument_events.len() + 1);
    }
    let (path, body) = &bodies("x", json!({}))[0];
    let refused = sim
        .http
        .post(sim.url(path))
        .header("content-type", "application/json")
        .header("x-sim-fault", "split-tool")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 400, "an unknown fault is refused");
}
