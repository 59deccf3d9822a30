//! A run's fleet-wide budgets: what the filter and the quota service say to each other when a
//! key's `runs.fleet_wide` names a budget and the config has a `fleet` section.
//!
//! No leases: each call of such a run is reserved in the quota store itself, by one signed call
//! ([`RESERVE_PATH`]) that a script answers atomically — for each fleet-wide measure it checks
//! `used + reserved + demand <= limit` on the run's hash (`weir:run:{key path}:{digest}`, its
//! idle time refreshed on every call), the run's runtime from its first call, and its calls in
//! flight, then adds the demand and the call. The body waits for the answer; a store that does
//! not answer refuses the call (a run's budget never fails open). Settles go in batches from
//! each worker's root tick ([`SETTLE_PATH`]): what a call reserved is replaced by what it used.
//!
//! Bound across the fleet: every check and add is one script, so N concurrent calls on any
//! number of Envoys admit exactly `min(N, limit - used)` for model calls, tool calls reserved
//! at admission, retries and parallel calls, and output tokens never pass their budget when a
//! call reserves its ceiling; input tokens and cost pass by at most what concurrent calls used
//! over their estimate (as on one Envoy). A call whose settle never arrives (its worker died,
//! the batch was dropped or failed, or the call outlived [`CALL_TTL_MS`]) keeps what it
//! reserved charged until the run ends: the run is undercharged never, at worst refused early.
//! A call admitted by the store whose caller left before the answer came is charged the same
//! way (its settle, sent when the caller left, finds no call to settle if it arrives first).

use serde::{Deserialize, Serialize};

use super::{Budget, Counts, MAX_CALLS_IN_FLIGHT, RunDenial, RunKey};
use crate::config::{RunBudgets, Tenant};
use crate::fleet::MAX_AMOUNT;
use crate::trusted;

/// The quota service's path that reserves a call of a run.
pub const RESERVE_PATH: &str = "/v1/quota/runs/reserve";

/// The quota service's path that settles a batch of calls.
pub const SETTLE_PATH: &str = "/v1/quota/runs/settle";

/// How long a call holds its place among its run's calls in flight, and its reservation can be
/// settled, without a settle: longer than any call should last.
pub const CALL_TTL_MS: u64 = 600_000;

/// Settles one batch carries; more wait for the next tick.
pub const MAX_SETTLES: usize = 256;

/// Longest idle time the store is asked to keep a run (a day).
pub const MAX_IDLE_TTL_MS: u64 = 86_400_000;

/// A counted measure of a run, as the store names its field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Measure {
    ModelCalls,
    ToolCalls,
    InputTokens,
    OutputTokens,
    CostMicros,
    Retries,
}

impl Measure {
    pub const ALL: [Measure; 6] = [
        Measure::ModelCalls,
        Measure::ToolCalls,
        Measure::InputTokens,
        Measure::OutputTokens,
        Measure::CostMicros,
        Measure::Retries,
    ];

    pub fn budget(self) -> Budget {
        match self {
            Measure::ModelCalls => Budget::ModelCalls,
            Measure::ToolCalls => Budget::ToolCalls,
            Measure::InputTokens => Budget::InputTokens,
            Measure::OutputTokens => Budget::OutputTokens,
            Measure::CostMicros => Budget::CostMicros,
            Measure::Retries => Budget::Retries,
        }
    }

    /// The store's field of the measure (its config name).
    pub fn name(self) -> &'static str {
        self.budget().name()
    }

    fn limit(self, b: &RunBudgets) -> Option<u64> {
        match self {
            Measure::ModelCalls => b.model_calls,
            Measure::ToolCalls => b.tool_calls,
            Measure::InputTokens => b.input_tokens,
            Measure::OutputTokens => b.output_tokens,
            Measure::CostMicros => b.cost_micros,
            Measure::Retries => b.retries,
        }
    }

    fn of(self, c: &Counts) -> u64 {
        match self {
            Measure::ModelCalls => c.model_calls,
            Measure::ToolCalls => c.tool_calls,
            Measure::InputTokens => c.input_tokens,
            Measure::OutputTokens => c.output_tokens,
            Measure::CostMicros => c.cost_micros,
            Measure::Retries => c.retries,
        }
    }
}

/// One measure a call asks of its run's fleet-wide budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeasureAsk {
    pub measure: Measure,
    pub limit: u64,
    pub demand: u64,
}

/// A call of a run, reserved in the store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReserveAsk {
    /// The run's store key ([`run_key`]).
    pub run: String,
    /// The call's id, unique within the run.
    pub call: u64,
    pub idle_ttl_ms: u64,
    #[serde(default)]
    pub runtime_ms: Option<u64>,
    /// Calls in flight at once (capped at [`MAX_CALLS_IN_FLIGHT`]).
    #[serde(default)]
    pub parallel_calls: Option<u64>,
    pub measures: Vec<MeasureAsk>,
}

