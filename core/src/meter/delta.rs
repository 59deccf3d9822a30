//! The chat or completions event most of a stream is made of — its choices' deltas of text,
//! no usage, no error — read in one pass over its bytes, at about a third of what the serde
//! reader in [`super::chat`] costs per event (the relay meters every event of every stream).
//!
//! It declines (answers `None`) whatever it does not read exactly as that reader does: escapes,
//! floats, `usage` or `error` set, tool calls, a repeated field, anything not JSON. The serde
//! reader then takes the event, so the two agree wherever this one answers: its fields are
//! that reader's (`Event`, `Choice` and `Generated` there), and a differential test holds them
//! to it.

use super::generated_tokens;

/// Deeper than this is declined (serde's own limit is 128).
const MAX_DEPTH: usize = 16;

/// The output tokens of a plain event's generated text, or `None` to leave it to serde.
pub(super) fn generated(data: &[u8]) -> Option<u64> {
    let mut scan = Scan { bytes: data, at: 0 };
    let mut choices = None;
    let mut usage_or_error = [false; 2];
    scan.object(|scan, key| match key {
        "choices" if choices.is_none() => {
            choices = Some(scan.choices()?);
            Some(())
        }
        "usage" | "error" => {
            // Set, it is not a plain event.
            first(&mut usage_or_error, usize::from(key == "error"))?;
            scan.null()
        }
        "choices" => None,
        _ => scan.skip(1),
    })?;
    scan.space();
    (scan.at == data.len()).then_some(choices?)
}

/// A field's first time; a repeated field is declined (serde refuses the event).
fn first(seen: &mut [bool], field: usize) -> Option<()> {
    let seen = seen.get_mut(field)?;
    (!std::mem::replace(seen, true)).then_some(())
}

struct Scan<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Scan<'a> {
    fn space(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.bytes.get(self.at) {
            self.at += 1;
        }
    }

    /// The next byte past any whitespace.
    fn peek(&mut self) -> Option<u8> {
        self.space();
        self.bytes.get(self.at).copied()
    }

    fn eat(&mut self, byte: u8) -> bool {
        let next = self.peek() == Some(byte);
        self.at += usize::from(next);
        next
    }

    fn expect(&mut self, byte: u8) -> Option<()> {
        self.eat(byte).then_some(())
    }

    /// A string with no escapes and valid UTF-8 (declined otherwise).
    fn str(&mut self) -> Option<&'a str> {
        self.expect(b'"')?;
        let rest = self.bytes.get(self.at..)?;
        let len = rest
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20)?;
        if rest.get(len) != Some(&b'"') {
            return None;
        }
        let text = std::str::from_utf8(rest.get(..len)?).ok()?;
        self.at += len + 1;
        Some(text)
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        self.space();
        let end = self.at + word.len();
        (self.bytes.get(self.at..end)? == word).then(|| self.at = end)
    }

    fn null(&mut self) -> Option<()> {
        self.literal(b"null")
    }

    /// An integer (a fraction or exponent is declined).
    fn integer(&mut self) -> Option<()> {
        self.eat(b'-');
        let digits = self.bytes.get(self.at..)?;
        let len = digits.iter().take_while(|b| b.is_ascii_digit()).count();
        let leading_zero = len > 1 && digits.first() == Some(&b'0');
        if len == 0 || leading_zero || matches!(digits.get(len), Some(b'.' | b'e' | b'E')) {
            return None;
        }
        self.at += len;
        Some(())
    }

    /// An object's members, each key handed to `member` to read its value.
    fn object(&mut self, mut member: impl FnMut(&mut Self, &'a str) -> Option<()>) -> Option<()> {
        self.expect(b'{')?;
        if self.eat(b'}') {
            return Some(());
        }
        loop {
            let key = self.str()?;
            self.expect(b':')?;
            member(self, key)?;
            if !self.eat(b',') {
                return self.expect(b'}');
            }
        }
    }

    /// An array's elements, each read by `element`.
    fn array(&mut self, mut element: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.expect(b'[')?;
        if self.eat(b']') {
            return Some(());
        }
        loop {
            element(self)?;
            if !self.eat(b',') {
                return self.expect(b']');
            }
        }
    }

    /// Any value of a field weir does not read.
    fn skip(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.peek()? {
            b'"' => self.str().map(drop),
            b'{' => self.object(|scan, _| scan.skip(depth + 1)),
            b'[' => self.array(|scan| scan.skip(depth + 1)),
            b'n' => self.null(),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'-' | b'0'..=b'9' => self.integer(),
            _ => None,
        }
    }

    fn choices(&mut self) -> Option<u64> {
        let mut tokens = 0;
        self.array(|scan| {
            tokens += scan.choice()?;
            Some(())
        })?;
        Some(tokens)
    }

    /// One choice: its `delta`, `message` (each `Generated` there) and `text`.
    fn choice(&mut self) -> Option<u64> {
        let mut tokens = 0;
        let mut seen = [false; 3];
        self.object(|scan, key| {
            let field = ["delta", "message", "text"].iter().position(|f| *f == key);
            let Some(field) = field else {
                return scan.skip(2);
            };
            first(&mut seen, field)?;
            tokens += if field == 2 {
                scan.text()?
            } else {
                scan.generated()?
            };
            Some(())
        })?;
        Some(tokens)
    }

    /// A delta or message: its text fields, with no tool or function call.
    fn generated(&mut self) -> Option<u64> {
        if self.peek()? == b'n' {
            return self.null().map(|()| 0);
        }
        const TEXTS: [&str; 4] = ["content", "reasoning_content", "reasoning", "refusal"];
        let mut tokens = 0;
        let mut seen = [false; 6];
        self.object(|scan, key| {
            let field = TEXTS
                .iter()
                .chain(&["tool_calls", "function_call"])
                .position(|f| *f == key);
            let Some(field) = field else {
                return scan.skip(3);
            };
            first(&mut seen, field)?;
            if field < TEXTS.len() {
                tokens += scan.text()?;
                Some(())
            } else {
                scan.null()
            }
        })?;
        Some(tokens)
    }

    /// A text field's tokens (none when null).
    fn text(&mut self) -> Option<u64> {
        if self.peek()? == b'n' {
            return self.null().map(|()| 0);
        }
        self.str().map(|text| generated_tokens([text]))
    }
}
