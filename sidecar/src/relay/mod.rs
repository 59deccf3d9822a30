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

pub mod resume;
pub mod stream_end;

use std::pin::pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::BytesMut;
use futures::{Stream, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant as TokioInstant;
use weir_core::endpoint::Endpoint;
use weir_core::error::ApiError;
use weir_core::meter::{BodyMeter, BodyUsage, StreamMeter};

use crate::dispatch::{Assignment, Event, Requeued};
use crate::intake::app::App;
use crate::intake::idempotency::{Claim, StoredResponse};
use crate::intake::trust::Trusted;
use crate::ledger::UsageRecord;
use crate::metrics::{HistogramSeries, Labels, gen_ai};
use crate::relay::resume::{Splice, continued, segment_id};
use crate::relay::stream_end::Ending;
use crate::replica::engine::Dialect;
use crate::support::clock::now_ms;
use crate::support::respond::{error_response, error_response_with};

/// Longest silence from a replica before the stream is declared lost.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Output tokens charged to the scheduler in batches of this many.
const CHARGE_EVERY: u64 = 16;
const JSON: &str = "application/json";
pub const TRACE_ID: &str = "x-request-id";
const EVENT_STREAM: &str = "text/event-stream; charset=utf-8";

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
}

/// What a preemptible stream needs to go on after preemption: the body as sent (before a
/// replica's isolation mode), the first segment's engine `x-request-id` (later segments'
/// derive from it: [`segment_id`]), and the stream followed so far.
pub struct Continuation {
    pub body: serde_json::Value,
    pub trace_id: Option<HeaderValue>,
    pub splice: Splice,
}

/// The replica's stream, whichever segment of it is running.
type Upstream = std::pin::Pin<Box<dyn Stream<Item = reqwest::Result<Bytes>> + Send>>;

/// A request from dispatch to settlement.
pub struct Flight {
    app: Arc<App>,
    endpoint: Endpoint,
    who: Trusted,
    model: String,
    input_tokens: u64,
    /// The prompt part of the KV hold: the estimate, then the engine's count.
    prompt_held: u64,
    output_held: u64,
    unread_output: u64,
    /// The answer counts as a stream, as the filter meters it: as the request asked until its
    /// first bytes go to the client (the filter meters by the request until it has the
    /// response's headers), then a stream. What was relayed of a stream is counted; a
    /// non-streamed answer is read whole or billed its bound.
    streamed: bool,
    uncapped: bool,
    sequences: u64,
    assignment: Assignment,
    arrived: Instant,
    deadline_ms: u64,
    meter: StreamMeter,
    /// The tenant's inter-chunk latency series, observed per chunk.
    itl: HistogramSeries,
    first_chunk: Option<Instant>,
    last_chunk: Option<Instant>,
    charged: u64,
    /// Whether the engine's prompt count has replaced the filter's estimate yet.
    reconciled: bool,
    finished: bool,
    /// The caller's idempotency key held by this attempt, if it sent one.
    claim: Option<Claim>,
    /// The response so far, kept for replays while the claim wants it and it fits.
    captured: Option<Vec<u8>>,
    hide_usage: bool,
    /// The request never reached the engine, the engine answered with an error status, or it
    /// never took a stream in (no headers by its first-byte deadline): it ran nothing, so
    /// nothing is billed.
    nothing_ran: bool,
    /// What the ledger billed the attempt (prompt, output), once it ran and is settled.
    billed: Option<(u64, u64)>,
    continuation: Option<Continuation>,
}

impl Flight {
    pub fn new(
        app: Arc<App>,
        attempt: Attempt,
        assignment: Assignment,
        claim: Option<Claim>,
    ) -> Flight {
        let tenant = app.metrics.tenant(&attempt.who.tenant);
        let itl = app.metrics.itl.series(&[("tenant", tenant)]);
        Flight {
            itl,
            app,
            endpoint: attempt.endpoint,
            who: attempt.who,
            model: attempt.model,
            input_tokens: attempt.input_tokens,
            prompt_held: attempt.input_tokens,
            output_held: attempt.output_held,
            unread_output: attempt.unread_output,
            streamed: false,
            uncapped: attempt.uncapped,
            sequences: attempt.sequences,
            assignment,
            arrived: attempt.arrived,
            deadline_ms: attempt.deadline_ms,
            meter: StreamMeter::new(attempt.endpoint, attempt.hide_usage),
            hide_usage: attempt.hide_usage,
            first_chunk: None,
            last_chunk: None,
            charged: 0,
            reconciled: false,
            finished: false,
            captured: claim.as_ref().map(|_| Vec::new()),
            claim,
            nothing_ran: false,
            billed: None,
            continuation: attempt.continuation,
        }
    }

    /// An error reply to the caller, in its API's shape. An attempt that used the engine (a
    /// response deadline, an answer too large, an engine failing mid-answer) carries what it
    /// was billed as the API's `usage`, so the filter settles the tenant's quota on the same
    /// figures as the ledger (it charges an error without usage nothing).
    fn refusal(&self, error: ApiError) -> Response {
        let shape = self.endpoint.error_shape();
        let Some((prompt, output)) = self.billed else {
            return error_response(&error, shape, self.retry_after_s());
        };
        let mut body = error.to_json_in(shape);
        body["usage"] = usage_json(self.endpoint, prompt, output);
        error_response_with(&error, body, self.retry_after_s())
    }

    /// `Retry-After` for a retryable answer: drawn around the pool's projected wait.
    fn retry_after_s(&self) -> u64 {
        self.app.backoff.retry_after_s(Some(self.assignment.pool))
    }

    /// The engine's own `Retry-After`, never sooner than it asked but spread and capped as
    /// weir's are ([`crate::support::backoff::after_engine`]); an HTTP date is passed on as it is.
    fn engine_retry_after(&self, engine: HeaderValue) -> HeaderValue {
        let seconds = engine.to_str().ok().and_then(|v| v.trim().parse().ok());
        seconds.map_or(engine, |s| {
            self.app
                .backoff
                .after_engine_s(self.assignment.pool, s)
                .into()
        })
    }

    /// Keeps a copy of response bytes for replays, up to the bound of what is kept.
    fn capture(&mut self, bytes: &[u8]) {
        let limit = self.app.idempotency.max_response_bytes();
        if let Some(buf) = &mut self.captured {
            if buf.len() + bytes.len() > limit {
                self.captured = None;
            } else {
                buf.extend_from_slice(bytes);
            }
        }
    }

    /// Meters a chunk on its way to the client; returns what the client gets of it (all of it,
    /// unless weir asked for the usage chunk, which is then held back).
    fn observe(&mut self, chunk: &Bytes) -> Bytes {
        let now = Instant::now();
        match self.last_chunk {
            None => {
                let m = &self.app.metrics;
                let labels: Labels = &[("tenant", m.tenant(&self.who.tenant))];
                m.ttft.observe(labels, self.arrived.elapsed().as_secs_f64());
                self.first_chunk = Some(now);
            }
            Some(prev) => self.itl.observe((now - prev).as_secs_f64()),
        }
        self.last_chunk = Some(now);
        let out = if self.hide_usage {
            Bytes::from(self.meter.feed(chunk, false))
        } else {
            self.meter.meter(chunk, false);
            chunk.clone()
        };
        self.capture(&out);
        if let Some(usage) = self.meter.usage() {
            self.reconcile(usage.prompt_tokens);
        }
        let served = self.meter.generated_tokens();
        if served - self.charged >= CHARGE_EVERY {
            self.charge(served);
        }
        out
    }

    /// What the client gets of a chunk of the current segment: the events it completes
    /// ([`Splice::feed`]).
    fn splice(&mut self, chunk: &Bytes) -> Bytes {
        match &mut self.continuation {
            Some(c) => c.splice.feed(chunk),
            None => chunk.clone(),
        }
    }

    /// What the splice still holds once a stream has ended: its last event, made whole.
    fn splice_rest(&mut self) -> Bytes {
        self.continuation
            .as_mut()
            .map_or_else(Bytes::new, |c| c.splice.flush())
    }

