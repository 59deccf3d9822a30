//! Tool calls. When a request carries `tools` and its `tool_choice` is not `"none"`, which calls
//! the answer makes is decided by three rules, in order, so that scripted agent loops end:
//! 1. If the last input item is a tool result (a chat `role: "tool"` message, a Responses
//!    `function_call_output` item, a Messages `tool_result` block last in the last message), the
//!    answer is text — unless `tool_choice` is `required`/`any` or names a tool.
//! 2. Else, when `tool_choice` names no tool, `call A, B` in the last user text (the first `call`
//!    followed by offered tool names; names not offered are skipped) calls those tools, in that
//!    order, as parallel calls — only the first when parallel calls are off
//!    (`parallel_tool_calls: false`, Anthropic's `disable_parallel_tool_use`).
//! 3. Else one call of one tool: the tool `tool_choice` names, else the first with a name.
//!
//! Each call's arguments are a JSON object of one string field — the first property of the
//! tool's parameter schema, else `query` — which the generated text fills:
//! `{"query": " the cache of"}`. The generated content is shared out over the calls in order
//! ([`fragments`]); every token is a fragment of some call's arguments, so the fragments streamed
//! add up to the arguments a whole body carries, and the tokens are billed as completion tokens
//! like any others.
//!
//! Tools are read from each API's own shape: chat's `{"type": "function", "function": {"name",
//! "parameters"}}`, the Responses API's `{"type": "function", "name", "parameters"}` and
//! Anthropic's `{"name", "input_schema"}`.

use std::fmt;

use serde::de::{IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;
use weir_core::endpoint::Endpoint;
use weir_core::error::ApiError;

/// The argument the generated text fills when the tool's schema names none.
const DEFAULT_ARGUMENT: &str = "query";

/// One tool call an answer makes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// Its position among the answer's calls (chat's `tool_calls[].index`).
    pub index: u32,
    /// The call's id: `chatcmpl-tool-…` (chat), `call_…` (Responses), `toolu_…` (Messages); the
    /// first call's is the answer's key, a later one's has `_{index}` after it.
    pub id: String,
    pub name: String,
    /// The argument the generated text fills.
    pub argument: String,
}

#[derive(Deserialize)]
struct Tools {
    #[serde(default)]
    tools: Option<Vec<ToolDef>>,
    #[serde(default)]
    tool_choice: Option<ToolChoice>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
}

/// A tool definition in any API's shape; tools without a name (built-in ones) are skipped.
#[derive(Deserialize)]
struct ToolDef {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    function: Option<FunctionDef>,
    #[serde(default)]
    parameters: Option<Box<RawValue>>,
    #[serde(default)]
    input_schema: Option<Box<RawValue>>,
}

#[derive(Deserialize)]
struct FunctionDef {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    parameters: Option<Box<RawValue>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ToolChoice {
    /// `"none"`, `"auto"`, `"required"`.
    Mode(String),
    /// `{"type": "function", "function": {"name"}}` (chat), `{"type": "function", "name"}`
    /// (Responses), `{"type": "auto" | "any" | "tool" | "none", "name"}` (Messages).
    Object {
        #[serde(rename = "type", default)]
        kind: Option<String>,
        #[serde(default)]
        name: Option<String>,
        #[serde(default)]
        function: Option<NamedFunction>,
        #[serde(default)]
        disable_parallel_tool_use: Option<bool>,
    },
}

#[derive(Deserialize)]
struct NamedFunction {
    #[serde(default)]
    name: Option<String>,
}

/// A JSON schema's `properties`, of which only the first key is kept.
#[derive(Deserialize)]
struct Schema {
    #[serde(default)]
    properties: Option<FirstKey>,
}

struct FirstKey(Option<String>);

impl<'de> Deserialize<'de> for FirstKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct First;
        impl<'de> Visitor<'de> for First {
            type Value = FirstKey;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<FirstKey, A::Error> {
                let first = map.next_key::<String>()?;
                if first.is_some() {
                    map.next_value::<IgnoredAny>()?;
                }
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(FirstKey(first))
            }
        }
        deserializer.deserialize_map(First)
    }
}

