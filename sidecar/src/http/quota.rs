//! `POST /v1/quota/leases`: a filter's renewal, checked in the order that tells an unsigned
//! caller nothing — signature (401) before the body is read, body size (413), the body's signed
//! digest (401), its shape and bounds (400) — and only then taken to the store, whose failure
//! is a quick 503 `quota_store_unavailable` (the filter then applies its `fail_open` or
//! `fail_closed` rule).

use std::time::Instant;

use axum::body::Body;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use weir_core::error::{ApiError, ErrorShape};
use weir_core::fleet::{LeaseRequest, LeaseResponse};

use crate::intake::trust::Trust;
use crate::metrics::Metrics;
use crate::quota::Store;
use crate::quota::asks::{self, MAX_BODY_BYTES};
use crate::support::clock::now_ms;
use crate::support::respond::error_response;

/// A store error's `Retry-After`: renewals are periodic, the next one comes soon anyway.
const RETRY_AFTER_S: u64 = 1;

pub async fn serve(
    store: &Store,
    trust: &Trust,
    metrics: &Metrics,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let refuse = |e: &ApiError| error_response(e, ErrorShape::OpenAi, RETRY_AFTER_S);
    let signed = match trust.check_call(&headers, now_ms()) {
        Ok(signed) => signed,
        Err(refusal) => {
            metrics.reject("untrusted", "", refusal.status);
            return refuse(&refusal);
        }
    };
    let Ok(body) = axum::body::to_bytes(body, MAX_BODY_BYTES).await else {
        return refuse(&ApiError::payload_too_large(MAX_BODY_BYTES));
    };
    if let Err(refusal) = trust.accept(&signed, &body, now_ms()) {
        metrics.reject("untrusted", "", refusal.status);
        return refuse(&refusal);
    }
    let request: LeaseRequest =
        match serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(&body)) {
            Ok(request) => request,
            Err(e) => {
                return refuse(
                    &ApiError::bad_request(format!("not a lease request: {}", e.inner()))
                        .with_code("invalid_lease_request")
                        .with_param(&e.path().to_string()),
                );
            }
        };
    if let Err(refusal) = asks::check(&request) {
        return refuse(&refusal);
    }
    let started = Instant::now();
    let grants = store.renew(&request).await;
    metrics
        .quota
        .store_latency
        .observe(started.elapsed().as_secs_f64());
    match grants {
        Ok(grants) => {
            for (ask, grant) in request.counters.iter().zip(&grants) {
                metrics
                    .quota
                    .granted
                    .get_or_create(&vec![
                        (
                            "tenant",
                            metrics.tenant(asks::tenant_of(&ask.key)).to_owned(),
                        ),
                        ("window", ask.window.name().to_owned()),
                    ])
                    .inc_by(grant.granted);
            }
            axum::Json(LeaseResponse { grants }).into_response()
        }
        Err(e) => {
            tracing::warn!("quota renewal refused: {e}");
            metrics
                .quota
                .store_errors
                .get_or_create(&vec![("kind", e.kind().to_owned())])
                .inc();
            refuse(
                &ApiError::new(
                    503,
                    "the quota store is unavailable; leases are not renewed until it returns",
                )
                .with_code("quota_store_unavailable"),
            )
        }
    }
}
