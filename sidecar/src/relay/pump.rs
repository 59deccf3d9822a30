//! The pump: a task that reads the replica's stream and hands it to the response body through
//! a one-chunk channel, gathering what the client has not taken yet, and ends the stream
//! (settling the flight) when the replica ends or fails, the client leaves or stalls, the
//! stream's time is up, the grace period ends, or a preempted stream cannot go on.

use std::pin::{Pin, pin};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, header};
use axum::response::Response;
use bytes::BytesMut;
use futures::{Stream, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tokio::time::{Instant as TokioInstant, Sleep};

use crate::dispatch::Requeued;
use crate::relay::body::{Delivery, Piece, deliver};
use crate::relay::engine::{EVENT_STREAM, Upstream};
use crate::relay::flight::Flight;
use crate::relay::grace::cut;
use crate::relay::preemption::{Resumed, preempted, resumed};
use crate::relay::stream_end::Ending;
use crate::relay::watch::{Lapse, Watch};
use weir_core::outcome;

/// Most bytes the pump holds for a client that has not taken the last chunk yet. What the
/// replica sends meanwhile goes out as one chunk, one write for many events (the slower the
/// client, the larger the batch); past this the pump stops reading, and the replica's stream
/// waits on the client.
pub(super) const MAX_PENDING_BYTES: usize = 16 * 1024;

/// The streamed answer: its body is what the pump relays from `upstream` until `deadline`.
pub(super) fn streaming(flight: Flight, upstream: Upstream, deadline: TokioInstant) -> Response {
    let body = Body::from_stream(relay_stream(flight, upstream, deadline));
    let mut resp = Response::new(body);
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(EVENT_STREAM));
    resp
}

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

/// What the pump does after one of its waits.
enum Next {
    /// Relays on.
    Relay,
    /// Ends the stream early with weir's closing event (the flight is settled).
    Close(Ending),
    /// Done: the flight is settled and the client has had all it gets.
    Stop,
}

/// The pump's state between its waits.
struct Pumping {
    flight: Flight,
    watch: Watch,
    stall: Duration,
    /// What the replica sent that the client has not taken yet.
    pending: BytesMut,
    /// Whether a chunk came since the replica's connection last had a turn.
    gathering: bool,
}

/// Relays the replica's stream to the body channel until it ends, the client leaves or stalls,
/// or the stream's time (`deadline`, counted from dispatch) is up; settles the flight on every
/// path.
pub(super) async fn pump(
    mut flight: Flight,
    mut upstream: Upstream,
    tx: mpsc::Sender<Piece>,
    deadline: TokioInstant,
) {
    // The headers go to the client with the first bytes: from here the filter meters a stream.
    flight.meter.streamed = true;
    let app = flight.app.clone();
    let stall = Duration::from_millis(app.relay.load().client_stall_ms);
    let mut preemption = flight.hold.assignment.take_preemption();
    let mut p = Pumping {
        flight,
        watch: Watch::new(stall, TokioInstant::now()),
        stall,
        pending: BytesMut::new(),
        gathering: false,
    };
    let timer = tokio::time::sleep_until(p.watch.next_check());
    let (mut timer, mut closed) = (pin!(timer), pin!(tx.closed()));
    let (mut deadline, mut cut) = (pin!(tokio::time::sleep_until(deadline)), pin!(cut(&app)));
    let ending = loop {
        let reading = p.pending.len() < MAX_PENDING_BYTES;
        let next = tokio::select! {
            biased;
            () = &mut closed => p.settled(outcome::CANCELLED),
            () = &mut cut => p.closed("shutdown", Ending::Shutdown),
            () = &mut deadline => p.closed("stream_deadline", Ending::Deadline),
            () = &mut timer => p.lapsed(reading, timer.as_mut()),
            requeued = preempted(&mut preemption) => {
                let resume = (&mut upstream, &mut preemption);
                p.preempted(requeued, resume, &tx, deadline.deadline()).await
            }
            next = upstream.next(), if reading => match next {
                Some(Ok(chunk)) => p.chunk(&chunk, timer.as_mut()),
                None => p.complete(&tx).await,
                Some(Err(_)) => p.lost_replica(),
            },
            // The replica's connection hands its events over one at a time: it gets a turn to
            // hand over what it has already read before the pending bytes go out, so a burst
            // of events is one write to the client, not one each.
            () = tokio::task::yield_now(), if p.gathering => {
                p.gathering = false;
                Next::Relay
            }
            permit = tx.reserve(), if !p.gathering && !p.pending.is_empty() => {
                if let Ok(permit) = permit {
                    permit.send(Piece::Chunk(p.pending.split().freeze()));
                    p.watch.caught_up(TokioInstant::now());
                }
                Next::Relay
            }
        };
        match next {
            Next::Relay => {}
            Next::Close(ending) => break ending,
            Next::Stop => return,
        }
    };
    // The stream ends early: what was pending, then weir's closing event.
    drop(upstream);
    p.pending
        .extend_from_slice(&ending.event(p.flight.endpoint));
    deliver(&tx, Piece::Last(p.pending.freeze()), stall).await;
}