impl ToolDef {
    fn name(&self) -> Option<&str> {
        self.function
            .as_ref()
            .and_then(|f| f.name.as_deref())
            .or(self.name.as_deref())
    }

    /// The first property of the tool's parameters, if its schema names any.
    fn first_property(&self) -> Option<String> {
        let schema = self
            .function
            .as_ref()
            .and_then(|f| f.parameters.as_ref())
            .or(self.parameters.as_ref())
            .or(self.input_schema.as_ref())?;
        serde_json::from_str::<Schema>(schema.get())
            .ok()?
            .properties?
            .0
    }
}

impl ToolChoice {
    fn is_none(&self) -> bool {
        match self {
            ToolChoice::Mode(mode) => mode == "none",
            ToolChoice::Object { kind, .. } => kind.as_deref() == Some("none"),
        }
    }

    fn named(&self) -> Option<&str> {
        match self {
            ToolChoice::Mode(_) => None,
            ToolChoice::Object { name, function, .. } => function
                .as_ref()
                .and_then(|f| f.name.as_deref())
                .or(name.as_deref()),
        }
    }

    /// Whether the answer must call a tool: `required`, `any`, or a tool named.
    fn forces_a_call(&self) -> bool {
        match self {
            ToolChoice::Mode(mode) => mode == "required",
            ToolChoice::Object { kind, .. } => {
                kind.as_deref() == Some("any") || self.named().is_some()
            }
        }
    }

    fn disables_parallel(&self) -> bool {
        matches!(
            self,
            ToolChoice::Object {
                disable_parallel_tool_use: Some(true),
                ..
            }
        )
    }
}

/// The last input item of a conversation, as far as the rules need it.
#[derive(Debug, PartialEq, Eq)]
enum LastTurn {
    ToolResult,
    UserText(String),
    Other,
}

/// The conversation fields of the three APIs; read leniently, as only the rules need them and
/// the request was validated before.
#[derive(Deserialize)]
struct Conversation {
    #[serde(default)]
    messages: Option<Vec<Box<RawValue>>>,
    #[serde(default)]
    input: Option<Box<RawValue>>,
}

impl LastTurn {
    fn of_request(endpoint: Endpoint, body: &[u8]) -> LastTurn {
        let Ok(conversation) = serde_json::from_slice::<Conversation>(body) else {
            return LastTurn::Other;
        };
        let last = match endpoint {
            Endpoint::Responses => {
                let input = conversation
                    .input
                    .and_then(|raw| serde_json::from_str::<Value>(raw.get()).ok());
                match input {
                    Some(Value::String(text)) => return LastTurn::UserText(text),
                    Some(Value::Array(mut items)) => items.pop(),
                    _ => None,
                }
            }
            _ => conversation.messages.and_then(|m| {
                m.last()
                    .and_then(|raw| serde_json::from_str(raw.get()).ok())
            }),
        };
        last.map_or(LastTurn::Other, |item| LastTurn::of_item(&item))
    }

    /// A chat message, a Responses input item or a Messages message.
    fn of_item(item: &Value) -> LastTurn {
        let kind = item.get("type").and_then(Value::as_str);
        let role = item.get("role").and_then(Value::as_str);
        if matches!(role, Some("tool" | "function"))
            || matches!(
                kind,
                Some("function_call_output" | "custom_tool_call_output")
            )
        {
            return LastTurn::ToolResult;
        }
        if role != Some("user") {
            return LastTurn::Other;
        }
        match item.get("content") {
            Some(Value::String(text)) => LastTurn::UserText(text.clone()),
            Some(Value::Array(parts)) => {
                let last = parts
                    .last()
                    .and_then(|p| p.get("type"))
                    .and_then(Value::as_str);
                if last == Some("tool_result") {
                    return LastTurn::ToolResult;
                }
                let text = parts
                    .iter()
                    .filter(|p| {
                        matches!(
                            p.get("type").and_then(Value::as_str),
                            Some("text" | "input_text")
                        )
                    })
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join("\n");
                LastTurn::UserText(text)
            }
            _ => LastTurn::Other,
        }
    }
}

