//! The ledger record: one per attempt, priced where the tenant has prices (its spend counted
//! in the metrics too), with the run it belongs to and the tool calls its answer made.

use crate::ledger::UsageRecord;
use crate::metrics::Labels;
use crate::relay::flight::Flight;
use crate::relay::meter::Bill;
use crate::support::clock::now_ms;

impl Flight {
    /// Writes the attempt's record to the ledger.
    pub(super) fn record(&self, outcome: &str, bill: &Bill, attempt: u32) {
        let finished_at_ms = now_ms();
        let took_ms = u64::try_from(self.figures.arrived.elapsed().as_millis()).unwrap_or(u64::MAX);
        let record = UsageRecord {
            idempotency_key: (self.who.idempotency_key.clone())
                .unwrap_or_else(|| self.who.request_id.clone()),
            attempt,
            request_id: self.who.request_id.clone(),
            tenant: self.who.tenant.clone(),
            model: self.model.clone(),
            api: self.endpoint.name().to_owned(),
            replica: self.hold.assignment.url.clone(),
            prompt_tokens: bill.prompt,
            completion_tokens: bill.completion,
            source: bill.source.into(),
            outcome: outcome.into(),
            cached_prompt_tokens: bill.cached,
            queued_ms: self.hold.assignment.queued_ms,
            finished_at_ms,
            started_at_ms: Some(finished_at_ms.saturating_sub(took_ms)),
            route: self.who.route.clone(),
            mode: self.who.mode.clone(),
            run_id: self.who.run_id.clone(),
            agent_id: self.who.agent.clone(),
            tool_calls: bill.tool_calls,
            ..UsageRecord::default()
        };
        let prices = self.who.prices.as_ref();
        let price = prices.and_then(|p| Some((&p.currency, p.of(&record.model)?)));
        let record = match price {
            Some((currency, price)) => record.priced(currency, price),
            None => record,
        };
        if let (Some(cost), Some(currency)) = (record.cost_micros, &record.currency) {
            let tenant = self.app.metrics.tenant(&self.who.tenant);
            let labels: Labels = &[("tenant", tenant), ("currency", currency)];
            self.app.metrics.spend.inc_by(labels, cost);
        }
        self.app.ledger.record(record);
    }
}
