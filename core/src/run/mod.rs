//! A run's budgets: what one agent's task (a client-named sequence of model calls) may use,
//! reserved when a call is admitted and settled when it ends, exactly under concurrency on one
//! Envoy.
//!
//! A run lives in one entry of a slot in shared data ([`table`]); its used-plus-reserved
//! counts and its calls in flight are in that one value ([`entry`]). [`reserve`] is a single
//! compare-and-swap on the slot that checks, for every budget set, `used + reserved + demand
//! <= limit` (and that the run's runtime has not run out), then adds the demand and takes a
//! lease for the call; [`settle`] replaces what the call reserved by what it used, on every
//! exit, and gives the lease back. A call's lease lapses by itself if its settle never
//! happens, as concurrency slots do ([`crate::lease`]).
//!
//! Bound on one Envoy: each measure is one value under CAS and admission needs
//! `used + reserved + demand <= limit`, so N concurrent calls admit exactly
//! `min(N, limit - used)` for model calls, tool calls, retries and parallel calls, and output
//! tokens never pass their budget when a call reserves its output ceiling. Input tokens and
//! cost pass it by at most what the concurrent calls' actual use exceeds what they reserved.
//! A call admitted before the runtime ran out may finish after it.

pub mod entry;
pub mod fleet;
pub mod identity;
pub mod table;

#[cfg(test)]
mod tests;

use crate::config::{RunBudgets, Tenant};
use crate::error::ApiError;
use crate::lease::Lease;
use crate::reservation::SlotLease;
use crate::store::{SharedStore, Update, update};

pub use entry::{Counts, ENTRIES_PER_SLOT, MAX_CALLS_IN_FLIGHT};
pub use identity::{BadRunId, RunKey};
pub use table::{RunTable, create, runs_enabled};

use entry::{Entry, Slot};

/// A measure a run is held to (named as in `policy.runs.budgets`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Budget {
    ModelCalls,
    ToolCalls,
    RuntimeMs,
    InputTokens,
    OutputTokens,
    CostMicros,
    ParallelCalls,
    Retries,
}

impl Budget {
    /// The config name, as in [`crate::config::RUN_BUDGETS`].
    pub fn name(self) -> &'static str {
        match self {
            Budget::ModelCalls => "model_calls",
            Budget::ToolCalls => "tool_calls",
            Budget::RuntimeMs => "runtime_ms",
            Budget::InputTokens => "input_tokens",
            Budget::OutputTokens => "output_tokens",
            Budget::CostMicros => "cost_micros",
            Budget::ParallelCalls => "parallel_calls",
            Budget::Retries => "retries",
        }
    }
}

/// A call that would take its run past a budget (`run_budget_exceeded`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunDenial {
    pub budget: Budget,
    pub limit: u64,
    /// Used plus reserved when the call came (for `runtime_ms`, the ms since the run began;
    /// for `parallel_calls`, the calls in flight).
    pub used: u64,
    /// What the call asked of the budget (1 for a call, a place or a tool call; its prompt's
    /// estimate, its output ceiling, their cost; 0 for runtime).
    pub requested: u64,
    pub run_id: String,
}

impl RunDenial {
    /// The error's message: `run r1: model_calls budget 10 reached`.
    pub fn message(&self) -> String {
        let (run, budget, limit) = (&self.run_id, self.budget.name(), self.limit);
        format!("run {run}: {budget} budget {limit} reached")
    }

    /// The `x-weir-run-budget` header's value: `model_calls=10/10`.
    pub fn header_value(&self) -> String {
        format!("{}={}/{}", self.budget.name(), self.used, self.limit)
    }

    /// The error a refused call gets: 429 `run_budget_exceeded`, naming the budget, its limit
    /// and what was used (OpenAI's `type` and `code` both say `run_budget_exceeded`; in
    /// Anthropic's shape the type is the status's, `rate_limit_error`).
    pub fn error(&self) -> ApiError {
        ApiError::rate_limited(self.message())
            .with_type(RUN_BUDGET_EXCEEDED)
            .with_code(RUN_BUDGET_EXCEEDED)
            .with_extra("budget", self.budget.name())
            .with_extra("limit", self.limit)
            .with_extra("used", self.used)
            .with_extra("requested", self.requested)
            .with_extra("run_id", self.run_id.clone())
    }
}

/// The error code of a call refused by its run's budget.
pub const RUN_BUDGET_EXCEEDED: &str = "run_budget_exceeded";

impl RunRefusal {
    /// The error a refused call gets, and the reason it is counted under.
    pub fn error(&self) -> (ApiError, &'static str) {
        match self {
            RunRefusal::Budget(denial) => (denial.error(), RUN_BUDGET_EXCEEDED),
            RunRefusal::Capacity => (
                ApiError::rate_limited(
                    "This key has as many runs active as it may have: end a run, or wait for \
                     an idle one to expire.",
                )
                .with_code("run_capacity"),
                "run_capacity",
            ),
            RunRefusal::Unavailable | RunRefusal::Contended => (
                ApiError::new(
                    503,
                    "The run's state could not be read or updated; try again.",
                )
                .with_code("run_state_unavailable"),
                "run_state_unavailable",
            ),
        }
    }
}

