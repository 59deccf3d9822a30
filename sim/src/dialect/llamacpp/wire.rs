//! llama-server's answers, in the field order of the captures: `choices` first, a
//! `system_fingerprint`, a chat stream that opens with `"content": null`, the finish reason in a
//! chunk of its own with an empty delta, and llama.cpp's `timings` on the last chunk or body.

use serde::Serialize;
use weir_core::endpoint::Endpoint;

use super::BUILD_INFO;
use crate::engine::Finished;
use crate::tool_call::{ChatToolCall, ToolCallDelta};
use crate::wire::{Answer, Delta, Finish, Reply, ResponseHead, SSE_DONE, Wire, sse_event};

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
        delta: ChunkDelta<'a>,
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

/// A chat chunk's delta as llama-server writes it.
#[derive(Serialize, Default)]
struct ChunkDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    /// `Some(None)` is the opening chunk's `"content": null`.
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<Option<&'a str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<[ToolCallDelta<'a>; 1]>,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<ChatToolCall<'a>>,
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
        _ => "text_completion",
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
        reply: &Reply,
        choice: u32,
        delta: Delta<'_>,
        first: bool,
        _finish_reason: Option<&str>,
    ) -> String {
        let head = &reply.head;
        if head.endpoint != Endpoint::ChatCompletions {
            let text = match delta {
                Delta::Content(t) | Delta::Reasoning(t) | Delta::Arguments(_, t) => t,
                Delta::ToolCall(..) | Delta::ToolName(..) => "",
            };
            let piece = Choice::Text {
                text,
                index: choice,
                logprobs: (),
                finish_reason: None,
            };
            return frame(head, [piece], Tail::default());
        }
        let mut frames = String::new();
        if first {
            let open = Choice::ChatChunk {
                finish_reason: None,
                index: choice,
                delta: ChunkDelta {
                    role: Some("assistant"),
                    content: Some(None),
                    ..ChunkDelta::default()
                },
            };
            frames.push_str(&frame(head, [open], Tail::default()));
        }
        let delta = match delta {
            Delta::Content(t) => ChunkDelta {
                content: Some(Some(t)),
                ..ChunkDelta::default()
            },
            Delta::Reasoning(t) => ChunkDelta {
                reasoning_content: Some(t),
                ..ChunkDelta::default()
            },
            Delta::ToolCall(call, name) => ChunkDelta {
                tool_calls: Some([call.opening_delta(name)]),
                ..ChunkDelta::default()
            },
            Delta::ToolName(call, rest) => ChunkDelta {
                tool_calls: Some([call.name_delta(rest)]),
                ..ChunkDelta::default()
            },
            Delta::Arguments(index, t) => ChunkDelta {
                tool_calls: Some([ToolCallDelta::arguments(index, t)]),
                ..ChunkDelta::default()
            },
        };
        let piece = Choice::ChatChunk {
            finish_reason: None,
            index: choice,
            delta,
        };
        frames.push_str(&frame(head, [piece], Tail::default()));
        frames
    }

    /// Chat: a finish chunk, then the usage chunk when asked for, `timings` on the last of them.
    /// Completions: one final chunk per choice with its finish reason, the last with the
    /// request's usage and timings.
    fn closing_frames(&self, reply: &Reply, finishes: &[Finish], done: &Finished) -> String {
        let head = &reply.head;
        let usage = reply.usage;
        let mut frames = match head.endpoint {
            Endpoint::ChatCompletions => {
                let finish_reason =
                    reply.finish_reason(finishes.first().copied().unwrap_or_default());
                let finish = [Choice::ChatChunk {
                    finish_reason: Some(finish_reason),
                    index: 0,
                    delta: ChunkDelta::default(),
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
            _ => {
                let last = finishes.len().saturating_sub(1);
                (0u32..)
                    .zip(finishes)
                    .map(|(index, &finish)| {
                        let choice = [Choice::Text {
                            text: "",
                            index,
                            logprobs: (),
                            finish_reason: Some(reply.finish_reason(finish)),
                        }];
                        let tail = if index as usize == last {
                            Tail {
                                usage: usage.is_some().then(|| done.into()),
                                timings: Some(done.into()),
                            }
                        } else {
                            Tail::default()
                        };
                        frame(head, choice, tail)
                    })
                    .collect()
            }
        };
        frames.push_str(SSE_DONE);
        frames
    }

    fn response(&self, reply: &Reply, answers: &[Answer], done: &Finished) -> String {
        let head = &reply.head;
        let tail = Tail {
            usage: reply.usage.is_some().then(|| done.into()),
            timings: Some(done.into()),
        };
        let choices: Vec<Choice<'_>> = (0u32..)
            .zip(answers)
            .map(|(index, answer)| {
                let finish_reason = reply.finish_reason(answer.finish);
                match head.endpoint {
                    Endpoint::ChatCompletions => Choice::Chat {
                        finish_reason,
                        index,
                        message: Message {
                            role: "assistant",
                            content: answer.arguments.is_empty().then_some(answer.text.as_str()),
                            reasoning_content: (!answer.reasoning.is_empty())
                                .then_some(answer.reasoning.as_str()),
                            tool_calls: reply
                                .calls
                                .iter()
                                .zip(&answer.arguments)
                                .map(|(call, arguments)| call.message(arguments))
                                .collect(),
                        },
                    },
                    _ => Choice::Text {
                        text: &answer.text,
                        index,
                        logprobs: (),
                        finish_reason: Some(finish_reason),
                    },
                }
            })
            .collect();
        encode(head, false, choices, tail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Usage as EngineUsage;
    use crate::wire::Params;

    fn reply(endpoint: Endpoint, usage: Option<bool>) -> Reply {
        Reply {
            head: ResponseHead {
                endpoint,
                id: "chatcmpl-1".into(),
                key: "1".into(),
                created: 7,
                model: "tiny-llama".into(),
            },
            calls: Vec::new(),
            faults: crate::faults::RequestFaults::default(),
            usage,
            prompt_tokens: 33,
            params: Params::Plain,
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
        let r = reply(Endpoint::ChatCompletions, Some(true));
        let frames = LlamaCppWire.token_frames(&r, 0, Delta::Content("find"), true, None);
        assert_eq!(
            frames,
            "data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":null}}],\"created\":7,\"id\":\"chatcmpl-1\",\"model\":\"tiny-llama\",\"system_fingerprint\":\"b1-weir-sim\",\"object\":\"chat.completion.chunk\"}\n\n\
             data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"delta\":{\"content\":\"find\"}}],\"created\":7,\"id\":\"chatcmpl-1\",\"model\":\"tiny-llama\",\"system_fingerprint\":\"b1-weir-sim\",\"object\":\"chat.completion.chunk\"}\n\n"
        );
        let closing = LlamaCppWire.closing_frames(&r, &[Finish::Length], &done());
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
        let r = reply(Endpoint::ChatCompletions, Some(false));
        let answer = Answer {
            text: "hi".into(),
            finish: Finish::Length,
            ..Answer::default()
        };
        let body = LlamaCppWire.response(&r, &[answer], &done());
        assert!(
            body.starts_with(
                "{\"choices\":[{\"finish_reason\":\"length\",\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"hi\"}}],\"created\":7,\"model\":\"tiny-llama\",\"system_fingerprint\":\"b1-weir-sim\",\"object\":\"chat.completion\",\"usage\":{\"completion_tokens\":6,\"prompt_tokens\":33,\"total_tokens\":39,\"prompt_tokens_details\":{\"cached_tokens\":32}},\"id\":\"chatcmpl-1\",\"timings\":{\"cache_n\":32,"
            ),
            "{body}"
        );
    }

    #[test]
    fn a_prompt_batch_ends_each_choice_and_reports_the_request_once() {
        let r = reply(Endpoint::Completions, Some(false));
        let closing = LlamaCppWire.closing_frames(&r, &[Finish::Stop, Finish::Length], &done());
        let events: Vec<&str> = closing.split("\n\n").collect();
        assert_eq!(events.len(), 4, "{closing}");
        assert!(events[0].contains("\"index\":0,\"logprobs\":null,\"finish_reason\":\"stop\""));
        assert!(!events[0].contains("usage"));
        assert!(events[1].contains("\"index\":1,\"logprobs\":null,\"finish_reason\":\"length\""));
        assert!(events[1].contains("\"usage\":{") && events[1].contains("\"timings\":{"));
    }
}
