//! The ledger on a real PostgreSQL server: the store itself (its schema created once however
//! many writers start together, inserts idempotent, concurrent writers safe), and acceptance
//! test 4 of fleet mode: two real sidecars write one ledger under load (each with its own Envoy
//! and filter, and clients that sign priced requests to it directly, as the filter with a
//! price table will) while PostgreSQL is stopped for 20 s and started again; afterwards it
//! holds exactly one record per attempt that got a response, the priced ones with their cost,
//! and `weir usage` exports them from PostgreSQL.
//!
//! One server for the binary; the tests take turns on it (one of them stops it).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use serde_json::json;
use weir_core::price::{Price, Usage};
use weir_e2e::postgres::Postgres;
use weir_e2e::{Envoy, Sidecar, Sim, api_key, chat_body, weir_cli};
use weir_sidecar::ledger::UsageRecord;
use weir_sidecar::ledger::postgres as store;
use weir_sidecar::ledger::remote::Store;

const PRICE: Price = Price {
    input: 0.15,
    cached_input: Some(0.075),
    output: 0.6,
};

/// The server, one test at a time.
fn server() -> MutexGuard<'static, Postgres> {
    static SERVER: OnceLock<Mutex<Postgres>> = OnceLock::new();
    let server = SERVER.get_or_init(|| Mutex::new(Postgres::start()));
    server
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn record(tenant: &str, key: &str, request_id: &str) -> UsageRecord {
    UsageRecord {
        tenant: tenant.into(),
        idempotency_key: key.into(),
        attempt: 1,
        request_id: request_id.into(),
        model: "tiny".into(),
        api: "chat_completions".into(),
        replica: "http://r".into(),
        prompt_tokens: 10,
        completion_tokens: 5,
        source: "engine".into(),
        outcome: "ok".into(),
        finished_at_ms: now_ms(),
        ..UsageRecord::default()
    }
}

