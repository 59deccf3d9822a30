//! Anthropic's Messages API (`POST /v1/messages`) in vLLM's shapes.
//!
//! A stream is named events: `message_start` (the message, empty, with the prompt's usage:
//! `input_tokens` less the cached ones, which `cache_read_input_tokens` counts), then one
//! content block per kind of output in the order generated — `thinking` (`thinking_delta`s and a
//! `signature_delta`), `text` (`text_delta`s), `tool_use` (`input_json_delta`s) — each between
//! `content_block_start` and `content_block_stop` (parallel calls are one `tool_use` block each),
//! then `message_delta` with the stop reason (`end_turn`, `max_tokens`, `tool_use`) and the output
//! tokens, and `message_stop`. An engine error mid-stream is an `error` event in Anthropic's
//! envelope. The `split-tool-name` fault sends a call's first `input_json_delta` as two events
//! (the name rides whole on `content_block_start`: the shape has no event to split it over).

use serde::Serialize;
use serde_json::{Value, json};
use weir_core::error::{ApiError, ErrorShape};

use super::{Answer, Encoder, Finish, Outcome, Output, Reply, named_event};
use crate::tool_call::halves;

/// The message object of `message_start` and of whole bodies.
#[derive(Serialize)]
struct MessageObject<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    content: Vec<Value>,
    model: &'a str,
    stop_reason: Option<&'static str>,
    stop_sequence: (),
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<UsageBody>,
}

#[derive(Serialize)]
struct UsageBody {
    input_tokens: u64,
    cache_read_input_tokens: u64,
    cache_creation_input_tokens: u64,
    output_tokens: u32,
}

impl UsageBody {
    fn new(reply: &Reply, cached_tokens: u64, output_tokens: u32) -> Option<Self> {
        reply.usage.map(|_| UsageBody {
            input_tokens: reply.prompt_tokens.saturating_sub(cached_tokens),
            cache_read_input_tokens: cached_tokens,
            cache_creation_input_tokens: 0,
            output_tokens,
        })
    }
}

fn stop_reason(reply: &Reply, finish: Finish) -> &'static str {
    match (finish, reply.calls.is_empty()) {
        (Finish::Stop, false) => "tool_use",
        (Finish::Stop, true) => "end_turn",
        (Finish::Length, _) => "max_tokens",
    }
}

/// The opaque signature a thinking block ends with.
fn signature(reply: &Reply) -> String {
    format!("weir-sim-{}", reply.head.key)
}

/// The kinds of content block, in the order a message generates them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Thinking,
    Text,
    /// The call with this index.
    ToolUse(u32),
}

impl Kind {
    fn of(output: &Output<'_>) -> Self {
        match output {
            Output::Reasoning(_) => Kind::Thinking,
            Output::Text(_) => Kind::Text,
            Output::Arguments(call, _) => Kind::ToolUse(*call),
        }
    }

    /// The block as `content_block_start` opens it (`text` empty), or whole.
    fn block(self, reply: &Reply, text: &str, whole: bool) -> Value {
        match self {
            Kind::Thinking => json!({
                "type": "thinking", "thinking": text,
                "signature": if whole { signature(reply) } else { String::new() },
            }),
            Kind::Text => json!({"type": "text", "text": text}),
            Kind::ToolUse(call) => {
                let (id, name) = reply
                    .calls
                    .get(call as usize)
                    .map_or(("", ""), |t| (t.id.as_str(), t.name.as_str()));
                let input = if whole {
                    serde_json::from_str(text).unwrap_or_else(|_| json!({}))
                } else {
                    json!({})
                };
                json!({"type": "tool_use", "id": id, "name": name, "input": input})
            }
        }
    }

    fn delta(self, text: &str) -> Value {
        match self {
            Kind::Thinking => json!({"type": "thinking_delta", "thinking": text}),
            Kind::Text => json!({"type": "text_delta", "text": text}),
            Kind::ToolUse(_) => json!({"type": "input_json_delta", "partial_json": text}),
        }
    }
}

fn message(
    reply: &Reply,
    content: Vec<Value>,
    stop: Option<&'static str>,
    usage: Option<UsageBody>,
) -> String {
    let object = MessageObject {
        id: &reply.head.id,
        kind: "message",
        role: "assistant",
        content,
        model: &reply.head.model,
        stop_reason: stop,
        stop_sequence: (),
        usage,
    };
    // Plain structs of strings, numbers and JSON values always serialize.
    serde_json::to_string(&object).unwrap_or_default()
}

