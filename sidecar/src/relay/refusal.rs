//! An attempt the relay ends before an answer is relayed, settled and answered in one place:
//! the engine unreachable or failing, refusing the pool's credential or throttling it, no
//! answer by a deadline, an answer too large, the shutdown grace period over. Each error
//! carries what the attempt was billed, and a retryable one a `Retry-After`.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use weir_core::endpoint::Endpoint;
use weir_core::error::ApiError;
use weir_core::meter::BodyUsage;

use crate::dispatch::Event;
use crate::relay::flight::Flight;
use crate::support::respond::{error_response, error_response_with};
use weir_core::outcome;

impl Flight {
    /// An error reply to the caller, in its API's shape. An attempt that used the engine (a
    /// response deadline, an answer too large, an engine failing mid-answer) carries what it
    /// was billed as the API's `usage`, so the filter settles the tenant's quota on the same
    /// figures as the ledger (it charges an error without usage nothing).
    pub(super) fn refusal(&self, error: ApiError) -> Response {
        let shape = self.endpoint.error_shape();
        let Some(bill) = self.settled.filter(|bill| bill.ran) else {
            return error_response(&error, shape, self.retry_after_s());
        };
        let mut body = error.to_json_in(shape);
        body["usage"] = usage_json(self.endpoint, bill.prompt, bill.completion);
        error_response_with(&error, body, self.retry_after_s())
    }

    /// `Retry-After` for a retryable answer: drawn around the pool's projected wait.
    pub(super) fn retry_after_s(&self) -> u64 {
        self.app
            .backoff
            .retry_after_s(Some(self.hold.assignment.pool))
    }

    /// The engine's own `Retry-After`, never sooner than it asked but spread and capped as
    /// weir's are ([`crate::support::backoff::after_engine`]); an HTTP date is passed on as it is.
    pub(super) fn engine_retry_after(&self, engine: HeaderValue) -> HeaderValue {
        let seconds = engine.to_str().ok().and_then(|v| v.trim().parse().ok());
        seconds.map_or(engine, |s| {
            self.app
                .backoff
                .after_engine_s(self.hold.assignment.pool, s)
                .into()
        })
    }

    /// The replica failed (unreachable, or its connection broke): the dispatcher is told and
    /// the attempt settled `failed`.
    pub(super) fn replica_failed(&mut self, body_usage: Option<BodyUsage>) {
        let _ = self.app.events.send(Event::ReplicaFailed {
            pool: self.hold.assignment.pool,
            replica: self.hold.assignment.replica,
        });
        self.finish(outcome::FAILED, body_usage);
    }
}

/// An API's `usage` object for `prompt` and `output` tokens, as its answers spell it.
fn usage_json(endpoint: Endpoint, prompt: u64, output: u64) -> serde_json::Value {
    let total = prompt.saturating_add(output);
    match endpoint {
        Endpoint::ChatCompletions | Endpoint::Completions => serde_json::json!({
            "prompt_tokens": prompt, "completion_tokens": output, "total_tokens": total}),
        Endpoint::Embeddings => {
            serde_json::json!({"prompt_tokens": prompt, "total_tokens": prompt})
        }
        Endpoint::Responses => serde_json::json!({
            "input_tokens": prompt, "output_tokens": output, "total_tokens": total}),
        Endpoint::Messages => serde_json::json!({"input_tokens": prompt, "output_tokens": output}),
    }
}

/// The engine could not be reached: it ran nothing and is billed nothing.
pub(super) fn unreachable(flight: &mut Flight, error: reqwest::Error) -> Response {
    tracing::warn!(replica = %flight.hold.assignment.url, "replica unreachable: {:#}", anyhow::Error::from(error));
    flight.meter.nothing_ran = true;
    flight.replica_failed(Some(BodyUsage::Unknown));
    flight.refusal(ApiError::new(
        502,
        "the engine replica could not be reached; retry",
    ))
}

/// The engine failed partway through a non-streamed answer: it took the prompt and is
/// billed it (its output is in the part that never came).
pub(super) fn failed_mid_response(flight: &mut Flight) -> Response {
    flight.replica_failed(Some(BodyUsage::Unknown));
    flight.refusal(ApiError::new(
        502,
        "the engine replica failed mid-response; retry",
    ))
}

/// A non-streamed answer past `relay.max_response_bytes`: the engine did the work, so the
/// attempt is billed its prompt and its answer's bound (its own count is in the part not read),
/// and the caller told to ask for less.
pub(super) fn too_large(flight: &mut Flight, max: usize) -> Response {
    (flight.app.metrics).reject("response_too_large", &flight.who.tenant, 502);
    flight.meter.streamed = false;
    flight.finish("response_too_large", None);
    flight.refusal(
        ApiError::new(
            502,
            format!(
                "the engine's answer is larger than this gateway relays ({max} bytes, \
                 relay.max_response_bytes); ask for less (fewer inputs, a lower max_tokens)"
            ),
        )
        .with_code("response_too_large"),
    )
}

