//! The OpenAI-compatible wire contract: request bodies as weir reads them and errors in the
//! shape clients (and the official SDKs) expect.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use crate::tokens::{ChatTurn, Encoding, TokenId, TokenizerUnavailable};

/// Which OpenAI endpoint a body was sent to; it decides whether `messages` or `prompt` is read.
/// [`crate::path`] says which one a request path names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    ChatCompletions,
    Completions,
}

/// The fields of a chat or text completion request that serving and metering depend on.
/// Other fields are accepted, as engines do, and the text they can carry into the prompt is kept
/// in `extra` (see [`CompletionRequest::prompt`]). `extra` is read by a second pass over the raw
/// body ([`CompletionRequest::from_body`]) rather than with `serde(flatten)`, which would build a
/// tree of the whole body: a few MB of small JSON objects take many times their size as a tree,
/// and a VM's memory never shrinks.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    #[serde(default)]
    pub messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    pub prompt: Option<PromptInput>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    /// llama.cpp extension: its output limit, read before `max_tokens` on every endpoint.
    #[serde(default)]
    pub n_predict: Option<u32>,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub seed: Option<u64>,
    /// vLLM extension: generate exactly the token limit.
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// vLLM extension: scopes prefix-cache reuse to requests carrying the same salt.
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// The text of every other field that can reach the prompt: `tools`, `tool_choice`,
    /// `functions`, `response_format`, guided decoding, `chat_template_kwargs`, `documents`,
    /// unknown fields (see [`OUTSIDE_PROMPT`]).
    #[serde(skip)]
    pub extra: Vec<String>,
}

/// The fields [`CompletionRequest`] reads itself; every other top-level field is extra.
const REQUEST_FIELDS: [&str; 12] = [
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n_predict",
    "n",
    "seed",
    "ignore_eos",
    "cache_salt",
];

#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

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

/// Part types that carry text, and the field that holds it.
const TEXT_PARTS: [(&str, &str); 3] = [
    ("text", "text"),
    ("input_text", "text"),
    ("refusal", "refusal"),
];

impl ContentPart {
    fn carries_text(&self) -> bool {
        TEXT_PARTS.iter().any(|&(kind, field)| {
            self.kind == kind
                && match field {
                    "text" => self.text.is_some(),
                    _ => self.refusal.as_ref().is_some_and(Value::is_string),
                }
        })
    }
}

/// Top-level fields known to stay out of the prompt even when they hold strings. Everything
/// else that holds text — `tools`, `functions`, `tool_choice`, `response_format`, `guided_*`,
/// `structured_outputs`, `chat_template`, `chat_template_kwargs`, `documents`, `suffix`, and
/// any field weir does not know — is counted as prompt, so a new or invented field is never a
/// way around the estimate.
const OUTSIDE_PROMPT: [&str; 11] = [
    "stop",
    "stop_token_ids",
    "bad_words",
    "allowed_token_ids",
    "logit_bias",
    "user",
    "metadata",
    "service_tier",
    "reasoning_effort",
    "modalities",
    "request_id",
];

/// The text a JSON value brings into a prompt: a string as itself, a structure as its JSON
/// (how templates render tools and schemas), nothing for numbers, booleans and null.
fn rendered(raw: &RawValue) -> Option<String> {
    let text = raw.get();
    match text.as_bytes().first()? {
        b'"' => serde_json::from_str(text).ok(),
        b'[' | b'{' => Some(text.to_owned()),
        _ => None,
    }
}

/// A JSON object's fields, values left as raw JSON text (nothing is built from them).
type RawObject<'a> = BTreeMap<Cow<'a, str>, &'a RawValue>;

fn raw_object(raw: &RawValue) -> Option<RawObject<'_>> {
    serde_json::from_str(raw.get()).ok()
}

fn raw_array(raw: &RawValue) -> Option<Vec<&RawValue>> {
    serde_json::from_str(raw.get()).ok()
}

/// The rendered text of an object's fields other than `known` (and [`OUTSIDE_PROMPT`]).
fn extra_texts(object: &RawObject<'_>, known: &[&str]) -> Vec<String> {
    object
        .iter()
        .filter(|(k, _)| !known.contains(&k.as_ref()) && !OUTSIDE_PROMPT.contains(&k.as_ref()))
        .filter_map(|(_, v)| rendered(v))
        .collect()
}

