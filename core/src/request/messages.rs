//! Anthropic's Messages API: what a request puts into the prompt — `system` (a string or text
//! blocks), then `messages` with their content blocks (text, thinking, tool use with its input,
//! tool results), with `tools` and any other text-bearing field counted in the first turn.
//! `max_tokens` is required, as Anthropic's API requires it.

use serde::Deserialize;

use crate::error::ApiError;
use crate::request::fields::{COMMON_FIELDS, field};
use crate::request::prompt::{
    OUTSIDE_PROMPT, Prompt, RawObject, borrowed, extra_texts, raw_array, raw_object,
};
use crate::tokens::ChatTurn;

/// The prompt-bearing part of a Messages request.
#[derive(Clone, Debug, Default)]
pub struct MessagesRequest {
    pub system: Option<Content>,
    pub messages: Option<Vec<Message>>,
    pub extra: Vec<String>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Content,
    #[serde(skip)]
    pub extra: Vec<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

/// A content block. `text` and `thinking` are read as text; a block's other fields (a tool
/// use's name and input, a tool result's content, ...) are counted as their rendered text.
#[derive(Clone, Debug, Deserialize)]
pub struct Block {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub thinking: Option<String>,
    /// What a block holds inside (a tool result's content): read only to check that it is
    /// text, as it is counted with the block's other fields.
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(skip)]
    pub extra: Vec<String>,
}

/// Block fields read as text, and those templates never render.
const BLOCK_FIELDS: [&str; 6] = [
    "type",
    "text",
    "thinking",
    "cache_control",
    "signature",
    "citations",
];

/// Blocks that carry no text weir can count.
const NON_TEXT_BLOCKS: [&str; 3] = ["image", "document", "container_upload"];

const MESSAGE_FIELDS: [&str; 2] = ["role", "content"];

const REQUEST_FIELDS: [&str; 2] = ["system", "messages"];

/// Fields of a Messages request that stay out of the prompt.
const MESSAGES_OUTSIDE: [&str; 4] = ["stop_sequences", "thinking", "top_k", "context_management"];

const ROLES: [&str; 2] = ["user", "assistant"];

impl Content {
    fn read_extras(&mut self, raw: Option<&serde_json::value::RawValue>) {
        let raw_blocks = raw.and_then(raw_array);
        if let (Content::Blocks(blocks), Some(raw)) = (self, raw_blocks) {
            for (block, raw) in blocks.iter_mut().zip(raw) {
                if let Some(fields) = raw_object(raw) {
                    block.extra = extra_texts(&fields, &[&BLOCK_FIELDS]);
                }
            }
        }
    }

    fn texts(&self) -> Vec<std::borrow::Cow<'_, str>> {
        match self {
            Content::Text(t) => vec![t.as_str().into()],
            Content::Blocks(blocks) => blocks
                .iter()
                .flat_map(|b| {
                    [&b.text, &b.thinking]
                        .into_iter()
                        .flatten()
                        .map(|t| t.as_str().into())
                        .chain(borrowed(&b.extra))
                })
                .collect(),
        }
    }

    /// The first block that carries no text, at any depth (an image inside a tool result is
    /// an image of the prompt too).
    fn non_text_block(&self) -> Option<&str> {
        match self {
            Content::Text(_) => None,
            Content::Blocks(blocks) => blocks.iter().find_map(|b| {
                if NON_TEXT_BLOCKS.contains(&b.kind.as_str()) {
                    Some(b.kind.as_str())
                } else {
                    b.content.as_ref().and_then(Content::non_text_block)
                }
            }),
        }
    }
}

impl MessagesRequest {
    pub fn from_fields(top: &RawObject<'_>) -> Result<Self, ApiError> {
        let mut req = MessagesRequest {
            system: field(top, "system")?,
            messages: field(top, "messages")?,
            extra: extra_texts(
                top,
                &[
                    &COMMON_FIELDS,
                    &REQUEST_FIELDS,
                    &MESSAGES_OUTSIDE,
                    &OUTSIDE_PROMPT,
                ],
            ),
        };
        if let Some(system) = &mut req.system {
            system.read_extras(top.get("system").copied());
        }
        let raw_messages = top.get("messages").and_then(|m| raw_array(m));
        if let (Some(messages), Some(raw)) = (&mut req.messages, raw_messages) {
            for (message, raw) in messages.iter_mut().zip(raw) {
                if let Some(fields) = raw_object(raw) {
                    message.extra = extra_texts(&fields, &[&MESSAGE_FIELDS]);
                    message.content.read_extras(fields.get("content").copied());
                }
            }
        }
        Ok(req)
    }

