//! Streaming a dispatched request to its replica and the answer back.
//!
//! A pump task reads the replica and hands chunks to the response body through a one-chunk
//! channel; hyper pulls the next one only when the client has taken the last, so a slow client
//! slows its own upstream read instead of growing a buffer. The pump owns the request's hold on
//! the replica and watches the client: a client that leaves, one that lets a chunk wait longer
//! than `relay.client_stall_ms`, and any stream older than `relay.max_stream_ms` end the upstream
//! request (the engine aborts and frees the KV) and the hold at once, not when hyper next polls
//! the body; the client then gets an OpenAI-shaped error event and `[DONE]`. A replica that dies
//! mid-stream, and the end of the shutdown grace period, end the stream the same way.
//! A stream is answered only once the engine has started it (its first body bytes, which also
//! time the replica's concurrency limiter); one not started within `relay.first_byte_ms` is
//! dropped upstream and answered 503 `first_byte_deadline`, for the caller to retry.
//! Every path ends in [`Flight::finish`]: one ledger record for the attempt, KV given back (the
//! assignment is the hold on the replica, released when the flight finishes or is dropped), the
//! idempotency claim settled (with the response, captured up to a bound, for replays).
//!
//! The relay is in parts, each importing only those listed before it:
//! - the flight's parts, one per job: `hold` (KV accounting), `meter` (what is billed),
//!   `figures` (latencies), `capture` (idempotency), `learn` (the prediction), `approval`
//!   (calls held for an approver), and the leaves
//!   `engine` (the request and its answer's headers), `grace` (the shutdown cut), `body` (the
//!   hand-over to the response body), `watch` (the pump's timer), [`resume`] (a continuation's
//!   body and splice), [`stream_end`] (weir's closing event);
//! - `flight`: the attempt carried, its parts together;
//! - `settle` (once per attempt), with `publish` (its metrics) and `record` (its ledger record);
//!   `refusal` (every early end, answered in one place);
//! - `answer` (a non-streamed answer), `preemption` (a preempted stream resumed), `pump` (a
//!   stream relayed);
//! - this module: the relay's steps, from dispatch to the first answer.

mod answer;
mod approval;
mod body;
mod capture;
mod engine;
mod figures;
mod flight;
mod grace;
mod hold;
mod learn;
mod meter;
mod preemption;
mod publish;
mod pump;
mod record;
mod refusal;
pub mod resume;
mod settle;
pub mod stream_end;
mod watch;

use std::time::Duration;

use axum::http::HeaderValue;
use axum::response::Response;
use futures::StreamExt;
use tokio::time::Instant as TokioInstant;

pub use crate::relay::approval::Watch;
pub use crate::relay::engine::TRACE_ID;
pub use crate::relay::flight::{Attempt, Continuation, Flight};

use crate::config::RelayConfig;
use crate::relay::engine::{Upstream, post, retry_after_of, status_of, streamed};
use crate::relay::grace::cut;
use crate::relay::refusal::{cut_short, not_started, refused_by_engine, timed_out, unreachable};

/// An attempt's time and size bounds. All count from dispatch: an engine that accepts the
/// request and never answers (no headers, or a non-streamed body that never comes) must not
/// hold the replica for ever, and one that does not start a stream within `first_byte_ms` is
/// holding it in a queue.
struct Bounds {
    /// The whole answer of a non-streamed request (and the headers of any).
    response: TokioInstant,
    /// A stream's whole life.
    stream: TokioInstant,
    /// A stream's first bytes, within its whole life too.
    first_byte: TokioInstant,
    /// The engine's headers; past it, `late` settles and answers.
    headers: TokioInstant,
    late: fn(&mut Flight) -> Response,
    max_response_bytes: usize,
}