/// Everything a request puts into the engine's prompt, as the tokenizer sees it.
#[derive(Clone, Debug)]
pub enum Prompt<'a> {
    /// Chat turns; fields beside the messages (tools, schemas, ...) ride in the first turn, as
    /// templates render them into the system prompt.
    Chat(Vec<ChatTurn<'a>>),
    /// A completions prompt: pre-tokenized ids, if given, and texts (the prompt, `suffix`, ...).
    Completion {
        ids: &'a [TokenId],
        texts: Vec<Cow<'a, str>>,
    },
}

impl Prompt<'_> {
    /// Every piece of text (roles and names included for chat).
    pub fn texts(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        match self {
            Prompt::Chat(turns) => Box::new(turns.iter().flat_map(|t| {
                std::iter::once(t.role)
                    .chain(t.name)
                    .chain(t.content.iter().map(|c| c.as_ref()))
            })),
            Prompt::Completion { texts, .. } => Box::new(texts.iter().map(|c| c.as_ref())),
        }
    }

    /// Token ids as the engine would see them (chat framing included).
    pub fn encode(&self, encoding: Encoding) -> Result<Vec<TokenId>, TokenizerUnavailable> {
        match self {
            Prompt::Chat(turns) => encoding.encode_chat(turns.iter().cloned()),
            Prompt::Completion { ids, texts } => {
                let mut out = ids.to_vec();
                for text in texts {
                    out.extend(encoding.encode(text)?);
                }
                Ok(out)
            }
        }
    }
}

/// `prompt` of the completions endpoint: one string, or one pre-tokenized prompt.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<TokenId>),
    Batch(Vec<String>),
}

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

