//! An inference request as weir reads it, whatever API it was sent to: the fields serving and
//! metering depend on (model, streaming, every output limit an engine may read), and the API's
//! own model of what goes into the prompt.
//!
//! The body is read once as raw top-level fields ([`RawObject`]); each field is then read from
//! its own text, so nothing builds a tree of the body and a field is never read twice.
//!
//! Each API reads its own fields in a module of its own ([`completions`] for Chat Completions
//! and Completions, [`responses`], [`messages`], [`embeddings`]); beside them, the fields every
//! API shares ([`fields`]) and what a prompt is made of ([`prompt`]).

pub mod completions;
pub mod embeddings;
pub mod fields;
pub mod messages;
pub mod prompt;
pub mod responses;

use serde::Deserialize;

use crate::endpoint::Endpoint;
use crate::error::ApiError;
use crate::request::completions::CompletionRequest;
use crate::request::embeddings::EmbeddingsRequest;
use crate::request::fields::{ANSWER_COUNT_FIELDS, OUTPUT_LIMIT_FIELDS, field};
use crate::request::messages::MessagesRequest;
use crate::request::prompt::{Prompt, RawObject};
use crate::request::responses::ResponsesRequest;
use crate::tokens::{Encoding, TokenId, TokenizerUnavailable};

#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The API-specific part of a request: what it puts into the prompt.
#[derive(Clone, Debug)]
pub enum ApiRequest {
    /// Chat Completions and Completions.
    Completion(CompletionRequest),
    Responses(ResponsesRequest),
    Messages(MessagesRequest),
    Embeddings(EmbeddingsRequest),
}

/// A parsed inference request.
#[derive(Clone, Debug)]
pub struct InferenceRequest {
    pub endpoint: Endpoint,
    pub model: String,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Output limits the body sets, by field name (see [`OUTPUT_LIMIT_FIELDS`]).
    pub output_limits: Vec<(&'static str, u32)>,
    /// Counts of answers the body asks for, by field name (see [`ANSWER_COUNT_FIELDS`]).
    pub answer_counts: Vec<(&'static str, u32)>,
    pub seed: Option<u64>,
    /// vLLM extension: generate exactly the token limit.
    pub ignore_eos: Option<bool>,
    /// vLLM extension: scopes prefix-cache reuse to requests carrying the same salt.
    pub cache_salt: Option<String>,
    pub api: ApiRequest,
}

impl InferenceRequest {
    /// Parses a body sent to `endpoint`, naming the offending field on failure.
    pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Self, ApiError> {
        let top: RawObject<'_> = serde_json::from_slice(body).map_err(|e| {
            let what = if e.is_syntax() || e.is_eof() {
                "malformed JSON"
            } else {
                "the request body must be a JSON object"
            };
            ApiError::bad_request(format!("{what}: {e}"))
        })?;
        let model: Option<String> = field(&top, "model")?;
        let mut output_limits = Vec::new();
        for name in OUTPUT_LIMIT_FIELDS {
            if let Some(limit) = field::<u32>(&top, name)? {
                output_limits.push((name, limit));
            }
        }
        let mut answer_counts = Vec::new();
        for name in ANSWER_COUNT_FIELDS {
            if let Some(count) = field::<u32>(&top, name)? {
                answer_counts.push((name, count));
            }
        }
        let api = match endpoint {
            Endpoint::ChatCompletions | Endpoint::Completions => {
                ApiRequest::Completion(CompletionRequest::from_fields(endpoint, &top)?)
            }
            Endpoint::Responses => ApiRequest::Responses(ResponsesRequest::from_fields(&top)?),
            Endpoint::Messages => ApiRequest::Messages(MessagesRequest::from_fields(&top)?),
            Endpoint::Embeddings => ApiRequest::Embeddings(EmbeddingsRequest::from_fields(&top)?),
        };
        Ok(InferenceRequest {
            endpoint,
            model: model
                .ok_or_else(|| ApiError::bad_request("model is required").with_param("model"))?,
            stream: field(&top, "stream")?,
            stream_options: field(&top, "stream_options")?,
            output_limits,
            answer_counts,
            seed: field(&top, "seed")?,
            ignore_eos: field(&top, "ignore_eos")?,
            cache_salt: field(&top, "cache_salt")?,
            api,
        })
    }

    pub fn is_streaming(&self) -> bool {
        self.endpoint != Endpoint::Embeddings && self.stream.unwrap_or(false)
    }

