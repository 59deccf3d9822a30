//! The HTTP front of the simulator: the inference APIs (chat, completions, Responses,
//! Anthropic Messages, embeddings) and the test surface (`/debug/*`). A request is prepared
//! ([`crate::job`]), its sequences submitted and answered ([`crate::relay`]); everything
//! engine-specific comes from the [`crate::dialect::Dialect`].

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use serde_json::{Value, json};
use weir_core::endpoint::Endpoint;
use weir_core::error::{ApiError, ErrorShape};

use crate::app::App;
use crate::{job, relay};

pub fn router(app: Arc<App>) -> Router {
    let endpoints = app.dialect.clone().endpoints();
    let mut router = Router::new();
    for endpoint in Endpoint::ALL {
        router = router.route(
            endpoint.path(),
            post(
                move |State(app): State<Arc<App>>, headers: HeaderMap, body: Body| {
                    infer(app, endpoint, headers, body)
                },
            ),
        );
    }
    router
        .route("/debug/requests", get(recorded_requests))
        .route("/debug/faults", get(faults))
        .route("/debug/faults/hang", put(switch_hang))
        .fallback(|State(app): State<Arc<App>>| async move {
            app.refuse(
                ErrorShape::OpenAi,
                ApiError::not_found("no such route; see /v1/models"),
            )
        })
        .with_state(app)
        .merge(endpoints)
}

/// Serves one inference request: read, recorded, held by the hang, prepared, run, answered.
async fn infer(app: Arc<App>, endpoint: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let shape = endpoint.error_shape();
    let limit = app.settings.max_body_bytes;
    let Ok(bytes) = axum::body::to_bytes(body, limit).await else {
        return app.refuse(shape, ApiError::payload_too_large(limit));
    };
    app.record(endpoint.path(), &headers, &bytes);
    if app.faults.hangs() {
        // Accepted, never answered: the handler is dropped when the client goes away.
        let _held = app.faults.hold();
        std::future::pending::<()>().await;
    }
    let job = match job::prepare(&app, endpoint, &headers, &bytes).await {
        Ok(job) => job,
        Err(refusal) => return app.refuse(shape, refusal),
    };
    let (events, guard) = relay::submit(&app, &job);
    relay::reply(app, job, events, guard).await
}

async fn recorded_requests(State(app): State<Arc<App>>) -> Response {
    axum::Json(Value::Array(app.recorded())).into_response()
}

/// The run-time fault switches and what they hold.
async fn faults(State(app): State<Arc<App>>) -> Response {
    axum::Json(json!({"hang": app.faults.hangs(), "hung": app.faults.num_hung()})).into_response()
}

/// `PUT /debug/faults/hang` with `true` or `false`: new requests hang, or are served again.
async fn switch_hang(State(app): State<Arc<App>>, body: Bytes) -> Response {
    match serde_json::from_slice::<bool>(&body) {
        Ok(on) => {
            app.faults.set_hang(on);
            faults(State(app)).await
        }
        Err(_) => app.refuse(
            ErrorShape::OpenAi,
            ApiError::bad_request("expected `true` or `false`"),
        ),
    }
}
