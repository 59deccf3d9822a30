//! `weir usage --by run`: the ledger's records summed per run. A run is one tenant's, and one
//! agent's when the key names agents, as the filter holds its budgets
//! ([`weir_core::run::RunKey`]): the same run id under two tenants or two agents is two runs. Per run: its calls (attempts that used an engine, as
//! the ledger bills them), the tool calls their answers made, tokens, cost, its runtime (from
//! the first call's start to the last call's end) and the outcome of its last call. Only the
//! records in the window `--since` asks for are summed: a run older than it shows its later part.

use std::collections::BTreeMap;

use serde::Serialize;
use weir_sidecar::ledger::UsageRecord;

use crate::usage_export::{csv, optional, rfc3339};

const HEADER: &str = "tenant,agent_id,run_id,calls,tool_calls,input_tokens,output_tokens,currency,cost_micros,started_at,finished_at,runtime_ms,outcome";

/// One run's records, summed.
#[derive(Debug, PartialEq, Serialize)]
pub struct RunUsage {
    pub tenant: String,
    pub agent_id: Option<String>,
    pub run_id: String,
    pub calls: u64,
    pub tool_calls: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// The currency of its priced calls (`mixed` if they were priced in several, when the cost
    /// is not summed); `None` when none was priced.
    pub currency: Option<String>,
    pub cost_micros: Option<u64>,
    pub started_at_ms: u64,
    pub finished_at_ms: u64,
    pub runtime_ms: u64,
    /// The outcome of its last call (the one that finished last).
    pub outcome: String,
}

impl RunUsage {
    fn first(r: &UsageRecord, run_id: &str) -> RunUsage {
        RunUsage {
            tenant: r.tenant.clone(),
            agent_id: r.agent_id.clone(),
            run_id: run_id.to_owned(),
            calls: 0,
            tool_calls: 0,
            input_tokens: 0,
            output_tokens: 0,
            currency: None,
            cost_micros: None,
            started_at_ms: u64::MAX,
            finished_at_ms: 0,
            runtime_ms: 0,
            outcome: String::new(),
        }
    }

    fn add(&mut self, r: &UsageRecord) {
        self.calls += 1;
        self.tool_calls += r.tool_calls;
        self.input_tokens += r.prompt_tokens;
        self.output_tokens += r.completion_tokens;
        if let (Some(cost), Some(currency)) = (r.cost_micros, &r.currency) {
            match &self.currency {
                None => self.currency = Some(currency.clone()),
                Some(c) if c == currency => {}
                Some(_) => self.currency = Some("mixed".into()),
            }
            self.cost_micros = Some(self.cost_micros.unwrap_or(0) + cost);
        }
        if self.currency.as_deref() == Some("mixed") {
            self.cost_micros = None;
        }
        self.started_at_ms = self
            .started_at_ms
            .min(r.started_at_ms.unwrap_or(r.finished_at_ms));
        if r.finished_at_ms >= self.finished_at_ms {
            self.finished_at_ms = r.finished_at_ms;
            self.outcome = r.outcome.clone();
        }
        self.runtime_ms = self.finished_at_ms.saturating_sub(self.started_at_ms);
    }
}

/// The runs of `rows` (those recorded with a run id), by tenant, agent and run id.
pub fn by_run(rows: &[UsageRecord]) -> Vec<RunUsage> {
    type Key<'r> = (&'r str, Option<&'r str>, &'r str);
    let mut runs: BTreeMap<Key, RunUsage> = BTreeMap::new();
    for r in rows {
        let Some(run_id) = r.run_id.as_deref() else {
            continue;
        };
        runs.entry((r.tenant.as_str(), r.agent_id.as_deref(), run_id))
            .or_insert_with(|| RunUsage::first(r, run_id))
            .add(r);
    }
    runs.into_values().collect()
}

/// The runs as a JSON array (times also in RFC 3339, as the per-call export gives them).
pub fn json(runs: &[RunUsage]) -> serde_json::Result<String> {
    #[derive(Serialize)]
    struct Exported<'r> {
        #[serde(flatten)]
        run: &'r RunUsage,
        started_at: String,
        finished_at: String,
    }
    let runs: Vec<Exported> = runs
        .iter()
        .map(|run| Exported {
            run,
            started_at: rfc3339(run.started_at_ms),
            finished_at: rfc3339(run.finished_at_ms),
        })
        .collect();
    Ok(serde_json::to_string_pretty(&runs)? + "\n")
}

/// The header line and one line per run.
pub fn table(runs: &[RunUsage]) -> String {
    csv(
        HEADER,
        runs.iter().map(|r| {
            [
                r.tenant.clone(),
                r.agent_id.clone().unwrap_or_default(),
                r.run_id.clone(),
                r.calls.to_string(),
                r.tool_calls.to_string(),
                r.input_tokens.to_string(),
                r.output_tokens.to_string(),
                r.currency.clone().unwrap_or_default(),
                optional(r.cost_micros),
                rfc3339(r.started_at_ms),
                rfc3339(r.finished_at_ms),
                r.runtime_ms.to_string(),
                r.outcome.clone(),
            ]
        }),
    )
}

