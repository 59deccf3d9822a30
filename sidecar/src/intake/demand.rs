//! What a request will ask of an engine, read from the body the filter admitted: its prompt in
//! tokens (the filter's estimator, run again here) and the most output it may produce.
//!
//! The filter sends a request's headers on before its body is read (all a mesh lets a module
//! do), so it can vouch only for who sent it; the sidecar has the body anyway. The engine's own
//! count replaces the prompt estimate once it reports usage (see [`crate::relay`]).

use weir_core::admission;
use weir_core::endpoint::Endpoint;
use weir_core::estimate::{self, Counting};
use weir_core::request::InferenceRequest;
use weir_core::tokens::Encoding;

/// Output tokens held per sequence when prediction is off ([`crate::intake::prediction`]): KV
/// admission needs a figure, and holding a whole `max_tokens` would admit a fraction of what
/// fits.
pub const UNBOUNDED_OUTPUT_TOKENS: u64 = 512;

/// Bytes per token assumed for a body that cannot be read as its API's request.
const BYTES_PER_TOKEN: u64 = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Demand {
    pub input_tokens: u64,
    /// The most output the engine may generate for it, every answer together: `None` when the
    /// body sets no limit.
    pub output_tokens: Option<u64>,
    /// The output its answer is billed if nobody reads it (a non-streamed answer the client
    /// left): the filter charges the same ([`admission::unread_output`]).
    pub unread_output: u64,
}

/// The demand of `body` sent to `endpoint`, counted with `encoding` (exactly up to
/// `exact_below_bytes` of prompt text).
pub fn of(endpoint: Endpoint, body: &[u8], encoding: Encoding, exact_below_bytes: usize) -> Demand {
    let Ok(req) = InferenceRequest::parse(endpoint, body) else {
        return Demand {
            input_tokens: body.len() as u64 / BYTES_PER_TOKEN,
            output_tokens: None,
            unread_output: admission::unread_output(None, 1),
        };
    };
    let limit = req.largest_output_limit().map(u64::from);
    let output_tokens = match limit {
        _ if req.answers() == 0 => Some(0),
        limit => limit.map(|n| n.saturating_mul(req.answers())),
    };
    Demand {
        input_tokens: estimate::prompt_tokens(&req, encoding, exact_below_bytes, Counting::Exact)
            .tokens,
        output_tokens,
        unread_output: admission::unread_output(limit, req.answers()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demand(endpoint: Endpoint, body: &str) -> Demand {
        of(endpoint, body.as_bytes(), Encoding::Cl100kBase, 8192)
    }

    #[test]
    fn the_prompt_is_counted_and_the_output_bounded_as_the_body_says() {
        let chat = demand(
            Endpoint::ChatCompletions,
            r#"{"model":"m","max_tokens":40,"messages":[{"role":"user","content":"hello"}]}"#,
        );
        assert_eq!(
            chat,
            Demand {
                input_tokens: 8,
                output_tokens: Some(40),
                unread_output: 40,
            }
        );
        let batch = demand(
            Endpoint::Completions,
            r#"{"model":"m","max_tokens":5,"prompt":["a","b","c"]}"#,
        );
        assert_eq!(batch.output_tokens, Some(15), "each prompt is answered");
        assert_eq!(batch.unread_output, 15);
        let embeddings = demand(Endpoint::Embeddings, r#"{"model":"m","input":["a b","c"]}"#);
        assert_eq!(
            embeddings,
            Demand {
                input_tokens: 3,
                output_tokens: Some(0),
                unread_output: 0,
            }
        );
        let unbounded = demand(Endpoint::Responses, r#"{"model":"m","input":"hi"}"#);
        assert_eq!(unbounded.output_tokens, None);
        assert_eq!(
            unbounded.unread_output,
            admission::UNBOUNDED_OUTPUT_RESERVATION,
            "an unread answer without a limit is billed as the filter charges it"
        );
        let unreadable = demand(
            Endpoint::ChatCompletions,
            r#"{"model":"m","messages":7,"x":"......"}"#,
        );
        assert_eq!(unreadable.output_tokens, None);
        assert!(unreadable.input_tokens > 0);
    }
}
