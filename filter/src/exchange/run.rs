//! The run a call belongs to: named by the caller (the route's run-id header), bound to the
//! caller's key, charged once the body's tokens are reserved and settled with the request.
//!
//! A call is admitted to its run only after the tenant's own limits took it, and a run's
//! refusal gives those back (`refuse` cancels the reservation): a call is charged to both or
//! to neither. Its run is settled wherever the request is (`settle.rs::finish`, and
//! `cancel_reservation` for a refusal after admission), so no exit keeps what the call
//! reserved of its run; a VM that dies mid-call leaves only its call's lease, which lapses.

use proxy_wasm::types::Action;
use weir_core::admission::Admitted;
use weir_core::config::{RunBudgets, Tenant};
use weir_core::error::ApiError;
use weir_core::reply::Reply;
use weir_core::reservation::{Demand, SlotLease};
use weir_core::run::{self, Counts, RunDemand, RunKey, RunRefusal, RunTable, fleet};
use weir_core::trusted;

use super::run_fleet::FleetRun;
use super::{Exchange, Host, Stage};
use crate::telemetry;

/// The header a caller names its run with when the route names no other.
pub const DEFAULT_RUN_ID_HEADER: &str = trusted::RUN_ID;

impl Exchange {
    /// Takes the run id the caller sent (read before its `x-weir-*` headers were stripped),
    /// binds it to the authenticated key and vouches it on. A malformed id, or none where a
    /// level requires one, is refused.
    pub(super) fn name_run(&mut self, run_id: Option<&str>) -> Result<(), ApiError> {
        let Some(tenant) = self.tenant.clone() else {
            return Ok(());
        };
        let Some(run_id) = run_id else {
            if tenant.run_required {
                return Err(ApiError::bad_request(
                    "This key's calls must name their run: send its id in the run-id header.",
                )
                .with_code("run_id_required"));
            }
            return Ok(());
        };
        let key = RunKey::new(tenant.path(), None, run_id).map_err(|_| {
            ApiError::bad_request(format!(
                "A run id is 1 to {} visible ASCII characters.",
                run::identity::MAX_ID_LEN
            ))
            .with_code("invalid_run_id")
        })?;
        self.vouch(trusted::RUN_ID, key.run_id.clone());
        if run::runs_enabled(&tenant) {
            self.run_key = Some(key);
        }
        Ok(())
    }

    /// Admits the call to its run: one model call, its prompt, its output ceiling (never a
    /// prediction, so an output budget is never passed), their cost, a retry when it repeats
    /// one. `None` lets the request go on; otherwise the
    /// refusal's action (the tenant's reservation given back with it).
    pub(super) fn charge_run(&mut self, host: &impl Host, admitted: &Admitted) -> Option<Action> {
        // A shadowed call holds nothing of its run: a run has no shadow ledger, and a dark
        // launch must never spend what the run's enforced calls may use.
        if self.shadow {
            return None;
        }
        let (Some(tenant), Some(key)) = (self.tenant.clone(), self.run_key.as_ref()) else {
            return None;
        };
        let budgets = tenant.run_budgets;
        if (budgets.output_tokens.is_some() || budgets.cost_micros.is_some())
            && !admitted.output_bounded
        {
            // Its answer could be any length: no reservation could hold the budget.
            let error = ApiError::bad_request(
                "This call's run has an output_tokens or cost budget: set the answer's limit \
                 (max_tokens, or max_output_tokens for the Responses API) so the run can be \
                 held to it.",
            )
            .with_param("max_tokens")
            .with_code("output_limit_required");
            let reply = self.error_reply(&error);
            return self.refuse_on_admission(host, reply, "output_limit_required");
        }
        let ceiling = admitted.unread_output;
        let counts = Counts {
            model_calls: 1,
            // Counted as the answer makes them (`run::take_tool_call`): a call may answer
            // with text, and one past the budget is withheld, not the call that asked.
            tool_calls: 0,
            input_tokens: admitted.prompt_tokens,
            output_tokens: ceiling,
            cost_micros: self.cost(&admitted.model, admitted.prompt_tokens, 0, ceiling),
            retries: u64::from(self.retry),
        };
        let demand = RunDemand {
            counts,
            call: SlotLease {
                id: host.random_u64(),
                ttl_ms: self.gw.config.slot_lease_ms,
            },
        };
        if tenant.run_fleet_wide != RunBudgets::default() {
            // Reserved in the quota store once the body is let go (`run_fleet.rs`); here
            // only the budgets held on this Envoy, if any.
            self.run_fleet = FleetRun::Due(counts);
            if fleet::local_budgets(&tenant) == RunBudgets::default() {
                return None;
            }
        }
        self.charge_run_locally(host, &tenant, key.clone(), demand)
    }

