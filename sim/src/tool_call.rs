//! Tool calls. When a request carries `tools` and its `tool_choice` is not `"none"`, the answer
//! is one call of one tool: the tool `tool_choice` names, else the first with a name. Its
//! arguments are a JSON object of one string field — the first property of the tool's parameter
//! schema, else `query` — which the generated text fills: `{"query": " the cache of"}`. Every
//! generated token is a fragment of the arguments (the first opens the object, the last closes
//! it), so the fragments streamed add up to the arguments a whole body carries, and the
//! tokens are billed as completion tokens like any others.
//!
//! Tools are read from each API's own shape: chat's `{"type": "function", "function": {"name",
//! "parameters"}}`, the Responses API's `{"type": "function", "name", "parameters"}` and
//! Anthropic's `{"name", "input_schema"}`.

use std::fmt;

use serde::de::{IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::value::RawValue;
use weir_core::endpoint::Endpoint;
use weir_core::error::ApiError;

/// The argument the generated text fills when the tool's schema names none.
const DEFAULT_ARGUMENT: &str = "query";

/// The one tool call an answer makes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// The call's id: `chatcmpl-tool-…` (chat), `call_…` (Responses), `toolu_…` (Messages).
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
    /// The call a request's answer makes, if any. `key` makes the call's id unique.
    pub fn of_request(
        endpoint: Endpoint,
        body: &[u8],
        key: &str,
    ) -> Result<Option<ToolCall>, ApiError> {
        if !matches!(
            endpoint,
            Endpoint::ChatCompletions | Endpoint::Responses | Endpoint::Messages
        ) {
            return Ok(None);
        }
        let tools: Tools = serde_json::from_slice(body).map_err(|e| {
            ApiError::bad_request(format!("invalid request: tools: {e}")).with_param("tools")
        })?;
        let defs = tools.tools.unwrap_or_default();
        if tools.tool_choice.as_ref().is_some_and(ToolChoice::is_none) {
            return Ok(None);
        }
        let named = tools.tool_choice.as_ref().and_then(ToolChoice::named);
        let chosen = named
            .and_then(|n| defs.iter().find(|d| d.name() == Some(n)))
            .or_else(|| defs.iter().find(|d| d.name().is_some()));
        let Some((def, name)) = chosen.and_then(|d| Some((d, d.name()?))) else {
            return Ok(None);
        };
        let id = match endpoint {
            Endpoint::Responses => format!("call_{key}"),
            Endpoint::Messages => format!("toolu_{key}"),
            _ => format!("chatcmpl-tool-{key}"),
        };
        Ok(Some(ToolCall {
            id,
            name: name.to_owned(),
            argument: def
                .first_property()
                .unwrap_or_else(|| DEFAULT_ARGUMENT.to_owned()),
        }))
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

    /// The opening tool-call delta of a chat stream: id, type and name, no arguments yet.
    pub fn opening_delta(&self) -> ToolCallDelta<'_> {
        ToolCallDelta {
            index: 0,
            id: Some(&self.id),
            kind: Some("function"),
            function: FunctionDelta {
                name: Some(&self.name),
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
    /// A chat stream's delta carrying a fragment of the arguments.
    pub fn arguments(fragment: &'a str) -> Self {
        ToolCallDelta {
            index: 0,
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

    fn call(endpoint: Endpoint, body: &str) -> Option<ToolCall> {
        ToolCall::of_request(endpoint, body.as_bytes(), "k").unwrap()
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
            id: "i".into(),
            name: "f".into(),
            argument: "q\"".into(),
        };
        let joined = call.fragment(" the", true, false) + &call.fragment(" \"a\"", false, true);
        let v: serde_json::Value = serde_json::from_str(&joined).unwrap();
        assert_eq!(v, serde_json::json!({"q\"": " the \"a\""}));
        assert_eq!(call.fragment("x", true, true), "{\"q\\\"\": \"x\"}");
    }
}
