//! OpenAI's Responses API: what a request puts into the prompt — `instructions`, then `input`
//! (a string, or items: messages with content parts, function calls and their outputs,
//! reasoning), with `tools`, `text.format` schemas and any other text-bearing field counted in
//! the first turn.
//!
//! State the engine would load from its own store is refused: `previous_response_id`,
//! `conversation`, `item_reference` items and `prompt` templates bring a prompt weir cannot
//! count, and stored responses are one namespace per engine, not per tenant — a tenant naming
//! another's response id would read its conversation. `background` requests run detached from
//! the connection weir meters, so they are refused too.

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::error::ApiError;
use crate::request::completions::MessageContent;
use crate::request::fields::{COMMON_FIELDS, field};
use crate::request::prompt::{
    OUTSIDE_PROMPT, Prompt, RawObject, borrowed, extra_texts, raw_array, raw_object,
};
use crate::tokens::ChatTurn;

/// The prompt-bearing part of a Responses request.
#[derive(Clone, Debug, Default)]
pub struct ResponsesRequest {
    pub instructions: Option<String>,
    pub input: Option<ResponsesInput>,
    /// Fields naming stored state or detached runs that were set (see the module doc).
    pub stateful: Option<&'static str>,
    /// The type of the first tool the engine would run itself (see [`CLIENT_TOOLS`]).
    pub engine_tool: Option<String>,
    pub extra: Vec<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum ResponsesInput {
    Text(String),
    Items(Vec<ResponsesItem>),
}

/// One input item: a message (`type` may be omitted), a function call, its output, reasoning...
#[derive(Clone, Debug, Deserialize)]
pub struct ResponsesItem {
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub role: Option<String>,
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// What of a tool call's output is not text, if anything (see [`non_text_output`]); the
    /// output itself is counted with the item's other fields.
    #[serde(skip)]
    pub non_text_output: Option<String>,
    /// The rendered text of the item's other fields (names, arguments, outputs, summaries).
    #[serde(skip)]
    pub extra: Vec<String>,
}

const ITEM_FIELDS: [&str; 3] = ["type", "role", "content"];

/// Fields a Responses request carries that stay out of the prompt.
const RESPONSES_OUTSIDE: [&str; 7] = [
    "store",
    "include",
    "truncation",
    "parallel_tool_calls",
    "max_tool_calls",
    "top_logprobs",
    "background",
];

/// Fields [`ResponsesRequest`] reads itself (the stateful ones are refused).
const REQUEST_FIELDS: [&str; 5] = [
    "instructions",
    "input",
    "previous_response_id",
    "conversation",
    "prompt",
];

const MESSAGE_ROLES: [&str; 4] = ["user", "assistant", "system", "developer"];

/// Tools the client runs, whose calls come back to it as output items: the only ones served.
/// Every other type (`web_search`, `code_interpreter`, `mcp`, `file_search`, ...) the engine
/// runs itself, in a loop in which vLLM lets each turn after the first generate up to the rest
/// of the context, whatever `max_output_tokens` says, and calls out to tool servers: output no
/// reservation bounds and work weir does not see. A `namespace` groups tools and is judged by
/// them.
const CLIENT_TOOLS: [&str; 2] = ["function", "custom"];

/// The type of the first tool in `tools` (a raw array) that is not run by the client.
fn engine_tool(tools: &RawValue) -> Option<String> {
    let Some(tools) = raw_array(tools) else {
        return (tools.get() != "null").then(|| "tools".to_owned());
    };
    tools.into_iter().find_map(|tool| {
        let fields = raw_object(tool)?;
        let kind: Option<String> = fields
            .get("type")
            .and_then(|t| serde_json::from_str(t.get()).ok());
        match kind.as_deref() {
            Some(kind) if CLIENT_TOOLS.contains(&kind) => None,
            Some("namespace") => fields.get("tools").and_then(|t| engine_tool(t)),
            Some(kind) => Some(kind.to_owned()),
            None => Some("untyped".to_owned()),
        }
    })
}

/// [`ResponsesRequest::check_engine_state`] of a request's raw body. A body that is no JSON
/// object has no such state (the engine refuses it); one whose fields are malformed is
/// refused for them.
pub fn check_engine_state(body: &[u8]) -> Result<(), ApiError> {
    let Ok(top) = serde_json::from_slice::<RawObject<'_>>(body) else {
        return Ok(());
    };
    ResponsesRequest::from_fields(&top)?.check_engine_state()
}

