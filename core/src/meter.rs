//! Metering a response as it passes, in the shape of the API that was called (one submodule
//! per API's events and bodies): the engine's usage when it reports one, a count of the tokens
//! seen when it does not.
//!
//! Streams are scanned event by event across chunk boundaries, framed as a client's parser
//! frames them ([`crate::sse`]). Only the bytes of an incomplete trailing event are held back
//! (never more than [`MAX_HELD_BYTES`]); everything else is forwarded at once. An event larger
//! than that (a Responses event repeating the request's instructions and tools) is forwarded as
//! it comes and read as it passes ([`scan`]), so its usage and its end are still seen. The
//! usage-only event that weir asks the engine for is removed again when the client did not ask
//! for it.

mod chat;
mod delta;
mod messages;
mod responses;
mod scan;

use std::borrow::Cow;
use std::ops::Range;

use serde::Deserialize;

use crate::endpoint::Endpoint;
use crate::sse::{event_data, event_end};
use scan::{EventScan, Skeleton};

pub use scan::MAX_KEPT_BYTES;

/// An event larger than this is not held: it is forwarded as it comes and read as it passes.
pub const MAX_HELD_BYTES: usize = 64 * 1024;

/// Token counts of a finished response.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Of `prompt_tokens`, those the engine served from its prefix cache (0 when it does not
    /// say): they are priced apart ([`crate::price::Price::cached_input`]).
    pub cached_prompt_tokens: u64,
}

/// A usage object as any of the APIs spells it: OpenAI's `prompt_tokens`/`completion_tokens`,
/// the Responses and Messages APIs' `input_tokens`/`output_tokens`. Anthropic counts cache
/// reads and writes apart from `input_tokens`, so the prompt is their sum. Fields a later event
/// reports replace earlier ones (a Messages stream gives input in `message_start` and the output
/// so far in each `message_delta`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
struct Reported {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
    /// OpenAI's (and vLLM's) count of cached prompt tokens, `{"cached_tokens": n}`.
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
    /// The Responses API's spelling of the same.
    #[serde(default)]
    input_tokens_details: Option<Details>,
}

/// The part of a usage object that breaks the prompt down.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

impl Reported {
    fn merge(&mut self, newer: Reported) {
        let fields = [
            (&mut self.prompt_tokens, newer.prompt_tokens),
            (&mut self.completion_tokens, newer.completion_tokens),
            (&mut self.input_tokens, newer.input_tokens),
            (&mut self.output_tokens, newer.output_tokens),
            (
                &mut self.cache_read_input_tokens,
                newer.cache_read_input_tokens,
            ),
            (
                &mut self.cache_creation_input_tokens,
                newer.cache_creation_input_tokens,
            ),
        ];
        for (field, value) in fields {
            if value.is_some() {
                *field = value;
            }
        }
        let details = [
            (&mut self.prompt_tokens_details, newer.prompt_tokens_details),
            (&mut self.input_tokens_details, newer.input_tokens_details),
        ];
        for (field, value) in details {
            if value.is_some() {
                *field = value;
            }
        }
    }

    /// The counts, once the prompt's is known.
    fn usage(&self) -> Option<Usage> {
        let anthropic_input = self.input_tokens.map(|i| {
            i.saturating_add(self.cache_read_input_tokens.unwrap_or(0))
                .saturating_add(self.cache_creation_input_tokens.unwrap_or(0))
        });
        let cached = (self.prompt_tokens_details.or(self.input_tokens_details))
            .and_then(|d| d.cached_tokens)
            .or(self.cache_read_input_tokens)
            .unwrap_or(0);
        let prompt_tokens = self.prompt_tokens.or(anthropic_input)?;
        Some(Usage {
            prompt_tokens,
            completion_tokens: self.completion_tokens.or(self.output_tokens).unwrap_or(0),
            cached_prompt_tokens: cached.min(prompt_tokens),
        })
    }
}

/// What one event (or a whole body) of some API says.
#[derive(Debug, Default)]
struct Observed {
    usage: Option<Reported>,
    /// The usage's output count is a placeholder (a Messages stream's `message_start`), not the
    /// engine's count of what it generated.
    provisional_output: bool,
    /// Output tokens in the generated text it carries (see [`generated_tokens`]).
    generated: u64,
    error: bool,
    /// The API's last event (`[DONE]`, `response.completed`, `message_stop`).
    terminal: bool,
    /// An event that carries nothing but the usage weir asked for (chat and completions).
    usage_only: bool,
    /// A body that is an answer of the API (not an error): without usage, its generated text is
    /// what is charged.
    answer: bool,
}

/// Reads one event's data, or a whole body, in the shape of `endpoint`; `None` when it is not
/// JSON of that shape.
fn observe(endpoint: Endpoint, data: &[u8]) -> Option<Observed> {
    match endpoint {
        Endpoint::ChatCompletions | Endpoint::Completions | Endpoint::Embeddings => {
            chat::observe(data)
        }
        Endpoint::Responses => responses::observe(data),
        Endpoint::Messages => messages::observe(data),
    }
}

/// Output tokens in some generated text: a fast count of every piece, and at least one token
/// for any non-empty piece (an engine sends no empty token).
fn generated_tokens<'a>(pieces: impl IntoIterator<Item = &'a str>) -> u64 {
    pieces
        .into_iter()
        .filter(|t| !t.is_empty())
        .map(|t| crate::estimate::fast_count(t).max(1))
        .sum()
}

/// Whether a response's `content-type` says it is an event stream. The answer's type, not the
/// request's `stream` field, says how to read it: an engine may answer a stream as one JSON
/// body, or stream on a spelling of `stream` it reads leniently.
pub fn is_event_stream(content_type: &str) -> bool {
    content_type
        .trim_start()
        .to_ascii_lowercase()
        .starts_with("text/event-stream")
}

