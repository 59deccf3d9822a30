//! A run's fleet-wide budgets on the request path ([`weir_core::run::fleet`]): once the call is
//! charged to the tenant's limits and to its run's per-Envoy budgets, it is reserved in the
//! quota store by one signed call, and its body waits for the answer (at most the fleet's
//! `timeout_ms`). Admitted, it goes on; refused, it gets `run_budget_exceeded` as a per-Envoy
//! refusal does; a store that does not answer refuses it with 429 `quota_unavailable` (a run's
//! budget never fails open). Either refusal gives back everything the call had reserved.
//!
//! Its settle goes on the gateway's queue when the request ends (its context may be gone by
//! the time the store answers), and each worker's root tick sends the queue in batches. A full
//! queue drops the settle (counted): the call then stays charged what it reserved.

use std::collections::VecDeque;

use proxy_wasm::types::Action;
use weir_core::admission::Admitted;
use weir_core::error::ApiError;
use weir_core::reservation::Demand;
use weir_core::run::fleet::{
    self, FleetHold, MAX_SETTLES, RESERVE_PATH, ReserveAnswer, ReserveAsk, SETTLE_PATH, Settle,
    SettleBatch,
};
use weir_core::run::{Counts, RunRefusal, table::DEFAULT_IDLE_TTL_MS};

use super::{Exchange, Host};
use crate::Gateway;
use crate::telemetry;

/// Settles a worker keeps waiting for its tick: a few ticks' worth of batches.
pub const MAX_QUEUED_SETTLES: usize = 16 * MAX_SETTLES;

/// Where a call stands with its run's fleet-wide budgets.
#[derive(Default)]
pub(super) enum FleetRun {
    /// None to reserve: the run has no fleet-wide budget, or the call was not charged.
    #[default]
    None,
    /// Charged on this Envoy; `demand` is to be reserved in the store.
    Due(Counts),
    /// Asked: the admitted body waits for the answer to call `token`.
    Asked {
        token: u32,
        ask: ReserveAsk,
        admitted: Box<Admitted>,
        size: usize,
    },
    /// Reserved in the store until it settles.
    Held(FleetHold),
}

impl Exchange {
    /// Lets the admitted body go, first reserving the call in the store when its run has
    /// fleet-wide budgets (the body then waits for [`Self::on_run_reserved`]).
    pub(super) fn forward_run(
        &mut self,
        host: &impl Host,
        admitted: Admitted,
        size: usize,
    ) -> Action {
        let FleetRun::Due(demand) = std::mem::take(&mut self.run_fleet) else {
            return self.forward(host, admitted, size);
        };
        let (Some(tenant), Some(key), Some(config)) = (
            self.tenant.clone(),
            self.run_key.as_ref(),
            self.gw.config.fleet.as_ref(),
        ) else {
            return self.forward(host, admitted, size);
        };
        let idle = tenant.run_idle_ttl_ms.unwrap_or(DEFAULT_IDLE_TTL_MS);
        let Some(ask) = fleet::ask(&tenant, key, host.random_u64(), &demand, idle) else {
            return self.forward(host, admitted, size);
        };
        let body = serde_json::to_vec(&ask).unwrap_or_default();
        let signer = self.gw.signer.as_ref();
        match crate::renewal::call(host, config, signer, RESERVE_PATH, &body, host.now_ms()) {
            Ok(token) => {
                self.run_fleet = FleetRun::Asked {
                    token,
                    ask,
                    admitted: Box::new(admitted),
                    size,
                };
                Action::Pause
            }
            Err(status) => {
                log::warn!("weir: cannot call the quota service for a run: {status:?}");
                self.refuse_run_store_down(host, admitted, size)
            }
        }
    }

    /// The store answered call `token` ([`Self::forward_run`]): the waiting body goes on, or
    /// is refused.
    pub fn on_run_reserved(&mut self, host: &impl Host, token: u32, body_size: usize) {
        if !matches!(&self.run_fleet, FleetRun::Asked { token: asked, .. } if *asked == token) {
            return;
        }
        let FleetRun::Asked {
            ask,
            admitted,
            size,
            ..
        } = std::mem::take(&mut self.run_fleet)
        else {
            return;
        };
        let (status, body) = host.call_response(body_size);
        let answer = match status {
            Some(200) => serde_json::from_slice::<ReserveAnswer>(&body).ok(),
            _ => None,
        };
        let run_id = self.run_key.as_ref().map_or("", |k| k.run_id.as_str());
        let action = match answer.as_ref().map(|a| (a, a.denial(&ask, run_id))) {
            Some((_, None)) => {
                self.run_fleet = FleetRun::Held(ask.hold());
                self.forward(host, *admitted, size)
            }
            Some((_, Some(denial))) => {
                self.refuse_run(host, &RunRefusal::Budget(denial));
                self.forward_unless_replied(host, *admitted, size)
            }
            None => {
                log::warn!(
                    "weir: the quota service did not reserve a run's call (status {status:?})"
                );
                self.refuse_run_store_down(host, *admitted, size)
            }
        };
        if action == Action::Continue {
            host.resume_request();
        }
    }

