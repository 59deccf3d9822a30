//! The approved call delivered to its re-send: the answer the engine would have given with
//! that one call in it, in the re-send's API shape, streamed or whole as it asks, with zero
//! usage (the engine does not run; the tokens of the call were billed when the model made it).
//! `idempotent-replayed: true` makes the filter settle nothing for it, and
//! `weir-approval: delivered` tells it the call is the approved one (not to be withheld).

use axum::body::Bytes;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use weir_core::endpoint::Endpoint;

use super::HeldCall;

/// The header that marks a delivered call.
pub const DELIVERED: &str = "weir-approval";

/// The response to a re-send (`request`, its body) of approval `id` holding `call`, at
/// `now_s` (Unix seconds).
pub fn delivered(call: &HeldCall, id: &str, request: &Value, now_s: u64) -> Response {
    let stream = request["stream"].as_bool().unwrap_or(false);
    let (content_type, body) = if stream {
        let usage = request["stream_options"]["include_usage"].as_bool() == Some(true);
        (
            "text/event-stream",
            Bytes::from(events(call, id, now_s, usage)),
        )
    } else {
        let body = whole(call, id, now_s).to_string();
        ("application/json", Bytes::from(body))
    };
    let mut resp = (StatusCode::OK, body).into_response();
    let headers = resp.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    headers.insert(DELIVERED, HeaderValue::from_static("delivered"));
    resp
}

/// The Messages `input`: the arguments as JSON, or `{}` if they are not.
fn input(call: &HeldCall) -> Value {
    serde_json::from_str(&call.arguments).unwrap_or_else(|_| json!({}))
}

fn responses_item(call: &HeldCall, id: &str) -> Value {
    json!({"type": "function_call", "id": format!("fc_{id}"), "call_id": call.call_id,
           "name": call.name, "arguments": call.arguments, "status": "completed"})
}

