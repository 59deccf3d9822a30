//! Metering a response as it passes: the engine's usage when it reports one, a count of the
//! tokens seen when it does not.
//!
//! Streams are scanned event by event across chunk boundaries. Only the bytes of an incomplete
//! trailing event are held back (never more than [`MAX_HELD_BYTES`]); everything else is
//! forwarded at once. The usage-only event that weir asks the engine for is removed again
//! when the client did not ask for it.

use serde::Deserialize;

/// An event larger than this is forwarded unparsed rather than held.
pub const MAX_HELD_BYTES: usize = 64 * 1024;

/// Token counts of a finished response.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
}

#[derive(Deserialize)]
struct Event {
    #[serde(default)]
    choices: Option<Vec<Choice>>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    delta: Option<Generated>,
    #[serde(default)]
    message: Option<Generated>,
    /// The completions endpoint's output.
    #[serde(default)]
    text: Option<String>,
}

/// Every field of a message or delta the engine generates, each billed as output: the answer,
/// the reasoning (`reasoning_content` in vLLM until 0.10, `reasoning` after), a refusal, and
/// tool calls (names and arguments), current and legacy.
#[derive(Deserialize)]
struct Generated {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    reasoning: Option<String>,
    #[serde(default)]
    refusal: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCall>>,
    #[serde(default)]
    function_call: Option<FunctionCall>,
}

#[derive(Deserialize)]
struct ToolCall {
    #[serde(default)]
    function: Option<FunctionCall>,
}

#[derive(Deserialize)]
struct FunctionCall {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

impl Generated {
    fn texts(&self) -> impl Iterator<Item = &str> {
        let calls = self
            .tool_calls
            .iter()
            .flatten()
            .filter_map(|c| c.function.as_ref());
        let functions = calls.chain(self.function_call.as_ref());
        [
            &self.content,
            &self.reasoning_content,
            &self.reasoning,
            &self.refusal,
        ]
        .into_iter()
        .flatten()
        .map(String::as_str)
        .chain(functions.flat_map(|f| {
            [&f.name, &f.arguments]
                .into_iter()
                .flatten()
                .map(String::as_str)
        }))
    }
}

impl Choice {
    /// Every piece of generated text in the choice.
    fn texts(&self) -> impl Iterator<Item = &str> {
        self.delta
            .iter()
            .chain(self.message.iter())
            .flat_map(Generated::texts)
            .chain(self.text.as_deref())
    }
}

/// Output tokens in the generated text of some choices: a fast count of every generated field,
/// and at least one token for any non-empty piece (an engine sends no empty token).
fn generated_tokens(choices: &[Choice]) -> u64 {
    choices
        .iter()
        .flat_map(Choice::texts)
        .filter(|t| !t.is_empty())
        .map(|t| crate::estimate::fast_count(t).max(1))
        .sum()
}

/// Meters a server-sent-event stream of chat or text completion chunks.
#[derive(Debug, Default)]
pub struct StreamMeter {
    hide_usage_event: bool,
    held: Vec<u8>,
    usage: Option<Usage>,
    generated_tokens: u64,
    error_events: u64,
    done: bool,
}

impl StreamMeter {
    /// `hide_usage_event`: the client did not ask for `include_usage`, so the usage-only
    /// event is metered and then dropped.
    pub fn new(hide_usage_event: bool) -> Self {
        StreamMeter {
            hide_usage_event,
            ..StreamMeter::default()
        }
    }

    /// The engine's usage, once its usage event has passed.
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// Output tokens counted in the generated text that passed (every field, not events): the
    /// fallback completion count when the engine reports no usage.
    pub fn generated_tokens(&self) -> u64 {
        self.generated_tokens
    }

    /// Events that carried an error object (an engine failing mid-stream).
    pub fn error_events(&self) -> u64 {
        self.error_events
    }

    /// Whether the stream's closing `data: [DONE]` has passed: a stream that ends without it
    /// was cut short, however cleanly its connection closed.
    pub fn saw_done(&self) -> bool {
        self.done
    }

    /// Takes the next chunk of the stream and returns the bytes to forward now.
    pub fn feed(&mut self, chunk: &[u8], end_of_stream: bool) -> Vec<u8> {
        self.held.extend_from_slice(chunk);
        let complete = if end_of_stream {
            self.held.len()
        } else {
            match last_boundary(&self.held) {
                Some(end) => end,
                None if self.held.len() > MAX_HELD_BYTES => {
                    return std::mem::take(&mut self.held);
                }
                None => return Vec::new(),
            }
        };
        let rest = self.held.split_off(complete);
        let ready = std::mem::replace(&mut self.held, rest);
        let mut out = Vec::with_capacity(ready.len());
        for event in split_events(&ready) {
            if self.observe(event) {
                out.extend_from_slice(event);
            }
        }
        out
    }

    /// Meters one event; returns whether to forward it.
    fn observe(&mut self, event: &[u8]) -> bool {
        let Some(data) = event_data(event) else {
            return true;
        };
        if data.trim_ascii() == b"[DONE]" {
            self.done = true;
            return true;
        }
        let Ok(parsed) = serde_json::from_slice::<Event>(&data) else {
            return true;
        };
        if parsed.error.is_some() {
            self.error_events += 1;
        }
        let choices = parsed.choices.unwrap_or_default();
        self.generated_tokens += generated_tokens(&choices);
        match parsed.usage {
            Some(usage) => {
                self.usage = Some(usage);
                !(self.hide_usage_event && choices.is_empty())
            }
            None => true,
        }
    }
}

/// End (exclusive) of the first event in `buf`: just past its blank line.
fn event_end(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    // A `\r\n\r\n` that ends first lies before the first `\n\n`: searching only there keeps
    // splitting a chunk into events linear in its length.
    let before_lf = buf.get(..lf.unwrap_or(buf.len())).unwrap_or(buf);
    let crlf = before_lf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| i + 4);
    crlf.or(lf)
}

