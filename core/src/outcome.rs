//! How an attempt ended, in the words the filter's access record and metrics and the
//! sidecar's ledger and metrics both use: one classification, so a request reads the same at
//! both ends.

/// Completed work: the engine answered in full.
pub const OK: &str = "ok";
/// The engine answered with an error, or sent one in its stream.
pub const UPSTREAM_ERROR: &str = "upstream_error";
/// An answer cut short: a stream the engine closed without its end, or a body that broke.
pub const FAILED: &str = "failed";
/// The caller left before the answer ended.
pub const CANCELLED: &str = "cancelled";

/// An answer the upstream gave in full with `status`: only a 2xx is completed work (an error,
/// or a redirect, answers nothing the caller asked for).
pub fn of_answer(status: u16) -> &'static str {
    if (200..300).contains(&status) {
        OK
    } else {
        UPSTREAM_ERROR
    }
}

/// A stream the engine ended: an error event in it (an engine failing once the stream had
/// started) makes it an upstream error, and one closed without its end (`[DONE]`) failed.
/// Both are billed for what streamed but are not completed work.
pub fn of_stream(error_events: u64, saw_done: bool) -> &'static str {
    if error_events > 0 {
        UPSTREAM_ERROR
    } else if !saw_done {
        FAILED
    } else {
        OK
    }
}

/// Whether the attempt was completed work: what the output prediction learns from and what
/// an idempotency key may replay.
pub fn completed(outcome: &str) -> bool {
    outcome == OK
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_2xx_answer_is_completed_work() {
        assert_eq!(of_answer(200), OK);
        assert_eq!(of_answer(204), OK);
        for status in [0, 101, 302, 400, 429, 500, 503] {
            assert_eq!(of_answer(status), UPSTREAM_ERROR, "{status}");
        }
        assert!(completed(of_answer(200)) && !completed(of_answer(302)));
    }

    #[test]
    fn a_stream_is_completed_only_with_its_end_and_no_error_in_it() {
        assert_eq!(of_stream(0, true), OK);
        assert_eq!(of_stream(0, false), FAILED);
        assert_eq!(of_stream(1, true), UPSTREAM_ERROR);
        assert_eq!(of_stream(2, false), UPSTREAM_ERROR);
    }
}
