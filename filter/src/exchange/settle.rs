//! The end of an exchange: what the request used replaces its reservation (the engine's count
//! when it reported one, nothing when the upstream failed before serving, else what was seen
//! streaming past), the tenant's output history learns a predicted answer's length, and the
//! access log gets the request's record. `on_log` is the backstop: a request that ended without
//! its last chunk (client gone, upstream reset) settles there with what was seen.

use weir_core::endpoint::Endpoint;
use weir_core::meter::BodyUsage;
use weir_core::prediction;
use weir_core::price;
use weir_core::reservation::{self, Demand};

use super::{Exchange, Host, Meter, Stage};
use crate::Gateway;
use crate::telemetry::{self, AccessRecord};
use weir_core::outcome;

impl Exchange {
    /// Replaces the reservation with what was used: the engine's count when it reported one,
    /// nothing when the upstream failed before serving, else what was seen streaming past.
    pub(super) fn finish(&mut self, host: &impl Host, outcome: &'static str) {
        if matches!(
            self.stage,
            Stage::Done | Stage::Replied | Stage::Passthrough
        ) {
            return;
        }
        self.stage = Stage::Done;
        self.outcome = outcome;
        let (usage, measured) = self.measure(host);
        self.usage = usage;
        if self.replayed {
            // The same completed work is never charged twice, to quota either.
            self.usage = Demand::default();
        } else if outcome::completed(outcome) && measured {
            self.learn_output(host);
        }
        let ran = !self.replayed && (self.upstream_status < 400 || total(self.usage) > 0);
        self.settle_run(host, ran.then_some(self.usage));
        if let Some(r) = self.reservation.take() {
            if let Ok(mut in_flight) = self.gw.in_flight.try_borrow_mut() {
                in_flight.remove(&r.slot.id);
            }
            let conflicts = reservation::settle(host.store(), &r, self.usage, host.now_ms());
            host.add(telemetry::SETTLE_CONFLICTS, conflicts as i64);
            host.add(telemetry::RESERVED, -total(r.demand));
        }
        host.add(telemetry::TOKENS_IN, self.usage.input_tokens as i64);
        host.add(telemetry::TOKENS_OUT, self.usage.output_tokens as i64);
    }

    /// What the request used, priced, and whether the answer's length was read (from a report
    /// or a count, not the reservation).
    fn measure(&self, host: &impl Host) -> (Demand, bool) {
        let estimate = self.admitted.as_ref().map_or(0, |a| a.prompt_tokens);
        // A buffered body is parsed once, here, whatever it turns out to say.
        let body = match &self.meter {
            Meter::Body(m) => Some(m.finish()),
            _ => None,
        };
        let reported = match (&self.meter, body) {
            (Meter::Stream(m), _) => m.usage(),
            (_, Some(BodyUsage::Reported(u))) => Some(u),
            _ => None,
        };
        // What the answer's length was read from: a report or a count, not the reservation.
        let measured = reported.is_some()
            || matches!(self.meter, Meter::Stream(_))
            || matches!(body, Some(BodyUsage::Estimated { .. }));
        // Without a report, a response weir could not read is charged what would have been
        // reserved without a prediction (with one, a low prediction would be all it paid).
        let unread_output = self.admitted.as_ref().map_or(0, |a| a.unread_output);
        let mut usage = match reported {
            Some(u) => {
                let off = estimate.abs_diff(u.prompt_tokens).saturating_mul(100);
                if let Some(err_pct) = off.checked_div(u.prompt_tokens) {
                    host.record(telemetry::ESTIMATE_ERROR, err_pct);
                }
                Demand {
                    input_tokens: u.prompt_tokens,
                    output_tokens: u.completion_tokens,
                    cost_micros: 0,
                }
            }
            None if self.upstream_status >= 400 => Demand::default(),
            None => Demand {
                cost_micros: 0,
                input_tokens: estimate,
                output_tokens: match (&self.meter, body) {
                    (Meter::Stream(m), _) => m.generated_tokens(),
                    (_, Some(BodyUsage::Estimated { completion_tokens })) => completion_tokens,
                    (Meter::Body(_) | Meter::Unreadable, _) => unread_output,
                    (Meter::None, _) => 0,
                },
            },
        };
        let cached = reported.map_or(0, |u| u.cached_prompt_tokens);
        usage.cost_micros = self.admitted.as_ref().map_or(0, |a| {
            self.cost(&a.model, usage.input_tokens, cached, usage.output_tokens)
        });
        (usage, measured)
    }

