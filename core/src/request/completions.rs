//! OpenAI's Chat Completions and Completions APIs: what a request puts into the prompt.
//!
//! Chat messages are read with their content parts; every other field of a message, a part or
//! the request that can carry text into the prompt — `tools`, `tool_choice`, `functions`,
//! `response_format`, guided decoding, `chat_template_kwargs`, `documents`, `suffix`, tool calls
//! in messages, unknown fields — is kept as its rendered text and counted (see
//! [`crate::request::prompt`]). A completions `prompt` may be a batch: each prompt is its own sequence.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::Value;

use crate::endpoint::Endpoint;
use crate::error::ApiError;
use crate::request::fields::{COMMON_FIELDS, field};
use crate::request::prompt::{
    OUTSIDE_PROMPT, Prompt, RawObject, Sequence, borrowed, extra_texts, raw_array, raw_object,
};
use crate::tokens::{ChatTurn, TokenId};

/// Most prompts a completions batch may carry (OpenAI's own bound).
pub const MAX_BATCH: usize = 2048;

/// The prompt-bearing part of a chat or text completion request.
#[derive(Clone, Debug, Default)]
pub struct CompletionRequest {
    pub messages: Option<Vec<ChatMessage>>,
    pub prompt: Option<PromptInput>,
    /// The text of every other field that can reach the prompt.
    pub extra: Vec<String>,
}

/// The fields [`CompletionRequest`] reads itself.
const REQUEST_FIELDS: [&str; 2] = ["messages", "prompt"];

#[derive(Clone, Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<MessageContent>,
    #[serde(default)]
    pub name: Option<String>,
    /// The text of `tool_calls`, `tool_call_id`, `function_call`, `reasoning_content`, ...:
    /// rendered into the prompt by chat templates, so counted.
    #[serde(skip)]
    pub extra: Vec<String>,
}

const MESSAGE_FIELDS: [&str; 3] = ["role", "content", "name"];

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// A content part of a chat message or a Responses input item.
#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
    /// A `refusal` part's text (any other JSON there is refused as not text).
    #[serde(default)]
    pub refusal: Option<Value>,
    /// The text of whatever else a part carries: counted.
    #[serde(skip)]
    pub extra: Vec<String>,
}

const PART_FIELDS: [&str; 3] = ["type", "text", "refusal"];

/// Part types that carry text, and the field that holds it (chat's, and the Responses API's
/// input, output, summary and reasoning text).
const TEXT_PARTS: [(&str, &str); 6] = [
    ("text", "text"),
    ("input_text", "text"),
    ("output_text", "text"),
    ("summary_text", "text"),
    ("reasoning_text", "text"),
    ("refusal", "refusal"),
];

impl ContentPart {
    pub fn carries_text(&self) -> bool {
        TEXT_PARTS.iter().any(|&(kind, field)| {
            self.kind == kind
                && match field {
                    "text" => self.text.is_some(),
                    _ => self.refusal.as_ref().is_some_and(Value::is_string),
                }
        })
    }

    /// The part's text and the rendered text of its other fields.
    pub fn texts(&self) -> impl Iterator<Item = Cow<'_, str>> {
        self.text
            .as_deref()
            .or(self.refusal.as_ref().and_then(Value::as_str))
            .map(Cow::Borrowed)
            .into_iter()
            .chain(borrowed(&self.extra))
    }
}

impl MessageContent {
    /// Reads content with the extra text of each part (a second pass over the raw parts).
    pub fn read_extras(&mut self, raw: Option<&serde_json::value::RawValue>) {
        let raw_parts = raw.and_then(raw_array);
        if let (MessageContent::Parts(parts), Some(raw)) = (self, raw_parts) {
            for (part, raw) in parts.iter_mut().zip(raw) {
                if let Some(fields) = raw_object(raw) {
                    part.extra = extra_texts(&fields, &[&PART_FIELDS]);
                }
            }
        }
    }

    pub fn texts(&self) -> Vec<Cow<'_, str>> {
        match self {
            MessageContent::Text(t) => vec![Cow::Borrowed(t.as_str())],
            MessageContent::Parts(parts) => parts.iter().flat_map(ContentPart::texts).collect(),
        }
    }

    /// The first part that carries no text (images, audio, files), if any.
    pub fn non_text_part(&self) -> Option<&str> {
        match self {
            MessageContent::Text(_) => None,
            MessageContent::Parts(parts) => parts
                .iter()
                .find(|p| !p.carries_text())
                .map(|p| p.kind.as_str()),
        }
    }
}

/// `prompt` of the completions endpoint: one string or pre-tokenized prompt, or a batch.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<TokenId>),
    Batch(Vec<String>),
    TokenBatch(Vec<Vec<TokenId>>),
}

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

impl CompletionRequest {
    /// Reads the prompt-bearing fields of a chat or completions body.
    pub fn from_fields(endpoint: Endpoint, top: &RawObject<'_>) -> Result<Self, ApiError> {
        let mut req = CompletionRequest {
            messages: field(top, "messages")?,
            prompt: field(top, "prompt")?,
            extra: extra_texts(top, &[&COMMON_FIELDS, &REQUEST_FIELDS, &OUTSIDE_PROMPT]),
        };
        if endpoint == Endpoint::ChatCompletions {
            let raw_messages = top.get("messages").and_then(|m| raw_array(m));
            if let (Some(messages), Some(raw)) = (&mut req.messages, raw_messages) {
                for (message, raw) in messages.iter_mut().zip(raw) {
                    let Some(fields) = raw_object(raw) else {
                        continue;
                    };
                    message.extra = extra_texts(&fields, &[&MESSAGE_FIELDS]);
                    if let Some(content) = &mut message.content {
                        content.read_extras(fields.get("content").copied());
                    }
                }
            }
        }
        Ok(req)
    }