    /// Refuses the call with 429 `quota_unavailable` and a `Retry-After` of a renewal period,
    /// as a fleet-wide limit that fails closed does (shadow mode lets it on).
    fn refuse_run_store_down(
        &mut self,
        host: &impl Host,
        admitted: Admitted,
        size: usize,
    ) -> Action {
        let wait_s =
            (self.gw.config.fleet.as_ref()).map_or(1, |f| f.renew_ms.div_ceil(1000).max(1));
        let error = ApiError::new(
            429,
            format!(
                "The run's fleet-wide budget cannot be checked: the quota store did not \
                 answer and a run's budget fails closed. Retry after {wait_s} s."
            ),
        )
        .with_code("quota_unavailable");
        let mut reply = self.error_reply(&error);
        reply.headers.push(("retry-after", wait_s.to_string()));
        self.refuse(host, reply, "quota_unavailable", super::Stage::AwaitingBody);
        self.forward_unless_replied(host, admitted, size)
    }

    /// After a refusal: shadow mode lets the body on, enforce has answered it.
    fn forward_unless_replied(
        &mut self,
        host: &impl Host,
        admitted: Admitted,
        size: usize,
    ) -> Action {
        if self.stage == super::Stage::Replied {
            return Action::Pause;
        }
        self.forward(host, admitted, size)
    }

    /// Queues the call's settle in the store, if it reserved there: `used` replaces what it
    /// reserved (`None`: no model ran, its model call given back). A call still waiting for
    /// the store's answer settles as one that used nothing: if the store admitted it, the
    /// settle gives it all back; if the settle comes first, it finds nothing to settle.
    pub(super) fn settle_run_fleet(&mut self, host: &impl Host, used: Option<Demand>) {
        let (hold, actual) = match std::mem::take(&mut self.run_fleet) {
            FleetRun::Held(hold) => {
                let ran = used.is_some();
                let u = used.unwrap_or_default();
                let reserved = |m| {
                    hold.measures
                        .iter()
                        .find(|a| a.measure == m)
                        .map_or(0, |a| a.demand)
                };
                let actual = Counts {
                    model_calls: u64::from(ran),
                    // Tool calls the answer made are counted on this Envoy's hold; without
                    // one, what was reserved stays counted.
                    tool_calls: self
                        .run
                        .as_ref()
                        .map_or(reserved(fleet::Measure::ToolCalls), |h| {
                            h.reserved.tool_calls
                        }),
                    input_tokens: u.input_tokens,
                    output_tokens: u.output_tokens,
                    cost_micros: u.cost_micros,
                    retries: if ran {
                        reserved(fleet::Measure::Retries)
                    } else {
                        0
                    },
                };
                (hold, actual)
            }
            FleetRun::Asked { ask, .. } => (ask.hold(), Counts::default()),
            FleetRun::None | FleetRun::Due(_) => return,
        };
        queue_settle(host, &self.gw, hold.settle(&actual));
    }
}

/// Puts a settle on the worker's queue; a full queue drops it (counted).
fn queue_settle(host: &impl Host, gw: &Gateway, settle: Settle) {
    let Ok(mut queue) = gw.run_settles.try_borrow_mut() else {
        return;
    };
    if queue.len() >= MAX_QUEUED_SETTLES {
        host.add(telemetry::FLEET_RUN_SETTLES_DROPPED, 1);
        return;
    }
    queue.push_back(settle);
}

/// Sends the worker's queued settles, a batch per call (the root tick). A batch that cannot
/// be sent is dropped (counted): its calls stay charged what they reserved.
pub fn send_settles(host: &impl Host, gw: &Gateway) {
    let Some(config) = gw.config.fleet.as_ref() else {
        return;
    };
    let Ok(mut queue) = gw.run_settles.try_borrow_mut() else {
        return;
    };
    while !queue.is_empty() {
        let batch = SettleBatch {
            settles: take(&mut queue, MAX_SETTLES),
        };
        let body = serde_json::to_vec(&batch).unwrap_or_default();
        let sent = crate::renewal::call(
            host,
            config,
            gw.signer.as_ref(),
            SETTLE_PATH,
            &body,
            host.now_ms(),
        );
        if let Err(status) = sent {
            log::warn!("weir: cannot send runs' settles to the quota service: {status:?}");
            host.add(
                telemetry::FLEET_RUN_SETTLES_DROPPED,
                batch.settles.len() as i64,
            );
        }
    }
}

fn take(queue: &mut VecDeque<Settle>, n: usize) -> Vec<Settle> {
    let n = n.min(queue.len());
    queue.drain(..n).collect()
}
