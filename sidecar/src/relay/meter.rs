//! Metering: what an attempt is billed. A stream is metered as it passes (and its usage chunk
//! held back when weir asked for it); a non-streamed answer read whole is metered from its
//! body; one nobody read is billed its bound, as the filter charges it; one that ran nothing
//! is billed nothing. The tool calls the answer made are counted alongside, for its record.

use axum::body::Bytes;
use weir_core::endpoint::Endpoint;
use weir_core::meter::{BodyUsage, StreamMeter};
use weir_core::outcome;
use weir_core::sse;
use weir_core::tools::{ToolCall, ToolScan, body_calls};

/// What the attempt is billed, and where the figures came from.
#[derive(Clone, Copy, Debug)]
pub struct Bill {
    pub prompt: u64,
    pub completion: u64,
    /// `engine` (its usage), `counted` (weir's count), or `bound` (an unread answer's).
    pub source: &'static str,
    pub cached: u64,
    /// Whether the engine ran anything for it: an attempt that ran nothing is billed nothing.
    pub ran: bool,
    /// Tool calls its answer made ([`ToolCount`]).
    pub tool_calls: u64,
}

/// The attempt's meter, and how its answer is billed.
pub struct Meter {
    pub(super) stream: StreamMeter,
    hide_usage: bool,
    /// The answer counts as a stream, as the filter meters it: as the request asked until its
    /// first bytes go to the client (the filter meters by the request until it has the
    /// response's headers), then a stream. What was relayed of a stream is counted; a
    /// non-streamed answer is read whole or billed its bound.
    pub(super) streamed: bool,
    /// Output billed for its answer if nobody reads it.
    unread_output: u64,
    /// The request never reached the engine, the engine answered with an error status, or it
    /// never took a stream in (no headers by its first-byte deadline): it ran nothing, so
    /// nothing is billed.
    pub(super) nothing_ran: bool,
    /// The tool calls its answer made.
    pub(super) tools: ToolCount,
}

impl Meter {
    pub(super) fn new(endpoint: Endpoint, hide_usage: bool, unread_output: u64) -> Meter {
        Meter {
            stream: StreamMeter::new(endpoint, hide_usage),
            hide_usage,
            streamed: false,
            unread_output,
            nothing_ran: false,
            tools: ToolCount::new(endpoint),
        }
    }

    /// Meters a chunk; what the client gets of it (the usage chunk held back if weir asked
    /// for it).
    pub(super) fn feed(&mut self, chunk: &Bytes) -> Bytes {
        self.tools.feed(chunk);
        if self.hide_usage {
            Bytes::from(self.stream.feed(chunk, false))
        } else {
            self.stream.meter(chunk, false);
            chunk.clone()
        }
    }

    /// Meters what the meter still holds once the stream has ended; what of it the client
    /// has not had yet.
    pub(super) fn drain(&mut self) -> Bytes {
        self.tools.end();
        let metered = self.stream.feed(&[], true);
        if !self.hide_usage {
            return Bytes::new();
        }
        Bytes::from(metered)
    }

    /// How a stream the engine ended went: an error event in it (an engine failing once the
    /// stream had started) makes it an `upstream_error`, and a stream closed without its
    /// `[DONE]` (an engine that died but closed the connection cleanly) `failed`. Both are
    /// billed for what streamed but are not completed work, so the key's retry runs instead of
    /// replaying a failure or a truncated answer.
    pub(super) fn ended_outcome(&self) -> &'static str {
        outcome::of_stream(self.stream.error_events(), self.stream.saw_done())
    }

    /// The bill: the engine's usage where it reported one (`body_usage` for an answer read
    /// whole, else the stream's), else weir's count, or an unread answer's bound.
    pub(super) fn bill(&self, body_usage: Option<BodyUsage>, input_tokens: u64) -> Bill {
        let reported = match body_usage {
            Some(BodyUsage::Reported(u)) => Some(u),
            Some(_) => None,
            None => self.stream.usage(),
        };
        let counted = match body_usage {
            Some(BodyUsage::Estimated { completion_tokens }) => completion_tokens,
            _ => self.stream.generated_tokens(),
        };
        let cached = reported.map_or(0, |u| u.cached_prompt_tokens);
        // A non-streamed answer the engine was working on that nobody read (the client left,
        // a deadline or shutdown cut it, it was too large): its bound, as the filter charges it.
        let unread = !self.streamed && body_usage.is_none();
        let (prompt, completion, source) = match reported {
            Some(u) => (u.prompt_tokens, u.completion_tokens, "engine"),
            // Nothing ran: the attempt is recorded, billed nothing (as the filter charges it).
            None if self.nothing_ran => (0, 0, "counted"),
            None if unread => (input_tokens, self.unread_output, "bound"),
            None => (input_tokens, counted, "counted"),
        };
        Bill {
            prompt,
            completion,
            source,
            cached,
            ran: !self.nothing_ran,
            tool_calls: self.tools.made(),
        }
    }
}