impl ResponsesItem {
    /// The chat role the item is rendered as.
    fn role(&self) -> &str {
        match self.kind.as_deref() {
            None | Some("message") => self.role.as_deref().unwrap_or("user"),
            Some(kind) if kind.ends_with("_output") => "tool",
            Some(_) => "assistant",
        }
    }

    /// The first part of the item that carries no text, in its content or its tool output.
    fn non_text_part(&self) -> Option<&str> {
        self.content
            .as_ref()
            .and_then(MessageContent::non_text_part)
            .or(self.non_text_output.as_deref())
    }
}

/// What of a tool call's `output` is not text: a string is text, parts are as text as their
/// kinds (an engine renders them as the tool message's content, an image part as an image of
/// the prompt), anything else (a screenshot object) is not text.
fn non_text_output(output: &RawValue) -> Option<String> {
    match output.get().as_bytes().first() {
        Some(b'"' | b'n') => None,
        Some(b'[') => match serde_json::from_str::<MessageContent>(output.get()) {
            Ok(parts) => parts.non_text_part().map(str::to_owned),
            Err(_) => Some("output".to_owned()),
        },
        _ => Some(
            raw_object(output)
                .and_then(|o| {
                    o.get("type")
                        .and_then(|t| serde_json::from_str(t.get()).ok())
                })
                .unwrap_or_else(|| "output".to_owned()),
        ),
    }
}

fn is_set(raw: Option<&&RawValue>) -> bool {
    raw.is_some_and(|v| !matches!(v.get(), "null" | "false"))
}

impl ResponsesRequest {
    pub fn from_fields(top: &RawObject<'_>) -> Result<Self, ApiError> {
        let stateful = [
            "previous_response_id",
            "conversation",
            "prompt",
            "background",
        ]
        .into_iter()
        .find(|f| is_set(top.get(*f)));
        let mut req = ResponsesRequest {
            instructions: field(top, "instructions")?,
            input: field(top, "input")?,
            stateful,
            engine_tool: top.get("tools").and_then(|t| engine_tool(t)),
            extra: extra_texts(
                top,
                &[
                    &COMMON_FIELDS,
                    &REQUEST_FIELDS,
                    &RESPONSES_OUTSIDE,
                    &OUTSIDE_PROMPT,
                ],
            ),
        };
        let raw_items = top.get("input").and_then(|i| raw_array(i));
        if let (Some(ResponsesInput::Items(items)), Some(raw)) = (&mut req.input, raw_items) {
            for (item, raw) in items.iter_mut().zip(raw) {
                let Some(fields) = raw_object(raw) else {
                    continue;
                };
                item.extra = extra_texts(&fields, &[&ITEM_FIELDS]);
                item.non_text_output = fields.get("output").and_then(|o| non_text_output(o));
                if let Some(content) = &mut item.content {
                    content.read_extras(fields.get("content").copied());
                }
            }
        }
        Ok(req)
    }

    pub fn validate(&self) -> Result<(), ApiError> {
        self.check_engine_state()?;
        let items = match &self.input {
            None => return Err(ApiError::bad_request("input is required").with_param("input")),
            Some(ResponsesInput::Text(_)) => return Ok(()),
            Some(ResponsesInput::Items(items)) => items,
        };
        if items.is_empty() {
            return Err(ApiError::bad_request("input must not be empty").with_param("input"));
        }
        for (i, item) in items.iter().enumerate() {
            if matches!(item.kind.as_deref(), None | Some("message"))
                && !MESSAGE_ROLES.contains(&item.role())
            {
                return Err(ApiError::bad_request(format!(
                    "input[{i}].role '{}' is not one of {}",
                    item.role(),
                    MESSAGE_ROLES.join(", ")
                ))
                .with_param("input"));
            }
            if let Some(kind) = item.non_text_part() {
                return Err(ApiError::bad_request(format!(
                    "input[{i}].content: only text parts are supported, got '{kind}'"
                ))
                .with_param("input"));
            }
        }
        Ok(())
    }

