//! The request to the engine, and what its answer's headers say: the POST (with the engine's
//! `x-request-id`), whether the answer streams, its status and its own `Retry-After`.

use axum::body::Bytes;
use axum::http::{HeaderValue, StatusCode, header};
use futures::Stream;

use crate::dispatch::Assignment;
use crate::replica::engine::Dialect;

pub const JSON: &str = "application/json";
pub const TRACE_ID: &str = "x-request-id";
pub const EVENT_STREAM: &str = "text/event-stream; charset=utf-8";

/// The replica's stream, whichever segment of it is running.
pub type Upstream = std::pin::Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// Sends a request body to the assigned replica.
pub fn post(
    assignment: &Assignment,
    url: &str,
    body: Vec<u8>,
    trace_id: Option<HeaderValue>,
    stream: bool,
) -> impl Future<Output = reqwest::Result<reqwest::Response>> + use<> {
    let mut request = (assignment.upstream)
        .post(url)
        .header(header::CONTENT_TYPE, JSON);
    if let Some(trace_id) = trace_id {
        request = request.header(TRACE_ID, trace_id);
    }
    // Asked to close, the connection is never pooled for a request it would fail.
    let closes = assignment
        .dialect
        .is_some_and(Dialect::closes_after_a_stream);
    if stream && closes {
        request = request.header(header::CONNECTION, "close");
    }
    request.body(body).send()
}

/// Whether the engine answered with an event stream: its content type says, whatever the
/// request's `stream` field looked like (a lenient engine streams on `"true"` or `1`, which the
/// sidecar would not read as true); the request decides only when the engine names no type.
pub fn streamed(headers: &reqwest::header::HeaderMap, asked: bool) -> bool {
    match headers.get(header::CONTENT_TYPE).map(|v| v.to_str()) {
        Some(Ok(content_type)) => weir_core::meter::is_event_stream(content_type),
        _ => asked,
    }
}

/// The engine's status, as the caller gets it.
pub fn status_of(upstream: &reqwest::Response) -> StatusCode {
    StatusCode::from_u16(upstream.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY)
}

/// The engine's own `Retry-After`, if it sent one.
pub fn retry_after_of(upstream: &reqwest::Response) -> Option<HeaderValue> {
    upstream
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok())
}