    /// Prompts in the request: a completions batch has one per entry.
    pub fn prompts(&self) -> u64 {
        match &self.prompt {
            Some(PromptInput::Batch(b)) => b.len() as u64,
            Some(PromptInput::TokenBatch(b)) => b.len() as u64,
            _ => 1,
        }
    }

    pub fn validate(&self, endpoint: Endpoint) -> Result<(), ApiError> {
        match endpoint {
            Endpoint::Completions => {
                let prompts = match &self.prompt {
                    None => 0,
                    Some(PromptInput::Tokens(ids)) if ids.is_empty() => 0,
                    Some(_) => self.prompts(),
                };
                if prompts == 0 {
                    return Err(ApiError::bad_request("prompt is required").with_param("prompt"));
                }
                if prompts > MAX_BATCH as u64 {
                    return Err(ApiError::bad_request(format!(
                        "a batch may carry at most {MAX_BATCH} prompts"
                    ))
                    .with_param("prompt"));
                }
                Ok(())
            }
            _ => self.validate_messages(),
        }
    }

    fn validate_messages(&self) -> Result<(), ApiError> {
        let messages = match &self.messages {
            Some(m) if !m.is_empty() => m,
            _ => {
                return Err(ApiError::bad_request("messages must be a non-empty array")
                    .with_param("messages"));
            }
        };
        for (i, m) in messages.iter().enumerate() {
            if !ROLES.contains(&m.role.as_str()) {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].role '{}' is not one of {}",
                    m.role,
                    ROLES.join(", ")
                ))
                .with_param("messages"));
            }
            if let Some(kind) = m.content.as_ref().and_then(MessageContent::non_text_part) {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].content: only text parts are supported, got '{kind}'"
                ))
                .with_param("messages"));
            }
        }
        Ok(())
    }

    /// Everything the engine puts into the prompt. Call after [`validate`](Self::validate).
    pub fn prompt(&self, endpoint: Endpoint) -> Prompt<'_> {
        if endpoint != Endpoint::Completions {
            let mut turns: Vec<ChatTurn<'_>> = self
                .messages
                .iter()
                .flatten()
                .map(|m| {
                    let mut content = m.content.as_ref().map(|c| c.texts()).unwrap_or_default();
                    content.extend(borrowed(&m.extra));
                    ChatTurn {
                        role: &m.role,
                        name: m.name.as_deref(),
                        content,
                    }
                })
                .collect();
            if let Some(first) = turns.first_mut() {
                first.content.extend(borrowed(&self.extra));
            }
            return Prompt::Chat(turns);
        }
        // Fields beside the prompt (`suffix`, ...) go into every prompt of a batch.
        let mut seqs: Vec<Sequence<'_>> = match &self.prompt {
            Some(PromptInput::Text(t)) => vec![Sequence::of_text(t)],
            Some(PromptInput::Batch(b)) => b.iter().map(|t| Sequence::of_text(t)).collect(),
            Some(PromptInput::Tokens(ids)) => vec![Sequence {
                ids,
                texts: Vec::new(),
            }],
            Some(PromptInput::TokenBatch(b)) => b
                .iter()
                .map(|ids| Sequence {
                    ids,
                    texts: Vec::new(),
                })
                .collect(),
            None => vec![Sequence::default()],
        };
        for seq in &mut seqs {
            seq.texts.extend(borrowed(&self.extra));
        }
        Prompt::Sequences(seqs)
    }
}

#[cfg(test)]
mod tests {
    use crate::endpoint::Endpoint;
    use crate::request::InferenceRequest;
    use crate::tokens::Encoding;

    fn check(endpoint: Endpoint, body: &str) -> Result<InferenceRequest, crate::error::ApiError> {
        let req = InferenceRequest::parse(endpoint, body.as_bytes())?;
        req.validate()?;
        Ok(req)
    }

    #[test]
    fn empty_messages_and_unknown_roles_are_rejected() {
        let chat = |b| check(Endpoint::ChatCompletions, b);
        assert!(chat(r#"{"model":"m","messages":[]}"#).is_err());
        assert!(chat(r#"{"model":"m","messages":[{"role":"wizard","content":"x"}]}"#).is_err());
        assert!(
            chat(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#)
                .is_err()
        );
    }

    #[test]
    fn completions_take_one_prompt_or_a_batch() {
        let completions = |b| check(Endpoint::Completions, b);
        assert!(completions(r#"{"model":"m"}"#).is_err());
        assert!(completions(r#"{"model":"m","prompt":[]}"#).is_err());
        assert!(completions(r#"{"model":"m","prompt":[1,2,3]}"#).is_ok());
        assert!(completions(r#"{"model":"m","prompt":"hi"}"#).is_ok());
        let batch = completions(r#"{"model":"m","prompt":["a b","c"],"suffix":"!"}"#).unwrap();
        assert_eq!(batch.answers(), 2);
        let ids = batch.prompt_tokens(Encoding::Cl100kBase).unwrap();
        assert_eq!(ids.len(), 2, "one sequence per prompt");
        assert_eq!(ids[0].len(), 3, "'a b' and the suffix");
        let tokens = completions(r#"{"model":"m","prompt":[[1,2],[3]]}"#).unwrap();
        assert_eq!(
            tokens.prompt_tokens(Encoding::Cl100kBase).ok(),
            Some(vec![vec![1, 2], vec![3]])
        );
    }
}
