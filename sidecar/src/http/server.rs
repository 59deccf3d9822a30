//! The HTTP side: Envoy sends filtered requests here. Only requests whose trusted headers the
//! filter signed are served ([`crate::intake::trust`]); the sidecar binds to loopback by default (use
//! mTLS between pods as well).

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;
use weir_core::admission::ENGINE_CONTROL_FIELDS;
use weir_core::config::Priority;
use weir_core::endpoint::Endpoint;
use weir_core::error::{ApiError, ErrorShape};

use crate::dispatcher::{Event, Job, Refusal};
use crate::intake::app::App;
use crate::intake::demand;
use crate::intake::idempotency::{self, Claimed, StoredResponse};
use crate::intake::trust::Trusted;
use crate::relay::resume::{self, Splice};
use crate::relay::{Attempt, Continuation, Flight, TRACE_ID, relay};
use crate::replica::pool::affinity_key;
use crate::support::clock::now_ms;
use crate::support::respond::error_response;

/// A pool as requests are matched to it: its model, how much of a prompt picks the affine
/// replica, and how its prompts are counted.
pub struct PoolRoute {
    pub model: String,
    pub affinity_prefix_bytes: usize,
    pub encoding: weir_core::tokens::Encoding,
}

/// Sent by Anthropic's SDKs on every request.
const ANTHROPIC_VERSION: &str = "anthropic-version";

/// The serving port, where Envoy routes: the inference APIs and the tenant's model list only.
/// Whatever a tenant sends through the gateway lands here, so nothing on it may show another
/// tenant's figures.
pub fn router(app: Arc<App>) -> Router {
    let mut router = Router::new().route("/v1/models", get(models));
    for endpoint in Endpoint::ALL {
        router = router.route(
            endpoint.path(),
            post(
                move |State(app): State<Arc<App>>, headers: HeaderMap, body: Body| {
                    serve(app, endpoint, headers, body)
                },
            ),
        );
    }
    router
        .route(weir_core::fleet::PATH, post(leases))
        .fallback(|headers: HeaderMap| async move {
            error_response(&ApiError::not_found("no such route"), shape_of(&headers), 0)
        })
        .with_state(app)
}

/// The quota service's renewals; 404 like any unknown route without a `quota` section.
async fn leases(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    match &app.quota {
        Some(store) => {
            crate::http::quota::serve(store, &app.trust, &app.metrics, headers, body).await
        }
        None => error_response(&ApiError::not_found("no such route"), ErrorShape::OpenAi, 0),
    }
}

/// Anthropic's error shape for Anthropic's SDKs, OpenAI's otherwise (for paths that are not an
/// API's own).
fn shape_of(headers: &HeaderMap) -> ErrorShape {
    if headers.contains_key(ANTHROPIC_VERSION) {
        ErrorShape::Anthropic
    } else {
        ErrorShape::OpenAi
    }
}

/// The admin port (`admin_listen`), never routed to by the gateway: metrics of every tenant,
/// the health check (liveness) and `/ready` (readiness) for probes.
pub fn admin_router(app: Arc<App>) -> Router {
    Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            error_response(&ApiError::not_found("no such route"), ErrorShape::OpenAi, 0)
        })
        .with_state(app)
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let mut out = String::new();
    let _ = prometheus_client::encoding::text::encode(&mut out, &app.registry);
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        out,
    )
        .into_response()
}

