//! weir's approvals API (`/v1/weir/approvals`), on the serving port behind the filter: the
//! filter authenticates the key and vouches its approver scopes (`x-weir-approves`, signed),
//! so the sidecar trusts only those. A key with no scopes is refused (`not_an_approver`);
//! an approval outside its scopes is `approval_not_found`, as an unknown or expired one is.
//!
//! - `GET /v1/weir/approvals[?state=pending|approved|rejected|delivered]`: the list;
//! - `GET /v1/weir/approvals/{id}`: one;
//! - `POST /v1/weir/approvals/{id}/approve`, `.../reject`: the decision.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use weir_core::error::{ApiError, ErrorShape};
use weir_core::path::WEIR_API;

use crate::approvals::{Approval, Approver, Decision, Refused};
use crate::intake::app::App;
use crate::support::clock::now_ms;
use crate::support::respond::error_response;

/// The API's routes.
pub fn routes(router: Router<Arc<App>>) -> Router<Arc<App>> {
    router
        .route(WEIR_API, get(list))
        .route(&format!("{WEIR_API}/{{id}}"), get(one))
        .route(
            &format!("{WEIR_API}/{{id}}/approve"),
            post(|app, headers, id| decide(app, headers, id, Decision::Approve)),
        )
        .route(
            &format!("{WEIR_API}/{{id}}/reject"),
            post(|app, headers, id| decide(app, headers, id, Decision::Reject)),
        )
}

/// The approver the signed headers name, or why not.
fn approver(app: &App, headers: &HeaderMap) -> Result<Approver, ApiError> {
    let who = app.trust.check(headers, now_ms()).inspect_err(|e| {
        app.metrics.reject("untrusted", "", e.status);
    })?;
    if who.approves.is_empty() {
        app.metrics.reject("not_an_approver", &who.tenant, 403);
        return Err(
            ApiError::new(403, "this key approves no tenant's tool calls")
                .with_code("not_an_approver"),
        );
    }
    Ok(Approver {
        tenant: who.tenant,
        scopes: who.approves,
    })
}

/// The API's answer: JSON, or the error in OpenAI's shape.
fn answer(result: Result<Value, ApiError>) -> Response {
    match result {
        Ok(body) => axum::Json(body).into_response(),
        Err(error) => error_response(&error, ErrorShape::OpenAi, 0),
    }
}

async fn list(State(app): State<Arc<App>>, headers: HeaderMap, uri: Uri) -> Response {
    const STATES: [&str; 4] = ["pending", "approved", "rejected", "delivered"];
    let state =
        (uri.query().unwrap_or_default().split('&')).find_map(|pair| pair.strip_prefix("state="));
    answer(approver(&app, &headers).and_then(|approver| {
        if state.is_some_and(|s| !STATES.contains(&s)) {
            let message = format!("state must be one of {}", STATES.join(", "));
            return Err(ApiError::bad_request(message).with_param("state"));
        }
        let found = app.approvals.list(&approver, state, now_ms());
        let data: Vec<Value> = found.iter().map(view).collect();
        Ok(json!({"object": "list", "data": data}))
    }))
}

async fn one(State(app): State<Arc<App>>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    answer(approver(&app, &headers).and_then(|approver| {
        (app.approvals.get(&approver, &id, now_ms()))
            .map(|approval| view(&approval))
            .ok_or_else(|| Refused::NotFound.error())
    }))
}

async fn decide(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    decision: Decision,
) -> Response {
    answer(approver(&app, &headers).and_then(|approver| {
        (app.approvals.decide(&approver, &id, decision, now_ms()))
            .map(|approval| view(&approval))
            .map_err(Refused::error)
    }))
}

/// An approval as the API shows it: the call whole (what the approver decides on), never
/// the request it came from.
fn view(a: &Approval) -> Value {
    json!({
        "object": "approval",
        "id": a.id,
        "state": a.state.name(),
        "tenant": a.tenant,
        "run_id": a.run_id,
        "api": a.call.endpoint.path(),
        "model": a.call.model,
        "tool": a.call.name,
        "call_id": a.call.call_id,
        "arguments": a.call.arguments,
        "arguments_sha256": a.call.arguments_sha256,
        "created_at_ms": a.created_ms,
        "expires_at_ms": a.expires_ms,
        "decided_by": a.state.by(),
    })
}
