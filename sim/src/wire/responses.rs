//! The Responses API (`POST /v1/responses`) in vLLM's shapes.
//!
//! A stream is named events (`event: {type}` then `data: {json}`) with a `sequence_number` from
//! 0 and no `[DONE]`: `response.created`, `response.in_progress`, then one output item per kind
//! of output in the order generated — reasoning (`response.reasoning_text.delta`), a message
//! (`response.output_text.delta`), a function call (`response.function_call_arguments.delta`),
//! each opened with `response.output_item.added` (and its content part) and closed with its
//! `.done` events; parallel calls are one `function_call` item each — and `response.completed`
//! with the whole response and its usage. A response cut by `max_output_tokens` completes with
//! `status: "incomplete"`. The `split-tool-name` fault sends a call's first arguments fragment
//! as two `response.function_call_arguments.delta` events (the name itself rides whole on
//! `response.output_item.added`: the shape has no event to split it over).

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Value, json};
use weir_core::error::ApiError;

use super::{Answer, Encoder, Finish, Outcome, Output, Params, Reply, named_event};
use crate::engine::Usage;
use crate::tool_call::halves;

/// The request fields a response echoes.
#[derive(Debug, Default, Deserialize)]
pub struct Echo {
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    max_output_tokens: Option<u32>,
    #[serde(default)]
    metadata: Option<Box<RawValue>>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    tool_choice: Option<Box<RawValue>>,
    #[serde(default)]
    tools: Option<Box<RawValue>>,
}

impl Echo {
    pub fn of_request(body: &[u8]) -> Result<Self, ApiError> {
        serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("invalid request: {e}")))
    }
}

/// The response object of `response.created`, `response.completed` and whole bodies, in the
/// field order of vLLM's `ResponsesResponse`.
#[derive(Serialize)]
struct ResponseObject<'a> {
    id: &'a str,
    created_at: u64,
    incomplete_details: Option<Value>,
    instructions: Option<&'a str>,
    metadata: Option<&'a RawValue>,
    model: &'a str,
    object: &'static str,
    output: &'a [Value],
    parallel_tool_calls: bool,
    temperature: f64,
    tool_choice: Option<&'a RawValue>,
    tools: Option<&'a RawValue>,
    top_p: f64,
    background: bool,
    max_output_tokens: Option<u32>,
    max_tool_calls: (),
    previous_response_id: (),
    prompt: (),
    reasoning: (),
    service_tier: &'static str,
    status: &'static str,
    text: Value,
    top_logprobs: (),
    truncation: &'static str,
    usage: Option<Value>,
    user: (),
}

/// How the response ended: its status, and why when it is incomplete.
fn status(finish: Finish) -> (&'static str, Option<Value>) {
    match finish {
        Finish::Stop => ("completed", None),
        Finish::Length => ("incomplete", Some(json!({"reason": "max_output_tokens"}))),
    }
}

fn usage(u: &Usage, reasoning_tokens: u32) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": u.prompt_tokens + u64::from(u.completion_tokens),
    })
}

/// The echo of a request that is not a Responses one: none of its fields.
static NO_ECHO: Echo = Echo {
    instructions: None,
    max_output_tokens: None,
    metadata: None,
    parallel_tool_calls: None,
    temperature: None,
    top_p: None,
    tool_choice: None,
    tools: None,
};

/// The response object; its `status` is `in_progress` until `outcome` is known.
fn response<'a>(
    reply: &'a Reply,
    output: &'a [Value],
    outcome: Option<&Outcome>,
) -> ResponseObject<'a> {
    let echo = match &reply.params {
        Params::Responses(echo) => echo,
        _ => &NO_ECHO,
    };
    let raw = |v: &'static str| serde_json::from_str::<&RawValue>(v).ok();
    let (auto, none) = (raw("\"auto\""), raw("[]"));
    let (status, incomplete_details) = match outcome {
        Some(o) => status(o.finishes.first().copied().unwrap_or_default()),
        None => ("in_progress", None),
    };
    let shown = reply.usage.is_some();
    ResponseObject {
        id: &reply.head.id,
        created_at: reply.head.created,
        incomplete_details,
        instructions: echo.instructions.as_deref(),
        metadata: echo.metadata.as_deref(),
        model: &reply.head.model,
        object: "response",
        output,
        parallel_tool_calls: echo.parallel_tool_calls.unwrap_or(true),
        temperature: echo.temperature.unwrap_or(1.0),
        tool_choice: echo.tool_choice.as_deref().or(auto),
        tools: echo.tools.as_deref().or(none),
        top_p: echo.top_p.unwrap_or(1.0),
        background: false,
        max_output_tokens: echo.max_output_tokens,
        max_tool_calls: (),
        previous_response_id: (),
        prompt: (),
        reasoning: (),
        service_tier: "auto",
        status,
        text: json!({"format": {"type": "text"}}),
        top_logprobs: (),
        truncation: "disabled",
        usage: outcome
            .filter(|_| shown)
            .map(|o| usage(&o.done.usage, o.reasoning_tokens)),
        user: (),
    }
}