/// The tools `text` asks for with `call A, B` (or `call A and B`): the first `call` followed by
/// at least one offered tool, and the offered names on the rest of its line, in order.
fn requested<'a>(text: &'a str, offered: &[&str]) -> Vec<&'a str> {
    let mut rest = text;
    while let Some(at) = rest.find("call") {
        let before = rest[..at].chars().next_back();
        let after = &rest[at + "call".len()..];
        rest = after;
        if before.is_some_and(char::is_alphanumeric) || !after.starts_with([' ', '\t']) {
            continue;
        }
        let line = after.lines().next().unwrap_or_default();
        let names: Vec<&str> = line
            .split([',', ' ', '\t'])
            .map(|w| w.trim_matches(|c: char| !(c.is_alphanumeric() || c == '_' || c == '-')))
            .filter(|w| offered.contains(w))
            .collect();
        if !names.is_empty() {
            return names;
        }
    }
    Vec::new()
}

/// The characters of `text` as they stand inside a JSON string.
fn escaped(text: &str) -> String {
    let quoted = serde_json::to_string(text).unwrap_or_default();
    quoted
        .strip_prefix('"')
        .and_then(|s| s.strip_suffix('"'))
        .unwrap_or_default()
        .to_owned()
}

impl ToolCall {
    /// The calls a request's answer makes, by the module's rules; none for a text answer.
    /// `key` makes the calls' ids unique.
    pub fn of_request(
        endpoint: Endpoint,
        body: &[u8],
        key: &str,
    ) -> Result<Vec<ToolCall>, ApiError> {
        if !matches!(
            endpoint,
            Endpoint::ChatCompletions | Endpoint::Responses | Endpoint::Messages
        ) {
            return Ok(Vec::new());
        }
        let tools: Tools = serde_json::from_slice(body).map_err(|e| {
            ApiError::bad_request(format!("invalid request: tools: {e}")).with_param("tools")
        })?;
        let defs = tools.tools.unwrap_or_default();
        let choice = tools.tool_choice.as_ref();
        if defs.iter().all(|d| d.name().is_none()) || choice.is_some_and(ToolChoice::is_none) {
            return Ok(Vec::new());
        }
        let turn = LastTurn::of_request(endpoint, body);
        if turn == LastTurn::ToolResult && !choice.is_some_and(ToolChoice::forces_a_call) {
            return Ok(Vec::new());
        }
        let named = choice.and_then(ToolChoice::named);
        let find = |n: &str| defs.iter().find(|d| d.name() == Some(n));
        let mut chosen: Vec<&ToolDef> = match (&turn, named) {
            (LastTurn::UserText(text), None) => {
                let offered: Vec<&str> = defs.iter().filter_map(ToolDef::name).collect();
                requested(text, &offered)
                    .into_iter()
                    .filter_map(find)
                    .collect()
            }
            _ => Vec::new(),
        };
        if chosen.is_empty() {
            chosen.extend(
                named
                    .and_then(find)
                    .or_else(|| defs.iter().find(|d| d.name().is_some())),
            );
        }
        if tools.parallel_tool_calls == Some(false)
            || choice.is_some_and(ToolChoice::disables_parallel)
        {
            chosen.truncate(1);
        }
        let prefix = match endpoint {
            Endpoint::Responses => "call_",
            Endpoint::Messages => "toolu_",
            _ => "chatcmpl-tool-",
        };
        Ok((0u32..)
            .zip(chosen)
            .filter_map(|(index, def)| {
                Some(ToolCall {
                    index,
                    id: match index {
                        0 => format!("{prefix}{key}"),
                        _ => format!("{prefix}{key}_{index}"),
                    },
                    name: def.name()?.to_owned(),
                    argument: def
                        .first_property()
                        .unwrap_or_else(|| DEFAULT_ARGUMENT.to_owned()),
                })
            })
            .collect())
    }

