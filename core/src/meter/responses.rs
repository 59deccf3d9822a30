//! Responses API events and bodies. A stream is typed events (`{"type": ...}`); generated text
//! arrives in every `*.delta` event (output text, reasoning, summaries, refusals, function-call
//! arguments), usage in the `response` of the terminal event (`response.completed`,
//! `response.incomplete` or `response.failed`). No `[DONE]` follows. A body is the response
//! object, with `usage` and its `output` items.

use serde::Deserialize;
use serde::de::IgnoredAny;

use super::{Observed, Reported, generated_tokens};

const TERMINAL: [&str; 3] = [
    "response.completed",
    "response.incomplete",
    "response.failed",
];

/// Deltas that are not generated text (base64 audio).
const NOT_TEXT_DELTAS: [&str; 1] = ["response.audio.delta"];

#[derive(Deserialize)]
struct Event {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    response: Option<Response>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Delta {
    Text(String),
    Other(IgnoredAny),
}

#[derive(Deserialize)]
struct Response {
    #[serde(default)]
    usage: Option<Reported>,
    #[serde(default)]
    output: Option<Vec<Item>>,
    #[serde(default)]
    error: Option<IgnoredAny>,
    #[serde(default)]
    status: Option<String>,
}

/// An output item: a message or reasoning with text parts, or a function call.
#[derive(Deserialize)]
struct Item {
    #[serde(default)]
    content: Option<Vec<Part>>,
    #[serde(default)]
    summary: Option<Vec<Part>>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

#[derive(Deserialize)]
struct Part {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    refusal: Option<String>,
}

impl Item {
    fn texts(&self) -> impl Iterator<Item = &str> {
        let parts = self.content.iter().chain(self.summary.iter()).flatten();
        parts
            .flat_map(|p| [&p.text, &p.refusal])
            .chain([&self.name, &self.arguments])
            .flatten()
            .map(String::as_str)
    }
}

pub(super) fn observe(data: &[u8]) -> Option<Observed> {
    if let Ok(event) = serde_json::from_slice::<Event>(data)
        && let Some(kind) = event.kind.as_deref()
        && (kind.starts_with("response.") || kind == "error")
    {
        let text = match (&event.delta, kind.ends_with(".delta")) {
            (Some(Delta::Text(t)), true) if !NOT_TEXT_DELTAS.contains(&kind) => Some(t.as_str()),
            _ => None,
        };
        return Some(Observed {
            usage: event.response.as_ref().and_then(|r| r.usage),
            generated: generated_tokens(text),
            error: kind == "error" || kind == "response.failed",
            terminal: TERMINAL.contains(&kind),
            ..Observed::default()
        });
    }
    // A whole response object.
    let body: Response = serde_json::from_slice(data).ok()?;
    let failed = body.error.is_some() || body.status.as_deref() == Some("failed");
    Some(Observed {
        usage: body.usage,
        generated: generated_tokens(body.output.iter().flatten().flat_map(Item::texts)),
        error: failed,
        answer: body.output.is_some() && !failed,
        ..Observed::default()
    })
}