fn responses_body(
    call: &HeldCall,
    id: &str,
    now_s: u64,
    output: Vec<Value>,
    status: &str,
) -> Value {
    json!({"id": format!("resp_{id}"), "object": "response", "created_at": now_s,
           "status": status, "model": call.model, "output": output,
           "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                     "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens_details": {"reasoning_tokens": 0}}})
}

const MESSAGES_USAGE: fn() -> Value = || json!({"input_tokens": 0, "output_tokens": 0});

/// A whole (non-streamed) answer.
fn whole(call: &HeldCall, id: &str, now_s: u64) -> Value {
    match call.endpoint {
        Endpoint::Responses => {
            responses_body(call, id, now_s, vec![responses_item(call, id)], "completed")
        }
        Endpoint::Messages => json!({
            "id": format!("msg_{id}"), "type": "message", "role": "assistant",
            "model": call.model,
            "content": [{"type": "tool_use", "id": call.call_id, "name": call.name,
                         "input": input(call)}],
            "stop_reason": "tool_use", "stop_sequence": null, "usage": MESSAGES_USAGE(),
        }),
        _ => json!({
            "id": format!("chatcmpl-{id}"), "object": "chat.completion", "created": now_s,
            "model": call.model,
            "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": null,
                "message": {"role": "assistant", "content": null, "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}]}}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }),
    }
}

/// A streamed answer's events (`usage`: the chat stream's usage chunk was asked for).
fn events(call: &HeldCall, id: &str, now_s: u64, usage: bool) -> String {
    let mut out = String::new();
    let mut event = |name: Option<&str>, data: &Value| {
        if let Some(name) = name {
            out.push_str(&format!("event: {name}\n"));
        }
        out.push_str(&format!("data: {data}\n\n"));
    };
    match call.endpoint {
        Endpoint::Responses => {
            let started = responses_body(call, id, now_s, Vec::new(), "in_progress");
            let mut added = responses_item(call, id);
            added["arguments"] = json!("");
            added["status"] = json!("in_progress");
            let item = responses_item(call, id);
            let fc = format!("fc_{id}");
            let steps = [
                ("response.created", json!({"response": started})),
                (
                    "response.output_item.added",
                    json!({"output_index": 0, "item": added}),
                ),
                (
                    "response.function_call_arguments.delta",
                    json!({"output_index": 0, "item_id": fc, "delta": call.arguments}),
                ),
                (
                    "response.function_call_arguments.done",
                    json!({"output_index": 0, "item_id": fc, "arguments": call.arguments}),
                ),
                (
                    "response.output_item.done",
                    json!({"output_index": 0, "item": item}),
                ),
                (
                    "response.completed",
                    json!({"response": responses_body(call, id, now_s, vec![item.clone()], "completed")}),
                ),
            ];
            for (n, (kind, mut data)) in steps.into_iter().enumerate() {
                data["type"] = json!(kind);
                data["sequence_number"] = json!(n);
                event(Some(kind), &data);
            }
        }
        Endpoint::Messages => {
            let message = json!({"id": format!("msg_{id}"), "type": "message", "role": "assistant",
                "model": call.model, "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": MESSAGES_USAGE()});
            let steps = [
                ("message_start", json!({"message": message})),
                (
                    "content_block_start",
                    json!({"index": 0, "content_block":
                    {"type": "tool_use", "id": call.call_id, "name": call.name, "input": {}}}),
                ),
                (
                    "content_block_delta",
                    json!({"index": 0, "delta":
                    {"type": "input_json_delta", "partial_json": call.arguments}}),
                ),
                ("content_block_stop", json!({"index": 0})),
                (
                    "message_delta",
                    json!({"delta": {"stop_reason": "tool_use", "stop_sequence": null},
                    "usage": {"output_tokens": 0}}),
                ),
                ("message_stop", json!({})),
            ];
            for (kind, mut data) in steps {
                data["type"] = json!(kind);
                event(Some(kind), &data);
            }
        }
        _ => {
            let chunk = |choices: Value| {
                json!({"id": format!("chatcmpl-{id}"),
                "object": "chat.completion.chunk", "created": now_s, "model": call.model,
                "choices": choices})
            };
            event(
                None,
                &chunk(json!([{"index": 0, "finish_reason": null, "delta": {
                "role": "assistant", "content": null, "tool_calls": [{"index": 0,
                    "id": call.call_id, "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}]}}])),
            );
            event(
                None,
                &chunk(json!([{"index": 0, "delta": {}, "finish_reason": "tool_calls"}])),
            );
            if usage {
                let mut last = chunk(json!([]));
                last["usage"] =
                    json!({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0});
                event(None, &last);
            }
            out.push_str("data: [DONE]\n\n");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_core::tools::{ToolScan, body_calls};

    /// Each shape, streamed or whole, reads back (as weir's own scan reads an engine's answer)
    /// as the one call held, whole and verbatim.
    #[test]
    fn a_delivered_call_reads_back_as_the_call_held_in_each_api() {
        for endpoint in [
            Endpoint::ChatCompletions,
            Endpoint::Responses,
            Endpoint::Messages,
        ] {
            let call = HeldCall::new(
                endpoint,
                "tiny",
                "call_9",
                "deploy_prod",
                r#"{"env":"prod"}"#,
            );
            let body = whole(&call, "apr_x", 1).to_string();
            let calls = body_calls(endpoint, body.as_bytes()).unwrap();
            let stream = events(&call, "apr_x", 1, true);
            let mut scan = ToolScan::new(endpoint);
            for event in stream.split_inclusive("\n\n") {
                scan.observe(event.as_bytes());
            }
            assert!(scan.saw_done(), "{endpoint:?}");
            for read in [&calls[..], scan.calls()] {
                assert_eq!(read.len(), 1, "{endpoint:?}");
                let c = &read[0];
                assert!(c.complete, "{endpoint:?}");
                assert_eq!(
                    (c.id.as_str(), c.name.as_str(), c.arguments.as_str()),
                    ("call_9", "deploy_prod", r#"{"env":"prod"}"#),
                    "{endpoint:?}"
                );
            }
        }
    }
}
