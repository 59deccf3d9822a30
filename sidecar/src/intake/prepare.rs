//! A request made ready for its pool, or turned away: the filter's signature (checked on the
//! headers' arrival, however long the body then takes), the body read within its bound and
//! parsed once, the model's pool, the prompt's demand and the output held for it, the tenant's
//! prefix affinity, its idempotency key claimed, and the body rewritten for the engine (engine
//! control stripped, the tenant's `cache_salt`, a stream's usage asked for).

use axum::body::Body;
use axum::http::HeaderMap;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;
use weir_core::config::Priority;
use weir_core::endpoint::Endpoint;
use weir_core::error::ApiError;
use weir_core::request::fields::answers_asked;
use weir_core::rewrite::Rewrite;
use weir_core::tokens::Encoding;

use crate::approvals;
use crate::dispatch::{Assignment, Job, Refusal};
use crate::intake::app::{App, Route};
use crate::intake::demand::{self, Demand};
use crate::intake::idempotency::{self, Claim, Claimed, StoredResponse};
use crate::intake::trust::Trusted;
use crate::relay::{Watch, resume};
use crate::replica::pool::affinity_key;
use crate::support::clock::now_ms;

/// A request ready to queue.
pub struct Prepared {
    pub who: Trusted,
    pub model: String,
    pub pool: usize,
    pub encoding: Encoding,
    /// The body as the engine gets it, but for the replica's isolation mode (applied where it
    /// is placed).
    pub body: Value,
    pub demand: Demand,
    pub claim: Option<Claim>,
    pub stream: bool,
    /// weir asked the engine for the stream's usage chunk: the caller does not get it.
    pub hide_usage: bool,
    /// Sequences the engine runs for it at once, each in a slot.
    pub sequences: u64,
    pub preemptible: bool,
    /// Output tokens its KV hold is sized for: the prediction, within its own limit.
    pub output_held: u64,
    pub kv_need: u64,
    pub affinity: u64,
    /// Until when it may wait for dispatch (Unix ms), counted from the body's arrival.
    pub deadline_ms: u64,
    /// The watch for calls that wait for an approver, when the filter vouched patterns.
    pub approval: Option<Watch>,
}

/// Why a request goes no further than its intake.
pub enum Turned {
    /// Refused with this error; its `Retry-After` follows the pool's projected wait once the
    /// pool is known.
    Refused(ApiError, Option<usize>),
    /// A duplicate of a completed request: its response, again.
    Replayed(StoredResponse),
    /// Answered here, the engine not run: a re-send naming an approval
    /// ([`crate::approvals`]), its approved call or why not.
    Answered(Box<axum::response::Response>),
}

