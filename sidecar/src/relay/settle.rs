//! Settlement, once per attempt on every path: the bill taken from the meter, the KV given
//! back and what was left charged, the prediction taught, the figures published
//! ([`crate::relay::publish`]), the idempotency claim settled and the ledger record written
//! ([`crate::relay::record`]).

use weir_core::meter::BodyUsage;

use crate::relay::engine::EVENT_STREAM;
use crate::relay::flight::Flight;
use crate::relay::meter::Bill;
use weir_core::outcome;

impl Flight {
    /// Settles once: gives the KV back, charges what was left, writes the ledger record,
    /// settles the idempotency claim.
    pub fn finish(&mut self, outcome: &str, body_usage: Option<BodyUsage>) {
        self.finish_with(outcome, body_usage, (200, EVENT_STREAM));
    }

    /// [`finish`](Self::finish), with the status and content type of what the client got, for
    /// a replay of completed work.
    pub(super) fn finish_with(
        &mut self,
        outcome: &str,
        body_usage: Option<BodyUsage>,
        (status, content_type): (u16, &'static str),
    ) {
        if self.settled.is_some() {
            return;
        }
        let bill = self.meter.bill(body_usage, self.input_tokens);
        self.settled = Some(bill);
        self.give_back(&bill);
        if outcome::completed(outcome) && bill.ran && self.learning.uncapped {
            let at = (self.who.tenant.as_str(), self.hold.assignment.pool);
            (self.learning).teach(&self.app, at, &self.model, bill.completion);
        }
        self.publish(outcome, &bill);
        let attempt = self.capture.attempt();
        self.capture
            .settle(outcome::completed(outcome), status, content_type);
        self.record(outcome, &bill, attempt);
    }

    /// The hold's last accounts: the engine's prompt count, what was left to charge, then
    /// the KV given back.
    fn give_back(&mut self, bill: &Bill) {
        if bill.source == "engine" {
            self.reconcile(bill.prompt);
        }
        self.charge(bill.completion);
        self.hold.assignment.release();
    }
}