/// Meters a server-sent-event stream of one API's events.
#[derive(Debug)]
pub struct StreamMeter {
    endpoint: Endpoint,
    hide_usage_event: bool,
    held: Vec<u8>,
    /// Events larger than this are not held ([`MAX_HELD_BYTES`] unless [`Self::holding`]).
    hold_limit: usize,
    /// The event too large to hold that is passing, read up to its end.
    passing: Option<EventScan>,
    reported: Option<Reported>,
    /// An event reported the output count (not only a placeholder for it).
    output_reported: bool,
    generated_tokens: u64,
    error_events: u64,
    done: bool,
}

impl StreamMeter {
    /// `hide_usage_event`: weir asked for the usage event and the client did not (chat and
    /// completions), so it is metered and then dropped.
    pub fn new(endpoint: Endpoint, hide_usage_event: bool) -> Self {
        StreamMeter {
            endpoint,
            hide_usage_event,
            held: Vec::new(),
            hold_limit: MAX_HELD_BYTES,
            passing: None,
            reported: None,
            output_reported: false,
            generated_tokens: 0,
            error_events: 0,
            done: false,
        }
    }

    /// Holds events up to `limit` bytes rather than [`MAX_HELD_BYTES`], for a caller that must
    /// read every event whole before it is forwarded (the tool policy: a call in an event
    /// forwarded as it passes would reach the client unread).
    pub fn holding(mut self, limit: usize) -> Self {
        self.hold_limit = limit.max(MAX_HELD_BYTES);
        self
    }

    /// The engine's usage, once the events that report it have passed. A stream cut after the
    /// engine reported its prompt but before it reported its output (a Messages stream left
    /// before its `message_delta`) is the engine's prompt count and the output that streamed.
    pub fn usage(&self) -> Option<Usage> {
        let usage = self.reported.as_ref().and_then(Reported::usage)?;
        if self.output_reported {
            return Some(usage);
        }
        Some(Usage {
            completion_tokens: usage.completion_tokens.max(self.generated_tokens),
            ..usage
        })
    }

    /// Output tokens counted in the generated text that passed (every field, not events): the
    /// fallback completion count when the engine reports no usage.
    pub fn generated_tokens(&self) -> u64 {
        self.generated_tokens
    }

    /// Events that carried an error (an engine failing mid-stream).
    pub fn error_events(&self) -> u64 {
        self.error_events
    }

    /// Whether the API's last event (`data: [DONE]`, `response.completed`, `message_stop`) has
    /// passed: a stream that ends without it was cut short, however cleanly its connection
    /// closed.
    pub fn saw_done(&self) -> bool {
        self.done
    }

    /// Bytes the meter holds between chunks, whatever the size of the events: at most
    /// [`MAX_HELD_BYTES`] (or the limit it is [`holding`](Self::holding) to) of an incomplete event and [`MAX_KEPT_BYTES`] of one passing.
    pub fn held_bytes(&self) -> usize {
        self.held.capacity() + self.passing.as_ref().map_or(0, EventScan::held_bytes)
    }

    /// Takes the next chunk of the stream and returns the bytes to forward now.
    pub fn feed(&mut self, chunk: &[u8], end_of_stream: bool) -> Vec<u8> {
        let mut out = Out::new(chunk.len() + self.held.len(), false);
        self.take(chunk, end_of_stream, Some(&mut out));
        out.bytes
    }

    /// [`feed`](Self::feed), and where each event lies in the bytes to forward, for a caller
    /// that reads whole events (the tool scan): every byte forwarded is in one frame, in order.
    pub fn feed_framed(&mut self, chunk: &[u8], end_of_stream: bool) -> (Vec<u8>, Vec<Frame>) {
        let mut out = Out::new(chunk.len() + self.held.len(), true);
        self.take(chunk, end_of_stream, Some(&mut out));
        (out.bytes, out.frames)
    }

    /// Meters the next chunk, for a caller that forwards the stream as it came (one that
    /// hides no event): [`feed`](Self::feed) without copying what to forward.
    pub fn meter(&mut self, chunk: &[u8], end_of_stream: bool) {
        self.take(chunk, end_of_stream, None);
    }

    /// Meters the complete events of what was held and `chunk` (all of it at the end of the
    /// stream), adding those to forward to `out`; holds an incomplete last event. A chunk of
    /// whole events with nothing held, the common case, is read where it lies.
    fn take(&mut self, chunk: &[u8], end_of_stream: bool, mut out: Option<&mut Out>) {
        let chunk = self.pass(chunk, end_of_stream, out.as_deref_mut());
        if self.passing.is_some() {
            return;
        }
        let held = std::mem::take(&mut self.held);
        let buf = if held.is_empty() {
            Cow::Borrowed(chunk)
        } else {
            let mut held = held;
            held.extend_from_slice(chunk);
            Cow::Owned(held)
        };
        // Scanned forward event by event, so where events end never depends on how the
        // stream was chunked (a backward search for the last blank line disagrees when `\r\n`
        // runs overlap).
        let mut at = 0;
        while let Some(len) = buf.get(at..).and_then(event_end) {
            let event = buf.get(at..at + len).unwrap_or_default();
            self.forward(event, &mut out);
            at += len;
        }
        let rest = buf.get(at..).unwrap_or_default();
        if end_of_stream {
            if !rest.is_empty() {
                self.forward(rest, &mut out);
            }
        } else if rest.len() > self.hold_limit {
            // Too large to hold: forwarded now, read as it passes. The scan ends events where
            // `event_end` does, so nothing follows in `rest`; were it to, it is taken anew.
            self.passing = Some(EventScan::default());
            let after = self.pass(rest, false, out.as_deref_mut());
            if !after.is_empty() {
                self.take(after, false, out);
            }
        } else {
            self.held = rest.to_vec();
        }
    }