/// Bytes of one event read for its tool calls: more than the filter holds of an event under a
/// tool policy (the request body bound and a mebibyte, by default), so a call the filter reads
/// and counts the ledger records, and the approval watch holds. Held only while such an event
/// streams; a larger one is passed unread (its calls neither counted nor held).
pub const MAX_TOOL_EVENT_BYTES: usize = 8 * 1024 * 1024;

/// Reads the tool calls an answer makes, once, for its record and for the approval watch
/// ([`super::approval::Watch`]): a stream read one whole event at a time by a [`ToolScan`]
/// (framed as the meters frame it), or an answer read whole by [`body_calls`]. An unended
/// event past [`MAX_TOOL_EVENT_BYTES`] is passed unread, and the reading goes on at the next
/// event; past the scan's own bounds (more than [`weir_core::tools::MAX_CALLS`] calls) it
/// counts no further.
pub(super) struct ToolCount {
    scan: ToolScan,
    /// The stream's unended last event; while `skipping`, only its last bytes, which may
    /// begin the empty line that ends it.
    rest: Vec<u8>,
    skipping: bool,
    /// The calls of an answer read whole.
    whole: Option<u64>,
    endpoint: Endpoint,
}

/// Bytes kept of an event passed unread: enough for the start of the line endings that end it.
const SKIP_TAIL: usize = 3;

impl ToolCount {
    pub(super) fn new(endpoint: Endpoint) -> ToolCount {
        ToolCount {
            scan: ToolScan::new(endpoint),
            rest: Vec::new(),
            skipping: false,
            whole: None,
            endpoint,
        }
    }

    /// Reads the events a chunk of the stream completes.
    pub(super) fn feed(&mut self, chunk: &[u8]) {
        self.rest.extend_from_slice(chunk);
        let mut at = 0;
        while let Some(len) = self.rest.get(at..).and_then(sse::event_end) {
            if !std::mem::take(&mut self.skipping) {
                self.scan
                    .observe(self.rest.get(at..at + len).unwrap_or_default());
            }
            at += len;
        }
        self.rest.drain(..at);
        if self.skipping || self.rest.len() > MAX_TOOL_EVENT_BYTES {
            self.skipping = true;
            self.rest.drain(..self.rest.len().saturating_sub(SKIP_TAIL));
        }
    }

    /// The stream ended: its unended last event is read, and the calls still undecided are
    /// decided as they stand.
    fn end(&mut self) {
        if !self.skipping && !self.rest.is_empty() {
            self.scan.observe(&std::mem::take(&mut self.rest));
        }
        self.scan.finish();
    }

    /// Counts the calls of an answer read whole (none when it is not the API's answer).
    pub(super) fn whole(&mut self, body: &[u8]) {
        let calls = body_calls(self.endpoint, body).map_or(0, |calls| calls.len());
        self.whole = Some(calls as u64);
    }

    fn made(&self) -> u64 {
        self.whole.unwrap_or_else(|| self.scan.calls_made())
    }

