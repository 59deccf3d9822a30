//! Reading an event (or a body) too large to hold, as its bytes pass. A Responses stream
//! repeats the request's `instructions` and `tools` in `response.created` and
//! `response.completed`, so one event can be as large as the request, and the usage is in it.
//!
//! The scan follows the JSON's nesting and strings byte by byte and keeps only the members the
//! APIs' readers need of an event: its `type`, `usage`, `error` and `status`, and the `usage`
//! of its `response` (Responses) or `message` (a Messages `message_start`), at most
//! [`MAX_KEPT_BYTES`] of them. What it keeps is a small JSON object, read by the same per-API
//! reader as an event held whole ([`super::observe`]), so the two never disagree on what a
//! field means; a member repeated is kept twice, and refused there as in a whole event. A
//! non-streamed body past its meter's bound is read the same way, for its usage.
//!
//! It checks the JSON's structure (nesting, strings and their escapes, separators), not the
//! numbers, literals and UTF-8 of what it skips: serde checks what it keeps. Generated text in
//! such an event is not counted (deltas are a few tokens each; the events that outgrow the
//! bound are those repeating the request), and a usage-only event that large is not hidden
//! (its start was forwarded before its end said what it was).

use super::{Observed, observe};
use crate::endpoint::Endpoint;

/// Most bytes kept of one event or body: past it the event is not read (a usage object is a
/// few hundred bytes).
pub const MAX_KEPT_BYTES: usize = 16 * 1024;

/// Deeper nesting fails the scan (it is what bounds the stack of open containers). serde_json
/// refuses it in what it reads but skips it in members it ignores; no API's event nests so deep.
const MAX_DEPTH: u32 = 128;

/// Longest key compared with those kept (room for one spelled in `\u` escapes).
const MAX_KEY_BYTES: usize = 64;

/// Top-level members kept whole (a Responses body's `status` says whether it failed).
const KEPT: [&str; 4] = ["type", "usage", "error", "status"];
/// Top-level members kept as an object of only their own [`KEPT_INSIDE`] members.
const OPENED: [&str; 2] = ["response", "message"];
const KEPT_INSIDE: [&str; 1] = ["usage"];

/// What may come next, between tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Expect {
    /// The document, a member's value, an array's next element.
    #[default]
    Value,
    /// An array's first element or its end.
    ValueOrEnd,
    Key,
    /// An object's first key or its end.
    KeyOrEnd,
    Colon,
    /// A comma or the container's end, after a value.
    Next,
    /// Only whitespace, after the document.
    Nothing,
}

/// The token being read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Lex {
    #[default]
    Between,
    /// A string (a key when `key`).
    Str { key: bool, escape: Escape },
    /// A number or a literal.
    Scalar,
}

/// Where a string is in an escape.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Escape {
    #[default]
    None,
    /// Just past the backslash.
    Started,
    /// Hex digits of a `\u` escape still to come.
    Hex(u8),
}

