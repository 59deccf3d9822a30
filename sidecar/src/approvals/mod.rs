//! Tool calls held for an approver (DESIGN invariant 18, issue 30).
//!
//! A call to a tool of class `approval` is withheld from the client by the filter, which ends
//! the answer with `approval_required` naming [`weir_core::tools::approval_id`]. The sidecar
//! relaying that answer keeps the call ([`Approval`]) under the same id, stored **before** it
//! relays the event that completes the call, so the client's `approval_required` always
//! follows a stored record. An approver — a key whose `approves` scopes cover the calling
//! key's path, never the calling key itself unless [`Terms::self_approve`] — approves or
//! rejects it through weir's API (`/v1/weir/approvals`). The client then sends the same
//! request again with `weir-approval-id`, and gets the held call exactly as the model made it,
//! rendered in the re-send's API shape ([`render`]), without the engine running again and
//! without a ledger record (nothing is billed twice).
//!
//! An approval is bound to its tenant (the calling key's path), its run and its request's
//! body; it serves once ([`Approvals::take`] moves it from approved to delivered under one
//! lock). Unknown, expired, another tenant's and another run's ids are alike
//! (`approval_not_found`). Approvals live in this process's memory: a restart loses them (a
//! re-send then gets `approval_not_found`, and the client asks the model again).

mod render;
mod store;
#[cfg(test)]
mod tests;

pub use render::{DELIVERED, delivered};
pub use store::{Approval, Approvals, Approver, Claim, Decision, HeldCall, Refused, State, Terms};

use axum::http::{HeaderValue, header};
use axum::response::Response;
use serde_json::Value;
use sha2::{Digest, Sha256};
use weir_core::error::{ApiError, ErrorShape};

use crate::support::respond::error_response;

/// The header a client re-sends a request with to get its approved call.
pub const APPROVAL_ID: &str = "weir-approval-id";

/// How long a re-send of a pending approval is told to wait (`Retry-After`, seconds).
const PENDING_RETRY_AFTER_S: u64 = 5;

/// The fingerprint binding an approval to its request: SHA-256 of the body as received.
pub fn request_sha256(body: &[u8]) -> [u8; 32] {
    Sha256::digest(body).into()
}

impl Approvals {
    /// The answer to a re-send naming an approval: the approved call (delivered once), or
    /// why not. `request` is the re-send's body.
    pub fn redeem(
        &self,
        claim: Claim<'_>,
        request: &Value,
        now_ms: u64,
    ) -> Result<Response, ApiError> {
        let call = self.take(claim, now_ms).map_err(Refused::error)?;
        Ok(delivered(&call, claim.id, request, now_ms / 1000))
    }
}

impl Refused {
    /// The error a caller gets, OpenAI-shaped by default.
    pub fn error(self) -> ApiError {
        let (status, code, message) = match self {
            Refused::NotFound => (404, "approval_not_found", "no such approval"),
            Refused::Pending => (
                409,
                "approval_pending",
                "the tool call waits for an approver; send the request again later",
            ),
            Refused::Rejected => (
                403,
                "approval_rejected",
                "an approver rejected the tool call",
            ),
            Refused::Used => (
                409,
                "approval_used",
                "the approved tool call was delivered already; an approval serves once",
            ),
            Refused::Mismatch => (
                409,
                "approval_request_mismatch",
                "the request is not the one whose tool call was approved: send it unchanged",
            ),
            Refused::SelfApproval => (
                403,
                "self_approval_not_allowed",
                "a key may not approve or reject its own tool calls",
            ),
            Refused::Decided => (409, "approval_decided", "the approval was decided already"),
            Refused::Full => (
                429,
                "approval_capacity",
                "too many tool calls of this key wait for an approver",
            ),
        };
        // The code in Anthropic's shape too, which has no field of its own for it.
        ApiError::new(status, message)
            .with_code(code)
            .with_extra("code", code)
    }
}

/// An approval refusal as a response in `shape`; a pending one says when to ask again.
pub fn refusal_response(error: &ApiError, shape: ErrorShape) -> Response {
    let mut resp = error_response(error, shape, PENDING_RETRY_AFTER_S);
    if error.code == Some("approval_pending") {
        resp.headers_mut().insert(
            header::RETRY_AFTER,
            HeaderValue::from(PENDING_RETRY_AFTER_S),
        );
    }
    resp
}
