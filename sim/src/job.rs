//! A request accepted for the engine: its sequences — one per prompt of a completions batch or
//! input of an embeddings request, else one — how long each runs and how it ends, and what the
//! answer's shape depends on. [`prepare`] does everything that can refuse a request before the
//! engine sees it.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::Ordering;

use axum::body::Bytes;
use axum::http::HeaderMap;
use weir_core::endpoint::Endpoint;
use weir_core::error::ApiError;
use weir_core::request::InferenceRequest;
use weir_core::tokens::TokenId;

use crate::app::App;
use crate::dialect::{CacheScope, Refusal};
use crate::engine::SeqSpec;
use crate::faults::{RequestFaults, Verdict};
use crate::framing::Framing;
use crate::kv_cache::block_hashes;
use crate::text::TextGen;
use crate::tool_call::ToolCall;
use crate::wire::embeddings::Format;
use crate::wire::responses::Echo;
use crate::wire::{Finish, Params, Reply, ResponseHead};

/// Prompts larger than this are tokenized off the async workers.
const INLINE_TOKENIZE_BYTES: usize = 64 * 1024;

/// One accepted request on its way through the engine.
pub struct Job {
    pub reply: Reply,
    /// One per engine sequence, in answer order (a choice's index is its position).
    pub choices: Vec<Choice>,
    pub stream: bool,
    /// The request's 1-based number among those served (for `--exit-after`).
    pub accepted: u64,
    /// Whether the API streams the first `--reasoning-tokens` as reasoning (chat, Responses,
    /// Messages; not completions).
    pub reasons: bool,
}

/// One engine sequence of a job.
pub struct Choice {
    pub spec: SeqSpec,
    pub text: TextGen,
    /// How the sequence ends when it has generated all its tokens.
    pub finish: Finish,
}

impl Job {
    /// Whether the job generates nothing (embeddings): its sequences are prompts only.
    pub fn prompt_only(&self) -> bool {
        !self.reply.head.endpoint.generates()
    }
}

/// Parses, validates and sizes a request.
pub async fn prepare(
    app: &App,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Job, Refusal> {
    let faults = RequestFaults::of_headers(headers).map_err(ApiError::bad_request)?;
    let req = InferenceRequest::parse(endpoint, body)?;
    req.validate()?;
    let model = app.dialect.served_model(&req.model, &app.settings.model)?;
    let (verdict, accepted) = app.faults.admit();
    match verdict {
        Verdict::Serve => {}
        Verdict::Fail => return Err(ApiError::internal("injected engine failure").into()),
        Verdict::Throttle => return Err(ApiError::rate_limited("injected throttling").into()),
    }
    // vLLM reads the chat's framing before it renders the template.
    let framing = (endpoint == Endpoint::ChatCompletions)
        .then(|| Framing::of_request(body))
        .transpose()?;
    let (req, mut prompts) = tokenize(app, req, body.len()).await?;
    if let (Some(framing), Some(prompt)) = (framing, prompts.first_mut()) {
        *prompt = framing
            .apply(std::mem::take(prompt), app.profile.model.tokenizer)
            .map_err(|e| ApiError::internal(e.to_string()))?;
    }
    if prompts.iter().any(Vec::is_empty) {
        return Err(ApiError::bad_request("The decoder prompt cannot be empty").into());
    }

    let first_id = app
        .next_id
        .fetch_add(prompts.len() as u64, Ordering::Relaxed);
    let head = ResponseHead::new(endpoint, first_id, &model);
    let calls = ToolCall::of_request(endpoint, body, &head.key)?;
    let params = match endpoint {
        Endpoint::Responses => Params::Responses(Box::new(Echo::of_request(body)?)),
        Endpoint::Embeddings => Params::Embeddings(Format::of_request(body, &prompts)?),
        _ => Params::Plain,
    };
    let choices = (0u64..)
        .zip(&prompts)
        .map(|(index, tokens)| choice(app, &req, body, (first_id, index), tokens))
        .collect::<Result<Vec<Choice>, Refusal>>()?;

    let shape = &app.settings.shape;
    let reasons = matches!(
        endpoint,
        Endpoint::ChatCompletions | Endpoint::Responses | Endpoint::Messages
    );
    let reasoning = if reasons { shape.reasoning_tokens } else { 0 };
    // Tools are called only if some of the answer is not reasoning.
    let calls = if choices.iter().any(|c| c.spec.output_len > reasoning) {
        calls
    } else {
        Vec::new()
    };
    let usage = (!shape.omit_usage).then(|| !req.usage_is_optional() || req.wants_stream_usage());
    Ok(Job {
        reply: Reply {
            head,
            calls,
            faults,
            usage,
            prompt_tokens: prompts.iter().map(|p| p.len() as u64).sum(),
            params,
        },
        choices,
        stream: req.is_streaming(),
        accepted,
        reasons,
    })
}

/// Token ids of each of the request's sequences; large bodies are tokenized off the workers.
async fn tokenize(
    app: &App,
    req: InferenceRequest,
    body_len: usize,
) -> Result<(InferenceRequest, Vec<Vec<TokenId>>), Refusal> {
    let encoding = app.profile.model.tokenizer;
    let (req, prompts) = if body_len > INLINE_TOKENIZE_BYTES {
        tokio::task::spawn_blocking(move || {
            let prompts = req.prompt_tokens(encoding);
            (req, prompts)
        })
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
    } else {
        let prompts = req.prompt_tokens(encoding);
        (req, prompts)
    };
    let prompts = prompts.map_err(|e| ApiError::internal(e.to_string()))?;
    Ok((req, prompts))
}

/// Sequence `index` of the request whose first sequence is `first_id`: its output budget,
/// prefix-cache hashes, text and length.
fn choice(
    app: &App,
    req: &InferenceRequest,
    body: &[u8],
    (first_id, index): (u64, u64),
    tokens: &[TokenId],
) -> Result<Choice, Refusal> {
    let prompt_len = tokens.len() as u64;
    let max_tokens = app.dialect.output_budget(req, prompt_len, &app.profile)?;
    let generates = req.endpoint.generates();
    let block_hashes = match app.dialect.cache_scope(req, body) {
        // Embeddings take no salt (vLLM's embeddings request has no `cache_salt`).
        CacheScope::Salted(_) if !generates => block_hashes(None, tokens),
        CacheScope::Salted(salt) => block_hashes(salt, tokens),
        CacheScope::Off => Vec::new(),
    };
    let seed = req.seed.unwrap_or_else(|| {
        let mut h = DefaultHasher::new();
        (app.settings.seed, tokens).hash(&mut h);
        h.finish()
    });
    // Each prompt of a batch gets its own text, even when the prompts are the same.
    let mut text = TextGen::new(seed.wrapping_add(index));
    let output_len = if !generates {
        0
    } else if req.ignore_eos.unwrap_or(false) {
        max_tokens
    } else {
        text.natural_length(&app.profile.output).min(max_tokens)
    };
    Ok(Choice {
        spec: SeqSpec {
            id: first_id + index,
            prompt_len,
            block_hashes,
            output_len,
        },
        text,
        finish: if generates && output_len == max_tokens {
            Finish::Length
        } else {
            Finish::Stop
        },
    })
}
