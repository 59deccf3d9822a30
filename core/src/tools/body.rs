//! The calls of a whole (non-streamed) answer.

use crate::endpoint::Endpoint;

use super::events::{ChatBody, MessagesBody, ResponsesBody};
use super::{LEGACY_INDEX, MAX_CALLS, ToolCall};

/// The tool calls of a whole answer in the called API's shape, complete, in the answer's
/// order (`index` is the call's place in its message's `tool_calls`, the Responses `output`,
/// the Messages `content`). `None` when the body is not JSON of that shape or makes more than
/// [`MAX_CALLS`] calls: the caller fails closed. Completions and embeddings make none.
pub fn body_calls(endpoint: Endpoint, body: &[u8]) -> Option<Vec<ToolCall>> {
    let calls = match endpoint {
        Endpoint::ChatCompletions => chat(body)?,
        Endpoint::Responses => responses(body)?,
        Endpoint::Messages => messages(body)?,
        Endpoint::Completions | Endpoint::Embeddings => Vec::new(),
    };
    (calls.len() <= MAX_CALLS).then_some(calls)
}

/// A complete call.
fn whole(choice: u32, index: usize, id: &str, name: &str, arguments: &str) -> ToolCall {
    let mut call = ToolCall {
        choice,
        index: u32::try_from(index).unwrap_or(u32::MAX),
        id: id.to_owned(),
        name: name.to_owned(),
        decided: true,
        complete: true,
        ..ToolCall::default()
    };
    call.push_arguments(arguments);
    call
}

fn chat(body: &[u8]) -> Option<Vec<ToolCall>> {
    let body: ChatBody = serde_json::from_slice(body).ok()?;
    let mut calls = Vec::new();
    for (n, choice) in body.choices.unwrap_or_default().into_iter().enumerate() {
        let c = choice
            .index
            .unwrap_or_else(|| u32::try_from(n).unwrap_or(u32::MAX));
        let (tool_calls, legacy) = choice
            .message
            .map(|m| (m.tool_calls.unwrap_or_default(), m.function_call))
            .unwrap_or_default();
        for (k, call) in tool_calls.into_iter().enumerate() {
            let id = call.id.clone().unwrap_or_default();
            let (name, arguments) = call.parts()?;
            let (name, arguments) = (name.unwrap_or_default(), arguments.unwrap_or_default());
            calls.push(whole(c, k, &id, &name, &arguments));
        }
        if let Some(f) = legacy {
            let (name, arguments) = (f.name.unwrap_or_default(), f.arguments.unwrap_or_default());
            let mut call = whole(c, 0, "", &name, &arguments);
            call.index = LEGACY_INDEX;
            calls.push(call);
        }
    }
    Some(calls)
}

fn responses(body: &[u8]) -> Option<Vec<ToolCall>> {
    let body: ResponsesBody = serde_json::from_slice(body).ok()?;
    let output = body.output.unwrap_or_default();
    Some(
        output
            .into_iter()
            .enumerate()
            .filter(|(_, item)| item.is_call())
            .map(|(n, mut item)| {
                let arguments = item.arguments().unwrap_or_default();
                let name = item.name().unwrap_or_default();
                let id = item.call_id.unwrap_or_default();
                whole(0, n, &id, &name, &arguments)
            })
            .collect(),
    )
}

fn messages(body: &[u8]) -> Option<Vec<ToolCall>> {
    let body: MessagesBody = serde_json::from_slice(body).ok()?;
    let content = body.content.unwrap_or_default();
    Some(
        content
            .into_iter()
            .enumerate()
            .filter(|(_, block)| block.kind.as_deref() == Some("tool_use"))
            .map(|(n, block)| {
                whole(
                    0,
                    n,
                    &block.id.unwrap_or_default(),
                    &block.name.unwrap_or_default(),
                    block.input.map_or("", |input| input.get()),
                )
            })
            .collect(),
    )
}