impl CompletionRequest {
    /// Parses a body, naming the offending field or position on failure.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        Self::from_body(body).map_err(|e| {
            let what = if e.is_syntax() || e.is_eof() {
                "malformed JSON"
            } else {
                "invalid request"
            };
            ApiError::bad_request(format!("{what}: {e}"))
        })
    }

    /// The typed fields (unknown ones are skipped, not built), then the text of every other
    /// field from a second pass over the raw JSON.
    pub fn from_body(body: &[u8]) -> Result<Self, serde_json::Error> {
        let mut req: CompletionRequest = serde_json::from_slice(body)?;
        let top: RawObject<'_> = serde_json::from_slice(body)?;
        req.extra = extra_texts(&top, &REQUEST_FIELDS);
        let raw_messages = top.get("messages").and_then(|m| raw_array(m));
        if let (Some(messages), Some(raw)) = (&mut req.messages, raw_messages) {
            for (message, raw) in messages.iter_mut().zip(raw) {
                let Some(fields) = raw_object(raw) else {
                    continue;
                };
                message.extra = extra_texts(&fields, &MESSAGE_FIELDS);
                let raw_parts = fields.get("content").and_then(|c| raw_array(c));
                if let (Some(MessageContent::Parts(parts)), Some(raw)) =
                    (&mut message.content, raw_parts)
                {
                    for (part, raw) in parts.iter_mut().zip(raw) {
                        if let Some(fields) = raw_object(raw) {
                            part.extra = extra_texts(&fields, &PART_FIELDS);
                        }
                    }
                }
            }
        }
        Ok(req)
    }

    pub fn is_streaming(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// Whether the client asked for the trailing usage chunk of a stream.
    pub fn wants_stream_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }

    /// The output-token ceiling the client set, `max_completion_tokens` taking precedence.
    pub fn max_output_tokens(&self) -> Option<u32> {
        self.max_completion_tokens.or(self.max_tokens)
    }

    /// Every output limit the request sets, by parameter name. Engines read different ones
    /// (vLLM `max_completion_tokens` then `max_tokens`, older engines and TGI `max_tokens`,
    /// llama.cpp `n_predict` then `max_tokens`), so the front door bounds all of them.
    pub fn output_limits(&self) -> impl Iterator<Item = (&'static str, u32)> {
        [
            ("max_completion_tokens", self.max_completion_tokens),
            ("max_tokens", self.max_tokens),
            ("n_predict", self.n_predict),
        ]
        .into_iter()
        .filter_map(|(param, limit)| limit.map(|l| (param, l)))
    }

    /// The most output any engine may generate for this request, if it bounds it at all.
    pub fn largest_output_limit(&self) -> Option<u32> {
        self.output_limits().map(|(_, l)| l).max()
    }

    /// Checks the parameters every engine rejects, independent of the model.
    pub fn validate(&self, endpoint: Endpoint) -> Result<(), ApiError> {
        if let Some(n) = self.n.filter(|&n| n != 1) {
            return Err(ApiError::bad_request(format!(
                "n={n} is not supported; only n=1 is served"
            ))
            .with_param("n"));
        }
        if let Some((param, _)) = self.output_limits().find(|&(_, l)| l == 0) {
            return Err(
                ApiError::bad_request(format!("{param} must be at least 1")).with_param(param)
            );
        }
        if self.stream_options.is_some() && !self.is_streaming() {
            return Err(ApiError::bad_request(
                "stream_options can only be set when stream is true",
            )
            .with_param("stream_options"));
        }
        match endpoint {
            Endpoint::ChatCompletions => self.validate_messages(),
            Endpoint::Completions => match &self.prompt {
                None => Err(ApiError::bad_request("prompt is required").with_param("prompt")),
                Some(PromptInput::Batch(batch)) if batch.len() != 1 => Err(ApiError::bad_request(
                    "a batch of prompts is not supported; send one prompt per request",
                )
                .with_param("prompt")),
                Some(_) => Ok(()),
            },
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
            if let Some(MessageContent::Parts(parts)) = &m.content
                && let Some(p) = parts.iter().find(|p| !p.carries_text())
            {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].content: only text parts are supported, got '{}'",
                    p.kind
                ))
                .with_param("messages"));
            }
        }
        Ok(())
    }

    /// Text the request's other fields bring into the prompt (see [`OUTSIDE_PROMPT`]).
    fn extra_texts(&self) -> impl Iterator<Item = Cow<'_, str>> {
        self.extra.iter().map(|t| Cow::Borrowed(t.as_str()))
    }

    /// Everything the engine puts into the prompt. Call after [`validate`](Self::validate).
    pub fn prompt(&self, endpoint: Endpoint) -> Prompt<'_> {
        match endpoint {
            Endpoint::ChatCompletions => {
                let mut turns: Vec<ChatTurn<'_>> = self
                    .messages
                    .iter()
                    .flatten()
                    .map(|m| {
                        let mut content: Vec<Cow<'_, str>> = match &m.content {
                            None => Vec::new(),
                            Some(MessageContent::Text(t)) => vec![Cow::Borrowed(t.as_str())],
                            Some(MessageContent::Parts(parts)) => parts
                                .iter()
                                .flat_map(|p| {
                                    p.text
                                        .as_deref()
                                        .or(p.refusal.as_ref().and_then(Value::as_str))
                                        .map(Cow::Borrowed)
                                        .into_iter()
                                        .chain(p.extra.iter().map(|t| Cow::Borrowed(t.as_str())))
                                })
                                .collect(),
                        };
                        content.extend(m.extra.iter().map(|t| Cow::Borrowed(t.as_str())));
                        ChatTurn {
                            role: &m.role,
                            name: m.name.as_deref(),
                            content,
                        }
                    })
                    .collect();
                if let Some(first) = turns.first_mut() {
                    first.content.extend(self.extra_texts());
                }
                Prompt::Chat(turns)
            }
            Endpoint::Completions => {
                let (ids, text): (&[TokenId], Option<&str>) = match &self.prompt {
                    Some(PromptInput::Text(t)) => (&[], Some(t.as_str())),
                    Some(PromptInput::Batch(b)) => (&[], b.first().map(String::as_str)),
                    Some(PromptInput::Tokens(ids)) => (ids, None),
                    None => (&[], None),
                };
                let texts = text
                    .map(Cow::Borrowed)
                    .into_iter()
                    .chain(self.extra_texts());
                Prompt::Completion {
                    ids,
                    texts: texts.collect(),
                }
            }
        }
    }

    /// Token ids of the prompt as the engine would see it (chat framing included).
    /// Call after [`validate`](Self::validate).
    pub fn prompt_tokens(
        &self,
        endpoint: Endpoint,
        encoding: Encoding,
    ) -> Result<Vec<TokenId>, TokenizerUnavailable> {
        self.prompt(endpoint).encode(encoding)
    }
}

