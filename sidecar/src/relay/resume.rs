//! Resuming a preempted batch stream (invariant 7): the relay aborts the upstream stream (the
//! engine frees the sequence), and once the request is dispatched again it asks the engine to
//! continue from what was generated, so the client's stream pauses and goes on.
//!
//! - Chat Completions: the generated text becomes a final assistant message, continued with
//!   vLLM's `continue_final_message: true, add_generation_prompt: false` (SGLang reads the same
//!   fields; llama.cpp continues a final assistant message by itself).
//! - Completions: the prompt (a string) with the generated text after it.
//!
//! Either way the output limits are lowered by what was generated. The continued stream is
//! rewritten as the client first saw it ([`Splice`]): the first chunk's `id` and `created`, no
//! second `role` delta, and a usage chunk with the original prompt and every token generated.
//! Segments are spliced on event boundaries: the client never gets half an event, so an event
//! cut by the preemption is not the client's, and the continuation generates it again.
//! Requests that cannot be continued this way (not streamed, other APIs, several answers, tools,
//! structured output, log-probabilities, token-id prompts, chats without a generation prompt
//! that continue no final message) are never preempted; one that turns out to stream reasoning
//! or tool calls, or whose answer has ended, is left running.

use axum::body::Bytes;
use axum::http::HeaderValue;
use serde_json::{Map, Value, json};
use weir_core::endpoint::Endpoint;
use weir_core::meter::MAX_HELD_BYTES;
use weir_core::request::fields::answers_asked;
use weir_core::sse;
use weir_core::tokens::Encoding;

/// Fields whose answer a continuation would not reproduce: tool calls and structured output
/// restart their grammar, log-probabilities and echoes cover the whole answer.
const NOT_RESUMABLE: [&str; 11] = [
    "tools",
    "functions",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "logprobs",
    "echo",
    "suffix",
];

/// Output limits lowered by what was generated before a continuation, with the least each may
/// become (an engine refuses a maximum of 0; a minimum already generated is 0).
const LIMITS: [(&str, u64); 3] = [
    ("max_completion_tokens", 1),
    ("max_tokens", 1),
    ("min_tokens", 0),
];

/// Whether a request's stream can be continued after preemption (see the module doc).
pub fn resumable(endpoint: Endpoint, body: &Value, stream: bool) -> bool {
    let single = answers_asked(body) <= 1;
    let plain = NOT_RESUMABLE
        .iter()
        .all(|f| body[*f].is_null() || body[*f] == Value::Bool(false));
    // A chat its caller left without a generation prompt, and not continuing its final
    // message, has the model go on from the raw chat: a continuation would open a turn.
    let framed = body["add_generation_prompt"] != Value::Bool(false)
        || body["continue_final_message"] == Value::Bool(true);
    let prompt = match endpoint {
        Endpoint::ChatCompletions => body["messages"].is_array() && framed,
        Endpoint::Completions => body["prompt"].is_string(),
        _ => false,
    };
    stream && single && plain && prompt
}

/// The body that continues `body` after `text` (`tokens` of it) was generated.
pub fn continued(endpoint: Endpoint, body: &Value, text: &str, tokens: u64) -> Value {
    let mut next = body.clone();
    for (limit, least) in LIMITS {
        if let Some(n) = next[limit].as_u64() {
            next[limit] = json!(n.saturating_sub(tokens).max(least));
        }
    }
    match endpoint {
        Endpoint::Completions => {
            let prompt = next["prompt"].as_str().unwrap_or_default();
            next["prompt"] = json!(format!("{prompt}{text}"));
        }
        _ => {
            let already_continuing = next["continue_final_message"] == Value::Bool(true);
            let messages = next["messages"].as_array_mut();
            match messages {
                Some(m) if already_continuing => {
                    if let Some(last) = m.last_mut() {
                        append(&mut last["content"], text);
                    }
                }
                Some(m) => m.push(json!({"role": "assistant", "content": text})),
                None => {}
            }
            next["continue_final_message"] = json!(true);
            next["add_generation_prompt"] = json!(false);
        }
    }
    next
}

/// Appends generated text to the final message the caller asked to continue, whichever shape
/// its content has: a string, or parts (the text goes into the last text part, as engines join
/// parts with a newline; after a non-text part, into a new one).
fn append(content: &mut Value, text: &str) {
    if let Some(parts) = content.as_array_mut() {
        match parts.last_mut() {
            Some(part) if part["type"] == "text" => {
                let before = part["text"].as_str().unwrap_or_default();
                part["text"] = json!(format!("{before}{text}"));
            }
            _ => parts.push(json!({"type": "text", "text": text})),
        }
        return;
    }
    let before = content.as_str().unwrap_or_default();
    *content = json!(format!("{before}{text}"));
}

