//! Prompt token estimation for admission: exact BPE while it is cheap, a fast linear-time
//! estimate above a size threshold so no Envoy worker stalls on a long prompt.
//!
//! The fast estimate mimics the pre-tokenizer of the cl100k/o200k vocabularies: words with
//! their leading space, digits in groups of three, punctuation runs, newlines, and non-ASCII
//! text by character class. Its error against the exact count is measured per kind of text by
//! the tests below and by `cargo xtask bench`; the engine's reported usage replaces it at
//! settlement either way.

use crate::openai::{CompletionRequest, Endpoint, MessageContent, PromptInput};
use crate::tokens::{Encoding, TokenizerUnavailable};

/// Framing tokens per chat message, and for priming the reply (see [`crate::tokens`]).
const PER_MESSAGE: u64 = 3;
const REPLY_PRIMING: u64 = 3;

/// How a count was obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    Exact,
    Fast,
}

impl Method {
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Exact => "exact",
            Method::Fast => "fast",
        }
    }
}

/// Counts a request's prompt tokens: exactly when its text is at most `exact_below_bytes`,
/// otherwise with [`fast_count`].
pub fn prompt_tokens(
    req: &CompletionRequest,
    endpoint: Endpoint,
    encoding: Encoding,
    exact_below_bytes: usize,
) -> Result<(u64, Method), TokenizerUnavailable> {
    let texts = prompt_texts(req, endpoint);
    let bytes: usize = texts.iter().map(|t| t.len()).sum();
    if let (Endpoint::Completions, Some(PromptInput::Tokens(ids))) = (endpoint, &req.prompt) {
        return Ok((ids.len() as u64, Method::Exact));
    }
    if bytes <= exact_below_bytes {
        let n = req.prompt_tokens(endpoint, encoding)?.len() as u64;
        return Ok((n, Method::Exact));
    }
    let framing = match endpoint {
        Endpoint::ChatCompletions => {
            let messages = req.messages.as_ref().map_or(0, Vec::len) as u64;
            messages * PER_MESSAGE + REPLY_PRIMING
        }
        Endpoint::Completions => 0,
    };
    let n = texts.iter().map(|t| fast_count(t)).sum::<u64>() + framing;
    Ok((n, Method::Fast))
}

