//! Fleet-wide limits in real Envoy: leases of a fleet budget renewed in the background from
//! the quota service (the real sidecar on a real Redis), and what a limit does while the store
//! cannot be reached. Three Envoys share one sidecar, its Redis and the simulator; the tests
//! that use them take turns (one stops Redis).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::net::TcpListener;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use weir_e2e::redis_server::Redis;
use weir_e2e::{Envoy, Sidecar, Sim, api_key_limited, chat_body, post_json, wait_for, weir_cli};

const LIMIT: u64 = 60_000;
const SHARE: f64 = 0.1;

fn fleet_key(id: &str, fail: &str) -> Value {
    api_key_limited(
        id,
        json!({"input_tokens_per_minute": LIMIT,
               "fleet_wide": {"input_tokens_per_minute": fail}}),
    )
}

/// A per-Envoy limit as large as the fleet-wide one: the baseline.
fn local_key(id: &str) -> Value {
    api_key_limited(id, json!({"input_tokens_per_minute": LIMIT}))
}

const RENEW_MS: u64 = 250;
const MAX_LEASE_FRACTION: f64 = 0.1;
const ENVOYS: usize = 3;
/// The monthly spend budget: 1 cent, 10,000 tokens at 1 USD per million.
const SPEND: f64 = 0.01;

struct Fleet {
    _sim: Sim,
    redis: Mutex<Redis>,
    sidecar: Sidecar,
    envoys: Vec<Envoy>,
}

fn fleet() -> &'static Fleet {
    static FLEET: OnceLock<Fleet> = OnceLock::new();
    FLEET.get_or_init(|| {
        let sim = Sim::start(&["--preset", "tiny", "--time-scale", "50", "--output-len", "fixed:1"]);
        let redis = Redis::launch();
        let sidecar = Sidecar::quota_service(&sim.url, &redis);
        let config = json!({
            "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "e2e", "keys": [
                fleet_key("fleet", "fail_closed"),
                local_key("local"),
                fleet_key("open", "fail_open"),
                fleet_key("closed", "fail_closed"),
                api_key_limited("spender", json!({"budgets": [{"window": "month", "spend": SPEND}]})),
            ]}]}]}],
            "models": {"tiny": {"max_context_tokens": 4096}},
            "prices": {"currency": "USD", "default": {"input": 1.0, "output": 1.0}},
            "fleet": {"cluster": "upstream", "renew_ms": RENEW_MS, "timeout_ms": 500,
                      "max_lease_fraction": MAX_LEASE_FRACTION, "fail_open_share": SHARE},
        });
        let envoys = (0..ENVOYS)
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

/// One test at a time on the shared fleet.
async fn turn() -> tokio::sync::MutexGuard<'static, ()> {
    static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    TURN.lock().await
}

