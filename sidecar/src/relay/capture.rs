//! Idempotency capture: the caller's key held by this attempt, and the response kept (up to a
//! bound) so a duplicate of completed work is answered with it rather than run again.

use axum::body::Bytes;

use crate::intake::idempotency::{Claim, StoredResponse};
use crate::support::clock::now_ms;

/// The claim on the caller's idempotency key, if it sent one, and the response so far.
pub struct Capture {
    claim: Option<Claim>,
    /// The response so far, kept for replays while the claim wants it and it fits.
    body: Option<Vec<u8>>,
}

impl Capture {
    pub(super) fn new(claim: Option<Claim>) -> Capture {
        Capture {
            body: claim.as_ref().map(|_| Vec::new()),
            claim,
        }
    }

    /// Keeps a copy of response bytes, up to `limit` in all (past it nothing is kept).
    pub(super) fn keep(&mut self, bytes: &[u8], limit: usize) {
        if let Some(buf) = &mut self.body {
            if buf.len() + bytes.len() > limit {
                self.body = None;
            } else {
                buf.extend_from_slice(bytes);
            }
        }
    }

    /// Which attempt at the key this is (the first, without a key).
    pub(super) fn attempt(&self) -> u32 {
        self.claim.as_ref().map_or(1, Claim::attempt)
    }

    /// Settles the claim: completed work (`ok`) leaves its response for replays, with the
    /// status and content type the client got.
    pub(super) fn settle(&mut self, ok: bool, status: u16, content_type: &'static str) {
        if let Some(claim) = &mut self.claim {
            let completed = ok.then(|| {
                self.body.take().map(|body| StoredResponse {
                    status,
                    content_type,
                    body: Bytes::from(body),
                })
            });
            claim.finish(completed, now_ms());
        }
    }
}
