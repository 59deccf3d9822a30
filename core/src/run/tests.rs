use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::*;
use crate::config::Config;
use crate::store::StoreError;

mod attacks;

/// Shared data as Envoy keeps it, safe to share between threads: every load and store takes
/// the lock, so a CAS fails exactly when another thread wrote in between. A load yields after
/// reading, to widen the window in which another thread writes.
#[derive(Default)]
struct Shared(Mutex<HashMap<String, (Vec<u8>, u32)>>);

impl SharedStore for Shared {
    fn load(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        let value = self.0.lock().ok()?.get(key).cloned();
        std::thread::yield_now();
        value
    }

    fn store(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let mut data = self.0.lock().map_err(|_| StoreError::Failed)?;
        let current = data.get(key).map(|(_, c)| *c);
        // An absent key is written whatever the token, as Envoy does.
        if current.is_some() && cas.is_some() && cas != current {
            return Err(StoreError::CasMismatch);
        }
        data.insert(key.to_owned(), (value.to_vec(), current.unwrap_or(0) + 1));
        Ok(())
    }
}

impl Shared {
    fn put(&self, key: &str, value: &[u8]) {
        self.store(key, value, None).unwrap();
    }
}

fn tenant(key_id: &str, budgets: &str) -> Tenant {
    let h = "c".repeat(64);
    let json = format!(
        r#"{{"orgs": [{{"id": "agentco", "workspaces": [{{"id": "w", "projects": [{{"id": "p",
            "keys": [{{"id": "{key_id}", "sha256": "{h}",
                       "policy": {{"runs": {{"budgets": {budgets}}}}}}}]}}]}}]}}]}}"#
    );
    let config = Config::parse(json.as_bytes()).unwrap();
    config.directory().lookup(&h).unwrap().as_ref().clone()
}

const TABLE: RunTable = RunTable {
    slots: 8,
    idle_ttl_ms: 60_000,
};
const CALL_TTL: u64 = 30_000;

fn call() -> SlotLease {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    SlotLease {
        id: NEXT.fetch_add(1, Ordering::Relaxed),
        ttl_ms: CALL_TTL,
    }
}

fn model_call(output_ceiling: u64) -> RunDemand {
    RunDemand {
        counts: Counts {
            model_calls: 1,
            input_tokens: 100,
            output_tokens: output_ceiling,
            ..Counts::default()
        },
        call: call(),
    }
}

fn ready(tenant: &Tenant) -> Shared {
    let store = Shared::default();
    assert_eq!(create(&store, [tenant], TABLE), TABLE.slots as usize);
    store
}

fn run(tenant: &Tenant, id: &str) -> RunKey {
    RunKey::new(tenant.path(), None, id).unwrap()
}

fn denial(refusal: RunRefusal) -> RunDenial {
    match refusal {
        RunRefusal::Budget(d) => d,
        other => unreachable!("expected a budget denial, got {other:?}"),
    }
}

/// Reserves on many threads at once; a contended reserve tries again, so every call is
/// decided. Returns how many were admitted. Native only: WASI has no threads.
#[cfg(not(target_family = "wasm"))]
fn race(store: &Shared, tenant: &Tenant, r: &RunKey, n: usize, demand: fn() -> RunDemand) -> usize {
    let admitted = AtomicU64::new(0);
    let start = std::sync::Barrier::new(n);
    std::thread::scope(|s| {
        for _ in 0..n {
            s.spawn(|| {
                start.wait();
                loop {
                    match reserve(store, tenant, &TABLE, r, demand(), 1_000) {
                        Ok(_) => {
                            admitted.fetch_add(1, Ordering::Relaxed);
                            return;
                        }
                        Err(RunRefusal::Contended) => std::thread::yield_now(),
                        Err(RunRefusal::Budget(_)) => return,
                        Err(other) => unreachable!("{other:?}"),
                    }
                }
            });
        }
    });
    admitted.load(Ordering::Relaxed) as usize
}