/// Every piece of prompt text in the request (roles and names included for chat).
fn prompt_texts(req: &CompletionRequest, endpoint: Endpoint) -> Vec<&str> {
    match endpoint {
        Endpoint::ChatCompletions => req
            .messages
            .iter()
            .flatten()
            .flat_map(|m| {
                let content: Vec<&str> = match &m.content {
                    None => Vec::new(),
                    Some(MessageContent::Text(t)) => vec![t.as_str()],
                    Some(MessageContent::Parts(parts)) => {
                        parts.iter().filter_map(|p| p.text.as_deref()).collect()
                    }
                };
                std::iter::once(m.role.as_str())
                    .chain(m.name.as_deref())
                    .chain(content)
            })
            .collect(),
        Endpoint::Completions => match &req.prompt {
            Some(PromptInput::Text(t)) => vec![t.as_str()],
            Some(PromptInput::Batch(b)) => b.iter().map(String::as_str).collect(),
            _ => Vec::new(),
        },
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Digit,
    Space,
    Newline,
    Punct,
    /// Scripts written without spaces (CJK, kana, hangul): about a token per character.
    Ideograph,
    /// Other non-ASCII letters (accented Latin, Cyrillic, Greek, …).
    OtherLetter,
}

fn class(c: char) -> Class {
    match c {
        'a'..='z' | 'A'..='Z' => Class::Letter,
        '0'..='9' => Class::Digit,
        '\n' | '\r' => Class::Newline,
        ' ' | '\t' => Class::Space,
        c if c.is_ascii() => Class::Punct,
        '\u{2E80}'..='\u{9FFF}' | '\u{AC00}'..='\u{D7AF}' | '\u{F900}'..='\u{FAFF}' => {
            Class::Ideograph
        }
        c if c.is_alphabetic() => Class::OtherLetter,
        c if c.is_whitespace() => Class::Space,
        _ => Class::Punct,
    }
}

/// Estimates BPE tokens in one pass without a vocabulary.
pub fn fast_count(text: &str) -> u64 {
    let mut tokens = 0.0f64;
    let mut chars = text.chars().peekable();
    let mut previous = Class::Space;
    while let Some(c) = chars.next() {
        let kind = class(c);
        let mut run = 1u32;
        while chars.peek().is_some_and(|&n| class(n) == kind) {
            chars.next();
            run += 1;
        }
        let run = f64::from(run);
        tokens += match kind {
            // Common words are one token; longer ones split into pieces of about seven letters.
            Class::Letter => 1.0 + ((run - 1.0) / 7.0).floor(),
            Class::Digit => (run / 3.0).ceil(),
            // A single space joins the next word, and indentation joins the newline before it;
            // other runs of spaces become tokens of their own.
            Class::Space if run == 1.0 || previous == Class::Newline => 0.0,
            Class::Space => (run / 8.0).ceil(),
            Class::Newline => 1.0,
            // A lone `_` or `.` inside an identifier merges with its neighbours.
            Class::Punct if run == 1.0 && previous == Class::Letter && matches!(c, '_' | '.') => {
                0.5
            }
            Class::Punct => (run / 2.0).ceil(),
            Class::Ideograph => run * 1.1,
            Class::OtherLetter => run,
        };
        previous = kind;
    }
    tokens.ceil() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Texts of different kinds, and how far the fast estimate may stray from exact on each.
    const SAMPLES: [(&str, &str, f64); 5] = [
        ("english prose", include_str!("../testdata/prose.txt"), 0.10),
        ("rust code", include_str!("bucket.rs"), 0.15),
        ("json", include_str!("../testdata/request.json"), 0.15),
        ("german", include_str!("../testdata/german.txt"), 0.20),
        ("chinese", include_str!("../testdata/chinese.txt"), 0.10),
    ];

    fn relative_error(text: &str) -> f64 {
        let exact = Encoding::Cl100kBase.encode(text).unwrap().len() as f64;
        (fast_count(text) as f64 - exact) / exact
    }

    #[test]
    fn fast_estimate_stays_near_exact_for_each_kind_of_text() {
        for (kind, text, bound) in SAMPLES {
            let err = relative_error(text);
            assert!(
                err.abs() <= bound,
                "{kind}: error {:.1}% exceeds {:.0}%",
                err * 100.0,
                bound * 100.0
            );
        }
    }

    #[test]
    fn fast_estimate_of_nothing_is_nothing() {
        assert_eq!(fast_count(""), 0);
        assert_eq!(fast_count(" "), 0);
        assert_eq!(fast_count("hello"), 1);
    }

    #[test]
    fn threshold_switches_methods_and_keeps_framing() {
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
            include_str!("../testdata/prose.txt")
                .replace('\n', " ")
                .replace('"', "'")
        );
        let req = CompletionRequest::parse(body.as_bytes()).unwrap();
        let (exact, m1) = prompt_tokens(
            &req,
            Endpoint::ChatCompletions,
            Encoding::Cl100kBase,
            usize::MAX,
        )
        .unwrap();
        let (fast, m2) =
            prompt_tokens(&req, Endpoint::ChatCompletions, Encoding::Cl100kBase, 0).unwrap();
        assert_eq!((m1, m2), (Method::Exact, Method::Fast));
        let exact_ids = req
            .prompt_tokens(Endpoint::ChatCompletions, Encoding::Cl100kBase)
            .unwrap();
        assert_eq!(exact, exact_ids.len() as u64);
        assert!(
            (fast as f64 / exact as f64 - 1.0).abs() < 0.15,
            "{fast} vs {exact}"
        );
    }

    #[test]
    fn token_prompts_are_counted_as_given() {
        let req = CompletionRequest::parse(br#"{"model":"m","prompt":[1,2,3,4]}"#).unwrap();
        let n = prompt_tokens(&req, Endpoint::Completions, Encoding::Cl100kBase, 0).unwrap();
        assert_eq!(n, (4, Method::Exact));
    }
}