/// The engine request id (`x-request-id`) of a segment after the first: a new engine request,
/// so not the id of the aborted one, which the engine may still be aborting (vLLM refuses an id
/// it runs, and an abort in flight can hit the newcomer that reuses it).
pub fn segment_id(id: &HeaderValue, segment: u32) -> Option<HeaderValue> {
    let id = id.to_str().ok()?;
    HeaderValue::from_str(&format!("{id}.resume-{segment}")).ok()
}

/// Follows a stream across its segments, event by event ([`sse`]): collects the generated text
/// (for the continuation), and rewrites every segment after the first as the continuation of
/// the first. The client gets whole events only: an event still arriving is held back until its
/// empty line comes, so a stream preempted mid-event leaves the client no half event for the
/// next segment's first line to join (such a join broke the client's SDK, and both meters lost
/// its tokens). The held-back half is dropped; the continuation, which never carried its text,
/// generates it again.
pub struct Splice {
    encoding: Encoding,
    /// The start of an event not complete yet, held back from the client.
    partial: Vec<u8>,
    /// The chunk id and creation time of the first chunk the client got.
    id: Option<Value>,
    created: Option<Value>,
    text: String,
    /// Which segment is streaming (0: the first).
    segment: u32,
    /// Output tokens generated before the current segment (weir's count: those streams were
    /// aborted before their usage chunk).
    before: u64,
    /// Prompt tokens the current segment's prompt has beyond the original: the generated text
    /// counted with the pool's tokenizer, at most the tokens generated (a tokenizer that splits
    /// the text finer than the engine must not bill less than the engine reported).
    prompt_extra: u64,
    /// It streamed something a continuation would not reproduce (reasoning, tool calls), or
    /// the end of its answer (a finish reason, usage, `[DONE]`): there is nothing to go on
    /// with, and a continuation would stream after the client's end of stream.
    unresumable: bool,
}

impl Splice {
    pub fn new(encoding: Encoding) -> Self {
        Splice {
            encoding,
            partial: Vec::new(),
            id: None,
            created: None,
            text: String::new(),
            segment: 0,
            before: 0,
            prompt_extra: 0,
            unresumable: false,
        }
    }

    /// Whether the stream can be continued now: nothing unresumable streamed (an event held
    /// back is not the client's: the continuation generates it again).
    pub fn resumable(&self) -> bool {
        !self.unresumable
    }

    /// Which segment is streaming (0: the first).
    pub fn segment(&self) -> u32 {
        self.segment
    }

    /// The text generated so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The next segment starts, `before` output tokens having been generated.
    pub fn next_segment(&mut self, before: u64) {
        self.segment += 1;
        self.before = before;
        // Neither the client's nor in the text: the continuation generates it again.
        self.partial.clear();
        self.prompt_extra = self
            .encoding
            .encode(&self.text)
            .map_or(before, |ids| ids.len() as u64)
            .min(before);
    }

    /// Reads a chunk of the current segment; returns the events it completes, as the client
    /// gets them: as they came in the first segment, rewritten in later ones.
    pub fn feed(&mut self, chunk: &[u8]) -> Bytes {
        let mut buf = std::mem::take(&mut self.partial);
        buf.extend_from_slice(chunk);
        let mut out = Vec::with_capacity(buf.len());
        let mut at = 0;
        while let Some(len) = buf.get(at..).and_then(sse::event_end) {
            self.event(buf.get(at..at + len).unwrap_or_default(), &mut out);
            at += len;
        }
        self.partial = buf.get(at..).unwrap_or_default().to_vec();
        if self.partial.len() > MAX_HELD_BYTES {
            // No end in sight: passed on unread, as the meters do; the client then has a half
            // event no continuation could complete.
            self.unresumable = true;
            out.append(&mut self.partial);
        }
        Bytes::from(out)
    }

    /// What the client still lacks when a segment's stream ends: its last event, if the engine
    /// left it unended.
    pub fn flush(&mut self) -> Bytes {
        let rest = std::mem::take(&mut self.partial);
        let mut out = Vec::with_capacity(rest.len() + 2);
        if !rest.is_empty() {
            self.event(&rest, &mut out);
        }
        Bytes::from(out)
    }

