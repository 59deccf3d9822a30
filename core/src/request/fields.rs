//! The body fields every inference API shares — the model, streaming, every output limit and
//! answer count an engine may read — and how one top-level field is read from its own text.

use serde::Deserialize;

use crate::error::ApiError;
use crate::request::prompt::RawObject;

/// Every output limit an engine may read, whichever API it serves: OpenAI's
/// `max_completion_tokens` and `max_tokens` (older engines and TGI read only the latter), the
/// Responses API's `max_output_tokens`, Anthropic's `max_tokens`, llama.cpp's `n_predict`.
/// The front door bounds all of them, on every API: an engine may read one that the API does not
/// define.
pub const OUTPUT_LIMIT_FIELDS: [&str; 4] = [
    "max_completion_tokens",
    "max_tokens",
    "max_output_tokens",
    "n_predict",
];

/// How many answers a request asks the engine for, by every name an engine reads: OpenAI's `n`,
/// llama.cpp's `n_cmpl` (which it reads before `n`, running each answer in a slot of its own),
/// `best_of` (vLLM's older engine, TGI: sequences generated to return the best). Only one answer
/// is served, on every API: each of them multiplies a request's output past its reservation.
pub const ANSWER_COUNT_FIELDS: [&str; 3] = ["n", "n_cmpl", "best_of"];

/// Answers a body (as a JSON tree) asks for per prompt: the largest of its
/// [`ANSWER_COUNT_FIELDS`], else 1.
pub fn answers_asked(body: &serde_json::Value) -> u64 {
    ANSWER_COUNT_FIELDS
        .iter()
        .filter_map(|f| body[*f].as_u64())
        .max()
        .unwrap_or(1)
}

/// Fields read here for every API; each API's model reads the rest.
pub const COMMON_FIELDS: [&str; 13] = [
    "model",
    "stream",
    "stream_options",
    "n",
    "n_cmpl",
    "best_of",
    "seed",
    "ignore_eos",
    "cache_salt",
    "max_completion_tokens",
    "max_tokens",
    "max_output_tokens",
    "n_predict",
];

/// Reads one top-level field, if present and not `null`, naming the field (and the path inside
/// it) when it has the wrong shape.
pub fn field<'de, T: Deserialize<'de>>(
    top: &RawObject<'de>,
    name: &str,
) -> Result<Option<T>, ApiError> {
    let Some(raw) = top.get(name) else {
        return Ok(None);
    };
    let mut de = serde_json::Deserializer::from_str(raw.get());
    serde_path_to_error::deserialize::<_, Option<T>>(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let at = match path.as_str() {
            "" | "." => name.to_owned(),
            p if p.starts_with('[') => format!("{name}{p}"),
            p => format!("{name}.{p}"),
        };
        ApiError::bad_request(format!("invalid request: {at}: {}", e.inner())).with_param(name)
    })
}