    /// How a stream the engine ended went: an error event in it (an engine failing once the
    /// stream had started) makes it an `upstream_error`, and a stream closed without its
    /// `[DONE]` (an engine that died but closed the connection cleanly) `failed`. Both are
    /// billed for what streamed but are not completed work, so the key's retry runs instead of
    /// replaying a failure or a truncated answer.
    fn ended_outcome(&self) -> &'static str {
        if self.meter.error_events() > 0 {
            "upstream_error"
        } else if !self.meter.saw_done() {
            "failed"
        } else {
            "ok"
        }
    }

    /// Meters what the meter still holds once the stream has ended; returns what of it the
    /// client has not had yet.
    fn drain(&mut self) -> Bytes {
        let metered = self.meter.feed(&[], true);
        if !self.hide_usage {
            return Bytes::new();
        }
        let out = Bytes::from(metered);
        self.capture(&out);
        out
    }

    fn charge(&mut self, served: u64) {
        if served > self.charged {
            let _ = self.app.events.send(Event::Served {
                pool: self.assignment.pool,
                replica: self.assignment.replica,
                tenant: self.who.tenant.clone(),
                output_tokens: served - self.charged,
            });
            self.charged = served;
        }
        // Past its prediction, the hold follows what the replica really holds.
        let used = self.prompt_held + served;
        if used > self.assignment.kv_held() {
            self.assignment.resize(used);
        }
    }

    /// Replaces the filter's prompt estimate with the engine's count, once: in the tenant's
    /// counter (an underestimate is charged in full) and in the KV held on the replica.
    fn reconcile(&mut self, prompt_tokens: u64) {
        if std::mem::replace(&mut self.reconciled, true) {
            return;
        }
        let estimated = self.input_tokens;
        if estimated > 0 && prompt_tokens > 0 {
            let labels: Labels = &[("api", self.endpoint.name())];
            let ratio = estimated as f64 / prompt_tokens as f64;
            self.app.metrics.estimate_error.observe(labels, ratio);
        }
        if prompt_tokens == estimated {
            return;
        }
        let _ = self.app.events.send(Event::Reconciled {
            pool: self.assignment.pool,
            tenant: self.who.tenant.clone(),
            estimated,
            reported: prompt_tokens,
        });
        let output_part = self.assignment.kv_held().saturating_sub(estimated);
        self.assignment.resize(prompt_tokens + output_part);
        self.prompt_held = prompt_tokens;
    }

    /// Settles once: gives the KV back, charges what was left, writes the ledger record,
    /// settles the idempotency claim.
    pub fn finish(&mut self, outcome: &str, body_usage: Option<BodyUsage>) {
        self.finish_with(outcome, body_usage, None);
    }

    /// [`finish`](Self::finish), with the status and content type of what the client got, for
    /// a replay of completed work.
    fn finish_with(
        &mut self,
        outcome: &str,
        body_usage: Option<BodyUsage>,
        response: Option<(u16, &'static str)>,
    ) {
        if self.finished {
            return;
        }
        self.finished = true;
        let reported = match body_usage {
            Some(BodyUsage::Reported(u)) => Some(u),
            Some(_) => None,
            None => self.meter.usage(),
        };
        let counted = match body_usage {
            Some(BodyUsage::Estimated { completion_tokens }) => completion_tokens,
            _ => self.meter.generated_tokens(),
        };
        let cached = reported.map_or(0, |u| u.cached_prompt_tokens);
        // A non-streamed answer the engine was working on that nobody read (the client left,
        // a deadline or shutdown cut it, it was too large): its bound, as the filter charges it.
        let unread = !self.streamed && body_usage.is_none();
        let (prompt, completion, source) = match reported {
            Some(u) => (u.prompt_tokens, u.completion_tokens, "engine"),
            // Nothing ran: the attempt is recorded, billed nothing (as the filter charges it).
            None if self.nothing_ran => (0, 0, "counted"),
            None if unread => (self.input_tokens, self.unread_output, "bound"),
            None => (self.input_tokens, counted, "counted"),
        };
        if source == "engine" {
            self.reconcile(prompt);
        }
        if !self.nothing_ran {
            self.billed = Some((prompt, completion));
        }
        self.charge(completion);
        self.assignment.release();
        if outcome == "ok" && !self.nothing_ran && self.uncapped {
            self.learn_output(completion);
        }
        self.publish(outcome, prompt, completion);
        let attempt = self.claim.as_ref().map_or(1, Claim::attempt);
        if let Some(claim) = &mut self.claim {
            let completed = (outcome == "ok").then(|| {
                let (status, content_type) = response.unwrap_or((200, EVENT_STREAM));
                self.captured.take().map(|body| StoredResponse {
                    status,
                    content_type,
                    body: Bytes::from(body),
                })
            });
            claim.finish(completed, now_ms());
        }
        let record = UsageRecord {
            idempotency_key: (self.who.idempotency_key.clone())
                .unwrap_or_else(|| self.who.request_id.clone()),
            attempt,
            request_id: self.who.request_id.clone(),
            tenant: self.who.tenant.clone(),
            model: self.model.clone(),
            api: self.endpoint.name().to_owned(),
            replica: self.assignment.url.clone(),
            prompt_tokens: prompt,
            completion_tokens: completion,
            source: source.into(),
            outcome: outcome.into(),
            cached_prompt_tokens: cached,
            queued_ms: self.assignment.queued_ms,
            finished_at_ms: now_ms(),
            route: self.who.route.clone(),
            mode: self.who.mode.clone(),
            ..UsageRecord::default()
        };
        let prices = self.who.prices.as_ref();
        let price = prices.and_then(|p| Some((&p.currency, p.of(&record.model)?)));
        let record = match price {
            Some((currency, price)) => record.priced(currency, price),
            None => record,
        };
        if let (Some(cost), Some(currency)) = (record.cost_micros, &record.currency) {
            let tenant = self.app.metrics.tenant(&self.who.tenant);
            let labels: Labels = &[("tenant", tenant), ("currency", currency)];
            self.app.metrics.spend.inc_by(labels, cost);
        }
        self.app.ledger.record(record);
    }

    /// The settled attempt's figures: weir's per-tenant counters and the GenAI conventions'
    /// instruments (tokens only for attempts that ran, latencies only for successful ones).
    fn publish(&self, outcome: &str, prompt: u64, completion: u64) {
        let m = &self.app.metrics;
        let tenant = m.tenant(&self.who.tenant);
        m.tokens
            .inc_by(&[("tenant", tenant), ("direction", "in")], prompt);
        m.tokens
            .inc_by(&[("tenant", tenant), ("direction", "out")], completion);
        let ok = outcome == "ok";
        if ok && now_ms() <= self.deadline_ms {
            let labels: Labels = &[("pool", &self.model), ("tier", &self.who.tier)];
            m.goodput_tokens.inc_by(labels, prompt + completion);
        }
        let operation = gen_ai::operation(self.endpoint);
        let attributes = [
            (gen_ai::OPERATION, operation),
            (gen_ai::PROVIDER, Dialect::provider(self.assignment.dialect)),
            (gen_ai::REQUEST_MODEL, self.model.as_str()),
            (gen_ai::TENANT, tenant),
        ];
        if !self.nothing_ran {
            for (kind, n) in [("input", prompt), ("output", completion)] {
                let mut labels = attributes.to_vec();
                labels.push((gen_ai::TOKEN_TYPE, kind));
                m.gen_ai.token_usage.observe(&labels, n as f64);
            }
        }
        let duration = self.arrived.elapsed().as_secs_f64();
        if ok {
            m.gen_ai.request_duration.observe(&attributes, duration);
        } else {
            let mut labels = attributes.to_vec();
            labels.push((gen_ai::ERROR_TYPE, outcome));
            m.gen_ai.request_duration.observe(&labels, duration);
        }
        if let (true, Some(first)) = (ok, self.first_chunk) {
            let ttft = first.duration_since(self.arrived).as_secs_f64();
            m.gen_ai.time_to_first_token.observe(&attributes, ttft);
            if completion > 1 {
                let after = first.elapsed().as_secs_f64() / (completion - 1) as f64;
                m.gen_ai.time_per_output_token.observe(&attributes, after);
            }
        }
    }
}