impl Bounds {
    fn from_dispatch(limits: &RelayConfig, stream: bool) -> Bounds {
        let dispatched = TokioInstant::now();
        let response = dispatched + Duration::from_millis(limits.max_response_ms);
        let first_byte =
            dispatched + Duration::from_millis(limits.first_byte_ms.min(limits.max_stream_ms));
        // A stream's headers come by its first byte at the latest (llama.cpp sends those of a
        // request it has not started only once it starts it).
        let (headers, late): (_, fn(&mut Flight) -> Response) = if stream && first_byte < response {
            (first_byte, |flight| not_started(flight, false))
        } else {
            (response, timed_out)
        };
        Bounds {
            response,
            stream: dispatched + Duration::from_millis(limits.max_stream_ms),
            first_byte,
            headers,
            late,
            max_response_bytes: limits.max_response_bytes,
        }
    }
}

/// Sends the request to its replica and relays the answer. `trace_id` is the `x-request-id`
/// the engine gets (the caller's trace id with weir's attempt id).
pub async fn relay(
    mut flight: Flight,
    path: &str,
    body: Vec<u8>,
    stream: bool,
    trace_id: Option<HeaderValue>,
) -> Response {
    let bounds = Bounds::from_dispatch(&flight.app.relay.load(), stream);
    flight.meter.streamed = stream;
    let upstream = match send(&mut flight, path, body, (stream, trace_id), &bounds).await {
        Ok(upstream) => upstream,
        Err(refused) => return refused,
    };
    if !status_of(&upstream).is_success() || !streamed(upstream.headers(), stream) {
        let max = bounds.max_response_bytes;
        return answer::whole(&mut flight, upstream, bounds.response, max).await;
    }
    match started(&mut flight, upstream, bounds.first_byte).await {
        Ok(upstream) => pump::streaming(flight, upstream, bounds.stream),
        Err(refused) => refused,
    }
}

/// Sends the request; the engine's answer once its headers came, unless the attempt ended
/// first (the grace period over, no headers in time, the replica unreachable, the engine
/// refusing or throttling the pool): then the caller's answer.
async fn send(
    flight: &mut Flight,
    path: &str,
    body: Vec<u8>,
    (stream, trace_id): (bool, Option<HeaderValue>),
    bounds: &Bounds,
) -> Result<reqwest::Response, Response> {
    let app = flight.app.clone();
    if *app.cut.borrow() {
        // Dispatched after the grace period ended (it was queued): never sent.
        flight.meter.nothing_ran = true;
        return Err(cut_short(flight));
    }
    let url = format!("{}{path}", flight.hold.assignment.url);
    let request = post(&flight.hold.assignment, &url, body, trace_id, stream);
    let sent = tokio::select! {
        sent = request => sent,
        () = cut(&app) => return Err(cut_short(flight)),
        () = tokio::time::sleep_until(bounds.headers) => return Err((bounds.late)(flight)),
    };
    let upstream = sent.map_err(|e| unreachable(flight, e))?;
    let status = status_of(&upstream);
    flight.meter.nothing_ran = !status.is_success();
    // An engine's own `Retry-After` (a throttling or overloaded engine) is the caller's to obey.
    match refused_by_engine(flight, status, retry_after_of(&upstream)) {
        Some(refused) => Err(refused),
        None => Ok(upstream),
    }
}

/// The answer's status is settled only once the engine has started: a stream it holds
/// unstarted past `first_byte_ms` is still a 503 the caller can retry, not a broken 200.
/// The stream from its first bytes, or the caller's answer.
async fn started(
    flight: &mut Flight,
    upstream: reqwest::Response,
    first_byte: TokioInstant,
) -> Result<Upstream, Response> {
    let app = flight.app.clone();
    let mut upstream = upstream.bytes_stream();
    let first = tokio::select! {
        first = upstream.next() => first,
        () = cut(&app) => return Err(cut_short(flight)),
        () = tokio::time::sleep_until(first_byte) => return Err(not_started(flight, true)),
    };
    if matches!(first, Some(Ok(_))) {
        flight.hold.assignment.started(flight.input_tokens);
    }
    Ok(Box::pin(futures::stream::iter(first).chain(upstream)))
}

#[cfg(test)]
mod tests;