/// What `workers` loops per Envoy admit for `key` until `until`: input tokens the engine
/// reported on answers that got 200, and the answers refused.
async fn flood(key: &'static str, workers: usize, until: Instant) -> (u64, u64) {
    let content = "fleet ".repeat(400);
    let mut tasks = Vec::new();
    for envoy in &fleet().envoys {
        for _ in 0..workers {
            let content = content.clone();
            tasks.push(tokio::spawn(async move {
                let (mut admitted, mut refused) = (0, 0);
                while Instant::now() < until {
                    let (status, _, input) = served(envoy, key, &content).await;
                    if status == StatusCode::OK {
                        admitted += input;
                    } else {
                        refused += 1;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
                (admitted, refused)
            }));
        }
    }
    let mut total = (0, 0);
    for t in tasks {
        let (a, r) = t.await.unwrap();
        total = (total.0 + a, total.1 + r);
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_envoys_hold_one_fleet_wide_limit_and_without_it_admit_three_times_as_much() {
    let _turn = turn().await;
    let minutes = 2.0;
    let until = Instant::now() + Duration::from_secs_f64(minutes * 60.0);
    // The fleet tenant and a per-Envoy tenant with the same limit, flooded at the same time.
    let (fleet_run, local_run) = tokio::join!(flood("fleet", 3, until), flood("local", 3, until));
    let (fleet_admitted, local_admitted) = (fleet_run.0, local_run.0);
    let limit = LIMIT as f64;
    // burst (a minute of the rate) + rate·T + Σ outstanding leases + per-request overrun (one
    // request per flooding worker, ~410 tokens, estimated within a few percent).
    let leases = ENVOYS as f64 * MAX_LEASE_FRACTION * limit;
    let overrun = (ENVOYS * 3) as f64 * 450.0;
    let bound = limit + limit * minutes + leases + overrun;
    println!(
        "{minutes} min, {ENVOYS} Envoys, {LIMIT} input tokens/min: fleet-wide admitted {fleet_admitted} (refused {}), bound {bound}; per-Envoy limit admitted {local_admitted} (refused {}); ratio {:.2}",
        fleet_run.1,
        local_run.1,
        local_admitted as f64 / fleet_admitted.max(1) as f64
    );
    assert!(
        fleet_admitted as f64 <= bound,
        "{fleet_admitted} over the bound {bound}"
    );
    assert!(
        fleet_admitted as f64 >= 0.8 * limit * (1.0 + minutes),
        "the fleet limit admitted far less than it allows: {fleet_admitted}"
    );
    assert!(
        local_admitted as f64 >= 2.5 * fleet_admitted as f64,
        "without fleet mode three Envoys should admit about 3x: {local_admitted} vs {fleet_admitted}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_store_fails_open_within_the_share_or_closed_and_both_recover() {
    let _turn = turn().await;
    let envoy = &fleet().envoys[0];
    let content = "fleet ".repeat(400);
    // Both limits are served with the store up (a first request asks for its lease at once).
    for key in ["open", "closed"] {
        let (status, v, _) = served(envoy, key, &content).await;
        assert_eq!(status, StatusCode::OK, "{key} with the store up: {v}");
    }
    fleet().redis.lock().unwrap().stop();
    let down_for = Duration::from_secs(10);
    let until = Instant::now() + down_for;
    let (mut open_admitted, mut closed_unavailable, mut closed_other) = (0u64, 0u32, 0u32);
    while Instant::now() < until {
        let (status, _, input) = served(envoy, "open", &content).await;
        if status == StatusCode::OK {
            open_admitted += input;
        }
        let (status, v, _) = served(envoy, "closed", &content).await;
        match (status, v["error"]["code"].as_str()) {
            (StatusCode::OK, _) => closed_other += 1,
            (_, Some("quota_unavailable")) => closed_unavailable += 1,
            _ => closed_other += 1,
        }
    }
    // What the open limit may spend alone: its lease (at most the max lease) + the share's
    // burst (a full bucket of the share) + its refill over the outage.
    let share = LIMIT as f64 * SHARE;
    let open_bound =
        MAX_LEASE_FRACTION * LIMIT as f64 + share + share * down_for.as_secs_f64() / 60.0 + 450.0;
    println!(
        "store down {down_for:?}: fail_open admitted {open_admitted} input tokens (bound {open_bound}); fail_closed: {closed_unavailable} quota_unavailable, {closed_other} other"
    );
    assert!(open_admitted > 0, "fail_open stopped serving");
    assert!(
        open_admitted as f64 <= open_bound,
        "{open_admitted} over {open_bound}"
    );
    assert!(
        closed_unavailable > 0,
        "fail_closed never answered quota_unavailable"
    );

    // The store comes back on the same port, empty: both recover without a restart.
    fleet().redis.lock().unwrap().start();
    let back = Instant::now();
    for key in ["open", "closed"] {
        let ok = weir_e2e::wait_for(Duration::from_secs(15), || {
            let status = futures_block(served(envoy, key, &content)).0;
            (status == StatusCode::OK).then_some(())
        });
        assert!(
            ok.is_some(),
            "{key} did not recover after the store returned"
        );
    }
    println!("recovered {:?} after the store returned", back.elapsed());
    // An empty store never grants more than a full bucket plus its refill.
    let window = Duration::from_secs(5);
    let (admitted, _) = {
        let until = Instant::now() + window;
        let mut admitted = 0;
        let mut refused = 0;
        while Instant::now() < until {
            let (status, _, input) = served(envoy, "closed", &content).await;
            if status == StatusCode::OK {
                admitted += input;
            } else {
                refused += 1;
            }
        }
        (admitted, refused)
    };
    let bound =
        LIMIT as f64 * (1.0 + window.as_secs_f64() / 60.0) + MAX_LEASE_FRACTION * LIMIT as f64;
    println!("after the restart, {window:?}: {admitted} admitted (bound {bound})");
    assert!(admitted as f64 <= bound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_monthly_spend_budget_refuses_with_budget_exceeded_until_the_first_of_next_month() {
    let _turn = turn().await;
    let content = "fleet ".repeat(400);
    let (mut spent, mut served_n) = (0u64, 0u32);
    let mut exceeded = None;
    let started = Instant::now();
    while exceeded.is_none() && started.elapsed() < Duration::from_secs(60) {
        for envoy in &fleet().envoys {
            let body = chat_body("tiny", &content, json!({"max_tokens": 4})).to_string();
            let url = format!("{}/v1/chat/completions", envoy.url);
            let r = post_json(&url, Some("spender"), body, &[]).await;
            let (status, headers) = (r.status(), r.headers().clone());
            let v: Value = r.json().await.unwrap_or(Value::Null);
            if status == StatusCode::OK {
                served_n += 1;
                spent += v["usage"]["total_tokens"].as_u64().unwrap_or(0);
            } else if v["error"]["code"] == "budget_exceeded" {
                exceeded = Some((v, headers));
                break;
            } else {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    let (v, headers) = exceeded.expect("the budget was never exceeded");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let (_, month_end) = weir_core::fleet::Window::Month.bounds(now).unwrap();
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("")
    };
    println!(
        "{served_n} answers served, {spent} tokens (= {spent} micro-USD at 1 USD/M) of a {SPEND} USD month; then {v}; x-weir-budget-exceeded: {}; retry-after {}",
        header("x-weir-budget-exceeded"),
        header("retry-after")
    );
    assert_eq!(v["error"]["type"], "insufficient_quota");
    let resets = header("x-weir-budget-exceeded")
        .split("; ")
        .find_map(|kv| kv.strip_prefix("resets="))
        .and_then(weir_core::config::parse_rfc3339);
    assert_eq!(
        resets,
        Some(month_end),
        "resets on the first of next month, 00:00 UTC"
    );
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("month spend budget") && message.contains("T00:00:00Z"),
        "{message}"
    );
    let retry_after: u64 = header("retry-after").parse().unwrap_or(0);
    assert!(
        retry_after.abs_diff((month_end - now) / 1_000) <= 5,
        "{retry_after}"
    );
    // What was served stays within the budget, plus one request's overrun per Envoy.
    assert!(
        spent <= 10_000 + ENVOYS as u64 * 450,
        "{spent} micro-USD spent of 10,000"
    );
    assert!(
        spent >= 5_000,
        "the budget refused long before it was spent: {spent}"
    );

    // The export bills each answer at the price the filter vouched for (the table's default,
    // 1 USD per million tokens of each kind): one row per answer, its cost its tokens.
    let tenant = Some("acme/lab/e2e/spender");
    wait_for(Duration::from_secs(5), || {
        (fleet().sidecar.ledger_rows(tenant).len() as u32 >= served_n).then_some(())
    });
    let ledger = fleet().sidecar.ledger.display().to_string();
    let out = weir_cli([
        "usage",
        "--since",
        "all",
        "--format",
        "json",
        "--tenant",
        "acme/lab/e2e/spender",
        "--ledger",
        &ledger,
    ]);
    let rows: Vec<Value> = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        rows.len() as u32,
        served_n,
        "one record per answer: {rows:?}"
    );
    let billed: u64 = rows.iter().filter_map(|r| r["cost_micros"].as_u64()).sum();
    for r in &rows {
        assert_eq!(
            (
                r["currency"].as_str(),
                r["price_input"].as_f64(),
                r["price_output"].as_f64()
            ),
            (Some("USD"), Some(1.0), Some(1.0)),
            "{r}"
        );
        let tokens =
            r["prompt_tokens"].as_u64().unwrap_or(0) + r["completion_tokens"].as_u64().unwrap_or(0);
        assert_eq!(r["cost_micros"].as_u64(), Some(tokens), "{r}");
    }
    println!(
        "the export bills {} answers {billed} micro-USD at USD 1/1/1 per million",
        rows.len()
    );
    assert_eq!(billed, spent, "the ledger bills what the answers reported");
}

/// Runs a future to completion from a synchronous probe inside a multi-threaded runtime.
fn futures_block<F: std::future::Future>(f: F) -> F::Output {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))
}

/// A port nothing listens on: the quota service's cluster, unreachable.
fn closed_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The prompt tokens the engine reported for one answer, if it was served.
async fn served(envoy: &Envoy, key: &str, content: &str) -> (StatusCode, Value, u64) {
    let body = chat_body("tiny", content, json!({"max_tokens": 4})).to_string();
    let r = post_json(
        &format!("{}/v1/chat/completions", envoy.url),
        Some(key),
        body,
        &[],
    )
    .await;
    let status = r.status();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    let input = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    (status, v, input)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_s_first_request_and_its_first_after_idle_are_served() {
    // A fresh Envoy on the fleet's quota service: its first request finds no lease, asks the
    // store at once and waits for the answer instead of being refused; so is the first after
    // the tenant was idle (whether its lease lapsed or the renewal kept it: a lease that lapsed
    // is `Unleased` in `core/src/allowance.rs`'s tests).
    let _turn = turn().await;
    let quota = fleet().sidecar.port;
    let config = json!({
        "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "e2e", "keys": [
            // Fleet-wide requests and tokens: the count is owed at the headers, the tokens
            // asked for with the body.
            api_key_limited("first", json!({
                "requests_per_minute": 100, "input_tokens_per_minute": LIMIT,
                "fleet_wide": {"requests_per_minute": "fail_closed",
                               "input_tokens_per_minute": "fail_closed"}})),
        ]}]}]}],
        "models": {"tiny": {"max_context_tokens": 4096}},
        "fleet": {"cluster": "upstream", "renew_ms": 1_000, "timeout_ms": 2_000,
                  "lease_ttl_ms": 1_000},
    });
    let envoy = Envoy::start(&config, quota, quota);
    let content = "fleet ".repeat(200);
    // The first request's own ask brings only what it lacked: those right after it find the
    // lease short while the store holds plenty, and ask at once too (before, a 429 saying
    // "remaining 0" until the period's renewal topped the lease up).
    let moments = [
        ("first", 0),
        ("right after", 0),
        ("right after that", 3),
        ("after 3 s idle", 0),
    ];
    for (moment, idle_s) in moments {
        let (status, v, input) = served(&envoy, "first", &content).await;
        println!("{moment}: {status}, {input} input tokens");
        assert_eq!(status, StatusCode::OK, "{moment}: {v}");
        assert!(input > 0, "{moment}: {v}");
        tokio::time::sleep(Duration::from_secs(idle_s)).await;
    }
    let asked = envoy
        .stats()
        .await
        .get("weir.fleet.leases_asked_at_once")
        .copied();
    assert!(
        asked >= Some(1),
        "the first request asked at once: {asked:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_envoy_s_unspent_lease_goes_back_to_the_window_s_budget() {
    // An hourly budget is a calendar window: what a stopped Envoy's lease held unspent was
    // lost to the fleet until the hour ended, so every rollout shrank it. Now each Envoy tells
    // the store what it holds every period, and the store takes back the holding of one it has
    // not heard from within its hold at the next call of another.
    let _turn = turn().await;
    let f = fleet();
    let quota = f.sidecar.port;
    let config = json!({
        "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "e2e", "keys": [
            api_key_limited("returner", json!({
                "budgets": [{"window": "hour", "input_tokens": 1_000_000}]})),
        ]}]}]}],
        "models": {"tiny": {"max_context_tokens": 4096}},
        "fleet": {"cluster": "upstream", "renew_ms": RENEW_MS, "timeout_ms": 1_000},
    });
    // Served input tokens of `n` requests through `envoy`.
    async fn spend(envoy: &Envoy, n: usize) -> u64 {
        let content = "fleet ".repeat(100);
        let mut spent = 0;
        for _ in 0..n {
            let (status, v, input) = served(envoy, "returner", &content).await;
            assert_eq!(status, StatusCode::OK, "{v}");
            spent += input;
        }
        spent
    }
    // What the store counts as used this hour, and what each Envoy last said it holds.
    let store = || -> (u64, Vec<(String, u64)>) {
        let redis = f.redis.lock().unwrap();
        let mut keys: Vec<String> = redis.command(&["KEYS", "*acme/lab/e2e/returner*hour*"]);
        keys.sort();
        let [count, held] = &keys[..] else {
            panic!("a count and its holdings: {keys:?}")
        };
        let used: String = redis.command(&["GET", count]);
        let holders: Vec<(String, String)> = redis.command(&["HGETALL", held]);
        let holders = holders
            .into_iter()
            .map(|(id, v)| (id, v.split(':').next().unwrap().parse().unwrap()))
            .collect();
        (used.parse().unwrap(), holders)
    };
    let mut first = Envoy::start(&config, quota, quota);
    let spent_first = spend(&first, 5).await;
    // Drained: its traffic over, it has told the store what it holds since (an Envoy killed
    // mid-traffic may have spent some of its last report's holding: the documented bound).
    let held = wait_for(Duration::from_secs(5), || {
        let (used, holders) = store();
        let [(_, reported)] = holders[..] else {
            return None;
        };
        let held = used.checked_sub(spent_first)?;
        (held > 0 && reported.abs_diff(held) <= 5).then_some(held)
    })
    .expect("a lease beyond what was spent, held by one Envoy and reported");
    let stopped = tokio::task::block_in_place(|| first.terminate(Duration::from_secs(10)));
    assert!(stopped.is_some(), "Envoy exits on SIGTERM");
    let hold =
        Duration::from_millis(10 * RENEW_MS).max(Duration::from_secs(5)) + Duration::from_secs(1);
    tokio::time::sleep(hold).await;
    // Another Envoy's calls for the tenant take the stopped one's holding back.
    let second = Envoy::start(&config, quota, quota);
    let spent_second = spend(&second, 3).await;
    // Counted as used: every grant, so what was spent and what the running Envoy holds, to
    // within the requests' estimate errors (an answer's prompt a token over its reservation
    // is a debt on the lease until the next grant repays it).
    let spent = spent_first + spent_second;
    let settled = wait_for(Duration::from_secs(5), || {
        let (used, holders) = store();
        let [(_, unspent)] = holders[..] else {
            return None;
        };
        (used.abs_diff(spent + unspent) <= 8).then_some(())
    });
    let (used, holders) = store();
    println!(
        "spent {spent_first} then {spent_second}; the first Envoy held {held} more; \
         the store counts {used}, holders {holders:?}"
    );
    assert!(
        settled.is_some(),
        "the store counts what was spent and what the running Envoy holds, not the stopped one's {held}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_store_fails_closed_or_serves_only_the_local_share() {
    let sim = Sim::start(&[
        "--preset",
        "tiny",
        "--time-scale",
        "20",
        "--output-len",
        "fixed:4",
    ]);
    let config = json!({
        "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [{"id": "e2e", "keys": [
            fleet_key("closed", "fail_closed"),
            fleet_key("open", "fail_open"),
        ]}]}]}],
        "models": {"tiny": {"max_context_tokens": 4096}},
        "fleet": {"cluster": "alt", "renew_ms": 100, "timeout_ms": 500, "fail_open_share": SHARE},
    });
    let envoy = Envoy::start(&config, sim.port, closed_port());
    let content = "fleet ".repeat(200);

    // fail_closed: cold first (no grant yet), then the failed renewal marks the store down.
    let mut unavailable = None;
    for _ in 0..50 {
        let (status, v, _) = served(&envoy, "closed", &content).await;
        assert_ne!(
            status,
            StatusCode::OK,
            "nothing may be served without a lease: {v}"
        );
        if v["error"]["code"] == "quota_unavailable" {
            unavailable = Some(v);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let unavailable = unavailable.expect("fail_closed never answered quota_unavailable");
    println!("fail_closed while the store is down: {unavailable}");
    assert!(
        unavailable["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("input_tokens_per_minute") && !m.contains("e2e/open")),
        "{unavailable}"
    );

    // fail_open: served from the local share, 10% of 60,000 per minute, and no more.
    let (mut admitted, mut ok, mut refused) = (0u64, 0u32, 0u32);
    for _ in 0..60 {
        let (status, v, input) = served(&envoy, "open", &content).await;
        match status {
            StatusCode::OK => {
                ok += 1;
                admitted += input;
            }
            StatusCode::TOO_MANY_REQUESTS => {
                refused += 1;
                assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{v}");
            }
            other => panic!("unexpected {other}: {v}"),
        }
    }
    let share = (LIMIT as f64 * SHARE) as u64;
    println!(
        "fail_open while the store is down: {ok} served ({admitted} input tokens), {refused} \
         refused; local share {share}/min"
    );
    assert!(ok > 0, "fail_open stopped serving");
    // The share refills at 100 tokens/s while the loop runs: a few seconds of it at most.
    assert!(
        admitted <= share + 1_500,
        "{admitted} admitted over a share of {share}"
    );
    assert!(refused > 0, "the share did not bound what was served");
    let failures = envoy.stat("wasmcustom.weir.fleet.renewal_failures").await;
    println!("renewal failures: {failures:?}");
    assert!(failures.is_some_and(|f| f > 0));
}