/// The kinds of output item, in the order a response generates them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Reasoning,
    Message,
    /// The call with this index.
    FunctionCall(u32),
}

impl Kind {
    fn of(output: &Output<'_>) -> Self {
        match output {
            Output::Reasoning(_) => Kind::Reasoning,
            Output::Text(_) => Kind::Message,
            Output::Arguments(call, _) => Kind::FunctionCall(*call),
        }
    }

    fn item_id(self, reply: &Reply) -> String {
        let key = &reply.head.key;
        match self {
            Kind::Reasoning => format!("rs_{key}"),
            Kind::Message => format!("msg_{key}"),
            Kind::FunctionCall(0) => format!("fc_{key}"),
            Kind::FunctionCall(call) => format!("fc_{key}_{call}"),
        }
    }

    /// The item's content part with its text so far (function calls have none).
    fn part(self, text: &str) -> Value {
        match self {
            Kind::Reasoning => json!({"type": "reasoning_text", "text": text}),
            _ => json!({"type": "output_text", "text": text, "annotations": []}),
        }
    }

    /// The output item, `in_progress` (and empty) or `completed` with `text`.
    fn item(self, reply: &Reply, text: &str, done: bool) -> Value {
        let id = self.item_id(reply);
        let status = if done { "completed" } else { "in_progress" };
        let content: Vec<Value> = if done { vec![self.part(text)] } else { vec![] };
        match self {
            Kind::Reasoning => json!({
                "id": id, "type": "reasoning", "summary": [], "content": content,
                "encrypted_content": null, "status": status,
            }),
            Kind::Message => json!({
                "id": id, "type": "message", "role": "assistant", "status": status,
                "content": content,
            }),
            Kind::FunctionCall(call) => {
                let (call_id, name) = reply
                    .calls
                    .get(call as usize)
                    .map_or(("", ""), |t| (t.id.as_str(), t.name.as_str()));
                json!({
                    "id": id, "type": "function_call", "call_id": call_id, "name": name,
                    "arguments": if done { text } else { "" }, "status": status,
                })
            }
        }
    }
}

/// The output items of a finished answer.
fn items(reply: &Reply, answer: &Answer) -> Vec<Value> {
    let mut items = Vec::new();
    if !answer.reasoning.is_empty() {
        items.push(Kind::Reasoning.item(reply, &answer.reasoning, true));
    }
    if !answer.text.is_empty() || (answer.reasoning.is_empty() && answer.arguments.is_empty()) {
        items.push(Kind::Message.item(reply, &answer.text, true));
    }
    for (call, arguments) in (0u32..).zip(&answer.arguments) {
        items.push(Kind::FunctionCall(call).item(reply, arguments, true));
    }
    items
}

/// A whole, non-streamed response.
pub fn body(reply: &Reply, answers: &[Answer], outcome: &Outcome) -> String {
    let output: Vec<Value> = answers.iter().flat_map(|a| items(reply, a)).collect();
    // Plain structs of strings, numbers and valid raw JSON always serialize.
    serde_json::to_string(&response(reply, &output, Some(outcome))).unwrap_or_default()
}

/// The item being streamed and its text so far.
struct Open {
    kind: Kind,
    text: String,
}

/// A streamed response.
pub struct ResponsesStream<'a> {
    reply: &'a Reply,
    sequence_number: u64,
    created: bool,
    open: Option<Open>,
    /// Items already streamed whole.
    done: Vec<Value>,
    /// Whether the `split-tool-name` fault split the arguments already.
    split: bool,
}

impl<'a> ResponsesStream<'a> {
    pub fn new(reply: &'a Reply) -> Self {
        ResponsesStream {
            reply,
            sequence_number: 0,
            created: false,
            open: None,
            done: Vec::new(),
            split: false,
        }
    }

