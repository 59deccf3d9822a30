//! A run's fleet-wide budgets in the store ([`weir_core::run::fleet`]): one script
//! (`runs.lua`) reserves a call (checks every fleet-wide measure, the runtime and the calls in
//! flight, then adds the call's demand, all or nothing) or settles a batch of calls (what each
//! reserved replaced by what it used, once). Each call is one atomic script, so concurrent
//! calls from any number of Envoys and sidecars are admitted exactly up to a budget.

use std::sync::LazyLock;

use redis::{FromRedisValue, Script, ScriptInvocation, Value};
use weir_core::run::fleet::{ReserveAnswer, ReserveAsk, SettleBatch};

use super::store::{Store, StoreError};

static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("runs.lua")));

impl Store {
    /// Reserves the call at the store's clock, or says which budget it would pass.
    pub async fn reserve_run(&self, ask: &ReserveAsk) -> Result<ReserveAnswer, StoreError> {
        self.reserve_run_at(ask, None).await
    }

    /// [`Store::reserve_run`] at `now_ms` (tests of runtime and expiry).
    pub async fn reserve_run_at(
        &self,
        ask: &ReserveAsk,
        now_ms: Option<u64>,
    ) -> Result<ReserveAnswer, StoreError> {
        let mut call = SCRIPT.prepare_invoke();
        let (run, calls) = self.run_keys(&ask.run);
        call.key(run).key(calls);
        call.arg("reserve")
            .arg(text(now_ms))
            .arg(ask.call)
            .arg(weir_core::run::fleet::CALL_TTL_MS)
            .arg(ask.idle_ttl_ms)
            .arg(text(ask.runtime_ms))
            .arg(text(ask.parallel_calls));
        for m in &ask.measures {
            call.arg(m.measure.name()).arg(m.limit).arg(m.demand);
        }
        let values: Vec<Value> = self.invoke(&call).await?;
        let number = |v: Option<&Value>| match v {
            Some(Value::Int(n)) => u64::try_from(*n).ok(),
            _ => None,
        };
        match values.as_slice() {
            [Value::Int(1)] => Ok(ReserveAnswer::Admitted),
            [Value::Int(0), budget, limit, used] => {
                let budget = match budget {
                    Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                    Value::SimpleString(s) => s.clone(),
                    _ => return Err(StoreError::Malformed(values.len(), 1)),
                };
                Ok(ReserveAnswer::Refused {
                    budget,
                    limit: number(Some(limit)).unwrap_or(0),
                    used: number(Some(used)).unwrap_or(0),
                })
            }
            _ => Err(StoreError::Malformed(values.len(), 1)),
        }
    }

    /// Settles a batch; the number of calls it found to settle.
    pub async fn settle_runs(&self, batch: &SettleBatch) -> Result<u64, StoreError> {
        self.settle_runs_at(batch, None).await
    }

    /// [`Store::settle_runs`] at `now_ms`.
    pub async fn settle_runs_at(
        &self,
        batch: &SettleBatch,
        now_ms: Option<u64>,
    ) -> Result<u64, StoreError> {
        if batch.settles.is_empty() {
            return Ok(0);
        }
        let mut call = SCRIPT.prepare_invoke();
        call.arg("settle").arg(text(now_ms));
        for s in &batch.settles {
            let (run, calls) = self.run_keys(&s.run);
            call.key(run).key(calls);
            call.arg(s.call).arg(s.idle_ttl_ms).arg(s.measures.len());
            for m in &s.measures {
                call.arg(m.measure.name()).arg(m.reserved).arg(m.actual);
            }
        }
        self.invoke(&call).await
    }

    /// Runs the script within the store's timeout.
    async fn invoke<T: FromRedisValue>(
        &self,
        call: &ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.clone();
        tokio::time::timeout(self.timeout, call.invoke_async(&mut conn))
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))?
            .map_err(StoreError::from)
    }

    /// The run's hash and its calls in flight, under the prefix.
    pub fn run_keys(&self, run: &str) -> (String, String) {
        let key = format!("{}{run}", self.prefix);
        let calls = format!("{key}:calls");
        (key, calls)
    }
}

fn text(n: Option<u64>) -> String {
    n.map(|n| n.to_string()).unwrap_or_default()
}
