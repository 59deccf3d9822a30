//! Chat Completions and Completions chunks and bodies (and embeddings bodies, which carry only
//! `usage`): generated text in `choices`, usage in a trailing `"choices": []` chunk or the body,
//! `data: [DONE]` last.

use std::borrow::Cow;

use std::fmt;

use serde::Deserialize;
use serde::de::{Deserializer, SeqAccess, Visitor};

use super::{Observed, Reported, generated_tokens};

/// Text fields are borrowed from the event where they hold no escapes: a stream is read event
/// by event, and most events are one short delta (read first without serde, by
/// [`super::delta`], which must know every field here).
#[derive(Deserialize)]
struct Event {
    #[serde(default)]
    choices: Option<Choices>,
    #[serde(default)]
    usage: Option<Reported>,
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default, borrow)]
    delta: Option<Generated<'a>>,
    #[serde(default, borrow)]
    message: Option<Generated<'a>>,
    /// The completions endpoint's output.
    #[serde(default, borrow)]
    text: Option<Text<'a>>,
}

/// Every field of a message or delta the engine generates, each billed as output: the answer,
/// the reasoning (`reasoning_content` in vLLM until 0.10, `reasoning` after), a refusal, and
/// tool calls (names and arguments), current and legacy.
#[derive(Deserialize)]
struct Generated<'a> {
    #[serde(default, borrow)]
    content: Option<Text<'a>>,
    #[serde(default, borrow)]
    reasoning_content: Option<Text<'a>>,
    #[serde(default, borrow)]
    reasoning: Option<Text<'a>>,
    #[serde(default, borrow)]
    refusal: Option<Text<'a>>,
    #[serde(default, borrow)]
    tool_calls: Option<Vec<ToolCall<'a>>>,
    #[serde(default, borrow)]
    function_call: Option<FunctionCall<'a>>,
}

#[derive(Deserialize)]
struct ToolCall<'a> {
    #[serde(default, borrow)]
    function: Option<FunctionCall<'a>>,
}

#[derive(Deserialize)]
struct FunctionCall<'a> {
    #[serde(default, borrow)]
    name: Option<Text<'a>>,
    #[serde(default, borrow)]
    arguments: Option<Text<'a>>,
}

impl Generated<'_> {
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
        .map(Text::as_str)
        .chain(functions.flat_map(|f| {
            [&f.name, &f.arguments]
                .into_iter()
                .flatten()
                .map(Text::as_str)
        }))
    }
}

impl Choice<'_> {
    /// Every piece of generated text in the choice.
    fn texts(&self) -> impl Iterator<Item = &str> {
        self.delta
            .iter()
            .chain(self.message.iter())
            .flat_map(Generated::texts)
            .chain(self.text.as_ref().map(Text::as_str))
    }
}

/// A generated text field, borrowed from the event unless it holds escapes (serde borrows a
/// bare `Cow<str>` field, never one inside an `Option`).
struct Text<'a>(Cow<'a, str>);

impl Text<'_> {
    fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Str;
        impl<'de> Visitor<'de> for Str {
            type Value = Cow<'de, str>;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }

            fn visit_borrowed_str<E: serde::de::Error>(
                self,
                v: &'de str,
            ) -> Result<Self::Value, E> {
                Ok(Cow::Borrowed(v))
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Cow::Owned(v.to_owned()))
            }

            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Cow::Owned(v))
            }
        }
        deserializer.deserialize_str(Str).map(Text)
    }
}

/// An event's choices, read one by one into what metering needs of them (how many, and the
/// tokens of their generated text) rather than kept as a list: most events are one short delta.
#[derive(Default)]
struct Choices {
    count: usize,
    generated: u64,
}

impl<'de> Deserialize<'de> for Choices {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Each;
        impl<'de> Visitor<'de> for Each {
            type Value = Choices;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of choices")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Choices, A::Error> {
                let mut choices = Choices::default();
                while let Some(choice) = seq.next_element::<Choice<'de>>()? {
                    choices.count += 1;
                    choices.generated += generated_tokens(choice.texts());
                }
                Ok(choices)
            }
        }
        deserializer.deserialize_seq(Each)
    }
}

pub(super) fn observe(data: &[u8]) -> Option<Observed> {
    if data.trim_ascii() == b"[DONE]" {
        return Some(Observed {
            terminal: true,
            ..Observed::default()
        });
    }
    if let Some(generated) = super::delta::generated(data) {
        return Some(Observed {
            answer: true,
            generated,
            ..Observed::default()
        });
    }
    read(data)
}