    /// One event: its fields plus `type` and the next `sequence_number`.
    fn event(&mut self, kind: &'static str, mut fields: Value) -> String {
        if let Some(object) = fields.as_object_mut() {
            object.insert("type".into(), json!(kind));
            object.insert("sequence_number".into(), json!(self.sequence_number));
        }
        self.sequence_number += 1;
        named_event(kind, &fields.to_string())
    }

    /// An event carrying the response object.
    fn response_event(&mut self, kind: &'static str, outcome: Option<&Outcome>) -> String {
        let response =
            serde_json::to_value(response(self.reply, &self.done, outcome)).unwrap_or_default();
        self.event(kind, json!({ "response": response }))
    }

    /// `response.created` and `response.in_progress`, once.
    fn create(&mut self) -> String {
        if std::mem::replace(&mut self.created, true) {
            return String::new();
        }
        self.response_event("response.created", None)
            + &self.response_event("response.in_progress", None)
    }

    fn open_item(&mut self, kind: Kind) -> String {
        let output_index = self.done.len();
        let item_id = kind.item_id(self.reply);
        let mut frames = self.event(
            "response.output_item.added",
            json!({"output_index": output_index, "item": kind.item(self.reply, "", false)}),
        );
        if !matches!(kind, Kind::FunctionCall(_)) {
            frames += &self.event(
                "response.content_part.added",
                json!({
                    "item_id": item_id, "output_index": output_index, "content_index": 0,
                    "part": kind.part(""),
                }),
            );
        }
        self.open = Some(Open {
            kind,
            text: String::new(),
        });
        frames
    }

    fn delta(&mut self, kind: Kind, delta: &str) -> String {
        let (output_index, item_id) = (self.done.len(), kind.item_id(self.reply));
        if let Some(open) = &mut self.open {
            open.text.push_str(delta);
        }
        match kind {
            Kind::Reasoning => self.event(
                "response.reasoning_text.delta",
                json!({"item_id": item_id, "output_index": output_index, "content_index": 0, "delta": delta}),
            ),
            Kind::Message => self.event(
                "response.output_text.delta",
                json!({
                    "item_id": item_id, "output_index": output_index, "content_index": 0,
                    "delta": delta, "logprobs": [],
                }),
            ),
            Kind::FunctionCall(_)
                if self.reply.faults.split_tool_name
                    && !std::mem::replace(&mut self.split, true) =>
            {
                let (head, rest) = halves(delta);
                [head, rest]
                    .map(|part| {
                        self.event(
                            "response.function_call_arguments.delta",
                            json!({"item_id": item_id, "output_index": output_index, "delta": part}),
                        )
                    })
                    .concat()
            }
            Kind::FunctionCall(_) => self.event(
                "response.function_call_arguments.delta",
                json!({"item_id": item_id, "output_index": output_index, "delta": delta}),
            ),
        }
    }

    fn close_item(&mut self) -> String {
        let Some(Open { kind, text }) = self.open.take() else {
            return String::new();
        };
        let (output_index, item_id) = (self.done.len(), kind.item_id(self.reply));
        let mut frames = match kind {
            Kind::Reasoning => self.event(
                "response.reasoning_text.done",
                json!({"item_id": item_id, "output_index": output_index, "content_index": 0, "text": text}),
            ),
            Kind::Message => self.event(
                "response.output_text.done",
                json!({
                    "item_id": item_id, "output_index": output_index, "content_index": 0,
                    "text": text, "logprobs": [],
                }),
            ),
            Kind::FunctionCall(_) => self.event(
                "response.function_call_arguments.done",
                json!({"item_id": item_id, "output_index": output_index, "arguments": text}),
            ),
        };
        if !matches!(kind, Kind::FunctionCall(_)) {
            frames += &self.event(
                "response.content_part.done",
                json!({
                    "item_id": item_id, "output_index": output_index, "content_index": 0,
                    "part": kind.part(&text),
                }),
            );
        }
        let item = kind.item(self.reply, &text, true);
        frames += &self.event(
            "response.output_item.done",
            json!({"output_index": output_index, "item": item}),
        );
        self.done.push(item);
        frames
    }
}

