//! Anthropic Messages events and bodies. A stream's `message_start` carries the input usage,
//! each `message_delta` the output so far; generated text arrives in `content_block_delta`
//! events (`text`, `thinking`, a tool use's `partial_json`); `message_stop` is the last event and
//! `error` an engine's failure. A body is the message, with `usage` and its content blocks.

use serde::Deserialize;
use serde_json::value::RawValue;

use super::{Observed, Reported, generated_tokens};

#[derive(Deserialize)]
struct Event {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    /// `message_start`'s message.
    #[serde(default)]
    message: Option<Message>,
    #[serde(default)]
    delta: Option<Block>,
    /// `content_block_start`'s block (a tool use's name).
    #[serde(default)]
    content_block: Option<Block>,
    #[serde(default)]
    usage: Option<Reported>,
    /// A whole body's content.
    #[serde(default)]
    content: Option<Vec<Block>>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    usage: Option<Reported>,
}

/// A content block, or a delta of one: every field the model generates.
#[derive(Deserialize)]
struct Block {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    thinking: Option<String>,
    #[serde(default)]
    partial_json: Option<String>,
    #[serde(default)]
    name: Option<String>,
    /// A tool use's input, as JSON.
    #[serde(default)]
    input: Option<Box<RawValue>>,
}

impl Block {
    fn texts(&self) -> impl Iterator<Item = &str> {
        [&self.text, &self.thinking, &self.partial_json, &self.name]
            .into_iter()
            .flatten()
            .map(String::as_str)
            .chain(self.input.as_deref().map(RawValue::get))
    }
}

pub(super) fn observe(data: &[u8]) -> Option<Observed> {
    let event: Event = serde_json::from_slice(data).ok()?;
    let kind = event.kind.as_deref().unwrap_or_default();
    let mut usage = event.message.and_then(|m| m.usage);
    if let Some(newer) = event.usage {
        usage.get_or_insert_default().merge(newer);
    }
    let blocks = (event.delta.iter())
        .chain(event.content_block.iter())
        .chain(event.content.iter().flatten());
    Some(Observed {
        usage,
        // Its output count is 0 or 1 before anything was generated: message_delta says.
        provisional_output: kind == "message_start",
        generated: generated_tokens(blocks.flat_map(Block::texts)),
        error: kind == "error",
        terminal: kind == "message_stop",
        answer: kind == "message" && event.content.is_some(),
        usage_only: false,
    })
}