/// Makes `body`, sent to `endpoint` with `headers`, ready to queue; every refusal is counted
/// in the metrics by its reason.
pub async fn prepare(
    app: &App,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Body,
) -> Result<Prepared, Turned> {
    let refuse = |reason: &str, tenant: &str, error: ApiError, pool: Option<usize>| {
        app.metrics.reject(reason, tenant, error.status);
        Turned::Refused(error, pool)
    };
    let who = app
        .trust
        .check(headers, now_ms())
        .map_err(|error| refuse("untrusted", "", error, None))?;
    let max_body_bytes = *app.max_body_bytes.load();
    // Too large, or cut off (the filter refused the body after sending the headers on).
    let body = axum::body::to_bytes(body, max_body_bytes)
        .await
        .map_err(|_| Turned::Refused(ApiError::payload_too_large(max_body_bytes), None))?;
    // The wait for dispatch starts now: the headers came first, the body when it came.
    let deadline_ms = now_ms().saturating_add(*app.queue_deadline_ms.load());
    let mut value = serde_json::from_slice::<Value>(&body)
        .map_err(|_| Turned::Refused(ApiError::bad_request("malformed JSON"), None))?;
    redeem(app, endpoint, headers, &who, (&body, &value))?;
    // The front door refuses these only where it enforces (not on `off` or `shadow` routes,
    // nor outside a rollout's share): as the last hop, the sidecar refuses them on every route,
    // or a tenant who learned another's response id would read that conversation.
    if endpoint == Endpoint::Responses {
        weir_core::request::responses::check_engine_state(&body)
            .map_err(|error| refuse("engine_state", &who.tenant, error, None))?;
    }
    let model = value["model"].as_str().unwrap_or_default().to_owned();
    let Some(&Route {
        pool,
        affinity_prefix_bytes,
        encoding,
        ..
    }) = app.pools.load().iter().find(|r| r.model == model)
    else {
        let error = ApiError::model_not_found(&model);
        return Err(refuse("model_not_found", &who.tenant, error, None));
    };
    let demand = demand::of(endpoint, &body, encoding, *app.exact_below_bytes.load());
    let affinity = affinity(endpoint, &value, &who.tenant, affinity_prefix_bytes);
    let claim = claim(app, &who, endpoint, &body, pool)?;
    let stream = value["stream"].as_bool().unwrap_or(false);
    let salt_key = &app.cache_salt_key;
    let hide_usage = rewrite(&mut value, endpoint, stream, salt_key, &who.tenant)
        .map_err(|error| refuse("internal", &who.tenant, error, None))?;
    let sequences = engine_sequences(endpoint, &value);
    let preemptible =
        who.priority == Priority::Batch && resume::resumable(endpoint, &value, stream);
    let output_held = output_held(app, &who.tenant, pool, &demand, sequences);
    let kv_need = demand.input_tokens.saturating_add(output_held);
    let approval = Watch::of(&who, endpoint, || approvals::request_sha256(&body));
    Ok(Prepared {
        who,
        model,
        pool,
        encoding,
        body: value,
        demand,
        claim,
        stream,
        hide_usage,
        sequences,
        preemptible,
        output_held,
        kv_need,
        affinity,
        deadline_ms,
        approval,
    })
}

/// A re-send naming an approval (`weir-approval-id`) is answered here, before it is queued:
/// with the approved call, bound to the tenant, the run and the request's body, delivered once
/// ([`crate::approvals::Approvals::redeem`]), or with why not. The engine does not run for it
/// and no record is written, so nothing is billed twice.
fn redeem(
    app: &App,
    endpoint: Endpoint,
    headers: &HeaderMap,
    who: &Trusted,
    (body, value): (&[u8], &Value),
) -> Result<(), Turned> {
    let Some(id) = headers.get(approvals::APPROVAL_ID) else {
        return Ok(());
    };
    let claim = approvals::Claim {
        tenant: &who.tenant,
        run_id: who.run_id.as_deref(),
        id: id.to_str().unwrap_or_default(),
        request_sha256: approvals::request_sha256(body),
    };
    let answer = match app.approvals.redeem(claim, value, now_ms()) {
        Ok(delivered) => delivered,
        Err(error) => {
            app.metrics
                .reject(error.code.unwrap_or("approval"), &who.tenant, error.status);
            approvals::refusal_response(&error, endpoint.error_shape())
        }
    };
    Err(Turned::Answered(Box::new(answer)))
}

/// The tenant's prefix affinity: its first `prefix_bytes` of the prompt, as sent.
fn affinity(endpoint: Endpoint, value: &Value, tenant: &str, prefix_bytes: usize) -> u64 {
    let prompt: String = prompt_fields(endpoint)
        .iter()
        .map(|f| value[*f].to_string())
        .collect();
    affinity_key(tenant, &prompt.as_bytes()[..prompt.len().min(prefix_bytes)])
}

/// The output tokens a request's KV hold is sized for: what its `sequences` will likely
/// produce, not the most they may (the hold grows if it runs past: see the relay).
fn output_held(app: &App, tenant: &str, pool: usize, demand: &Demand, sequences: u64) -> u64 {
    let predicted = app
        .predictions
        .predict(tenant, pool)
        .saturating_mul(sequences);
    demand
        .output_tokens
        .map_or(predicted, |cap| cap.min(predicted))
}

