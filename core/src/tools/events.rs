//! The fields of each API's events and bodies that carry tool calls, read with serde (every
//! other field ignored; text borrowed from the event where it holds no escapes).

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

type Text<'a> = Option<Cow<'a, str>>;

/// A Chat Completions chunk (the usage-only chunk has no `choices`).
#[derive(Deserialize)]
pub struct ChatChunk<'a> {
    #[serde(default, borrow)]
    pub choices: Option<Vec<ChatChoice<'a>>>,
}

#[derive(Deserialize)]
pub struct ChatChoice<'a> {
    #[serde(default)]
    pub index: Option<u32>,
    #[serde(default, borrow)]
    pub delta: Option<ChatMessage<'a>>,
    #[serde(default, borrow)]
    pub message: Option<ChatMessage<'a>>,
    #[serde(default, borrow)]
    pub finish_reason: Text<'a>,
}

/// A chunk's `delta` or a body's `message`.
#[derive(Deserialize)]
pub struct ChatMessage<'a> {
    #[serde(default, borrow)]
    pub tool_calls: Option<Vec<ChatToolCall<'a>>>,
    /// The legacy functions API's one call: clients that still read it run it.
    #[serde(default, borrow)]
    pub function_call: Option<ChatFunction<'a>>,
}

#[derive(Deserialize)]
pub struct ChatToolCall<'a> {
    #[serde(default)]
    pub index: Option<u32>,
    #[serde(default, borrow)]
    pub id: Text<'a>,
    /// `function` or `custom`: which of the two members a client reads.
    #[serde(rename = "type", default, borrow)]
    pub kind: Text<'a>,
    #[serde(default, borrow)]
    pub function: Option<ChatFunction<'a>>,
    /// A custom tool's call (`type: "custom"`): its text `input` in place of `arguments`.
    #[serde(default, borrow)]
    pub custom: Option<ChatCustom<'a>>,
}

impl<'a> ChatToolCall<'a> {
    /// The call's name and arguments (a piece of each, in a stream), whichever kind it is;
    /// `None` when it is ambiguous what a client runs (both members, or the one its `type`
    /// does not name): a client going by `type` and one going by the member present differ.
    pub fn parts(self) -> Option<(Text<'a>, Text<'a>)> {
        match (self.kind.as_deref(), self.function, self.custom) {
            (None | Some("function"), Some(f), None) => Some((f.name, f.arguments)),
            (None | Some("custom"), None, Some(c)) => Some((c.name, c.input)),
            (_, None, None) => Some((None, None)),
            _ => None,
        }
    }
}

#[derive(Deserialize)]
pub struct ChatFunction<'a> {
    #[serde(default, borrow)]
    pub name: Text<'a>,
    #[serde(default, borrow)]
    pub arguments: Text<'a>,
}

#[derive(Deserialize)]
pub struct ChatCustom<'a> {
    #[serde(default, borrow)]
    pub name: Text<'a>,
    #[serde(default, borrow)]
    pub input: Text<'a>,
}

/// A Chat Completions body.
#[derive(Deserialize)]
pub struct ChatBody<'a> {
    #[serde(default, borrow)]
    pub choices: Option<Vec<ChatChoice<'a>>>,
}

/// A Responses stream event (only the fields tool calls use).
#[derive(Deserialize)]
pub struct ResponsesEvent<'a> {
    #[serde(rename = "type", borrow)]
    pub kind: Cow<'a, str>,
    #[serde(default)]
    pub output_index: Option<u32>,
    #[serde(default, borrow)]
    pub item: Option<ResponsesItem<'a>>,
    /// `response.function_call_arguments.delta`'s fragment; other events' `delta` (text) is
    /// read and ignored.
    #[serde(default, borrow)]
    pub delta: Option<&'a RawValue>,
    #[serde(default, borrow)]
    pub arguments: Text<'a>,
    /// `response.custom_tool_call_input.done`'s whole input.
    #[serde(default, borrow)]
    pub input: Text<'a>,
    /// The response as it stands (`response.created`, `response.completed`…), whose
    /// `output` may restate calls, or make ones no event opened.
    #[serde(default, borrow)]
    pub response: Option<ResponsesBody<'a>>,
}

