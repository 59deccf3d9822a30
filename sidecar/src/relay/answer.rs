//! A non-streamed answer, or an engine's error: read whole (up to `relay.max_response_bytes`),
//! metered from its body, settled, and relayed as JSON.

use axum::body::Bytes;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use weir_core::meter::{BodyMeter, BodyUsage};

use tokio::time::Instant as TokioInstant;

use crate::relay::engine::{JSON, retry_after_of, status_of};
use crate::relay::flight::Flight;
use crate::relay::grace::cut;
use crate::relay::refusal::{cut_short, failed_mid_response, timed_out, too_large};
use weir_core::outcome;

/// Most of a non-streamed answer the meter copies to parse whole (for a count where the engine
/// reports no usage, as the filter does); past it the rest is scanned for the usage as it
/// passes, not copied.
const METERED_BODY_BYTES: usize = 4 << 20;

/// Reads the engine's whole answer, up to `max` bytes by `deadline`, and relays it.
pub(super) async fn whole(
    flight: &mut Flight,
    upstream: reqwest::Response,
    deadline: TokioInstant,
    max: usize,
) -> Response {
    let app = flight.app.clone();
    let status = status_of(&upstream);
    let retry_after = retry_after_of(&upstream);
    let bytes = tokio::select! {
        bytes = read_bounded(upstream, max) => bytes,
        () = cut(&app) => return cut_short(flight),
        () = tokio::time::sleep_until(deadline) => return timed_out(flight),
    };
    match bytes {
        Ok(None) => too_large(flight, max),
        Ok(Some(bytes)) => relayed(flight, status, bytes, retry_after),
        Err(_) => failed_mid_response(flight),
    }
}

/// A non-streamed answer read whole, or `None` once it is past `max` bytes (its
/// `content-length` says so, or what came did): the rest is left unread, and the connection
/// dropped with it.
async fn read_bounded(upstream: reqwest::Response, max: usize) -> reqwest::Result<Option<Bytes>> {
    if upstream
        .content_length()
        .is_some_and(|len| len > max as u64)
    {
        return Ok(None);
    }
    let mut body = Vec::new();
    let mut chunks = upstream.bytes_stream();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk?;
        if body.len().saturating_add(chunk.len()) > max {
            return Ok(None);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Some(Bytes::from(body)))
}

/// The answer read whole: metered, settled, and relayed (an engine's error in the caller's
/// API's shape), with the engine's `Retry-After` or weir's own for a 502 or 503.
fn relayed(
    flight: &mut Flight,
    status: StatusCode,
    bytes: Bytes,
    retry_after: Option<HeaderValue>,
) -> Response {
    if status.is_success() {
        flight.hold.assignment.answered();
    }
    let usage = metered(flight, &bytes);
    let outcome = outcome::of_answer(status.as_u16());
    flight.finish_with(outcome, usage, (status.as_u16(), JSON));
    // An engine's own error answer, in the provider's values as weir's own are.
    let shape = flight.endpoint.error_shape();
    let shaped = (!status.is_success())
        .then(|| weir_core::error::from_engine(status.as_u16(), &bytes, shape))
        .flatten();
    let bytes = shaped.map_or(bytes, |body| Bytes::from(body.to_string()));
    let mut resp = (status, bytes).into_response();
    let headers = resp.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(JSON));
    match retry_after {
        Some(retry_after) => {
            headers.insert(header::RETRY_AFTER, flight.engine_retry_after(retry_after));
        }
        None if matches!(status.as_u16(), 502 | 503) => {
            headers.insert(header::RETRY_AFTER, flight.retry_after_s().into());
        }
        None => {}
    }
    resp
}

/// Meters an answer read whole (and keeps it for replays). It goes out whole as JSON, which
/// the filter meters as a body whatever the request asked; one with no usage weir could read
/// or count is billed its bound, as the filter charges it.
fn metered(flight: &mut Flight, bytes: &Bytes) -> Option<BodyUsage> {
    let mut meter = BodyMeter::new(flight.endpoint, METERED_BODY_BYTES);
    meter.feed(bytes);
    flight.meter.tools.whole(bytes);
    flight.keep(bytes);
    flight.hold_body_calls(bytes);
    flight.meter.streamed = false;
    Some(meter.finish()).filter(|u| !matches!(u, BodyUsage::Unknown))
}