    /// Whether the client asked for the trailing usage chunk of a stream (chat and
    /// completions; the other APIs always report usage).
    pub fn wants_stream_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }

    /// Whether the API asks for usage with `stream_options` (the others always report it).
    pub fn usage_is_optional(&self) -> bool {
        self.endpoint.usage_is_optional()
    }

    /// The output limit the API itself defines, if the request sets it: what the engine is
    /// asked for (`max_completion_tokens` before `max_tokens` for chat).
    pub fn max_output_tokens(&self) -> Option<u32> {
        self.limit_field()
            .iter()
            .find_map(|f| self.output_limits.iter().find(|(n, _)| n == f))
            .map(|&(_, l)| l)
    }

    /// The API's own output-limit fields, in the order engines read them.
    fn limit_field(&self) -> &'static [&'static str] {
        match self.endpoint {
            Endpoint::ChatCompletions => &["max_completion_tokens", "max_tokens"],
            Endpoint::Completions | Endpoint::Messages => &["max_tokens"],
            Endpoint::Responses => &["max_output_tokens"],
            Endpoint::Embeddings => &[],
        }
    }

    /// Where weir writes the cap it fills in for a request that sets no limit of the API's own;
    /// `None` where the API generates nothing or requires the client to set it.
    pub fn fill_in_field(&self) -> Option<&'static str> {
        match self.endpoint {
            Endpoint::ChatCompletions | Endpoint::Completions => Some("max_tokens"),
            Endpoint::Responses => Some("max_output_tokens"),
            Endpoint::Messages | Endpoint::Embeddings => None,
        }
    }

    /// The most output any engine may generate per sequence, if the request bounds it at all.
    pub fn largest_output_limit(&self) -> Option<u32> {
        self.output_limits.iter().map(|&(_, l)| l).max()
    }

    /// How many answers the engine generates: one per prompt of a completions batch.
    pub fn answers(&self) -> u64 {
        match &self.api {
            ApiRequest::Completion(c) => c.prompts(),
            ApiRequest::Embeddings(_) => 0,
            _ => 1,
        }
    }

    /// Checks the parameters every engine rejects, independent of the model.
    pub fn validate(&self) -> Result<(), ApiError> {
        if let Some(&(param, n)) = self.answer_counts.iter().find(|&&(_, n)| n != 1) {
            return Err(ApiError::bad_request(format!(
                "{param}={n} is not supported; only {param}=1 is served"
            ))
            .with_param(param));
        }
        if let Some(&(param, _)) = self.output_limits.iter().find(|&&(_, l)| l == 0) {
            return Err(
                ApiError::bad_request(format!("{param} must be at least 1")).with_param(param)
            );
        }
        if self.stream_options.is_some() && !(self.is_streaming() && self.usage_is_optional()) {
            return Err(ApiError::bad_request(
                "stream_options can only be set when stream is true",
            )
            .with_param("stream_options"));
        }
        match &self.api {
            ApiRequest::Completion(c) => c.validate(self.endpoint),
            ApiRequest::Responses(r) => r.validate(),
            ApiRequest::Messages(m) => m.validate(self.max_output_tokens()),
            ApiRequest::Embeddings(e) => e.validate(),
        }
    }

    /// Everything the engine puts into the prompt. Call after [`validate`](Self::validate).
    pub fn prompt(&self) -> Prompt<'_> {
        match &self.api {
            ApiRequest::Completion(c) => c.prompt(self.endpoint),
            ApiRequest::Responses(r) => r.prompt(),
            ApiRequest::Messages(m) => m.prompt(),
            ApiRequest::Embeddings(e) => e.prompt(),
        }
    }

    /// Token ids of each sequence of the prompt as the engine would see it (chat framing
    /// included). Call after [`validate`](Self::validate).
    pub fn prompt_tokens(
        &self,
        encoding: Encoding,
    ) -> Result<Vec<Vec<TokenId>>, TokenizerUnavailable> {
        self.prompt().encode(encoding)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(endpoint: Endpoint, body: &str) -> Result<InferenceRequest, ApiError> {
        let req = InferenceRequest::parse(endpoint, body.as_bytes())?;
        req.validate()?;
        Ok(req)
    }

    fn chat(body: &str) -> Result<InferenceRequest, ApiError> {
        parse(Endpoint::ChatCompletions, body)
    }

    #[test]
    fn malformed_json_is_named() {
        let err = chat("{\"model\": ").err();
        assert!(err.is_some_and(|e| e.status == 400 && e.message.starts_with("malformed JSON")));
        let err = chat("[1]").err();
        assert!(err.is_some_and(|e| e.message.contains("must be a JSON object")));
    }

    #[test]
    fn wrong_types_name_the_field() {
        let err = chat(r#"{"model":"m","messages":[],"max_tokens":"ten"}"#).err();
        assert!(
            err.as_ref()
                .is_some_and(|e| e.param.as_deref() == Some("max_tokens"))
        );
        let msg = err.map(|e| e.message).unwrap_or_default();
        assert!(
            msg.contains("max_tokens") && msg.contains("invalid type"),
            "{msg}"
        );
        let err = chat(r#"{"model":"m","messages":[{"role":"user","content":5}]}"#).err();
        let msg = err.map(|e| e.message).unwrap_or_default();
        assert!(msg.contains("messages[0]"), "{msg}");
        let err = chat(r#"{"model":"m","stream":"true","messages":[]}"#).err();
        assert!(err.is_some_and(|e| e.param.as_deref() == Some("stream")));
    }

    #[test]
    fn every_engine_s_count_of_answers_other_than_one_is_rejected() {
        // llama.cpp reads `n_cmpl` (before `n`) and runs that many sequences, each in a slot of
        // its own; vLLM's older engine and TGI read `best_of`. Each multiplies the output of a
        // request reserved for one answer.
        for field in ["n_cmpl", "best_of"] {
            for endpoint in Endpoint::ALL {
                let body = match endpoint {
                    Endpoint::ChatCompletions => {
                        r#"{"model":"m","messages":[{"role":"user","content":"x"}]"#
                    }
                    Endpoint::Completions => r#"{"model":"m","prompt":"x""#,
                    Endpoint::Responses => r#"{"model":"m","input":"x""#,
                    Endpoint::Messages => {
                        r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"x"}]"#
                    }
                    Endpoint::Embeddings => r#"{"model":"m","input":"x""#,
                };
                let err = parse(endpoint, &format!("{body},\"{field}\":4}}")).err();
                assert_eq!(
                    err.and_then(|e| e.param).as_deref(),
                    Some(field),
                    "{endpoint:?} {field}"
                );
                assert!(parse(endpoint, &format!("{body},\"{field}\":1}}")).is_ok());
            }
        }
    }

    #[test]
    fn n_other_than_one_is_rejected() {
        let err = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":2}"#).err();
        assert_eq!(err.and_then(|e| e.param).as_deref(), Some("n"));
        assert!(chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":1}"#).is_ok());
    }

    #[test]
    fn every_output_limit_is_read_and_the_api_s_own_is_asked_for() {
        let req = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":5,"max_completion_tokens":7,"n_predict":9}"#,
        )
        .unwrap();
        assert_eq!(req.max_output_tokens(), Some(7));
        assert_eq!(req.largest_output_limit(), Some(9));
        let req = parse(
            Endpoint::Responses,
            r#"{"model":"m","input":"x","max_tokens":50,"max_output_tokens":7}"#,
        )
        .unwrap();
        assert_eq!(req.max_output_tokens(), Some(7));
        assert_eq!(req.largest_output_limit(), Some(50));
        assert_eq!(req.fill_in_field(), Some("max_output_tokens"));
    }

    #[test]
    fn stream_options_need_a_stream_of_an_api_that_takes_them() {
        assert!(chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":true}}"#).is_err());
        let req = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true,"stream_options":{"include_usage":true}}"#,
        );
        assert!(req.is_ok_and(|r| r.wants_stream_usage()));
        let responses = parse(
            Endpoint::Responses,
            r#"{"model":"m","input":"x","stream":true,"stream_options":{"include_usage":true}}"#,
        );
        assert!(responses.is_err());
    }

    #[test]
    fn embeddings_never_stream_and_generate_nothing() {
        let req = parse(
            Endpoint::Embeddings,
            r#"{"model":"m","input":["a","b"],"stream":true}"#,
        )
        .unwrap();
        assert!(!req.is_streaming());
        assert_eq!(req.answers(), 0);
        assert_eq!(req.fill_in_field(), None);
    }

    #[test]
    fn token_prompts_pass_through() {
        let req = parse(Endpoint::Completions, r#"{"model":"m","prompt":[5,6,7]}"#).unwrap();
        let ids = req.prompt_tokens(Encoding::Cl100kBase).ok();
        assert_eq!(ids, Some(vec![vec![5, 6, 7]]));
    }
}