    /// Refuses what would have the engine run state weir can neither keep within the tenant
    /// nor count: stored responses and conversations, stored items, prompt templates, detached
    /// runs, and tools the engine runs itself (see the module doc). The sidecar, the last hop,
    /// checks this on every route, whatever the front door's mode ([`check_engine_state`]).
    pub fn check_engine_state(&self) -> Result<(), ApiError> {
        if let Some(param) = self.stateful {
            return Err(ApiError::bad_request(format!(
                "{param} is not supported by this gateway: it runs state the engine keeps, \
                 which weir can neither count nor keep within your tenant; send the whole \
                 conversation in `input`"
            ))
            .with_param(param));
        }
        if let Some(kind) = &self.engine_tool {
            return Err(ApiError::bad_request(format!(
                "tools of type '{kind}' are not supported by this gateway: the engine would run \
                 them itself, past the output limit weir reserved; use function tools"
            ))
            .with_param("tools"));
        }
        let items = match &self.input {
            Some(ResponsesInput::Items(items)) => items.as_slice(),
            _ => &[],
        };
        if let Some(i) =
            (items.iter()).position(|item| item.kind.as_deref() == Some("item_reference"))
        {
            return Err(ApiError::bad_request(format!(
                "input[{i}]: item_reference is not supported by this gateway (a stored item \
                 weir cannot count); send the item itself"
            ))
            .with_param("input"));
        }
        Ok(())
    }

    /// Everything the engine puts into the prompt. Call after [`validate`](Self::validate).
    pub fn prompt(&self) -> Prompt<'_> {
        let mut turns: Vec<ChatTurn<'_>> = Vec::new();
        if let Some(instructions) = &self.instructions {
            turns.push(ChatTurn {
                role: "system",
                name: None,
                content: vec![instructions.as_str().into()],
            });
        }
        match &self.input {
            Some(ResponsesInput::Text(text)) => turns.push(ChatTurn {
                role: "user",
                name: None,
                content: vec![text.as_str().into()],
            }),
            Some(ResponsesInput::Items(items)) => turns.extend(items.iter().map(|item| {
                let mut content = item.content.as_ref().map(|c| c.texts()).unwrap_or_default();
                content.extend(borrowed(&item.extra));
                ChatTurn {
                    role: item.role(),
                    name: None,
                    content,
                }
            })),
            None => {}
        }
        if let Some(first) = turns.first_mut() {
            first.content.extend(borrowed(&self.extra));
        }
        Prompt::Chat(turns)
    }
}

#[cfg(test)]
mod tests {
    use crate::endpoint::Endpoint;
    use crate::error::ApiError;
    use crate::request::InferenceRequest;
    use crate::tokens::Encoding;

    fn check(body: &str) -> Result<InferenceRequest, ApiError> {
        let req = InferenceRequest::parse(Endpoint::Responses, body.as_bytes())?;
        req.validate()?;
        Ok(req)
    }

    fn tokens(body: &str) -> usize {
        let req = check(body).unwrap();
        req.prompt_tokens(Encoding::Cl100kBase).unwrap()[0].len()
    }

