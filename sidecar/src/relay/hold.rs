//! KV accounting: the attempt's hold on its replica (the assignment: KV and a slot), sized by
//! the prompt and what the engine has generated, and the output charged to the tenant's
//! counter in the dispatcher as it streams.

use weir_core::endpoint::Endpoint;

use crate::dispatch::{Assignment, Event};
use crate::intake::app::App;
use crate::metrics::Labels;

/// Output tokens charged to the scheduler in batches of this many.
const CHARGE_EVERY: u64 = 16;

/// The hold on the replica, and what the dispatcher has been told of it.
pub struct Hold {
    /// The hold itself: given back when the flight settles (or is dropped).
    pub(super) assignment: Assignment,
    /// The prompt part of the KV hold: the estimate, then the engine's count.
    prompt_held: u64,
    /// Output tokens charged to the tenant's counter so far.
    charged: u64,
    /// Whether the engine's prompt count has replaced the filter's estimate yet.
    reconciled: bool,
}

impl Hold {
    pub(super) fn new(assignment: Assignment, prompt_estimate: u64) -> Hold {
        Hold {
            assignment,
            prompt_held: prompt_estimate,
            charged: 0,
            reconciled: false,
        }
    }

    /// Whether enough output has streamed since the last charge to charge it.
    pub(super) fn charge_due(&self, served: u64) -> bool {
        served - self.charged >= CHARGE_EVERY
    }

    /// Charges `tenant` the output `served` so far that it was not charged yet; past its
    /// prediction, the hold follows what the replica really holds.
    pub(super) fn charge(&mut self, app: &App, tenant: &str, served: u64) {
        if served > self.charged {
            let _ = app.events.send(Event::Served {
                pool: self.assignment.pool,
                replica: self.assignment.replica,
                tenant: tenant.to_owned(),
                output_tokens: served - self.charged,
            });
            self.charged = served;
        }
        let used = self.prompt_held + served;
        if used > self.assignment.kv_held() {
            self.assignment.resize(used);
        }
    }

    /// Replaces the filter's prompt estimate with the engine's count, once: in the tenant's
    /// counter (an underestimate is charged in full) and in the KV held on the replica. The
    /// estimate's error is published per API.
    pub(super) fn reconcile(
        &mut self,
        app: &App,
        (tenant, endpoint): (&str, Endpoint),
        estimated: u64,
        prompt_tokens: u64,
    ) {
        if std::mem::replace(&mut self.reconciled, true) {
            return;
        }
        if estimated > 0 && prompt_tokens > 0 {
            let labels: Labels = &[("api", endpoint.name())];
            let ratio = estimated as f64 / prompt_tokens as f64;
            app.metrics.estimate_error.observe(labels, ratio);
        }
        if prompt_tokens == estimated {
            return;
        }
        let _ = app.events.send(Event::Reconciled {
            pool: self.assignment.pool,
            tenant: tenant.to_owned(),
            estimated,
            reported: prompt_tokens,
        });
        let output_part = self.assignment.kv_held().saturating_sub(estimated);
        self.assignment.resize(prompt_tokens + output_part);
        self.prompt_held = prompt_tokens;
    }
}