    /// The arguments' text for a chunk of generated text: the first chunk opens the object,
    /// the last closes it.
    pub fn fragment(&self, text: &str, first: bool, last: bool) -> String {
        let mut out = String::new();
        if first {
            out.push_str(&format!("{{\"{}\": \"", escaped(&self.argument)));
        }
        out.push_str(&escaped(text));
        if last {
            out.push_str("\"}");
        }
        out
    }

    /// The opening tool-call delta of a chat stream: id, type and `name` (the call's name, or
    /// its first part), no arguments yet.
    pub fn opening_delta<'a>(&'a self, name: &'a str) -> ToolCallDelta<'a> {
        ToolCallDelta {
            index: self.index,
            id: Some(&self.id),
            kind: Some("function"),
            function: FunctionDelta {
                name: Some(name),
                arguments: "",
            },
        }
    }

    /// A chat stream's delta carrying the rest of the call's name, as engines whose parsers
    /// stream names in pieces send it; clients concatenate the pieces.
    pub fn name_delta<'a>(&self, rest: &'a str) -> ToolCallDelta<'a> {
        ToolCallDelta {
            index: self.index,
            id: None,
            kind: None,
            function: FunctionDelta {
                name: Some(rest),
                arguments: "",
            },
        }
    }

    /// The call as a chat message carries it.
    pub fn message<'a>(&'a self, arguments: &'a str) -> ChatToolCall<'a> {
        ChatToolCall {
            id: &self.id,
            kind: "function",
            function: FunctionCall {
                name: &self.name,
                arguments,
            },
        }
    }
}

/// Shares a chunk of generated content out over `calls`: the chunk fills call `target` (the
/// last call on a choice's last chunk). A call left behind is closed, and calls skipped over
/// are made whole and empty, so that every call's arguments are a complete object once the
/// last chunk is out, however few chunks there were. `open` is the call being filled.
/// Returns each piece with the index of the call it belongs to.
pub fn fragments(
    calls: &[ToolCall],
    open: &mut Option<usize>,
    text: &str,
    target: usize,
    last: bool,
) -> Vec<(u32, String)> {
    let Some(end) = calls.len().checked_sub(1) else {
        return Vec::new();
    };
    let target = match (last, *open) {
        (true, _) => end,
        (false, Some(open)) => target.clamp(open, end),
        (false, None) => target.min(end),
    };
    let mut pieces = Vec::new();
    let from = match *open {
        Some(j) if j == target => None,
        Some(j) => {
            pieces.extend(calls.get(j).map(|c| (c.index, c.fragment("", false, true))));
            Some(j + 1)
        }
        None => Some(0),
    };
    let skipped = from.map_or(0..0, |from| from..target);
    for call in calls.get(skipped).unwrap_or_default() {
        pieces.push((call.index, call.fragment("", true, true)));
    }
    if let Some(call) = calls.get(target) {
        pieces.push((call.index, call.fragment(text, from.is_some(), last)));
    }
    *open = Some(target);
    pieces
}

/// `text` cut in two at the character boundary nearest its middle, for the faults that split
/// a name or the arguments over two events; the second half is empty for one character.
pub fn halves(text: &str) -> (&str, &str) {
    let mut at = text.len() / 2;
    while !text.is_char_boundary(at) {
        at += 1;
    }
    if at == 0 && !text.is_empty() {
        at = text.chars().next().map_or(0, char::len_utf8);
    }
    text.split_at(at)
}

/// One element of a chat stream delta's `tool_calls`.
#[derive(Serialize)]
pub struct ToolCallDelta<'a> {
    index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    kind: Option<&'static str>,
    function: FunctionDelta<'a>,
}

