//! Streaming a dispatched request to its replica and the answer back.
//!
//! Chunks are passed on as they arrive; hyper pulls the next one only when the client has taken
//! the last, so a slow client slows its own upstream read instead of growing a buffer. A client
//! that leaves drops the stream, which drops the upstream request: the engine aborts and frees
//! the KV. A replica that dies mid-stream ends the stream with an OpenAI-shaped error event.
//! Every path ends in [`Flight::finish`]: one ledger record, KV given back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use weir_core::meter::{BodyMeter, BodyUsage, StreamMeter};
use weir_core::openai::ApiError;

use crate::dispatcher::{Assignment, Event, now_ms};
use crate::ledger::UsageRecord;
use crate::metrics::tenant;
use crate::server::{App, Trusted, error_response};

/// Longest silence from a replica before the stream is declared lost.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Output tokens charged to the scheduler in batches of this many.
const CHARGE_EVERY: u64 = 16;

/// A request from dispatch to settlement.
pub struct Flight {
    app: Arc<App>,
    who: Trusted,
    model: String,
    assignment: Assignment,
    kv_need: u64,
    arrived: Instant,
    meter: StreamMeter,
    last_chunk: Option<Instant>,
    charged: u64,
    finished: bool,
}

impl Flight {
    pub fn new(
        app: Arc<App>,
        who: Trusted,
        model: String,
        assignment: Assignment,
        kv_need: u64,
        arrived: Instant,
    ) -> Flight {
        Flight {
            app,
            who,
            model,
            assignment,
            kv_need,
            arrived,
            meter: StreamMeter::new(false),
            last_chunk: None,
            charged: 0,
            finished: false,
        }
    }

    /// Meters a chunk on its way to the client.
    fn observe(&mut self, chunk: &[u8]) {
        let now = Instant::now();
        let labels = tenant(&self.who.tenant);
        match self.last_chunk {
            None => self
                .app
                .metrics
                .ttft
                .get_or_create(&labels)
                .observe(self.arrived.elapsed().as_secs_f64()),
            Some(prev) => self
                .app
                .metrics
                .itl
                .get_or_create(&labels)
                .observe((now - prev).as_secs_f64()),
        }
        self.last_chunk = Some(now);
        self.meter.feed(chunk, false);
        let served = self.meter.generated_tokens();
        if served - self.charged >= CHARGE_EVERY {
            self.charge(served);
        }
    }

    fn charge(&mut self, served: u64) {
        if served > self.charged {
            let _ = self.app.events.send(Event::Served {
                tenant: self.who.tenant.clone(),
                output_tokens: served - self.charged,
            });
            self.charged = served;
        }
    }

    /// Settles once: gives the KV back, charges what was left, writes the ledger record.
    pub fn finish(&mut self, outcome: &str, body_usage: Option<BodyUsage>) {
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
        let (prompt, completion, source) = match reported {
            Some(u) => (u.prompt_tokens, u.completion_tokens, "engine"),
            None => (self.who.input_tokens, counted, "counted"),
        };
        self.charge(completion);
        let _ = self.app.events.send(Event::Finished {
            pool: self.assignment.pool,
            replica: self.assignment.replica,
            tenant: self.who.tenant.clone(),
            kv_need: self.kv_need,
        });
        let m = &self.app.metrics;
        let labels = |dir: &str| {
            vec![
                ("tenant", self.who.tenant.clone()),
                ("direction", dir.to_owned()),
            ]
        };
        m.tokens.get_or_create(&labels("in")).inc_by(prompt);
        m.tokens.get_or_create(&labels("out")).inc_by(completion);
        if outcome == "ok" && now_ms() <= self.who.deadline_ms {
            m.goodput_tokens
                .get_or_create(&vec![("tier", self.who.tier.clone())])
                .inc_by(prompt + completion);
        }
        self.app.ledger.record(UsageRecord {
            request_id: self.who.request_id.clone(),
            tenant: self.who.tenant.clone(),
            model: self.model.clone(),
            replica: self.assignment.url.clone(),
            prompt_tokens: prompt,
            completion_tokens: completion,
            source: source.into(),
            outcome: outcome.into(),
            queued_ms: self.assignment.queued_ms,
            finished_at_ms: now_ms(),
        });
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        // Dropped unfinished: the client went away mid-stream.
        self.finish("cancelled", None);
    }
}

/// Sends the request to its replica and relays the answer.
pub async fn relay(mut flight: Flight, path: &str, body: Vec<u8>, stream: bool) -> Response {
    let url = format!("{}{path}", flight.assignment.url);
    let sent = flight
        .app
        .http
        .post(url)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .send()
        .await;
    let upstream = match sent {
        Ok(resp) => resp,
        Err(e) => {
            tracing::warn!(replica = %flight.assignment.url, "replica unreachable: {e}");
            let _ = flight.app.events.send(Event::ReplicaFailed {
                pool: flight.assignment.pool,
                replica: flight.assignment.replica,
            });
            flight.finish("failed", Some(BodyUsage::Unknown));
            return error_response(&ApiError::new(
                502,
                "ServiceUnavailableError",
                "the engine replica could not be reached; retry",
            ));
        }
    };
    let status =
        StatusCode::from_u16(upstream.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    if !status.is_success() || !stream {
        let bytes = upstream.bytes().await;
        let outcome = if status.is_success() {
            "ok"
        } else {
            "upstream_error"
        };
        return match bytes {
            Ok(bytes) => {
                let mut meter = BodyMeter::new(usize::MAX);
                meter.feed(&bytes);
                flight.finish(outcome, Some(meter.finish()));
                let mut resp = (status, bytes).into_response();
                resp.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                resp
            }
            Err(_) => {
                let _ = flight.app.events.send(Event::ReplicaFailed {
                    pool: flight.assignment.pool,
                    replica: flight.assignment.replica,
                });
                flight.finish("failed", Some(BodyUsage::Unknown));
                error_response(&ApiError::new(
                    502,
                    "ServiceUnavailableError",
                    "the engine replica failed mid-response; retry",
                ))
            }
        };
    }
    let body = Body::from_stream(relay_stream(flight, upstream.bytes_stream()));
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    resp
}

/// The final event of a stream whose replica died: OpenAI's error shape, then `[DONE]`.
fn lost_replica_event() -> Bytes {
    let err = ApiError::new(
        503,
        "ServiceUnavailableError",
        "the engine replica failed mid-stream; the partial answer was billed as streamed",
    )
    .to_json();
    Bytes::from(format!("data: {err}\n\ndata: [DONE]\n\n"))
}

fn relay_stream(
    flight: Flight,
    upstream: impl Stream<Item = reqwest::Result<Bytes>> + Send + Unpin + 'static,
) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send {
    futures::stream::unfold(Some((flight, upstream)), |state| async move {
        let (mut flight, mut upstream) = state?;
        match tokio::time::timeout(IDLE_TIMEOUT, upstream.next()).await {
            Ok(Some(Ok(chunk))) => {
                flight.observe(&chunk);
                Some((Ok(chunk), Some((flight, upstream))))
            }
            Ok(None) => {
                flight.finish("ok", None);
                None
            }
            Ok(Some(Err(_))) | Err(_) => {
                let _ = flight.app.events.send(Event::ReplicaFailed {
                    pool: flight.assignment.pool,
                    replica: flight.assignment.replica,
                });
                flight.finish("failed", None);
                Some((Ok(lost_replica_event()), None))
            }
        }
    })
}