/// Why a call was not admitted to its run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunRefusal {
    Budget(RunDenial),
    /// The run's slot holds only live runs of its key (`run_capacity`).
    Capacity,
    /// The run's slot is missing or does not parse: the table was not created, or was
    /// overwritten. Refused, since a run's budget never fails open.
    Unavailable,
    /// The slot kept changing under the compare-and-swap, or the store failed.
    Contended,
}

/// What a call asks of its run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunDemand {
    /// Reserved until the call settles: one model call (and a retry, if it repeats one), its
    /// estimated input, its output ceiling, its cost at those, tool results it sends.
    pub counts: Counts,
    /// The call's lease on a place among the run's calls in flight.
    pub call: SlotLease,
}

/// What an admitted call holds of its run until it settles.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunHold {
    pub slot_key: String,
    pub digest: [u8; 16],
    /// Which run of that id: a run that ended and began again has another start.
    pub first_ms: u64,
    /// What the call holds of its run: its admission's demand, and the tool calls its answer
    /// made ([`take_tool_call`]).
    pub reserved: Counts,
    pub call_id: u64,
    pub run_id: String,
}

/// Admits a call to its run, or says which budget it would pass: the budgets held on this
/// Envoy ([`fleet::local_budgets`]; a fleet-wide one is reserved in the quota store).
pub fn reserve(
    store: &impl SharedStore,
    tenant: &Tenant,
    table: &RunTable,
    run: &RunKey,
    demand: RunDemand,
    now_ms: u64,
) -> Result<RunHold, RunRefusal> {
    let slot_key = table.key_of(tenant.path(), run);
    // The table holds what this Envoy holds: a fleet-wide budget is the quota store's.
    let budgets = fleet::local_budgets(tenant);
    let mut first_ms = now_ms;
    let outcome = update(store, &slot_key, |current| {
        let mut slot = current
            .and_then(Slot::decode)
            .ok_or(RunRefusal::Unavailable)?;
        let entry = place(&mut slot, run, table.idle_ttl_ms, now_ms)?;
        check(entry, &budgets, &demand, now_ms).map_err(|(budget, limit, used, requested)| {
            RunRefusal::Budget(RunDenial {
                budget,
                limit,
                used,
                requested,
                run_id: run.run_id.clone(),
            })
        })?;
        entry.calls.retain(|c| c.expires_ms > now_ms);
        entry.calls.push(Lease {
            id: demand.call.id,
            expires_ms: now_ms.saturating_add(demand.call.ttl_ms),
        });
        entry.counts = entry.counts.plus(demand.counts);
        entry.last_ms = now_ms;
        first_ms = entry.first_ms;
        Ok(slot.encode())
    });
    match outcome {
        Update::Done(()) => Ok(RunHold {
            slot_key,
            digest: run.digest,
            first_ms,
            reserved: demand.counts,
            call_id: demand.call.id,
            run_id: run.run_id.clone(),
        }),
        Update::Refused(refusal) => Err(refusal),
        Update::Contended => Err(RunRefusal::Contended),
    }
}

/// The run's entry in its slot: its own if live, else a new one in a free or ended place.
fn place<'s>(
    slot: &'s mut Slot,
    run: &RunKey,
    idle_ttl_ms: u64,
    now_ms: u64,
) -> Result<&'s mut Entry, RunRefusal> {
    let own = slot.entries.iter().position(|e| e.digest == run.digest);
    let at = match own {
        Some(i) => i,
        None if slot.entries.len() < ENTRIES_PER_SLOT => {
            slot.entries.push(Entry::new(run.digest, now_ms));
            slot.entries.len().saturating_sub(1)
        }
        None => (slot.entries.iter())
            .position(|e| e.is_idle(now_ms, idle_ttl_ms))
            .ok_or(RunRefusal::Capacity)?,
    };
    let entry = slot.entries.get_mut(at).ok_or(RunRefusal::Unavailable)?;
    if entry.digest != run.digest || entry.is_idle(now_ms, idle_ttl_ms) {
        // A new run, or the same id after its run ended: it starts afresh.
        *entry = Entry::new(run.digest, now_ms);
    }
    Ok(entry)
}