    /// `max_tokens` is the request's own output limit, required by the API.
    pub fn validate(&self, max_tokens: Option<u32>) -> Result<(), ApiError> {
        if max_tokens.is_none() {
            return Err(
                ApiError::bad_request("max_tokens: Field required").with_param("max_tokens")
            );
        }
        let messages = match &self.messages {
            Some(m) if !m.is_empty() => m,
            _ => {
                return Err(
                    ApiError::bad_request("messages: at least one message is required")
                        .with_param("messages"),
                );
            }
        };
        for (i, m) in messages.iter().enumerate() {
            if !ROLES.contains(&m.role.as_str()) {
                return Err(ApiError::bad_request(format!(
                    "messages.{i}.role: '{}' is not one of {}",
                    m.role,
                    ROLES.join(", ")
                ))
                .with_param("messages"));
            }
        }
        let contents = self
            .system
            .iter()
            .chain(messages.iter().map(|m| &m.content));
        if let Some(kind) = contents.filter_map(Content::non_text_block).next() {
            return Err(ApiError::bad_request(format!(
                "only text content blocks are supported, got '{kind}'"
            ))
            .with_param("messages"));
        }
        Ok(())
    }

    /// Everything the engine puts into the prompt. Call after [`validate`](Self::validate).
    pub fn prompt(&self) -> Prompt<'_> {
        let system = self.system.iter().map(|s| ChatTurn {
            role: "system",
            name: None,
            content: s.texts(),
        });
        let messages = self.messages.iter().flatten().map(|m| {
            let mut content = m.content.texts();
            content.extend(borrowed(&m.extra));
            ChatTurn {
                role: &m.role,
                name: None,
                content,
            }
        });
        let mut turns: Vec<ChatTurn<'_>> = system.chain(messages).collect();
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
        let req = InferenceRequest::parse(Endpoint::Messages, body.as_bytes())?;
        req.validate()?;
        Ok(req)
    }

    fn tokens(body: &str) -> usize {
        check(body)
            .unwrap()
            .prompt_tokens(Encoding::Cl100kBase)
            .unwrap()[0]
            .len()
    }

    #[test]
    fn system_blocks_tool_use_and_tools_are_all_in_the_prompt() {
        let plain = tokens(
            r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hello"}]}"#,
        );
        let system = tokens(
            r#"{"model":"m","max_tokens":5,"system":[{"type":"text","text":"You answer in French.","cache_control":{"type":"ephemeral"}}],
                "messages":[{"role":"user","content":"hello"}]}"#,
        );
        assert!(system > plain + 5, "{system} vs {plain}");
        let tool_use = tokens(
            r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hello"},
                {"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"get_weather","input":{"city":"Paris"}}]},
                {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"sunny and warm"}]}]}"#,
        );
        assert!(tool_use > plain + 15, "{tool_use}");
        let tools = tokens(
            r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hello"}],
                "tools":[{"name":"get_weather","description":"Look up the weather in a city","input_schema":{"type":"object"}}]}"#,
        );
        assert!(tools > plain + 15, "{tools}");
        let outside = tokens(
            r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hello"}],"stop_sequences":["END"],"thinking":{"type":"enabled","budget_tokens":100}}"#,
        );
        assert_eq!(outside, plain);
    }

    #[test]
    fn max_tokens_is_required_and_content_must_be_text() {
        let err = check(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#).err();
        assert!(err.is_some_and(|e| e.param.as_deref() == Some("max_tokens")));
        assert!(check(r#"{"model":"m","max_tokens":5,"messages":[]}"#).is_err());
        assert!(
            check(r#"{"model":"m","max_tokens":5,"messages":[{"role":"system","content":"hi"}]}"#)
                .is_err()
        );
        assert!(check(r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[{"type":"image","source":{}}]}]}"#).is_err());
    }

    #[test]
    fn content_nested_in_a_tool_result_must_be_text_too() {
        // vLLM turns a tool result's image into an image of the prompt (fetching a URL source).
        let nested = |item: &str| {
            format!(
                r#"{{"model":"m","max_tokens":5,"messages":[{{"role":"user","content":[
                    {{"type":"tool_result","tool_use_id":"t1","content":[{item}]}}]}}]}}"#
            )
        };
        for item in [
            r#"{"type":"image","source":{"type":"url","url":"https://example.com/a.png"}}"#,
            r#"{"type":"text","text":"see"},{"type":"document","source":{}}"#,
        ] {
            let err = check(&nested(item)).err();
            assert!(err.is_some_and(|e| e.status == 400), "{item}");
        }
        assert!(check(&nested(r#"{"type":"text","text":"sunny"}"#)).is_ok());
        let text = r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[
            {"type":"tool_result","tool_use_id":"t1","content":"sunny"}]}]}"#;
        assert!(check(text).is_ok());
    }
}
