//! A run's fleet-wide budgets (`policy.runs.fleet_wide`): each call reserved in the quota store
//! by one atomic script. Against the store alone (a real Redis), 32 concurrent reserves of one
//! run admit exactly its budget, settles replace what was reserved and count once, and the run
//! ends with its idle time. Through two real Envoys in fleet mode (one sidecar, its Redis, the
//! simulator), 32 concurrent calls of one run split across both admit exactly its model-call
//! budget, or its output-token budget, and none while the store is down.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use serde_json::{Value, json};

use weir_core::run::fleet::{
    Measure, MeasureAsk, MeasureSettle, ReserveAnswer, ReserveAsk, Settle, SettleBatch,
};
use weir_e2e::redis_server::Redis;
use weir_e2e::{Envoy, Sidecar, Sim, api_key, chat_body, post_json};
use weir_sidecar::quota::Store;

fn redis() -> &'static Redis {
    static REDIS: OnceLock<Redis> = OnceLock::new();
    REDIS.get_or_init(Redis::launch)
}

fn store(prefix: &str) -> Store {
    redis().store(prefix)
}

const RUN: &str = "weir:run:acme/w/p/k:00112233445566778899aabbccddeeff";

fn reserve(call: u64, measures: &[(Measure, u64, u64)]) -> ReserveAsk {
    ReserveAsk {
        run: RUN.into(),
        call,
        idle_ttl_ms: 60_000,
        runtime_ms: None,
        parallel_calls: None,
        measures: (measures.iter())
            .map(|&(measure, limit, demand)| MeasureAsk {
                measure,
                limit,
                demand,
            })
            .collect(),
    }
}

