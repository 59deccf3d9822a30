//! Retries at the front door, once the body is whole and before it is admitted: a call that
//! repeats one its key sent within the minute (its `Idempotency-Key`, or its caller's
//! `x-request-id` with the same body; [`weir_core::retry`]) is a retry. A retry that offers a
//! `side_effect` tool without an idempotency key is refused (409), and past the key's
//! `retries_per_minute` a retry is refused (429) with a `Retry-After` that grows with the
//! key's streak of refusals — before it takes any queue space upstream; first attempts are
//! never held to it. Either refusal gives back what the headers reserved, and is held back
//! before it is sent (`crate::tarpit`), so a client retrying with no backoff retries at most
//! once a hold.

use proxy_wasm::types::Action;
use weir_core::reply::Reply;
use weir_core::reservation::{self, Denial};
use weir_core::retry;
use weir_core::trusted;

use super::{Exchange, Host, Stage};
use crate::telemetry;

impl Exchange {
    /// Tells whether the call is a retry (marking it so for the run's `retries` budget), and
    /// refuses it if it may not go on: `None` to go on, else the action that ends it.
    pub(super) fn check_retry(&mut self, host: &impl Host, body: &[u8]) -> Option<Action> {
        let tenant = self.tenant.clone().filter(|t| retry::watched(t))?;
        // Sending a withheld call's request again for its approved call is how approval works,
        // not a retry: the sidecar answers it from the approval, no engine runs. Only a key
        // with approval tools has any to send again.
        let approves_calls = tenant.tools.approval_patterns().next().is_some();
        if self.approval_resend && approves_calls {
            return None;
        }
        self.endpoint?;
        let idempotency_key = (self.vouched.iter())
            .find(|(name, _)| *name == trusted::IDEMPOTENCY_KEY)
            .map(|(_, key)| key.clone());
        let (store, now) = (host.store(), host.now_ms());
        let request_id = self.caller_request_id.as_deref();
        let key_path = tenant.path();
        if !retry::is_retry(
            store,
            key_path,
            idempotency_key.as_deref(),
            request_id,
            body,
            now,
        ) {
            return None;
        }
        self.retry = true;
        if idempotency_key.is_none()
            && let Some(tool) = retry::side_effect_tool(&tenant, body)
        {
            let reply = self.error_reply(&retry::side_effect_retry(&tool));
            let reason = "side_effect_retry_requires_idempotency_key";
            return self.refuse_retry(host, reply, reason);
        }
        let denial = match reservation::charge_retry(store, &tenant, self.ledger(), now) {
            Ok(()) => {
                retry::admitted(store, key_path);
                return None;
            }
            Err(denial) => denial,
        };
        let reply = match denial {
            Denial::Limit { level, limit, .. } => {
                let wait = retry::retry_after_s(retry::refused(store, key_path, now));
                let mut reply = self.error_reply(&retry::budget_exceeded(&level, limit, wait));
                reply.headers.push(("retry-after", wait.to_string()));
                reply
            }
            other => Reply::denied(&other, self.shape, now),
        };
        if !self.shadow {
            telemetry::runs::retry_refused(host, &tenant);
        }
        self.refuse_retry(host, reply, "retry_budget_exceeded")
    }

    /// Refuses a retry, its reply held back (in shadow mode, noted and let go on).
    fn refuse_retry(
        &mut self,
        host: &impl Host,
        reply: Reply,
        reason: &'static str,
    ) -> Option<Action> {
        if let Some(action) = self.refusing(host, reason, Stage::AwaitingBody) {
            return (self.stage == Stage::Replied).then_some(action);
        }
        host.hold_reply(reply);
        Some(Action::Pause)
    }
}