#[test]
fn the_schema_is_created_once_and_concurrent_writers_add_each_attempt_once() {
    let pg = server();
    let url = pg.url();
    const WRITERS: usize = 4;
    const RECORDS: usize = 50;
    let tenant = "acme/lab/pg/writers";
    // Writers that start together all create the schema if missing; each then writes the same
    // records (a replay) and records of its own under one shared key (attempts numbered from
    // a history read before the others wrote).
    let threads: Vec<_> = (0..WRITERS)
        .map(|w| {
            let url = url.clone();
            std::thread::spawn(move || {
                let mut client = store::connect(&url).unwrap();
                let same: Vec<UsageRecord> = (0..RECORDS)
                    .map(|i| record(tenant, &format!("same-{i}"), &format!("weir-same-{i}")))
                    .collect();
                let own: Vec<UsageRecord> = (0..RECORDS)
                    .map(|i| record(tenant, "shared", &format!("weir-w{w}-{i}")))
                    .collect();
                for (a, b) in same.chunks(10).zip(own.chunks(10)) {
                    client.append_all(a).unwrap();
                    client.append_all(b).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let mut client = store::connect(&url).unwrap();
    let rows = store::query(&mut client, Some(tenant), 0).unwrap();
    let ids: HashSet<&str> = rows.iter().map(|r| r.request_id.as_str()).collect();
    let shared: Vec<u32> = rows
        .iter()
        .filter(|r| r.idempotency_key == "shared")
        .map(|r| r.attempt)
        .collect();
    println!(
        "{WRITERS} concurrent writers: {} rows, {} distinct request ids, shared key attempts 1..={}",
        rows.len(),
        ids.len(),
        shared.iter().max().copied().unwrap_or(0)
    );
    assert_eq!(rows.len(), ids.len(), "no request id twice");
    assert_eq!(rows.len(), RECORDS + WRITERS * RECORDS);
    let mut attempts = shared.clone();
    attempts.sort_unstable();
    assert_eq!(
        attempts,
        (1..=(WRITERS * RECORDS) as u32).collect::<Vec<_>>(),
        "every attempt of the shared key kept, each its own number"
    );
    let history = store::history(&mut client, tenant, "shared").unwrap();
    assert_eq!(history.attempts, (WRITERS * RECORDS) as u32);
    assert!(history.completed);
}

#[test]
fn an_idempotency_key_s_history_is_read_from_postgres_and_the_spool() {
    let pg = server();
    let dir = tempfile::tempdir().unwrap();
    let config: weir_sidecar::config::ledger::LedgerStoreConfig = serde_json::from_value(json!({
        "postgres": {"url_file": pg.url_file()},
        "spool": dir.path().join("spool.sqlite"),
    }))
    .unwrap();
    let tenant = "acme/lab/pg/history";
    // Attempt 1 ran on another sidecar (it is in PostgreSQL); attempt 2 failed here while
    // PostgreSQL was down (it is still in this sidecar's spool).
    let mut client = store::connect(&pg.url()).unwrap();
    let mut first = record(tenant, "moved", "weir-moved-1");
    first.outcome = "cancelled".into();
    client.append_all(&[first]).unwrap();
    let mut second = record(tenant, "moved", "weir-moved-2");
    second.attempt = 2;
    second.outcome = "failed".into();
    let spool = weir_sidecar::ledger::spool::open(&config.spool).unwrap();
    weir_sidecar::ledger::spool::push(&spool, &second).unwrap();
    let reader = weir_sidecar::ledger::Reader::open(dir.path(), Some(&config)).unwrap();
    let past = reader.history(tenant, "moved");
    println!("history of a key split between PostgreSQL and the spool: {past:?}");
    assert_eq!(
        past,
        Some(weir_sidecar::ledger::KeyHistory {
            attempts: 2,
            completed: false
        })
    );
    assert_eq!(
        reader
            .history("acme/lab/pg/other", "moved")
            .map(|h| h.attempts),
        Some(0),
        "keys are per tenant"
    );
}

#[test]
fn ledger_migrates_and_records_run_id() {
    let pg = server();
    // A ledger as the release before runs wrote it, in a database of its own.
    let mut admin = postgres::Client::connect(&pg.url(), postgres::NoTls).unwrap();
    for sql in [
        "DROP DATABASE IF EXISTS weir_before_runs WITH (FORCE)",
        "CREATE DATABASE weir_before_runs",
    ] {
        admin.batch_execute(sql).unwrap();
    }
    let url = format!(
        "{}/weir_before_runs",
        pg.url().strip_suffix("/postgres").unwrap()
    );
    let mut old = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    old.batch_execute(
        "CREATE TABLE weir_usage (tenant TEXT NOT NULL, idempotency_key TEXT NOT NULL,
             attempt INTEGER NOT NULL, request_id TEXT NOT NULL, model TEXT NOT NULL,
             api TEXT NOT NULL, replica TEXT NOT NULL, prompt_tokens BIGINT NOT NULL,
             completion_tokens BIGINT NOT NULL, cached_prompt_tokens BIGINT NOT NULL DEFAULT 0,
             source TEXT NOT NULL, outcome TEXT NOT NULL, queued_ms BIGINT NOT NULL,
             finished_at_ms BIGINT NOT NULL, currency TEXT, price_input DOUBLE PRECISION,
             price_cached_input DOUBLE PRECISION, price_output DOUBLE PRECISION,
             cost_micros BIGINT, route TEXT, mode TEXT,
             PRIMARY KEY (tenant, idempotency_key, attempt));
         INSERT INTO weir_usage (tenant, idempotency_key, attempt, request_id, model, api,
             replica, prompt_tokens, completion_tokens, source, outcome, queued_ms,
             finished_at_ms)
         VALUES ('a/w/p/k', 'k', 1, 'weir-old', 'tiny', 'chat_completions', 'r', 7, 3,
             'engine', 'ok', 1, 100);",
    )
    .unwrap();
    assert!(
        store::connect_read_only(&url).is_err(),
        "weir usage refuses a ledger the sidecar has not migrated yet"
    );
    let mut client = store::connect(&url).unwrap();
    let mut step = record("a/w/p/k", "k2", "weir-run-step");
    step.run_id = Some("run-1".into());
    step.agent_id = Some("planner".into());
    step.tool_calls = 3;
    step.started_at_ms = Some(150);
    client.append_all(&[step]).unwrap();
    let rows: Vec<_> = store::query(&mut client, None, 0)
        .unwrap()
        .into_iter()
        .map(|r| (r.run_id, r.agent_id, r.tool_calls, r.started_at_ms))
        .collect();
    assert_eq!(
        rows,
        [
            (None, None, 0, None),
            (Some("run-1".into()), Some("planner".into()), 3, Some(150))
        ]
    );
    assert!(store::connect_read_only(&url).is_ok(), "migrated");
    drop((client, old));
    admin
        .batch_execute("DROP DATABASE weir_before_runs WITH (FORCE)")
        .unwrap();
}

/// The signed headers the filter would send for a request of `tenant`, every model priced at
/// [`PRICE`] (the table's default).
fn signed(tenant: &str, request_id: &str) -> Vec<(String, String)> {
    let price = weir_core::price::Prices {
        currency: "USD".into(),
        models: Default::default(),
        default: Some(PRICE),
    }
    .to_header();
    weir_e2e::vouched(tenant, request_id, &[("x-weir-price", price.as_str())])
}

/// A metric's value on a sidecar's admin `/metrics` (0 when absent).
async fn metric(sidecar: &Sidecar, name: &str) -> f64 {
    sidecar
        .metrics()
        .await
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// How a load client reaches a sidecar.
#[derive(Clone)]
enum Route {
    /// Straight to the sidecar, signed here as the filter signs, priced at [`PRICE`]: the
    /// request id names the record.
    Signed { sidecar: String, tenant: String },
    /// Through Envoy and the filter with an API key (the filter on this branch sends no price).
    /// The filter's request id is not shown to the client, so these are counted, not named.
    /// Without an `Idempotency-Key`: a key this sidecar does not remember is refused while
    /// PostgreSQL is down (its history cannot be read), which would keep these out of the
    /// outage.
    Gateway { envoy: String, key: String },
}

/// Sends requests until `stop`; returns the ids of those that got a complete answer (for
/// [`Route::Signed`], the request ids that name their records), and the count of those that
/// did not.
async fn load(route: Route, worker: usize, stop: Arc<AtomicBool>) -> (Vec<String>, usize) {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let (mut answered, mut failed) = (Vec::new(), 0);
    let mut n = 0;
    while !stop.load(Ordering::SeqCst) {
        n += 1;
        let id = format!("weir-{worker}-{n}-{}", now_ms());
        let body = chat_body("tiny", &format!("bill me {id}"), json!({"max_tokens": 8}));
        let mut req = match &route {
            Route::Signed { sidecar, .. } => client.post(format!("{sidecar}/v1/chat/completions")),
            Route::Gateway { envoy, key } => client
                .post(format!("{envoy}/v1/chat/completions"))
                .bearer_auth(format!("key-{key}")),
        }
        .header("content-type", "application/json")
        .body(body.to_string());
        if let Route::Signed { tenant, .. } = &route {
            for (k, v) in signed(tenant, &id) {
                req = req.header(k, v);
            }
        }
        let ok = match req.send().await {
            Ok(resp) if resp.status().is_success() => resp
                .json::<serde_json::Value>()
                .await
                .is_ok_and(|v| v["usage"]["completion_tokens"].is_u64()),
            _ => false,
        };
        if ok {
            answered.push(id);
        } else {
            failed += 1;
        }
    }
    (answered, failed)
}

#[test]
fn two_sidecars_share_one_ledger_through_a_postgres_outage() {
    const WORKERS: usize = 6;
    const OUTAGE: Duration = Duration::from_secs(20);
    let mut pg = server();
    let url_file = pg.url_file();
    let sim = Sim::start_tiny_fast(&[]);
    let spool_dir = tempfile::tempdir().unwrap();
    let sidecars: Vec<Sidecar> = (0..2)
        .map(|i| {
            Sidecar::start(json!({
                "queue": {"max_per_tenant": 64, "deadline_ms": 20000},
                "pools": [{"model": "tiny", "replicas": [sim.url]}],
                "ledger_store": {
                    "postgres": {"url_file": url_file},
                    "spool": spool_dir.path().join(format!("spool-{i}.sqlite")),
                },
            }))
        })
        .collect();
    for s in &sidecars {
        s.wait_for_probes(1);
    }
    let gateway_keys = ["one-gw", "two-gw"];
    let weir_config = json!({
        "orgs": [{"id": "acme", "workspaces": [{"id": "lab", "projects": [
            {"id": "pg", "keys": gateway_keys.map(api_key)}]}]}],
        "models": {"tiny": {"max_context_tokens": 4096}},
    });
    // One Envoy with the filter in front of each sidecar.
    let envoys: Vec<Envoy> = sidecars
        .iter()
        .map(|s| Envoy::start(&weir_config, s.port, s.port))
        .collect();
    let signed_tenants = ["acme/lab/pg/one", "acme/lab/pg/two"];
    let tenants = [
        signed_tenants[0],
        signed_tenants[1],
        "acme/lab/pg/one-gw",
        "acme/lab/pg/two-gw",
    ];
    // The clients run on a runtime of their own; this thread stops and starts PostgreSQL.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let depth = |name: &'static str| {
        rt.block_on(futures::future::join_all(
            sidecars.iter().map(|s| metric(s, name)),
        ))
        .into_iter()
        .sum::<f64>()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for i in 0..2 {
        let signed = Route::Signed {
            sidecar: sidecars[i].url.clone(),
            tenant: signed_tenants[i].to_owned(),
        };
        let gateway = Route::Gateway {
            envoy: envoys[i].url.clone(),
            key: gateway_keys[i].to_owned(),
        };
        for w in 0..WORKERS {
            let route = if w % 2 == 0 { &signed } else { &gateway };
            let worker = workers.len();
            let through_gateway = matches!(route, Route::Gateway { .. });
            let task = rt.spawn(load(route.clone(), worker, stop.clone()));
            workers.push((through_gateway, task));
        }
    }
    // Under load: PostgreSQL goes away for OUTAGE, then comes back.
    std::thread::sleep(Duration::from_secs(4));
    pg.stop();
    let down = Instant::now();
    let mut peak = 0.0f64;
    while down.elapsed() < OUTAGE {
        peak = peak.max(depth("weir_ledger_spooled_records"));
        std::thread::sleep(Duration::from_millis(250));
    }
    pg.start_again();
    let back = Instant::now();
    // Still under load: the spools drain while new records keep coming.
    let replayed = weir_e2e::wait_for(Duration::from_secs(60), || {
        (depth("weir_ledger_spooled_records") == 0.0).then(|| back.elapsed())
    })
    .expect("the spools drained within a minute of PostgreSQL's return");
    std::thread::sleep(Duration::from_secs(6).saturating_sub(back.elapsed()));
    stop.store(true, Ordering::SeqCst);
    let (mut answered, mut answered_gateway, mut failed) = (Vec::new(), 0, 0);
    for (through_gateway, w) in workers {
        let (ids, f) = rt.block_on(w).unwrap();
        if through_gateway {
            answered_gateway += ids.len();
        } else {
            answered.extend(ids);
        }
        failed += f;
    }
    weir_e2e::wait_for(Duration::from_secs(30), || {
        let left = depth("weir_ledger_spooled_records") + depth("weir_ledger_pending_records");
        (left == 0.0).then_some(())
    })
    .expect("every record written once the load stopped");
    let store_failures = depth("weir_ledger_store_failures_total");
    assert_eq!(
        depth("weir_ledger_write_failures_total"),
        0.0,
        "no record lost"
    );
    let mut client = store::connect(&pg.url()).unwrap();
    let rows = store::query(&mut client, None, 0).unwrap();
    let rows: Vec<UsageRecord> = rows
        .into_iter()
        .filter(|r| tenants.contains(&r.tenant.as_str()))
        .collect();
    let is_signed = |r: &&UsageRecord| signed_tenants.contains(&r.tenant.as_str());
    let gateway_rows = rows.iter().filter(|r| !is_signed(r)).count();
    let mut by_id: HashMap<&str, usize> = HashMap::new();
    for r in &rows {
        *by_id.entry(r.request_id.as_str()).or_default() += 1;
    }
    let doubled = by_id.values().filter(|n| **n > 1).count();
    let missing: Vec<&String> = answered
        .iter()
        .filter(|id| !by_id.contains_key(id.as_str()))
        .collect();
    let answered_ids: HashSet<&str> = answered.iter().map(String::as_str).collect();
    let unanswered_rows = rows
        .iter()
        .filter(is_signed)
        .filter(|r| !answered_ids.contains(r.request_id.as_str()))
        .count();
    println!(
        "2 sidecars x {WORKERS} clients, PostgreSQL down {OUTAGE:?}: signed to the sidecars: \
         {} answered, {} rows, {unanswered_rows} rows without a complete answer, {} missing; \
         through Envoy: {answered_gateway} answered, {gateway_rows} rows; {failed} not \
         answered; {doubled} request ids doubled; spooled peak {peak}, {store_failures} store failures, \
         spools empty {replayed:?} after PostgreSQL returned (under load)",
        answered.len(),
        rows.len() - gateway_rows,
        missing.len()
    );
    assert!(answered.len() > 100, "the load ran: {}", answered.len());
    assert!(peak > 0.0, "records were spooled during the outage");
    assert!(missing.is_empty(), "answered but not billed: {missing:?}");
    assert_eq!(doubled, 0, "no attempt billed twice");
    assert_eq!(
        unanswered_rows, 0,
        "a record per attempt that got a response, and none other (no client gave up)"
    );
    assert!(
        answered_gateway > 100,
        "the gateway path ran: {answered_gateway}"
    );
    assert_eq!(
        gateway_rows, answered_gateway,
        "through Envoy too: one record per answered attempt"
    );
    for r in rows.iter().filter(is_signed) {
        let usage = Usage {
            input_tokens: r.prompt_tokens,
            cached_input_tokens: r.cached_prompt_tokens,
            output_tokens: r.completion_tokens,
        };
        assert_eq!(r.cost_micros, Some(PRICE.cost_micros(usage)), "{r:?}");
        assert_eq!(r.currency.as_deref(), Some("USD"));
        assert_eq!(r.price_output, Some(PRICE.output));
    }

    // `weir usage` exports the same records, with cost and price, from PostgreSQL.
    let url_file = url_file.display().to_string();
    let out = weir_cli([
        "usage",
        "--since",
        "all",
        "--format",
        "csv",
        "--postgres-url-file",
        &url_file,
    ]);
    let csv = String::from_utf8(out).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let cost = header.iter().position(|h| *h == "cost_micros").unwrap();
    let tenant = header.iter().position(|h| *h == "tenant").unwrap();
    let exported: Vec<Vec<&str>> = lines
        .map(|l| l.split(',').collect::<Vec<_>>())
        .filter(|f| tenants.contains(&f[tenant]))
        .collect();
    let total: u64 = exported
        .iter()
        .map(|f| f[cost].parse::<u64>().unwrap_or(0))
        .sum();
    let cached: u64 = rows.iter().map(|r| r.cached_prompt_tokens).sum();
    let prompt: u64 = rows.iter().map(|r| r.prompt_tokens).sum();
    println!(
        "weir usage --postgres-url-file: {} rows, total cost {total} micro-USD \
         ({prompt} prompt tokens, {cached} of them cached)",
        exported.len()
    );
    assert_eq!(exported.len(), rows.len());
    assert_eq!(
        total,
        rows.iter().filter_map(|r| r.cost_micros).sum::<u64>()
    );
}