    /// Reads one event and adds it to `out` as the client gets it (rewritten in a later
    /// segment), ended so that it reads as whole by itself: an LF goes after one that ends at a
    /// lone CR (read as ended only once the next byte shows it is no CRLF), and line endings
    /// after one the engine left unended (its stream's last). The client's parser and the
    /// meters then see it end where the splice did.
    fn event(&mut self, event: &[u8], out: &mut Vec<u8>) {
        let start = out.len();
        match self.read(event) {
            Some(rewritten) => out.extend(rewritten),
            None => out.extend_from_slice(event),
        }
        // Two at most: the first may complete a CRLF.
        for _ in 0..2 {
            if out.get(start..).and_then(sse::event_end).is_some() {
                break;
            }
            out.push(b'\n');
        }
    }

    /// Reads an event: the text it generated, whether the stream could go on after it, and
    /// the name the client's first chunk gives the stream; in a later segment returns it
    /// rewritten.
    fn read(&mut self, event: &[u8]) -> Option<Vec<u8>> {
        let data = sse::event_data(event)?;
        let data = std::str::from_utf8(&data).ok()?.trim();
        if data == "[DONE]" {
            self.unresumable = true;
            return None;
        }
        let mut chunk: Value = serde_json::from_str(data).ok()?;
        // The last usage chunk (continuous usage stats ride on chunks with choices).
        if !chunk["usage"].is_null() && chunk["choices"].as_array().is_none_or(Vec::is_empty) {
            self.unresumable = true;
        }
        for choice in chunk["choices"].as_array().into_iter().flatten() {
            let delta = &choice["delta"];
            if !delta["tool_calls"].is_null()
                || !delta["reasoning_content"].is_null()
                || !delta["reasoning"].is_null()
                || !choice["finish_reason"].is_null()
            {
                self.unresumable = true;
            }
            let piece = delta["content"].as_str().or(choice["text"].as_str());
            self.text.push_str(piece.unwrap_or_default());
        }
        // The first chunk the client gets, in whichever segment, names the stream: every later
        // one carries its id and creation time, and its role delta is the only one.
        let named = self.id.is_some();
        if !named {
            self.id = Some(chunk["id"].clone());
            self.created = Some(chunk["created"].clone());
        }
        if self.segment == 0 {
            return None;
        }
        let fields = chunk.as_object_mut()?;
        if let Some(id) = &self.id {
            fields.insert("id".into(), id.clone());
        }
        if let Some(created) = &self.created {
            fields.insert("created".into(), created.clone());
        }
        if named {
            let choices = fields.get_mut("choices").and_then(Value::as_array_mut);
            for choice in choices.into_iter().flatten() {
                if let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) {
                    delta.remove("role");
                }
            }
        }
        if let Some(usage) = fields.get_mut("usage").and_then(Value::as_object_mut) {
            self.restate(usage);
        }
        Some(rewritten(event, &serde_json::to_vec(&chunk).ok()?))
    }

    /// A later segment's usage as the whole request's: the original prompt, every token
    /// generated.
    fn restate(&self, usage: &mut Map<String, Value>) {
        let prompt = usage
            .get("prompt_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0)
            .saturating_sub(self.prompt_extra);
        let completion = usage
            .get("completion_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(0)
            + self.before;
        // Cached tokens of the re-prefill are at most the prompt's.
        if let Some(cached) = usage
            .get_mut("prompt_tokens_details")
            .and_then(|d| d.get_mut("cached_tokens"))
            && let Some(n) = cached.as_u64()
        {
            *cached = json!(n.min(prompt));
        }
        usage.insert("prompt_tokens".into(), json!(prompt));
        usage.insert("completion_tokens".into(), json!(completion));
        usage.insert("total_tokens".into(), json!(prompt + completion));
    }
}

/// An event with its data lines replaced by one carrying `data`; its other lines (a name, an
/// id, comments) and its line endings stay as they were.
fn rewritten(event: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(event.len() + data.len());
    let mut written = false;
    for (line, end) in sse::lines(event) {
        if !line.starts_with(b"data:") {
            out.extend_from_slice(line);
        } else if std::mem::replace(&mut written, true) {
            continue;
        } else {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(data);
        }
        out.extend_from_slice(end);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(s: &str) -> Bytes {
        Bytes::from(s.to_owned())
    }

    #[test]
    fn only_plain_single_streams_of_chat_and_completions_resume() {
        let chat = json!({"messages": [], "stream": true});
        assert!(resumable(Endpoint::ChatCompletions, &chat, true));
        assert!(!resumable(Endpoint::ChatCompletions, &chat, false));
        let tools = json!({"messages": [], "tools": [{}]});
        assert!(!resumable(Endpoint::ChatCompletions, &tools, true));
        assert!(!resumable(
            Endpoint::ChatCompletions,
            &json!({"messages": [], "n": 2}),
            true
        ));
        assert!(resumable(
            Endpoint::Completions,
            &json!({"prompt": "a", "logprobs": false}),
            true
        ));
        assert!(!resumable(
            Endpoint::Completions,
            &json!({"prompt": [1, 2]}),
            true
        ));
        assert!(!resumable(
            Endpoint::Responses,
            &json!({"input": "a"}),
            true
        ));
    }

    #[test]
    fn a_chat_left_unframed_by_its_caller_is_not_resumed() {
        // No generation prompt and no final message to continue: the model continues the raw
        // chat; a continuation would open an assistant turn it never had.
        let raw = json!({"messages": [{"role": "user", "content": "hi"}],
                         "add_generation_prompt": false});
        assert!(!resumable(Endpoint::ChatCompletions, &raw, true));
        let prefilled = json!({"messages": [{"role": "assistant", "content": "Sure"}],
                               "add_generation_prompt": false, "continue_final_message": true});
        assert!(resumable(Endpoint::ChatCompletions, &prefilled, true));
    }

    #[test]
    fn a_continuation_carries_the_text_and_lowers_the_limits() {
        let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10});
        let next = continued(Endpoint::ChatCompletions, &chat, " the cache", 2);
        assert_eq!(
            next["messages"][1],
            json!({"role": "assistant", "content": " the cache"})
        );
        assert_eq!(next["max_tokens"], 8);
        assert_eq!(next["continue_final_message"], true);
        assert_eq!(next["add_generation_prompt"], false);
        // Continued again: the same final message grows.
        let again = continued(Endpoint::ChatCompletions, &next, " is", 1);
        assert_eq!(again["messages"].as_array().map(Vec::len), Some(2));
        assert_eq!(again["messages"][1]["content"], " the cache is");
        assert_eq!(again["max_tokens"], 7);
        let completion = json!({"prompt": "Once", "max_tokens": 3});
        let next = continued(Endpoint::Completions, &completion, " upon", 1);
        assert_eq!(next["prompt"], "Once upon");
        assert_eq!(next["max_tokens"], 2);
    }

    #[test]
    fn a_caller_s_own_final_message_in_parts_keeps_its_prefix_and_min_tokens_may_reach_zero() {
        let chat = json!({
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "Sure,"}]},
            ],
            "continue_final_message": true,
            "add_generation_prompt": false,
            "min_tokens": 2,
        });
        let next = continued(Endpoint::ChatCompletions, &chat, " here", 3);
        assert_eq!(next["messages"].as_array().map(Vec::len), Some(2));
        assert_eq!(
            next["messages"][1]["content"],
            json!([{"type": "text", "text": "Sure, here"}]),
            "the caller's prefix stays, the text follows it in the same part"
        );
        assert_eq!(next["min_tokens"], 0, "its minimum was already generated");
    }

    #[test]
    fn a_finished_stream_is_not_resumed_and_one_cut_mid_event_is_without_its_half() {
        let content =
            "data: {\"choices\":[{\"delta\":{\"content\":\" a\"},\"finish_reason\":null}]}\n\n";
        let ends = [
            "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
            "data: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"length\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\n",
            "data: [DONE]\n\n",
        ];
        let continuous_usage = "data: {\"choices\":[{\"delta\":{\"content\":\" c\"}}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n";
        for end in ends {
            let mut s = Splice::new(Encoding::Cl100kBase);
            s.feed(&chunk(content));
            s.feed(&chunk(continuous_usage));
            assert!(s.resumable(), "mid-answer it can go on");
            s.feed(&chunk(end));
            assert!(!s.resumable(), "{end}");
        }
        // Half an event, even one whose data line is whole: held back from the client, so the
        // continuation generates it again.
        let mut s = Splice::new(Encoding::Cl100kBase);
        s.feed(&chunk(content));
        for half in [
            "data: {\"choices\":[{\"delta\":{\"content\":\" b",
            "\"}}]}\n",
        ] {
            assert!(s.feed(&chunk(half)).is_empty(), "{half}");
        }
        assert!(s.resumable());
        assert_eq!(s.text(), " a");
    }

    #[test]
    fn an_event_too_large_to_hold_passes_unread_and_the_stream_runs_on() {
        let mut s = Splice::new(Encoding::Cl100kBase);
        let huge = format!("data: {}", "x".repeat(MAX_HELD_BYTES));
        assert_eq!(s.feed(&chunk(&huge)), huge, "not hoarded");
        assert!(!s.resumable(), "the client has half an event");
    }

    #[test]
    fn every_event_reaches_the_client_ended_by_itself() {
        let mut s = Splice::new(Encoding::Cl100kBase);
        // A lone CR ends an event only once the next byte shows it is no CRLF's.
        assert!(s.feed(&chunk("data: {\"choices\":[]}\r\r")).is_empty());
        assert_eq!(
            s.feed(&chunk("data: [DONE]")),
            "data: {\"choices\":[]}\r\r\n",
            "an LF after it: it reads as ended by itself"
        );
        assert_eq!(s.flush(), "data: [DONE]\n\n", "the engine left it unended");
        assert!(!s.resumable());
    }

    #[test]
    fn the_prompt_is_restated_less_no_more_than_the_tokens_generated() {
        // Generated text the pool's tokenizer splits finer than the engine did: 40 emoji
        // streamed as 40 tokens, more for cl100k. Taking the tokenizer's count off the engine's
        // prompt would bill less than the engine reported for the last segment alone.
        let mut s = Splice::new(Encoding::Cl100kBase);
        let piece = "data: {\"choices\":[{\"delta\":{\"content\":\"\u{1F600}\"}}]}\n\n";
        for _ in 0..40 {
            s.feed(&chunk(piece));
        }
        let counted = Encoding::Cl100kBase.encode(s.text()).map(|t| t.len());
        s.next_segment(40);
        let usage = s.feed(&chunk(
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":140,\"completion_tokens\":5,\"total_tokens\":145}}\n\n",
        ));
        let text = std::str::from_utf8(&usage).unwrap();
        println!("tokenizer count {counted:?} for 40 generated; restated {text}");
        assert!(counted.is_ok_and(|n| n > 40));
        assert!(
            text.contains("\"prompt_tokens\":100") && text.contains("\"total_tokens\":145"),
            "{text}"
        );
    }

    #[test]
    fn each_segment_is_its_own_engine_request() {
        let id = HeaderValue::from_static("trace.att-1");
        let ids: Vec<_> = (1..=2).filter_map(|n| segment_id(&id, n)).collect();
        assert_eq!(ids, ["trace.att-1.resume-1", "trace.att-1.resume-2"]);
    }

    #[test]
    fn later_segments_read_as_the_first() {
        let mut s = Splice::new(Encoding::Cl100kBase);
        let first = chunk(
            "data: {\"id\":\"chatcmpl-1\",\"created\":7,\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\" the\"}}]}\n\n",
        );
        assert_eq!(s.feed(&first), first, "the first segment passes as it came");
        // Split across chunks: held back until it is whole.
        let head = "data: {\"id\":\"chatcmpl-1\",\"cre";
        assert!(s.feed(&chunk(head)).is_empty());
        let tail = "ated\":7,\"choices\":[{\"delta\":{\"content\":\" cache\"}}]}\n\n";
        assert_eq!(s.feed(&chunk(tail)), format!("{head}{tail}"));
        assert_eq!(s.text(), " the cache");
        s.next_segment(2);
        let out = s.feed(&chunk(
            "data: {\"id\":\"chatcmpl-2\",\"created\":9,\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\" is\"}}]}\n\n",
        ));
        let line = std::str::from_utf8(&out).unwrap();
        let event: Value =
            serde_json::from_str(line.trim().strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(event["id"], "chatcmpl-1");
        assert_eq!(event["created"], 7);
        assert_eq!(event["choices"][0]["delta"], json!({"content": " is"}));
        assert!(line.ends_with("\n\n"));
        let usage = s.feed(&chunk(
            "data: {\"id\":\"chatcmpl-2\",\"created\":9,\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":1,\"total_tokens\":13,\"prompt_tokens_details\":{\"cached_tokens\":12}}}\n\ndata: [DONE]\n\n",
        ));
        let text = std::str::from_utf8(&usage).unwrap();
        assert!(
            text.contains("\"prompt_tokens\":10") && text.contains("\"completion_tokens\":3"),
            "{text}"
        );
        assert!(text.contains("\"total_tokens\":13"));
        assert!(text.contains("\"cached_tokens\":10"), "{text}");
        assert!(text.ends_with("data: [DONE]\n\n"));
        let mut tools = Splice::new(Encoding::Cl100kBase);
        assert!(tools.resumable());
        tools.feed(&chunk(
            "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{}]}}]}\n\n",
        ));
        assert!(!tools.resumable());
    }
}
