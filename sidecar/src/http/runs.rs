//! `POST /v1/quota/runs/reserve` and `/v1/quota/runs/settle`: a filter reserving one call of a
//! run against its fleet-wide budgets, and settling a batch of them
//! ([`weir_core::run::fleet`]). Checked as renewals are (signature, size, signed digest, shape,
//! bounds) before the store is touched; a store that fails is a quick 503
//! `quota_store_unavailable`, which the filter turns into a refusal (a run's budget never
//! fails open). Without a `quota` section both answer 404, like any unknown route.

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use weir_core::error::{ApiError, ErrorShape};
use weir_core::run::fleet::{RESERVE_PATH, ReserveAsk, SETTLE_PATH, SettleAnswer, SettleBatch};

use super::quota::{checked, refuse, store_failed};
use crate::intake::app::App;
use crate::metrics::Metrics;
use crate::quota::store::StoreError;
use crate::support::respond::error_response;

const CODE: &str = "invalid_run_call";

/// The two routes, for the serving port's router.
pub fn routes() -> Router<Arc<App>> {
    Router::new()
        .route(RESERVE_PATH, post(reserve))
        .route(SETTLE_PATH, post(settle))
}

async fn reserve(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let Some(store) = &app.quota else {
        return not_found();
    };
    let ask = checked::<ReserveAsk>(&app.trust, &app.metrics, &headers, body, CODE)
        .await
        .and_then(|a| a.check().map(|()| a).map_err(invalid));
    let ask = match ask {
        Ok(ask) => ask,
        Err(refusal) => return refuse(&refusal),
    };
    let started = Instant::now();
    let answer = store.reserve_run(&ask).await;
    answered(&app.metrics, started, answer)
}

async fn settle(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let Some(store) = &app.quota else {
        return not_found();
    };
    let batch = checked::<SettleBatch>(&app.trust, &app.metrics, &headers, body, CODE)
        .await
        .and_then(|b| {
            b.check()
                .map(|()| b)
                .map_err(|(i, e)| invalid(e).with_param(&format!("settles[{i}]")))
        });
    let batch = match batch {
        Ok(batch) => batch,
        Err(refusal) => return refuse(&refusal),
    };
    let started = Instant::now();
    let settled = store.settle_runs(&batch).await;
    answered(
        &app.metrics,
        started,
        settled.map(|settled| SettleAnswer { settled }),
    )
}

/// The store's answer as JSON, its latency observed; a store error is a quick 503.
fn answered<T: serde::Serialize>(
    metrics: &Metrics,
    started: Instant,
    answer: Result<T, StoreError>,
) -> Response {
    metrics
        .quota
        .store_latency
        .observe(started.elapsed().as_secs_f64());
    match answer {
        Ok(answer) => axum::Json(answer).into_response(),
        Err(e) => store_failed(
            metrics,
            &e,
            "the quota store is unavailable; the run's call is refused",
        ),
    }
}

fn invalid(problem: String) -> ApiError {
    ApiError::bad_request(problem).with_code(CODE)
}

fn not_found() -> Response {
    error_response(&ApiError::not_found("no such route"), ErrorShape::OpenAi, 0)
}
