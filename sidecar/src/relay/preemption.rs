//! A preempted stream, on the relay's side: the dispatcher's word that it was preempted, its
//! wait for the next dispatch, and the continuation asked of the new replica, spliced into the
//! stream the client already has ([`crate::relay::resume`] rewrites the body and splices the
//! segments).

use std::time::Duration;

use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant as TokioInstant;

use crate::dispatch::Requeued;
use crate::intake::app::App;
use crate::relay::body::Piece;
use crate::relay::engine::{Upstream, post, streamed};
use crate::relay::flight::Flight;
use crate::relay::grace::cut;
use crate::relay::resume::{continued, segment_id};
use crate::relay::stream_end::Ending;
use weir_core::outcome;

/// Resolves with the dispatcher's word when it preempts the stream (never, if it does not).
pub(super) async fn preempted(preemption: &mut Option<oneshot::Receiver<Requeued>>) -> Requeued {
    if let Some(rx) = preemption
        && let Ok(requeued) = rx.await
    {
        *preemption = None;
        return requeued;
    }
    *preemption = None;
    std::future::pending().await
}

/// How a preempted stream went on.
pub(super) enum Resumed {
    /// Dispatched again and continued: the next segment of the replica's stream.
    Streaming(Upstream),
    /// Settled: the client left, time ran out, or it could not be resumed (with the event
    /// the client gets, if any).
    Ended(Option<Ending>),
}

/// Runs `work` unless the client leaves, the stream's time is up or the grace period ends
/// first; then the outcome to record and the event the client gets.
async fn unless_ended<T>(
    work: impl Future<Output = T>,
    tx: &mpsc::Sender<Piece>,
    deadline: TokioInstant,
    app: &App,
) -> Result<T, (&'static str, Option<Ending>)> {
    tokio::select! {
        t = work => Ok(t),
        () = tx.closed() => Err((outcome::CANCELLED, None)),
        () = tokio::time::sleep_until(deadline) => Err(("stream_deadline", Some(Ending::Deadline))),
        () = cut(app) => Err(("shutdown", Some(Ending::Shutdown))),
    }
}

/// A preempted stream, its upstream request aborted and its hold given back, waits for its
/// next dispatch (at the head of its tenant's batch queue) and asks the new replica to
/// continue what was generated ([`crate::relay::resume`]). Settles the flight unless it streams on.
pub(super) async fn resumed(
    flight: &mut Flight,
    requeued: Requeued,
    tx: &mpsc::Sender<Piece>,
    deadline: TokioInstant,
) -> Resumed {
    let app = flight.app.clone();
    let assigned = match unless_ended(requeued, tx, deadline, &app).await {
        Ok(assigned) => assigned,
        Err((outcome, ending)) => {
            flight.finish(outcome, None);
            return Resumed::Ended(ending);
        }
    };
    let started = match assigned {
        Ok(Ok(assignment)) => {
            // The previous hold was given back when it was preempted.
            flight.hold.assignment = assignment;
            let first_byte = Duration::from_millis(app.relay.load().first_byte_ms);
            let request = continuation(flight);
            unless_ended(
                tokio::time::timeout(first_byte, request),
                tx,
                deadline,
                &app,
            )
            .await
        }
        // Refused (no replica took it) or dropped by the dispatcher.
        Ok(Err(_)) | Err(_) => Ok(Ok(None)),
    };
    match started {
        Ok(Ok(Some(upstream))) => {
            flight.hold.assignment.started(flight.input_tokens);
            Resumed::Streaming(upstream)
        }
        Ok(result) => {
            if result.is_err() {
                flight.hold.assignment.not_started();
            }
            tracing::warn!(replica = %flight.hold.assignment.url, "a preempted stream could not be resumed");
            flight.finish("not_resumed", None);
            Resumed::Ended(Some(Ending::NotResumed))
        }
        Err((outcome, ending)) => {
            flight.finish(outcome, None);
            Resumed::Ended(ending)
        }
    }
}

/// Sends the continuation of a preempted stream to its new replica; its stream from the first
/// chunk once the engine has started it, `None` if the engine refused or failed.
fn continuation(flight: &mut Flight) -> impl Future<Output = Option<Upstream>> + use<> {
    let before = flight.meter.stream.generated_tokens();
    let assignment = &flight.hold.assignment;
    let request = flight.continuation.as_mut().map(|c| {
        c.splice.next_segment(before);
        let mut body = continued(flight.endpoint, &c.body, c.splice.text(), before);
        assignment.isolation.apply(&mut body);
        let url = format!("{}{}", assignment.url, flight.endpoint.path());
        let body = serde_json::to_vec(&body).unwrap_or_default();
        let engine_id = c
            .trace_id
            .as_ref()
            .and_then(|id| segment_id(id, c.splice.segment()));
        post(assignment, &url, body, engine_id, true)
    });
    async move {
        let resp = request?.await.ok()?;
        if !resp.status().is_success() || !streamed(resp.headers(), true) {
            return None;
        }
        let mut rest = resp.bytes_stream();
        let first = rest.next().await?.ok()?;
        let upstream: Upstream = Box::pin(futures::stream::iter([Ok(first)]).chain(rest));
        Some(upstream)
    }
}