impl Flight {
    /// A completed answer teaches the tenant's prediction on this pool its real length, and
    /// the prediction's error is published (per pool: no tenant label).
    fn learn_output(&self, completion: u64) {
        let per_sequence = completion / self.sequences.max(1);
        let pool = self.assignment.pool;
        self.app
            .predictions
            .learn(&self.who.tenant, pool, per_sequence);
        if self.output_held > 0 {
            let ratio = completion as f64 / self.output_held as f64;
            (self.app.metrics.output_prediction_ratio).observe(&[("pool", &self.model)], ratio);
        }
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        // Dropped unfinished: the client went away mid-stream.
        self.finish("cancelled", None);
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
    let url = format!("{}{path}", flight.assignment.url);
    let app = flight.app.clone();
    // All count from dispatch: an engine that accepts the request and never answers (no
    // headers, or a non-streamed body that never comes) must not hold the replica for ever,
    // and one that does not start a stream within `first_byte_ms` is holding it in a queue.
    let dispatched = TokioInstant::now();
    let limits = app.relay.load();
    let deadline = dispatched + Duration::from_millis(limits.max_response_ms);
    let stream_deadline = dispatched + Duration::from_millis(limits.max_stream_ms);
    // A stream's first bytes come within its whole life too.
    let first_byte =
        dispatched + Duration::from_millis(limits.first_byte_ms.min(limits.max_stream_ms));
    // A stream's headers come by its first byte at the latest (llama.cpp sends those of a
    // request it has not started only once it starts it).
    let (headers_deadline, late): (_, fn(Flight) -> Response) = if stream && first_byte < deadline {
        (first_byte, |flight| not_started(flight, false))
    } else {
        (deadline, timed_out)
    };
    flight.streamed = stream;
    if *app.cut.borrow() {
        // Dispatched after the grace period ended (it was queued): never sent.
        flight.nothing_ran = true;
        return cut_short(flight);
    }
    let request = post(&flight.assignment, &url, body, trace_id, stream);
    let sent = tokio::select! {
        sent = request => sent,
        () = cut(&app) => return cut_short(flight),
        () = tokio::time::sleep_until(headers_deadline) => return late(flight),
    };
    let upstream = match sent {
        Ok(resp) => resp,
        Err(e) => {
            tracing::warn!(replica = %flight.assignment.url, "replica unreachable: {:#}", anyhow::Error::from(e));
            let _ = flight.app.events.send(Event::ReplicaFailed {
                pool: flight.assignment.pool,
                replica: flight.assignment.replica,
            });
            flight.nothing_ran = true;
            flight.finish("failed", Some(BodyUsage::Unknown));
            return flight.refusal(ApiError::new(
                502,
                "the engine replica could not be reached; retry",
            ));
        }
    };
    let status =
        StatusCode::from_u16(upstream.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    flight.nothing_ran = !status.is_success();
    // An engine's own `Retry-After` (a throttling or overloaded engine) is the caller's to obey.
    let retry_after = upstream
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok());
    match status {
        StatusCode::UNAUTHORIZED | StatusCode::PROXY_AUTHENTICATION_REQUIRED => {
            return credential_refused(flight, status);
        }
        StatusCode::TOO_MANY_REQUESTS => return throttled(flight, retry_after),
        _ => {}
    }
    let stream = streamed(upstream.headers(), stream);
    if !status.is_success() || !stream {
        let max = limits.max_response_bytes;
        let bytes = tokio::select! {
            bytes = read_bounded(upstream, max) => bytes,
            () = cut(&app) => return cut_short(flight),
            () = tokio::time::sleep_until(deadline) => return timed_out(flight),
        };
        let outcome = if status.is_success() {
            "ok"
        } else {
            "upstream_error"
        };
        return match bytes {
            Ok(None) => too_large(flight, max),
            Ok(Some(bytes)) => {
                if status.is_success() {
                    flight.assignment.answered();
                }
                let mut meter = BodyMeter::new(flight.endpoint, METERED_BODY_BYTES);
                meter.feed(&bytes);
                flight.capture(&bytes);
                let response = (status.as_u16(), JSON);
                // It goes out whole as JSON, which the filter meters as a body whatever the
                // request asked; one with no usage weir could read or count is billed its
                // bound, as the filter charges it.
                flight.streamed = false;
                let usage = Some(meter.finish()).filter(|u| !matches!(u, BodyUsage::Unknown));
                flight.finish_with(outcome, usage, Some(response));
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
            Err(_) => {
                let _ = flight.app.events.send(Event::ReplicaFailed {
                    pool: flight.assignment.pool,
                    replica: flight.assignment.replica,
                });
                flight.finish("failed", Some(BodyUsage::Unknown));
                flight.refusal(ApiError::new(
                    502,
                    "the engine replica failed mid-response; retry",
                ))
            }
        };
    }
    // The answer's status is settled only once the engine has started: a stream it holds
    // unstarted past `first_byte_ms` is still a 503 the caller can retry, not a broken 200.
    let mut upstream = upstream.bytes_stream();
    let first = tokio::select! {
        first = upstream.next() => first,
        () = cut(&app) => return cut_short(flight),
        () = tokio::time::sleep_until(first_byte) => return not_started(flight, true),
    };
    if matches!(first, Some(Ok(_))) {
        flight.assignment.started(flight.input_tokens);
    }
    let upstream = Box::pin(futures::stream::iter(first).chain(upstream));
    let body = Body::from_stream(relay_stream(flight, upstream, stream_deadline));
    let mut resp = Response::new(body);
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(EVENT_STREAM));
    resp
}

/// An API's `usage` object for `prompt` and `output` tokens, as its answers spell it.
fn usage_json(endpoint: Endpoint, prompt: u64, output: u64) -> serde_json::Value {
    let total = prompt.saturating_add(output);
    match endpoint {
        Endpoint::ChatCompletions | Endpoint::Completions => serde_json::json!({
            "prompt_tokens": prompt, "completion_tokens": output, "total_tokens": total}),
        Endpoint::Embeddings => {
            serde_json::json!({"prompt_tokens": prompt, "total_tokens": prompt})
        }
        Endpoint::Responses => serde_json::json!({
            "input_tokens": prompt, "output_tokens": output, "total_tokens": total}),
        Endpoint::Messages => serde_json::json!({"input_tokens": prompt, "output_tokens": output}),
    }
}

/// Most of a non-streamed answer the meter copies to parse whole (for a count where the engine
/// reports no usage, as the filter does); past it the rest is scanned for the usage as it
/// passes, not copied.
const METERED_BODY_BYTES: usize = 4 << 20;

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

/// A non-streamed answer past `relay.max_response_bytes`: the engine did the work, so the
/// attempt is billed its prompt and its answer's bound (its own count is in the part not read),
/// and the caller told to ask for less.
fn too_large(mut flight: Flight, max: usize) -> Response {
    (flight.app.metrics).reject("response_too_large", &flight.who.tenant, 502);
    flight.streamed = false;
    flight.finish("response_too_large", None);
    flight.refusal(
        ApiError::new(
            502,
            format!(
                "the engine's answer is larger than this gateway relays ({max} bytes, \
                 relay.max_response_bytes); ask for less (fewer inputs, a lower max_tokens)"
            ),
        )
        .with_code("response_too_large"),
    )
}

/// Sends a request body to the assigned replica.
fn post(
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
fn streamed(headers: &reqwest::header::HeaderMap, asked: bool) -> bool {
    match headers.get(header::CONTENT_TYPE).map(|v| v.to_str()) {
        Some(Ok(content_type)) => weir_core::meter::is_event_stream(content_type),
        _ => asked,
    }
}

/// Resolves when the sidecar's shutdown grace period is over (never, if it never stops).
async fn cut(app: &App) {
    let mut cut = app.cut.clone();
    if cut.wait_for(|&c| c).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// A request still running when the shutdown grace period ends: recorded, then refused. Before
/// its first bytes came nothing was relayed: it is billed its prompt, not an unread answer's
/// bound (weir's restart cut it, not the caller).
fn cut_short(mut flight: Flight) -> Response {
    flight.finish("shutdown", Some(BodyUsage::Unknown));
    flight.refusal(
        ApiError::new(503, "the gateway's scheduler is restarting; retry")
            .with_code("shutting_down"),
    )
}

/// An engine that refuses a request as unauthenticated refuses the pool's credential, not the
/// caller's key (which the gateway checked): the caller gets a retryable 502 of weir's own,
/// never the engine's answer, whose body speaks of the credential it got (a hosted API quotes
/// part of the key it refused) and which an SDK would take for its own key being wrong.
fn credential_refused(mut flight: Flight, status: StatusCode) -> Response {
    tracing::warn!(replica = %flight.assignment.url, %status, "the engine refused the pool's credential");
    (flight.app.metrics).reject("engine_unauthorized", &flight.who.tenant, 502);
    flight.finish("upstream_error", None);
    flight.refusal(
        ApiError::new(
            502,
            "the engine refused the gateway's own credential; retry later",
        )
        .with_code("engine_unauthorized"),
    )
}

/// An engine that throttles a request throttles the pool's account, every tenant's traffic
/// together: the caller gets the engine's 429 and `Retry-After`, in weir's words, never the
/// engine's answer, which speaks of the account's limits and usage (a hosted API names the
/// organization and what it used: the figures the filter keeps out of rate-limit headers).
fn throttled(mut flight: Flight, retry_after: Option<HeaderValue>) -> Response {
    (flight.app.metrics).reject("engine_rate_limited", &flight.who.tenant, 429);
    flight.finish("upstream_error", None);
    let mut resp = flight.refusal(
        ApiError::rate_limited("the engine is rate limiting the gateway's requests; retry later")
            .with_code("engine_rate_limited"),
    );
    if let Some(retry_after) = retry_after {
        let retry_after = flight.engine_retry_after(retry_after);
        resp.headers_mut().insert(header::RETRY_AFTER, retry_after);
    }
    resp
}

/// A request whose engine had not answered (headers, or the whole of a non-streamed body) by
/// the end of `relay.max_response_ms`: the upstream request is dropped (the engine aborts and
/// frees the KV), the attempt recorded and billed its prompt — not an unread answer's bound:
/// weir's deadline cut it, and a hung engine must not bill every tenant its `max_tokens` — and
/// the caller told to retry.
fn timed_out(mut flight: Flight) -> Response {
    flight.finish("response_deadline", Some(BodyUsage::Unknown));
    flight.refusal(
        ApiError::new(
            504,
            "the engine did not answer within the gateway's longest response time; retry",
        )
        .with_code("response_deadline"),
    )
}

/// A stream the engine had not started (no body bytes) by the end of `relay.first_byte_ms`: the
/// upstream request is dropped (the engine aborts it), the replica's concurrency limit lowered,
/// and the caller told to retry. An engine that had `accepted` it (its headers came: vLLM sends
/// them as it takes a request in, llama.cpp once a slot starts it) ran its prompt, or held it
/// in a queue of its own, and is billed the prompt: a prefill longer than the deadline is not
/// free to retry without end. One that had not ran nothing and is billed nothing.
fn not_started(mut flight: Flight, accepted: bool) -> Response {
    flight.assignment.not_started();
    (flight.app.metrics).reject("first_byte_deadline", &flight.who.tenant, 503);
    flight.nothing_ran = !accepted;
    flight.finish("first_byte_deadline", Some(BodyUsage::Unknown));
    flight.refusal(
        ApiError::new(
            503,
            "the engine did not start the request within the gateway's first-byte deadline; retry",
        )
        .with_code("first_byte_deadline"),
    )
}

/// What the pump hands the response body.
enum Piece {
    Chunk(Bytes),
    /// weir's closing event (an error and `[DONE]`), after what was still pending: nothing
    /// follows it.
    Last(Bytes),
    /// The stream is complete; without it, a closed channel means the pump gave up on the client.
    End,
}

/// How a chunk's hand-over to the client went.
enum Delivery {
    Taken,
    ClientGone,
    ClientStalled,
}

/// Most bytes the pump holds for a client that has not taken the last chunk yet. What the
/// replica sends meanwhile goes out as one chunk, one write for many events (the slower the
/// client, the larger the batch); past this the pump stops reading, and the replica's stream
/// waits on the client.
const MAX_PENDING_BYTES: usize = 16 * 1024;

fn relay_stream(
    flight: Flight,
    upstream: Upstream,
    deadline: TokioInstant,
) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send {
    let (tx, rx) = mpsc::channel(1);
    let endpoint = flight.endpoint;
    tokio::spawn(pump(flight, upstream, tx, deadline));
    futures::stream::unfold(Some(rx), move |rx| async move {
        let mut rx: mpsc::Receiver<Piece> = rx?;
        match rx.recv().await {
            Some(Piece::Chunk(chunk)) => Some((Ok(chunk), Some(rx))),
            Some(Piece::Last(event)) => Some((Ok(event), None)),
            Some(Piece::End) => None,
            // The pump gave up on this client: say so if it is still there to read it.
            None => Some((Ok(Ending::SlowClient.event(endpoint)), None)),
        }
    })
}

/// Hands a piece to the response body, waiting at most `stall` for the client to take the last.
async fn deliver(tx: &mpsc::Sender<Piece>, piece: Piece, stall: Duration) -> Delivery {
    match tokio::time::timeout(stall, tx.send(piece)).await {
        Ok(Ok(())) => Delivery::Taken,
        Ok(Err(_)) => Delivery::ClientGone,
        Err(_) => Delivery::ClientStalled,
    }
}

/// What the pump waits on besides the replica and the client: how long each has kept it
/// waiting. One timer serves both; it is moved when it fires and when bytes start waiting for
/// the client with a limit before it, never per chunk. On tokio's clock, as the timer is.
struct Watch {
    idle: Duration,
    stall: Duration,
    /// Since when the pump has been waiting for the replica's next bytes.
    replica_since: TokioInstant,
    /// Since when bytes have been pending for a client that has not taken the last chunk.
    client_since: Option<TokioInstant>,
}

/// Who kept the pump waiting too long.
#[derive(Debug, PartialEq)]
enum Lapse {
    /// No bytes from the replica for `IDLE_TIMEOUT` while the pump was reading.
    Replica,
    /// Bytes pending for the client longer than `relay.client_stall_ms`.
    Client,
}

impl Watch {
    fn new(stall: Duration, now: TokioInstant) -> Watch {
        Watch {
            idle: IDLE_TIMEOUT,
            stall,
            replica_since: now,
            client_since: None,
        }
    }

    /// Bytes are pending for the client at `now`: when its limit is up, if they were not
    /// already.
    fn client_waits(&mut self, now: TokioInstant) -> Option<TokioInstant> {
        if self.client_since.is_some() {
            return None;
        }
        self.client_since = Some(now);
        Some(now + self.stall)
    }

    /// Who has lapsed at `now`; the replica counts only while the pump is `reading` it (while
    /// it is not, its silence starts over, so the next check is never one already past).
    fn lapsed(&mut self, now: TokioInstant, reading: bool) -> Option<Lapse> {
        if !reading {
            self.replica_since = now;
        }
        // A replica silent while the pump reads it is reported even if the client is slow too.
        if reading && now >= self.replica_since + self.idle {
            Some(Lapse::Replica)
        } else if self.client_since.is_some_and(|t| now >= t + self.stall) {
            Some(Lapse::Client)
        } else {
            None
        }
    }

    /// When to look again.
    fn next_check(&self) -> TokioInstant {
        let replica = self.replica_since + self.idle;
        self.client_since
            .map_or(replica, |t| replica.min(t + self.stall))
    }
}

/// Relays the replica's stream to the body channel until it ends, the client leaves or stalls,
/// or the stream's time (`deadline`, counted from dispatch) is up; settles the flight on every
/// path.
async fn pump(
    mut flight: Flight,
    mut upstream: Upstream,
    tx: mpsc::Sender<Piece>,
    deadline: TokioInstant,
) {
    // The headers go to the client with the first bytes: from here the filter meters a stream.
    flight.streamed = true;
    let app = flight.app.clone();
    let stall = Duration::from_millis(app.relay.load().client_stall_ms);
    let mut preemption = flight.assignment.take_preemption();
    let mut watch = Watch::new(stall, TokioInstant::now());
    let timer = tokio::time::sleep_until(watch.next_check());
    let (mut timer, mut closed) = (pin!(timer), pin!(tx.closed()));
    let (mut deadline, mut cut) = (pin!(tokio::time::sleep_until(deadline)), pin!(cut(&app)));
    // What the replica sent that the client has not taken yet.
    let mut pending = BytesMut::new();
    // Whether a chunk came since the replica's connection last had a turn.
    let mut gathering = false;
    let ending = loop {
        let reading = pending.len() < MAX_PENDING_BYTES;
        tokio::select! {
            biased;
            () = &mut closed => {
                flight.finish("cancelled", None);
                return;
            }
            () = &mut cut => {
                flight.finish("shutdown", None);
                break Ending::Shutdown;
            }
            () = &mut deadline => {
                flight.finish("stream_deadline", None);
                break Ending::Deadline;
            }
            () = &mut timer => {
                match watch.lapsed(TokioInstant::now(), reading) {
                    Some(Lapse::Client) => {
                        flight.finish("slow_client", None);
                        return;
                    }
                    Some(Lapse::Replica) => break lost_replica(&mut flight),
                    None => timer.as_mut().reset(watch.next_check()),
                }
            }
            requeued = preempted(&mut preemption) => {
                if !flight.continuation.as_ref().is_some_and(|c| c.splice.resumable()) {
                    // It streamed what a continuation would not reproduce: it runs on.
                    continue;
                }
                drop(upstream);
                flight.assignment.release();
                if !pending.is_empty() {
                    let chunk = Piece::Chunk(pending.split().freeze());
                    if !delivered(&mut flight, deliver(&tx, chunk, stall).await) {
                        return;
                    }
                }
                match resumed(&mut flight, requeued, &tx, deadline.deadline()).await {
                    Resumed::Streaming(next) => {
                        upstream = next;
                        preemption = flight.assignment.take_preemption();
                        watch.replica_since = TokioInstant::now();
                        watch.client_since = None;
                    }
                    Resumed::Ended(ending) => {
                        if let Some(ending) = ending {
                            deliver(&tx, Piece::Last(ending.event(flight.endpoint)), stall).await;
                        }
                        return;
                    }
                }
            }
            next = upstream.next(), if reading => match next {
                Some(Ok(chunk)) => {
                    let now = TokioInstant::now();
                    watch.replica_since = now;
                    let chunk = flight.splice(&chunk);
                    let chunk = if chunk.is_empty() { chunk } else { flight.observe(&chunk) };
                    if !chunk.is_empty() {
                        // The client's limit may come before the check the timer is set for.
                        if let Some(due) = watch.client_waits(now)
                            && due < timer.deadline()
                        {
                            timer.as_mut().reset(due);
                        }
                        pending.extend_from_slice(&chunk);
                        gathering = true;
                    }
                }
                None => {
                    let spliced = flight.splice_rest();
                    if !spliced.is_empty() {
                        pending.extend_from_slice(&flight.observe(&spliced));
                    }
                    pending.extend_from_slice(&flight.drain());
                    let outcome = flight.ended_outcome();
                    flight.finish(outcome, None);
                    if !pending.is_empty() {
                        let rest = Piece::Chunk(pending.split().freeze());
                        if !delivered(&mut flight, deliver(&tx, rest, stall).await) {
                            return;
                        }
                    }
                    deliver(&tx, Piece::End, stall).await;
                    return;
                }
                Some(Err(_)) => break lost_replica(&mut flight),
            },
            // The replica's connection hands its events over one at a time: it gets a turn to
            // hand over what it has already read before the pending bytes go out, so a burst
            // of events is one write to the client, not one each.
            () = tokio::task::yield_now(), if gathering => gathering = false,
            permit = tx.reserve(), if !gathering && !pending.is_empty() => {
                let Ok(permit) = permit else { continue };
                permit.send(Piece::Chunk(pending.split().freeze()));
                watch.client_since = None;
                watch.replica_since = TokioInstant::now();
            }
        }
    };
    // The stream ends early: what was pending, then weir's closing event.
    drop(upstream);
    pending.extend_from_slice(&ending.event(flight.endpoint));
    deliver(&tx, Piece::Last(pending.freeze()), stall).await;
}

/// The replica failed mid-stream (an error, or silent past `IDLE_TIMEOUT`): the dispatcher is
/// told and the attempt settled.
fn lost_replica(flight: &mut Flight) -> Ending {
    let _ = flight.app.events.send(Event::ReplicaFailed {
        pool: flight.assignment.pool,
        replica: flight.assignment.replica,
    });
    flight.finish("failed", None);
    Ending::LostReplica
}

/// Settles a flight whose client did not take a chunk; whether the stream goes on.
fn delivered(flight: &mut Flight, delivery: Delivery) -> bool {
    match delivery {
        Delivery::Taken => true,
        Delivery::ClientGone => {
            flight.finish("cancelled", None);
            false
        }
        Delivery::ClientStalled => {
            flight.finish("slow_client", None);
            false
        }
    }
}

/// Resolves with the dispatcher's word when it preempts the stream (never, if it does not).
async fn preempted(preemption: &mut Option<oneshot::Receiver<Requeued>>) -> Requeued {
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
enum Resumed {
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
        () = tx.closed() => Err(("cancelled", None)),
        () = tokio::time::sleep_until(deadline) => Err(("stream_deadline", Some(Ending::Deadline))),
        () = cut(app) => Err(("shutdown", Some(Ending::Shutdown))),
    }
}

/// A preempted stream, its upstream request aborted and its hold given back, waits for its
/// next dispatch (at the head of its tenant's batch queue) and asks the new replica to
/// continue what was generated ([`crate::relay::resume`]). Settles the flight unless it streams on.
async fn resumed(
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
            flight.assignment = assignment;
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
            flight.assignment.started(flight.input_tokens);
            Resumed::Streaming(upstream)
        }
        Ok(result) => {
            if result.is_err() {
                flight.assignment.not_started();
            }
            tracing::warn!(replica = %flight.assignment.url, "a preempted stream could not be resumed");
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
    let before = flight.meter.generated_tokens();
    let request = flight.continuation.as_mut().map(|c| {
        c.splice.next_segment(before);
        let mut body = continued(flight.endpoint, &c.body, c.splice.text(), before);
        flight.assignment.isolation.apply(&mut body);
        let url = format!("{}{}", flight.assignment.url, flight.endpoint.path());
        let body = serde_json::to_vec(&body).unwrap_or_default();
        let engine_id = c
            .trace_id
            .as_ref()
            .and_then(|id| segment_id(id, c.splice.segment()));
        post(&flight.assignment, &url, body, engine_id, true)
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

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    /// What a pump runs against: an App with a ledger in a file of its own, the dispatcher's
    /// events, and the shutdown switch.
    struct Rig {
        app: Arc<App>,
        events: mpsc::UnboundedReceiver<Event>,
        cut: tokio::sync::watch::Sender<bool>,
        _draining: tokio::sync::watch::Sender<bool>,
        ledger: std::path::PathBuf,
    }

    fn rig(client_stall_ms: u64) -> Rig {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("weir-pump-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ledger.db");
        let (events_tx, events) = mpsc::unbounded_channel();
        let (metrics, registry) =
            crate::metrics::Metrics::new(&crate::config::metrics::MetricsConfig::default(), None);
        let ledger = crate::ledger::Ledger::start(&path, None, Default::default()).unwrap();
        let (cut, cut_rx) = tokio::sync::watch::channel(false);
        let (draining, draining_rx) = tokio::sync::watch::channel(false);
        let (_waits, waits) =
            tokio::sync::watch::channel(Arc::new(crate::support::backoff::Waits::default()));
        let app = Arc::new(App {
            events: events_tx,
            ledger_reader: crate::ledger::Reader::open(&path, None).unwrap(),
            metrics,
            registry,
            ledger,
            pools: crate::support::live::Live::new(Vec::new()),
            exact_below_bytes: crate::support::live::Live::new(0),
            max_body_bytes: crate::support::live::Live::new(1 << 20),
            cache_salt_key: Vec::new(),
            queue_deadline_ms: crate::support::live::Live::new(0),
            trust: crate::intake::trust::Trust::new(Vec::new()),
            idempotency: crate::intake::idempotency::Idempotency::new(Default::default()),
            relay: crate::support::live::Live::new(crate::config::RelayConfig {
                client_stall_ms,
                ..Default::default()
            }),
            backoff: crate::support::backoff::Backoff::new(waits),
            predictions: crate::intake::prediction::Predictions::new(Default::default()),
            quota: None,
            cut: cut_rx,
            draining: draining_rx,
        });
        Rig {
            app,
            events,
            cut,
            _draining: draining,
            ledger: path,
        }
    }

    fn flight(rig: &Rig, hide_usage: bool) -> Flight {
        flight_of(rig, Endpoint::ChatCompletions, hide_usage)
    }

    fn flight_of(rig: &Rig, endpoint: Endpoint, hide_usage: bool) -> Flight {
        let attempt = Attempt {
            endpoint,
            who: Trusted {
                tenant: "t".into(),
                request_id: "r1".into(),
                idempotency_key: None,
                tier: "standard".into(),
                weights: vec![1.0],
                priority: Default::default(),
                kv_cap: None,
                models: None,
                prices: None,
                route: Some("llm-api".into()),
                mode: Some("shadow".into()),
            },
            model: "m".into(),
            input_tokens: 10,
            output_held: 100,
            unread_output: 100,
            uncapped: false,
            sequences: 1,
            arrived: Instant::now(),
            deadline_ms: u64::MAX,
            hide_usage,
            continuation: None,
        };
        let assignment = Assignment::for_tests(rig.app.events.clone(), 110, None);
        Flight::new(rig.app.clone(), attempt, assignment, None)
    }

    type Feed = futures::channel::mpsc::UnboundedSender<reqwest::Result<Bytes>>;

    /// A replica's stream the test writes to.
    fn replica() -> (Feed, Upstream) {
        let (tx, rx) = futures::channel::mpsc::unbounded();
        (tx, Box::pin(rx))
    }

    fn token(i: usize) -> Bytes {
        Bytes::from(format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i}\"}}}}]}}\n\n"
        ))
    }

    const LONG: Duration = Duration::from_secs(600);

    /// A pump relaying `flight` from a replica the test writes to (`feed`) to the client's end
    /// of the body channel, with `time` left on the stream.
    struct Running {
        feed: Feed,
        client: mpsc::Receiver<Piece>,
        pump: tokio::task::JoinHandle<()>,
    }

    fn run(flight: Flight, time: Duration) -> Running {
        let (feed, upstream) = replica();
        let (tx, client) = mpsc::channel(1);
        let pump = tokio::spawn(pump(flight, upstream, tx, TokioInstant::now() + time));
        Running { feed, client, pump }
    }

    /// Sends tokens `0..n` from the replica; the bytes sent.
    fn send_tokens(feed: &Feed, n: usize) -> Vec<u8> {
        let mut sent = Vec::new();
        for i in 0..n {
            let t = token(i);
            sent.extend_from_slice(&t);
            feed.unbounded_send(Ok(t)).unwrap();
        }
        sent
    }

    /// A stream that ends early: the client reads the bytes that were pending (`sent`), then
    /// weir's closing event, which is returned once the pump is done.
    async fn closes_after(
        mut client: mpsc::Receiver<Piece>,
        pump: tokio::task::JoinHandle<()>,
        sent: &[u8],
    ) -> String {
        let (got, how) = read_all(&mut client).await;
        assert_eq!(how, "last");
        let text = String::from_utf8_lossy(&got).into_owned();
        assert!(
            got.starts_with(sent),
            "the pending bytes come first: {text}"
        );
        pump.await.unwrap();
        text[sent.len()..].to_owned()
    }

    /// The outcomes the ledger recorded (waits for the writer).
    fn outcomes(rig: &Rig) -> Vec<String> {
        records(rig)
            .into_iter()
            .map(|(_, outcome, _)| outcome)
            .collect()
    }

    /// The request id, outcome and completion tokens of each record in the ledger (waits for
    /// the writer).
    fn records(rig: &Rig) -> Vec<(String, String, u64)> {
        assert!(rig.app.ledger.flush(Duration::from_secs(5)));
        let conn = rusqlite::Connection::open(&rig.ledger).unwrap();
        let columns = "SELECT request_id, outcome, completion_tokens FROM usage";
        let mut stmt = conn.prepare(columns).unwrap();
        stmt.query_map([], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get::<_, i64>(2)? as u64))
        })
        .unwrap()
        .map(Result::unwrap)
        .collect()
    }

