//! An API error as an HTTP response: its status, its body in the caller's API shape, and a
//! `Retry-After` on the statuses a client may retry.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use weir_core::error::{ApiError, ErrorShape};

/// An error in the called API's shape; a retryable one (429, 502, 503) says when to retry.
pub fn error_response(e: &ApiError, shape: ErrorShape, retry_after_s: u64) -> Response {
    error_response_with(e, e.to_json_in(shape), retry_after_s)
}

/// [`error_response`] with the body given (the error in its shape, and anything beside it).
pub fn error_response_with(e: &ApiError, body: Value, retry_after_s: u64) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut resp = (status, axum::Json(body)).into_response();
    if matches!(e.status, 429 | 502 | 503) {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_s));
    }
    resp
}