    /// Reads the event passing (if one is) up to its end, forwarding those bytes as they are;
    /// returns what follows its end.
    fn pass<'c>(
        &mut self,
        chunk: &'c [u8],
        end_of_stream: bool,
        out: Option<&mut Out>,
    ) -> &'c [u8] {
        let Some(scan) = &mut self.passing else {
            return chunk;
        };
        let end = scan.feed(chunk);
        let (event, rest) = chunk
            .split_at_checked(end.unwrap_or(chunk.len()))
            .unwrap_or((chunk, &[]));
        if let Some(out) = out {
            out.push(event, false);
        }
        if end.is_some() || end_of_stream {
            let seen = scan.observed(self.endpoint);
            self.passing = None;
            if let Some(seen) = seen {
                self.record(seen);
            }
        }
        rest
    }

    /// Meters one event and adds it to `out` unless it is to be hidden.
    fn forward(&mut self, event: &[u8], out: &mut Option<&mut Out>) {
        if self.observe(event)
            && let Some(out) = out
        {
            out.push(event, true);
        }
    }

    /// Meters one event; returns whether to forward it.
    fn observe(&mut self, event: &[u8]) -> bool {
        let Some(seen) = event_data(event).and_then(|data| observe(self.endpoint, &data)) else {
            return true;
        };
        let hide = self.hide_usage_event && seen.usage_only;
        self.record(seen);
        !hide
    }

    /// Adds what an event said.
    fn record(&mut self, seen: Observed) {
        self.error_events += u64::from(seen.error);
        self.done |= seen.terminal;
        self.generated_tokens += seen.generated;
        if let Some(newer) = seen.usage {
            self.output_reported |= !seen.provisional_output;
            self.reported.get_or_insert_default().merge(newer);
        }
    }
}

/// Where one event lies in the bytes [`StreamMeter::feed_framed`] forwards.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// A whole event (or the unended rest at the end of the stream).
    Event(Range<usize>),
    /// Bytes of an event too large to hold, forwarded as they come (not a whole event).
    Passing(Range<usize>),
}

/// The bytes to forward, and their frames when asked for.
struct Out {
    bytes: Vec<u8>,
    frames: Vec<Frame>,
    framed: bool,
}

impl Out {
    fn new(capacity: usize, framed: bool) -> Out {
        Out {
            bytes: Vec::with_capacity(capacity),
            frames: Vec::new(),
            framed,
        }
    }

    fn push(&mut self, event: &[u8], whole: bool) {
        if event.is_empty() {
            return;
        }
        let range = self.bytes.len()..self.bytes.len() + event.len();
        self.bytes.extend_from_slice(event);
        if self.framed {
            self.frames.push(if whole {
                Frame::Event(range)
            } else {
                Frame::Passing(range)
            });
        }
    }
}

/// Meters a non-streamed JSON response: the body is copied (up to a bound) as it passes and
/// read once it is complete. Past the bound (a Responses answer repeating large instructions
/// and tools) it is read as it passes instead, for its usage only.
#[derive(Debug)]
pub struct BodyMeter {
    endpoint: Endpoint,
    body: Vec<u8>,
    limit: usize,
    /// Past the limit: the body's scan (and nothing copied).
    overflowed: Option<Skeleton>,
}

/// What a complete non-streamed body says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyUsage {
    Reported(Usage),
    /// No usage object: the completion is estimated from the generated text's length.
    Estimated {
        completion_tokens: u64,
    },
    /// Not parseable (not JSON, an error body, or too large and reporting no usage).
    Unknown,
}

impl BodyMeter {
    pub fn new(endpoint: Endpoint, limit: usize) -> Self {
        BodyMeter {
            endpoint,
            body: Vec::new(),
            limit,
            overflowed: None,
        }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        if let Some(scan) = &mut self.overflowed {
            scan.feed(chunk);
        } else if self.body.len().saturating_add(chunk.len()) > self.limit {
            let mut scan = Skeleton::default();
            scan.feed(&std::mem::take(&mut self.body));
            scan.feed(chunk);
            self.overflowed = Some(scan);
        } else {
            self.body.extend_from_slice(chunk);
        }
    }

    pub fn finish(&self) -> BodyUsage {
        if let Some(scan) = &self.overflowed {
            // Too large to read whole: its usage, if it reports one (no estimate from its text).
            let usage = scan
                .observed(self.endpoint)
                .and_then(|seen| seen.usage?.usage());
            return usage.map_or(BodyUsage::Unknown, BodyUsage::Reported);
        }
        let Some(seen) = observe(self.endpoint, &self.body) else {
            return BodyUsage::Unknown;
        };
        if let Some(usage) = seen.usage.as_ref().and_then(Reported::usage) {
            return BodyUsage::Reported(usage);
        }
        if seen.answer {
            BodyUsage::Estimated {
                completion_tokens: seen.generated,
            }
        } else {
            BodyUsage::Unknown
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHUNK: &str = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":null}]}\n\n";
    const USAGE: &str = "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":16,\"total_tokens\":32,\"completion_tokens\":16}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    fn stream() -> String {
        format!("{CHUNK}{CHUNK}{USAGE}{DONE}")
    }

    #[test]
    fn usage_event_is_read_and_hidden_when_not_asked_for() {
        let mut meter = StreamMeter::new(Endpoint::ChatCompletions, true);
        let out = meter.feed(stream().as_bytes(), true);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("{CHUNK}{CHUNK}{DONE}")
        );
        assert_eq!(
            meter.usage(),
            Some(Usage {
                prompt_tokens: 16,
                completion_tokens: 16,
                cached_prompt_tokens: 0
            })
        );
        assert_eq!(meter.generated_tokens(), 2);
    }