impl Prepared {
    /// The job queued for it, answered on `reply`.
    pub fn job(&self, reply: oneshot::Sender<Result<Assignment, Refusal>>) -> Job {
        Job {
            tenant: self.who.tenant.clone(),
            tier: self.who.tier.clone(),
            weights: self.who.weights.clone(),
            priority: self.who.priority,
            pool: self.pool,
            input_tokens: self.demand.input_tokens,
            kv_need: self.kv_need,
            sequences: self.sequences,
            kv_cap: self.who.kv_cap,
            affinity: self.affinity,
            arrived_ms: now_ms(),
            deadline_ms: self.deadline_ms,
            preemptible: self.preemptible,
            stream: self.stream,
            preemptions: 0,
            reply,
        }
    }
}

/// The body as the engine gets it ([`Rewrite`]): engine control stripped, the tenant's
/// `cache_salt` set where the model generates (embedding models have no prefix cache to scope;
/// vLLM ignores the field there), and a stream's usage asked for where the caller did not. True
/// when weir asked for the usage chunk.
///
/// The filter strips engine control from the requests it meters, but forwards off-mode and
/// out-of-rollout bodies as they came; the sidecar is the last hop before the engine, so it
/// rewrites every request. It asks for usage on those too, so the ledger bills the engine's
/// counts rather than a guess from the body's size; the chunk is then hidden from the caller.
fn rewrite(
    value: &mut Value,
    endpoint: Endpoint,
    stream: bool,
    salt_key: &[u8],
    tenant: &str,
) -> Result<bool, ApiError> {
    let salt = endpoint.generates().then(|| cache_salt(salt_key, tenant));
    let ask_usage = stream && endpoint.usage_is_optional() && leaves_usage_out(value);
    let Some(fields) = value.as_object_mut() else {
        return Ok(false);
    };
    let rewrite = Rewrite {
        cache_salt: salt.as_deref(),
        ask_usage,
        output_limit: None,
    };
    rewrite
        .apply(fields)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(ask_usage)
}

/// Whether a body leaves a stream's usage out: options without `include_usage: true`, or none
/// (`null`, or not an object, which the rewrite replaces, as the filter's does).
fn leaves_usage_out(value: &Value) -> bool {
    match value.get("stream_options") {
        Some(Value::Object(options)) => {
            options.get("include_usage").and_then(Value::as_bool) != Some(true)
        }
        _ => true,
    }
}

/// The fields a request's prompt starts with, for prefix affinity.
fn prompt_fields(endpoint: Endpoint) -> &'static [&'static str] {
    match endpoint {
        Endpoint::ChatCompletions => &["messages"],
        Endpoint::Completions => &["prompt"],
        Endpoint::Responses => &["instructions", "input"],
        Endpoint::Messages => &["system", "messages"],
        Endpoint::Embeddings => &["input"],
    }
}

/// Claims the caller's idempotency key before the request is queued
/// ([`crate::intake::idempotency`]): `None` when it sent none; a duplicate of a completed
/// request is replayed, one of a request under way (or of another body) refused.
fn claim(
    app: &App,
    who: &Trusted,
    endpoint: Endpoint,
    body: &[u8],
    pool: usize,
) -> Result<Option<Claim>, Turned> {
    let Some(key) = who.idempotency_key.as_deref() else {
        return Ok(None);
    };
    let history = || app.ledger_reader.history(&who.tenant, key);
    let fingerprint = idempotency::fingerprint(endpoint.path(), body);
    match (app.idempotency).claim(&who.tenant, key, fingerprint, now_ms(), history) {
        Claimed::Run(claim) => Ok(Some(claim)),
        Claimed::Replay(stored) => Err(Turned::Replayed(stored)),
        Claimed::Refused(error) => {
            let reason = error.code.unwrap_or("idempotency");
            app.metrics.reject(reason, &who.tenant, error.status);
            Err(Turned::Refused(error, Some(pool)))
        }
    }
}

