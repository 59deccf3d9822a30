//! vLLM's chat and completions answers, in the shape and field order vLLM 0.32 sends them (see
//! `shared/reference/vllm-0.32/`): the finish reason rides on a choice's last chunk; usage
//! comes in a trailing `"choices": []` chunk only when asked for, summed over a prompt batch.

use serde::Serialize;
use serde_json::{Value, json};
use weir_core::endpoint::Endpoint;
use weir_core::error::ApiError;

use super::{Answer, Delta, Finish, Reply, ResponseHead, SSE_DONE, Wire, sse_event};
use crate::engine::{Finished, Usage};
use crate::tool_call::{ChatToolCall, ToolCallDelta};

pub struct VllmWire;

/// vLLM's error body: OpenAI's envelope with vLLM's own values, an exception class for `type`
/// and the status for a `code` it does not name (`{"type": "NotFoundError", "code": 404}`, as
/// captured in `shared/reference/vllm-0.32/`). weir's own errors carry OpenAI's values instead.
pub fn error_body(error: &ApiError) -> Value {
    json!({
        "error": {
            "message": error.message,
            "type": error_type(error.status),
            "param": error.param,
            "code": error.code.map_or_else(|| json!(error.status), |c| json!(c)),
        }
    })
}

/// vLLM's exception class for a status.
pub fn error_type(status: u16) -> &'static str {
    match status {
        404 => "NotFoundError",
        429 => "RateLimitError",
        s if s >= 500 => "InternalServerError",
        _ => "BadRequestError",
    }
}

impl Wire for VllmWire {
    fn token_frames(
        &self,
        reply: &Reply,
        choice: u32,
        delta: Delta<'_>,
        first: bool,
        finish_reason: Option<&str>,
    ) -> String {
        reply.head.token_frames(choice, delta, first, finish_reason)
    }

    fn closing_frames(&self, reply: &Reply, _finishes: &[Finish], done: &Finished) -> String {
        let mut frames = if reply.usage == Some(true) {
            reply.head.usage_frame(&done.usage)
        } else {
            String::new()
        };
        frames.push_str(SSE_DONE);
        frames
    }

    fn response(&self, reply: &Reply, answers: &[Answer], done: &Finished) -> String {
        let usage = reply.usage.is_some().then_some(&done.usage);
        reply.head.response(reply, answers, usage)
    }
}

#[derive(Serialize)]
struct Envelope<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: C,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<UsageBody>,
}

#[derive(Serialize, Default)]
struct ChatDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<[ToolCallDelta<'a>; 1]>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Choice<'a> {
    ChatChunk {
        index: u32,
        delta: ChatDelta<'a>,
        logprobs: (),
        finish_reason: Option<&'a str>,
    },
    Chat {
        index: u32,
        message: ChatMessage<'a>,
        logprobs: (),
        finish_reason: &'a str,
        stop_reason: (),
    },
    Text {
        index: u32,
        text: &'a str,
        logprobs: (),
        finish_reason: Option<&'a str>,
        stop_reason: (),
    },
}

#[derive(Serialize)]
struct ChatMessage<'a> {
    role: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    content: Option<&'a str>,
    refusal: (),
    tool_calls: Vec<ChatToolCall<'a>>,
}

#[derive(Serialize)]
struct UsageBody {
    prompt_tokens: u64,
    total_tokens: u64,
    completion_tokens: u32,
    prompt_tokens_details: CachedTokens,
}

#[derive(Serialize)]
struct CachedTokens {
    cached_tokens: u64,
}

impl From<&Usage> for UsageBody {
    fn from(u: &Usage) -> Self {
        UsageBody {
            prompt_tokens: u.prompt_tokens,
            total_tokens: u.prompt_tokens + u64::from(u.completion_tokens),
            completion_tokens: u.completion_tokens,
            prompt_tokens_details: CachedTokens {
                cached_tokens: u.cached_tokens,
            },
        }
    }
}

impl ResponseHead {
    fn encode<C: Serialize>(&self, streaming: bool, choices: C, usage: Option<&Usage>) -> String {
        let object = match (self.endpoint, streaming) {
            (Endpoint::ChatCompletions, true) => "chat.completion.chunk",
            (Endpoint::ChatCompletions, false) => "chat.completion",
            _ => "text_completion",
        };
        let envelope = Envelope {
            id: &self.id,
            object,
            created: self.created,
            model: &self.model,
            choices,
            usage: usage.map(UsageBody::from),
        };
        // Plain structs of strings and numbers always serialize.
        serde_json::to_string(&envelope).unwrap_or_default()
    }

    fn chunk(&self, choice: Choice<'_>) -> String {
        sse_event(&self.encode(true, [choice], None))
    }

