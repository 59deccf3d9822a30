//! The quota store's script against a real Redis (`redis-server` on loopback, one for this
//! binary): grants never exceed what a bucket or a window holds under concurrent renewals,
//! windows reset at their UTC boundaries, returned tokens go back only where they belong, and
//! junk in the store is clamped, never granted.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use weir_core::fleet::{CounterAsk, Grant, Holder, Window};
use weir_e2e::redis_server::Redis;
use weir_sidecar::quota::Store;

fn redis() -> &'static Redis {
    static REDIS: OnceLock<Redis> = OnceLock::new();
    REDIS.get_or_init(Redis::launch)
}

/// A store on this binary's Redis, its keys under `prefix` (one per test).
fn store(prefix: &str) -> Store {
    redis().store(prefix)
}

fn ask(key: &str, window: Window, limit: u64, want: u64) -> CounterAsk {
    CounterAsk {
        key: key.into(),
        window,
        limit,
        want,
        returned: 0,
        returned_window_start_ms: None,
        held: None,
        held_window_start_ms: None,
    }
}

async fn one(store: &Store, ask: CounterAsk, now_ms: Option<u64>) -> Grant {
    held_by(store, None, ask, now_ms).await
}

/// One ask from the Envoy `holder` (none: a filter that names none).
async fn held_by(
    store: &Store,
    holder: Option<&Holder>,
    ask: CounterAsk,
    now_ms: Option<u64>,
) -> Grant {
    let mut grants = store.renew_at(&[ask], holder, now_ms).await.unwrap();
    assert_eq!(grants.len(), 1);
    grants.remove(0)
}

/// A day window's holdings: an Envoy that stops calling has what it held unspent taken back
/// into the budget once its hold has passed without a word from it, by the next call of any
/// other Envoy; one still calling keeps its holding, and a filter that names no holder never
/// touches them. Before, a stopped Envoy's lease was lost until the window reset.
#[tokio::test]
async fn a_quiet_holder_s_unspent_window_lease_goes_back_to_the_budget() {
    let store = store("holders:");
    let key = "weir:e:acme:tpd";
    let (a, b) = (
        Holder {
            id: "a1".into(),
            hold_ms: 5_000,
        },
        Holder {
            id: "b2".into(),
            hold_ms: 5_000,
        },
    );
    let noon = 1_798_718_400_000; // 2026-12-31T12:00Z
    let today = noon - 43_200_000;
    let day = |want: u64, held: u64| CounterAsk {
        held: Some(held),
        held_window_start_ms: Some(today),
        ..ask(key, Window::Day, 10_000, want)
    };
    let g = held_by(&store, Some(&a), day(1_000, 0), Some(noon)).await;
    assert_eq!((g.granted, g.remaining), (1_000, 9_000));
    // A spent 400 and says it holds 600; B, one second later, finds A's holding standing.
    held_by(&store, Some(&a), day(0, 600), Some(noon + 1_000)).await;
    let g = held_by(&store, Some(&b), day(100, 0), Some(noon + 2_000)).await;
    assert_eq!((g.granted, g.remaining), (100, 8_900));
    // A filter naming no holder neither reclaims nor records.
    let g = one(&store, day(0, 0), Some(noon + 9_000)).await;
    assert_eq!(g.remaining, 8_900);
    // A has been quiet past its hold: B's next call puts A's 600 back in the budget, once.
    let g = held_by(&store, Some(&b), day(0, 100), Some(noon + 9_000)).await;
    assert_eq!(g.remaining, 9_500, "A's unspent 600 back");
    let g = held_by(&store, Some(&b), day(0, 100), Some(noon + 9_500)).await;
    assert_eq!(g.remaining, 9_500, "taken back once");
    // B, still calling, keeps its holding however long after its first call.
    let g = held_by(&store, Some(&a), day(0, 0), Some(noon + 14_000)).await;
    assert_eq!(g.remaining, 9_500, "B's 100 stands: it called at +9.5 s");
    let g = held_by(&store, Some(&a), day(0, 0), Some(noon + 15_000)).await;
    assert_eq!(g.remaining, 9_600, "B quiet past its hold since +9.5 s");
    // A holding of yesterday's window that reaches the store today (a call late across the
    // boundary) is not filed as today's: taking it back later would grant today's budget twice.
    let c = Holder {
        id: "c3".into(),
        hold_ms: 5_000,
    };
    let late = CounterAsk {
        held_window_start_ms: Some(today - 86_400_000),
        ..day(0, 5_000)
    };
    held_by(&store, Some(&c), late, Some(noon + 16_000)).await;
    let g = held_by(&store, Some(&a), day(0, 0), Some(noon + 30_000)).await;
    assert_eq!(
        g.remaining, 9_600,
        "nothing of yesterday's taken back into today"
    );
}