/// Every pool and replica as the dispatcher sees them ([`crate::replica::readiness`]): 200 while every
/// pool has a replica that serves, else 503.
async fn ready(State(app): State<Arc<App>>) -> Response {
    if *app.draining.borrow() {
        let body = serde_json::json!({"ready": false, "draining": true});
        return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    }
    let (reply, snapshot) = oneshot::channel();
    let _ = app.events.send(Event::Ready(reply));
    match tokio::time::timeout(std::time::Duration::from_secs(1), snapshot).await {
        Ok(Ok(readiness)) => {
            let status = if readiness.ready {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            (status, axum::Json(readiness)).into_response()
        }
        _ => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

/// The models this sidecar serves that the caller's key may use, as OpenAI's model list (or
/// Anthropic's, for Anthropic's SDKs).
async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    let shape = shape_of(&headers);
    let who = match app.trust.check(&headers, now_ms()) {
        Ok(who) => who,
        Err(refusal) => {
            app.metrics.reject("untrusted", "", refusal.status);
            return error_response(&refusal, shape, 0);
        }
    };
    let allowed = |m: &str| {
        who.models
            .as_ref()
            .is_none_or(|ms| ms.iter().any(|a| a == m))
    };
    let routes = app.pools.load();
    let ids: Vec<&str> = routes
        .iter()
        .map(|r| r.model.as_str())
        .filter(|m| allowed(m))
        .collect();
    let list = match shape {
        ErrorShape::OpenAi => json!({
            "object": "list",
            "data": ids.iter().map(|id| json!({
                "id": id, "object": "model", "created": 0, "owned_by": "weir",
            })).collect::<Vec<_>>(),
        }),
        ErrorShape::Anthropic => json!({
            "data": ids.iter().map(|id| json!({
                "type": "model", "id": id, "display_name": id,
                "created_at": "1970-01-01T00:00:00Z",
            })).collect::<Vec<_>>(),
            "has_more": false,
            "first_id": ids.first(),
            "last_id": ids.last(),
        }),
    };
    axum::Json(list).into_response()
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
/// each as a request of its own), times the answers asked for per prompt (`n`, llama.cpp's
/// `n_cmpl`, `best_of`: the filter refuses more than one where it meters, off-mode requests
/// come as sent). At least 1.
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
    let answers = ["n", "n_cmpl", "best_of"]
        .iter()
        .filter_map(|f| body[*f].as_u64())
        .max()
        .unwrap_or(1);
    prompts.saturating_mul(answers).max(1)
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

async fn serve(app: Arc<App>, endpoint: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let arrived = Instant::now();
    let shape = endpoint.error_shape();
    let error_response = |e: &ApiError| error_response(e, shape, app.backoff.retry_after_s(None));
    // The signature first: the filter sends the headers on before the body, so they are
    // checked on arrival, however long the body then takes.
    let who = match app.trust.check(&headers, now_ms()) {
        Ok(who) => who,
        Err(refusal) => {
            app.metrics.reject("untrusted", "", refusal.status);
            return error_response(&refusal);
        }
    };
    let max_body_bytes = *app.max_body_bytes.load();
    let Ok(body) = axum::body::to_bytes(body, max_body_bytes).await else {
        // Too large, or cut off (the filter refused the body after sending the headers on).
        return error_response(&ApiError::payload_too_large(max_body_bytes));
    };
    // The wait for dispatch starts now: the headers came first, the body when it came.
    let deadline_ms = now_ms().saturating_add(*app.queue_deadline_ms.load());
    let Ok(mut value) = serde_json::from_slice::<Value>(&body) else {
        return error_response(&ApiError::bad_request("malformed JSON"));
    };
    // The front door refuses these only where it enforces (not on `off` or `shadow` routes,
    // nor outside a rollout's share): as the last hop, the sidecar refuses them on every route,
    // or a tenant who learned another's response id would read that conversation.
    if endpoint == Endpoint::Responses
        && let Err(error) = weir_core::responses::check_engine_state(&body)
    {
        app.metrics
            .reject("engine_state", &who.tenant, error.status);
        return error_response(&error);
    }
    let model = value["model"].as_str().unwrap_or_default().to_owned();
    let Some((pool, prefix_bytes, encoding)) =
        app.pools.load().iter().find_map(|r| {
            (r.model == model).then_some((r.pool, r.affinity_prefix_bytes, r.encoding))
        })
    else {
        app.metrics.reject("model_not_found", &who.tenant, 404);
        return error_response(&ApiError::model_not_found(&model));
    };
    // From here a refusal's `Retry-After` follows the pool's projected wait.
    let error_response =
        |e: &ApiError| self::error_response(e, shape, app.backoff.retry_after_s(Some(pool)));
    let demand = demand::of(endpoint, &body, encoding, *app.exact_below_bytes.load());
    let prompt: String = prompt_fields(endpoint)
        .iter()
        .map(|f| value[*f].to_string())
        .collect();
    let affinity = affinity_key(
        &who.tenant,
        &prompt.as_bytes()[..prompt.len().min(prefix_bytes)],
    );
    let claim = match claim(&app, &who, endpoint, &body) {
        None => None,
        Some(Claimed::Run(claim)) => Some(claim),
        Some(Claimed::Replay(stored)) => return replayed(stored),
        Some(Claimed::Refused(error)) => {
            app.metrics.reject(
                error.code.unwrap_or("idempotency"),
                &who.tenant,
                error.status,
            );
            return error_response(&error);
        }
    };
    strip_engine_control(&mut value);
    // Embedding models have no prefix cache to scope (vLLM ignores the field there).
    if endpoint.generates() {
        value["cache_salt"] = json!(cache_salt(&app.cache_salt_key, &who.tenant));
    }
    let stream = value["stream"].as_bool().unwrap_or(false);
    let usage_is_optional = matches!(endpoint, Endpoint::ChatCompletions | Endpoint::Completions);
    let hide_usage = stream && usage_is_optional && ask_stream_usage(&mut value);
    // Each sequence the engine runs for the request takes a slot, and may produce output.
    let sequences = engine_sequences(endpoint, &value);
    let preemptible =
        who.priority == Priority::Batch && resume::resumable(endpoint, &value, stream);
    // Held for the output it will likely produce, not the most it may (the hold grows if it
    // runs past: see the relay).
    let predicted = app
        .predictions
        .predict(&who.tenant, pool)
        .saturating_mul(sequences);
    let output_held = demand
        .output_tokens
        .map_or(predicted, |cap| cap.min(predicted));
    let kv_need = demand.input_tokens.saturating_add(output_held);

    let (reply, assigned) = oneshot::channel();
    let job = Job {
        tenant: who.tenant.clone(),
        tier: who.tier.clone(),
        weights: who.weights.clone(),
        priority: who.priority,
        pool,
        input_tokens: demand.input_tokens,
        kv_need,
        sequences,
        kv_cap: who.kv_cap,
        affinity,
        arrived_ms: now_ms(),
        deadline_ms,
        preemptible,
        stream,
        preemptions: 0,
        reply,
    };
    if app.events.send(Event::Enqueue(job)).is_err() {
        return error_response(&ApiError::new(503, "dispatcher stopped"));
    }
    let assignment = match assigned.await {
        Ok(Ok(a)) => a,
        Ok(Err(refusal)) => {
            // Told to come back about when its own backlog has gone, not the pool's.
            let retry_after = refusal.wait_ms().map_or_else(
                || app.backoff.retry_after_s(Some(pool)),
                |ms| app.backoff.retry_after_wait_s(ms),
            );
            return self::error_response(&refused(refusal), shape, retry_after);
        }
        Err(_) => return error_response(&refused(Refusal::NoReplica)),
    };
    // The caller's trace id goes back to the caller and, suffixed with weir's attempt id, to
    // the engine: engines such as vLLM take `x-request-id` as their own request id, so two
    // calls of one mesh trace (or another tenant's copy of the id) must not meet there.
    let trace_id = headers.get(TRACE_ID).cloned();
    let engine_request_id = engine_request_id(trace_id.as_ref(), &who.request_id);
    // Kept before the replica's isolation mode is applied: a resumed stream may run elsewhere.
    let continuation = preemptible.then(|| Continuation {
        body: value.clone(),
        trace_id: engine_request_id.clone(),
        splice: Splice::new(encoding),
    });
    // Last, over whatever the caller sent: the replica's isolation mode (its off-switch).
    assignment.isolation.apply(&mut value);
    let body = serde_json::to_vec(&value).unwrap_or_default();
    let attempt = Attempt {
        endpoint,
        who,
        model,
        input_tokens: demand.input_tokens,
        output_held,
        unread_output: demand.unread_output,
        uncapped: demand.output_tokens.is_none(),
        sequences,
        arrived,
        deadline_ms,
        hide_usage,
        continuation,
    };
    let flight = Flight::new(app, attempt, assignment, claim);
    let mut resp = relay(flight, endpoint.path(), body, stream, engine_request_id).await;
    if let Some(trace_id) = trace_id {
        resp.headers_mut().insert(TRACE_ID, trace_id);
    }
    resp
}

/// The `x-request-id` an engine sees: the caller's trace id (searchable in engine logs) with
/// weir's attempt id after it, unique per attempt.
fn engine_request_id(trace_id: Option<&HeaderValue>, attempt_id: &str) -> Option<HeaderValue> {
    let id = match trace_id.and_then(|t| t.to_str().ok()) {
        Some(trace) => format!("{trace}.{attempt_id}"),
        None => attempt_id.to_owned(),
    };
    HeaderValue::from_str(&id).ok()
}

/// Removes the body fields by which a request would steer the engine across the tenant
/// boundary ([`ENGINE_CONTROL_FIELDS`]). The filter strips them from the requests it meters, but
/// forwards off-mode and out-of-rollout bodies as they came; the sidecar is the last hop before
/// the engine, so it strips them from every request.
fn strip_engine_control(value: &mut Value) {
    if let Some(fields) = value.as_object_mut() {
        for field in ENGINE_CONTROL_FIELDS {
            fields.remove(field);
        }
    }
}

/// Asks the engine for a stream's usage chunk when the body does not (requests the filter did
/// not meter: off mode, out of the rollout), so the ledger bills the engine's counts rather
/// than a guess from the body's size. True when weir asked: the chunk is then hidden from the
/// caller, who did not ask for it.
fn ask_stream_usage(value: &mut Value) -> bool {
    let Some(fields) = value.as_object_mut() else {
        return false;
    };
    let options = fields.entry("stream_options").or_insert_with(|| json!({}));
    let Some(options) = options.as_object_mut() else {
        return false;
    };
    if options.get("include_usage").and_then(Value::as_bool) == Some(true) {
        return false;
    }
    options.insert("include_usage".into(), Value::Bool(true));
    true
}

/// Claims the caller's idempotency key before the request is queued ([`crate::intake::idempotency`]);
/// `None` when it sent none.
fn claim(app: &App, who: &Trusted, endpoint: Endpoint, body: &[u8]) -> Option<Claimed> {
    let key = who.idempotency_key.as_deref()?;
    let history = || app.ledger_reader.history(&who.tenant, key);
    let fingerprint = idempotency::fingerprint(endpoint.path(), body);
    Some(
        app.idempotency
            .claim(&who.tenant, key, fingerprint, now_ms(), history),
    )
}

/// A completed response, sent again for a duplicate of its request.
fn replayed(stored: StoredResponse) -> Response {
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let mut resp = (status, stored.body).into_response();
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(stored.content_type),
    );
    headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    resp
}

/// The answer to a refusal from the queue.
fn refused(refusal: Refusal) -> ApiError {
    let unavailable = |message| ApiError::new(503, message);
    match refusal {
        Refusal::QueueFull(_) => {
            ApiError::rate_limited("too many requests queued for this tenant; retry shortly")
                .with_code("queue_full")
        }
        Refusal::Shed(_) => ApiError::rate_limited(
            "the pool is overloaded; free-tier requests beyond one queued are shed first",
        )
        .with_code("overloaded"),
        Refusal::ProjectedWait(_) => unavailable(
            "this tenant's queued requests would not be dispatched before this one's deadline",
        )
        .with_code("projected_wait"),
        Refusal::DeadlinePassed(_) => {
            unavailable("the pool is saturated and the request's wait passed its deadline")
                .with_code("queue_deadline")
        }
        Refusal::NoReplica => unavailable("no healthy replica"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