#[cfg(test)]
mod attacks;
#[cfg(test)]
mod tests {
    use super::*;
    use weir_sidecar::ledger::{append, open, query};

    /// A call of `run` under `tenant`, its `key`'s `attempt`, from `start` to `end`.
    fn call(
        tenant: &str,
        run: Option<&str>,
        (key, attempt): (&str, u32),
        span: (u64, u64),
    ) -> UsageRecord {
        UsageRecord {
            tenant: tenant.into(),
            idempotency_key: key.into(),
            attempt,
            request_id: format!("weir-{tenant}-{key}-{attempt}"),
            model: "m".into(),
            outcome: "ok".into(),
            prompt_tokens: 100,
            completion_tokens: 10,
            started_at_ms: Some(span.0),
            finished_at_ms: span.1,
            run_id: run.map(str::to_owned),
            ..UsageRecord::default()
        }
    }

    #[test]
    fn usage_by_run_aggregates_attempts() {
        let path = std::env::temp_dir().join(format!("weir-cli-runs-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let conn = open(&path).unwrap();
        let a = "acme/w/p/agent";
        // Run 1 of `a`: a first attempt cut off and its retry, then a second call that made
        // tool calls and failed last.
        let mut cut = call(a, Some("run-1"), ("k1", 1), (1_000, 1_500));
        cut.outcome = "cancelled".into();
        cut.completion_tokens = 3;
        let mut retried = call(a, Some("run-1"), ("k1", 2), (1_600, 2_500));
        retried.tool_calls = 2;
        let mut last = call(a, Some("run-1"), ("k2", 1), (3_000, 4_000));
        last.tool_calls = 1;
        last.outcome = "upstream_error".into();
        for (r, cost) in [(&mut retried, 40), (&mut last, 2)] {
            r.currency = Some("USD".into());
            r.cost_micros = Some(cost);
        }
        let records = [
            last,
            cut,
            retried,
            // The same run id under another tenant is another run.
            call("other/w/p/k", Some("run-1"), ("k1", 1), (1_000, 1_200)),
            // Outside any run: not summed.
            call(a, None, ("k9", 1), (1_000, 9_000)),
            // The same run id of an agent of the key is the agent's run.
            UsageRecord {
                agent_id: Some("planner".into()),
                ..call(a, Some("run-1"), ("k3", 1), (5_000, 6_000))
            },
        ];
        for r in &records {
            assert!(append(&conn, r).unwrap());
        }
        let runs = by_run(&query(&conn, None, 0).unwrap());
        assert_eq!(runs.len(), 3, "{runs:?}");
        assert_eq!(
            runs[0],
            RunUsage {
                tenant: a.into(),
                agent_id: None,
                run_id: "run-1".into(),
                calls: 3,
                tool_calls: 3,
                input_tokens: 300,
                output_tokens: 23,
                currency: Some("USD".into()),
                cost_micros: Some(42),
                started_at_ms: 1_000,
                finished_at_ms: 4_000,
                runtime_ms: 3_000,
                outcome: "upstream_error".into(),
            }
        );
        assert_eq!(
            (
                runs[1].agent_id.as_deref(),
                runs[1].calls,
                runs[1].runtime_ms
            ),
            (Some("planner"), 1, 1_000)
        );
        assert_eq!(
            (runs[2].tenant.as_str(), runs[2].calls, runs[2].runtime_ms),
            ("other/w/p/k", 1, 200)
        );
        assert_eq!(runs[2].cost_micros, None, "nothing priced");
        let csv = table(&runs);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 4, "{csv}");
        assert!(
            lines[1].starts_with("acme/w/p/agent,,run-1,3,3,300,23,USD,42,")
                && lines[1].ends_with(",3000,upstream_error"),
            "{csv}"
        );
        let json: serde_json::Value = serde_json::from_str(&json(&runs).unwrap()).unwrap();
        assert_eq!(json[0]["tool_calls"], 3);
        assert_eq!(json[0]["started_at"], "1970-01-01T00:00:01Z");
        drop(conn);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_run_priced_in_two_currencies_sums_no_cost() {
        let mut usd = call("t", Some("r"), ("a", 1), (0, 1));
        (usd.currency, usd.cost_micros) = (Some("USD".into()), Some(5));
        let mut eur = call("t", Some("r"), ("b", 1), (1, 2));
        (eur.currency, eur.cost_micros) = (Some("EUR".into()), Some(7));
        let runs = by_run(&[usd, eur]);
        assert_eq!(
            (runs[0].currency.as_deref(), runs[0].cost_micros),
            (Some("mixed"), None)
        );
    }
}