    #[test]
    fn instructions_input_items_and_tools_are_all_in_the_prompt() {
        let plain = tokens(r#"{"model":"m","input":"hello"}"#);
        let instructed = tokens(r#"{"model":"m","instructions":"be brief","input":"hello"}"#);
        assert!(instructed > plain + 2, "{instructed} vs {plain}");
        let items = tokens(
            r#"{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"hello"}]},
                {"type":"function_call","call_id":"c1","name":"get_weather","arguments":"{\"city\":\"Paris\"}"},
                {"type":"function_call_output","call_id":"c1","output":"sunny and warm"}]}"#,
        );
        assert!(items > plain + 15, "{items}");
        let tools = tokens(
            r#"{"model":"m","input":"hello","tools":[{"type":"function","name":"get_weather",
                "description":"Look up the weather in a city","parameters":{"type":"object"}}]}"#,
        );
        assert!(tools > plain + 15, "{tools}");
        let outside = tokens(
            r#"{"model":"m","input":"hello","store":false,"truncation":"auto","include":["reasoning.encrypted_content"]}"#,
        );
        assert_eq!(outside, plain);
    }

    #[test]
    fn state_kept_by_the_engine_is_refused() {
        for body in [
            r#"{"model":"m","input":"x","previous_response_id":"resp_1"}"#,
            r#"{"model":"m","input":"x","conversation":"conv_1"}"#,
            r#"{"model":"m","input":"x","background":true}"#,
            r#"{"model":"m","input":"x","prompt":{"id":"pmpt_1"}}"#,
            r#"{"model":"m","input":[{"type":"item_reference","id":"msg_1"}]}"#,
        ] {
            let err = check(body).err();
            assert!(err.is_some_and(|e| e.status == 400), "{body}");
        }
        assert!(
            check(r#"{"model":"m","input":"x","background":false,"previous_response_id":null}"#)
                .is_ok()
        );
    }

    #[test]
    fn inputs_must_be_text() {
        assert!(check(r#"{"model":"m"}"#).is_err());
        assert!(check(r#"{"model":"m","input":[]}"#).is_err());
        assert!(check(r#"{"model":"m","input":[{"role":"wizard","content":"x"}]}"#).is_err());
        assert!(check(r#"{"model":"m","input":[{"role":"user","content":[{"type":"input_image","image_url":"x"}]}]}"#).is_err());
    }

    #[test]
    fn tools_the_engine_runs_itself_are_refused() {
        // vLLM runs built-in tools in a loop of its own, each turn after the first allowed the
        // rest of the context whatever max_output_tokens says.
        for tool in [
            r#"{"type":"code_interpreter","container":{"type":"auto"}}"#,
            r#"{"type":"web_search_preview"}"#,
            r#"{"type":"mcp","server_label":"python","server_url":"http://x"}"#,
            r#"{"type":"namespace","name":"n","tools":[{"type":"web_search"}]}"#,
            r#"{"name":"untyped"}"#,
        ] {
            let body =
                format!(r#"{{"model":"m","input":"x","max_output_tokens":5,"tools":[{tool}]}}"#);
            let err = check(&body).err();
            assert!(
                err.is_some_and(|e| e.status == 400 && e.param.as_deref() == Some("tools")),
                "{tool}"
            );
        }
        let client_run = r#"{"model":"m","input":"x","tools":[
            {"type":"function","name":"f","parameters":{}},
            {"type":"custom","name":"c"},
            {"type":"namespace","name":"n","tools":[{"type":"function","name":"g"}]}]}"#;
        assert!(check(client_run).is_ok());
    }

    #[test]
    fn a_tool_output_must_be_text_too() {
        // vLLM renders a function call's output as the tool message's content: its parts are
        // parts of the prompt, an image one included.
        let output = |output: &str| {
            format!(
                r#"{{"model":"m","input":[{{"type":"function_call","call_id":"c1","name":"f","arguments":"{{}}"}},
                    {{"type":"function_call_output","call_id":"c1","output":{output}}}]}}"#
            )
        };
        for bad in [
            r#"[{"type":"input_image","image_url":"https://example.com/a.png"}]"#,
            r#"[{"type":"input_text","text":"see"},{"type":"input_file","file_url":"x"}]"#,
            r#"{"type":"computer_screenshot","image_url":"https://example.com/a.png"}"#,
        ] {
            let err = check(&output(bad)).err();
            assert!(err.is_some_and(|e| e.status == 400), "{bad}");
        }
        assert!(check(&output(r#""sunny""#)).is_ok());
        assert!(check(&output(r#"[{"type":"input_text","text":"sunny"}]"#)).is_ok());
    }
}