/// A whole, non-streamed message.
pub fn body(reply: &Reply, answers: &[Answer], outcome: &Outcome) -> String {
    let mut content = Vec::new();
    for answer in answers {
        if !answer.reasoning.is_empty() {
            content.push(Kind::Thinking.block(reply, &answer.reasoning, true));
        }
        if !answer.text.is_empty() || (answer.reasoning.is_empty() && answer.arguments.is_empty()) {
            content.push(Kind::Text.block(reply, &answer.text, true));
        }
        for (call, arguments) in (0u32..).zip(&answer.arguments) {
            content.push(Kind::ToolUse(call).block(reply, arguments, true));
        }
    }
    let u = &outcome.done.usage;
    let finish = outcome.finishes.first().copied().unwrap_or_default();
    message(
        reply,
        content,
        Some(stop_reason(reply, finish)),
        UsageBody::new(reply, u.cached_tokens, u.completion_tokens),
    )
}

/// A streamed message.
pub struct MessagesStream<'a> {
    reply: &'a Reply,
    started: bool,
    /// The block being streamed and its index.
    open: Option<(Kind, u32)>,
    next_index: u32,
    /// Whether the `split-tool-name` fault split the arguments already.
    split: bool,
}

impl<'a> MessagesStream<'a> {
    pub fn new(reply: &'a Reply) -> Self {
        MessagesStream {
            reply,
            started: false,
            open: None,
            next_index: 0,
            split: false,
        }
    }

    fn event(kind: &'static str, mut fields: Value) -> String {
        if let Some(object) = fields.as_object_mut() {
            object.insert("type".into(), json!(kind));
        }
        named_event(kind, &fields.to_string())
    }

    /// `message_start`, once.
    fn start(&mut self, cached_tokens: u64) -> String {
        if std::mem::replace(&mut self.started, true) {
            return String::new();
        }
        let usage = UsageBody::new(self.reply, cached_tokens, 0);
        let message = message(self.reply, Vec::new(), None, usage);
        named_event(
            "message_start",
            &format!("{{\"type\":\"message_start\",\"message\":{message}}}"),
        )
    }

    fn close_block(&mut self) -> String {
        let Some((kind, index)) = self.open.take() else {
            return String::new();
        };
        let mut frames = String::new();
        if kind == Kind::Thinking {
            frames += &Self::event(
                "content_block_delta",
                json!({"index": index, "delta": {"type": "signature_delta", "signature": signature(self.reply)}}),
            );
        }
        frames + &Self::event("content_block_stop", json!({ "index": index }))
    }
}