/// The store's answer to a [`ReserveAsk`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case", deny_unknown_fields)]
pub enum ReserveAnswer {
    Admitted,
    /// The first budget the call would pass: its limit, and what was used and reserved (for
    /// `runtime_ms` the ms since the run began, for `parallel_calls` the calls in flight).
    Refused {
        budget: String,
        limit: u64,
        used: u64,
    },
}

/// What a settled call reserved and used of one measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeasureSettle {
    pub measure: Measure,
    pub reserved: u64,
    pub actual: u64,
}

/// One call's settle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settle {
    pub run: String,
    pub call: u64,
    pub idle_ttl_ms: u64,
    pub measures: Vec<MeasureSettle>,
}

/// A worker's settles of one tick.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SettleBatch {
    pub settles: Vec<Settle>,
}

/// The store's answer to a [`SettleBatch`]: how many calls it found to settle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SettleAnswer {
    pub settled: u64,
}

/// What a call reserved in the store, until it settles.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetHold {
    pub run: String,
    pub call: u64,
    pub idle_ttl_ms: u64,
    pub measures: Vec<MeasureAsk>,
}

impl FleetHold {
    /// The settle that replaces what the call reserved by `actual`.
    pub fn settle(&self, actual: &Counts) -> Settle {
        Settle {
            run: self.run.clone(),
            call: self.call,
            idle_ttl_ms: self.idle_ttl_ms,
            measures: (self.measures.iter())
                .map(|m| MeasureSettle {
                    measure: m.measure,
                    reserved: m.demand,
                    actual: m.measure.of(actual),
                })
                .collect(),
        }
    }
}

/// The run's key in the store: `weir:run:{key path}:{digest as hex}`.
pub fn run_key(key_path: &str, run: &RunKey) -> String {
    let hex: String = run.digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("weir:run:{key_path}:{hex}")
}

