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
use crate::quota::store::StoreError;
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
    let request = checked::<LeaseRequest>(trust, metrics, &headers, body, "invalid_lease_request")
        .await
        .and_then(|r| asks::check(&r).map(|()| r));
    match request {
        Ok(request) => renewed(store, metrics, &request).await,
        Err(refusal) => refuse(&refusal),
    }
}

/// A refusal of a renewal, with a short `Retry-After`.
pub(super) fn refuse(error: &ApiError) -> Response {
    error_response(error, ErrorShape::OpenAi, RETRY_AFTER_S)
}

/// A call's body, checked in the order the module doc gives (an untrusted caller is counted),
/// up to its shape; a shape it does not have is a 400 with `code`.
pub(super) async fn checked<T: serde::de::DeserializeOwned>(
    trust: &Trust,
    metrics: &Metrics,
    headers: &HeaderMap,
    body: Body,
    code: &'static str,
) -> Result<T, ApiError> {
    let untrusted = |refusal: &ApiError| metrics.reject("untrusted", "", refusal.status);
    let signed = trust.check_call(headers, now_ms()).inspect_err(untrusted)?;
    let Ok(body) = axum::body::to_bytes(body, MAX_BODY_BYTES).await else {
        return Err(ApiError::payload_too_large(MAX_BODY_BYTES));
    };
    trust
        .accept(&signed, &body, now_ms())
        .inspect_err(untrusted)?;
    serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(&body)).map_err(
        |e| {
            ApiError::bad_request(format!("not a quota call: {}", e.inner()))
                .with_code(code)
                .with_param(&e.path().to_string())
        },
    )
}

/// The leases the store grants (counted per tenant and window), or a quick 503 when it fails.
async fn renewed(store: &Store, metrics: &Metrics, request: &LeaseRequest) -> Response {
    let started = Instant::now();
    let grants = store.renew(request).await;
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
        Err(e) => store_failed(
            metrics,
            &e,
            "the quota store is unavailable; leases are not renewed until it returns",
        ),
    }
}

/// A store that failed a call: counted by kind, and a quick 503 `quota_store_unavailable`.
pub(super) fn store_failed(metrics: &Metrics, e: &StoreError, message: &str) -> Response {
    tracing::warn!("a call to the quota store failed: {e}");
    metrics
        .quota
        .store_errors
        .get_or_create(&vec![("kind", e.kind().to_owned())])
        .inc();
    refuse(&ApiError::new(503, message).with_code("quota_store_unavailable"))
}
