//! Chat Completions and Completions chunks and bodies (and embeddings bodies, which carry only
//! `usage`): generated text in `choices`, usage in a trailing `"choices": []` chunk or the body,
//! `data: [DONE]` last.

use std::borrow::Cow;

use std::fmt;

use serde::Deserialize;
use serde::de::{Deserializer, SeqAccess, Visitor};

use super::{Observed, Reported, generated_tokens};

/// Text fields are borrowed from the event where they hold no escapes: a stream is read event
/// by event, and most events are one short delta.
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

    #[test]
    fn generated_text_is_borrowed_from_the_event_unless_it_holds_escapes() {
        let plain: Text = serde_json::from_str(r#""a delta""#).unwrap();
        assert!(matches!(plain.0, Cow::Borrowed("a delta")));
        let escaped: Text = serde_json::from_str(r#""a \"quoted\" delta""#).unwrap();
        assert!(matches!(&escaped.0, Cow::Owned(s) if s == "a \"quoted\" delta"));
        assert!(serde_json::from_str::<Text>("7").is_err());
    }
}