/// `n` reserves of one run at once, each on its own connection: how many were admitted, and
/// the refusals' (budget, used).
async fn concurrently(
    prefix: &str,
    n: u64,
    measures: &[(Measure, u64, u64)],
) -> (u64, Vec<(String, u64)>) {
    let mut tasks = Vec::new();
    for call in 0..n {
        let store = Arc::new(store(prefix));
        let ask = reserve(call, measures);
        tasks.push(tokio::spawn(async move {
            store.reserve_run(&ask).await.unwrap()
        }));
    }
    let (mut admitted, mut refused) = (0, Vec::new());
    for t in tasks {
        match t.await.unwrap() {
            ReserveAnswer::Admitted => admitted += 1,
            ReserveAnswer::Refused { budget, used, .. } => refused.push((budget, used)),
        }
    }
    (admitted, refused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_concurrent_reserves_admit_exactly_the_budget() {
    let (admitted, refused) = concurrently("calls:", 32, &[(Measure::ModelCalls, 10, 1)]).await;
    println!(
        "store: 32 concurrent reserves, model_calls 10: {admitted} admitted, {} refused",
        refused.len()
    );
    assert_eq!(admitted, 10);
    assert_eq!(refused.len(), 22);
    assert!(
        refused
            .iter()
            .all(|(b, used)| b == "model_calls" && *used == 10),
        "{refused:?}"
    );
    // Output tokens: each call reserves its ceiling of 100 against 1,000.
    let (admitted, refused) = concurrently(
        "tokens:",
        32,
        &[
            (Measure::ModelCalls, 100, 1),
            (Measure::OutputTokens, 1_000, 100),
        ],
    )
    .await;
    println!(
        "store: 32 concurrent reserves of 100 output tokens, budget 1000: {admitted} admitted"
    );
    assert_eq!(admitted, 10);
    assert!(
        refused.iter().all(|(b, _)| b == "output_tokens"),
        "{refused:?}"
    );
}

#[tokio::test]
async fn a_settle_replaces_what_was_reserved_once_and_a_late_one_changes_nothing() {
    let s = store("settle:");
    let measures = [
        (Measure::ModelCalls, 3, 1),
        (Measure::OutputTokens, 300, 100),
    ];
    for call in 1..=3 {
        assert_eq!(
            s.reserve_run(&reserve(call, &measures)).await.unwrap(),
            ReserveAnswer::Admitted
        );
    }
    let refused = s.reserve_run(&reserve(4, &measures)).await.unwrap();
    assert!(
        matches!(refused, ReserveAnswer::Refused { ref budget, used: 3, .. } if budget == "model_calls"),
        "{refused:?}"
    );
    // Call 1 ran and used 10 output tokens; call 2 never ran (its model call back): settled in
    // one batch, call 1 twice (the second is no settle), and an unknown call 9.
    let settle = |call, model_calls, output| Settle {
        run: RUN.into(),
        call,
        idle_ttl_ms: 60_000,
        measures: vec![
            MeasureSettle {
                measure: Measure::ModelCalls,
                reserved: 1,
                actual: model_calls,
            },
            MeasureSettle {
                measure: Measure::OutputTokens,
                reserved: 100,
                actual: output,
            },
        ],
    };
    let batch = SettleBatch {
        settles: vec![
            settle(1, 1, 10),
            settle(2, 0, 0),
            settle(1, 1, 10),
            settle(9, 0, 0),
        ],
    };
    assert_eq!(s.settle_runs(&batch).await.unwrap(), 2);
    let (run, calls) = s.run_keys(RUN);
    let field = |f: &str| redis().command::<Option<u64>>(&["HGET", &run, f]);
    assert_eq!(field("model_calls"), Some(2));
    assert_eq!(
        field("output_tokens"),
        Some(110),
        "300 reserved, 90 and 100 back"
    );
    assert_eq!(
        redis().command::<u64>(&["ZCARD", &calls]),
        1,
        "call 3 is in flight"
    );
    // The model call given back admits another call; then the budget holds again.
    assert_eq!(
        s.reserve_run(&reserve(5, &measures)).await.unwrap(),
        ReserveAnswer::Admitted
    );
    assert!(matches!(
        s.reserve_run(&reserve(6, &measures)).await.unwrap(),
        ReserveAnswer::Refused { .. }
    ));
    // The run's keys expire with its idle time once no call is in flight.
    let ttl: i64 = redis().command(&["PTTL", &run]);
    assert!(ttl > 60_000 && ttl <= 60_000 + 600_000, "{ttl}");
}

#[tokio::test]
async fn runtime_and_parallel_calls_are_held_at_the_store_s_clock() {
    let s = store("time:");
    let t0 = 1_800_000_000_000u64;
    let mut ask = reserve(1, &[(Measure::ModelCalls, 100, 1)]);
    ask.runtime_ms = Some(5_000);
    ask.parallel_calls = Some(2);
    ask.idle_ttl_ms = 1_000;
    let at = |ask: &ReserveAsk, call, now| {
        let mut a = ask.clone();
        a.call = call;
        let s = &s;
        async move { s.reserve_run_at(&a, Some(now)).await.unwrap() }
    };
    assert_eq!(at(&ask, 1, t0).await, ReserveAnswer::Admitted);
    assert_eq!(at(&ask, 2, t0 + 10).await, ReserveAnswer::Admitted);
    let third = at(&ask, 3, t0 + 20).await;
    assert!(
        matches!(third, ReserveAnswer::Refused { ref budget, used: 2, .. } if budget == "parallel_calls"),
        "{third:?}"
    );
    let late = at(&ask, 4, t0 + 5_001 + weir_core::run::fleet::CALL_TTL_MS).await;
    assert!(
        matches!(late, ReserveAnswer::Refused { ref budget, .. } if budget == "runtime_ms"),
        "{late:?}"
    );
}

#[tokio::test]
async fn junk_in_the_run_s_keys_is_refused_or_dropped_never_admitted_on() {
    let s = store("junk:");
    let (run, calls) = s.run_keys(RUN);
    redis().command::<()>(&["HSET", &run, "model_calls", "lots"]);
    let answer = s
        .reserve_run(&reserve(1, &[(Measure::ModelCalls, 10, 1)]))
        .await
        .unwrap();
    assert!(
        matches!(answer, ReserveAnswer::Refused { .. }),
        "{answer:?}"
    );
    redis().command::<()>(&["DEL", &run]);
    redis().command::<()>(&["SET", &calls, "x"]);
    let answer = s
        .reserve_run(&reserve(1, &[(Measure::ModelCalls, 10, 1)]))
        .await
        .unwrap();
    assert_eq!(answer, ReserveAnswer::Admitted);
}

/// Two Envoys in fleet mode on one sidecar, its Redis and the simulator (every answer 100
/// tokens long, so a call uses what it reserves and no settle frees anything mid-test).
struct Fleet {
    _sim: Sim,
    redis: Mutex<Redis>,
    sidecar: Sidecar,
    envoys: Vec<Envoy>,
}

/// A key whose runs are held to `budgets`, fleet-wide.
fn run_key(id: &str, budgets: Value) -> Value {
    let fleet_wide: serde_json::Map<String, Value> = (budgets.as_object().unwrap().keys())
        .map(|k| (k.clone(), json!("fail_closed")))
        .collect();
    let mut key = api_key(id);
    key["policy"] = json!({"runs": {"budgets": budgets, "fleet_wide": fleet_wide}});
    key
}

fn fleet() -> &'static Fleet {
    static FLEET: OnceLock<Fleet> = OnceLock::new();
    FLEET.get_or_init(|| {
        let sim = Sim::start(&["--preset", "tiny", "--time-scale", "20", "--output-len", "fixed:100"]);
        let redis = Redis::launch();
        let sidecar = Sidecar::quota_service(&sim.url, &redis);
        let config = json!({
            "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "e2e", "keys": [
                run_key("calls", json!({"model_calls": 10})),
                run_key("tokens", json!({"output_tokens": 1_000})),
            ]}]}]}],
            "models": {"tiny": {"max_context_tokens": 4096}},
            "fleet": {"cluster": "upstream", "renew_ms": 250, "timeout_ms": 1_000},
        });
        let envoys = (0..2)
            .map(|_| Envoy::start(&config, sidecar.port, sidecar.port))
            .collect();
        Fleet {
            _sim: sim,
            redis: Mutex::new(redis),
            sidecar,
            envoys,
        }
    })
}