    /// Waits (up to `within`) for the replica's hold to be given back; how many times it was.
    async fn released(rig: &mut Rig, within: Duration) -> usize {
        let mut n = 0;
        let _ = tokio::time::timeout(within, async {
            while let Some(e) = rig.events.recv().await {
                if matches!(e, Event::Finished { .. }) {
                    n += 1;
                    break;
                }
            }
        })
        .await;
        // Anything more already sent counts too.
        while let Ok(e) = rig.events.try_recv() {
            if matches!(e, Event::Finished { .. }) {
                n += 1;
            }
        }
        n
    }

    /// Everything the client reads until the pump's side ends.
    async fn read_all(rx: &mut mpsc::Receiver<Piece>) -> (Vec<u8>, &'static str) {
        let mut out = Vec::new();
        loop {
            match rx.recv().await {
                Some(Piece::Chunk(c)) => out.extend_from_slice(&c),
                Some(Piece::Last(c)) => {
                    out.extend_from_slice(&c);
                    return (out, "last");
                }
                Some(Piece::End) => return (out, "end"),
                None => return (out, "closed"),
            }
        }
    }

    /// A Responses stream whose `response.created` and `response.completed` each repeat 200 KB
    /// of instructions, arriving in 16 KiB pieces: the client gets it as it came, and it is
    /// settled from the engine's usage (its cached tokens too) as completed work. The meter
    /// lost events past its 64 KiB bound: `counted`, `failed`, and the key's retry billed again.
    #[tokio::test]
    async fn a_responses_stream_of_events_past_the_meters_bound_is_settled_from_its_usage() {
        let mut rig = rig(5_000);
        let flight = flight_of(&rig, Endpoint::Responses, false);
        let Running {
            feed,
            mut client,
            pump,
        } = run(flight, LONG);
        let instructions =
            serde_json::to_string(&"Answer as \"the {gateway}\" would.\n\n".repeat(6_000)).unwrap();
        let response = |status: &str, usage: &str| {
            format!(
                r#"{{"id":"r","object":"response","instructions":{instructions},"status":"{status}","tools":[],"usage":{usage}}}"#
            )
        };
        let usage = r#"{"input_tokens":51000,"input_tokens_details":{"cached_tokens":50000},"output_tokens":2,"total_tokens":51002}"#;
        let stream = format!(
            "event: response.created\ndata: {{\"type\":\"response.created\",\"response\":{}}}\n\n\
             event: response.output_text.delta\ndata: {{\"type\":\"response.output_text.delta\",\"delta\":\" hi\"}}\n\n\
             event: response.completed\ndata: {{\"type\":\"response.completed\",\"response\":{}}}\n\n",
            response("in_progress", "null"),
            response("completed", usage),
        );
        assert!(stream.len() > 400_000);
        for piece in stream.as_bytes().chunks(16 * 1024) {
            feed.unbounded_send(Ok(Bytes::copy_from_slice(piece)))
                .unwrap();
        }
        drop(feed);
        let (got, how) = read_all(&mut client).await;
        assert_eq!(how, "end");
        assert!(
            got == stream.as_bytes(),
            "{} bytes of {}",
            got.len(),
            stream.len()
        );
        pump.await.unwrap();
        assert_eq!(released(&mut rig, Duration::from_secs(1)).await, 1);
        assert!(rig.app.ledger.flush(Duration::from_secs(5)));
        let conn = rusqlite::Connection::open(&rig.ledger).unwrap();
        let row = conn
            .query_row(
                "SELECT source, outcome, prompt_tokens, completion_tokens, cached_prompt_tokens, \
                 route || '/' || mode FROM usage",
                [],
                |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, String>(1)?,
                        r.get(2)?,
                        r.get(3)?,
                        r.get(4)?,
                        r.get::<_, String>(5)?,
                    ))
                },
            )
            .unwrap();
        assert_eq!(
            row,
            (
                "engine".into(),
                "ok".into(),
                51000_i64,
                2_i64,
                50000_i64,
                "llm-api/shadow".into()
            )
        );
    }

    /// An engine whose non-streamed answer outgrows `relay.max_response_bytes` (a batch of
    /// embeddings too large, or an engine gone wrong) is not read whole: the caller gets 502
    /// `response_too_large`, and the attempt is billed its prompt and its answer's bound.
    /// Before, the sidecar read any answer whole into memory.
    #[tokio::test]
    async fn a_non_streamed_answer_past_the_bound_is_refused_and_billed_not_held() {
        let rig = rig(5_000);
        let huge = |declared: bool| async move {
            let answer = format!(
                r#"{{"object":"list","data":[{{"embedding":[{}]}}]}}"#,
                "0.123456789,".repeat(20_000) + "0"
            );
            if declared {
                answer.into_response()
            } else {
                // Chunked, without a length: the bound is found reading.
                let chunks = answer
                    .into_bytes()
                    .chunks(4096)
                    .map(|c| Ok::<_, std::io::Error>(Bytes::copy_from_slice(c)))
                    .collect::<Vec<_>>();
                Body::from_stream(futures::stream::iter(chunks)).into_response()
            }
        };
        let engine = axum::Router::new()
            .route("/declared", axum::routing::post(move || huge(true)))
            .route("/chunked", axum::routing::post(move || huge(false)));
        let url = serve(engine).await;
        rig.app.relay.store(crate::config::RelayConfig {
            max_response_bytes: 64 * 1024,
            ..Default::default()
        });
        for (i, path) in ["/declared", "/chunked"].into_iter().enumerate() {
            let mut flight = flight_of(&rig, Endpoint::Embeddings, false);
            flight.who.request_id = format!("big-{i}");
            flight.assignment.url = url.clone();
            let resp = relay(flight, path, b"{}".to_vec(), false, None).await;
            let (status, v) = answer_of(resp).await;
            assert_eq!(status, StatusCode::BAD_GATEWAY, "{path}: {v}");
            assert_eq!(v["error"]["code"], "response_too_large", "{path}: {v}");
        }
        assert_eq!(
            billed(&rig),
            vec![("response_too_large".into(), 10, 100, "bound".into()); 2],
            "its prompt, and its answer's bound"
        );
    }

    /// An engine's own refusal reaches the caller with its status and message in the
    /// provider's values: vLLM's exception class and numeric code were passed on as they came.
    #[tokio::test]
    async fn an_engine_s_refusal_reaches_the_caller_in_the_provider_s_values() {
        let rig = rig(5_000);
        let refuse = || async {
            let body = r#"{"error":{"message":"max_tokens is too large","type":"BadRequestError","param":"max_tokens","code":400}}"#;
            (StatusCode::BAD_REQUEST, body).into_response()
        };
        let url = serve(axum::Router::new().route("/refuse", axum::routing::post(refuse))).await;
        for (endpoint, want) in [
            (
                Endpoint::ChatCompletions,
                json!({"error": {"message": "max_tokens is too large",
                    "type": "invalid_request_error", "param": "max_tokens", "code": null}}),
            ),
            (
                Endpoint::Messages,
                json!({"type": "error", "error": {"type": "invalid_request_error",
                    "message": "max_tokens is too large"}}),
            ),
        ] {
            let mut flight = flight_of(&rig, endpoint, false);
            flight.who.request_id = format!("refused-{}", endpoint.name());
            flight.assignment.url = url.clone();
            let resp = relay(flight, "/refuse", b"{}".to_vec(), false, None).await;
            let (status, v) = answer_of(resp).await;
            assert_eq!((status, v), (StatusCode::BAD_REQUEST, want));
        }
    }

    /// Each record's outcome, prompt and output tokens and their source, by request id (waits
    /// for the writer).
    fn billed(rig: &Rig) -> Vec<(String, u64, u64, String)> {
        assert!(rig.app.ledger.flush(Duration::from_secs(5)));
        let conn = rusqlite::Connection::open(&rig.ledger).unwrap();
        let columns = "SELECT outcome, prompt_tokens, completion_tokens, source FROM usage \
                       ORDER BY request_id";
        let mut stmt = conn.prepare(columns).unwrap();
        stmt.query_map([], |r| {
            Ok((
                r.get(0)?,
                r.get::<_, i64>(1)? as u64,
                r.get::<_, i64>(2)? as u64,
                r.get(3)?,
            ))
        })
        .unwrap()
        .map(Result::unwrap)
        .collect()
    }

    /// Serves `engine` on loopback; its URL.
    async fn serve(engine: axum::Router) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, engine).await });
        url
    }

    /// An engine that takes the request in and never answers.
    async fn silent() -> &'static str {
        std::future::pending().await
    }

    /// An engine that sends a stream's headers and never its first byte (a long prefill).
    async fn unstarted() -> Response {
        let body = Body::from_stream(futures::stream::pending::<std::io::Result<Bytes>>());
        ([(header::CONTENT_TYPE, EVENT_STREAM)], body).into_response()
    }

    /// The status and JSON body of the caller's answer.
    async fn answer_of(resp: Response) -> (StatusCode, Value) {
        let status = resp.status();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, serde_json::from_slice(&body).unwrap())
    }

    /// A client that leaves a request the engine is working on before any of its answer came.
    /// Non-streamed, nobody reads the answer: the attempt is billed its prompt and the answer's
    /// bound (its `max_tokens`), as the filter charges it. Before, the ledger billed no output.
    /// Streamed, what was relayed is counted: nothing yet.
    #[tokio::test]
    async fn a_non_streamed_answer_the_client_left_is_billed_its_bound() {
        let rig = rig(5_000);
        // A stream asked for and answered as JSON whose body never ends: the filter meters it
        // as the stream it asked for (it never got the answer's headers), so the ledger does.
        let half_json = || async {
            let start = futures::stream::once(async { Ok(Bytes::from_static(b"{\"choices\":[")) });
            let body = Body::from_stream(
                start.chain(futures::stream::pending::<std::io::Result<Bytes>>()),
            );
            ([(header::CONTENT_TYPE, JSON)], body).into_response()
        };
        let engine = axum::Router::new()
            .route("/answer", axum::routing::post(silent))
            .route("/stream", axum::routing::post(unstarted))
            .route("/json", axum::routing::post(half_json));
        let url = serve(engine).await;
        let exits = [("/answer", false), ("/stream", true), ("/json", true)];
        for (i, (path, stream)) in exits.into_iter().enumerate() {
            let mut flight = flight(&rig, false);
            flight.who.request_id = format!("r{i}");
            flight.assignment.url = url.clone();
            let left = tokio::time::timeout(
                Duration::from_millis(200),
                relay(flight, path, b"{}".to_vec(), stream, None),
            )
            .await;
            assert!(left.is_err(), "{path}: the engine answered");
        }
        assert_eq!(
            billed(&rig),
            [
                ("cancelled".into(), 10, 100, "bound".into()),
                ("cancelled".into(), 10, 0, "counted".into()),
                ("cancelled".into(), 10, 0, "counted".into()),
            ]
        );
    }

    /// An answer with no usage weir can read or count (not the API's JSON) is billed its bound,
    /// as the filter charges it; before, the ledger billed no output.
    #[tokio::test]
    async fn an_answer_with_no_usage_weir_can_read_is_billed_its_bound() {
        let rig = rig(5_000);
        let odd = || async {
            (
                [(header::CONTENT_TYPE, JSON)],
                "{\"object\":\"odd\",\"output\":\"...\"}",
            )
        };
        let url = serve(axum::Router::new().route("/", axum::routing::post(odd))).await;
        // Asked for as a stream too: answered whole as JSON, the filter meters it as a body.
        for (i, stream) in [false, true].into_iter().enumerate() {
            let mut flight = flight(&rig, false);
            flight.who.request_id = format!("r{i}");
            flight.assignment.url = url.clone();
            let resp = relay(flight, "/", b"{}".to_vec(), stream, None).await;
            assert_eq!(resp.status(), StatusCode::OK);
        }
        assert_eq!(
            billed(&rig),
            vec![("ok".into(), 10, 100, "bound".into()); 2]
        );
    }

    /// An engine that cannot be reached ran nothing and is billed nothing; one that fails
    /// partway through a non-streamed answer took the prompt and is billed it (its output is
    /// in the part that never came), and the 502 says so for the filter.
    #[tokio::test]
    async fn an_engine_that_fails_is_billed_for_what_it_took_in() {
        let rig = rig(5_000);
        let failing = || async {
            let start = Bytes::from_static(b"{\"id\":\"chatcmpl-1\",\"choices\":[");
            let dies = async {
                tokio::time::sleep(Duration::from_millis(100)).await;
                Err(std::io::Error::other("engine died"))
            };
            let pieces =
                futures::stream::once(async { Ok(start) }).chain(futures::stream::once(dies));
            Body::from_stream(pieces).into_response()
        };
        let url = serve(axum::Router::new().route("/", axum::routing::post(failing))).await;
        let closed = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}", listener.local_addr().unwrap())
        };
        let mut usages = Vec::new();
        for (i, url) in [url, closed].into_iter().enumerate() {
            let mut flight = flight(&rig, false);
            flight.who.request_id = format!("r{i}");
            flight.assignment.url = url;
            let resp = relay(flight, "/", b"{}".to_vec(), false, None).await;
            let (status, v) = answer_of(resp).await;
            assert_eq!(status, StatusCode::BAD_GATEWAY, "{v}");
            usages.push(v["usage"].clone());
        }
        assert_eq!(
            (&usages[0]["prompt_tokens"], &usages[0]["completion_tokens"]),
            (&json!(10), &json!(0))
        );
        assert_eq!(usages[1], Value::Null, "nothing billed, nothing said");
        assert_eq!(
            billed(&rig),
            [
                ("failed".into(), 10, 0, "counted".into()),
                ("failed".into(), 0, 0, "counted".into()),
            ]
        );
    }

    /// A stream the engine has not started by `relay.first_byte_ms`: one it took in (its
    /// headers came) ran or queued its prompt and is billed it, and the 503 says so for the
    /// filter; one it never answered is billed nothing. Before, both were free to retry.
    #[tokio::test]
    async fn a_stream_not_started_by_its_first_byte_is_billed_its_prompt_once_taken_in() {
        let rig = rig(5_000);
        let engine = axum::Router::new()
            .route("/taken", axum::routing::post(unstarted))
            .route("/silent", axum::routing::post(silent));
        let url = serve(engine).await;
        rig.app.relay.store(crate::config::RelayConfig {
            first_byte_ms: 200,
            ..Default::default()
        });
        let mut usages = Vec::new();
        // The third: a plain request the engine took in as a stream, billed no bound either.
        let exits = [("/taken", true), ("/silent", true), ("/taken", false)];
        for (i, (path, stream)) in exits.into_iter().enumerate() {
            let mut flight = flight(&rig, false);
            flight.who.request_id = format!("r{i}");
            flight.assignment.url = url.clone();
            let resp = relay(flight, path, b"{}".to_vec(), stream, None).await;
            let (status, v) = answer_of(resp).await;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{path}: {v}");
            assert_eq!(v["error"]["code"], "first_byte_deadline", "{path}: {v}");
            usages.push(v["usage"].clone());
        }
        assert_eq!(usages[0]["prompt_tokens"], 10, "{usages:?}");
        assert_eq!(usages[0]["completion_tokens"], 0, "{usages:?}");
        assert_eq!(usages[1], Value::Null, "nothing billed, nothing said");
        assert_eq!(
            billed(&rig),
            [
                ("first_byte_deadline".into(), 10, 0, "counted".into()),
                ("first_byte_deadline".into(), 0, 0, "counted".into()),
                ("first_byte_deadline".into(), 10, 0, "counted".into()),
            ]
        );
    }

    /// A client that stops reading is cut at its stall limit, not when the timer set for the
    /// replica's 30 s silence next fires (which kept the engine's KV and slot for 30 s).
    #[tokio::test]
    async fn a_client_that_stops_reading_is_cut_at_the_stall_limit_not_the_idle_timeout() {
        let mut rig = rig(200);
        let Running {
            feed,
            client: _never_read,
            pump,
        } = run(flight(&rig, false), LONG);
        // One chunk fills the body channel; the next waits for a client that never takes it.
        for i in 0..4 {
            feed.unbounded_send(Ok(token(i))).unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let started = std::time::Instant::now();
        let n = released(&mut rig, Duration::from_secs(3)).await;
        assert_eq!(
            n,
            1,
            "the hold is given back once within 3 s of a 200 ms stall (took {:?})",
            started.elapsed()
        );
        tokio::time::timeout(Duration::from_secs(1), pump)
            .await
            .unwrap()
            .unwrap();
        // Billed its prompt and the tokens the pump took from the replica (two in each `tN`).
        assert_eq!(
            billed(&rig),
            [("slow_client".into(), 10, 8, "counted".into())]
        );
    }

    /// While the pump is not reading (16 KiB pending), the replica's silence does not count,
    /// and its deadline must not set a check already past: the timer re-armed in the past fired
    /// at once, again and again (a busy loop that, biased ahead of the body channel, also kept
    /// the client from its bytes) until a stall limit above 30 s lapsed.
    #[test]
    fn a_check_with_nothing_lapsed_is_never_due_already() {
        let stall = Duration::from_secs(60);
        let t0 = TokioInstant::now();
        let mut watch = Watch::new(stall, t0);
        // 16 KiB came at t0 for a client that has not taken the last chunk: no more reading.
        watch.client_since = Some(t0);
        for secs in [29, 30, 31, 45, 59] {
            let now = t0 + Duration::from_secs(secs);
            if watch.lapsed(now, false).is_none() {
                assert!(
                    watch.next_check() > now,
                    "at {secs} s nothing lapsed, yet the next check is due already"
                );
            }
        }
        assert_eq!(
            watch.lapsed(t0 + stall, false),
            Some(Lapse::Client),
            "the client's stall still lapses"
        );
    }

    /// A replica that ends its stream while bytes wait for a slow client: all of it reaches
    /// the client, in order, then the end; one record, one release.
    #[tokio::test]
    async fn pending_bytes_reach_a_slow_client_in_order_before_the_end() {
        let mut rig = rig(5_000);
        let Running {
            feed,
            mut client,
            pump,
        } = run(flight(&rig, false), LONG);
        let mut want = send_tokens(&feed, 2000);
        want.extend_from_slice(b"data: [DONE]\n\n");
        feed.unbounded_send(Ok(Bytes::from_static(b"data: [DONE]\n\n")))
            .unwrap();
        drop(feed);
        // A slow client: a chunk every 20 ms.
        let mut got = Vec::new();
        let ending = loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            match client.recv().await {
                Some(Piece::Chunk(c)) => {
                    assert!(c.len() <= MAX_PENDING_BYTES + 200, "a chunk of {}", c.len());
                    got.extend_from_slice(&c);
                }
                Some(Piece::End) => break "end",
                Some(Piece::Last(_)) => break "last",
                None => break "closed",
            }
        };
        assert_eq!(ending, "end");
        assert!(got == want, "{} bytes of {}", got.len(), want.len());
        pump.await.unwrap();
        assert_eq!(released(&mut rig, Duration::from_secs(1)).await, 1);
        assert_eq!(outcomes(&rig), ["ok"]);
    }

    /// The stream's deadline while bytes are pending for a client that has not taken the last
    /// chunk: the pending bytes, then weir's closing event, one record.
    #[tokio::test]
    async fn the_deadline_delivers_what_was_pending_before_its_event() {
        let mut rig = rig(5_000);
        let Running { feed, client, pump } = run(flight(&rig, false), Duration::from_millis(300));
        let want = send_tokens(&feed, 50);
        // The client reads nothing until the deadline has passed.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let event = closes_after(client, pump, &want).await;
        assert!(event.contains("stream_deadline") && event.ends_with("data: [DONE]\n\n"));
        assert_eq!(released(&mut rig, Duration::from_secs(1)).await, 1);
        assert_eq!(outcomes(&rig), ["stream_deadline"]);
        drop(feed);
    }

    /// The shutdown cut, with bytes pending: they come first, then weir's closing event.
    #[tokio::test]
    async fn the_shutdown_cut_delivers_what_was_pending_before_its_event() {
        let mut rig = rig(5_000);
        let Running { feed, client, pump } = run(flight(&rig, false), LONG);
        let want = send_tokens(&feed, 50);
        tokio::time::sleep(Duration::from_millis(100)).await;
        rig.cut.send(true).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let event = closes_after(client, pump, &want).await;
        assert!(event.contains("shutting_down") && event.ends_with("data: [DONE]\n\n"));
        assert_eq!(released(&mut rig, Duration::from_secs(1)).await, 1);
        assert_eq!(
            billed(&rig),
            [("shutdown".into(), 10, 100, "counted".into())],
            "its prompt and what was relayed, no bound"
        );
        drop(feed);
    }

    /// A client that never reads does not make the pump read without bound: it stops taking
    /// the replica's bytes at 16 KiB pending (plus the chunk in the channel).
    #[tokio::test]
    async fn a_client_that_never_reads_stops_the_pump_reading() {
        let rig = rig(5_000);
        let (feed, rx) = futures::channel::mpsc::unbounded::<reqwest::Result<Bytes>>();
        let taken = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = taken.clone();
        let upstream: Upstream = Box::pin(rx.inspect(move |c| {
            if let Ok(c) = c {
                counted.fetch_add(c.len(), std::sync::atomic::Ordering::Relaxed);
            }
        }));
        let (tx, _client) = mpsc::channel(1);
        let deadline = TokioInstant::now() + Duration::from_secs(600);
        let pump = tokio::spawn(pump(flight(&rig, false), upstream, tx, deadline));
        send_tokens(&feed, 5000);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let taken = taken.load(std::sync::atomic::Ordering::Relaxed);
        assert!(taken >= MAX_PENDING_BYTES, "it reads: {taken}");
        assert!(
            taken <= 2 * MAX_PENDING_BYTES + 2 * token(0).len(),
            "took {taken} bytes for a client that took none"
        );
        pump.abort();
        drop(feed);
    }

    /// A preempted stream that cannot be resumed, with bytes pending for a client
    /// that has not taken the last chunk: the pending bytes, then the `not_resumed` event;
    /// one release, one record.
    #[tokio::test]
    async fn a_preempted_stream_delivers_what_was_pending_before_it_ends() {
        let mut rig = rig(5_000);
        let (feed, upstream) = replica();
        let (tx, client) = mpsc::channel(1);
        let (preempt, preempted) = oneshot::channel();
        let mut flight = flight(&rig, false);
        flight.assignment = Assignment::for_tests(rig.app.events.clone(), 110, Some(preempted));
        // The hold replaced here is given back: not the pump's.
        assert_eq!(released(&mut rig, Duration::from_secs(1)).await, 1);
        flight.continuation = Some(Continuation {
            body: serde_json::json!({"model": "m", "messages": [], "stream": true}),
            trace_id: None,
            splice: Splice::new(Default::default()),
        });
        let deadline = TokioInstant::now() + Duration::from_secs(600);
        let pump = tokio::spawn(pump(flight, upstream, tx, deadline));
        let want = send_tokens(&feed, 50);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (requeue, requeued) = oneshot::channel();
        preempt.send(requeued).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let _ = requeue.send(Err(crate::dispatch::Refusal::NoReplica));
        let event = closes_after(client, pump, &want).await;
        assert!(event.contains("\"preempted\"") && event.ends_with("data: [DONE]\n\n"));
        assert_eq!(released(&mut rig, Duration::from_secs(1)).await, 1);
        assert_eq!(outcomes(&rig), ["not_resumed"]);
        drop(feed);
    }

    /// A replica whose connection fails mid-stream, with bytes pending: they come
    /// first, then the lost-replica event; the dispatcher is told; one record.
    #[tokio::test]
    async fn a_failing_replica_delivers_what_was_pending_before_its_event() {
        let mut rig = rig(5_000);
        let Running { feed, client, pump } = run(flight(&rig, false), LONG);
        let want = send_tokens(&feed, 50);
        let error = reqwest::get("http://127.0.0.1:9/").await.unwrap_err();
        feed.unbounded_send(Err(error)).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let event = closes_after(client, pump, &want).await;
        assert!(event.contains("replica_lost") && event.ends_with("data: [DONE]\n\n"));
        let mut failed = 0;
        let mut finished = 0;
        while let Ok(e) = rig.events.try_recv() {
            match e {
                Event::ReplicaFailed { .. } => failed += 1,
                Event::Finished { .. } => finished += 1,
                _ => {}
            }
        }
        assert_eq!((failed, finished), (1, 1));
        assert_eq!(outcomes(&rig), ["failed"]);
    }

    /// Weir's usage chunk stays hidden when it comes in the same burst as the
    /// tokens, and the client still gets `[DONE]`.
    #[tokio::test]
    async fn a_hidden_usage_chunk_does_not_leak_from_a_gathered_burst() {
        let mut rig = rig(5_000);
        let Running {
            feed,
            mut client,
            pump,
        } = run(flight(&rig, true), LONG);
        send_tokens(&feed, 20);
        let usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":20,\"total_tokens\":27}}\n\n";
        // Split mid-event, as a connection may.
        feed.unbounded_send(Ok(Bytes::from(&usage[..30]))).unwrap();
        feed.unbounded_send(Ok(Bytes::from(&usage[30..]))).unwrap();
        feed.unbounded_send(Ok(Bytes::from_static(b"data: [DONE]\n\n")))
            .unwrap();
        drop(feed);
        let (got, how) = read_all(&mut client).await;
        let got = String::from_utf8(got).unwrap();
        assert_eq!(how, "end");
        assert!(!got.contains("usage"), "{got}");
        assert!(
            got.contains("t19") && got.ends_with("data: [DONE]\n\n"),
            "{got}"
        );
        pump.await.unwrap();
        assert_eq!(released(&mut rig, Duration::from_secs(1)).await, 1);
        assert_eq!(outcomes(&rig), ["ok"]);
    }

    /// The client leaving while bytes are pending: cancelled, once, and released.
    #[tokio::test]
    async fn a_client_that_leaves_with_bytes_pending_is_cancelled_once() {
        let mut rig = rig(5_000);
        let Running { feed, client, pump } = run(flight(&rig, false), LONG);
        send_tokens(&feed, 50);
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(client);
        tokio::time::timeout(Duration::from_secs(1), pump)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(released(&mut rig, Duration::from_secs(1)).await, 1);
        assert_eq!(outcomes(&rig), ["cancelled"]);
        drop(feed);
    }

    #[tokio::test]
    async fn a_client_that_does_not_take_a_chunk_in_time_is_stalled_and_one_that_left_is_gone() {
        let stall = Duration::from_millis(50);
        let (tx, mut rx) = mpsc::channel(1);
        let chunk = || Piece::Chunk(Bytes::from_static(b"data: {}\n\n"));
        assert!(matches!(
            deliver(&tx, chunk(), stall).await,
            Delivery::Taken
        ));
        // The client has not taken that one: the next waits, then gives up.
        let started = std::time::Instant::now();
        assert!(matches!(
            deliver(&tx, chunk(), stall).await,
            Delivery::ClientStalled
        ));
        assert!(started.elapsed() >= stall);
        // A client reading in time is never stalled.
        assert!(rx.recv().await.is_some());
        assert!(matches!(
            deliver(&tx, chunk(), stall).await,
            Delivery::Taken
        ));
        drop(rx);
        assert!(matches!(
            deliver(&tx, chunk(), stall).await,
            Delivery::ClientGone
        ));
    }

    /// Answer pieces of one token by every count (the engine's, the meters' estimate), each
    /// distinct, so a token lost or repeated shows in the text.
    const ANSWER: [&str; 6] = [" The", " cache", " is", " warm", ",", " so"];
    /// The completions prompt (a continuation's carries the generated text after it).
    const PROMPT: &str = "Once";

    /// Segment `segment`'s stream of the answer from its token `from` on, event by event, with
    /// vLLM's fields (its own chunk id and creation time; a chat's opens with the role): the
    /// tokens, the finish reason, the usage, `[DONE]`. Event `i` ends with `endings[i % len]`
    /// (its data line's line ending, then the empty line's).
    fn answer(endpoint: Endpoint, segment: u32, from: usize, endings: &[&str]) -> Vec<String> {
        let chat = endpoint == Endpoint::ChatCompletions;
        let object = if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let chunk = |choices: Value| {
            json!({"id": format!("cmpl-{segment}"), "object": object, "created": 7 + segment,
                   "model": "m", "choices": choices})
        };
        let piece = |text: &str, finish: Value| {
            let generated = if chat {
                json!({"index": 0, "delta": {"content": text}})
            } else {
                json!({"index": 0, "text": text})
            };
            let mut choice = generated;
            choice["logprobs"] = Value::Null;
            choice["finish_reason"] = finish;
            chunk(json!([choice]))
        };
        let mut events = Vec::new();
        if chat {
            let role = json!({"role": "assistant", "content": ""});
            let choice =
                json!({"index": 0, "delta": role, "logprobs": null, "finish_reason": null});
            events.push(chunk(json!([choice])));
        }
        events.extend(ANSWER[from..].iter().map(|t| piece(t, Value::Null)));
        events.push(piece("", json!("stop")));
        let mut usage = chunk(json!([]));
        let prompt = 9 + from;
        usage["usage"] = json!({"prompt_tokens": prompt, "completion_tokens": ANSWER.len() - from,
                                "total_tokens": prompt + ANSWER.len() - from});
        events.push(usage);
        let data = events.iter().map(Value::to_string).chain(["[DONE]".into()]);
        data.enumerate()
            .map(|(i, d)| format!("data: {d}{}", endings[i % endings.len()]))
            .collect()
    }

    /// An engine that continues the answer: after the text a continuation carries (the chat's
    /// final message, or what follows the prompt) it streams the rest, as segment 1; a text
    /// that is not the answer's first tokens gets a 400. Its URL.
    async fn continuing_engine(endpoint: Endpoint, endings: &'static [&'static str]) -> String {
        let continues = move |axum::Json(body): axum::Json<Value>| async move {
            let text = match endpoint {
                Endpoint::Completions => {
                    body["prompt"].as_str().and_then(|p| p.strip_prefix(PROMPT))
                }
                _ => body["messages"]
                    .as_array()
                    .and_then(|m| m.last()?["content"].as_str()),
            };
            match (0..=ANSWER.len()).find(|&k| text == Some(ANSWER[..k].concat().as_str())) {
                Some(from) => {
                    let stream = answer(endpoint, 1, from, endings).concat();
                    ([(header::CONTENT_TYPE, EVENT_STREAM)], stream).into_response()
                }
                None => StatusCode::BAD_REQUEST.into_response(),
            }
        };
        serve(axum::Router::new().route(endpoint.path(), axum::routing::post(continues))).await
    }

    /// What the client reads of `stream` (its events one chunk each) preempted once its first
    /// `cut` bytes were read, and resumed on `engine`; the pump is done when it returns. A
    /// stream that cannot be resumed runs on to its end. `at` names the request (its ledger
    /// record's request id).
    async fn preempted_at(
        rig: &Rig,
        (endpoint, at): (Endpoint, &str),
        stream: &[String],
        cut: usize,
        engine: &str,
    ) -> Vec<u8> {
        let mut flight = flight(rig, false);
        flight.who.request_id = at.to_owned();
        (flight.endpoint, flight.meter) = (endpoint, StreamMeter::new(endpoint, false));
        let (preempt, preempted) = oneshot::channel();
        flight.assignment = Assignment::for_tests(rig.app.events.clone(), 110, Some(preempted));
        let body = match endpoint {
            Endpoint::Completions => json!({"model": "m", "prompt": PROMPT, "stream": true}),
            _ => json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                        "stream": true}),
        };
        flight.continuation = Some(Continuation {
            body,
            trace_id: None,
            splice: Splice::new(Default::default()),
        });
        let mut next = Assignment::for_tests(rig.app.events.clone(), 110, None);
        next.url = engine.to_owned();
        let (requeue, requeued) = oneshot::channel();
        assert!(requeue.send(Ok(next)).is_ok());
        let mut chunks = Vec::new();
        let mut start = 0;
        for event in stream.iter().map(String::as_bytes) {
            let read = event.get(..cut.saturating_sub(start)).unwrap_or(event);
            if !read.is_empty() {
                chunks.push(Ok(Bytes::copy_from_slice(read)));
            }
            start += event.len();
        }
        let rest = Bytes::from(stream.concat()).slice(cut..);
        let preempting = futures::stream::once(async move {
            let _ = preempt.send(requeued);
            // The pump takes the word before it reads on: the rest is for a stream that runs on.
            tokio::task::yield_now().await;
            Ok(rest)
        });
        let upstream: Upstream = Box::pin(futures::stream::iter(chunks).chain(preempting));
        let (tx, mut client) = mpsc::channel(1);
        let pump = tokio::spawn(pump(flight, upstream, tx, TokioInstant::now() + LONG));
        let (got, how) = read_all(&mut client).await;
        pump.await.unwrap();
        assert_eq!(how, "end", "{at}: {}", String::from_utf8_lossy(&got));
        got
    }

    /// The data of each event a client's parser dispatches from `stream` (the HTML standard's
    /// reading: a line ends at CRLF, LF or CR, an empty line dispatches the data lines before
    /// it), and whether the stream ends between events, not inside one.
    fn dispatched(stream: &[u8]) -> (Vec<String>, bool) {
        let text = String::from_utf8_lossy(stream)
            .replace("\r\n", "\n")
            .replace('\r', "\n");
        let mut lines: Vec<&str> = text.split('\n').collect();
        let unended = lines.pop().unwrap_or_default();
        let (mut events, mut data) = (Vec::new(), String::new());
        for line in lines {
            if line.is_empty() {
                events.extend(data.strip_suffix('\n').map(str::to_owned));
                data.clear();
            } else if let Some(value) = line.strip_prefix("data:") {
                data.push_str(value.strip_prefix(' ').unwrap_or(value));
                data.push('\n');
            }
        }
        (events, unended.is_empty() && data.is_empty())
    }

    /// A batch stream preempted at every byte of a realistic stream, each API's, in each
    /// framing an engine may use: the client gets whole events only (a read ending between
    /// `data: …\n` and its empty line, when the stream was preempted, joined the next segment's
    /// first line into a half event), every token once, and the client's usage chunk, the
    /// ledger and the filter's meter (reading what the client got) all bill the tokens the
    /// client received.
    #[tokio::test]
    async fn a_stream_preempted_at_any_byte_reaches_the_client_as_whole_events_billed_as_received()
    {
        const FRAMINGS: [&[&str]; 3] = [
            &["\n\n"],
            &["\r\n\r\n"],
            &["\r\n\n", "\n\r\n", "\r\r", "\r\n\r\n", "\n\n"],
        ];
        let rig = rig(5_000);
        let n = ANSWER.len() as u64;
        let mut cuts = 0;
        for endpoint in [Endpoint::ChatCompletions, Endpoint::Completions] {
            for endings in FRAMINGS {
                let engine = continuing_engine(endpoint, endings).await;
                let stream = answer(endpoint, 0, 0, endings);
                for cut in 0..=stream.concat().len() {
                    let at = format!("{} {endings:?} cut at {cut}", endpoint.name());
                    let got = preempted_at(&rig, (endpoint, &at), &stream, cut, &engine).await;
                    let (events, whole) = dispatched(&got);
                    let got = String::from_utf8_lossy(&got);
                    assert!(whole, "{at}: the stream ends inside an event: {got:?}");
                    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{at}");
                    let (mut text, mut ids, mut roles, mut usage) =
                        (String::new(), Vec::new(), 0, Vec::new());
                    for data in &events[..events.len() - 1] {
                        let chunk: Value = serde_json::from_str(data).unwrap_or_else(|e| {
                            panic!("{at}: a half event ({e}): {data:?} in {got:?}")
                        });
                        ids.push((chunk["id"].clone(), chunk["created"].clone()));
                        for choice in chunk["choices"].as_array().unwrap() {
                            let delta = &choice["delta"];
                            roles += usize::from(!delta["role"].is_null());
                            text.push_str(
                                delta["content"]
                                    .as_str()
                                    .or(choice["text"].as_str())
                                    .unwrap_or_default(),
                            );
                        }
                        usage.extend(chunk["usage"]["completion_tokens"].as_u64());
                    }
                    assert_eq!(
                        text,
                        ANSWER.concat(),
                        "{at}: tokens lost or repeated: {got:?}"
                    );
                    ids.dedup();
                    assert_eq!(ids.len(), 1, "{at}: one stream's chunks: {ids:?}");
                    let role = usize::from(endpoint == Endpoint::ChatCompletions);
                    assert_eq!(roles, role, "{at}: {got:?}");
                    assert_eq!(usage, [n], "{at}: the usage the client gets");
                    let mut filter = StreamMeter::new(endpoint, false);
                    filter.meter(got.as_bytes(), true);
                    assert_eq!(filter.usage().map(|u| u.completion_tokens), Some(n), "{at}");
                    assert_eq!(
                        filter.generated_tokens(),
                        n,
                        "{at}: the tokens the client got"
                    );
                    cuts += 1;
                }
            }
        }
        let billed = records(&rig);
        assert_eq!(billed.len(), cuts, "one record each");
        for (at, outcome, completion) in billed {
            assert_eq!(
                (outcome.as_str(), completion),
                ("ok", n),
                "{at}: the ledger"
            );
        }
    }
}
