//! The quota service through the real sidecar binary on a real Redis: a signed renewal is
//! granted; unsigned, forged, replayed and bad-digest calls are refused (401) before the store
//! is touched; a store that hangs or dies is a quick 503 `quota_store_unavailable`, and grants
//! resume, from a store restarted empty, without restarting the sidecar.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use weir_core::fleet::{LeaseResponse, PATH};
use weir_core::{signature, trusted};
use weir_e2e::redis_server::Redis;
use weir_e2e::{Sidecar, sidecar_bin, signing_secret};

/// The store the tests that keep it running share; the outage test has its own.
fn redis() -> &'static Redis {
    static REDIS: OnceLock<Redis> = OnceLock::new();
    REDIS.get_or_init(Redis::launch)
}

/// A sidecar config whose one pool has no engine: the lease endpoint needs none.
fn config() -> Value {
    json!({"pools": [{"model": "m", "replicas": ["http://127.0.0.1:9"]}]})
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn hex_sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Headers as (name, value).
type Headers = Vec<(String, String)>;

/// The headers a filter sends with a renewal of `body`: its digest and a unique id, signed
/// with `secret` for 30 s.
fn signed(secret: &str, body: &str) -> Headers {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let id = format!(
        "lease-{}-{}",
        std::process::id(),
        CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let mut headers = vec![
        (trusted::BODY_SHA256.to_owned(), hex_sha256(body.as_bytes())),
        (trusted::REQUEST_ID.to_owned(), id),
    ];
    let view: Vec<(&str, &str)> = headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    let sig = signature::sign(secret.as_bytes(), &view, now_ms() + 30_000).unwrap();
    headers.push((trusted::SIGNATURE.to_owned(), sig));
    headers
}

/// POSTs a renewal: status and body.
async fn call(sidecar: &Sidecar, headers: &Headers, body: &str) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .post(format!("{}{PATH}", sidecar.url))
        .header("content-type", "application/json")
        .body(body.to_owned());
    for (name, value) in headers {
        req = req.header(name, value);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

fn renewal(asks: Value) -> String {
    json!({ "counters": asks }).to_string()
}

fn minute(key: &str, limit: u64, want: u64) -> Value {
    json!({"key": key, "window": "minute", "limit": limit, "want": want})
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn signed_renewals_are_granted_and_every_other_call_is_refused_before_the_store() {
    let redis = redis();
    let sidecar = Sidecar::start_with_quota(&sidecar_bin(), config(), redis);
    let secret = signing_secret();

    let body = renewal(json!([
        minute("weir:e:acme/lab:itpm", 1_000, 400),
        {"key": "weir:e:acme/lab:spend", "window": "day", "limit": 5_000, "want": 6_000},
    ]));
    let headers = signed(secret, &body);
    let (status, answer) = call(&sidecar, &headers, &body).await;
    assert_eq!(status, 200, "{answer}");
    let grants: LeaseResponse = serde_json::from_value(answer.clone()).unwrap();
    let figures: Vec<(u64, u64, bool)> = grants
        .grants
        .iter()
        .map(|g| (g.granted, g.remaining, g.window_start_ms.is_some()))
        .collect();
    println!("signed renewal: {answer}");
    assert_eq!(figures, [(400, 600, false), (5_000, 0, true)]);
    assert_eq!(grants.grants[0].key, "weir:e:acme/lab:itpm");

    // Everything below is refused before the store: it stays empty.
    redis.flushall();
    let other = "fedcba9876543210fedcba9876543210-not-the-secret";
    let bad_digest = signed(secret, &renewal(json!([])));
    let no_digest: Headers = {
        let id = vec![(trusted::REQUEST_ID.to_owned(), "lease-no-digest".to_owned())];
        let view: Vec<(&str, &str)> = id.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        let sig = signature::sign(secret.as_bytes(), &view, now_ms() + 30_000).unwrap();
        [id, vec![(trusted::SIGNATURE.to_owned(), sig)]].concat()
    };
    let mut tampered = signed(secret, &body);
    tampered[0].1 = hex_sha256(b"another body");
    let refusals: [(&str, Headers, u16, &str); 6] = [
        ("unsigned", vec![], 401, "untrusted_request"),
        ("forged", signed(other, &body), 401, "untrusted_request"),
        ("replayed", headers.clone(), 401, "replayed_request"),
        (
            "body not the signed one",
            bad_digest,
            401,
            "untrusted_request",
        ),
        ("digest not signed", no_digest, 401, "untrusted_request"),
        ("digest changed", tampered, 401, "untrusted_request"),
    ];
    for (what, headers, status, code) in refusals {
        let (got, answer) = call(&sidecar, &headers, &body).await;
        println!("{what}: {got} {answer}");
        assert_eq!(
            (got, answer["error"]["code"].as_str()),
            (status, Some(code)),
            "{what}"
        );
        assert!(
            answer.get("grants").is_none(),
            "{what}: an unsigned caller learns nothing"
        );
    }
    // Signed, but not a renewal the store may hold.
    for (what, asks, param) in [
        (
            "a key of the caller's choosing",
            json!([minute("tenant-chosen", 10, 10)]),
            "counters[0]",
        ),
        (
            "an unbounded limit",
            json!([minute("weir:e:acme:itpm", 1 << 51, 10)]),
            "counters[0]",
        ),
        (
            "an unknown window",
            json!([{"key": "weir:e:acme:x", "window": "week", "limit": 1, "want": 1}]),
            "counters[0].window",
        ),
    ] {
        let body = renewal(asks);
        let (got, answer) = call(&sidecar, &signed(secret, &body), &body).await;
        println!("{what}: {got} {answer}");
        assert_eq!(got, 400, "{what}: {answer}");
        assert_eq!(answer["error"]["code"], "invalid_lease_request", "{what}");
        assert_eq!(answer["error"]["param"], param, "{what}");
    }
    let huge = "x".repeat(2 * 1024 * 1024);
    let (got, _) = call(&sidecar, &signed(secret, &huge), &huge).await;
    assert_eq!(got, 413, "a body over the bound");
    assert_eq!(redis.dbsize(), 0, "no refused call reached the store");

    let text = sidecar.metrics().await;
    let granted = metric(
        &text,
        r#"weir_quota_granted_total{tenant="acme",window="minute"}"#,
    );
    assert_eq!(
        granted, 400.0,
        "the grant is counted per tenant (its org, the default depth) and window"
    );

    // Without a `quota` section the endpoint is an unknown route.
    let plain = Sidecar::start(config());
    let (got, answer) = call(&plain, &signed(secret, &body), &body).await;
    assert_eq!(got, 404);
    assert_eq!(answer["error"]["type"], "invalid_request_error", "{answer}");
    assert!(answer["error"]["code"].is_null(), "{answer}");
}

#[tokio::test]
async fn a_store_that_hangs_or_dies_is_a_quick_503_and_grants_resume_when_it_returns() {
    let mut redis = Redis::launch();
    let mut config = config();
    config["quota"] =
        json!({"redis_url_env": weir_e2e::redis_server::REDIS_URL_ENV, "timeout_ms": 250});
    let sidecar = Sidecar::start_with_quota(&sidecar_bin(), config, &redis);
    let secret = signing_secret();
    let renew = |want: u64| {
        let body = renewal(json!([minute("weir:e:acme:itpm", 600, want)]));
        (signed(secret, &body), body)
    };
    let (headers, body) = renew(500);
    let (status, answer) = call(&sidecar, &headers, &body).await;
    assert_eq!(
        (status, answer["grants"][0]["granted"].as_u64()),
        (200, Some(500))
    );

    // A store that hangs (frozen: connections open, no answers), then one that is gone.
    for (what, outage) in [("hangs", 0), ("is gone", 1)] {
        if outage == 0 {
            redis.pause();
        } else {
            redis.resume();
            redis.stop();
        }
        let mut slowest = Duration::ZERO;
        for _ in 0..3 {
            let (headers, body) = renew(100);
            let started = Instant::now();
            let (status, answer) = call(&sidecar, &headers, &body).await;
            slowest = slowest.max(started.elapsed());
            assert_eq!(status, 503, "{what}: {answer}");
            assert_eq!(answer["error"]["type"], "server_error");
            assert_eq!(answer["error"]["code"], "quota_store_unavailable");
        }
        println!(
            "store {what}: 503 quota_store_unavailable, slowest answer {slowest:?} (timeout 250 ms)"
        );
        assert!(
            slowest < Duration::from_millis(1_000),
            "{what}: {slowest:?}"
        );
    }

    // Back, empty, on the same port: grants resume without a sidecar restart, from a full
    // bucket (one burst), never more than the limit.
    redis.start();
    let back = Instant::now();
    let answer = loop {
        let (headers, body) = renew(10_000);
        let (status, answer) = call(&sidecar, &headers, &body).await;
        if status == 200 {
            break answer;
        }
        assert!(
            back.elapsed() < Duration::from_secs(10),
            "grants resume: {answer}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!(
        "store back (empty): granted again after {:?}: {answer}",
        back.elapsed()
    );
    let grant = &answer["grants"][0];
    assert_eq!(grant["granted"], 600, "a store restarted empty starts full");
    assert_eq!(grant["remaining"], 0);

    let text = sidecar.metrics().await;
    let timeouts = metric(&text, r#"weir_quota_store_errors_total{kind="timeout"}"#);
    let errors = metric(&text, r#"weir_quota_store_errors_total{kind="error"}"#);
    println!("store errors: {timeouts} timeouts, {errors} errors");
    assert!(timeouts >= 1.0 && timeouts + errors >= 6.0, "{text}");
}

#[tokio::test]
async fn renewals_reach_a_store_over_tls_whose_certificate_is_checked() {
    let redis = Redis::launch_tls();
    let sidecar = Sidecar::start_with_quota(&sidecar_bin(), config(), &redis);
    let body = renewal(json!([minute("weir:e:acme:itpm", 600, 200)]));
    let (status, answer) = call(&sidecar, &signed(signing_secret(), &body), &body).await;
    println!("rediss:// with the store's CA: {status} {answer}");
    assert_eq!(
        (status, answer["grants"][0]["granted"].as_u64()),
        (200, Some(200))
    );
    assert!(redis.url().starts_with("rediss://"));

    // Without its CA (the platform's roots only), the store's certificate is not trusted.
    let mut untrusting = config();
    untrusting["quota"] = json!({"redis_url_env": weir_e2e::redis_server::REDIS_URL_ENV});
    let sidecar = Sidecar::start_with_env(
        &sidecar_bin(),
        untrusting,
        &[],
        &[(weir_e2e::redis_server::REDIS_URL_ENV, &redis.url())],
    );
    let (status, answer) = call(&sidecar, &signed(signing_secret(), &body), &body).await;
    println!("rediss:// without the store's CA: {status} {answer}");
    assert_eq!(status, 503, "{answer}");
}

#[tokio::test]
async fn a_sidecar_started_while_the_store_is_down_serves_renewals_once_it_is_up() {
    let mut redis = Redis::launch();
    redis.stop();
    let sidecar = Sidecar::start_with_quota(&sidecar_bin(), config(), &redis);
    let renew = || {
        let body = renewal(json!([minute("weir:e:acme:rpm", 60, 10)]));
        (signed(signing_secret(), &body), body)
    };
    let (headers, body) = renew();
    let (status, answer) = call(&sidecar, &headers, &body).await;
    assert_eq!(status, 503, "{answer}");
    redis.start();
    let back = Instant::now();
    loop {
        let (headers, body) = renew();
        let (status, answer) = call(&sidecar, &headers, &body).await;
        if status == 200 {
            println!(
                "started without its store: served {:?} after it came up",
                back.elapsed()
            );
            assert_eq!(answer["grants"][0]["granted"], 10);
            break;
        }
        assert!(back.elapsed() < Duration::from_secs(10), "{answer}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_sidecars_on_one_store_grant_no_more_than_it_holds() {
    let redis = Redis::launch();
    let sidecars = [
        Sidecar::start_with_quota(&sidecar_bin(), config(), &redis),
        Sidecar::start_with_quota(&sidecar_bin(), config(), &redis),
    ];
    let limit = 60_000;
    let started = Instant::now();
    let calls = (0..8).map(|task| {
        let sidecar = &sidecars[task % 2];
        async move {
            let mut granted = 0;
            for _ in 0..50 {
                let body = renewal(json!([minute("weir:e:fleet:itpm", limit, 1_000)]));
                let (status, answer) = call(sidecar, &signed(signing_secret(), &body), &body).await;
                assert_eq!(status, 200, "{answer}");
                granted += answer["grants"][0]["granted"].as_u64().unwrap();
            }
            granted
        }
    });
    let total: u64 = futures::future::join_all(calls).await.into_iter().sum();
    let elapsed_ms = started.elapsed().as_millis() as u64;
    let bound = limit + limit * (elapsed_ms + 1) / 60_000;
    println!(
        "2 sidecars, 8 callers x 50 renewals of 1000 against one 60000/min counter: granted \
         {total} in {elapsed_ms} ms (bound {bound}: burst + refill)"
    );
    assert!(total <= bound, "granted {total} > {bound}");
    assert!(total >= limit, "the burst is granted: {total}");
}