impl Encoder for ResponsesStream<'_> {
    fn started(&mut self, _choice: u32, _cached_tokens: u64) -> String {
        self.create()
    }

    fn output(&mut self, _choice: u32, output: Output<'_>, _finish: Option<Finish>) -> String {
        let kind = Kind::of(&output);
        let mut frames = self.create();
        if self.open.as_ref().map(|o| o.kind) != Some(kind) {
            frames += &self.close_item();
            frames += &self.open_item(kind);
        }
        frames + &self.delta(kind, output.text())
    }

    fn close(&mut self, outcome: &Outcome) -> String {
        let frames = self.create() + &self.close_item();
        frames + &self.response_event("response.completed", Some(outcome))
    }

    fn error(&mut self, error: &ApiError) -> String {
        self.event(
            "error",
            json!({"code": error.code.unwrap_or(super::vllm::error_type(error.status)), "message": error.message, "param": error.param}),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Finished;
    use crate::faults::RequestFaults;
    use crate::tool_call::ToolCall;
    use crate::wire::ResponseHead;
    use weir_core::endpoint::Endpoint;

    fn reply(tool: bool, usage: bool) -> Reply {
        Reply {
            head: ResponseHead {
                endpoint: Endpoint::Responses,
                id: "resp_1".into(),
                key: "1".into(),
                created: 7,
                model: "m".into(),
            },
            calls: Vec::from_iter(tool.then(|| ToolCall {
                index: 0,
                id: "call_1".into(),
                name: "search".into(),
                argument: "query".into(),
            })),
            faults: RequestFaults::default(),
            usage: usage.then_some(true),
            prompt_tokens: 9,
            params: Params::Responses(Box::default()),
        }
    }

    fn outcome(finish: Finish) -> Outcome {
        Outcome {
            finishes: vec![finish],
            done: Finished {
                id: 1,
                usage: Usage {
                    prompt_tokens: 9,
                    completion_tokens: 3,
                    cached_tokens: 0,
                },
                queue_seconds: 0.0,
                ttft_seconds: 0.0,
                e2e_seconds: 0.0,
                preemptions: 0,
            },
            reasoning_tokens: 1,
        }
    }

    /// The `(event, data)` pairs of a stream.
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
    fn a_stream_opens_closes_and_numbers_each_item() {
        let r = reply(true, true);
        let mut s = ResponsesStream::new(&r);
        let mut frames = s.started(0, 0);
        frames += &s.output(0, Output::Reasoning("hm"), None);
        frames += &s.output(0, Output::Text(" a"), None);
        frames += &s.output(0, Output::Arguments(0, "{}"), Some(Finish::Stop));
        frames += &s.close(&outcome(Finish::Stop));
        let events = events(&frames);
        let names: Vec<&str> = events.iter().map(|(e, _)| e.as_str()).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (i, (_, data)) in events.iter().enumerate() {
            assert_eq!(data["sequence_number"], i);
        }
        assert!(events[0].1["response"]["usage"].is_null());
        assert_eq!(events[0].1["response"]["status"], "in_progress");
        let done = &events.last().unwrap().1["response"];
        assert_eq!(done["status"], "completed");
        assert_eq!(done["output"].as_array().unwrap().len(), 3);
        assert_eq!(done["output"][2]["name"], "search");
        assert_eq!(done["usage"]["total_tokens"], 12);
        assert_eq!(
            done["usage"]["output_tokens_details"]["reasoning_tokens"],
            1
        );
        assert!(!frames.contains("[DONE]"));
    }

    #[test]
    fn a_capped_body_is_incomplete_and_omitted_usage_is_null() {
        let r = reply(false, false);
        let answer = Answer {
            text: " a b".into(),
            finish: Finish::Length,
            ..Answer::default()
        };
        let v: Value =
            serde_json::from_str(&body(&r, &[answer], &outcome(Finish::Length))).unwrap();
        assert_eq!(v["status"], "incomplete");
        assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
        assert!(v["usage"].is_null());
        assert_eq!(v["output"][0]["content"][0]["text"], " a b");
        assert_eq!(v["tools"], json!([]));
        assert_eq!(v["tool_choice"], "auto");
    }

    #[test]
    fn an_engine_error_mid_stream_is_an_error_event_in_sequence() {
        let r = reply(false, true);
        let mut s = ResponsesStream::new(&r);
        let frames = s.started(0, 0) + &s.error(&ApiError::bad_request("refused"));
        let events = events(&frames);
        let (event, data) = events.last().unwrap();
        assert_eq!(event, "error");
        assert_eq!(
            (data["sequence_number"].as_u64(), data["message"].as_str()),
            (Some(2), Some("refused"))
        );
        assert_eq!(data["code"], "BadRequestError");
    }
}