    /// The SSE frames for one delta. A chat stream opens with an empty assistant delta, as vLLM
    /// does, so every later chunk carries only generated tokens.
    fn token_frames(
        &self,
        index: u32,
        delta: Delta<'_>,
        first: bool,
        finish_reason: Option<&str>,
    ) -> String {
        if self.endpoint != Endpoint::ChatCompletions {
            let text = match delta {
                Delta::Content(t) | Delta::Reasoning(t) | Delta::Arguments(_, t) => t,
                Delta::ToolCall(..) | Delta::ToolName(..) => "",
            };
            return self.chunk(Choice::Text {
                index,
                text,
                logprobs: (),
                finish_reason,
                stop_reason: (),
            });
        }
        let mut frames = if first {
            self.chunk(Choice::ChatChunk {
                index,
                delta: ChatDelta {
                    role: Some("assistant"),
                    content: Some(""),
                    ..ChatDelta::default()
                },
                logprobs: (),
                finish_reason: None,
            })
        } else {
            String::new()
        };
        let delta = match delta {
            Delta::Content(t) => ChatDelta {
                content: Some(t),
                ..ChatDelta::default()
            },
            Delta::Reasoning(t) => ChatDelta {
                reasoning_content: Some(t),
                ..ChatDelta::default()
            },
            Delta::ToolCall(call, name) => ChatDelta {
                tool_calls: Some([call.opening_delta(name)]),
                ..ChatDelta::default()
            },
            Delta::ToolName(call, rest) => ChatDelta {
                tool_calls: Some([call.name_delta(rest)]),
                ..ChatDelta::default()
            },
            Delta::Arguments(index, t) => ChatDelta {
                tool_calls: Some([ToolCallDelta::arguments(index, t)]),
                ..ChatDelta::default()
            },
        };
        frames.push_str(&self.chunk(Choice::ChatChunk {
            index,
            delta,
            logprobs: (),
            finish_reason,
        }));
        frames
    }

    /// The trailing frame of `stream_options.include_usage`: no choices, only usage.
    fn usage_frame(&self, usage: &Usage) -> String {
        sse_event(&self.encode(true, [(); 0], Some(usage)))
    }

    /// A whole non-streamed body.
    fn response(&self, reply: &Reply, answers: &[Answer], usage: Option<&Usage>) -> String {
        let choices: Vec<Choice<'_>> = (0u32..)
            .zip(answers)
            .map(|(index, answer)| {
                let finish_reason = reply.finish_reason(answer.finish);
                match self.endpoint {
                    Endpoint::ChatCompletions => Choice::Chat {
                        index,
                        message: ChatMessage {
                            role: "assistant",
                            reasoning_content: (!answer.reasoning.is_empty())
                                .then_some(answer.reasoning.as_str()),
                            content: answer.arguments.is_empty().then_some(answer.text.as_str()),
                            refusal: (),
                            tool_calls: reply
                                .calls
                                .iter()
                                .zip(&answer.arguments)
                                .map(|(call, arguments)| call.message(arguments))
                                .collect(),
                        },
                        logprobs: (),
                        finish_reason,
                        stop_reason: (),
                    },
                    _ => Choice::Text {
                        index,
                        text: &answer.text,
                        logprobs: (),
                        finish_reason: Some(finish_reason),
                        stop_reason: (),
                    },
                }
            })
            .collect();
        self.encode(false, choices, usage)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::faults::RequestFaults;
    use crate::wire::Params;

    fn reply(endpoint: Endpoint) -> Reply {
        Reply {
            head: ResponseHead {
                endpoint,
                id: "chatcmpl-1".into(),
                key: "1".into(),
                created: 7,
                model: "m".into(),
            },
            calls: Vec::new(),
            faults: RequestFaults::default(),
            usage: Some(false),
            prompt_tokens: 0,
            params: Params::Plain,
        }
    }

    #[test]
    fn chat_chunks_follow_vllm_field_order() {
        let frames = VllmWire.token_frames(
            &reply(Endpoint::ChatCompletions),
            0,
            Delta::Content("co"),
            true,
            None,
        );
        assert_eq!(
            frames,
            "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n\
             data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"co\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n"
        );
    }

    #[test]
    fn usage_frame_has_empty_choices() {
        let usage = Usage {
            prompt_tokens: 16,
            completion_tokens: 16,
            cached_tokens: 0,
        };
        let frame = reply(Endpoint::Completions).head.usage_frame(&usage);
        assert!(frame.contains("\"choices\":[],\"usage\":{\"prompt_tokens\":16,\"total_tokens\":32,\"completion_tokens\":16"), "{frame}");
    }

    #[test]
    fn full_response_carries_message_and_usage() {
        let r = reply(Endpoint::ChatCompletions);
        let answer = Answer {
            text: "hi".into(),
            ..Answer::default()
        };
        let body = r.head.response(&r, &[answer], Some(&Usage::default()));
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["content"], "hi");
        assert_eq!(
            v["choices"][0]["message"]["tool_calls"],
            serde_json::json!([])
        );
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["usage"]["total_tokens"], 0);
    }

    #[test]
    fn tool_calls_open_with_the_name_then_stream_arguments() {
        let mut r = reply(Endpoint::ChatCompletions);
        r.calls = vec![crate::tool_call::ToolCall {
            index: 0,
            id: "chatcmpl-tool-1".into(),
            name: "search".into(),
            argument: "query".into(),
        }];
        let call = &r.calls[0];
        let open = VllmWire.token_frames(&r, 0, Delta::ToolCall(call, "search"), false, None);
        assert!(
            open.contains("\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"chatcmpl-tool-1\",\"type\":\"function\",\"function\":{\"name\":\"search\",\"arguments\":\"\"}}]}"),
            "{open}"
        );
        let args =
            VllmWire.token_frames(&r, 0, Delta::Arguments(0, "{\""), false, Some("tool_calls"));
        assert!(
            args.contains("\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"\"}}]},\"logprobs\":null,\"finish_reason\":\"tool_calls\""),
            "{args}"
        );
        let answer = Answer {
            arguments: vec!["{}".into()],
            ..Answer::default()
        };
        let v: serde_json::Value =
            serde_json::from_str(&r.head.response(&r, &[answer], None)).unwrap();
        let message = &v["choices"][0]["message"];
        assert!(message["content"].is_null());
        assert_eq!(message["tool_calls"][0]["function"]["name"], "search");
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    }
}
