//! Response bodies and stream chunks: the [`Wire`] every dialect implements, and vLLM's, in the
//! shape and field order vLLM 0.32 sends them (see `shared/reference/vllm-0.32/`).

use serde::Serialize;
use weir_core::openai::Endpoint;

use crate::engine::{Finished, Usage};
use crate::shape::Field;

/// How one engine lays its answers out on the wire.
pub trait Wire: Send + Sync {
    /// The SSE frames for one generated piece of `field`; `finish_reason` is set on the last.
    fn token_frames(
        &self,
        head: &ResponseHead,
        text: &str,
        field: Field,
        first: bool,
        finish_reason: Option<&str>,
    ) -> String;

    /// The frames that close a finished stream, `[DONE]` last. `usage` is `None` when
    /// `--omit-usage` hides it, else whether the client asked for it (`include_usage`).
    fn closing_frames(
        &self,
        head: &ResponseHead,
        finish_reason: &str,
        done: &Finished,
        usage: Option<bool>,
    ) -> String;

    /// A whole non-streamed response body; `usage` unless `--omit-usage` hides it.
    fn response(
        &self,
        head: &ResponseHead,
        answer: Answer<'_>,
        done: &Finished,
        usage: bool,
    ) -> String;
}

/// The text of a finished, non-streamed answer (`reasoning` only for chat).
pub struct Answer<'a> {
    pub reasoning: Option<&'a str>,
    pub text: &'a str,
    pub finish_reason: &'a str,
}

/// vLLM's wire: the finish reason rides on the last token's chunk; usage comes in a trailing
/// `"choices": []` chunk only when asked for.
pub struct VllmWire;

impl Wire for VllmWire {
    fn token_frames(
        &self,
        head: &ResponseHead,
        text: &str,
        field: Field,
        first: bool,
        finish_reason: Option<&str>,
    ) -> String {
        head.token_frames(text, field, first, finish_reason)
    }

    fn closing_frames(
        &self,
        head: &ResponseHead,
        _finish_reason: &str,
        done: &Finished,
        usage: Option<bool>,
    ) -> String {
        let mut frames = if usage == Some(true) {
            head.usage_frame(&done.usage)
        } else {
            String::new()
        };
        frames.push_str(SSE_DONE);
        frames
    }

    fn response(
        &self,
        head: &ResponseHead,
        answer: Answer<'_>,
        done: &Finished,
        usage: bool,
    ) -> String {
        head.response(
            answer.reasoning,
            answer.text,
            answer.finish_reason,
            usage.then_some(&done.usage),
        )
    }
}

/// What every chunk and response of one request shares.
pub struct ResponseHead {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
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

#[derive(Serialize)]
struct ChatDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
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
    content: &'a str,
    refusal: (),
    tool_calls: [(); 0],
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
    pub fn new(endpoint: Endpoint, seq: u64, model: &str) -> Self {
        let prefix = match endpoint {
            Endpoint::ChatCompletions => "chatcmpl",
            Endpoint::Completions => "cmpl",
        };
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        ResponseHead {
            endpoint,
            id: format!("{prefix}-{:016x}", seq.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
            created,
            model: model.to_owned(),
        }
    }

    fn encode<C: Serialize>(&self, streaming: bool, choices: C, usage: Option<&Usage>) -> String {
        let object = match (self.endpoint, streaming) {
            (Endpoint::ChatCompletions, true) => "chat.completion.chunk",
            (Endpoint::ChatCompletions, false) => "chat.completion",
            (Endpoint::Completions, _) => "text_completion",
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

    /// The SSE frames for one generated piece of `field`. A chat stream opens with an empty
    /// assistant delta, as vLLM does, so every later chunk carries only generated tokens.
    fn token_frames(
        &self,
        text: &str,
        field: Field,
        first: bool,
        finish_reason: Option<&str>,
    ) -> String {
        match self.endpoint {
            Endpoint::ChatCompletions => {
                let mut frames = if first {
                    self.chunk(Choice::ChatChunk {
                        index: 0,
                        delta: ChatDelta {
                            role: Some("assistant"),
                            content: Some(""),
                            reasoning_content: None,
                        },
                        logprobs: (),
                        finish_reason: None,
                    })
                } else {
                    String::new()
                };
                let (content, reasoning_content) = match field {
                    Field::Content => (Some(text), None),
                    Field::Reasoning => (None, Some(text)),
                };
                frames.push_str(&self.chunk(Choice::ChatChunk {
                    index: 0,
                    delta: ChatDelta {
                        role: None,
                        content,
                        reasoning_content,
                    },
                    logprobs: (),
                    finish_reason,
                }));
                frames
            }
            Endpoint::Completions => self.chunk(Choice::Text {
                index: 0,
                text,
                logprobs: (),
                finish_reason,
                stop_reason: (),
            }),
        }
    }

    /// The trailing frame of `stream_options.include_usage`: no choices, only usage.
    fn usage_frame(&self, usage: &Usage) -> String {
        sse_event(&self.encode(true, [(); 0], Some(usage)))
    }

    /// A whole non-streamed response body (`reasoning` only for chat).
    fn response(
        &self,
        reasoning: Option<&str>,
        text: &str,
        finish_reason: &str,
        usage: Option<&Usage>,
    ) -> String {
        let choice = match self.endpoint {
            Endpoint::ChatCompletions => Choice::Chat {
                index: 0,
                message: ChatMessage {
                    role: "assistant",
                    reasoning_content: reasoning,
                    content: text,
                    refusal: (),
                    tool_calls: [],
                },
                logprobs: (),
                finish_reason,
                stop_reason: (),
            },
            Endpoint::Completions => Choice::Text {
                index: 0,
                text,
                logprobs: (),
                finish_reason: Some(finish_reason),
                stop_reason: (),
            },
        };
        self.encode(false, [choice], usage)
    }
}

/// One server-sent event carrying a JSON payload.
pub fn sse_event(payload: &str) -> String {
    format!("data: {payload}\n\n")
}

pub const SSE_DONE: &str = "data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    fn head(endpoint: Endpoint) -> ResponseHead {
        ResponseHead {
            endpoint,
            id: "chatcmpl-1".into(),
            created: 7,
            model: "m".into(),
        }
    }

    #[test]
    fn chat_chunks_follow_vllm_field_order() {
        let frames = head(Endpoint::ChatCompletions).token_frames("co", Field::Content, true, None);
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
        let frame = head(Endpoint::Completions).usage_frame(&usage);
        assert!(frame.contains("\"choices\":[],\"usage\":{\"prompt_tokens\":16,\"total_tokens\":32,\"completion_tokens\":16"), "{frame}");
    }

    #[test]
    fn full_response_carries_message_and_usage() {
        let body =
            head(Endpoint::ChatCompletions).response(None, "hi", "stop", Some(&Usage::default()));
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["content"], "hi");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["usage"]["total_tokens"], 0);
    }
}
