//! llama-server's answers, in the field order of the captures: `choices` first, a
//! `system_fingerprint`, a chat stream that opens with `"content": null`, the finish reason in a
//! chunk of its own with an empty delta, and llama.cpp's `timings` on the last chunk or body.

use serde::Serialize;
use weir_core::openai::Endpoint;

use super::BUILD_INFO;
use crate::engine::Finished;
use crate::shape::Field;
use crate::wire::{Answer, ResponseHead, SSE_DONE, Wire, sse_event};

pub struct LlamaCppWire;

#[derive(Serialize)]
struct Envelope<'a, C> {
    choices: C,
    created: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    model: &'a str,
    system_fingerprint: &'static str,
    object: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
    /// Non-streamed bodies and completion chunks carry the id after the usage.
    #[serde(rename = "id", skip_serializing_if = "Option::is_none")]
    trailing_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    timings: Option<Timings>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Choice<'a> {
    ChatChunk {
        finish_reason: Option<&'a str>,
        index: u32,
        delta: Delta<'a>,
    },
    Chat {
        finish_reason: &'a str,
        index: u32,
        message: Message<'a>,
    },
    Text {
        text: &'a str,
        index: u32,
        logprobs: (),
        finish_reason: Option<&'a str>,
    },
}

#[derive(Serialize, Default)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    /// `Some(None)` is the opening chunk's `"content": null`.
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<Option<&'a str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
}

#[derive(Serialize)]
struct Usage {
    completion_tokens: u32,
    prompt_tokens: u64,
    total_tokens: u64,
    prompt_tokens_details: CachedTokens,
}

#[derive(Serialize)]
struct CachedTokens {
    cached_tokens: u64,
}

/// llama.cpp's per-request timings, in milliseconds of model time.
#[derive(Serialize)]
struct Timings {
    cache_n: u64,
    prompt_n: u64,
    prompt_ms: f64,
    prompt_per_token_ms: f64,
    prompt_per_second: f64,
    predicted_n: u32,
    predicted_ms: f64,
    predicted_per_token_ms: f64,
    predicted_per_second: f64,
}

impl From<&Finished> for Usage {
    fn from(done: &Finished) -> Self {
        let u = &done.usage;
        Usage {
            completion_tokens: u.completion_tokens,
            prompt_tokens: u.prompt_tokens,
            total_tokens: u.prompt_tokens + u64::from(u.completion_tokens),
            prompt_tokens_details: CachedTokens {
                cached_tokens: u.cached_tokens,
            },
        }
    }
}

impl From<&Finished> for Timings {
    fn from(done: &Finished) -> Self {
        let u = &done.usage;
        let prompt_n = u.prompt_tokens - u.cached_tokens;
        let prompt_ms = (done.ttft_seconds - done.queue_seconds) * 1e3;
        let predicted_ms = (done.e2e_seconds - done.ttft_seconds) * 1e3;
        let predicted_n = f64::from(u.completion_tokens);
        // As llama.cpp computes them: a zero duration gives an infinite rate, serialized null.
        Timings {
            cache_n: u.cached_tokens,
            prompt_n,
            prompt_ms,
            prompt_per_token_ms: prompt_ms / prompt_n as f64,
            prompt_per_second: 1e3 / prompt_ms * prompt_n as f64,
            predicted_n: u.completion_tokens,
            predicted_ms,
            predicted_per_token_ms: predicted_ms / predicted_n,
            predicted_per_second: 1e3 / predicted_ms * predicted_n,
        }
    }
}

/// What a frame or body ends with besides its choices.
#[derive(Default)]
struct Tail {
    usage: Option<Usage>,
    timings: Option<Timings>,
}