#[cfg(not(target_family = "wasm"))]
#[test]
fn n_concurrent_reserves_admit_exactly_the_budget() {
    let limit = 10u64;
    for n in [1usize, 2, 7, 10, 11, 32, 64] {
        for used in [0u64, 3] {
            // Model calls.
            let t = tenant("k", r#"{"model_calls": 10}"#);
            let store = ready(&t);
            let r = run(&t, "thread-1");
            for _ in 0..used {
                reserve(&store, &t, &TABLE, &r, model_call(0), 1_000).unwrap();
            }
            let admitted = race(&store, &t, &r, n, || RunDemand {
                counts: Counts {
                    model_calls: 1,
                    ..Counts::default()
                },
                call: call(),
            });
            let expected = n.min((limit - used) as usize);
            assert_eq!(admitted, expected, "model calls: n={n} used={used}");
            // No admitted call's charge was lost: the run holds exactly what was admitted.
            let next = reserve(&store, &t, &TABLE, &r, model_call(0), 1_000);
            match next {
                Err(RunRefusal::Budget(d)) => assert_eq!(d.used, limit),
                Ok(_) => assert!(used + (admitted as u64) < limit),
                Err(other) => unreachable!("{other:?}"),
            }

            // Output tokens: each call reserves a ceiling of 100 of a budget of 1,000.
            let t = tenant("k", r#"{"output_tokens": 1000}"#);
            let store = ready(&t);
            let r = run(&t, "thread-1");
            for _ in 0..used {
                reserve(&store, &t, &TABLE, &r, model_call(100), 1_000).unwrap();
            }
            let admitted = race(&store, &t, &r, n, || model_call(100));
            assert_eq!(admitted, expected, "output tokens: n={n} used={used}");
        }
    }
}

#[test]
fn each_budget_refuses_the_crossing_call_naming_limit_and_used() {
    let one = |counts: Counts| RunDemand {
        counts,
        call: call(),
    };
    let cases: [(&str, Budget, Counts); 6] = [
        (
            r#"{"model_calls": 2}"#,
            Budget::ModelCalls,
            Counts {
                model_calls: 1,
                ..Counts::default()
            },
        ),
        (
            r#"{"tool_calls": 2}"#,
            Budget::ToolCalls,
            Counts {
                tool_calls: 1,
                ..Counts::default()
            },
        ),
        (
            r#"{"input_tokens": 200}"#,
            Budget::InputTokens,
            Counts {
                input_tokens: 100,
                ..Counts::default()
            },
        ),
        (
            r#"{"output_tokens": 200}"#,
            Budget::OutputTokens,
            Counts {
                output_tokens: 100,
                ..Counts::default()
            },
        ),
        (
            r#"{"cost_micros": 2000}"#,
            Budget::CostMicros,
            Counts {
                cost_micros: 1000,
                ..Counts::default()
            },
        ),
        (
            r#"{"retries": 2}"#,
            Budget::Retries,
            Counts {
                retries: 1,
                ..Counts::default()
            },
        ),
    ];
    for (budgets, budget, step) in cases {
        let t = tenant("k", budgets);
        let store = ready(&t);
        let r = run(&t, "r1");
        for i in 0..2 {
            let held = reserve(&store, &t, &TABLE, &r, one(step), 1_000 + i).unwrap();
            // Settled calls count as much as calls in flight.
            assert!(settle(&store, &held, step, 1_000 + i));
        }
        let refused = reserve(&store, &t, &TABLE, &r, one(step), 1_010).unwrap_err();
        let d = denial(refused);
        assert_eq!((d.budget, d.run_id.as_str()), (budget, "r1"), "{budgets}");
        let unit = [
            step.model_calls,
            step.tool_calls,
            step.input_tokens,
            step.output_tokens,
            step.cost_micros,
            step.retries,
        ]
        .into_iter()
        .sum::<u64>();
        assert_eq!(
            (d.limit, d.used, d.requested),
            (2 * unit, 2 * unit, unit),
            "{budgets}"
        );
    }

    // Parallel calls: counted while in flight, free again once settled.
    let t = tenant("k", r#"{"parallel_calls": 2}"#);
    let store = ready(&t);
    let r = run(&t, "r1");
    let a = reserve(&store, &t, &TABLE, &r, model_call(0), 1_000).unwrap();
    reserve(&store, &t, &TABLE, &r, model_call(0), 1_000).unwrap();
    let d = denial(reserve(&store, &t, &TABLE, &r, model_call(0), 1_000).unwrap_err());
    assert_eq!((d.budget, d.limit, d.used), (Budget::ParallelCalls, 2, 2));
    assert!(settle(&store, &a, a.reserved, 1_001));
    assert!(reserve(&store, &t, &TABLE, &r, model_call(0), 1_002).is_ok());

    // Runtime: from the run's first call.
    let t = tenant("k", r#"{"runtime_ms": 5000}"#);
    let store = ready(&t);
    let r = run(&t, "r1");
    let a = reserve(&store, &t, &TABLE, &r, model_call(0), 1_000).unwrap();
    settle(&store, &a, a.reserved, 1_100);
    assert!(reserve(&store, &t, &TABLE, &r, model_call(0), 6_000).is_ok());
    let d = denial(reserve(&store, &t, &TABLE, &r, model_call(0), 6_001).unwrap_err());
    assert_eq!(
        (d.budget, d.limit, d.used),
        (Budget::RuntimeMs, 5_000, 5_001)
    );
}

#[test]
fn run_ids_of_two_keys_never_share_state() {
    let a = tenant("a", r#"{"model_calls": 1}"#);
    let b = tenant("b", r#"{"model_calls": 1}"#);
    let store = Shared::default();
    create(&store, [&a, &b], TABLE);
    let (ra, rb) = (run(&a, "shared-id"), run(&b, "shared-id"));
    assert_ne!(ra.digest, rb.digest);
    assert_ne!(TABLE.key_of(a.path(), &ra), TABLE.key_of(b.path(), &rb));
    reserve(&store, &a, &TABLE, &ra, model_call(0), 1_000).unwrap();
    assert!(reserve(&store, &a, &TABLE, &ra, model_call(0), 1_000).is_err());
    assert!(reserve(&store, &b, &TABLE, &rb, model_call(0), 1_000).is_ok());
    // Nor do two agents of one key, nor an agent and no agent.
    let planner = RunKey::new(a.path(), Some("planner"), "shared-id").unwrap();
    assert_ne!(planner.digest, ra.digest);
}

#[test]
fn settle_refunds_tokens_but_keeps_the_call() {
    let t = tenant("k", r#"{"model_calls": 5, "output_tokens": 1000}"#);
    let store = ready(&t);
    let r = run(&t, "r1");
    let held = reserve(&store, &t, &TABLE, &r, model_call(900), 1_000).unwrap();
    // The ceiling of 900 is held: another call of 200 does not fit.
    let d = denial(reserve(&store, &t, &TABLE, &r, model_call(200), 1_001).unwrap_err());
    assert_eq!((d.budget, d.used), (Budget::OutputTokens, 900));
    let actual = Counts {
        output_tokens: 40,
        ..held.reserved
    };
    assert!(settle(&store, &held, actual, 1_002));
    let second = reserve(&store, &t, &TABLE, &r, model_call(200), 1_003).unwrap();
    settle(&store, &second, second.reserved, 1_004);
    let d = denial(reserve(&store, &t, &TABLE, &r, model_call(900), 1_005).unwrap_err());
    assert_eq!((d.budget, d.used), (Budget::OutputTokens, 240));
    // Both calls still count.
    let t1 = tenant("k", r#"{"model_calls": 2}"#);
    let d = denial(reserve(&store, &t1, &TABLE, &r, model_call(0), 1_006).unwrap_err());
    assert_eq!((d.budget, d.used), (Budget::ModelCalls, 2));
}

#[test]
fn a_replay_refunds_its_model_call() {
    let t = tenant("k", r#"{"model_calls": 1}"#);
    let store = ready(&t);
    let r = run(&t, "r1");
    let held = reserve(&store, &t, &TABLE, &r, model_call(0), 1_000).unwrap();
    let replayed = Counts {
        model_calls: 0,
        ..held.reserved
    };
    assert!(settle(&store, &held, replayed, 1_001));
    assert!(reserve(&store, &t, &TABLE, &r, model_call(0), 1_002).is_ok());
}

#[test]
fn idle_runs_expire_and_their_slot_is_reused() {
    let t = tenant("k", r#"{"model_calls": 1}"#);
    let store = ready(&t);
    let r = run(&t, "r1");
    let held = reserve(&store, &t, &TABLE, &r, model_call(0), 1_000).unwrap();
    settle(&store, &held, held.reserved, 1_000);
    let idle_end = 1_000 + TABLE.idle_ttl_ms;
    assert!(reserve(&store, &t, &TABLE, &r, model_call(0), idle_end).is_err());
    // Idle past the TTL: the same id starts a new run, and the old call's late settle does
    // not touch it.
    let new = reserve(&store, &t, &TABLE, &r, model_call(0), idle_end + 1).unwrap();
    assert_ne!(new.first_ms, held.first_ms);
    assert!(!settle(&store, &held, Counts::default(), idle_end + 2));
    assert!(reserve(&store, &t, &TABLE, &r, model_call(0), idle_end + 3).is_err());

    // A run with a call in flight does not end, however long the call takes, while its lease
    // is renewed.
    let r2 = run(&t, "r2");
    let long = reserve(&store, &t, &TABLE, &r2, model_call(0), 0).unwrap();
    let mut now = 0;
    while now < 3 * TABLE.idle_ttl_ms {
        now += CALL_TTL / 2;
        assert!(renew(&store, &long, CALL_TTL, now));
    }
    assert!(reserve(&store, &t, &TABLE, &r2, model_call(0), now).is_err());
}

#[test]
fn a_full_slot_refuses_only_its_key() {
    let one_slot = RunTable {
        slots: 1,
        idle_ttl_ms: 60_000,
    };
    let a = tenant("a", r#"{"model_calls": 5}"#);
    let b = tenant("b", r#"{"model_calls": 5}"#);
    let store = Shared::default();
    create(&store, [&a, &b], one_slot);
    for i in 0..ENTRIES_PER_SLOT {
        let r = run(&a, &format!("run-{i}"));
        reserve(&store, &a, &one_slot, &r, model_call(0), 1_000).unwrap();
    }
    let extra = run(&a, "one-too-many");
    let refused = reserve(&store, &a, &one_slot, &extra, model_call(0), 1_000);
    assert_eq!(refused, Err(RunRefusal::Capacity));
    // Its own live runs go on, and the other key's runs are untouched.
    assert!(
        reserve(
            &store,
            &a,
            &one_slot,
            &run(&a, "run-0"),
            model_call(0),
            1_001
        )
        .is_ok()
    );
    assert!(
        reserve(
            &store,
            &b,
            &one_slot,
            &run(&b, "one-too-many"),
            model_call(0),
            1_001
        )
        .is_ok()
    );
}

#[test]
fn state_that_fails_to_decode_is_refused_then_repaired_never_a_panic() {
    let t = tenant("k", r#"{"model_calls": 5}"#);
    let store = ready(&t);
    let r = run(&t, "r1");
    let key = TABLE.key_of(t.path(), &r);
    let held = reserve(&store, &t, &TABLE, &r, model_call(0), 1_000).unwrap();
    let good = store.load(&key).unwrap().0;
    let mut corrupt: Vec<Vec<u8>> = vec![vec![], b"garbage".to_vec(), vec![0xff; 200]];
    corrupt.extend(
        (0..good.len())
            .map(|cut| good[..cut].to_vec())
            .filter(|v| v.len() != 8),
    );
    let mut huge_count = good.clone();
    huge_count[8 + 16 + 8 + 8 + 48..8 + 16 + 8 + 8 + 48 + 8]
        .copy_from_slice(&u64::MAX.to_le_bytes());
    corrupt.push(huge_count);
    for bytes in corrupt {
        store.put(&key, &bytes);
        let refused = reserve(&store, &t, &TABLE, &r, model_call(0), 1_001);
        assert_eq!(refused, Err(RunRefusal::Unavailable), "{bytes:?}");
        assert!(!settle(&store, &held, held.reserved, 1_001));
        assert!(!renew(&store, &held, CALL_TTL, 1_001));
    }
    // A table that was never created refuses too.
    let missing = Shared::default();
    assert_eq!(
        reserve(&missing, &t, &TABLE, &r, model_call(0), 1_000),
        Err(RunRefusal::Unavailable)
    );
    // Loading the config again repairs the slot (forgetting its runs), and leaves good ones.
    assert_eq!(create(&store, [&t], TABLE), 1);
    assert_eq!(create(&store, [&t], TABLE), 0);
    assert!(reserve(&store, &t, &TABLE, &r, model_call(0), 1_002).is_ok());
}

#[test]
fn run_ids_are_one_to_128_visible_ascii() {
    assert!(RunKey::new("o/w/p/k", None, "thread_01:abc-9").is_ok());
    assert_eq!(RunKey::new("o/w/p/k", None, ""), Err(BadRunId::Empty));
    assert_eq!(
        RunKey::new("o/w/p/k", None, &"x".repeat(129)),
        Err(BadRunId::TooLong)
    );
    assert!(RunKey::new("o/w/p/k", None, &"x".repeat(128)).is_ok());
    for bad in ["a b", "tab\t", "é", "nl\n"] {
        assert_eq!(
            RunKey::new("o/w/p/k", None, bad),
            Err(BadRunId::NotVisibleAscii),
            "{bad:?}"
        );
    }
    assert_eq!(RunKey::new("o/w/p/k", Some(""), "r"), Err(BadRunId::Empty));
}

#[test]
fn only_tenants_with_a_run_budget_get_a_table() {
    let t = tenant("k", "{}");
    assert!(!runs_enabled(&t));
    let store = Shared::default();
    assert_eq!(create(&store, [&t], TABLE), 0);
    assert_eq!(RunTable::default().slots, 256);
}

#[test]
fn a_denial_names_its_budget_in_the_message_and_the_header() {
    let d = RunDenial {
        budget: Budget::ModelCalls,
        limit: 10,
        used: 10,
        requested: 1,
        run_id: "r1".into(),
    };
    assert_eq!(d.message(), "run r1: model_calls budget 10 reached");
    assert_eq!(d.header_value(), "model_calls=10/10");
    let names: Vec<&str> = [
        Budget::ModelCalls,
        Budget::ToolCalls,
        Budget::RuntimeMs,
        Budget::InputTokens,
        Budget::OutputTokens,
        Budget::CostMicros,
        Budget::ParallelCalls,
        Budget::Retries,
    ]
    .map(Budget::name)
    .to_vec();
    assert_eq!(names, crate::config::RUN_BUDGETS.to_vec());
}

#[test]
fn tool_calls_taken_past_the_budget_are_refused_and_settle_keeps_those_taken() {
    let t = tenant("k", r#"{"tool_calls": 2}"#);
    let store = ready(&t);
    let r = run(&t, "tools");
    let mut hold = reserve(&store, &t, &TABLE, &r, model_call(10), 1_000).unwrap();
    let budgets = t.run_budgets;
    assert_eq!(take_tool_call(&store, &budgets, &mut hold, 1_001), Ok(()));
    assert_eq!(take_tool_call(&store, &budgets, &mut hold, 1_002), Ok(()));
    let refused = take_tool_call(&store, &budgets, &mut hold, 1_003).unwrap_err();
    assert_eq!(
        (refused.budget, refused.limit, refused.used),
        (Budget::ToolCalls, 2, 2)
    );
    assert_eq!(hold.reserved.tool_calls, 2);
    let actual = Counts {
        model_calls: 1,
        tool_calls: hold.reserved.tool_calls,
        ..Counts::default()
    };
    assert!(settle(&store, &hold, actual, 1_004));
    // The next call's answer finds both taken.
    let mut next = reserve(&store, &t, &TABLE, &r, model_call(10), 1_005).unwrap();
    let refused = take_tool_call(&store, &budgets, &mut next, 1_006).unwrap_err();
    assert_eq!((refused.budget, refused.used), (Budget::ToolCalls, 2));
    // A take refused is not the call's.
    assert_eq!(next.reserved.tool_calls, 0);
}

#[test]
fn a_run_denial_s_error_names_budget_limit_and_used_in_each_shape() {
    use crate::error::ErrorShape;
    let denial = RunDenial {
        budget: Budget::ModelCalls,
        limit: 10,
        used: 10,
        requested: 1,
        run_id: "r1".into(),
    };
    let error = denial.error();
    assert_eq!(error.status, 429);
    let openai = error.to_json_in(ErrorShape::OpenAi);
    assert_eq!(
        openai,
        serde_json::json!({"error": {"message": "run r1: model_calls budget 10 reached",
            "type": "run_budget_exceeded", "param": null, "code": "run_budget_exceeded",
            "budget": "model_calls", "limit": 10, "used": 10, "requested": 1, "run_id": "r1"}})
    );
    let anthropic = error.to_json_in(ErrorShape::Anthropic);
    assert_eq!(
        anthropic,
        serde_json::json!({"type": "error", "error": {"type": "rate_limit_error",
            "message": "run r1: model_calls budget 10 reached", "code": "run_budget_exceeded",
            "budget": "model_calls", "limit": 10, "used": 10, "requested": 1, "run_id": "r1"}})
    );
    assert_eq!(denial.header_value(), "model_calls=10/10");
}

/// A guarantee is a property: across budgets, demands and orders of admission and settling
/// drawn at random (seed printed), every call is admitted exactly when a plain model of the
/// budgets (`used + reserved + demand <= limit` per measure, calls in flight under
/// `parallel_calls`) admits it, a refusal names the budget and figures the model does, and
/// what a run holds never passes a budget whose calls reserve their worst case.
#[test]
fn random_shapes_admit_exactly_what_the_budgets_allow() {
    use crate::draw::Rng;

    let mut rng = Rng::seeded("random_shapes_admit_exactly_what_the_budgets_allow");
    let (mut admitted, mut refused) = (0, HashMap::new());
    for shape in 0..200 {
        let mut budgets = RunBudgets {
            model_calls: rng.maybe(12),
            tool_calls: None,
            runtime_ms: None,
            input_tokens: rng.maybe(3_000),
            output_tokens: rng.maybe(2_000),
            cost_micros: None,
            parallel_calls: rng.maybe(6),
            retries: rng.maybe(4),
        };
        if budgets == RunBudgets::default() {
            // A run with no budget has no table.
            budgets.model_calls = Some(1 + rng.below(12));
        }
        let set = |name: &str, v: Option<u64>| v.map(|v| format!(r#""{name}": {v}"#));
        let json: Vec<String> = [
            set("model_calls", budgets.model_calls),
            set("input_tokens", budgets.input_tokens),
            set("output_tokens", budgets.output_tokens),
            set("parallel_calls", budgets.parallel_calls),
            set("retries", budgets.retries),
        ]
        .into_iter()
        .flatten()
        .collect();
        let t = tenant("k", &format!("{{{}}}", json.join(", ")));
        let store = ready(&t);
        let r = run(&t, &format!("shape-{shape}"));
        // The model: what the run holds, and the calls in flight with what each reserved.
        let mut held = Counts::default();
        let mut in_flight: Vec<RunHold> = Vec::new();
        for step in 0..60 {
            if !in_flight.is_empty() && rng.below(3) == 0 {
                let hold = in_flight.remove(rng.below(in_flight.len() as u64) as usize);
                // It used up to its output ceiling, any input, or nothing at all (a replay).
                let ran = rng.below(5) != 0;
                let used = Counts {
                    model_calls: u64::from(ran),
                    input_tokens: rng.below(400),
                    output_tokens: rng.below(hold.reserved.output_tokens + 1),
                    retries: hold.reserved.retries,
                    ..Counts::default()
                };
                assert!(settle(&store, &hold, used, 1_000));
                held = held.minus(hold.reserved).plus(used);
                continue;
            }
            let asked = Counts {
                model_calls: 1,
                input_tokens: rng.below(400),
                output_tokens: rng.below(400),
                retries: u64::from(rng.below(4) == 0),
                ..Counts::default()
            };
            let measures = [
                (
                    Budget::ModelCalls,
                    budgets.model_calls,
                    held.model_calls,
                    asked.model_calls,
                ),
                (
                    Budget::InputTokens,
                    budgets.input_tokens,
                    held.input_tokens,
                    asked.input_tokens,
                ),
                (
                    Budget::OutputTokens,
                    budgets.output_tokens,
                    held.output_tokens,
                    asked.output_tokens,
                ),
                (
                    Budget::Retries,
                    budgets.retries,
                    held.retries,
                    asked.retries,
                ),
            ];
            let crossed = measures
                .into_iter()
                .find_map(|(b, limit, used, want)| {
                    limit
                        .filter(|&l| used + want > l)
                        .map(|l| (b, l, used, want))
                })
                .or_else(|| {
                    let live = in_flight.len() as u64;
                    let limit = budgets.parallel_calls?;
                    (live + 1 > limit).then_some((Budget::ParallelCalls, limit, live, 1))
                });
            let demand = RunDemand {
                counts: asked,
                call: call(),
            };
            let got = reserve(&store, &t, &TABLE, &r, demand, 1_000);
            let at =
                format!("shape {shape} step {step}: {budgets:?} held {held:?} asked {asked:?}");
            match (got, crossed) {
                (Ok(hold), None) => {
                    held = held.plus(asked);
                    in_flight.push(hold);
                    admitted += 1;
                }
                (Err(RunRefusal::Budget(d)), Some((budget, limit, used, want))) => {
                    *refused.entry(budget.name()).or_insert(0) += 1;
                    assert_eq!(
                        (d.budget, d.limit, d.used, d.requested),
                        (budget, limit, used, want),
                        "{at}"
                    );
                }
                (got, crossed) => panic!("{at}: got {got:?}, the model says {crossed:?}"),
            }
            // Measures whose calls reserve their worst case never pass their budget.
            for (limit, value) in [
                (budgets.model_calls, held.model_calls),
                (budgets.output_tokens, held.output_tokens),
                (budgets.retries, held.retries),
                (budgets.parallel_calls, in_flight.len() as u64),
            ] {
                assert!(limit.is_none_or(|l| value <= l), "{at}");
            }
        }
    }
    println!("{admitted} calls admitted; refused by budget: {refused:?}");
    // Every budget drawn was met somewhere: the property was put to the test.
    assert_eq!(refused.len(), 5, "{refused:?}");
}