/// An error in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.
///
/// `code` carries a machine-readable code where one exists (`context_length_exceeded`) and
/// otherwise the HTTP status, as vLLM does.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequestError", message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(404, "NotFoundError", message)
    }

    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            413,
            "BadRequestError",
            format!("request body exceeds the limit of {limit} bytes"),
        )
    }

    pub fn rate_limited(message: impl Into<String>) -> Self {
        Self::new(429, "RateLimitError", message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "InternalServerError", message)
    }

    pub fn context_length_exceeded(max_context: u64, prompt: u64, completion: u64) -> Self {
        Self::bad_request(format!(
            "This model's maximum context length is {max_context} tokens. However, you requested \
             {} tokens ({prompt} in the messages, {completion} in the completion). Please reduce \
             the length of the messages or completion.",
            prompt + completion
        ))
        .with_param("messages")
        .with_code("context_length_exceeded")
    }

    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_owned());
        self
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn to_json(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code.map_or_else(|| json!(self.status), |c| json!(c)),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> Result<CompletionRequest, ApiError> {
        CompletionRequest::parse(body.as_bytes())
    }

    fn chat(body: &str) -> Result<CompletionRequest, ApiError> {
        let req = parse(body)?;
        req.validate(Endpoint::ChatCompletions)?;
        Ok(req)
    }

    #[test]
    fn malformed_json_is_named() {
        let err = parse("{\"model\": ").err();
        assert!(err.is_some_and(|e| e.status == 400 && e.message.starts_with("malformed JSON")));
    }

    #[test]
    fn wrong_types_name_the_problem() {
        let err = parse(r#"{"model":"m","messages":[],"max_tokens":"ten"}"#).err();
        let msg = err.map(|e| e.message).unwrap_or_default();
        assert!(
            msg.starts_with("invalid request") && msg.contains("invalid type"),
            "{msg}"
        );
    }

    #[test]
    fn n_other_than_one_is_rejected() {
        let err = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":2}"#).err();
        assert_eq!(err.and_then(|e| e.param), Some("n".to_owned()));
        assert!(chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":1}"#).is_ok());
    }

    #[test]
    fn empty_messages_and_unknown_roles_are_rejected() {
        assert!(chat(r#"{"model":"m","messages":[]}"#).is_err());
        assert!(chat(r#"{"model":"m","messages":[{"role":"wizard","content":"x"}]}"#).is_err());
        assert!(
            chat(r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#)
                .is_err()
        );
    }

    #[test]
    fn max_completion_tokens_wins_over_max_tokens() {
        let req = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":5,"max_completion_tokens":7}"#,
        );
        assert_eq!(req.ok().and_then(|r| r.max_output_tokens()), Some(7));
    }

    #[test]
    fn completions_need_one_prompt() {
        let check = |b: &str| parse(b).and_then(|r| r.validate(Endpoint::Completions));
        assert!(check(r#"{"model":"m"}"#).is_err());
        assert!(check(r#"{"model":"m","prompt":["a","b"]}"#).is_err());
        assert!(check(r#"{"model":"m","prompt":[1,2,3]}"#).is_ok());
        assert!(check(r#"{"model":"m","prompt":"hi"}"#).is_ok());
    }

    #[test]
    fn stream_options_need_stream() {
        assert!(chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":true}}"#).is_err());
        let req = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true,"stream_options":{"include_usage":true}}"#,
        );
        assert!(req.is_ok_and(|r| r.wants_stream_usage()));
    }

    #[test]
    fn error_shape_is_openai_compatible() {
        let v = ApiError::context_length_exceeded(100, 90, 20).to_json();
        assert_eq!(v["error"]["code"], "context_length_exceeded");
        assert_eq!(v["error"]["type"], "BadRequestError");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("110 tokens"))
        );
        let v = ApiError::not_found("nope").to_json();
        assert_eq!(v["error"]["code"], 404);
        assert!(v["error"]["param"].is_null());
    }

    #[test]
    fn token_prompts_pass_through() {
        let req = parse(r#"{"model":"m","prompt":[5,6,7]}"#);
        let ids = req.ok().and_then(|r| {
            r.prompt_tokens(Endpoint::Completions, Encoding::Cl100kBase)
                .ok()
        });
        assert_eq!(ids, Some(vec![5, 6, 7]));
    }
}