/// The first budget `demand` would pass: (budget, limit, used, requested).
fn check(
    entry: &Entry,
    budgets: &RunBudgets,
    demand: &RunDemand,
    now_ms: u64,
) -> Result<(), (Budget, u64, u64, u64)> {
    let elapsed = now_ms.saturating_sub(entry.first_ms);
    if let Some(limit) = budgets.runtime_ms.filter(|&l| elapsed > l) {
        return Err((Budget::RuntimeMs, limit, elapsed, 0));
    }
    let (used, asked) = (entry.counts, demand.counts);
    let measures = [
        (
            Budget::ModelCalls,
            budgets.model_calls,
            used.model_calls,
            asked.model_calls,
        ),
        (
            Budget::ToolCalls,
            budgets.tool_calls,
            used.tool_calls,
            asked.tool_calls,
        ),
        (
            Budget::InputTokens,
            budgets.input_tokens,
            used.input_tokens,
            asked.input_tokens,
        ),
        (
            Budget::OutputTokens,
            budgets.output_tokens,
            used.output_tokens,
            asked.output_tokens,
        ),
        (
            Budget::CostMicros,
            budgets.cost_micros,
            used.cost_micros,
            asked.cost_micros,
        ),
        (
            Budget::Retries,
            budgets.retries,
            used.retries,
            asked.retries,
        ),
    ];
    for (budget, limit, used, asked) in measures {
        if let Some(limit) = limit.filter(|&l| used.saturating_add(asked) > l) {
            return Err((budget, limit, used, asked));
        }
    }
    let cap = MAX_CALLS_IN_FLIGHT as u64;
    let limit = budgets.parallel_calls.map_or(cap, |l| l.min(cap));
    let live = entry.live_calls(now_ms) as u64;
    if live.saturating_add(1) > limit {
        return Err((Budget::ParallelCalls, limit, live, 1));
    }
    Ok(())
}

/// Ends a call: what it reserved is replaced by what it used, and its place among the run's
/// calls in flight is given back. A replay (an answer served without the engine) passes
/// `model_calls: 0`, which refunds its call. Returns whether the run was still there to
/// settle (a run that ended and began again is not charged for its predecessor's call).
pub fn settle(store: &impl SharedStore, hold: &RunHold, actual: Counts, now_ms: u64) -> bool {
    change(store, hold, |entry| {
        entry.counts = entry.counts.minus(hold.reserved).plus(actual);
        (entry.calls).retain(|c| c.expires_ms > now_ms && c.id != hold.call_id);
        entry.last_ms = now_ms;
        Some(())
    })
}

/// Counts one tool call the call's answer made, as it passes: refused, naming the budget, when
/// the run has no tool call left (the caller withholds the call). One CAS; what is taken is
/// the call's own from then on (in [`RunHold::reserved`]), so its settle keeps it.
pub fn take_tool_call(
    store: &impl SharedStore,
    budgets: &RunBudgets,
    hold: &mut RunHold,
    now_ms: u64,
) -> Result<(), RunDenial> {
    let denial = |used| RunDenial {
        budget: Budget::ToolCalls,
        limit: budgets.tool_calls.unwrap_or(u64::MAX),
        used,
        requested: 1,
        run_id: hold.run_id.clone(),
    };
    let outcome = update(store, &hold.slot_key, |current| {
        let mut slot = current.and_then(Slot::decode).ok_or(None)?;
        let entry = (slot.entries.iter_mut())
            .find(|e| e.digest == hold.digest && e.first_ms == hold.first_ms)
            .ok_or(None)?;
        let used = entry.counts.tool_calls;
        if budgets.tool_calls.is_some_and(|limit| used >= limit) {
            return Err(Some(used));
        }
        entry.counts.tool_calls = used.saturating_add(1);
        entry.last_ms = now_ms;
        Ok(slot.encode())
    });
    match outcome {
        Update::Done(()) => {
            hold.reserved.tool_calls = hold.reserved.tool_calls.saturating_add(1);
            Ok(())
        }
        // The run is gone or the store fails: a budget never fails open.
        Update::Refused(used) => Err(denial(used.unwrap_or(0))),
        Update::Contended => Err(denial(0)),
    }
}

/// Extends a call's lease while it lives (the filter's root tick), so a long call keeps its
/// place among the run's calls in flight and keeps the run from ending under it. A lease that
/// already lapsed is not taken again (its place may have gone to another call).
pub fn renew(store: &impl SharedStore, hold: &RunHold, ttl_ms: u64, now_ms: u64) -> bool {
    change(store, hold, |entry| {
        let call = entry.calls.iter_mut().find(|c| c.id == hold.call_id)?;
        call.expires_ms = now_ms.saturating_add(ttl_ms);
        Some(())
    })
}

/// Changes the held run's entry, if its slot parses and the run is still the one held.
fn change(
    store: &impl SharedStore,
    hold: &RunHold,
    mut f: impl FnMut(&mut Entry) -> Option<()>,
) -> bool {
    let outcome = update::<()>(store, &hold.slot_key, |current| {
        let mut slot = current.and_then(Slot::decode).ok_or(())?;
        let entry = (slot.entries.iter_mut())
            .find(|e| e.digest == hold.digest && e.first_ms == hold.first_ms)
            .ok_or(())?;
        f(entry).ok_or(())?;
        Ok(slot.encode())
    });
    matches!(outcome, Update::Done(()))
}
