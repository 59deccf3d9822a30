//! The last event of a stream that weir ends itself (a replica lost mid-stream, the stream's
//! deadline, a client too slow to read, the shutdown grace period), in the event shape of the
//! API that was streaming, so the client's SDK reports an error rather than a cut connection:
//! an error chunk and `[DONE]` for Chat Completions and Completions, an `error` event for the
//! Responses API, Anthropic's `error` event for Messages ([`reply::stream_error_event`]).

use axum::body::Bytes;
use weir_core::endpoint::Endpoint;
use weir_core::error::ApiError;
use weir_core::reply;

/// Why weir ended a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    LostReplica,
    Deadline,
    Shutdown,
    SlowClient,
    /// Preempted for interactive work, and not dispatched again (no replica took it).
    NotResumed,
}

impl Ending {
    fn error(self) -> ApiError {
        let (status, code, message) = match self {
            Ending::LostReplica => (
                503,
                "replica_lost",
                "the engine replica failed mid-stream; the partial answer was billed as streamed",
            ),
            Ending::Deadline => (
                408,
                "stream_deadline",
                "the stream reached the gateway's longest stream duration and was ended; the \
                 partial answer was billed as streamed",
            ),
            Ending::Shutdown => (
                503,
                "shutting_down",
                "the gateway's scheduler restarted mid-stream; the partial answer was billed as \
                 streamed",
            ),
            Ending::SlowClient => (
                408,
                "slow_client",
                "the stream was read too slowly and was ended to free the engine; the partial \
                 answer was billed as streamed",
            ),
            Ending::NotResumed => (
                503,
                "preempted",
                "the batch stream was preempted for interactive work and could not be resumed; \
                 the partial answer was billed as streamed; retry",
            ),
        };
        ApiError::new(status, message).with_code(code)
    }

    /// The closing event in `endpoint`'s stream shape.
    pub fn event(self, endpoint: Endpoint) -> Bytes {
        Bytes::from(reply::stream_error_event(endpoint, &self.error()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weir_core::meter::StreamMeter;

    #[test]
    fn each_api_s_meter_reads_weir_s_closing_event_as_an_error() {
        for endpoint in Endpoint::ALL {
            let mut meter = StreamMeter::new(endpoint, false);
            meter.feed(&Ending::LostReplica.event(endpoint), true);
            assert_eq!(meter.error_events(), 1, "{endpoint:?}");
        }
    }
}
