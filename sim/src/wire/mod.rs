//! Answers on the wire. Every API's answer is built from the same events — pieces of reasoning,
//! text or tool-call arguments for each choice as the engine generates them, then the outcome —
//! by an [`Encoder`] when streamed and by [`body`] when whole.
//!
//! Chat and completions answers take the shape of the dialect's [`Wire`] (vLLM's in [`vllm`],
//! llama.cpp's in its dialect); the Responses ([`responses`]), Messages ([`messages`]) and
//! Embeddings ([`embeddings`]) APIs are answered in vLLM's shapes whatever the dialect.

pub mod embeddings;
pub mod messages;
pub mod responses;
pub mod vllm;

use weir_core::endpoint::Endpoint;
use weir_core::error::ApiError;

pub use self::vllm::VllmWire;
use crate::engine::{Finished, Usage};
use crate::faults::RequestFaults;
use crate::tool_call::{ToolCall, halves};

/// What every chunk and body of one request shares.
pub struct ResponseHead {
    pub endpoint: Endpoint,
    /// The answer's id: `chatcmpl-…`, `cmpl-…`, `resp_…`, `msg_…` or `embd-…`.
    pub id: String,
    /// The hex part of the id, which the ids of items, blocks and tool calls share.
    pub key: String,
    pub created: u64,
    pub model: String,
}

impl ResponseHead {
    pub fn new(endpoint: Endpoint, seq: u64, model: &str) -> Self {
        let prefix = match endpoint {
            Endpoint::ChatCompletions => "chatcmpl-",
            Endpoint::Completions => "cmpl-",
            Endpoint::Responses => "resp_",
            Endpoint::Messages => "msg_",
            Endpoint::Embeddings => "embd-",
        };
        let key = format!(
            "{:016x}",
            (seq ^ process_salt()).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        );
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        ResponseHead {
            endpoint,
            id: format!("{prefix}{key}"),
            key,
            created,
            model: model.to_owned(),
        }
    }
}

/// Drawn once per process, so that two simulators (two replicas of a pool, or one restarted)
/// never give two requests the same id, as a real engine's random ids never do.
fn process_salt() -> u64 {
    static SALT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SALT.get_or_init(|| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        now ^ u64::from(std::process::id()).rotate_left(32)
    })
}

/// How a choice's generation ends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Finish {
    /// Its natural end.
    #[default]
    Stop,
    /// Its output limit (or the context's end).
    Length,
}

