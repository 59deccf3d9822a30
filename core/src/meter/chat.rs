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
    text: Option<Cow<'a, str>>,
}

/// Every field of a message or delta the engine generates, each billed as output: the answer,
/// the reasoning (`reasoning_content` in vLLM until 0.10, `reasoning` after), a refusal, and
/// tool calls (names and arguments), current and legacy.
#[derive(Deserialize)]
struct Generated<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    refusal: Option<Cow<'a, str>>,
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
    name: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    arguments: Option<Cow<'a, str>>,
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
        .map(Cow::as_ref)
        .chain(functions.flat_map(|f| {
            [&f.name, &f.arguments]
                .into_iter()
                .flatten()
                .map(Cow::as_ref)
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
            .chain(self.text.as_deref())
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