/// An event (not `[DONE]`) or a body, read by serde.
fn read(data: &[u8]) -> Option<Observed> {
    let event: Event = serde_json::from_slice(data).ok()?;
    let answer = event.choices.is_some() && event.error.is_none();
    let choices = event.choices.unwrap_or_default();
    Some(Observed {
        answer,
        usage_only: event.usage.is_some() && choices.count == 0,
        usage: event.usage,
        generated: choices.generated,
        error: event.error.is_some(),
        terminal: false,
        provisional_output: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::draw::Rng;

    const KEYS: [&str; 17] = [
        "choices",
        "usage",
        "error",
        "delta",
        "message",
        "text",
        "content",
        "reasoning",
        "reasoning_content",
        "refusal",
        "tool_calls",
        "function_call",
        "index",
        "id",
        "finish_reason",
        "cont\\u0065nt",
        "logprobs",
    ];

    const SCALARS: [&str; 26] = [
        "\"\"",
        "\"we\"",
        "\" the\"",
        "\"h\u{e9}llo\"",
        "\"\u{4e2d}\u{6587}\"",
        "\"a\\nb\"",
        "\"\\u0041\"",
        "\"tab\there\"",
        "\"\\\"q\\\"\"",
        "0",
        "-1",
        "12",
        "01",
        "-",
        "1.5",
        "1e3",
        "123456789012345678901234567890",
        "null",
        "true",
        "false",
        "nul",
        "nullx",
        "{}",
        "[]",
        "\"x\\",
        "[null]",
    ];

    /// A value: mostly what a stream's events hold, sometimes anything.
    fn value(rng: &mut Rng, depth: usize) -> String {
        match rng.below(if depth > 3 { 1 } else { 4 }) {
            0 => rng.pick(&SCALARS).to_owned(),
            1 => object(rng, depth + 1),
            2 => format!("[{}]", list(rng, depth)),
            _ => format!("[{}]", object(rng, depth + 1)),
        }
    }

    fn list(rng: &mut Rng, depth: usize) -> String {
        let n = rng.below(3);
        (0..n)
            .map(|_| value(rng, depth + 1))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn object(rng: &mut Rng, depth: usize) -> String {
        let n = rng.below(5);
        let members: Vec<String> = (0..n)
            .map(|_| format!("\"{}\":{}", rng.pick(&KEYS), value(rng, depth)))
            .collect();
        format!("{{{}}}", members.join(","))
    }

    /// An event of the plain shape, or near it.
    fn event(rng: &mut Rng) -> Vec<u8> {
        let text = rng.pick(&["\"we\"", "\"\"", "\" caf\u{e9}\"", "null", "\"a b c\""]);
        let field = rng.pick(&["content", "reasoning", "reasoning_content", "refusal"]);
        let choice = match rng.below(6) {
            4 => format!(
                "{{\"delta\":{{\"{field}\":{text}}},\"{}\":{{}}}}",
                rng.pick(&["delta", "message", "index"])
            ),
            5 => format!(
                "{{\"delta\":{{\"{field}\":{text},\"{}\":{text}}}}}",
                rng.pick(&["content", "refusal", "role"])
            ),
            0 => format!(
                "{{\"index\":0,\"delta\":{{\"{field}\":{text}}},\"logprobs\":null,\"finish_reason\":null}}"
            ),
            1 => format!("{{\"index\":1,\"text\":{text},\"finish_reason\":\"stop\"}}"),
            2 => format!(
                "{{\"message\":{{\"role\":\"assistant\",\"{field}\":{text},\"tool_calls\":null}}}}"
            ),
            _ => object(rng, 1),
        };
        let choices = match rng.below(5) {
            0 => String::new(),
            1 => format!("{choice},{choice}"),
            _ => choice,
        };
        let extra = match rng.below(6) {
            0 => format!(",\"usage\":{}", value(rng, 1)),
            1 => format!(",\"error\":{}", value(rng, 1)),
            2 => format!(",\"{}\":{}", rng.pick(&KEYS), value(rng, 1)),
            _ => String::new(),
        };
        let mut bytes = format!(
            " {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":17,\"choices\":[{choices}]{extra}}}\n"
        )
        .into_bytes();
        // Sometimes one byte changed, added or taken away.
        for _ in 0..rng.below(3).saturating_sub(1) {
            let at = rng.index(bytes.len());
            const BYTES: &[u8] = b",\"\\{}[] n0-.:\xff\x01e";
            let byte = rng.pick(BYTES);
            match rng.below(3) {
                0 => bytes[at] = byte,
                1 => bytes.insert(at, byte),
                _ => drop(bytes.remove(at)),
            }
        }
        bytes
    }

    #[test]
    fn the_plain_event_reader_agrees_with_serde_wherever_it_answers() {
        let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
        let mut answered = 0;
        let rounds = 200_000;
        for _ in 0..rounds {
            let data = event(&mut rng);
            let Some(generated) = super::super::delta::generated(&data) else {
                continue;
            };
            answered += 1;
            let by_serde = read(&data);
            let agrees = by_serde.as_ref().is_some_and(|o| {
                o.answer
                    && o.generated == generated
                    && o.usage.is_none()
                    && !(o.error || o.usage_only || o.terminal || o.provisional_output)
            });
            assert!(
                agrees,
                "{:?}: {generated} tokens, serde {by_serde:?}",
                String::from_utf8_lossy(&data)
            );
        }
        // Honest only if it answers often: a reader that always declined would pass.
        assert!(answered > rounds / 5, "answered {answered} of {rounds}");
    }

    /// Every one-byte insertion, replacement and deletion, and every truncation, of events
    /// the plain reader answers: wherever it still answers, serde agrees.
    #[test]
    fn every_one_byte_edit_of_a_plain_event_is_read_as_serde_reads_it() {
        const SEEDS: [&str; 4] = [
            r#"{"id":"c","choices":[{"index":0,"delta":{"content":"we","role":"assistant"},"logprobs":null,"finish_reason":null}],"usage":null}"#,
            r#"{"choices":[{"text":"a b","delta":{"reasoning":"x y","refusal":null,"tool_calls":null,"function_call":null},"message":{"reasoning_content":"q"}}],"error":null}"#,
            r#"{"choices":[{"delta":{}},{"message":null,"x":[1,-0,true,false,null,{"k":[{}]},"s"]}]}"#,
            "{\"choices\":[{\"delta\":{\"content\":\"\u{e9}t\u{e9} \u{4e2d}\"}}]}",
        ];
        let agrees = |data: &[u8]| {
            let Some(generated) = super::super::delta::generated(data) else {
                return true;
            };
            read(data).is_some_and(|o| {
                o.answer
                    && o.generated == generated
                    && o.usage.is_none()
                    && !(o.error || o.usage_only || o.terminal || o.provisional_output)
            })
        };
        for seed in SEEDS.map(str::as_bytes) {
            assert!(super::super::delta::generated(seed).is_some(), "{seed:?}");
            for at in 0..=seed.len() {
                let mut edits = vec![seed[..at].to_vec()];
                for byte in 0..=255u8 {
                    let mut inserted = seed.to_vec();
                    inserted.insert(at, byte);
                    edits.push(inserted);
                    if at < seed.len() {
                        let mut replaced = seed.to_vec();
                        replaced[at] = byte;
                        edits.push(replaced);
                    }
                }
                if at < seed.len() {
                    let mut removed = seed.to_vec();
                    removed.remove(at);
                    edits.push(removed);
                }
                for edit in edits {
                    assert!(agrees(&edit), "{:?}", String::from_utf8_lossy(&edit));
                }
            }
        }
    }

    #[test]
    fn the_plain_event_reader_answers_for_a_real_engines_deltas() {
        let capture = include_str!("../../testdata/vllm-chat-stream.sse");
        let mut deltas = 0;
        for event in capture
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
        {
            if event.contains("\"usage\":{") || event == "[DONE]" {
                continue;
            }
            let generated = super::super::delta::generated(event.as_bytes());
            assert_eq!(
                generated,
                read(event.as_bytes()).map(|o| o.generated),
                "{event}"
            );
            deltas += 1;
        }
        assert!(deltas > 10);
    }

    #[test]
    fn generated_text_is_borrowed_from_the_event_unless_it_holds_escapes() {
        let plain: Text = serde_json::from_str(r#""a delta""#).unwrap();
        assert!(matches!(plain.0, Cow::Borrowed("a delta")));
        let escaped: Text = serde_json::from_str(r#""a \"quoted\" delta""#).unwrap();
        assert!(matches!(&escaped.0, Cow::Owned(s) if s == "a \"quoted\" delta"));
        assert!(serde_json::from_str::<Text>("7").is_err());
    }
}