/// 2026-12-31T23:59:59.990Z: ten ms before an hour, a day, a month and a year end.
const YEAR_END: u64 = 1_798_761_599_990;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_renewals_never_grant_more_than_the_bucket_holds() {
    let store = Arc::new(store("concurrent:"));
    let limit = 60_000;
    let started = Instant::now();
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut granted = 0;
                for _ in 0..200 {
                    let a = ask("weir:e:acme:itpm", Window::Minute, limit, 500);
                    let g = one(&store, a, None).await;
                    assert!(g.granted <= 500 && g.remaining <= limit, "{g:?}");
                    granted += g.granted;
                }
                granted
            })
        })
        .collect();
    let mut total = 0;
    for task in tasks {
        total += task.await.unwrap();
    }
    let elapsed_ms = started.elapsed().as_millis() as u64;
    // The burst (one full bucket) plus what refilled while the renewals ran (the store's
    // clock reads whole ms: one more).
    let bound = limit + limit * (elapsed_ms + 1) / 60_000;
    println!(
        "8 tasks x 200 renewals of 500 against a 60000/min bucket: granted {total} in \
         {elapsed_ms} ms (bound {bound}: burst {limit} + refill)"
    );
    assert!(total <= bound, "granted {total} > {bound}");
    assert!(total >= limit, "the first burst is granted: {total}");
}

#[tokio::test]
async fn a_bucket_refills_continuously_and_takes_returns_back_up_to_its_capacity() {
    let store = store("bucket:");
    let key = "weir:e:acme/lab:otpm";
    let t = 1_796_183_000_000;
    // A missing bucket starts full: one burst, as a local bucket does.
    let g = one(&store, ask(key, Window::Minute, 600, 1_000), Some(t)).await;
    assert_eq!((g.granted, g.remaining, g.window_start_ms), (600, 0, None));
    assert_eq!(g.resets_ms, t + 60_000, "empty: full again in a minute");
    // Ten seconds refill a sixth.
    let g = one(
        &store,
        ask(key, Window::Minute, 600, 1_000),
        Some(t + 10_000),
    )
    .await;
    assert_eq!(g.granted, 100);
    // Returned tokens go back, capped at the capacity.
    let mut back = ask(key, Window::Minute, 600, 0);
    back.returned = 5_000;
    let g = one(&store, back, Some(t + 10_000)).await;
    assert_eq!((g.granted, g.remaining, g.resets_ms), (0, 600, t + 10_000));
    // A lowered limit clamps what the store holds.
    let g = one(
        &store,
        ask(key, Window::Minute, 50, 1_000),
        Some(t + 10_000),
    )
    .await;
    assert_eq!((g.granted, g.remaining), (50, 0));
    // A clock that went back refills nothing and grants nothing extra.
    let g = one(&store, ask(key, Window::Minute, 600, 1_000), Some(t)).await;
    assert_eq!(g.granted, 0);
}

#[tokio::test]
async fn windows_reset_at_the_boundary_and_take_back_only_their_own_returns() {
    let store = store("window:");
    for window in [Window::Hour, Window::Day, Window::Month] {
        let key = format!("weir:e:acme:spend_{}", window.name());
        let (start, end) = window.bounds(YEAR_END).unwrap();
        let g = one(&store, ask(&key, window, 1_000, 700), Some(YEAR_END)).await;
        assert_eq!(
            (g.granted, g.remaining, g.resets_ms, g.window_start_ms),
            (700, 300, end, Some(start)),
            "{window:?}"
        );
        let g = one(&store, ask(&key, window, 1_000, 700), Some(YEAR_END + 5)).await;
        assert_eq!((g.granted, g.remaining), (300, 0), "{window:?}: the rest");
        // The window ends: a fresh budget, in the next window.
        let g = one(&store, ask(&key, window, 1_000, 400), Some(end)).await;
        let (next_start, next_end) = window.bounds(end).unwrap();
        assert_eq!(
            (g.granted, g.window_start_ms, g.resets_ms),
            (400, Some(end), next_end),
            "{window:?}"
        );
        assert_eq!(next_start, end);
        // Tokens of the old window do not come back into the new one; the new one's do.
        let mut stale = ask(&key, window, 1_000, 0);
        stale.returned = 300;
        stale.returned_window_start_ms = Some(start);
        let g = one(&store, stale.clone(), Some(end + 1)).await;
        assert_eq!(g.remaining, 600, "{window:?}: a stale return is dropped");
        stale.returned_window_start_ms = Some(end);
        let g = one(&store, stale, Some(end + 1)).await;
        assert_eq!(g.remaining, 900, "{window:?}: the current window's return");
    }
    // The old windows' keys expire a little after their window ended.
    let (start, end) = Window::Month.bounds(YEAR_END).unwrap();
    let ttl: i64 = redis().command(&[
        "PTTL",
        &format!("window:weir:e:acme:spend_month:month:{start}"),
    ]);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    // Redis reads its clock before this process does: a second's slack either way.
    let expected = end as i64 + 60_000 - now;
    assert!(
        ttl > 0 && (ttl - expected).abs() <= 1_000,
        "ttl {ttl}, expected {expected}"
    );
}