/// One test at a time on the shared fleet (one stops its Redis).
async fn turn() -> tokio::sync::MutexGuard<'static, ()> {
    static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    TURN.lock().await
}

/// `n` calls of run `run` with `key` at once, alternating between the Envoys: each answer's
/// status and error code.
async fn calls_at_once(key: &'static str, run: &'static str, n: usize) -> Vec<(u16, String)> {
    let mut tasks = Vec::new();
    for i in 0..n {
        let envoy = &fleet().envoys[i % 2];
        tasks.push(tokio::spawn(async move {
            let body = chat_body("tiny", "one step of the task", json!({"max_tokens": 100}));
            let r = post_json(
                &format!("{}/v1/chat/completions", envoy.url),
                Some(key),
                body.to_string(),
                &[("x-weir-run-id", run)],
            )
            .await;
            let status = r.status().as_u16();
            let v: Value = r.json().await.unwrap_or(Value::Null);
            (status, v["error"]["code"].as_str().unwrap_or("").to_owned())
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// How many answers had each (status, code).
fn tally(answers: &[(u16, String)]) -> Vec<((u16, String), usize)> {
    let mut counts: Vec<((u16, String), usize)> = Vec::new();
    for a in answers {
        match counts.iter_mut().find(|(k, _)| k == a) {
            Some((_, n)) => *n += 1,
            None => counts.push((a.clone(), 1)),
        }
    }
    counts.sort();
    counts
}

fn ok_and_refused(answers: &[(u16, String)]) -> (usize, usize) {
    let ok = answers.iter().filter(|(s, _)| *s == 200).count();
    let refused = (answers.iter())
        .filter(|(s, c)| *s == 429 && c == "run_budget_exceeded")
        .count();
    (ok, refused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_calls_of_one_run_across_two_envoys_admit_exactly_ten() {
    let _turn = turn().await;
    let answers = calls_at_once("calls", "run-calls", 32).await;
    println!(
        "two Envoys, model_calls 10 fleet-wide, 32 calls at once: {:?}",
        tally(&answers)
    );
    assert_eq!(ok_and_refused(&answers), (10, 22), "{:?}", tally(&answers));
    // Another run of the key has its own budget.
    let answers = calls_at_once("calls", "run-calls-2", 12).await;
    assert_eq!(ok_and_refused(&answers), (10, 2), "{:?}", tally(&answers));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_calls_reserving_their_output_ceiling_admit_exactly_the_token_budget() {
    let _turn = turn().await;
    let answers = calls_at_once("tokens", "run-tokens", 32).await;
    println!(
        "two Envoys, output_tokens 1000 fleet-wide, 32 calls of max_tokens 100 at once: {:?}",
        tally(&answers)
    );
    assert_eq!(ok_and_refused(&answers), (10, 22), "{:?}", tally(&answers));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_store_refuses_every_call_and_admits_again_once_back() {
    let _turn = turn().await;
    fleet().redis.lock().unwrap().stop();
    let answers = calls_at_once("calls", "run-down", 8).await;
    fleet().redis.lock().unwrap().start();
    println!("store down, 8 calls: {:?}", tally(&answers));
    assert!(
        answers
            .iter()
            .all(|(s, c)| *s == 429 && c == "quota_unavailable"),
        "{:?}",
        tally(&answers)
    );
    let until = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let answers = calls_at_once("calls", "run-back", 1).await;
        if answers[0].0 == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < until,
            "never admitted again once the store was back: {answers:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_store_takes_only_calls_the_filter_signed() {
    let _turn = turn().await;
    let ask = reserve(1, &[(Measure::ModelCalls, 1_000_000, 1)]);
    for path in [
        weir_core::run::fleet::RESERVE_PATH,
        weir_core::run::fleet::SETTLE_PATH,
    ] {
        let url = format!("{}{path}", fleet().sidecar.url);
        let r = post_json(&url, None, serde_json::to_string(&ask).unwrap(), &[]).await;
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap_or(Value::Null);
        assert_eq!(status, 401, "{path}: {v}");
    }
    let keys: Vec<String> = fleet()
        .redis
        .lock()
        .unwrap()
        .command(&["KEYS", "*weir:run:acme/w/p/k*"]);
    assert!(
        keys.is_empty(),
        "an unsigned call reached the store: {keys:?}"
    );
}