/// A request still running when the shutdown grace period ends: recorded, then refused. Before
/// its first bytes came nothing was relayed: it is billed its prompt, not an unread answer's
/// bound (weir's restart cut it, not the caller).
pub(super) fn cut_short(flight: &mut Flight) -> Response {
    flight.finish("shutdown", Some(BodyUsage::Unknown));
    flight.refusal(
        ApiError::new(503, "the gateway's scheduler is restarting; retry")
            .with_code("shutting_down"),
    )
}

/// The engine's answer to a request it refused or throttled, if it did ([`credential_refused`],
/// [`throttled`]); `retry_after` is the engine's own.
pub(super) fn refused_by_engine(
    flight: &mut Flight,
    status: StatusCode,
    retry_after: Option<HeaderValue>,
) -> Option<Response> {
    match status {
        StatusCode::UNAUTHORIZED | StatusCode::PROXY_AUTHENTICATION_REQUIRED => {
            Some(credential_refused(flight, status))
        }
        StatusCode::TOO_MANY_REQUESTS => Some(throttled(flight, retry_after)),
        _ => None,
    }
}

/// An engine that refuses a request as unauthenticated refuses the pool's credential, not the
/// caller's key (which the gateway checked): the caller gets a retryable 502 of weir's own,
/// never the engine's answer, whose body speaks of the credential it got (a hosted API quotes
/// part of the key it refused) and which an SDK would take for its own key being wrong.
fn credential_refused(flight: &mut Flight, status: StatusCode) -> Response {
    tracing::warn!(replica = %flight.hold.assignment.url, %status, "the engine refused the pool's credential");
    (flight.app.metrics).reject("engine_unauthorized", &flight.who.tenant, 502);
    flight.finish(outcome::UPSTREAM_ERROR, None);
    flight.refusal(
        ApiError::new(
            502,
            "the engine refused the gateway's own credential; retry later",
        )
        .with_code("engine_unauthorized"),
    )
}

/// An engine that throttles a request throttles the pool's account, every tenant's traffic
/// together: the caller gets the engine's 429 and `Retry-After`, in weir's words, never the
/// engine's answer, which speaks of the account's limits and usage (a hosted API names the
/// organization and what it used: the figures the filter keeps out of rate-limit headers).
fn throttled(flight: &mut Flight, retry_after: Option<HeaderValue>) -> Response {
    (flight.app.metrics).reject("engine_rate_limited", &flight.who.tenant, 429);
    flight.finish(outcome::UPSTREAM_ERROR, None);
    let mut resp = flight.refusal(
        ApiError::rate_limited("the engine is rate limiting the gateway's requests; retry later")
            .with_code("engine_rate_limited"),
    );
    if let Some(retry_after) = retry_after {
        let retry_after = flight.engine_retry_after(retry_after);
        resp.headers_mut().insert(header::RETRY_AFTER, retry_after);
    }
    resp
}

/// A request whose engine had not answered (headers, or the whole of a non-streamed body) by
/// the end of `relay.max_response_ms`: the upstream request is dropped (the engine aborts and
/// frees the KV), the attempt recorded and billed its prompt — not an unread answer's bound:
/// weir's deadline cut it, and a hung engine must not bill every tenant its `max_tokens` — and
/// the caller told to retry.
pub(super) fn timed_out(flight: &mut Flight) -> Response {
    flight.finish("response_deadline", Some(BodyUsage::Unknown));
    flight.refusal(
        ApiError::new(
            504,
            "the engine did not answer within the gateway's longest response time; retry",
        )
        .with_code("response_deadline"),
    )
}

/// A stream the engine had not started (no body bytes) by the end of `relay.first_byte_ms`: the
/// upstream request is dropped (the engine aborts it), the replica's concurrency limit lowered,
/// and the caller told to retry. An engine that had `accepted` it (its headers came: vLLM sends
/// them as it takes a request in, llama.cpp once a slot starts it) ran its prompt, or held it
/// in a queue of its own, and is billed the prompt: a prefill longer than the deadline is not
/// free to retry without end. One that had not ran nothing and is billed nothing.
pub(super) fn not_started(flight: &mut Flight, accepted: bool) -> Response {
    flight.hold.assignment.not_started();
    (flight.app.metrics).reject("first_byte_deadline", &flight.who.tenant, 503);
    flight.meter.nothing_ran = !accepted;
    flight.finish("first_byte_deadline", Some(BodyUsage::Unknown));
    flight.refusal(
        ApiError::new(
            503,
            "the engine did not start the request within the gateway's first-byte deadline; retry",
        )
        .with_code("first_byte_deadline"),
    )
}
