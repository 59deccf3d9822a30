//! Prompt token estimation for admission: exact BPE while it is cheap, a fast linear-time
//! estimate above a size threshold so no Envoy worker stalls on a long prompt.
//!
//! The fast estimate mimics the pre-tokenizer of the cl100k/o200k vocabularies: words with
//! their leading space, digits in groups of three, punctuation runs, newlines, and non-ASCII
//! text by character class. Its error against the exact count is measured per kind of text by
//! the tests below and by `cargo xtask bench`; the engine's reported usage replaces it at
//! settlement either way.

use crate::prompt::Prompt;
use crate::request::InferenceRequest;
use crate::tokens::Encoding;

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

/// A prompt's size in tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Estimate {
    /// All of it: what is charged.
    pub tokens: u64,
    /// Its longest sequence: what must fit the model's context (a batch's prompts or embedding
    /// inputs each run on their own).
    pub longest: u64,
    pub method: Method,
}

/// Counts everything the request puts into the prompt ([`InferenceRequest::prompt`]: the
/// messages, and tools, schemas and any other text-bearing field): exactly when that text is at
/// most `exact_below_bytes` (and the tokenizer copes with it), otherwise with [`fast_count`].
pub fn prompt_tokens(
    req: &InferenceRequest,
    encoding: Encoding,
    exact_below_bytes: usize,
) -> Estimate {
    let prompt = req.prompt();
    let bytes: usize = prompt.texts().map(str::len).sum();
    if bytes <= exact_below_bytes
        && let Ok(seqs) = prompt.encode(encoding)
    {
        let lens = seqs.iter().map(|s| s.len() as u64);
        return Estimate {
            tokens: lens.clone().sum(),
            longest: lens.max().unwrap_or(0),
            method: Method::Exact,
        };
    }
    let lens: Vec<u64> = match &prompt {
        Prompt::Chat(turns) => {
            let names = turns.iter().filter(|t| t.name.is_some()).count() as u64;
            let framing = turns.len() as u64 * PER_MESSAGE + names + REPLY_PRIMING;
            vec![prompt.texts().map(fast_count).sum::<u64>() + framing]
        }
        Prompt::Sequences(seqs) => seqs
            .iter()
            .map(|s| s.ids.len() as u64 + s.texts.iter().map(|t| fast_count(t)).sum::<u64>())
            .collect(),
    };
    Estimate {
        tokens: lens.iter().sum(),
        longest: lens.iter().copied().max().unwrap_or(0),
        method: Method::Fast,
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
    use crate::endpoint::Endpoint;

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
        let req = chat(&body);
        let exact = prompt_tokens(&req, Encoding::Cl100kBase, usize::MAX);
        let fast = prompt_tokens(&req, Encoding::Cl100kBase, 0);
        assert_eq!((exact.method, fast.method), (Method::Exact, Method::Fast));
        let exact_ids = req.prompt_tokens(Encoding::Cl100kBase).unwrap();
        assert_eq!(exact.tokens, exact_ids[0].len() as u64);
        let (exact, fast) = (exact.tokens, fast.tokens);
        assert!(
            (fast as f64 / exact as f64 - 1.0).abs() < 0.15,
            "{fast} vs {exact}"
        );
    }

    #[test]
    fn text_the_tokenizer_cannot_handle_is_estimated_instead() {
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"{}x"}}]}}"#,
            " ".repeat(1_000_000)
        );
        let estimate = prompt_tokens(&chat(&body), Encoding::Cl100kBase, usize::MAX);
        assert_eq!(estimate.method, Method::Fast);
        assert!(estimate.tokens > 100_000, "{estimate:?}");
    }

    #[test]
    fn token_prompts_are_counted_as_given() {
        let completion =
            |body: &str| InferenceRequest::parse(Endpoint::Completions, body.as_bytes()).unwrap();
        let n = prompt_tokens(
            &completion(r#"{"model":"m","prompt":[1,2,3,4]}"#),
            Encoding::Cl100kBase,
            0,
        );
        assert_eq!((n.tokens, n.method), (4, Method::Exact));
        let with_suffix = completion(r#"{"model":"m","prompt":[1,2,3,4],"suffix":"the end"}"#);
        let n = prompt_tokens(&with_suffix, Encoding::Cl100kBase, 0);
        assert_eq!(
            (n.tokens, n.method),
            (6, Method::Fast),
            "given ids plus the suffix's words"
        );
        let batch = completion(r#"{"model":"m","prompt":[[1,2,3],[4]]}"#);
        let n = prompt_tokens(&batch, Encoding::Cl100kBase, 0);
        assert_eq!(
            (n.tokens, n.longest),
            (4, 3),
            "the batch is charged, its longest fits"
        );
    }

    fn chat(body: &str) -> InferenceRequest {
        let req = InferenceRequest::parse(Endpoint::ChatCompletions, body.as_bytes()).unwrap();
        req.validate().unwrap();
        req
    }

    fn count(body: &str, exact_below_bytes: usize) -> u64 {
        prompt_tokens(&chat(body), Encoding::Cl100kBase, exact_below_bytes).tokens
    }

    /// A JSON value of about `words` words of prose, shaped like a tool definition.
    fn bulk(words: usize) -> String {
        let prose = "the quick brown fox jumps over the lazy dog ".repeat(words / 9 + 1);
        serde_json::json!({"type": "function", "function": {"name": "lookup",
            "description": prose, "parameters": {"type": "object", "properties": {}}}})
        .to_string()
    }

    #[test]
    fn everything_the_engine_renders_into_the_prompt_is_counted() {
        let hello = r#""messages":[{"role":"user","content":"hi"}]"#;
        let base = count(&format!(r#"{{"model":"m",{hello}}}"#), usize::MAX);
        let tool = bulk(900);
        let schema = format!(r#"{{"type":"json_schema","json_schema":{tool}}}"#);
        let carriers = [
            format!(r#""tools":[{tool}]"#),
            format!(r#""functions":[{tool}]"#),
            format!(r#""tool_choice":{tool}"#),
            format!(r#""response_format":{schema}"#),
            format!(r#""guided_json":{tool}"#),
            format!(r#""guided_grammar":{}"#, serde_json::json!(tool)),
            format!(r#""guided_choice":[{}]"#, serde_json::json!(tool)),
            format!(r#""structured_outputs":{{"json":{tool}}}"#),
            format!(r#""chat_template_kwargs":{{"docs":{tool}}}"#),
            format!(r#""documents":[{tool}]"#),
            format!(r#""an_invented_field":{}"#, serde_json::json!(tool)),
        ];
        for carrier in &carriers {
            let body = format!(r#"{{"model":"m",{hello},{carrier}}}"#);
            for (threshold, method) in [(usize::MAX, "exact"), (0, "fast")] {
                let n = count(&body, threshold);
                assert!(n > base + 900, "{method} {}: {n}", &carrier[..20]);
            }
        }
        let in_messages = [
            format!(
                r#"{{"role":"assistant","content":null,"tool_calls":[{{"id":"c1","type":"function","function":{{"name":"f","arguments":{}}}}}]}}"#,
                serde_json::json!(tool)
            ),
            format!(
                r#"{{"role":"assistant","content":null,"function_call":{{"name":"f","arguments":{}}}}}"#,
                serde_json::json!(tool)
            ),
            format!(
                r#"{{"role":"tool","tool_call_id":"c1","content":{}}}"#,
                serde_json::json!(tool)
            ),
            format!(
                r#"{{"role":"assistant","content":[{{"type":"refusal","refusal":{}}}]}}"#,
                serde_json::json!(tool)
            ),
            format!(r#"{{"role":"user","content":[{{"type":"text","text":"hi","note":{tool}}}]}}"#),
        ];
        for message in &in_messages {
            let body = format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}},{message}]}}"#
            );
            for threshold in [usize::MAX, 0] {
                let n = count(&body, threshold);
                assert!(n > base + 900, "{}: {n}", &message[..30]);
            }
        }
    }

    #[test]
    fn parameters_that_stay_out_of_the_prompt_cost_nothing() {
        let hello = r#""model":"m","messages":[{"role":"user","content":"hi"}]"#;
        let base = count(&format!("{{{hello}}}"), usize::MAX);
        let body = format!(
            r#"{{{hello},"temperature":0.7,"top_p":1,"stop":["\\n"],"user":"u-1","logprobs":true,"seed":3,"max_tokens":5}}"#
        );
        assert_eq!(count(&body, usize::MAX), base);
    }

    #[test]
    fn the_fast_estimate_of_tools_stays_near_exact() {
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"tools":[{}]}}"#,
            bulk(5_000)
        );
        let (exact, fast) = (count(&body, usize::MAX), count(&body, 0));
        assert!(
            (fast as f64 / exact as f64 - 1.0).abs() < 0.15,
            "{fast} vs {exact}"
        );
    }
}