impl Finish {
    /// The reason the engine's metrics record (`vllm:request_success{finished_reason}`).
    pub fn metric_reason(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// One piece of a choice's generated output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output<'a> {
    Reasoning(&'a str),
    Text(&'a str),
    /// A fragment of the arguments of the call with this index (see [`ToolCall::fragment`]).
    Arguments(u32, &'a str),
}

impl<'a> Output<'a> {
    /// The piece's text, whatever its part.
    pub fn text(&self) -> &'a str {
        match *self {
            Output::Reasoning(t) | Output::Text(t) | Output::Arguments(_, t) => t,
        }
    }
}

/// A finished choice's output, for a whole body.
#[derive(Clone, Debug, Default)]
pub struct Answer {
    pub reasoning: String,
    pub text: String,
    /// Each tool call's arguments, by index; empty when the answer is text.
    pub arguments: Vec<String>,
    pub finish: Finish,
}

impl Answer {
    pub fn push(&mut self, output: Output<'_>) {
        match output {
            Output::Reasoning(t) => self.reasoning.push_str(t),
            Output::Text(t) => self.text.push_str(t),
            Output::Arguments(call, t) => {
                let call = call as usize;
                if self.arguments.len() <= call {
                    self.arguments.resize(call + 1, String::new());
                }
                if let Some(arguments) = self.arguments.get_mut(call) {
                    arguments.push_str(t);
                }
            }
        }
    }
}

/// What the whole request came to, once every sequence finished.
pub struct Outcome {
    /// Each choice's end, by index.
    pub finishes: Vec<Finish>,
    /// The request as one: usage summed over its sequences, latencies from the earliest
    /// sequence's start to the last one's end.
    pub done: Finished,
    /// Tokens of the output that were reasoning.
    pub reasoning_tokens: u32,
}

/// The whole request's figures from its sequences'.
pub fn merged(done: &[Finished]) -> Finished {
    let mut total = Finished {
        id: done.first().map_or(0, |d| d.id),
        usage: Usage::default(),
        queue_seconds: f64::INFINITY,
        ttft_seconds: f64::INFINITY,
        e2e_seconds: 0.0,
        preemptions: 0,
    };
    for d in done {
        total.usage.prompt_tokens += d.usage.prompt_tokens;
        total.usage.completion_tokens += d.usage.completion_tokens;
        total.usage.cached_tokens += d.usage.cached_tokens;
        total.queue_seconds = total.queue_seconds.min(d.queue_seconds);
        total.ttft_seconds = total.ttft_seconds.min(d.ttft_seconds);
        total.e2e_seconds = total.e2e_seconds.max(d.e2e_seconds);
        total.preemptions += d.preemptions;
    }
    if done.is_empty() {
        (total.queue_seconds, total.ttft_seconds) = (0.0, 0.0);
    }
    total
}

/// Everything an answer's shape depends on besides what was generated.
pub struct Reply {
    pub head: ResponseHead,
    /// The tool calls the answer makes, in order; none for a text answer.
    pub calls: Vec<ToolCall>,
    /// The faults the request asked for in its shape.
    pub faults: RequestFaults,
    /// `None` when `--omit-usage` hides usage; else whether the client asked for it
    /// (`stream_options.include_usage`; the APIs other than chat and completions always
    /// report it).
    pub usage: Option<bool>,
    /// Prompt tokens of the whole request.
    pub prompt_tokens: u64,
    /// What the API's answer echoes or needs from the request.
    pub params: Params,
}

/// The API-specific part of a [`Reply`].
pub enum Params {
    Plain,
    Responses(Box<responses::Echo>),
    Embeddings(embeddings::Format),
}

impl Reply {
    /// A chat or completions finish reason: a tool call that ends naturally is `tool_calls`.
    pub fn finish_reason(&self, finish: Finish) -> &'static str {
        match (finish, self.calls.is_empty()) {
            (Finish::Stop, false) => "tool_calls",
            (Finish::Stop, true) => "stop",
            (Finish::Length, _) => "length",
        }
    }
}

/// A streamed answer, encoded as the engine generates it.
pub trait Encoder: Send {
    /// The engine started choice `choice`, with `cached_tokens` of its prompt from the cache.
    fn started(&mut self, _choice: u32, _cached_tokens: u64) -> String {
        String::new()
    }

    /// A chunk of a choice's output; `finish` is set on the choice's last.
    fn output(&mut self, choice: u32, output: Output<'_>, finish: Option<Finish>) -> String;

    /// The frames that close the stream once every choice finished.
    fn close(&mut self, outcome: &Outcome) -> String;

    /// The frames that end the stream with an error (the engine refused or stopped).
    fn error(&mut self, error: &ApiError) -> String;
}

/// The encoder of a streamed answer to `reply`'s request.
pub fn encoder<'a>(reply: &'a Reply, wire: &'a dyn Wire) -> Box<dyn Encoder + 'a> {
    match reply.head.endpoint {
        Endpoint::Responses => Box::new(responses::ResponsesStream::new(reply)),
        Endpoint::Messages => Box::new(messages::MessagesStream::new(reply)),
        _ => Box::new(CompletionStream {
            reply,
            wire,
            opened: false,
            calling: Vec::new(),
            split: false,
        }),
    }
}

/// A whole, non-streamed body answering `reply`'s request.
pub fn body(reply: &Reply, wire: &dyn Wire, answers: &[Answer], outcome: &Outcome) -> String {
    match reply.head.endpoint {
        Endpoint::Responses => responses::body(reply, answers, outcome),
        Endpoint::Messages => messages::body(reply, answers, outcome),
        Endpoint::Embeddings => embeddings::body(reply, outcome),
        Endpoint::ChatCompletions | Endpoint::Completions => {
            wire.response(reply, answers, &outcome.done)
        }
    }
}

/// A piece of a chat or completions stream chunk's delta.
#[derive(Clone, Copy, Debug)]
pub enum Delta<'a> {
    Content(&'a str),
    Reasoning(&'a str),
    /// The opening of a tool call: its id and its name, or the name's first part.
    ToolCall(&'a ToolCall, &'a str),
    /// The rest of a tool call's name (the `split-tool-name` fault).
    ToolName(&'a ToolCall, &'a str),
    /// A fragment of the arguments of the call with this index.
    Arguments(u32, &'a str),
}

/// How one engine lays out chat and completions answers.
pub trait Wire: Send + Sync {
    /// The SSE frames for one delta of choice `choice`: `first` on the stream's first,
    /// `finish_reason` on the choice's last.
    fn token_frames(
        &self,
        reply: &Reply,
        choice: u32,
        delta: Delta<'_>,
        first: bool,
        finish_reason: Option<&str>,
    ) -> String;

    /// The frames that close a finished stream, `[DONE]` last.
    fn closing_frames(&self, reply: &Reply, finishes: &[Finish], done: &Finished) -> String;

    /// A whole non-streamed body, one choice per answer.
    fn response(&self, reply: &Reply, answers: &[Answer], done: &Finished) -> String;
}

/// A chat or completions stream in the dialect's shape.
struct CompletionStream<'a> {
    reply: &'a Reply,
    wire: &'a dyn Wire,
    opened: bool,
    /// The `(choice, call)` pairs whose call was opened.
    calling: Vec<(u32, u32)>,
    /// Whether the `split-tool-name` fault split the arguments already.
    split: bool,
}

impl Encoder for CompletionStream<'_> {
    fn output(&mut self, choice: u32, output: Output<'_>, finish: Option<Finish>) -> String {
        let reason = finish.map(|f| self.reply.finish_reason(f));
        let mut frames = String::new();
        let mut first = !std::mem::replace(&mut self.opened, true);
        let call = match output {
            Output::Arguments(index, _) => self.reply.calls.get(index as usize),
            _ => None,
        };
        let delta = match (output, call) {
            (Output::Reasoning(t), _) => Delta::Reasoning(t),
            (Output::Arguments(index, t), Some(call)) => {
                if !self.calling.contains(&(choice, index)) {
                    self.calling.push((choice, index));
                    let (head, rest) = match self.reply.faults.split_tool_name {
                        true => halves(&call.name),
                        false => (call.name.as_str(), ""),
                    };
                    let mut openings = vec![Delta::ToolCall(call, head)];
                    if !rest.is_empty() {
                        openings.push(Delta::ToolName(call, rest));
                    }
                    for opening in openings {
                        frames += &self
                            .wire
                            .token_frames(self.reply, choice, opening, first, None);
                        first = false;
                    }
                }
                Delta::Arguments(index, t)
            }
            (Output::Text(t) | Output::Arguments(_, t), _) => Delta::Content(t),
        };
        if let Delta::Arguments(index, t) = delta
            && self.reply.faults.split_tool_name
            && !std::mem::replace(&mut self.split, true)
        {
            // The first arguments fragment of the stream, over two events.
            let (head, rest) = halves(t);
            frames += &self.wire.token_frames(
                self.reply,
                choice,
                Delta::Arguments(index, head),
                first,
                None,
            );
            return frames
                + &self.wire.token_frames(
                    self.reply,
                    choice,
                    Delta::Arguments(index, rest),
                    false,
                    reason,
                );
        }
        frames += &self
            .wire
            .token_frames(self.reply, choice, delta, first, reason);
        frames
    }

    fn close(&mut self, outcome: &Outcome) -> String {
        self.wire
            .closing_frames(self.reply, &outcome.finishes, &outcome.done)
    }

    fn error(&mut self, error: &ApiError) -> String {
        sse_event(&vllm::error_body(error).to_string()) + SSE_DONE
    }
}

/// One server-sent event carrying a JSON payload.
pub fn sse_event(payload: &str) -> String {
    format!("data: {payload}\n\n")
}

/// One server-sent event with its type named, as the Responses and Messages APIs send them.
pub fn named_event(kind: &str, payload: &str) -> String {
    format!("event: {kind}\ndata: {payload}\n\n")
}

pub const SSE_DONE: &str = "data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    fn finished(prompt: u64, completion: u32, ttft: f64, e2e: f64) -> Finished {
        Finished {
            id: 1,
            usage: Usage {
                prompt_tokens: prompt,
                completion_tokens: completion,
                cached_tokens: 0,
            },
            queue_seconds: 0.0,
            ttft_seconds: ttft,
            e2e_seconds: e2e,
            preemptions: 0,
        }
    }

    #[test]
    fn a_request_s_figures_sum_its_sequences() {
        let total = merged(&[finished(3, 5, 0.2, 1.0), finished(4, 6, 0.1, 2.0)]);
        assert_eq!(total.usage.prompt_tokens, 7);
        assert_eq!(total.usage.completion_tokens, 11);
        assert_eq!((total.ttft_seconds, total.e2e_seconds), (0.1, 2.0));
        assert_eq!(merged(&[]).ttft_seconds, 0.0);
    }

    #[test]
    fn answers_gather_their_pieces() {
        let mut answer = Answer::default();
        answer.push(Output::Reasoning("r"));
        answer.push(Output::Arguments(0, "{\"q\": \"a"));
        answer.push(Output::Arguments(1, "{}"));
        answer.push(Output::Arguments(0, "b\"}"));
        assert_eq!(answer.reasoning, "r");
        assert_eq!(answer.arguments, ["{\"q\": \"ab\"}", "{}"]);
        assert!(answer.text.is_empty());
    }
}