fn encode<C: Serialize>(head: &ResponseHead, streaming: bool, choices: C, tail: Tail) -> String {
    // Chat chunks put the id before the model; completions and whole bodies put it last.
    let chat_chunk = streaming && head.endpoint == Endpoint::ChatCompletions;
    let object = match (head.endpoint, streaming) {
        (Endpoint::ChatCompletions, true) => "chat.completion.chunk",
        (Endpoint::ChatCompletions, false) => "chat.completion",
        (Endpoint::Completions, _) => "text_completion",
    };
    let envelope = Envelope {
        choices,
        created: head.created,
        id: chat_chunk.then_some(head.id.as_str()),
        model: &head.model,
        system_fingerprint: BUILD_INFO,
        object,
        usage: tail.usage,
        trailing_id: (!chat_chunk).then_some(head.id.as_str()),
        timings: tail.timings,
    };
    // Plain structs of strings and numbers always serialize.
    serde_json::to_string(&envelope).unwrap_or_default()
}

fn frame<C: Serialize>(head: &ResponseHead, choices: C, tail: Tail) -> String {
    sse_event(&encode(head, true, choices, tail))
}

impl Wire for LlamaCppWire {
    fn token_frames(
        &self,
        head: &ResponseHead,
        text: &str,
        field: Field,
        first: bool,
        _finish_reason: Option<&str>,
    ) -> String {
        match head.endpoint {
            Endpoint::ChatCompletions => {
                let mut frames = String::new();
                if first {
                    let open = Choice::ChatChunk {
                        finish_reason: None,
                        index: 0,
                        delta: Delta {
                            role: Some("assistant"),
                            content: Some(None),
                            reasoning_content: None,
                        },
                    };
                    frames.push_str(&frame(head, [open], Tail::default()));
                }
                let delta = match field {
                    Field::Content => Delta {
                        content: Some(Some(text)),
                        ..Delta::default()
                    },
                    Field::Reasoning => Delta {
                        reasoning_content: Some(text),
                        ..Delta::default()
                    },
                };
                let piece = Choice::ChatChunk {
                    finish_reason: None,
                    index: 0,
                    delta,
                };
                frames.push_str(&frame(head, [piece], Tail::default()));
                frames
            }
            Endpoint::Completions => {
                let piece = Choice::Text {
                    text,
                    index: 0,
                    logprobs: (),
                    finish_reason: None,
                };
                frame(head, [piece], Tail::default())
            }
        }
    }