impl Encoder for MessagesStream<'_> {
    fn started(&mut self, _choice: u32, cached_tokens: u64) -> String {
        self.start(cached_tokens)
    }

    fn output(&mut self, _choice: u32, output: Output<'_>, _finish: Option<Finish>) -> String {
        let kind = Kind::of(&output);
        let mut frames = self.start(0);
        let index = match self.open {
            Some((open, index)) if open == kind => index,
            _ => {
                frames += &self.close_block();
                let index = self.next_index;
                self.next_index += 1;
                self.open = Some((kind, index));
                frames += &Self::event(
                    "content_block_start",
                    json!({"index": index, "content_block": kind.block(self.reply, "", false)}),
                );
                index
            }
        };
        let text = output.text();
        let pieces = match kind {
            Kind::ToolUse(_)
                if self.reply.faults.split_tool_name
                    && !std::mem::replace(&mut self.split, true) =>
            {
                let (head, rest) = halves(text);
                vec![head, rest]
            }
            _ => vec![text],
        };
        for piece in pieces {
            frames += &Self::event(
                "content_block_delta",
                json!({"index": index, "delta": kind.delta(piece)}),
            );
        }
        frames
    }

    fn close(&mut self, outcome: &Outcome) -> String {
        let mut frames = self.start(0) + &self.close_block();
        let finish = outcome.finishes.first().copied().unwrap_or_default();
        let mut delta = json!({
            "delta": {"stop_reason": stop_reason(self.reply, finish), "stop_sequence": null},
        });
        if self.reply.usage.is_some()
            && let Some(fields) = delta.as_object_mut()
        {
            let usage = json!({"output_tokens": outcome.done.usage.completion_tokens});
            fields.insert("usage".into(), usage);
        }
        frames += &Self::event("message_delta", delta);
        frames + &Self::event("message_stop", json!({}))
    }

    fn error(&mut self, error: &ApiError) -> String {
        named_event(
            "error",
            &error.to_json_in(ErrorShape::Anthropic).to_string(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Finished, Usage};
    use crate::faults::RequestFaults;
    use crate::tool_call::ToolCall;
    use crate::wire::{Params, ResponseHead};
    use weir_core::endpoint::Endpoint;

    fn reply(tool: bool, usage: bool) -> Reply {
        Reply {
            head: ResponseHead {
                endpoint: Endpoint::Messages,
                id: "msg_1".into(),
                key: "1".into(),
                created: 7,
                model: "m".into(),
            },
            calls: Vec::from_iter(tool.then(|| ToolCall {
                index: 0,
                id: "toolu_1".into(),
                name: "search".into(),
                argument: "query".into(),
            })),
            faults: RequestFaults::default(),
            usage: usage.then_some(true),
            prompt_tokens: 40,
            params: Params::Plain,
        }
    }

    fn outcome(finish: Finish) -> Outcome {
        Outcome {
            finishes: vec![finish],
            done: Finished {
                id: 1,
                usage: Usage {
                    prompt_tokens: 40,
                    completion_tokens: 3,
                    cached_tokens: 32,
                },
                queue_seconds: 0.0,
                ttft_seconds: 0.0,
                e2e_seconds: 0.0,
                preemptions: 0,
            },
            reasoning_tokens: 1,
        }
    }

    fn events(frames: &str) -> Vec<(String, Value)> {
        frames
            .split("\n\n")
            .filter(|f| !f.is_empty())
            .map(|f| {
                let (event, data) = f.split_once('\n').unwrap();
                let event = event.strip_prefix("event: ").unwrap().to_owned();
                let data: Value =
                    serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
                assert_eq!(data["type"], event.as_str());
                (event, data)
            })
            .collect()
    }

    #[test]
    fn a_stream_has_one_block_per_kind_of_output() {
        let r = reply(true, true);
        let mut s = MessagesStream::new(&r);
        let mut frames = s.started(0, 32);
        frames += &s.output(0, Output::Reasoning("hm"), None);
        frames += &s.output(0, Output::Text(" a"), None);
        frames += &s.output(
            0,
            Output::Arguments(0, "{\"query\": \"x\"}"),
            Some(Finish::Stop),
        );
        frames += &s.close(&outcome(Finish::Stop));
        let events = events(&frames);
        let names: Vec<&str> = events.iter().map(|(e, _)| e.as_str()).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
        );
        let usage = &events[0].1["message"]["usage"];
        assert_eq!(
            (
                usage["input_tokens"].as_u64(),
                usage["cache_read_input_tokens"].as_u64()
            ),
            (Some(8), Some(32))
        );
        assert_eq!(events[3].1["delta"]["type"], "signature_delta");
        assert_eq!(events[8].1["content_block"]["type"], "tool_use");
        assert_eq!(events[8].1["index"], 2);
        assert_eq!(events[11].1["delta"]["stop_reason"], "tool_use");
        assert_eq!(events[11].1["usage"]["output_tokens"], 3);
    }

    #[test]
    fn bodies_parse_tool_input_and_omit_usage_when_asked() {
        let r = reply(true, false);
        let answer = Answer {
            arguments: vec!["{\"query\": \" a\"}".into()],
            finish: Finish::Length,
            ..Answer::default()
        };
        let v: Value =
            serde_json::from_str(&body(&r, &[answer], &outcome(Finish::Length))).unwrap();
        assert_eq!(v["content"][0]["input"], json!({"query": " a"}));
        assert_eq!(v["stop_reason"], "max_tokens");
        assert!(v.get("usage").is_none());
        let mut s = MessagesStream::new(&r);
        let frames =
            s.output(0, Output::Text("x"), Some(Finish::Stop)) + &s.close(&outcome(Finish::Stop));
        assert!(!frames.contains("usage"), "{frames}");
    }

    #[test]
    fn an_engine_error_mid_stream_is_an_anthropic_error_event() {
        let r = reply(false, true);
        let frames = MessagesStream::new(&r).error(&ApiError::internal("engine stopped"));
        let events = events(&frames);
        assert_eq!(events[0].0, "error");
        assert_eq!(events[0].1["error"]["type"], "api_error");
        assert_eq!(events[0].1["error"]["message"], "engine stopped");
    }
}