/// The tenant's prefix-cache scope: a salt only weir can derive, so no tenant can name another's.
fn cache_salt(key: &[u8], tenant: &str) -> String {
    let digest = Sha256::new()
        .chain_update(b"weir cache salt\0")
        .chain_update(key)
        .chain_update([0u8])
        .chain_update(tenant.as_bytes())
        .finalize();
    digest.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

/// How many sequences the engine runs for a request at once, each in a slot of its own: one per
/// prompt of a completions batch and per input of an embeddings batch (vLLM and llama.cpp run
/// each as a request of its own), times the answers asked for per prompt
/// ([`answers_asked`]: the filter refuses more than one where it meters, off-mode
/// requests come as sent). At least 1.
fn engine_sequences(endpoint: Endpoint, body: &Value) -> u64 {
    let batch = match endpoint {
        Endpoint::Completions => &body["prompt"],
        Endpoint::Embeddings => &body["input"],
        _ => &Value::Null,
    };
    let prompts = match batch.as_array() {
        // A list of strings or of token lists is a batch; a list of token ids is one prompt.
        Some(items) if items.first().is_some_and(|i| i.is_string() || i.is_array()) => {
            items.len() as u64
        }
        _ => 1,
    };
    prompts.saturating_mul(answers_asked(body)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_batch_is_as_many_sequences_as_it_has_prompts_or_inputs() {
        let seqs = |endpoint, body: Value| engine_sequences(endpoint, &body);
        let completions = Endpoint::Completions;
        assert_eq!(seqs(completions, json!({"prompt": "a"})), 1);
        assert_eq!(
            seqs(completions, json!({"prompt": [1, 2, 3]})),
            1,
            "one token prompt"
        );
        assert_eq!(seqs(completions, json!({"prompt": ["a", "b", "c"]})), 3);
        assert_eq!(seqs(completions, json!({"prompt": [[1], [2]], "n": 2})), 4);
        assert_eq!(seqs(Endpoint::Embeddings, json!({"input": ["a", "b"]})), 2);
        assert_eq!(seqs(Endpoint::ChatCompletions, json!({"n_cmpl": 3})), 3);
        assert_eq!(seqs(Endpoint::ChatCompletions, json!({"n": 0})), 1);
        assert_eq!(seqs(Endpoint::Messages, json!({"messages": ["a", "b"]})), 1);
    }

    #[test]
    fn salts_differ_per_tenant_and_secret() {
        let a = cache_salt(b"secret-0123456789", "acme/p/k");
        assert_eq!(a, cache_salt(b"secret-0123456789", "acme/p/k"));
        assert_ne!(a, cache_salt(b"secret-0123456789", "globex/p/k"));
        assert_ne!(a, cache_salt(b"other-secret-0123", "acme/p/k"));
        assert_eq!(a.len(), 32);
    }

    #[test]
    fn a_stream_without_usage_options_is_asked_for_its_usage_as_the_filter_asks() {
        for options in [
            json!(null),
            json!("x"),
            json!({}),
            json!({"include_usage": false}),
        ] {
            assert!(
                leaves_usage_out(&json!({"stream_options": options})),
                "{options}"
            );
        }
        assert!(leaves_usage_out(&json!({})));
        assert!(!leaves_usage_out(
            &json!({"stream_options": {"include_usage": true}})
        ));
    }

    #[test]
    fn a_stream_with_options_that_are_not_an_object_still_asks_for_usage() {
        for options in [json!(null), json!(false), json!("x"), json!([])] {
            let mut body = json!({"model": "m", "stream": true, "stream_options": options});
            let hide = rewrite(&mut body, Endpoint::ChatCompletions, true, b"k", "t").ok();
            assert_eq!(
                hide,
                Some(true),
                "{options}: weir asks, and hides the chunk"
            );
            assert_eq!(body["stream_options"]["include_usage"], true, "{options}");
        }
    }
}