/// End (exclusive) of the last complete event. Scans forward event by event, exactly as
/// [`split_events`] splits, so where events end never depends on how the stream was chunked
/// (a backward search for the last blank line disagrees when `\r\n` runs overlap).
fn last_boundary(buf: &[u8]) -> Option<usize> {
    let mut end = None;
    let mut at = 0;
    while let Some(len) = buf.get(at..).and_then(event_end) {
        at += len;
        end = Some(at);
    }
    end
}

/// Splits complete events, each keeping its trailing blank line.
fn split_events(buf: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = buf;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let end = event_end(rest).unwrap_or(rest.len());
        let (event, tail) = rest.split_at(end);
        rest = tail;
        Some(event)
    })
}

/// The concatenated `data:` lines of an event, if any.
fn event_data(event: &[u8]) -> Option<Vec<u8>> {
    let mut data: Option<Vec<u8>> = None;
    for line in event.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(value) = line.strip_prefix(b"data:") {
            let value = value.strip_prefix(b" ").unwrap_or(value);
            let d = data.get_or_insert_with(Vec::new);
            if !d.is_empty() {
                d.push(b'\n');
            }
            d.extend_from_slice(value);
        }
    }
    data
}

/// Meters a non-streamed JSON response: the body is copied (up to a bound) as it passes and
/// read once it is complete.
#[derive(Debug)]
pub struct BodyMeter {
    body: Vec<u8>,
    limit: usize,
    overflowed: bool,
}

/// What a complete non-streamed body says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyUsage {
    Reported(Usage),
    /// No usage object: the completion is estimated from the generated text's length.
    Estimated {
        completion_tokens: u64,
    },
    /// Not parseable (too large, not JSON, an error body).
    Unknown,
}

impl BodyMeter {
    pub fn new(limit: usize) -> Self {
        BodyMeter {
            body: Vec::new(),
            limit,
            overflowed: false,
        }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        if self.body.len() + chunk.len() > self.limit {
            self.overflowed = true;
            self.body = Vec::new();
        }
        if !self.overflowed {
            self.body.extend_from_slice(chunk);
        }
    }

    pub fn finish(&self) -> BodyUsage {
        if self.overflowed {
            return BodyUsage::Unknown;
        }
        let Ok(parsed) = serde_json::from_slice::<Event>(&self.body) else {
            return BodyUsage::Unknown;
        };
        if let Some(usage) = parsed.usage {
            return BodyUsage::Reported(usage);
        }
        match parsed.choices {
            Some(choices) if parsed.error.is_none() => BodyUsage::Estimated {
                completion_tokens: generated_tokens(&choices),
            },
            _ => BodyUsage::Unknown,
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
        let mut meter = StreamMeter::new(true);
        let out = meter.feed(stream().as_bytes(), true);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("{CHUNK}{CHUNK}{DONE}")
        );
        assert_eq!(
            meter.usage(),
            Some(Usage {
                prompt_tokens: 16,
                completion_tokens: 16
            })
        );
        assert_eq!(meter.generated_tokens(), 2);
    }

    #[test]
    fn the_closing_done_is_noticed() {
        let mut meter = StreamMeter::new(true);
        meter.feed(format!("{CHUNK}{CHUNK}").as_bytes(), false);
        assert!(!meter.saw_done(), "cut short so far");
        meter.feed(DONE.as_bytes(), true);
        assert!(meter.saw_done());
    }

    #[test]
    fn usage_event_passes_when_asked_for() {
        let mut meter = StreamMeter::new(false);
        let out = meter.feed(stream().as_bytes(), true);
        assert_eq!(String::from_utf8(out).unwrap(), stream());
    }

    #[test]
    fn events_split_anywhere_are_reassembled_without_holding_complete_ones() {
        let whole = stream();
        for split in 1..whole.len() {
            let mut meter = StreamMeter::new(true);
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
        let mut meter = StreamMeter::new(true);
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
        let mut meter = StreamMeter::new(true);
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
        let mut m = BodyMeter::new(4096);
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
        let mut meter = StreamMeter::new(true);
        let blob = vec![b'x'; MAX_HELD_BYTES + 1];
        assert_eq!(meter.feed(&blob, false).len(), blob.len());
    }

    #[test]
    fn error_events_are_counted() {
        let mut meter = StreamMeter::new(true);
        meter.feed(
            b"data: {\"error\":{\"message\":\"replica lost\"}}\n\n",
            false,
        );
        assert_eq!(meter.error_events(), 1);
    }

    #[test]
    fn non_streamed_bodies_report_or_estimate() {
        let mut m = BodyMeter::new(1024);
        m.feed(br#"{"choices":[{"message":{"content":"hello"}}],"#);
        m.feed(br#""usage":{"prompt_tokens":5,"completion_tokens":1}}"#);
        assert_eq!(
            m.finish(),
            BodyUsage::Reported(Usage {
                prompt_tokens: 5,
                completion_tokens: 1
            })
        );

        let mut m = BodyMeter::new(1024);
        m.feed(br#"{"choices":[{"text":"hello world"}]}"#);
        assert_eq!(
            m.finish(),
            BodyUsage::Estimated {
                completion_tokens: 2
            }
        );

        let mut m = BodyMeter::new(8);
        m.feed(br#"{"choices":[]}"#);
        assert_eq!(m.finish(), BodyUsage::Unknown);
    }
}
