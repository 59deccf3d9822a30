//! The attacker pass on agent runs (issue 30, acceptance 8): each test showed a flaw on the
//! code as it stood, and holds its fix.

use std::cell::RefCell;

use super::*;

/// A worker still in `on_configure` while another already serves: when this worker's
/// `create` finds a slot absent, `meanwhile` runs (the other worker creates the table and
/// admits a call) before this worker's write lands.
struct LateWorker<'s> {
    store: &'s Shared,
    meanwhile: RefCell<Option<Meanwhile<'s>>>,
}

/// What the other worker does while this one is between its load and its write.
type Meanwhile<'s> = Box<dyn FnOnce(&Shared) + 's>;

impl SharedStore for LateWorker<'_> {
    fn load(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        let value = self.store.load(key);
        if value.is_none()
            && let Some(other) = self.meanwhile.borrow_mut().take()
        {
            other(self.store);
        }
        value
    }

    fn store(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.store.store(key, value, cas)
    }
}

fn one_call(id: u64) -> RunDemand {
    RunDemand {
        counts: Counts {
            model_calls: 1,
            ..Counts::default()
        },
        call: SlotLease { id, ttl_ms: 30_000 },
    }
}

/// `create` writes an absent slot unconditionally, on the claim that no request can use it
/// yet; but Envoy configures each worker's VM on its own, and a config that turns runs on for
/// a key (or the first load, with many keys × 256 slots to write) leaves a window in which
/// one worker serves while another is still creating. The late worker's empty slot then
/// lands over a live run: the run's used calls are forgotten and its budget starts again.
#[test]
fn attack_a_late_worker_s_create_wipes_a_live_run() {
    let t = tenant("k", r#"{"model_calls": 1}"#);
    let table = RunTable::new(4, 60_000); // one slot: every run lives in it
    let r = RunKey::new(t.path(), None, "r1").unwrap();
    let memory = Shared::default();
    let late = LateWorker {
        store: &memory,
        meanwhile: RefCell::new(Some(Box::new(|store: &Shared| {
            create(store, [&t], table);
            reserve(store, &t, &table, &r, one_call(1), 1_000).unwrap();
        }))),
    };
    create(&late, [&t], table);
    let second = reserve(&memory, &t, &table, &r, one_call(2), 1_001);
    assert!(
        matches!(second, Err(RunRefusal::Budget(_))),
        "the run's one model call was used, yet a second was admitted: {second:?}"
    );
}

/// A route's `run_id_header` may name the caller's credential (`authorization`, `x-api-key`,
/// `cookie`): the filter then reads the API key as the run id, vouches it to the sidecar, the
/// ledger stores it in its run column and `weir usage --by run` prints it, and every refusal
/// echoes it. Validation refuses only `x-weir-*` names.
#[test]
fn attack_a_credential_header_may_name_runs() {
    for header in [
        "authorization",
        "x-api-key",
        "cookie",
        "proxy-authorization",
    ] {
        let json = format!(
            r#"{{"routes": {{"by_name": {{"llm": {{"mode": "enforce", "run_id_header": "{header}"}}}}}}}}"#
        );
        assert!(
            Config::parse(json.as_bytes()).is_err(),
            "run_id_header {header:?} was accepted"
        );
    }
}

/// `policy.runs.fleet_wide` is accepted, and promises a run's budget across every Envoy of the
/// fleet, failing closed; nothing reads it (no field of `Tenant` carries it, the filter keeps
/// runs only in its Envoy's shared data), and it is accepted even with no `fleet` section,
/// where `limits.fleet_wide` is refused. With N Envoys a run gets N times its budget, and the
/// config said otherwise.
#[test]
fn attack_runs_fleet_wide_is_accepted_and_does_nothing() {
    let h = "c".repeat(64);
    let json = format!(
        r#"{{"orgs": [{{"id": "agentco", "policy": {{"runs": {{
                "budgets": {{"model_calls": 10}},
                "fleet_wide": {{"model_calls": "fail_closed"}}}}}},
            "workspaces": [{{"id": "w", "projects": [{{"id": "p",
            "keys": [{{"id": "k", "sha256": "{h}"}}]}}]}}]}}]}}"#
    );
    assert!(
        Config::parse(json.as_bytes()).is_err(),
        "a fleet-wide run budget was accepted with no fleet to hold it across"
    );
}
