//! Chat Completions and Completions chunks and bodies (and embeddings bodies, which carry only
//! `usage`): generated text in `choices`, usage in a trailing `"choices": []` chunk or the body,
//! `data: [DONE]` last.

use serde::Deserialize;

use super::{Observed, Reported, generated_tokens};

#[derive(Deserialize)]
struct Event {
    #[serde(default)]
    choices: Option<Vec<Choice>>,
    #[serde(default)]
    usage: Option<Reported>,
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
        usage_only: event.usage.is_some() && choices.is_empty(),
        usage: event.usage,
        generated: generated_tokens(choices.iter().flat_map(Choice::texts)),
        error: event.error.is_some(),
        terminal: false,
        provisional_output: false,
    })
}