    /// The calls of the stream completed so far (their arguments whole).
    pub(super) fn completed(&self) -> impl Iterator<Item = &ToolCall> {
        self.scan.completed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_core::meter::MAX_HELD_BYTES;

    /// A chat answer that makes two parallel calls, the second after a text event too large
    /// for the meters to hold.
    fn chat_stream(filler: usize) -> String {
        let call = |index: u32, id: &str, name: &str, arguments: &str| {
            format!(
                "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"tool_calls\":[{{\"index\":{index},\
                 \"id\":\"{id}\",\"type\":\"function\",\"function\":{{\"name\":\"{name}\",\
                 \"arguments\":\"{arguments}\"}}}}]}}}}]}}\n\n"
            )
        };
        [
            call(0, "c1", "get_weather", ""),
            call(0, "", "", "{\\\"city\\\":\\\"Oslo\\\"}"),
            format!(
                "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{}\"}}}}]}}\r\n\r\n",
                "x".repeat(filler)
            ),
            call(1, "c2", "search", "{}"),
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n"
                .into(),
            "data: [DONE]".into(),
        ]
        .concat()
    }

    fn streamed(stream: &str, chunk: usize) -> Bill {
        let mut meter = Meter::new(Endpoint::ChatCompletions, false, 0);
        meter.streamed = true;
        for piece in stream.as_bytes().chunks(chunk) {
            meter.feed(&Bytes::copy_from_slice(piece));
        }
        meter.drain();
        meter.bill(None, 10)
    }

    #[test]
    fn a_stream_s_tool_calls_are_counted_however_it_is_chunked() {
        for chunk in [1, 7, 64, 100_000] {
            assert_eq!(streamed(&chat_stream(10), chunk).tool_calls, 2, "{chunk}");
            // An event past what the meters hold is passed unread; the next is read.
            let long = chat_stream(MAX_HELD_BYTES + 10);
            assert_eq!(streamed(&long, chunk.max(1_000)).tool_calls, 2, "{chunk}");
        }
        let text = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
        assert_eq!(streamed(text, 5).tool_calls, 0);
    }

    #[test]
    fn an_answer_read_whole_counts_its_calls() {
        let mut meter = Meter::new(Endpoint::Messages, false, 0);
        meter.tools.whole(
            br#"{"type":"message","role":"assistant","content":[
                {"type":"text","text":"on it"},
                {"type":"tool_use","id":"toolu_1","name":"search","input":{"q":"rain"}},
                {"type":"tool_use","id":"toolu_2","name":"deploy","input":{}}],
                "usage":{"input_tokens":5,"output_tokens":9}}"#,
        );
        assert_eq!(meter.bill(None, 5).tool_calls, 2);
        meter
            .tools
            .whole(br#"{"type":"error","error":{"type":"overloaded_error"}}"#);
        assert_eq!(meter.bill(None, 5).tool_calls, 0);
    }
}

#[cfg(test)]
mod attack_tests {
    use super::*;
    use weir_core::meter::MAX_HELD_BYTES;

    /// The filter reads and counts a call in one event past 64 KiB (it holds events whole under
    /// a tool policy): the ledger counts it too.
    #[test]
    fn a_call_in_one_event_past_64_kib_is_counted_in_the_ledger() {
        let arguments = format!("{{\\\"pad\\\":\\\"{}\\\"}}", "x".repeat(3 * MAX_HELD_BYTES));
        let stream = format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"tool_calls\":[{{\"index\":0,\
             \"id\":\"c1\",\"type\":\"function\",\"function\":{{\"name\":\"search\",\
             \"arguments\":\"{arguments}\"}}}}]}}}}]}}\n\n\
             data: {{\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"tool_calls\"}}]}}\n\n\
             data: [DONE]\n\n"
        );
        for chunk in [1_000, 16 * 1024, 1 << 20] {
            let mut meter = Meter::new(Endpoint::ChatCompletions, false, 0);
            meter.streamed = true;
            for piece in stream.as_bytes().chunks(chunk) {
                meter.feed(&Bytes::copy_from_slice(piece));
            }
            meter.drain();
            assert_eq!(meter.bill(None, 10).tool_calls, 1, "chunk {chunk}");
        }
    }
}
