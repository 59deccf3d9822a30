//! Metering: what an attempt is billed. A stream is metered as it passes (and its usage chunk
//! held back when weir asked for it); a non-streamed answer read whole is metered from its
//! body; one nobody read is billed its bound, as the filter charges it; one that ran nothing
//! is billed nothing.

use axum::body::Bytes;
use weir_core::endpoint::Endpoint;
use weir_core::meter::{BodyUsage, StreamMeter};
use weir_core::outcome;

/// What the attempt is billed, and where the figures came from.
#[derive(Clone, Copy, Debug)]
pub struct Bill {
    pub prompt: u64,
    pub completion: u64,
    /// `engine` (its usage), `counted` (weir's count), or `bound` (an unread answer's).
    pub source: &'static str,
    pub cached: u64,
    /// Whether the engine ran anything for it: an attempt that ran nothing is billed nothing.
    pub ran: bool,
}

/// The attempt's meter, and how its answer is billed.
pub struct Meter {
    pub(super) stream: StreamMeter,
    hide_usage: bool,
    /// The answer counts as a stream, as the filter meters it: as the request asked until its
    /// first bytes go to the client (the filter meters by the request until it has the
    /// response's headers), then a stream. What was relayed of a stream is counted; a
    /// non-streamed answer is read whole or billed its bound.
    pub(super) streamed: bool,
    /// Output billed for its answer if nobody reads it.
    unread_output: u64,
    /// The request never reached the engine, the engine answered with an error status, or it
    /// never took a stream in (no headers by its first-byte deadline): it ran nothing, so
    /// nothing is billed.
    pub(super) nothing_ran: bool,
}

impl Meter {
    pub(super) fn new(endpoint: Endpoint, hide_usage: bool, unread_output: u64) -> Meter {
        Meter {
            stream: StreamMeter::new(endpoint, hide_usage),
            hide_usage,
            streamed: false,
            unread_output,
            nothing_ran: false,
        }
    }

    /// Meters a chunk; what the client gets of it (the usage chunk held back if weir asked
    /// for it).
    pub(super) fn feed(&mut self, chunk: &Bytes) -> Bytes {
        if self.hide_usage {
            Bytes::from(self.stream.feed(chunk, false))
        } else {
            self.stream.meter(chunk, false);
            chunk.clone()
        }
    }

    /// Meters what the meter still holds once the stream has ended; what of it the client
    /// has not had yet.
    pub(super) fn drain(&mut self) -> Bytes {
        let metered = self.stream.feed(&[], true);
        if !self.hide_usage {
            return Bytes::new();
        }
        Bytes::from(metered)
    }

    /// How a stream the engine ended went: an error event in it (an engine failing once the
    /// stream had started) makes it an `upstream_error`, and a stream closed without its
    /// `[DONE]` (an engine that died but closed the connection cleanly) `failed`. Both are
    /// billed for what streamed but are not completed work, so the key's retry runs instead of
    /// replaying a failure or a truncated answer.
    pub(super) fn ended_outcome(&self) -> &'static str {
        outcome::of_stream(self.stream.error_events(), self.stream.saw_done())
    }

    /// The bill: the engine's usage where it reported one (`body_usage` for an answer read
    /// whole, else the stream's), else weir's count, or an unread answer's bound.
    pub(super) fn bill(&self, body_usage: Option<BodyUsage>, input_tokens: u64) -> Bill {
        let reported = match body_usage {
            Some(BodyUsage::Reported(u)) => Some(u),
            Some(_) => None,
            None => self.stream.usage(),
        };
        let counted = match body_usage {
            Some(BodyUsage::Estimated { completion_tokens }) => completion_tokens,
            _ => self.stream.generated_tokens(),
        };
        let cached = reported.map_or(0, |u| u.cached_prompt_tokens);
        // A non-streamed answer the engine was working on that nobody read (the client left,
        // a deadline or shutdown cut it, it was too large): its bound, as the filter charges it.
        let unread = !self.streamed && body_usage.is_none();
        let (prompt, completion, source) = match reported {
            Some(u) => (u.prompt_tokens, u.completion_tokens, "engine"),
            // Nothing ran: the attempt is recorded, billed nothing (as the filter charges it).
            None if self.nothing_ran => (0, 0, "counted"),
            None if unread => (input_tokens, self.unread_output, "bound"),
            None => (input_tokens, counted, "counted"),
        };
        Bill {
            prompt,
            completion,
            source,
            cached,
            ran: !self.nothing_ran,
        }
    }
}