    #[test]
    fn the_closing_done_is_noticed() {
        let mut meter = StreamMeter::new(Endpoint::ChatCompletions, true);
        meter.feed(format!("{CHUNK}{CHUNK}").as_bytes(), false);
        assert!(!meter.saw_done(), "cut short so far");
        meter.feed(DONE.as_bytes(), true);
        assert!(meter.saw_done());
    }

    #[test]
    fn usage_event_passes_when_asked_for() {
        let mut meter = StreamMeter::new(Endpoint::ChatCompletions, false);
        let out = meter.feed(stream().as_bytes(), true);
        assert_eq!(String::from_utf8(out).unwrap(), stream());
    }

    #[test]
    fn events_split_anywhere_are_reassembled_without_holding_complete_ones() {
        let whole = stream();
        for split in 1..whole.len() {
            let mut meter = StreamMeter::new(Endpoint::ChatCompletions, true);
            let (a, b) = whole.as_bytes().split_at(split);
            let first = meter.feed(a, false);
            // Whatever was forwarded first is a prefix of complete events.
            let complete_before = whole[..split].rfind("\n\n").map_or(0, |i| i + 2);
            let expected_first = whole[..complete_before].replace(USAGE, "");
            assert_eq!(
                String::from_utf8(first.clone()).unwrap(),
                expected_first,
                "split {split}"
            );
            let mut all = first;
            all.extend(meter.feed(b, true));
            assert_eq!(
                String::from_utf8(all).unwrap(),
                format!("{CHUNK}{CHUNK}{DONE}"),
                "split {split}"
            );
            assert_eq!(meter.usage().map(|u| u.completion_tokens), Some(16));
        }
    }

    #[test]
    fn crlf_events_and_multiline_data_are_understood() {
        let mut meter = StreamMeter::new(Endpoint::ChatCompletions, true);
        let usage = "data: {\"choices\":[],\r\ndata: \"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\r\n\r\n";
        let chunk = "data: {\"choices\":[{\"text\":\"a\"}]}\r\n\r\n";
        let out = meter.feed(format!("{chunk}{usage}{chunk}").as_bytes(), false);
        assert_eq!(String::from_utf8(out).unwrap(), format!("{chunk}{chunk}"));
        assert_eq!(meter.usage().map(|u| u.completion_tokens), Some(2));
        assert_eq!(meter.generated_tokens(), 2);
    }

    #[test]
    fn the_fallback_counts_tokens_of_every_generated_field_not_events() {
        let events = [
            // Three tokens in one chunk.
            r#"{"choices":[{"delta":{"content":" the model runs"}}]}"#,
            r#"{"choices":[{"delta":{"reasoning_content":" fair share"}}]}"#,
            r#"{"choices":[{"delta":{"reasoning":" queue"}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"name":"lookup","arguments":"{\"city\""}}]}}]}"#,
            r#"{"choices":[{"delta":{"function_call":{"arguments":":\"Paris\"}"}}}]}"#,
            r#"{"choices":[{"delta":{"refusal":" no"}}]}"#,
            r#"{"choices":[{"text":" key value"}]}"#,
            r#"{"choices":[{"delta":{"content":""},"finish_reason":"stop"}]}"#,
        ];
        let stream: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
        let mut meter = StreamMeter::new(Endpoint::ChatCompletions, true);
        meter.feed(stream.as_bytes(), true);
        let pieces = [
            " the model runs",
            " fair share",
            " queue",
            "lookup",
            "{\"city\"",
            ":\"Paris\"}",
            " no",
            " key value",
        ];
        let expected: u64 = pieces
            .iter()
            .map(|p| crate::estimate::fast_count(p).max(1))
            .sum();
        assert_eq!(meter.generated_tokens(), expected);
        assert!(expected >= 14, "{expected}");
        assert_eq!(meter.usage(), None);
    }