/// An output item (a Responses body's `output[]`, an event's `item`).
#[derive(Deserialize)]
pub struct ResponsesItem<'a> {
    #[serde(rename = "type", default, borrow)]
    pub kind: Text<'a>,
    #[serde(default, borrow)]
    pub call_id: Text<'a>,
    #[serde(default, borrow)]
    pub name: Text<'a>,
    #[serde(default, borrow)]
    pub arguments: Text<'a>,
    /// A `custom_tool_call`'s text input.
    #[serde(default, borrow)]
    pub input: Text<'a>,
    /// A built-in tool's call: what it asks the client to do.
    #[serde(default, borrow)]
    pub action: Option<&'a RawValue>,
    #[serde(default, borrow)]
    pub operation: Option<&'a RawValue>,
}

/// The Responses output items the client runs, and the name of the tool each calls: a
/// function's or a custom tool's call names it; a built-in tool's call is named by the tool's
/// `type` as the request offers it (`{"type": "local_shell"}`).
pub const RESPONSES_CALL_KINDS: [(&str, Option<&str>); 6] = [
    ("function_call", None),
    ("custom_tool_call", None),
    ("local_shell_call", Some("local_shell")),
    ("shell_call", Some("shell")),
    ("apply_patch_call", Some("apply_patch")),
    ("computer_call", Some("computer_use_preview")),
];

impl<'a> ResponsesItem<'a> {
    /// Whether the item is a call the client runs.
    pub fn is_call(&self) -> bool {
        self.builtin().is_some()
    }

    /// `Some` for a call: `Some(name)` of a built-in tool's, `None` of one that names its tool.
    fn builtin(&self) -> Option<Option<&'static str>> {
        let kind = self.kind.as_deref()?;
        (RESPONSES_CALL_KINDS.iter())
            .find(|(k, _)| *k == kind)
            .map(|(_, tool)| *tool)
    }

    /// The tool the call calls.
    pub fn name(&mut self) -> Text<'a> {
        match self.builtin() {
            Some(Some(tool)) => Some(Cow::Borrowed(tool)),
            _ => self.name.take(),
        }
    }

    /// The call's arguments (a custom tool's input, a built-in's action), when the item
    /// states them.
    pub fn arguments(&mut self) -> Text<'a> {
        let action = self
            .action
            .or(self.operation)
            .map(|a| Cow::Borrowed(a.get()));
        self.arguments
            .take()
            .or_else(|| self.input.take())
            .or(action)
    }
}

/// A Responses body.
#[derive(Deserialize)]
pub struct ResponsesBody<'a> {
    #[serde(default, borrow)]
    pub output: Option<Vec<ResponsesItem<'a>>>,
}

/// A Messages stream event (only the fields tool calls use).
#[derive(Deserialize)]
pub struct MessagesEvent<'a> {
    #[serde(rename = "type", borrow)]
    pub kind: Cow<'a, str>,
    #[serde(default)]
    pub index: Option<u32>,
    #[serde(default, borrow)]
    pub content_block: Option<MessagesBlock<'a>>,
    #[serde(default, borrow)]
    pub delta: Option<MessagesDelta<'a>>,
    /// `message_start`'s message, whose `content` may open calls.
    #[serde(default, borrow)]
    pub message: Option<MessagesBody<'a>>,
}

/// A content block (a Messages body's `content[]`, an event's `content_block`).
#[derive(Deserialize)]
pub struct MessagesBlock<'a> {
    #[serde(rename = "type", default, borrow)]
    pub kind: Text<'a>,
    #[serde(default, borrow)]
    pub id: Text<'a>,
    #[serde(default, borrow)]
    pub name: Text<'a>,
    #[serde(default, borrow)]
    pub input: Option<&'a RawValue>,
}

#[derive(Deserialize)]
pub struct MessagesDelta<'a> {
    #[serde(rename = "type", default, borrow)]
    pub kind: Text<'a>,
    #[serde(default, borrow)]
    pub partial_json: Text<'a>,
}

/// A Messages body.
#[derive(Deserialize)]
pub struct MessagesBody<'a> {
    #[serde(default, borrow)]
    pub content: Option<Vec<MessagesBlock<'a>>>,
}

/// A JSON string's value, for a field read raw because other events give it another type.
pub fn string_value(raw: &RawValue) -> Option<Cow<'_, str>> {
    serde_json::from_str::<Cow<'_, str>>(raw.get()).ok()
}