    /// What tokens of `model` cost at the configured price, in micro-units (0 without one).
    pub(super) fn cost(&self, model: &str, input: u64, cached: u64, output: u64) -> u64 {
        let usage = price::Usage {
            input_tokens: input,
            cached_input_tokens: cached,
            output_tokens: output,
        };
        let prices = self.gw.config.prices.as_ref();
        prices
            .and_then(|p| p.of(model))
            .map_or(0, |p| p.cost_micros(usage))
    }

    /// The shared-data key of the tenant's output history on `model` (see
    /// [`prediction::shared_key`]: only configured models get their own).
    fn history_key(&self, model: &str) -> String {
        let tenant = self.tenant.as_ref().map_or("", |t| t.path());
        history_key(&self.gw, tenant, model)
    }

    /// A completed answer whose output was predicted: its real length per answer goes into the
    /// tenant's history, and how it compared into the metrics.
    fn learn_output(&self, host: &impl Host) {
        let Some(a) = self.admitted.as_ref().filter(|a| a.predicted) else {
            return;
        };
        let actual = self.usage.output_tokens;
        let per_answer = actual / a.answers.max(1);
        let config = &self.gw.config.prediction;
        let key = self.history_key(&a.model);
        if !prediction::learn_shared(host.store(), &key, per_answer, config) {
            host.add(telemetry::SETTLE_CONFLICTS, 1);
        }
        if let Some(pct) = actual.saturating_mul(100).checked_div(a.reserved_output) {
            host.record(telemetry::PREDICTION_ACTUAL_PCT, pct);
        }
        let overrun = actual.saturating_sub(a.reserved_output);
        host.add(telemetry::PREDICTION_OVERRUN, overrun as i64);
    }

    /// Gives back whatever the request holds, its request count too.
    pub(super) fn cancel_reservation(&mut self, host: &impl Host) {
        self.settle_run(host, None);
        let Some(r) = self.reservation.take() else {
            return;
        };
        if let Ok(mut in_flight) = self.gw.in_flight.try_borrow_mut() {
            in_flight.remove(&r.slot.id);
        }
        let conflicts = reservation::cancel(host.store(), &r, host.now_ms());
        host.add(telemetry::SETTLE_CONFLICTS, conflicts as i64);
        host.add(telemetry::RESERVED, -total(r.demand));
    }

    /// The access log: the request's decision counted, anything it still holds settled, its
    /// outcome counted and its record left for the access log.
    pub fn on_log(&mut self, host: &impl Host) {
        if self.stage == Stage::Ignored {
            return;
        }
        if let (Some((route, mode)), Some(decision)) = (&self.counted_as, self.decision()) {
            let name = telemetry::decision_metric(route, *mode, decision);
            host.count(&name);
        }
        // The backstop: a stream that ended without its last chunk (client gone, upstream
        // reset) settles here with what was seen.
        if matches!(
            self.stage,
            Stage::AwaitingBody | Stage::Forwarded | Stage::Responding
        ) {
            self.finish(host, outcome::CANCELLED);
        }
        host.add(&telemetry::request_metric(self.outcome), 1);
        if let Some(tenant) = &self.tenant {
            AccessRecord {
                tenant: tenant.path(),
                api: self.endpoint.map_or("-", Endpoint::name),
                model: self.admitted.as_ref().map_or("-", |a| a.model.as_str()),
                tokens_in: self.usage.input_tokens,
                tokens_out: self.usage.output_tokens,
                estimate: self.admitted.as_ref().map_or(0, |a| a.prompt_tokens),
                outcome: self.outcome,
            }
            .publish(host);
        }
    }
}

pub(super) fn history_key(gw: &Gateway, tenant: &str, model: &str) -> String {
    prediction::shared_key(tenant, model, gw.config.models.contains_key(model))
}

pub(super) fn total(d: Demand) -> i64 {
    (d.input_tokens + d.output_tokens) as i64
}
