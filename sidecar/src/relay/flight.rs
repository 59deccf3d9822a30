//! A request from dispatch to settlement: what the caller sent ([`Attempt`]), and the
//! [`Flight`] that carries it, made of one part per job — its hold on the replica
//! ([`Hold`]), its metering ([`Meter`]), its latencies ([`Figures`]), the response kept for
//! replays ([`Capture`]), what it teaches the prediction ([`Learning`]) and how a preempted
//! stream goes on ([`Continuation`]). Each part is in its own module and knows only its job;
//! this one holds what a chunk on its way to the client does to them all. How the flight is
//! settled is in `settle`, how it ends early in `refusal`.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::http::HeaderValue;
use weir_core::endpoint::Endpoint;

use crate::dispatch::Assignment;
use crate::intake::app::App;
use crate::intake::idempotency::Claim;
use crate::intake::trust::Trusted;
use crate::relay::approval::Watch;
use crate::relay::capture::Capture;
use crate::relay::figures::Figures;
use crate::relay::hold::Hold;
use crate::relay::learn::Learning;
use crate::relay::meter::{Bill, Meter};
use crate::relay::resume::Splice;
use weir_core::outcome;

/// What a flight knows of the attempt it carries.
pub struct Attempt {
    /// The API called: how its answer is metered, its errors shaped, its record labelled.
    pub endpoint: Endpoint,
    pub who: Trusted,
    pub model: String,
    /// The prompt as counted before dispatch, until the engine reports its own count.
    pub input_tokens: u64,
    /// Output tokens its KV hold was sized for (the prediction, see [`crate::intake::prediction`]).
    pub output_held: u64,
    /// Output billed for its answer if nobody reads it ([`crate::intake::demand::Demand::unread_output`]).
    pub unread_output: u64,
    /// The request set no output limit: its answer's length teaches the prediction (one cut
    /// short by a small `max_tokens` would teach it low, as the filter also holds).
    pub uncapped: bool,
    /// Sequences the engine runs for it: what one answer's length is learned from.
    pub sequences: u64,
    pub arrived: Instant,
    /// Until when it could wait for dispatch (Unix ms): an answer after it is not goodput.
    pub deadline_ms: u64,
    /// weir asked the engine for the stream's usage chunk: the caller gets the stream without it.
    pub hide_usage: bool,
    /// How to resume the stream if it is preempted ([`crate::relay::resume`]; preemptible requests only).
    pub continuation: Option<Continuation>,
    /// The watch for calls that wait for an approver (requests with approval patterns only).
    pub approval: Option<Watch>,
}

/// What a preemptible stream needs to go on after preemption: the body as sent (before a
/// replica's isolation mode), the first segment's engine `x-request-id` (later segments'
/// derive from it: [`crate::relay::resume::segment_id`]), and the stream followed so far.
pub struct Continuation {
    pub body: serde_json::Value,
    pub trace_id: Option<HeaderValue>,
    pub splice: Splice,
}

/// A request from dispatch to settlement.
pub struct Flight {
    pub(super) app: Arc<App>,
    pub(super) endpoint: Endpoint,
    pub(super) who: Trusted,
    pub(super) model: String,
    pub(super) input_tokens: u64,
    /// KV and slot accounting: the assignment, and what the dispatcher has been charged.
    pub(super) hold: Hold,
    /// What the answer is billed.
    pub(super) meter: Meter,
    /// Its latencies, and the figures published when it settles.
    pub(super) figures: Figures,
    /// The caller's idempotency key, and the response kept for its replays.
    pub(super) capture: Capture,
    /// What its answer teaches the output prediction.
    pub(super) learning: Learning,
    /// How a preempted stream goes on (preemptible streams only).
    pub(super) continuation: Option<Continuation>,
    /// What the attempt was billed, once it is settled (settled once: [`Flight::finish`]).
    pub(super) settled: Option<Bill>,
    /// The answer's calls that wait for an approver, held as they complete.
    pub(super) approval: Option<Watch>,
}