    #[test]
    fn non_streamed_fallback_counts_reasoning_and_tool_calls() {
        let mut m = BodyMeter::new(Endpoint::ChatCompletions, 4096);
        m.feed(
            br#"{"choices":[{"message":{"content":null,"reasoning_content":"think hard",
                "tool_calls":[{"function":{"name":"f","arguments":"{\"a\":1}"}}]}}]}"#,
        );
        let expected = ["think hard", "f", "{\"a\":1}"]
            .iter()
            .map(|p| crate::estimate::fast_count(p).max(1))
            .sum();
        assert_eq!(
            m.finish(),
            BodyUsage::Estimated {
                completion_tokens: expected
            }
        );
    }

    #[test]
    fn huge_events_are_forwarded_not_hoarded() {
        let mut meter = StreamMeter::new(Endpoint::ChatCompletions, true);
        let blob = vec![b'x'; MAX_HELD_BYTES + 1];
        assert_eq!(meter.feed(&blob, false).len(), blob.len());
    }

    #[test]
    fn framed_feeds_frame_every_forwarded_byte_as_whole_events_or_passing_pieces() {
        let whole = stream();
        for split in 1..whole.len() {
            let mut meter = StreamMeter::new(Endpoint::ChatCompletions, true);
            let mut events = Vec::new();
            let (a, b) = whole.as_bytes().split_at(split);
            for (chunk, end) in [(a, false), (b, true)] {
                let (out, frames) = meter.feed_framed(chunk, end);
                let mut at = 0;
                for frame in frames {
                    let Frame::Event(range) = frame else {
                        panic!("no event is too large here");
                    };
                    assert_eq!(range.start, at, "in order, nothing left out");
                    at = range.end;
                    events.push(String::from_utf8(out[range].to_vec()).unwrap());
                }
                assert_eq!(at, out.len());
            }
            assert_eq!(events, [CHUNK, CHUNK, DONE], "split {split}");
        }
        let mut meter = StreamMeter::new(Endpoint::ChatCompletions, true);
        let blob = vec![b'x'; MAX_HELD_BYTES + 1];
        let (out, frames) = meter.feed_framed(&blob, false);
        assert_eq!(frames, [Frame::Passing(0..out.len())]);
    }

    /// Most a stream meter holds between chunks, whatever the size of its events.
    const MAX_METER_HOLD: usize = MAX_HELD_BYTES + MAX_KEPT_BYTES;

    /// Instructions of `bytes` or so, as a request's JSON spells them: quotes, braces,
    /// backslashes, line breaks and what looks like SSE framing and usage, all escaped.
    fn instructions(bytes: usize) -> String {
        let piece = "Answer as \"the {gateway}\" would: C:\\path\\to [x]\n\ndata: {\"type\":\"response.completed\",\"usage\":{\"input_tokens\":999}}\n\n";
        serde_json::to_string(&piece.repeat(bytes / piece.len() + 1)).unwrap()
    }

    /// Tool schemas of `bytes` or so, with `usage` and `type` keys nested below the kept ones.
    fn tools(bytes: usize) -> String {
        let tool = r#"{"type":"function","name":"lookup","description":"Looks up \"{usage}\".","parameters":{"type":"object","properties":{"usage":{"type":"object","properties":{"input_tokens":{"type":"integer"}}},"type":{"type":"string","enum":["response.completed"]}}}}"#;
        let n = bytes / tool.len() + 1;
        format!("[{}]", vec![tool; n].join(","))
    }

    /// A vLLM Responses stream: `response.created` and `response.completed` each repeat the
    /// request's instructions and tools (about 100 KB and 60 KB), the usage last.
    fn responses_stream() -> String {
        let (instructions, tools) = (instructions(100_000), tools(60_000));
        let response = |status: &str, usage: &str| {
            format!(
                r#"{{"id":"resp_1","object":"response","created_at":1,"instructions":{instructions},"model":"m","output":[],"status":"{status}","tools":{tools},"usage":{usage}}}"#
            )
        };
        let usage = r#"{"input_tokens":41000,"input_tokens_details":{"cached_tokens":40960},"output_tokens":7,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":41007}"#;
        sse(&[
            (
                "response.created",
                &format!(
                    r#"{{"type":"response.created","sequence_number":0,"response":{}}}"#,
                    response("in_progress", "null")
                ),
            ),
            (
                "response.output_text.delta",
                r#"{"type":"response.output_text.delta","sequence_number":1,"delta":" the model","output_index":0}"#,
            ),
            (
                "response.completed",
                &format!(
                    r#"{{"type":"response.completed","sequence_number":2,"response":{}}}"#,
                    response("completed", usage)
                ),
            ),
        ])
    }

    /// Feeds `stream` to a new meter in pieces of `piece` bytes, also cut at `cut`, checking
    /// after each that the meter holds no more than its bound; returns the meter and what it
    /// forwarded.
    fn fed_in_pieces(
        endpoint: Endpoint,
        hide: bool,
        stream: &[u8],
        piece: usize,
        cut: usize,
    ) -> (StreamMeter, Vec<u8>) {
        let mut meter = StreamMeter::new(endpoint, hide);
        let mut cuts: Vec<usize> = (piece..stream.len()).step_by(piece).collect();
        cuts.extend([cut.min(stream.len()), stream.len()]);
        cuts.sort_unstable();
        cuts.dedup();
        let (mut out, mut from) = (Vec::new(), 0);
        for to in cuts {
            out.extend(meter.feed(&stream[from..to], to == stream.len()));
            assert!(
                meter.held_bytes() <= MAX_METER_HOLD,
                "held {} after {to} bytes",
                meter.held_bytes()
            );
            from = to;
        }
        (meter, out)
    }

    /// Cuts worth trying in `stream`: every byte of `around` (its first occurrence after
    /// `after`) and the bytes next to it, and next to every blank line ending an event.
    fn cuts(stream: &str, around: &str, after: usize) -> Vec<usize> {
        let at = after + stream[after..].find(around).unwrap();
        let mut cuts: Vec<usize> = (at.saturating_sub(2)..at + around.len() + 2).collect();
        for (end, _) in stream.match_indices("\n\n") {
            cuts.extend(end.saturating_sub(2)..end + 4);
        }
        cuts
    }

    #[test]
    fn a_responses_stream_of_events_past_the_bound_is_settled_from_its_usage() {
        let stream = responses_stream();
        assert!(stream.len() > 4 * MAX_HELD_BYTES, "{}", stream.len());
        let usage = Usage {
            prompt_tokens: 41000,
            completion_tokens: 7,
            cached_prompt_tokens: 40960,
        };
        let completed = stream.find("event: response.completed").unwrap();
        let mut cut_at = cuts(&stream, r#""usage":{"input_tokens":41000"#, completed);
        // Inside strings with escaped quotes and braces, in both events.
        for event in [0, completed] {
            let quote = event + stream[event..].find(r#"\"the {gateway}\""#).unwrap();
            cut_at.extend(quote..quote + 20);
        }
        let pieces = [997, 4096, 16 * 1024, MAX_HELD_BYTES + 1, 100_000];
        let runs = (cut_at.iter().map(|&cut| (16 * 1024, cut)))
            .chain(pieces.iter().map(|&piece| (piece, 0)));
        for (piece, cut) in runs {
            for hide in [false, true] {
                let (meter, out) =
                    fed_in_pieces(Endpoint::Responses, hide, stream.as_bytes(), piece, cut);
                let at = format!("pieces of {piece}, cut at {cut}");
                assert!(out == stream.as_bytes(), "forwarded as it came: {at}");
                assert_eq!(meter.usage(), Some(usage), "{at}");
                assert!(meter.saw_done(), "{at}");
                assert_eq!(meter.error_events(), 0, "{at}");
                assert_eq!(meter.generated_tokens(), generated_tokens([" the model"]));
            }
        }
    }

    #[test]
    fn a_stream_cut_inside_an_event_past_the_bound_is_not_done() {
        let stream = responses_stream();
        let completed = stream.find("event: response.completed").unwrap();
        let usage = completed + stream[completed..].find(r#""usage":{"#).unwrap();
        for end in [completed + 2 * MAX_HELD_BYTES, usage + 20, stream.len() - 3] {
            let (meter, out) = fed_in_pieces(
                Endpoint::Responses,
                false,
                &stream.as_bytes()[..end],
                8192,
                0,
            );
            assert_eq!(out.len(), end);
            assert!(!meter.saw_done() && meter.usage().is_none(), "cut at {end}");
        }
        // Cut after its JSON but before its blank line, it is read at the end of the stream
        // (as an event held whole is).
        let end = stream.len() - 2;
        let (meter, _) = fed_in_pieces(
            Endpoint::Responses,
            false,
            &stream.as_bytes()[..end],
            8192,
            0,
        );
        assert!(meter.saw_done() && meter.usage().is_some());
    }

    #[test]
    fn chat_completions_and_messages_events_past_the_bound_are_read() {
        let padding = instructions(150_000);
        // Chat: a first chunk carrying the prompt's token ids, the usage chunk (hidden), and
        // a usage chunk past the bound itself when the client asked for it.
        let ids = (0..40_000)
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let first = format!(
            "data: {{\"id\":\"c\",\"prompt_token_ids\":[{ids}],\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}}}}]}}\n\n"
        );
        let stream = format!("{first}{CHUNK}{CHUNK}{USAGE}{DONE}");
        let padded_usage = USAGE.replacen(
            "\"choices\"",
            &format!("\"system_fingerprint\":{padding},\"choices\""),
            1,
        );
        let asked = format!("{first}{CHUNK}{padded_usage}{DONE}");
        // Completions echoing a prompt past the bound.
        let echo =
            format!("data: {{\"id\":\"c\",\"choices\":[{{\"index\":0,\"text\":{padding}}}]}}\n\n");
        let completions = format!("{echo}{CHUNK}{USAGE}{DONE}");
        // Messages: a message_start past the bound (padded: Anthropic's repeats no request).
        let messages = sse(&[
            (
                "message_start",
                &format!(
                    r#"{{"type":"message_start","message":{{"id":"m","type":"message","role":"assistant","content":[{{"type":"text","text":{padding}}}],"usage":{{"input_tokens":3,"cache_read_input_tokens":40000,"output_tokens":1}}}}}}"#
                ),
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" hello there"}}"#,
            ),
            (
                "message_delta",
                &format!(
                    r#"{{"type":"message_delta","delta":{{"stop_reason":"end_turn","padding":{padding}}},"usage":{{"output_tokens":5}}}}"#
                ),
            ),
            ("message_stop", r#"{"type":"message_stop"}"#),
        ]);
        let chat_usage = Usage {
            prompt_tokens: 16,
            completion_tokens: 16,
            cached_prompt_tokens: 0,
        };
        let messages_usage = Usage {
            prompt_tokens: 40003,
            completion_tokens: 5,
            cached_prompt_tokens: 40000,
        };
        let cases = [
            (
                Endpoint::ChatCompletions,
                true,
                &stream,
                r#""usage":{"#,
                chat_usage,
            ),
            (
                Endpoint::ChatCompletions,
                false,
                &asked,
                r#""usage":{"#,
                chat_usage,
            ),
            (
                Endpoint::Completions,
                true,
                &completions,
                r#""text":"#,
                chat_usage,
            ),
            (
                Endpoint::Messages,
                false,
                &messages,
                r#""usage":{"#,
                messages_usage,
            ),
        ];
        for (endpoint, hide, stream, around, usage) in cases {
            let expected = if hide {
                stream.replace(USAGE, "")
            } else {
                stream.clone()
            };
            let runs = (cuts(stream, around, 0)
                .into_iter()
                .map(|cut| (16 * 1024, cut)))
            .chain([997, 100_000].map(|piece| (piece, 0)));
            for (piece, cut) in runs {
                let (meter, out) = fed_in_pieces(endpoint, hide, stream.as_bytes(), piece, cut);
                let at = format!("{endpoint:?}, pieces of {piece}, cut at {cut}");
                assert!(out == expected.as_bytes(), "forwarded: {at}");
                assert_eq!(meter.usage(), Some(usage), "{at}");
                assert!(meter.saw_done(), "{at}");
            }
        }
        // A Messages stream cut after its message_start past the bound: the engine's prompt
        // count and the output that streamed.
        let cut = messages.find("event: message_delta").unwrap();
        let (meter, _) = fed_in_pieces(
            Endpoint::Messages,
            false,
            &messages.as_bytes()[..cut],
            4096,
            0,
        );
        assert_eq!(
            meter.usage(),
            Some(Usage {
                completion_tokens: generated_tokens([" hello there"]),
                ..messages_usage
            })
        );
    }

    #[test]
    fn a_non_streamed_body_past_the_bound_still_reports_its_usage() {
        let body = format!(
            r#"{{"id":"resp_1","object":"response","instructions":{},"tools":{},"output":[{{"type":"message","content":[{{"type":"output_text","text":"hi"}}]}}],"status":"completed","usage":{{"input_tokens":41000,"input_tokens_details":{{"cached_tokens":40960}},"output_tokens":1}}}}"#,
            instructions(150_000),
            tools(50_000)
        );
        let usage = BodyUsage::Reported(Usage {
            prompt_tokens: 41000,
            completion_tokens: 1,
            cached_prompt_tokens: 40960,
        });
        let at = body.find(r#""usage":{"#).unwrap();
        for cut in (at - 2..at + 40).chain([0, 1, MAX_HELD_BYTES + 1]) {
            let mut m = BodyMeter::new(Endpoint::Responses, MAX_HELD_BYTES);
            for piece in [&body[..cut], &body[cut..]] {
                for piece in piece.as_bytes().chunks(16 * 1024) {
                    m.feed(piece);
                }
            }
            assert_eq!(m.finish(), usage, "cut at {cut}");
        }
        // Within the bound, the same body is read whole, as before.
        let mut m = BodyMeter::new(Endpoint::Responses, body.len());
        m.feed(body.as_bytes());
        assert_eq!(m.finish(), usage);
        // Past the bound without usage, nothing is estimated from a body not read whole.
        let mut m = BodyMeter::new(Endpoint::Responses, MAX_HELD_BYTES);
        m.feed(body.replace(r#","usage":"#, r#","usage_":"#).as_bytes());
        assert_eq!(m.finish(), BodyUsage::Unknown);
    }

    #[test]
    fn error_events_are_counted() {
        let mut meter = StreamMeter::new(Endpoint::ChatCompletions, true);
        meter.feed(
            b"data: {\"error\":{\"message\":\"replica lost\"}}\n\n",
            false,
        );
        assert_eq!(meter.error_events(), 1);
    }

    #[test]
    fn an_error_body_that_says_what_was_billed_reports_it() {
        // The sidecar's answer to an attempt that used the engine and then failed (a response
        // deadline, an answer too large) carries the usage it billed, in the API's own shape.
        let error = r#""error":{"message":"m","type":"TimeoutError","code":"response_deadline"}"#;
        for (endpoint, usage) in [
            (
                Endpoint::ChatCompletions,
                r#"{"prompt_tokens":10,"completion_tokens":100,"total_tokens":110}"#,
            ),
            (
                Endpoint::Completions,
                r#"{"prompt_tokens":10,"completion_tokens":100,"total_tokens":110}"#,
            ),
            (
                Endpoint::Responses,
                r#"{"input_tokens":10,"output_tokens":100,"total_tokens":110}"#,
            ),
            (
                Endpoint::Messages,
                r#"{"input_tokens":10,"output_tokens":100}"#,
            ),
        ] {
            let mut m = BodyMeter::new(endpoint, 1 << 20);
            m.feed(format!(r#"{{{error},"usage":{usage}}}"#).as_bytes());
            match m.finish() {
                BodyUsage::Reported(u) => assert_eq!(
                    (u.prompt_tokens, u.completion_tokens),
                    (10, 100),
                    "{endpoint:?}"
                ),
                other => panic!("{endpoint:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn non_streamed_bodies_report_or_estimate() {
        let mut m = BodyMeter::new(Endpoint::ChatCompletions, 1024);
        m.feed(br#"{"choices":[{"message":{"content":"hello"}}],"#);
        m.feed(br#""usage":{"prompt_tokens":5,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":3}}}"#);
        assert_eq!(
            m.finish(),
            BodyUsage::Reported(Usage {
                prompt_tokens: 5,
                completion_tokens: 1,
                cached_prompt_tokens: 3
            })
        );

        let mut m = BodyMeter::new(Endpoint::ChatCompletions, 1024);
        m.feed(br#"{"choices":[{"text":"hello world"}]}"#);
        assert_eq!(
            m.finish(),
            BodyUsage::Estimated {
                completion_tokens: 2,
            }
        );

        let mut m = BodyMeter::new(Endpoint::ChatCompletions, 8);
        m.feed(br#"{"choices":[]}"#);
        assert_eq!(m.finish(), BodyUsage::Unknown);
    }

    fn sse(events: &[(&str, &str)]) -> String {
        events
            .iter()
            .map(|(kind, data)| format!("event: {kind}\ndata: {data}\n\n"))
            .collect()
    }

    #[test]
    fn responses_streams_report_usage_in_their_terminal_event() {
        let stream = sse(&[
            (
                "response.created",
                r#"{"type":"response.created","sequence_number":0,"response":{"status":"in_progress","usage":null}}"#,
            ),
            (
                "response.output_text.delta",
                r#"{"type":"response.output_text.delta","delta":" the model","output_index":0}"#,
            ),
            (
                "response.reasoning_text.delta",
                r#"{"type":"response.reasoning_text.delta","delta":" think"}"#,
            ),
            (
                "response.function_call_arguments.delta",
                r#"{"type":"response.function_call_arguments.delta","delta":"{\"a\":1}"}"#,
            ),
            (
                "response.audio.delta",
                r#"{"type":"response.audio.delta","delta":"UklGRiQAAABXQVZF"}"#,
            ),
            (
                "response.completed",
                r#"{"type":"response.completed","response":{"status":"completed","usage":{"input_tokens":12,"input_tokens_details":{"cached_tokens":4},"output_tokens":7,"total_tokens":19}}}"#,
            ),
        ]);
        let mut meter = StreamMeter::new(Endpoint::Responses, false);
        let out = meter.feed(stream.as_bytes(), true);
        assert_eq!(String::from_utf8(out).unwrap(), stream, "nothing is hidden");
        assert_eq!(
            meter.usage(),
            Some(Usage {
                prompt_tokens: 12,
                completion_tokens: 7,
                cached_prompt_tokens: 4
            })
        );
        let expected = generated_tokens([" the model", " think", "{\"a\":1}"]);
        assert_eq!(meter.generated_tokens(), expected);
        assert!(meter.saw_done() && meter.error_events() == 0);

        let mut cut = StreamMeter::new(Endpoint::Responses, false);
        cut.feed(stream.as_bytes().split_at(stream.len() / 2).0, true);
        assert!(!cut.saw_done() && cut.usage().is_none());

        let mut failed = StreamMeter::new(Endpoint::Responses, false);
        failed.feed(sse(&[("response.failed", r#"{"type":"response.failed","response":{"status":"failed","error":{"code":"server_error"}}}"#)]).as_bytes(), true);
        assert_eq!(failed.error_events(), 1);
    }

    #[test]
    fn messages_streams_add_up_input_and_output_usage_across_events() {
        let stream = sse(&[
            (
                "message_start",
                r#"{"type":"message_start","message":{"id":"m","type":"message","role":"assistant","content":[],"usage":{"input_tokens":3,"cache_read_input_tokens":8,"output_tokens":1}}}"#,
            ),
            (
                "content_block_start",
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" hello there"}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"thinking_delta","thinking":" hmm"}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"{\"city\":"}}"#,
            ),
            (
                "message_delta",
                r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":5}}"#,
            ),
            ("message_stop", r#"{"type":"message_stop"}"#),
        ]);
        let mut meter = StreamMeter::new(Endpoint::Messages, false);
        meter.feed(stream.as_bytes(), true);
        assert_eq!(
            meter.usage(),
            Some(Usage {
                prompt_tokens: 11,
                completion_tokens: 5,
                cached_prompt_tokens: 8
            }),
            "cache reads are part of the prompt (and cached); the last delta's output stands"
        );
        assert_eq!(
            meter.generated_tokens(),
            generated_tokens([" hello there", " hmm", "{\"city\":"])
        );
        assert!(meter.saw_done());
        let mut error = StreamMeter::new(Endpoint::Messages, false);
        error.feed(
            sse(&[(
                "error",
                r#"{"type":"error","error":{"type":"overloaded_error","message":"x"}}"#,
            )])
            .as_bytes(),
            true,
        );
        assert_eq!(error.error_events(), 1);
    }

    #[test]
    fn a_messages_stream_cut_before_its_message_delta_is_billed_what_streamed() {
        // `message_start` reports the prompt and a placeholder output (0 in vLLM's and the
        // simulator's streams, 1 in Anthropic's); the output count comes in `message_delta`.
        let stream = sse(&[
            (
                "message_start",
                r#"{"type":"message_start","message":{"id":"m","type":"message","role":"assistant","content":[],"usage":{"input_tokens":9,"output_tokens":0}}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" the model keeps on writing a long answer"}}"#,
            ),
        ]);
        let mut meter = StreamMeter::new(Endpoint::Messages, false);
        meter.feed(stream.as_bytes(), true);
        let streamed = generated_tokens([" the model keeps on writing a long answer"]);
        assert_eq!(
            meter.usage(),
            Some(Usage {
                prompt_tokens: 9,
                completion_tokens: streamed,
                cached_prompt_tokens: 0
            }),
            "the engine's prompt count, and the output that streamed"
        );
        // Once message_delta reports, the engine's count stands, even below what was counted.
        let delta = sse(&[(
            "message_delta",
            r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":2}}"#,
        )]);
        meter.feed(delta.as_bytes(), true);
        assert_eq!(meter.usage().map(|u| u.completion_tokens), Some(2));
    }

    #[test]
    fn each_api_s_bodies_report_or_estimate() {
        let finish = |endpoint, body: &str| {
            let mut m = BodyMeter::new(endpoint, 1 << 16);
            m.feed(body.as_bytes());
            m.finish()
        };
        assert_eq!(
            finish(
                Endpoint::Responses,
                r#"{"object":"response","status":"completed","output":[{"type":"message","content":[{"type":"output_text","text":"hi"}]}],"usage":{"input_tokens":9,"output_tokens":1}}"#
            ),
            BodyUsage::Reported(Usage {
                prompt_tokens: 9,
                completion_tokens: 1,
                cached_prompt_tokens: 0
            })
        );
        assert_eq!(
            finish(
                Endpoint::Responses,
                r#"{"object":"response","status":"completed","output":[{"type":"function_call","name":"f","arguments":"{}"},{"type":"reasoning","summary":[{"type":"summary_text","text":"so"}]}]}"#
            ),
            BodyUsage::Estimated {
                completion_tokens: generated_tokens(["f", "{}", "so"])
            }
        );
        assert_eq!(
            finish(
                Endpoint::Messages,
                r#"{"type":"message","content":[{"type":"text","text":"hi there"},{"type":"tool_use","name":"f","input":{"a":1}}],"usage":{"input_tokens":4,"cache_creation_input_tokens":2,"output_tokens":6}}"#
            ),
            BodyUsage::Reported(Usage {
                prompt_tokens: 6,
                completion_tokens: 6,
                cached_prompt_tokens: 0
            })
        );
        assert_eq!(
            finish(
                Endpoint::Messages,
                r#"{"type":"message","content":[{"type":"text","text":"hi there"}]}"#
            ),
            BodyUsage::Estimated {
                completion_tokens: 2,
            }
        );
        assert_eq!(
            finish(
                Endpoint::Messages,
                r#"{"type":"error","error":{"type":"api_error","message":"x"}}"#
            ),
            BodyUsage::Unknown
        );
        assert_eq!(
            finish(
                Endpoint::Embeddings,
                r#"{"object":"list","data":[{"embedding":[0.1]}],"usage":{"prompt_tokens":8,"total_tokens":8}}"#
            ),
            BodyUsage::Reported(Usage {
                prompt_tokens: 8,
                completion_tokens: 0,
                cached_prompt_tokens: 0
            })
        );
    }
}
