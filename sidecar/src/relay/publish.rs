//! The settled attempt's figures: weir's per-tenant counters and the GenAI conventions'
//! instruments.

use crate::metrics::{Labels, gen_ai};
use crate::relay::flight::Flight;
use crate::relay::meter::Bill;
use crate::replica::engine::Dialect;
use crate::support::clock::now_ms;
use weir_core::outcome;

impl Flight {
    /// The settled attempt's figures: weir's per-tenant counters and the GenAI conventions'
    /// instruments (tokens only for attempts that ran, latencies only for successful ones).
    pub(super) fn publish(&self, outcome: &str, bill: &Bill) {
        let (prompt, completion) = (bill.prompt, bill.completion);
        let (m, figures) = (&self.app.metrics, &self.figures);
        let tenant = m.tenant(&self.who.tenant);
        m.tokens
            .inc_by(&[("tenant", tenant), ("direction", "in")], prompt);
        m.tokens
            .inc_by(&[("tenant", tenant), ("direction", "out")], completion);
        let ok = outcome::completed(outcome);
        if ok && now_ms() <= figures.deadline_ms {
            let labels: Labels = &[("pool", &self.model), ("tier", &self.who.tier)];
            m.goodput_tokens.inc_by(labels, prompt + completion);
        }
        let operation = gen_ai::operation(self.endpoint);
        let attributes = [
            (gen_ai::OPERATION, operation),
            (
                gen_ai::PROVIDER,
                Dialect::provider(self.hold.assignment.dialect),
            ),
            (gen_ai::REQUEST_MODEL, self.model.as_str()),
            (gen_ai::TENANT, tenant),
        ];
        if bill.ran {
            for (kind, n) in [("input", prompt), ("output", completion)] {
                let mut labels = attributes.to_vec();
                labels.push((gen_ai::TOKEN_TYPE, kind));
                m.gen_ai.token_usage.observe(&labels, n as f64);
            }
        }
        let duration = figures.arrived.elapsed().as_secs_f64();
        if ok {
            m.gen_ai.request_duration.observe(&attributes, duration);
        } else {
            let mut labels = attributes.to_vec();
            labels.push((gen_ai::ERROR_TYPE, outcome));
            m.gen_ai.request_duration.observe(&labels, duration);
        }
        if let (true, Some(first)) = (ok, figures.first_chunk) {
            let ttft = first.duration_since(figures.arrived).as_secs_f64();
            m.gen_ai.time_to_first_token.observe(&attributes, ttft);
            if completion > 1 {
                let after = first.elapsed().as_secs_f64() / (completion - 1) as f64;
                m.gen_ai.time_per_output_token.observe(&attributes, after);
            }
        }
    }
}