impl<'a> ToolCallDelta<'a> {
    /// A chat stream's delta carrying a fragment of call `index`'s arguments.
    pub fn arguments(index: u32, fragment: &'a str) -> Self {
        ToolCallDelta {
            index,
            id: None,
            kind: None,
            function: FunctionDelta {
                name: None,
                arguments: fragment,
            },
        }
    }
}

#[derive(Serialize)]
struct FunctionDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    arguments: &'a str,
}

/// One element of a chat message's `tool_calls`.
#[derive(Serialize)]
pub struct ChatToolCall<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: FunctionCall<'a>,
}

#[derive(Serialize)]
struct FunctionCall<'a> {
    name: &'a str,
    arguments: &'a str,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn calls(endpoint: Endpoint, body: &str) -> Vec<ToolCall> {
        ToolCall::of_request(endpoint, body.as_bytes(), "k").unwrap()
    }

    fn call(endpoint: Endpoint, body: &str) -> Option<ToolCall> {
        let mut calls = calls(endpoint, body);
        assert!(calls.len() <= 1, "{calls:?}");
        calls.pop()
    }

    fn names(calls: &[ToolCall]) -> Vec<&str> {
        calls.iter().map(|c| c.name.as_str()).collect()
    }

    #[test]
    fn each_api_s_tool_shape_is_read() {
        let chat = call(
            Endpoint::ChatCompletions,
            r#"{"tools":[{"type":"function","function":{"name":"search","parameters":{"type":"object","properties":{"terms":{"type":"string"},"a":{}}}}}]}"#,
        );
        assert_eq!(
            chat,
            Some(ToolCall {
                index: 0,
                id: "chatcmpl-tool-k".into(),
                name: "search".into(),
                argument: "terms".into(),
            })
        );
        let responses = call(
            Endpoint::Responses,
            r#"{"tools":[{"type":"web_search"},{"type":"function","name":"lookup","parameters":{}}]}"#,
        );
        assert_eq!(
            responses.map(|c| (c.id, c.name, c.argument)),
            Some(("call_k".into(), "lookup".into(), "query".into()))
        );
        let messages = call(
            Endpoint::Messages,
            r#"{"tools":[{"name":"a","input_schema":{"properties":{"city":{}}}},{"name":"b"}],"tool_choice":{"type":"tool","name":"b"}}"#,
        );
        assert_eq!(
            messages.map(|c| (c.id, c.name, c.argument)),
            Some(("toolu_k".into(), "b".into(), "query".into()))
        );
    }

    #[test]
    fn none_no_tools_and_other_apis_make_no_call() {
        let tools = r#""tools":[{"type":"function","function":{"name":"f"}}]"#;
        assert!(
            call(
                Endpoint::ChatCompletions,
                &format!("{{{tools},\"tool_choice\":\"none\"}}")
            )
            .is_none()
        );
        assert!(
            call(
                Endpoint::Messages,
                r#"{"tools":[{"name":"f"}],"tool_choice":{"type":"none"}}"#
            )
            .is_none()
        );
        assert!(call(Endpoint::ChatCompletions, r#"{"tools":[]}"#).is_none());
        assert!(call(Endpoint::Completions, &format!("{{{tools}}}")).is_none());
        assert!(
            call(
                Endpoint::ChatCompletions,
                &format!("{{{tools},\"tool_choice\":\"required\"}}")
            )
            .is_some()
        );
        assert!(ToolCall::of_request(Endpoint::ChatCompletions, br#"{"tools":"x"}"#, "k").is_err());
    }

    #[test]
    fn fragments_add_up_to_a_json_object() {
        let call = ToolCall {
            index: 0,
            id: "i".into(),
            name: "f".into(),
            argument: "q\"".into(),
        };
        let joined = call.fragment(" the", true, false) + &call.fragment(" \"a\"", false, true);
        let v: serde_json::Value = serde_json::from_str(&joined).unwrap();
        assert_eq!(v, serde_json::json!({"q\"": " the \"a\""}));
        assert_eq!(call.fragment("x", true, true), "{\"q\\\"\": \"x\"}");
    }

    const CHAT_TOOLS: &str = r#""tools":[{"type":"function","function":{"name":"A","parameters":{"properties":{"city":{}}}}},{"type":"function","function":{"name":"B"}}]"#;
    const RESPONSES_TOOLS: &str =
        r#""tools":[{"type":"function","name":"A"},{"type":"function","name":"B"}]"#;
    const MESSAGES_TOOLS: &str = r#""tools":[{"name":"A"},{"name":"B"}]"#;

    #[test]
    fn a_tool_result_last_turn_is_answered_with_text_in_each_api() {
        let chat = format!(
            r#"{{{CHAT_TOOLS},"messages":[{{"role":"user","content":"call A"}},{{"role":"assistant","tool_calls":[]}},{{"role":"tool","tool_call_id":"x","content":"sunny"}}]"#
        );
        assert!(calls(Endpoint::ChatCompletions, &format!("{chat}}}")).is_empty());
        let responses = format!(
            r#"{{{RESPONSES_TOOLS},"input":[{{"role":"user","content":"call A"}},{{"type":"function_call","call_id":"c","name":"A","arguments":"{{}}"}},{{"type":"function_call_output","call_id":"c","output":"sunny"}}]"#
        );
        assert!(calls(Endpoint::Responses, &format!("{responses}}}")).is_empty());
        let messages = format!(
            r#"{{{MESSAGES_TOOLS},"messages":[{{"role":"user","content":"call A"}},{{"role":"assistant","content":[{{"type":"tool_use","id":"t","name":"A","input":{{}}}}]}},{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"t","content":"sunny"}}]}}]"#
        );
        assert!(calls(Endpoint::Messages, &format!("{messages}}}")).is_empty());
        // Unless the tool choice forces a call: `required`, `any`, or a tool named.
        let forced = [
            (
                Endpoint::ChatCompletions,
                format!(r#"{chat},"tool_choice":"required"}}"#),
            ),
            (
                Endpoint::ChatCompletions,
                format!(
                    r#"{chat},"tool_choice":{{"type":"function","function":{{"name":"B"}}}}}}"#
                ),
            ),
            (
                Endpoint::Responses,
                format!(r#"{responses},"tool_choice":"required"}}"#),
            ),
            (
                Endpoint::Messages,
                format!(r#"{messages},"tool_choice":{{"type":"any"}}}}"#),
            ),
            (
                Endpoint::Messages,
                format!(r#"{messages},"tool_choice":{{"type":"tool","name":"B"}}}}"#),
            ),
        ];
        let forced: Vec<String> = forced
            .iter()
            .map(|(e, body)| names(&calls(*e, body)).concat())
            .collect();
        assert_eq!(forced, ["A", "B", "A", "A", "B"]);
        // Text after the tool result is the last turn: the rules read it.
        let after = format!(
            r#"{{{MESSAGES_TOOLS},"messages":[{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"t","content":"x"}},{{"type":"text","text":"now call B"}}]}}]}}"#
        );
        assert_eq!(names(&calls(Endpoint::Messages, &after)), ["B"]);
    }

    #[test]
    fn call_a_and_b_makes_two_parallel_calls_in_each_api() {
        let chat = calls(
            Endpoint::ChatCompletions,
            &format!(
                r#"{{{CHAT_TOOLS},"messages":[{{"role":"user","content":"Please call A, B."}}]}}"#
            ),
        );
        assert_eq!(
            chat,
            [
                ToolCall {
                    index: 0,
                    id: "chatcmpl-tool-k".into(),
                    name: "A".into(),
                    argument: "city".into(),
                },
                ToolCall {
                    index: 1,
                    id: "chatcmpl-tool-k_1".into(),
                    name: "B".into(),
                    argument: "query".into(),
                },
            ]
        );
        let responses = calls(
            Endpoint::Responses,
            &format!(
                r#"{{{RESPONSES_TOOLS},"input":[{{"type":"message","role":"user","content":[{{"type":"input_text","text":"call B and A"}}]}}]}}"#
            ),
        );
        assert_eq!(names(&responses), ["B", "A"]);
        assert_eq!(responses[1].id, "call_k_1");
        let plain = calls(
            Endpoint::Responses,
            &format!(r#"{{{RESPONSES_TOOLS},"input":"call A, B"}}"#),
        );
        assert_eq!(names(&plain), ["A", "B"]);
        let messages = calls(
            Endpoint::Messages,
            &format!(
                r#"{{{MESSAGES_TOOLS},"messages":[{{"role":"user","content":[{{"type":"text","text":"call A, B"}}]}}]}}"#
            ),
        );
        assert_eq!(names(&messages), ["A", "B"]);
        assert_eq!(messages[1].id, "toolu_k_1");
        // Names not offered are skipped; a `call` naming none falls back to the first tool.
        let chat_text = |text: &str, extra: &str| {
            let body = format!(
                r#"{{{CHAT_TOOLS},"messages":[{{"role":"user","content":"{text}"}}]{extra}}}"#
            );
            names(&calls(Endpoint::ChatCompletions, &body))
                .into_iter()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        assert_eq!(chat_text("call C, B", ""), ["B"]);
        assert_eq!(chat_text("I will call you later", ""), ["A"]);
        assert_eq!(chat_text("recall B", ""), ["A"]);
        // A named tool choice and parallel calls turned off each win over the text.
        assert_eq!(
            chat_text(
                "call A, B",
                r#","tool_choice":{"type":"function","function":{"name":"B"}}"#
            ),
            ["B"]
        );
        assert_eq!(
            chat_text("call B, A", r#","parallel_tool_calls":false"#),
            ["B"]
        );
        let one = format!(
            r#"{{{MESSAGES_TOOLS},"messages":[{{"role":"user","content":"call B, A"}}],"tool_choice":{{"type":"auto","disable_parallel_tool_use":true}}}}"#
        );
        assert_eq!(names(&calls(Endpoint::Messages, &one)), ["B"]);
    }

    fn two_calls() -> Vec<ToolCall> {
        ["A", "B"]
            .into_iter()
            .zip(0..)
            .map(|(name, index)| ToolCall {
                index,
                id: format!("i{index}"),
                name: name.into(),
                argument: "q".into(),
            })
            .collect()
    }

    /// Each call's arguments, gathered from the pieces of a choice's chunks.
    fn gathered(pieces: impl IntoIterator<Item = (u32, String)>) -> Vec<String> {
        let mut out = vec![String::new(); 2];
        for (call, text) in pieces {
            out[call as usize] += &text;
        }
        out
    }

    #[test]
    fn content_is_shared_out_over_the_calls_and_every_call_closes() {
        let calls = two_calls();
        let mut open = None;
        let mut pieces = fragments(&calls, &mut open, "a", 0, false);
        pieces.extend(fragments(&calls, &mut open, "b", 1, false));
        pieces.extend(fragments(&calls, &mut open, "c", 1, true));
        assert_eq!(gathered(pieces), [r#"{"q": "a"}"#, r#"{"q": "bc"}"#]);
        // One chunk for both: the first call is made whole and empty.
        let mut open = None;
        let pieces = fragments(&calls, &mut open, "x", 0, true);
        assert_eq!(
            pieces,
            [(0, r#"{"q": ""}"#.into()), (1, r#"{"q": "x"}"#.into())]
        );
        assert!(fragments(&[], &mut None, "x", 0, true).is_empty());
    }

    #[test]
    fn halves_cut_at_a_character_boundary() {
        assert_eq!(halves("search"), ("sea", "rch"));
        assert_eq!(halves("aé"), ("a", "é"));
        assert_eq!(halves("é"), ("é", ""));
        assert_eq!(halves(""), ("", ""));
    }
}