/// Whether `key` is a run key as [`run_key`] forms it.
pub fn is_run_key(key: &str) -> bool {
    let Some((path, hex)) = key
        .strip_prefix("weir:run:")
        .and_then(|k| k.rsplit_once(':'))
    else {
        return false;
    };
    trusted::is_tenant_path(path)
        && hex.len() == 32
        && hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The budgets the tenant's runs are held to on each Envoy: those not held fleet-wide.
pub fn local_budgets(tenant: &Tenant) -> RunBudgets {
    let (all, fleet) = (tenant.run_budgets, tenant.run_fleet_wide);
    let local = |a: Option<u64>, f: Option<u64>| a.filter(|_| f.is_none());
    RunBudgets {
        model_calls: local(all.model_calls, fleet.model_calls),
        tool_calls: local(all.tool_calls, fleet.tool_calls),
        runtime_ms: local(all.runtime_ms, fleet.runtime_ms),
        input_tokens: local(all.input_tokens, fleet.input_tokens),
        output_tokens: local(all.output_tokens, fleet.output_tokens),
        cost_micros: local(all.cost_micros, fleet.cost_micros),
        parallel_calls: local(all.parallel_calls, fleet.parallel_calls),
        retries: local(all.retries, fleet.retries),
    }
}

/// The ask that reserves `demand` of the run's fleet-wide budgets for call `call`; `None` when
/// the tenant has none.
pub fn ask(
    tenant: &Tenant,
    run: &RunKey,
    call: u64,
    demand: &Counts,
    idle_ttl_ms: u64,
) -> Option<ReserveAsk> {
    let fleet = tenant.run_fleet_wide;
    if fleet == RunBudgets::default() {
        return None;
    }
    let cap = MAX_CALLS_IN_FLIGHT as u64;
    Some(ReserveAsk {
        run: run_key(tenant.path(), run),
        call,
        idle_ttl_ms: idle_ttl_ms.min(MAX_IDLE_TTL_MS),
        runtime_ms: fleet.runtime_ms,
        parallel_calls: fleet.parallel_calls.map(|l| l.min(cap)),
        measures: (Measure::ALL.iter())
            .filter_map(|&measure| {
                Some(MeasureAsk {
                    measure,
                    limit: measure.limit(&fleet)?,
                    demand: measure.of(demand),
                })
            })
            .collect(),
    })
}

impl ReserveAsk {
    /// What the call holds once the store admitted it.
    pub fn hold(&self) -> FleetHold {
        FleetHold {
            run: self.run.clone(),
            call: self.call,
            idle_ttl_ms: self.idle_ttl_ms,
            measures: self.measures.clone(),
        }
    }

    /// Whether the store may take it as it is: a run key, amounts its script holds exactly,
    /// each measure once.
    pub fn check(&self) -> Result<(), String> {
        if !is_run_key(&self.run) {
            return Err("run: not a run key (weir:run:<tenant path>:<32 hex digits>)".into());
        }
        if !(1..=MAX_IDLE_TTL_MS).contains(&self.idle_ttl_ms) {
            return Err(format!("idle_ttl_ms: 1 to {MAX_IDLE_TTL_MS}"));
        }
        if self
            .parallel_calls
            .is_some_and(|p| p > MAX_CALLS_IN_FLIGHT as u64)
        {
            return Err(format!("parallel_calls: at most {MAX_CALLS_IN_FLIGHT}"));
        }
        let amounts = self.measures.iter().flat_map(|m| [m.limit, m.demand]);
        if self
            .runtime_ms
            .into_iter()
            .chain(amounts)
            .any(|a| a > MAX_AMOUNT)
        {
            return Err(format!("an amount is above {MAX_AMOUNT}"));
        }
        check_once(self.measures.iter().map(|m| m.measure))
    }
}

impl Settle {
    /// As [`ReserveAsk::check`].
    pub fn check(&self) -> Result<(), String> {
        if !is_run_key(&self.run) {
            return Err("run: not a run key".into());
        }
        if !(1..=MAX_IDLE_TTL_MS).contains(&self.idle_ttl_ms) {
            return Err(format!("idle_ttl_ms: 1 to {MAX_IDLE_TTL_MS}"));
        }
        let amounts = self.measures.iter().flat_map(|m| [m.reserved, m.actual]);
        if amounts.into_iter().any(|a| a > MAX_AMOUNT) {
            return Err(format!("an amount is above {MAX_AMOUNT}"));
        }
        check_once(self.measures.iter().map(|m| m.measure))
    }
}

impl SettleBatch {
    /// Every settle checked, or the first bad one's index and problem.
    pub fn check(&self) -> Result<(), (usize, String)> {
        if self.settles.len() > MAX_SETTLES {
            return Err((MAX_SETTLES, format!("at most {MAX_SETTLES} settles")));
        }
        for (i, s) in self.settles.iter().enumerate() {
            s.check().map_err(|e| (i, e))?;
        }
        Ok(())
    }
}

fn check_once(measures: impl Iterator<Item = Measure>) -> Result<(), String> {
    let mut seen = Vec::new();
    for m in measures {
        if seen.contains(&m) {
            return Err(format!("{} is asked for twice", m.name()));
        }
        seen.push(m);
    }
    Ok(())
}

impl ReserveAnswer {
    /// The refusal it makes of `ask`, `run_id`'s call, if it refused.
    pub fn denial(&self, ask: &ReserveAsk, run_id: &str) -> Option<RunDenial> {
        let ReserveAnswer::Refused {
            budget,
            limit,
            used,
        } = self
        else {
            return None;
        };
        let budget = match budget.as_str() {
            "runtime_ms" => Budget::RuntimeMs,
            "parallel_calls" => Budget::ParallelCalls,
            name => (Measure::ALL.iter())
                .find(|m| m.name() == name)
                .map_or(Budget::ModelCalls, |m| m.budget()),
        };
        let requested = match budget {
            Budget::RuntimeMs => 0,
            Budget::ParallelCalls => 1,
            _ => (ask.measures.iter())
                .find(|m| m.measure.budget() == budget)
                .map_or(0, |m| m.demand),
        };
        Some(RunDenial {
            budget,
            limit: *limit,
            used: *used,
            requested,
            run_id: run_id.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn tenant(fleet: &str, runs: &str) -> Tenant {
        let config = format!(
            r#"{{"orgs": [{{"id": "o", "policy": {{"runs": {runs}}}, "workspaces": [{{"id": "w",
                "projects": [{{"id": "p", "keys": [{{"id": "k", "sha256": "{h}"}}]}}]}}]}}]
                {fleet}}}"#,
            h = "ab".repeat(32)
        );
        let config = Config::parse(config.as_bytes()).unwrap();
        let directory = config.directory();
        directory.lookup(&"ab".repeat(32)).unwrap().as_ref().clone()
    }

    const RUNS: &str = r#"{"budgets": {"model_calls": 10, "output_tokens": 500, "retries": 2},
        "fleet_wide": {"model_calls": "fail_closed", "output_tokens": "fail_closed"}}"#;
    const FLEET: &str = r#", "fleet": {"cluster": "quota"}"#;

    #[test]
    fn named_budgets_are_fleet_wide_only_with_a_fleet_section_and_the_rest_stay_local() {
        let t = tenant(FLEET, RUNS);
        assert_eq!(t.run_fleet_wide.model_calls, Some(10));
        assert_eq!(t.run_fleet_wide.output_tokens, Some(500));
        assert_eq!(t.run_fleet_wide.retries, None);
        let local = local_budgets(&t);
        assert_eq!(
            (local.model_calls, local.output_tokens, local.retries),
            (None, None, Some(2))
        );
        // Without one the config is refused: no Envoy could hold them across the fleet.
        let alone = tenant("", r#"{"budgets": {"model_calls": 10}}"#);
        assert_eq!(alone.run_fleet_wide, RunBudgets::default());
        assert_eq!(local_budgets(&alone), alone.run_budgets);
    }

    #[test]
    fn an_ask_carries_each_fleet_wide_measure_and_round_trips() {
        let t = tenant(FLEET, RUNS);
        let run = RunKey::new(t.path(), None, "r1").unwrap();
        let demand = Counts {
            model_calls: 1,
            output_tokens: 100,
            retries: 1,
            ..Counts::default()
        };
        let ask = ask(&t, &run, 7, &demand, 60_000).unwrap();
        assert!(is_run_key(&ask.run), "{}", ask.run);
        assert!(ask.run.starts_with("weir:run:o/w/p/k:"));
        assert_eq!(
            ask.measures,
            vec![
                MeasureAsk {
                    measure: Measure::ModelCalls,
                    limit: 10,
                    demand: 1
                },
                MeasureAsk {
                    measure: Measure::OutputTokens,
                    limit: 500,
                    demand: 100
                },
            ]
        );
        assert_eq!(ask.check(), Ok(()));
        let wire = serde_json::to_string(&ask).unwrap();
        assert_eq!(serde_json::from_str::<ReserveAsk>(&wire).unwrap(), ask);
        let settle = ask.hold().settle(&Counts {
            output_tokens: 40,
            ..Counts::default()
        });
        assert_eq!(settle.measures[1].reserved, 100);
        assert_eq!(settle.measures[1].actual, 40);
        assert_eq!(settle.measures[0].actual, 0, "no model ran");
        assert_eq!(settle.check(), Ok(()));
        let local = tenant("", r#"{"budgets": {"model_calls": 10}}"#);
        assert!(super::ask(&local, &run, 7, &demand, 60_000).is_none());
    }

    #[test]
    fn asks_the_store_cannot_hold_exactly_are_refused() {
        let t = tenant(FLEET, RUNS);
        let run = RunKey::new(t.path(), None, "r1").unwrap();
        let good = ask(&t, &run, 7, &Counts::default(), 60_000).unwrap();
        let mut bad = good.clone();
        bad.run = "weir:e:o/w/p/k:rpm".into();
        assert!(bad.check().is_err());
        let mut bad = good.clone();
        bad.measures[0].demand = MAX_AMOUNT + 1;
        assert!(bad.check().is_err());
        let mut bad = good.clone();
        bad.measures.push(bad.measures[0]);
        assert!(bad.check().is_err());
        let mut bad = good.clone();
        bad.idle_ttl_ms = 0;
        assert!(bad.check().is_err());
        for key in [
            "weir:run:o/w:",
            "weir:run:o:ABCDEF0123456789abcdef0123456789",
            "weir:run::00",
        ] {
            assert!(!is_run_key(key), "{key}");
        }
        let batch = SettleBatch {
            settles: vec![good.hold().settle(&Counts::default()); MAX_SETTLES + 1],
        };
        assert!(batch.check().is_err());
    }

    #[test]
    fn a_refusal_names_the_budget_it_would_pass() {
        let refused = ReserveAnswer::Refused {
            budget: "output_tokens".into(),
            limit: 500,
            used: 450,
        };
        let wire = serde_json::to_string(&refused).unwrap();
        assert_eq!(
            wire,
            r#"{"outcome":"refused","budget":"output_tokens","limit":500,"used":450}"#
        );
        let t = tenant(FLEET, RUNS);
        let run = RunKey::new(t.path(), None, "r1").unwrap();
        let demand = Counts {
            model_calls: 1,
            output_tokens: 60,
            ..Counts::default()
        };
        let asked = ask(&t, &run, 7, &demand, 60_000).unwrap();
        let denial = refused.denial(&asked, "r1").unwrap();
        assert_eq!(denial.header_value(), "output_tokens=450/500");
        assert_eq!(denial.requested, 60, "what the call asked");
        assert_eq!(ReserveAnswer::Admitted.denial(&asked, "r1"), None);
        let parallel = ReserveAnswer::Refused {
            budget: "parallel_calls".into(),
            limit: 2,
            used: 2,
        };
        let denial = parallel.denial(&asked, "r").unwrap();
        assert_eq!(
            (denial.budget, denial.requested),
            (Budget::ParallelCalls, 1)
        );
    }
}
