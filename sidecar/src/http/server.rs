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
use serde_json::json;
use tokio::sync::oneshot;
use weir_core::endpoint::Endpoint;
use weir_core::error::{ApiError, ErrorShape};

use crate::dispatch::{Event, Refusal};
use crate::intake::app::App;
use crate::intake::idempotency::StoredResponse;
use crate::intake::prepare::{Turned, prepare};
use crate::relay::resume::Splice;
use crate::relay::{Attempt, Continuation, Flight, TRACE_ID, relay};
use crate::support::clock::now_ms;
use crate::support::respond::error_response;

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
    crate::http::approvals::routes(router)
        .route(weir_core::fleet::PATH, post(leases))
        .merge(crate::http::runs::routes())
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

async fn serve(app: Arc<App>, endpoint: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let arrived = Instant::now();
    let shape = endpoint.error_shape();
    let mut p = match prepare(&app, endpoint, &headers, body).await {
        Ok(p) => p,
        Err(Turned::Replayed(stored)) => return replayed(stored),
        Err(Turned::Answered(answer)) => return *answer,
        Err(Turned::Refused(error, pool)) => {
            return error_response(&error, shape, app.backoff.retry_after_s(pool));
        }
    };
    let pool = p.pool;
    let (reply, assigned) = oneshot::channel();
    if app.events.send(Event::Enqueue(p.job(reply))).is_err() {
        let error = ApiError::new(503, "dispatcher stopped");
        return error_response(&error, shape, app.backoff.retry_after_s(Some(pool)));
    }
    let assignment = match assigned.await {
        Ok(Ok(a)) => a,
        Ok(Err(refusal)) => {
            // Told to come back about when its own backlog has gone, not the pool's.
            let retry_after = refusal.wait_ms().map_or_else(
                || app.backoff.retry_after_s(Some(pool)),
                |ms| app.backoff.retry_after_wait_s(ms),
            );
            return error_response(&refused(refusal), shape, retry_after);
        }
        Err(_) => {
            let retry_after = app.backoff.retry_after_s(Some(pool));
            return error_response(&refused(Refusal::NoReplica), shape, retry_after);
        }
    };
    // The caller's trace id goes back to the caller and, suffixed with weir's attempt id, to
    // the engine: engines such as vLLM take `x-request-id` as their own request id, so two
    // calls of one mesh trace (or another tenant's copy of the id) must not meet there.
    let trace_id = headers.get(TRACE_ID).cloned();
    let engine_request_id = engine_request_id(trace_id.as_ref(), &p.who.request_id);
    // Kept before the replica's isolation mode is applied: a resumed stream may run elsewhere.
    let continuation = p.preemptible.then(|| Continuation {
        body: p.body.clone(),
        trace_id: engine_request_id.clone(),
        splice: Splice::new(p.encoding),
    });
    // Last, over whatever the caller sent: the replica's isolation mode (its off-switch).
    assignment.isolation.apply(&mut p.body);
    let body = serde_json::to_vec(&p.body).unwrap_or_default();
    let attempt = Attempt {
        endpoint,
        who: p.who,
        model: p.model,
        input_tokens: p.demand.input_tokens,
        output_held: p.output_held,
        unread_output: p.demand.unread_output,
        uncapped: p.demand.output_tokens.is_none(),
        sequences: p.sequences,
        arrived,
        deadline_ms: p.deadline_ms,
        hide_usage: p.hide_usage,
        continuation,
        approval: p.approval,
    };
    let flight = Flight::new(app, attempt, assignment, p.claim);
    let mut resp = relay(flight, endpoint.path(), body, p.stream, engine_request_id).await;
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