/// What becomes of the member whose value comes next.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Member {
    #[default]
    Skipped,
    Kept(&'static str),
    Opened(&'static str),
}

/// A JSON document read as it passes, keeping the members an API's reader needs of it.
#[derive(Debug, Default)]
pub(super) struct Skeleton {
    /// Containers open, and which of them are objects (bit `i` for the one at depth `i + 1`).
    depth: u32,
    objects: u128,
    expect: Expect,
    lex: Lex,
    key: Key,
    member: Member,
    /// The depth of the member whose value is being kept.
    keeping: Option<u32>,
    /// The object at depth 2 is an opened member's.
    opened: bool,
    /// A member was written in the kept top-level object, in the opened one.
    written: [bool; 2],
    kept: Vec<u8>,
    failed: bool,
}

impl Skeleton {
    pub(super) fn feed(&mut self, bytes: &[u8]) {
        let mut rest = bytes;
        while !rest.is_empty() && !self.failed {
            let used = self.step(rest);
            rest = rest.get(used..).unwrap_or_default();
        }
    }

    /// What the document says, read by `endpoint`'s reader from what was kept; `None` unless
    /// it is one whole JSON object.
    pub(super) fn observed(&self, endpoint: Endpoint) -> Option<Observed> {
        if self.failed || self.expect != Expect::Nothing {
            return None;
        }
        observe(endpoint, &self.kept)
    }

    /// Bytes held: at most [`MAX_KEPT_BYTES`].
    pub(super) fn held_bytes(&self) -> usize {
        self.kept.capacity()
    }

    /// Reads from the start of `bytes`; returns how many it used (none when a number or
    /// literal ended: the byte after it is read next).
    fn step(&mut self, bytes: &[u8]) -> usize {
        match self.lex {
            Lex::Str { key, escape } => self.string(bytes, key, escape),
            Lex::Scalar => {
                let len = (bytes.iter())
                    .take_while(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
                    .count();
                self.keep(bytes.get(..len).unwrap_or_default());
                if len < bytes.len() {
                    self.lex = Lex::Between;
                    self.value_ended();
                }
                len
            }
            Lex::Between => {
                if let Some(&byte) = bytes.first() {
                    self.token(byte);
                }
                1
            }
        }
    }

    /// Reads on in a string: up to its end or next escape at once, an escape byte by byte.
    fn string(&mut self, bytes: &[u8], key: bool, escape: Escape) -> usize {
        if escape == Escape::None {
            let len = (bytes.iter())
                .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
                .unwrap_or(bytes.len());
            self.text(bytes.get(..len).unwrap_or_default(), key);
            match bytes.get(len) {
                None => {}
                Some(b'"') => {
                    self.keep(b"\"");
                    self.lex = Lex::Between;
                    if key {
                        self.key_ended();
                    } else {
                        self.value_ended();
                    }
                }
                Some(b'\\') => {
                    self.text(b"\\", key);
                    let escape = Escape::Started;
                    self.lex = Lex::Str { key, escape };
                }
                // A control character: not JSON.
                Some(_) => self.failed = true,
            }
            return len + usize::from(len < bytes.len());
        }
        let Some(&byte) = bytes.first() else {
            return 1;
        };
        let escape = match (escape, byte) {
            (Escape::Started, b'u') => Escape::Hex(4),
            (Escape::Started, b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => {
                Escape::None
            }
            (Escape::Hex(n), b) if b.is_ascii_hexdigit() && n > 1 => Escape::Hex(n - 1),
            (Escape::Hex(_), b) if b.is_ascii_hexdigit() => Escape::None,
            _ => {
                self.failed = true;
                return 1;
            }
        };
        self.text(&[byte], key);
        self.lex = Lex::Str { key, escape };
        1
    }

    /// A byte between tokens.
    fn token(&mut self, byte: u8) {
        if matches!(byte, b' ' | b'\t' | b'\n' | b'\r') {
            self.keep(&[byte]);
            return;
        }
        match (self.expect, byte) {
            (Expect::ValueOrEnd | Expect::Next, b']') | (Expect::KeyOrEnd | Expect::Next, b'}') => {
                self.close(byte);
            }
            (
                Expect::Value | Expect::ValueOrEnd,
                b'{' | b'[' | b'"' | b'-' | b'0'..=b'9' | b't' | b'f' | b'n',
            ) => self.value_starts(byte),
            (Expect::Key | Expect::KeyOrEnd, b'"') => {
                self.keep(b"\"");
                self.key = Key::default();
                let escape = Escape::None;
                self.lex = Lex::Str { key: true, escape };
            }
            (Expect::Colon, b':') => {
                self.keep(b":");
                self.expect = Expect::Value;
            }
            (Expect::Next, b',') => {
                self.keep(b",");
                self.expect = if self.in_object() {
                    Expect::Key
                } else {
                    Expect::Value
                };
            }
            _ => self.failed = true,
        }
    }

    /// Whether the innermost open container is an object.
    fn in_object(&self) -> bool {
        let at = self.depth.checked_sub(1);
        at.and_then(|i| self.objects.checked_shr(i))
            .is_some_and(|bits| bits & 1 == 1)
    }

    /// A key has been read: what becomes of its member.
    fn key_ended(&mut self) {
        self.expect = Expect::Colon;
        let (kept, opened): (&[&'static str], &[&'static str]) = match self.depth {
            1 => (&KEPT, &OPENED),
            2 if self.opened => (&KEPT_INSIDE, &[]),
            _ => {
                self.member = Member::Skipped;
                return;
            }
        };
        let raw = self.key.bytes();
        // A key spelled with escapes is compared as serde reads it.
        let unescaped = raw
            .filter(|k| k.contains(&b'\\'))
            .and_then(|k| serde_json::from_slice::<String>(&[b"\"", k, b"\""].concat()).ok());
        let key = unescaped.as_ref().map(String::as_bytes).or(raw);
        let named = |names: &[&'static str]| {
            (names.iter().copied()).find(|name| key == Some(name.as_bytes()))
        };
        self.member = match (named(kept), named(opened)) {
            (Some(name), _) => Member::Kept(name),
            (None, Some(name)) => Member::Opened(name),
            (None, None) => Member::Skipped,
        };
    }

    fn value_starts(&mut self, byte: u8) {
        let member = std::mem::take(&mut self.member);
        if self.depth == 0 {
            if byte != b'{' {
                // Only an object is read.
                self.failed = true;
                return;
            }
            self.write(b"{");
        }
        match member {
            Member::Opened(name) if byte == b'{' => {
                self.write_name(name);
                self.write(b"{");
                self.opened = true;
                self.written[1] = false;
            }
            // Not an object (`null`, or not what the reader expects): kept as it is.
            Member::Kept(name) | Member::Opened(name) => {
                self.write_name(name);
                self.keeping = Some(self.depth);
            }
            Member::Skipped => {}
        }
        self.keep(&[byte]);
        match byte {
            b'{' => self.open(true),
            b'[' => self.open(false),
            b'"' => {
                let escape = Escape::None;
                self.lex = Lex::Str { key: false, escape };
            }
            _ => self.lex = Lex::Scalar,
        }
    }

    fn open(&mut self, object: bool) {
        if self.depth >= MAX_DEPTH {
            self.failed = true;
            return;
        }
        let bit = 1u128 << self.depth;
        if object {
            self.objects |= bit;
        } else {
            self.objects &= !bit;
        }
        self.depth += 1;
        self.expect = if object {
            Expect::KeyOrEnd
        } else {
            Expect::ValueOrEnd
        };
    }

    fn close(&mut self, byte: u8) {
        if self.in_object() != (byte == b'}') {
            self.failed = true;
            return;
        }
        self.keep(&[byte]);
        self.depth = self.depth.saturating_sub(1);
        if self.keeping.is_none() {
            match self.depth {
                0 => self.write(b"}"),
                1 if self.opened => {
                    self.write(b"}");
                    self.opened = false;
                }
                _ => {}
            }
        }
        self.value_ended();
    }

    fn value_ended(&mut self) {
        if self.keeping == Some(self.depth) {
            self.keeping = None;
        }
        self.expect = if self.depth == 0 {
            Expect::Nothing
        } else {
            Expect::Next
        };
    }

    /// A string's bytes: kept if its value is, and remembered if it is a key.
    fn text(&mut self, bytes: &[u8], key: bool) {
        self.keep(bytes);
        if key {
            self.key.push(bytes);
        }
    }

    /// Writes a kept member's name (at depth 1 or 2).
    fn write_name(&mut self, name: &str) {
        let level = usize::from(self.depth > 1);
        if let Some(written) = self.written.get_mut(level)
            && std::mem::replace(written, true)
        {
            self.write(b",");
        }
        self.write(b"\"");
        self.write(name.as_bytes());
        self.write(b"\":");
    }

    /// Bytes of a value being kept.
    fn keep(&mut self, bytes: &[u8]) {
        if self.keeping.is_some() {
            self.write(bytes);
        }
    }

    /// Adds to what is kept, failing the scan past [`MAX_KEPT_BYTES`] (never held beyond it).
    fn write(&mut self, bytes: &[u8]) {
        let len = self.kept.len() + bytes.len();
        if len > MAX_KEPT_BYTES {
            self.failed = true;
            return;
        }
        if len > self.kept.capacity() {
            let grown = (2 * self.kept.capacity()).max(len).max(64);
            let grown = grown.min(MAX_KEPT_BYTES);
            self.kept
                .reserve_exact(grown.saturating_sub(self.kept.len()));
        }
        self.kept.extend_from_slice(bytes);
    }
}

/// The key being read, as far as it fits.
#[derive(Debug)]
struct Key {
    bytes: [u8; MAX_KEY_BYTES],
    /// Past the buffer when the key is longer.
    len: usize,
}

impl Default for Key {
    fn default() -> Self {
        Key {
            bytes: [0; MAX_KEY_BYTES],
            len: 0,
        }
    }
}

impl Key {
    fn push(&mut self, bytes: &[u8]) {
        let end = self.len.saturating_add(bytes.len());
        if let Some(slot) = self.bytes.get_mut(self.len..end) {
            slot.copy_from_slice(bytes);
        }
        self.len = end;
    }

    /// The key; `None` when longer than any kept.
    fn bytes(&self) -> Option<&[u8]> {
        self.bytes.get(..self.len)
    }
}

/// An event too large to hold, read as it passes: its `data:` lines through a [`Skeleton`]
/// (joined by line breaks, as [`crate::sse::event_data`] joins them), its end where
/// [`crate::sse::event_end`] finds it: lines end at CRLF, LF or a lone CR, the event at an
/// empty line.
#[derive(Debug, Default)]
pub(super) struct EventScan {
    data: Skeleton,
    line: Line,
    /// Bytes of the line under way: an empty line ends the event.
    line_len: usize,
    /// The last byte read was a CR ending a line: an LF next belongs to that line ending.
    after_cr: bool,
    /// And that line was empty: the event ends after the CR, or after the LF if one follows.
    ending: bool,
}

/// Where the scan is in one of the event's lines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Line {
    /// At its start, this many bytes of `data:` matched.
    Start(usize),
    Data,
    Other,
}

impl Default for Line {
    fn default() -> Self {
        Line::Start(0)
    }
}

impl EventScan {
    /// Reads the next bytes of the event; returns its end in them (just past its empty line)
    /// once it has come.
    pub(super) fn feed(&mut self, bytes: &[u8]) -> Option<usize> {
        let mut at = 0;
        if self.after_cr {
            let first = *bytes.first()?;
            self.after_cr = false;
            at = usize::from(first == b'\n');
            if self.ending {
                return Some(at);
            }
        }
        loop {
            let rest = bytes.get(at..)?;
            let Some(i) = rest.iter().position(|&b| b == b'\n' || b == b'\r') else {
                self.line_part(rest);
                return None;
            };
            self.line_part(rest.get(..i)?);
            let empty = self.line_len == 0;
            if self.line == Line::Data {
                self.data.feed(b"\n");
            }
            (self.line, self.line_len) = (Line::Start(0), 0);
            at += i + 1;
            if rest.get(i) == Some(&b'\r') {
                match bytes.get(at) {
                    Some(b'\n') => at += 1,
                    Some(_) => {}
                    None => {
                        (self.after_cr, self.ending) = (true, empty);
                        return None;
                    }
                }
            }
            if empty {
                return Some(at);
            }
        }
    }

    /// What the event says (see [`Skeleton::observed`]).
    pub(super) fn observed(&self, endpoint: Endpoint) -> Option<Observed> {
        self.data.observed(endpoint)
    }

    /// Bytes held.
    pub(super) fn held_bytes(&self) -> usize {
        self.data.held_bytes()
    }

    /// Some of a line's bytes (not its line break).
    fn line_part(&mut self, part: &[u8]) {
        const DATA: &[u8] = b"data:";
        match self.line {
            Line::Data => self.data.feed(part),
            Line::Other => {}
            Line::Start(matched) => {
                let want = DATA.get(matched..).unwrap_or_default();
                let n = want.len().min(part.len());
                if part.get(..n) != want.get(..n) {
                    self.line = Line::Other;
                } else if n == want.len() {
                    self.line = Line::Data;
                    self.data.feed(part.get(n..).unwrap_or_default());
                } else {
                    self.line = Line::Start(matched + n);
                }
            }
        }
        self.line_len += part.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meter::Reported;
    use crate::sse::event_end;

    /// What the scan must read as a whole event's reader does.
    fn read(seen: Option<Observed>) -> Option<(Option<Reported>, bool, bool, bool)> {
        seen.map(|o| (o.usage, o.terminal, o.error, o.provisional_output))
    }

    fn scanned(endpoint: Endpoint, data: &[u8], piece: usize) -> Option<Observed> {
        let mut scan = Skeleton::default();
        for piece in data.chunks(piece) {
            scan.feed(piece);
        }
        scan.observed(endpoint)
    }

    /// Events and bodies of every API, with what makes a scan go wrong: escaped quotes and
    /// braces in strings, `usage` and `type` keys nested deeper than the kept ones, keys
    /// spelled with escapes, repeated members.
    const SAMPLES: [(Endpoint, &str); 18] = [
        (
            Endpoint::Responses,
            r#"{"type":"response.created","sequence_number":0,"response":{"instructions":"say \"{usage}\" \\ {\"usage\":{\"input_tokens\":9}}","tools":[{"type":"function","parameters":{"properties":{"usage":{"type":"object"},"type":{"enum":["response.completed"]}}}}],"status":"in_progress","usage":null}}"#,
        ),
        (
            Endpoint::Responses,
            r#"{"type":"response.completed","response":{"tools":[[{"usage":{"input_tokens":1}}]],"usage":{"input_tokens":12,"input_tokens_details":{"cached_tokens":4},"output_tokens":7,"total_tokens":19},"status":"completed"}}"#,
        ),
        (
            Endpoint::Responses,
            r#"{"type":"response.output_text.delta","delta":" the \"model\"","output_index":0}"#,
        ),
        (
            Endpoint::Responses,
            r#"{"type":"response.failed","response":{"status":"failed","error":{"code":"server_error"},"usage":{"input_tokens":3,"output_tokens":0}}}"#,
        ),
        (
            Endpoint::Responses,
            r#"{"type":"error","code":"x","message":"m","sequence_number":2}"#,
        ),
        (
            Endpoint::Responses,
            r#"{"object":"response","status":"failed","output":[],"instructions":"{\"usage\":1}","usage":{"input_tokens":9,"output_tokens":1}}"#,
        ),
        (
            Endpoint::Messages,
            r#"{"type":"message_start","message":{"id":"m","content":[{"type":"text","text":"{\"usage\":{}}"}],"usage":{"input_tokens":3,"cache_read_input_tokens":8,"output_tokens":1}}}"#,
        ),
        (
            Endpoint::Messages,
            r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","usage":{"output_tokens":99}},"usage":{"output_tokens":5}}"#,
        ),
        (Endpoint::Messages, r#"{"type":"message_stop"}"#),
        (
            Endpoint::Messages,
            r#"{"type":"error","error":{"type":"overloaded_error","message":"x"}}"#,
        ),
        (
            Endpoint::Messages,
            r#"{"type":"message","content":[{"type":"tool_use","name":"f","input":{"usage":{"input_tokens":1}}}],"usage":{"input_tokens":4,"cache_creation_input_tokens":2,"output_tokens":6}}"#,
        ),
        (
            Endpoint::ChatCompletions,
            r#"{"id":"c","choices":[],"usage":{"prompt_tokens":16,"completion_tokens":16,"prompt_tokens_details":{"cached_tokens":3}}}"#,
        ),
        (
            Endpoint::ChatCompletions,
            r#"{"id":"c","choices":[{"index":0,"delta":{"content":"}\"usage\":{"},"finish_reason":null}],"usage":null}"#,
        ),
        (
            Endpoint::ChatCompletions,
            r#"{"error":{"message":"replica lost","usage":{"prompt_tokens":1}}}"#,
        ),
        (
            Endpoint::Completions,
            "{\"choices\":[{\"text\":\"\\u00e9t\\u00e9 \\ud83d\\ude00\"}],\r\n \"usage\": {\"prompt_tokens\": 5, \"completion_tokens\": 2}}\n",
        ),
        (
            Endpoint::Embeddings,
            r#"{"object":"list","data":[{"embedding":[0.1,-2e-3,1E+2]}],"us\u0061ge":{"prompt_tokens":8,"total_tokens":8}}"#,
        ),
        (
            Endpoint::ChatCompletions,
            r#"{"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":2}}"#,
        ),
        (
            Endpoint::Responses,
            r#"{"type":"response.completed","response":{"usage":{"input_tokens":1}},"response":{"usage":{"input_tokens":2}}}"#,
        ),
    ];

    #[test]
    fn what_the_scan_keeps_reads_as_the_whole_event_reads_however_it_is_cut() {
        let mut read_by_serde = 0;
        for (endpoint, data) in SAMPLES {
            let whole = read(observe(endpoint, data.as_bytes()));
            read_by_serde += usize::from(whole.is_some());
            for piece in [1, 2, 3, 7, data.len()] {
                assert_eq!(
                    read(scanned(endpoint, data.as_bytes(), piece)),
                    whole,
                    "{endpoint:?} in pieces of {piece}: {data}"
                );
            }
        }
        // The chat sample repeating `usage` is refused both ways (the Responses one repeating
        // `response` is read as a body without usage, both ways).
        assert_eq!(read_by_serde, SAMPLES.len() - 1);
    }

    /// Every one-byte insertion, replacement and deletion of every sample: wherever the whole
    /// event's reader still reads it, the scan reads the same.
    #[test]
    fn every_one_byte_edit_the_reader_reads_is_scanned_alike() {
        const BYTES: &[u8] = b",\"\\{}[]: n0-.eu\x01\x7f";
        let mut read = 0;
        for (endpoint, data) in SAMPLES.map(|(e, d)| (e, d.as_bytes())) {
            let mut edits = Vec::new();
            for at in 0..=data.len() {
                for &byte in BYTES {
                    let mut inserted = data.to_vec();
                    inserted.insert(at, byte);
                    edits.push(inserted);
                    if at < data.len() {
                        let mut replaced = data.to_vec();
                        replaced[at] = byte;
                        edits.push(replaced);
                    }
                }
                if at < data.len() {
                    let mut removed = data.to_vec();
                    removed.remove(at);
                    edits.push(removed);
                }
            }
            for edit in edits {
                let whole = self::read(observe(endpoint, &edit));
                if whole.is_some() {
                    read += 1;
                    assert_eq!(
                        self::read(scanned(endpoint, &edit, 5)),
                        whole,
                        "{endpoint:?}: {}",
                        String::from_utf8_lossy(&edit)
                    );
                }
            }
        }
        assert!(read > 10_000, "{read}");
    }

    #[test]
    fn the_scan_ends_an_event_where_event_end_does_however_it_is_cut() {
        let alphabet = [b'\r', b'\n', b'a'];
        for len in 0..=8u32 {
            for n in 0..3usize.pow(len) {
                let buf: Vec<u8> = (0..len).map(|i| alphabet[n / 3usize.pow(i) % 3]).collect();
                for cut in 0..=buf.len() {
                    let mut scan = EventScan::default();
                    let (a, b) = buf.split_at(cut);
                    let end = (scan.feed(a)).or_else(|| scan.feed(b).map(|end| end + cut));
                    assert_eq!(end, event_end(&buf), "{buf:?} cut at {cut}");
                }
            }
        }
    }

    #[test]
    fn an_events_data_lines_are_scanned_as_they_are_joined() {
        let event = "event: x\r\n: comment\r\ndat\r\ndata:{\"type\":\"message_delta\",\r\ndata:\r\ndata: \"usage\":{\"output_tokens\":5}}\r\nid: 1\r\n\r\ndata: next";
        for piece in 1..event.len() {
            let mut scan = EventScan::default();
            let mut end = None;
            for (i, part) in event.as_bytes().chunks(piece).enumerate() {
                if let Some(e) = scan.feed(part) {
                    end = Some(i * piece + e);
                    break;
                }
            }
            assert_eq!(end, event.find("data: next"), "pieces of {piece}");
            let seen = scan.observed(Endpoint::Messages);
            let usage = seen.and_then(|s| s.usage).and_then(|u| u.output_tokens);
            assert_eq!(usage, Some(5), "pieces of {piece}");
        }
    }

    #[test]
    fn what_is_kept_is_bounded_and_past_the_bound_nothing_is_read() {
        // Members not kept cost nothing, however large.
        let big = format!(
            r#"{{"tools":[{}],"instructions":"{}","usage":{{"prompt_tokens":1}}}}"#,
            r#"{"a":[1,{"usage":"x"}]},"#.repeat(50_000) + "0",
            "x\\\"".repeat(200_000)
        );
        let mut scan = Skeleton::default();
        scan.feed(big.as_bytes());
        assert!(scan.held_bytes() < 256, "{}", scan.held_bytes());
        let seen = scan.observed(Endpoint::ChatCompletions);
        assert_eq!(
            seen.and_then(|s| s.usage?.usage()).map(|u| u.prompt_tokens),
            Some(1)
        );
        // A kept member past the bound: the document is not read, and no more is held.
        let huge = format!(r#"{{"error":"{}"}}"#, "x".repeat(MAX_KEPT_BYTES));
        let mut scan = Skeleton::default();
        scan.feed(huge.as_bytes());
        assert!(scan.held_bytes() <= MAX_KEPT_BYTES);
        assert!(scan.observed(Endpoint::ChatCompletions).is_none());
        // Nesting past the bound is not read; up to it, it is.
        let nested = |depth: usize| {
            let inner = "[".repeat(depth - 1) + &"]".repeat(depth - 1);
            format!("{{\"a\":{inner},\"usage\":{{\"prompt_tokens\":1}}}}")
        };
        for (depth, read) in [(MAX_DEPTH as usize, true), (MAX_DEPTH as usize + 1, false)] {
            let mut scan = Skeleton::default();
            scan.feed(nested(depth).as_bytes());
            let seen = scan.observed(Endpoint::ChatCompletions);
            assert_eq!(seen.is_some(), read, "{depth}");
        }
    }
}