    /// Admits the call to its run's budgets held on this Envoy (the run table in shared data).
    fn charge_run_locally(
        &mut self,
        host: &impl Host,
        tenant: &Tenant,
        key: RunKey,
        demand: RunDemand,
    ) -> Option<Action> {
        let table = run_table(tenant);
        let now = host.now_ms();
        let mut held = run::reserve(host.store(), tenant, &table, &key, demand, now);
        if held == Err(RunRefusal::Contended) {
            held = run::reserve(host.store(), tenant, &table, &key, demand, host.now_ms());
        }
        match held {
            Ok(hold) => {
                if let Ok(mut runs) = self.gw.runs_in_flight.try_borrow_mut() {
                    runs.insert(hold.call_id, hold.clone());
                }
                self.run = Some(hold);
                None
            }
            Err(refusal) => {
                let action = self.refuse_run(host, &refusal);
                (self.stage == Stage::Replied).then_some(action)
            }
        }
    }

    /// Refuses the call for its run (`x-should-retry: false`, and the budget it would pass in
    /// `x-weir-run-budget`), giving back what it reserved.
    pub(super) fn refuse_run(&mut self, host: &impl Host, refusal: &RunRefusal) -> Action {
        let (error, reason) = refusal.error();
        let mut reply = Reply::error(&error, self.shape);
        reply.headers.push(("x-should-retry", "false".into()));
        if let RunRefusal::Budget(denial) = refusal {
            reply
                .headers
                .push(("x-weir-run-budget", denial.header_value()));
            if let (Some(tenant), false) = (&self.tenant, self.shadow) {
                telemetry::runs::run_refused(host, tenant, denial.budget);
            }
        }
        self.refuse(host, reply, reason, Stage::AwaitingBody)
    }

    /// Ends the call's part in its run: what it reserved is replaced by what it used. `None`
    /// when no model ran for it (refused, refused upstream before an engine took it, or
    /// answered from completed work): its model call is given back; tool calls its answer
    /// made stay counted.
    pub(super) fn settle_run(&mut self, host: &impl Host, used: Option<Demand>) {
        self.settle_run_fleet(host, used);
        let Some(hold) = self.run.take() else {
            return;
        };
        if let Ok(mut runs) = self.gw.runs_in_flight.try_borrow_mut() {
            runs.remove(&hold.call_id);
        }
        let ran = used.is_some();
        let u = used.unwrap_or_default();
        let actual = Counts {
            model_calls: u64::from(ran),
            tool_calls: hold.reserved.tool_calls,
            input_tokens: u.input_tokens,
            output_tokens: u.output_tokens,
            cost_micros: u.cost_micros,
            retries: if ran { hold.reserved.retries } else { 0 },
        };
        run::settle(host.store(), &hold, actual, host.now_ms());
    }
}

/// The run table a tenant's runs live in: the shape every table is created with, with the
/// tenant's idle time.
pub fn run_table(tenant: &Tenant) -> RunTable {
    let mut table = RunTable::default();
    if let Some(idle) = tenant.run_idle_ttl_ms {
        table.idle_ttl_ms = idle;
    }
    table
}