impl Pumping {
    /// Settles the flight; the client gets nothing more.
    fn settled(&mut self, outcome: &str) -> Next {
        self.flight.finish(outcome, None);
        Next::Stop
    }

    /// Settles the flight; the client gets weir's closing event.
    fn closed(&mut self, outcome: &str, ending: Ending) -> Next {
        self.flight.finish(outcome, None);
        Next::Close(ending)
    }

    /// The timer fired: ends the stream if the replica or the client lapsed, else sets it for
    /// the next check.
    fn lapsed(&mut self, reading: bool, timer: Pin<&mut Sleep>) -> Next {
        match self.watch.lapsed(TokioInstant::now(), reading) {
            Some(Lapse::Client) => self.settled("slow_client"),
            Some(Lapse::Replica) => self.lost_replica(),
            None => {
                timer.reset(self.watch.next_check());
                Next::Relay
            }
        }
    }

    /// The replica failed mid-stream (an error, or silent past the idle timeout): the
    /// dispatcher is told and the attempt settled.
    fn lost_replica(&mut self) -> Next {
        self.flight.replica_failed(None);
        Next::Close(Ending::LostReplica)
    }

    /// A chunk from the replica: spliced, metered, and pending for the client.
    fn chunk(&mut self, chunk: &Bytes, timer: Pin<&mut Sleep>) -> Next {
        let now = TokioInstant::now();
        self.watch.replica_since = now;
        let chunk = self.flight.splice(chunk);
        let chunk = if chunk.is_empty() {
            chunk
        } else {
            self.flight.observe(&chunk)
        };
        if !chunk.is_empty() {
            // The client's limit may come before the check the timer is set for.
            if let Some(due) = self.watch.client_waits(now)
                && due < timer.deadline()
            {
                timer.reset(due);
            }
            self.pending.extend_from_slice(&chunk);
            self.gathering = true;
        }
        Next::Relay
    }

    /// The replica ended its stream: the rest is metered, the flight settled, and what was
    /// pending delivered before the end.
    async fn complete(&mut self, tx: &mpsc::Sender<Piece>) -> Next {
        let flight = &mut self.flight;
        let spliced = flight.splice_rest();
        if !spliced.is_empty() {
            self.pending.extend_from_slice(&flight.observe(&spliced));
        }
        self.pending.extend_from_slice(&flight.drain());
        let outcome = flight.meter.ended_outcome();
        flight.finish(outcome, None);
        if self.deliver_pending(tx).await {
            deliver(tx, Piece::End, self.stall).await;
        }
        Next::Stop
    }

    /// Delivers what is pending, if anything; whether the client took it (if not, the flight
    /// is settled).
    async fn deliver_pending(&mut self, tx: &mpsc::Sender<Piece>) -> bool {
        if self.pending.is_empty() {
            return true;
        }
        let chunk = Piece::Chunk(self.pending.split().freeze());
        match deliver(tx, chunk, self.stall).await {
            Delivery::Taken => true,
            Delivery::ClientGone => {
                self.flight.finish(outcome::CANCELLED, None);
                false
            }
            Delivery::ClientStalled => {
                self.flight.finish("slow_client", None);
                false
            }
        }
    }

    /// The dispatcher preempted the stream: unless it streamed what a continuation would not
    /// reproduce (then it runs on), the upstream request is aborted, the hold given back and
    /// what was pending delivered, and the stream resumed on its next replica
    /// ([`resumed`]) — its next segment read from then on — or ended.
    async fn preempted(
        &mut self,
        requeued: Requeued,
        (upstream, preemption): (&mut Upstream, &mut Option<oneshot::Receiver<Requeued>>),
        tx: &mpsc::Sender<Piece>,
        deadline: TokioInstant,
    ) -> Next {
        let flight = &mut self.flight;
        if !flight
            .continuation
            .as_ref()
            .is_some_and(|c| c.splice.resumable())
        {
            return Next::Relay;
        }
        // Dropped, the upstream request is aborted (the engine frees the sequence).
        *upstream = Box::pin(futures::stream::empty());
        flight.hold.assignment.release();
        if !self.deliver_pending(tx).await {
            return Next::Stop;
        }
        match resumed(&mut self.flight, requeued, tx, deadline).await {
            Resumed::Streaming(next) => {
                *upstream = next;
                *preemption = self.flight.hold.assignment.take_preemption();
                self.watch.caught_up(TokioInstant::now());
                Next::Relay
            }
            Resumed::Ended(ending) => {
                if let Some(ending) = ending {
                    let last = Piece::Last(ending.event(self.flight.endpoint));
                    deliver(tx, last, self.stall).await;
                }
                Next::Stop
            }
        }
    }
}