    /// Chat: a finish chunk, then the usage chunk when asked for, `timings` on the last of them.
    /// Completions: one final chunk with the finish reason, usage and timings.
    fn closing_frames(
        &self,
        head: &ResponseHead,
        finish_reason: &str,
        done: &Finished,
        usage: Option<bool>,
    ) -> String {
        let mut frames = match head.endpoint {
            Endpoint::ChatCompletions => {
                let finish = [Choice::ChatChunk {
                    finish_reason: Some(finish_reason),
                    index: 0,
                    delta: Delta::default(),
                }];
                if usage == Some(true) {
                    frame(head, finish, Tail::default())
                        + &frame(
                            head,
                            [(); 0],
                            Tail {
                                usage: Some(done.into()),
                                timings: Some(done.into()),
                            },
                        )
                } else {
                    frame(
                        head,
                        finish,
                        Tail {
                            usage: None,
                            timings: Some(done.into()),
                        },
                    )
                }
            }
            Endpoint::Completions => {
                let finish = [Choice::Text {
                    text: "",
                    index: 0,
                    logprobs: (),
                    finish_reason: Some(finish_reason),
                }];
                let tail = Tail {
                    usage: usage.is_some().then(|| done.into()),
                    timings: Some(done.into()),
                };
                frame(head, finish, tail)
            }
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
        let tail = Tail {
            usage: usage.then(|| done.into()),
            timings: Some(done.into()),
        };
        match head.endpoint {
            Endpoint::ChatCompletions => {
                let choice = Choice::Chat {
                    finish_reason: answer.finish_reason,
                    index: 0,
                    message: Message {
                        role: "assistant",
                        content: answer.text,
                        reasoning_content: answer.reasoning,
                    },
                };
                encode(head, false, [choice], tail)
            }
            Endpoint::Completions => {
                let choice = Choice::Text {
                    text: answer.text,
                    index: 0,
                    logprobs: (),
                    finish_reason: Some(answer.finish_reason),
                };
                encode(head, false, [choice], tail)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Usage as EngineUsage;

    fn head(endpoint: Endpoint) -> ResponseHead {
        ResponseHead {
            endpoint,
            id: "chatcmpl-1".into(),
            created: 7,
            model: "tiny-llama".into(),
        }
    }

    fn done() -> Finished {
        Finished {
            id: 1,
            usage: EngineUsage {
                prompt_tokens: 33,
                completion_tokens: 6,
                cached_tokens: 32,
            },
            queue_seconds: 0.0,
            ttft_seconds: 0.002,
            e2e_seconds: 0.008,
            preemptions: 0,
        }
    }

    /// The first two and the last three events of `chat-stream-include-usage.sse`, less the
    /// values that vary (text, ids, times).
    #[test]
    fn chat_stream_matches_the_capture() {
        let h = head(Endpoint::ChatCompletions);
        let frames = LlamaCppWire.token_frames(&h, "find", Field::Content, true, None);
        assert_eq!(
            frames,
            "data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":null}}],\"created\":7,\"id\":\"chatcmpl-1\",\"model\":\"tiny-llama\",\"system_fingerprint\":\"b1-weir-sim\",\"object\":\"chat.completion.chunk\"}\n\n\
             data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"delta\":{\"content\":\"find\"}}],\"created\":7,\"id\":\"chatcmpl-1\",\"model\":\"tiny-llama\",\"system_fingerprint\":\"b1-weir-sim\",\"object\":\"chat.completion.chunk\"}\n\n"
        );
        let closing = LlamaCppWire.closing_frames(&h, "length", &done(), Some(true));
        let events: Vec<&str> = closing.split("\n\n").collect();
        assert_eq!(
            events[0],
            "data: {\"choices\":[{\"finish_reason\":\"length\",\"index\":0,\"delta\":{}}],\"created\":7,\"id\":\"chatcmpl-1\",\"model\":\"tiny-llama\",\"system_fingerprint\":\"b1-weir-sim\",\"object\":\"chat.completion.chunk\"}"
        );
        assert!(
            events[1].starts_with(
                "data: {\"choices\":[],\"created\":7,\"id\":\"chatcmpl-1\",\"model\":\"tiny-llama\",\"system_fingerprint\":\"b1-weir-sim\",\"object\":\"chat.completion.chunk\",\"usage\":{\"completion_tokens\":6,\"prompt_tokens\":33,\"total_tokens\":39,\"prompt_tokens_details\":{\"cached_tokens\":32}},\"timings\":{\"cache_n\":32,\"prompt_n\":1,\"prompt_ms\":2.0,"
            ),
            "{}",
            events[1]
        );
        assert_eq!(&events[2..], ["data: [DONE]", ""]);
    }

    #[test]
    fn chat_body_matches_the_capture() {
        let h = head(Endpoint::ChatCompletions);
        let answer = Answer {
            reasoning: None,
            text: "hi",
            finish_reason: "length",
        };
        let body = LlamaCppWire.response(&h, answer, &done(), true);
        assert!(
            body.starts_with(
                "{\"choices\":[{\"finish_reason\":\"length\",\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"hi\"}}],\"created\":7,\"model\":\"tiny-llama\",\"system_fingerprint\":\"b1-weir-sim\",\"object\":\"chat.completion\",\"usage\":{\"completion_tokens\":6,\"prompt_tokens\":33,\"total_tokens\":39,\"prompt_tokens_details\":{\"cached_tokens\":32}},\"id\":\"chatcmpl-1\",\"timings\":{\"cache_n\":32,"
            ),
            "{body}"
        );
    }
}
