//! The tools a request offers the model, judged by a key's tool policy before the engine sees
//! them: a blocked tool refuses the request (`tool_blocked`, naming it and where it is) or is
//! taken out of it, whichever the policy says.
//!
//! A tool's name is where its API puts it: chat's `tools[].function.name` (or a custom tool's
//! `custom.name`), the Responses API's and Messages' `tools[].name`; a Responses `namespace`
//! offers the tools inside it. Chat's legacy `functions` are refused under a policy: the calls
//! they make (`function_call`) are not read as they stream.

use serde_json::Value;
use serde_json::value::RawValue;

use super::events::RESPONSES_CALL_KINDS;
use super::withheld::{Policy, tool_blocked};
use crate::error::ApiError;

/// What a request offers, judged.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Offer {
    /// The names of the tools offered (and kept): a call to any other name fails closed.
    pub names: Vec<String>,
    /// The body's `tools` after removal, when a tool was removed (`None` inside: none left,
    /// the field goes, and `tool_choice` with it).
    pub rewritten: Option<Option<String>>,
}

/// The request's offered tools judged by `blocked`. `remove`: a blocked tool is taken out
/// rather than refused; a `tool_choice` naming one is refused still (the caller asked for a
/// call the policy forbids).
pub fn judge(
    tools: Option<&RawValue>,
    functions: Option<&RawValue>,
    tool_choice: Option<&RawValue>,
    blocked: impl Fn(&str) -> bool,
    remove: bool,
) -> Result<Offer, ApiError> {
    if functions.is_some_and(|f| f.get() != "null") {
        return Err(ApiError::bad_request(
            "`functions` is not accepted under a tool policy: offer the functions in `tools`",
        )
        .with_param("functions"));
    }
    let Some(tools) = tools.filter(|t| t.get() != "null") else {
        return Ok(Offer::default());
    };
    let mut tools: Value = serde_json::from_str(tools.get())
        .map_err(|e| ApiError::bad_request(format!("tools: {e}")).with_param("tools"))?;
    let mut offer = Offer::default();
    let mut removed = Vec::new();
    walk(
        &mut tools,
        "tools",
        &blocked,
        remove,
        &mut offer.names,
        &mut removed,
    )?;
    if removed.is_empty() {
        return Ok(offer);
    }
    if let Some(tool) = tool_choice.and_then(|c| chosen(c, &removed)) {
        return Err(tool_blocked(&tool, Policy::Blocked).with_param("tool_choice"));
    }
    let empty = tools.as_array().is_some_and(Vec::is_empty);
    offer.rewritten = Some((!empty).then(|| tools.to_string()));
    Ok(offer)
}

/// Judges the tools of one array (`at` names it, for `param`), recursing into namespaces;
/// removes the blocked ones when `remove`, else refuses the first.
fn walk(
    tools: &mut Value,
    at: &str,
    blocked: &impl Fn(&str) -> bool,
    remove: bool,
    names: &mut Vec<String>,
    removed: &mut Vec<String>,
) -> Result<(), ApiError> {
    let Some(items) = tools.as_array_mut() else {
        return Ok(());
    };
    let mut kept = Vec::with_capacity(items.len());
    for (i, mut item) in std::mem::take(items).into_iter().enumerate() {
        let param = format!("{at}[{i}]");
        if let Some(inner) = item.get_mut("tools") {
            walk(
                inner,
                &format!("{param}.tools"),
                blocked,
                remove,
                names,
                removed,
            )?;
        }
        let Some(name) = name_of(&item) else {
            kept.push(item);
            continue;
        };
        if !blocked(&name) {
            names.push(name);
            kept.push(item);
        } else if remove {
            removed.push(name);
        } else {
            return Err(tool_blocked(&name, Policy::Blocked).with_param(&param));
        }
    }
    *items = kept;
    Ok(())
}

/// A tool definition's name, wherever its API puts it; a Responses built-in tool the client
/// runs (`{"type": "local_shell"}`) is named by its type, as its calls are.
fn name_of(tool: &Value) -> Option<String> {
    let name = (tool.pointer("/function/name"))
        .or_else(|| tool.pointer("/custom/name"))
        .or_else(|| tool.get("name"))
        .or_else(|| {
            let kind = tool.get("type")?;
            let builtin = (RESPONSES_CALL_KINDS.iter()).any(|(_, t)| kind.as_str() == *t);
            builtin.then_some(kind)
        })?;
    name.as_str().map(str::to_owned)
}