#[tokio::test]
async fn the_scripts_calendar_is_core_s_calendar() {
    let store = store("calendar:");
    // Every 97 hours and 13 minutes from 2024 (a leap year) to 2031, and the last and first ms
    // of each month of 2028.
    let mut times: Vec<u64> = (0..700)
        .map(|i| 1_704_067_200_000 + i * (97 * 3_600_000 + 13 * 60_000))
        .collect();
    let mut t = 1_830_297_600_000; // 2028-01-01
    for _ in 0..12 {
        let (_, end) = Window::Month.bounds(t).unwrap();
        times.extend([end - 1, end]);
        t = end;
    }
    for window in [Window::Hour, Window::Day, Window::Month] {
        let asks: Vec<CounterAsk> = times
            .iter()
            .map(|_| ask("weir:e:cal:x", window, 1, 0))
            .collect();
        for (now, a) in times.iter().zip(asks) {
            let g = one(&store, a, Some(*now)).await;
            let (start, end) = window.bounds(*now).unwrap();
            assert_eq!(
                (g.window_start_ms, g.resets_ms),
                (Some(start), end),
                "{window:?} at {now}"
            );
        }
    }
    println!("{} times x 3 windows agree with core::fleet", times.len());
}

#[tokio::test]
async fn junk_in_the_store_is_clamped_never_granted() {
    let store = store("junk:");
    let bucket = ask("weir:e:junk:itpm", Window::Minute, 1_000, 5_000);
    let day = ask("weir:e:junk:tpd", Window::Day, 1_000, 5_000);
    let bucket_key = store.stored_key(&bucket);
    let (day_start, _) = Window::Day.bounds(YEAR_END).unwrap();
    let day_key = format!("{}:{day_start}", store.stored_key(&day));
    let t = YEAR_END.to_string();
    let cases: [(&str, &[&str], u64); 7] = [
        // (what, the junk written, granted: at most the limit, never more)
        (
            "negative level",
            &["HSET", &bucket_key, "level", "-1e18", "updated_ms", &t],
            0,
        ),
        (
            "huge level",
            &["HSET", &bucket_key, "level", "1e300", "updated_ms", &t],
            1_000,
        ),
        (
            "level not a number",
            &["HSET", &bucket_key, "level", "nan?", "updated_ms", &t],
            1_000,
        ),
        (
            "updated in the far future",
            &["HSET", &bucket_key, "level", "10", "updated_ms", "9e18"],
            10,
        ),
        (
            "a string where a hash is",
            &["SET", &bucket_key, "x"],
            1_000,
        ),
        ("negative used", &["SET", &day_key, "-50000"], 1_000),
        ("used above any limit", &["SET", &day_key, "1e300"], 0),
    ];
    for (what, junk, expected) in cases {
        redis().command::<()>(&["DEL", &bucket_key, &day_key]);
        redis().command::<()>(junk);
        let a = if junk[1] == day_key { &day } else { &bucket };
        let g = one(&store, a.clone(), Some(YEAR_END)).await;
        println!("{what}: granted {} remaining {}", g.granted, g.remaining);
        assert_eq!(g.granted, expected, "{what}");
        assert!(g.remaining <= 1_000, "{what}: {g:?}");
    }
    // A window key of the wrong type is dropped and counts as a fresh window.
    redis().command::<()>(&["DEL", &day_key]);
    redis().command::<()>(&["HSET", &day_key, "a", "b"]);
    assert_eq!(one(&store, day, Some(YEAR_END)).await.granted, 1_000);
}
