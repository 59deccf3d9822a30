//! The tools a request offers the model, by name, in the called API's shape.

use serde_json::Value;

use crate::endpoint::Endpoint;

/// The names of the tools `body` offers: Chat Completions' `tools[].function.name`, the
/// Responses API's and Messages' `tools[].name`. Built-in tools without a name (a Responses
/// `web_search`) and entries of another shape are left out; a body that is not JSON offers
/// none. Completions and embeddings offer none.
pub fn offered_names(endpoint: Endpoint, body: &[u8]) -> Vec<String> {
    let name: fn(&Value) -> Option<&str> = match endpoint {
        Endpoint::ChatCompletions => |t| t.get("function")?.get("name")?.as_str(),
        Endpoint::Responses | Endpoint::Messages => |t| t.get("name")?.as_str(),
        Endpoint::Completions | Endpoint::Embeddings => return Vec::new(),
    };
    let Ok(body) = serde_json::from_slice::<Value>(body) else {
        return Vec::new();
    };
    let tools = body.get("tools").and_then(Value::as_array);
    (tools.into_iter().flatten())
        .filter_map(name)
        .map(str::to_owned)
        .collect()
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
        assert_eq!(offered_names(Endpoint::ChatCompletions, chat), both);
        assert_eq!(offered_names(Endpoint::Responses, responses), both);
        assert_eq!(offered_names(Endpoint::Messages, messages), both);
        // Another API's shape names nothing here; neither does a body without tools.
        assert!(offered_names(Endpoint::ChatCompletions, messages).is_empty());
        assert!(offered_names(Endpoint::Messages, br#"{"model":"m"}"#).is_empty());
        assert!(offered_names(Endpoint::Messages, b"not json").is_empty());
        assert!(offered_names(Endpoint::Completions, chat).is_empty());
    }
}