/// The removed tool a `tool_choice` names, if it names one (at any depth: chat's
/// `{"function": {"name"}}`, the Responses and Messages `{"name"}`, allowed-tools lists).
fn chosen(choice: &RawValue, removed: &[String]) -> Option<String> {
    let choice: Value = serde_json::from_str(choice.get()).ok()?;
    let mut stack = vec![&choice];
    while let Some(value) = stack.pop() {
        match value {
            Value::Object(fields) => {
                if let Some(Value::String(name)) = fields.get("name")
                    && removed.contains(name)
                {
                    return Some(name.clone());
                }
                stack.extend(fields.values());
            }
            Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    None
}

/// The names of the tools a request body offers, in any API's shape, before a policy judged
/// them (a body that is not JSON, or offers none, names none).
pub fn offered_names(body: &[u8]) -> Vec<String> {
    #[derive(serde::Deserialize)]
    struct Tools<'a> {
        #[serde(borrow)]
        tools: Option<&'a RawValue>,
    }
    let tools = serde_json::from_slice::<Tools>(body)
        .ok()
        .and_then(|t| t.tools);
    judge(tools, None, None, |_| false, false).map_or_else(|_| Vec::new(), |offer| offer.names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offered_tools_are_named_in_each_api_shape() {
        let chat = br#"{"tools":[{"type":"function","function":{"name":"send_email"}},
                                 {"type":"function","function":{"name":"search"}}]}"#;
        let responses = br#"{"tools":[{"type":"function","name":"send_email"},
                                      {"type":"web_search"},{"type":"function","name":"search"}]}"#;
        let messages = br#"{"tools":[{"name":"send_email","input_schema":{}},{"name":"search"}]}"#;
        let both = ["send_email", "search"];
        for body in [&chat[..], responses, messages] {
            assert_eq!(offered_names(body), both);
        }
        assert!(offered_names(br#"{"model":"m"}"#).is_empty());
        assert!(offered_names(b"not json").is_empty());
    }

    fn raw(json: &str) -> Box<RawValue> {
        RawValue::from_string(json.to_owned()).unwrap()
    }

    const CHAT: &str = r#"[{"type":"function","function":{"name":"search"}},
        {"type":"function","function":{"name":"shell_rm"}}]"#;
    const RESPONSES: &str = r#"[{"type":"function","name":"search"},
        {"type":"namespace","name":"ops","tools":[{"type":"function","name":"shell_rm"}]}]"#;
    const MESSAGES: &str =
        r#"[{"name":"search","input_schema":{}},{"name":"shell_rm","input_schema":{}}]"#;

    fn shell(name: &str) -> bool {
        name.starts_with("shell_")
    }

    #[test]
    fn a_blocked_tool_offered_is_refused_naming_it_and_where_it_is_in_each_api() {
        for (tools, param) in [
            (CHAT, "tools[1]"),
            (RESPONSES, "tools[1].tools[0]"),
            (MESSAGES, "tools[1]"),
        ] {
            let error = judge(Some(&raw(tools)), None, None, shell, false).unwrap_err();
            let body = error.to_json();
            assert_eq!(error.status, 403);
            assert_eq!(body["error"]["code"], "tool_blocked", "{body}");
            assert_eq!(body["error"]["type"], "tool_blocked", "{body}");
            assert_eq!(body["error"]["param"], param, "{body}");
            assert_eq!(body["error"]["tool"], "shell_rm", "{body}");
            assert_eq!(body["error"]["policy"], "blocked", "{body}");
        }
    }

    #[test]
    fn a_blocked_tool_is_removed_when_the_policy_says_so() {
        for tools in [CHAT, RESPONSES, MESSAGES] {
            let offer = judge(Some(&raw(tools)), None, None, shell, true).unwrap();
            assert_eq!(offer.names.first().map(String::as_str), Some("search"));
            assert!(!offer.names.iter().any(|n| n == "shell_rm"));
            let rewritten = offer.rewritten.unwrap().unwrap();
            assert!(!rewritten.contains("shell_rm"), "{rewritten}");
            assert!(rewritten.contains("search"), "{rewritten}");
        }
        let only = r#"[{"name":"shell_ls"}]"#;
        let offer = judge(Some(&raw(only)), None, None, shell, true).unwrap();
        assert_eq!(offer.rewritten, Some(None), "none left: the field goes");
    }

    #[test]
    fn a_tool_choice_naming_a_removed_tool_is_refused() {
        for choice in [
            r#"{"type":"function","function":{"name":"shell_rm"}}"#,
            r#"{"type":"tool","name":"shell_rm"}"#,
        ] {
            let error = judge(Some(&raw(CHAT)), None, Some(&raw(choice)), shell, true).unwrap_err();
            assert_eq!(error.param.as_deref(), Some("tool_choice"));
            assert_eq!(error.code, Some("tool_blocked"));
        }
        let auto = raw(r#""auto""#);
        assert!(judge(Some(&raw(CHAT)), None, Some(&auto), shell, true).is_ok());
    }

    #[test]
    fn allowed_tools_pass_as_they_came_and_legacy_functions_are_refused() {
        let offer = judge(Some(&raw(CHAT)), None, None, |_| false, false).unwrap();
        assert_eq!(offer.names, ["search", "shell_rm"]);
        assert_eq!(offer.rewritten, None, "nothing removed, nothing rewritten");
        assert_eq!(
            judge(None, None, None, shell, false).unwrap(),
            Offer::default()
        );
        let functions = raw(r#"[{"name":"search"}]"#);
        let error = judge(None, Some(&functions), None, shell, false).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("functions"));
    }
}