impl Flight {
    pub fn new(
        app: Arc<App>,
        attempt: Attempt,
        assignment: Assignment,
        claim: Option<Claim>,
    ) -> Flight {
        let figures = Figures::new(
            &app,
            &attempt.who.tenant,
            attempt.arrived,
            attempt.deadline_ms,
        );
        Flight {
            figures,
            app,
            endpoint: attempt.endpoint,
            model: attempt.model,
            input_tokens: attempt.input_tokens,
            hold: Hold::new(assignment, attempt.input_tokens),
            meter: Meter::new(attempt.endpoint, attempt.hide_usage, attempt.unread_output),
            capture: Capture::new(claim),
            learning: Learning {
                uncapped: attempt.uncapped,
                sequences: attempt.sequences,
                output_held: attempt.output_held,
            },
            continuation: attempt.continuation,
            who: attempt.who,
            settled: None,
            approval: attempt.approval,
        }
    }

    /// Meters a chunk on its way to the client; returns what the client gets of it (all of it,
    /// unless weir asked for the usage chunk, which is then held back).
    pub(super) fn observe(&mut self, chunk: &Bytes) -> Bytes {
        self.figures.chunk(&self.app.metrics, &self.who.tenant);
        let out = self.meter.feed(chunk);
        self.hold_completed_calls();
        self.keep(&out);
        if let Some(usage) = self.meter.stream.usage() {
            self.reconcile(usage.prompt_tokens);
        }
        let served = self.meter.stream.generated_tokens();
        if self.hold.charge_due(served) {
            self.charge(served);
        }
        out
    }

    /// Holds the approval-class calls the stream has completed so far ([`Watch`]), before the
    /// events completing them go on.
    fn hold_completed_calls(&mut self) {
        if let Some(watch) = &mut self.approval {
            let at = (&self.app.approvals, &self.who, self.model.as_str());
            watch.hold_completed(self.meter.tools.completed(), at);
        }
    }

    /// Holds the approval-class calls of an answer read whole ([`Watch`]).
    pub(super) fn hold_body_calls(&self, body: &[u8]) {
        if let Some(watch) = &self.approval {
            watch.hold_body(body, (&self.app.approvals, &self.who, &self.model));
        }
    }

    /// Meters what the meter still holds once the stream has ended; returns what of it the
    /// client has not had yet.
    pub(super) fn drain(&mut self) -> Bytes {
        let out = self.meter.drain();
        self.hold_completed_calls();
        self.keep(&out);
        out
    }

    /// What the client gets of a chunk of the current segment: the events it completes
    /// ([`crate::relay::resume::Splice::feed`]).
    pub(super) fn splice(&mut self, chunk: &Bytes) -> Bytes {
        match &mut self.continuation {
            Some(c) => c.splice.feed(chunk),
            None => chunk.clone(),
        }
    }

    /// What the splice still holds once a stream has ended: its last event, made whole.
    pub(super) fn splice_rest(&mut self) -> Bytes {
        self.continuation
            .as_mut()
            .map_or_else(Bytes::new, |c| c.splice.flush())
    }

    /// Keeps a copy of response bytes for replays, up to the bound of what is kept.
    pub(super) fn keep(&mut self, bytes: &[u8]) {
        let limit = self.app.idempotency.max_response_bytes();
        self.capture.keep(bytes, limit);
    }

    /// Charges the tenant the output served so far ([`Hold::charge`]).
    pub(super) fn charge(&mut self, served: u64) {
        self.hold.charge(&self.app, &self.who.tenant, served);
    }

    /// Replaces the prompt estimate with the engine's count, once ([`Hold::reconcile`]).
    pub(super) fn reconcile(&mut self, prompt_tokens: u64) {
        let at = (self.who.tenant.as_str(), self.endpoint);
        (self.hold).reconcile(&self.app, at, self.input_tokens, prompt_tokens);
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        // Dropped unfinished: the client went away mid-stream.
        self.finish(outcome::CANCELLED, None);
    }
}
