//! Several sidecars per pool (fleet mode's acceptance test 5), through the real stack: one
//! Envoy with the built filter hashing each org to one of two sidecars, both fronting the same
//! two simulator replicas with `sidecars: 2` (each admits against half of every replica). One
//! sidecar is stopped under load as a platform stops it (SIGTERM, a short grace): its streams
//! end with an error event and a record each, its orgs' new requests reach the survivor, and
//! the survivor still keeps small tenants' latency through the flood.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use weir_e2e::{Envoy, Sidecar, Sim, api_key, chat_body, kept_latency, p95, post_json};

/// Orgs `o0` … `o15`, one key each (`key-o{i}`): enough that both sidecars get several.
const ORGS: usize = 16;
/// What each sidecar's pool allows per replica, and the simulators' own slots: with
/// `sidecars: 2` each sidecar runs at most half, so the two together never queue in an engine.
const SLOTS: u64 = 8;
/// The shutdown grace of the sidecars: short, so the flood's streams are cut.
const GRACE_MS: u64 = 500;
/// How long a stopping sidecar still accepts requests while its `/ready` says 503.
const LEAVE_MS: u64 = 1000;

fn weir_config() -> Value {
    let orgs: Vec<Value> = (0..ORGS)
        .map(|i| {
            json!({"id": format!("o{i}"), "workspaces": [{"id": "w", "projects": [{"id": "p",
                "keys": [api_key(&format!("o{i}"))]}]}]})
        })
        .collect();
    json!({"orgs": orgs, "models": {"tiny": {"max_context_tokens": 4096}}})
}

fn sidecar_config(sims: &[Sim]) -> Value {
    json!({
        "shutdown_grace_ms": GRACE_MS,
        // Time for Envoy's health checks (250 ms apart) to see `/ready` say 503.
        "shutdown_leave_ms": LEAVE_MS,
        "queue": {"max_per_tenant": 64, "deadline_ms": 20000},
        "pools": [{
            "model": "tiny",
            "replicas": sims.iter().map(|s| s.url.clone()).collect::<Vec<_>>(),
            "max_concurrency_per_replica": SLOTS,
            "sidecars": 2,
        }],
    })
}

fn prompt(tag: &str, tokens: usize) -> String {
    format!("{tag}: {}", "pack the cache ".repeat(tokens / 3))
}

/// How a streamed request ended, as its client saw it.
#[derive(Clone, Debug, PartialEq)]
enum Ending {
    /// The whole answer.
    Done,
    /// An error event in the stream, with its code.
    Cut(String),
    /// Refused or failed before streaming: the status and the error's code.
    Status(u16, String),
}

/// One streamed request: when it was sent, its time to first token, how it ended.
#[derive(Clone, Debug)]
struct Sample {
    sent: Instant,
    ttft: Option<f64>,
    ending: Ending,
}

/// Streams one chat completion as org `org`'s key.
async fn stream(url: &str, org: &str, prompt_tokens: usize, max_tokens: u64) -> Sample {
    let body = chat_body(
        "tiny",
        &prompt(&format!("{org} asks"), prompt_tokens),
        json!({"stream": true, "max_tokens": max_tokens, "ignore_eos": true}),
    )
    .to_string();
    let sent = Instant::now();
    let mut resp = post_json(url, Some(org), body, &[]).await;
    if resp.status() != StatusCode::OK {
        let status = resp.status().as_u16();
        let error: Value = resp.json().await.unwrap_or_default();
        // weir's code, else Envoy's reason (its local replies carry the status as the code).
        let code = match error["error"]["code"].as_str() {
            Some(code) => code.to_owned(),
            None => error["error"]["message"].as_str().unwrap_or("?").to_owned(),
        };
        return Sample {
            sent,
            ttft: None,
            ending: Ending::Status(status, code),
        };
    }
    let (mut ttft, mut text) = (None, String::new());
    while let Ok(Some(chunk)) = resp.chunk().await {
        let chunk = String::from_utf8_lossy(&chunk);
        if ttft.is_none() && chunk.contains("\"content\":\" ") {
            ttft = Some(sent.elapsed().as_secs_f64());
        }
        text.push_str(&chunk);
    }
    let ending = match text.split("\n\n").find(|e| e.contains("\"error\"")) {
        Some(event) => {
            let event: Value =
                serde_json::from_str(event.trim().trim_start_matches("data: ")).unwrap_or_default();
            Ending::Cut(event["error"]["code"].as_str().unwrap_or("?").to_owned())
        }
        None if text.contains("[DONE]") => Ending::Done,
        None => Ending::Cut("connection ended".to_owned()),
    };
    Sample { sent, ttft, ending }
}

/// Each org's sidecar (index into `sidecars`), from three requests per org: all three must be
/// in the ledger of one sidecar and only there.
async fn placement(envoy: &Envoy, sidecars: &[&Sidecar]) -> Vec<usize> {
    let url = format!("{}/v1/chat/completions", envoy.url);
    // One after another: a burst on a sidecar that has not measured its pool's rate yet may
    // be turned away as a projected wait.
    for (i, n) in (0..ORGS).flat_map(|i| (0..3).map(move |n| (i, n))) {
        let body = chat_body(
            "tiny",
            &format!("where is o{i}? {n}"),
            json!({"max_tokens": 1}),
        );
        let id = format!("where-o{i}-{n}");
        let resp = post_json(
            &url,
            Some(&format!("o{i}")),
            body.to_string(),
            &[("idempotency-key", &id)],
        )
        .await;
        assert_eq!(
            resp.status(),
            StatusCode::OK,
            "{}",
            resp.text().await.unwrap()
        );
    }
    let rows = weir_e2e::wait_for(Duration::from_secs(5), || {
        let rows: Vec<Vec<_>> = sidecars.iter().map(|s| s.ledger_rows(None)).collect();
        (rows.iter().map(Vec::len).sum::<usize>() == 3 * ORGS).then_some(rows)
    })
    .expect("one record per request");
    (0..ORGS)
        .map(|i| {
            let tenant = format!("o{i}/w/p/o{i}");
            let on: Vec<usize> = rows
                .iter()
                .map(|r| r.iter().filter(|r| r.tenant == tenant).count())
                .collect();
            let home = on.iter().position(|&n| n > 0).unwrap();
            assert_eq!(on[home], 3, "all of o{i}'s requests on one sidecar: {on:?}");
            home
        })
        .collect()
}

/// A sidecar's figure of `metric` for each replica (`weir_replica_concurrency_limit`, say).
async fn per_replica(sidecar: &Sidecar, metric: &str) -> Vec<f64> {
    sidecar
        .metrics()
        .await
        .lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect()
}

/// Two simulator replicas with [`SLOTS`] slots each.
fn two_sims() -> Vec<Sim> {
    let slots = SLOTS.to_string();
    (0..2)
        .map(|_| Sim::start_tiny_fast(&["--max-num-seqs", &slots]))
        .collect()
}

/// Two sidecars in front of `sims`, probed, and Envoy hashing over both.
fn two_sidecars(sims: &[Sim]) -> (Vec<Sidecar>, Envoy) {
    let sidecars: Vec<Sidecar> = (0..2)
        .map(|_| Sidecar::start(sidecar_config(sims)))
        .collect();
    for s in &sidecars {
        s.wait_for_probes(sims.len());
    }
    let envoy = Envoy::start_ring(&weir_config(), &sidecars.iter().collect::<Vec<_>>());
    (sidecars, envoy)
}

/// Sends `signal` to a sidecar's process (SIGSTOP freezes it, SIGCONT thaws it).
fn signal(sidecar: &Sidecar, signal: libc::c_int) {
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(sidecar.pid() as libc::pid_t, signal);
    }
}

#[tokio::test]
async fn a_sidecar_that_stops_answering_leaves_the_ring_and_gets_its_orgs_back_when_it_returns() {
    let sims = two_sims();
    let (sidecars, envoy) = two_sidecars(&sims);
    let home = placement(&envoy, &sidecars.iter().collect::<Vec<_>>()).await;
    let (gone, other) = (&sidecars[home[0]], &sidecars[1 - home[0]]);
    let url = format!("{}/v1/chat/completions", envoy.url);
    // Where o0's next request is recorded: on `gone` or `other`.
    let served_on = |phase: &'static str| {
        let url = url.clone();
        async move {
            let id = format!("o0-{phase}");
            let body = chat_body("tiny", "hello", json!({"max_tokens": 1})).to_string();
            let resp = post_json(&url, Some("o0"), body, &[("idempotency-key", &id)]).await;
            let status = resp.status();
            assert_eq!(
                status,
                StatusCode::OK,
                "{phase}: {}",
                resp.text().await.unwrap()
            );
            weir_e2e::wait_for(Duration::from_secs(5), || {
                [gone, other]
                    .iter()
                    .position(|s| s.ledger_rows(None).iter().any(|r| r.idempotency_key == id))
            })
            .expect("recorded")
        }
    };
    assert_eq!(served_on("before").await, 0);

    // Frozen (a hung process, a paused node): its health checks time out.
    signal(gone, libc::SIGSTOP);
    let frozen = Instant::now();
    envoy.wait_for_healthy("upstream", 1);
    let left = frozen.elapsed();
    assert_eq!(
        served_on("frozen").await,
        1,
        "o0 moved to the other sidecar"
    );

    signal(gone, libc::SIGCONT);
    let thawed = Instant::now();
    envoy.wait_for_healthy("upstream", 2);
    let back = thawed.elapsed();
    std::thread::sleep(weir_e2e::ring::RING_SETTLE);
    assert_eq!(served_on("back").await, 0, "o0 moved back");
    println!(
        "a frozen sidecar left Envoy's ring {} ms after it stopped answering and was back {} ms \
         after it answered again; o0 went to the other sidecar meanwhile and back after",
        left.as_millis(),
        back.as_millis()
    );
    assert!(
        left < Duration::from_secs(2) && back < Duration::from_secs(2),
        "{left:?} {back:?}"
    );
}

#[tokio::test]
async fn a_sidecar_killed_under_load_hands_its_orgs_to_the_survivor_which_keeps_them_fair() {
    let sims = two_sims();
    let (sidecars, envoy) = two_sidecars(&sims);
    let home = placement(&envoy, &sidecars.iter().collect::<Vec<_>>()).await;
    let mut sidecars: Vec<Option<Sidecar>> = sidecars.into_iter().map(Some).collect();
    let on = |s: usize| -> Vec<String> {
        (0..ORGS)
            .filter(|&i| home[i] == s)
            .map(|i| format!("o{i}"))
            .collect()
    };
    // The victim is o0's sidecar; o0 and the first org of the other flood, two more orgs on
    // each side are small tenants.
    let victim = home[0];
    let survivor = 1 - victim;
    let (on_victim, on_survivor) = (on(victim), on(survivor));
    println!("orgs on the victim: {on_victim:?}; on the survivor: {on_survivor:?}");
    assert!(
        on_victim.len() >= 3 && on_survivor.len() >= 3,
        "both sidecars hold orgs: {on_victim:?} / {on_survivor:?}"
    );
    let noisy = [on_victim[0].clone(), on_survivor[0].clone()];
    let small: Vec<String> = on_victim[1..3]
        .iter()
        .chain(&on_survivor[1..3])
        .cloned()
        .collect();
    let url = format!("{}/v1/chat/completions", envoy.url);

    // Small tenants alone: the baseline.
    let small_clients = |until: Instant| {
        futures::future::join_all(small.iter().map(|org| {
            let url = url.clone();
            async move {
                let mut samples = Vec::new();
                while Instant::now() < until {
                    samples.push(stream(&url, org, 250, 30).await);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                samples
            }
        }))
    };
    let quiet: Vec<Sample> = small_clients(Instant::now() + Duration::from_secs(3))
        .await
        .concat();
    for sim in &sims {
        sim.wait_idle().await;
    }

    // The flood, from both noisy orgs (20 clients each, about three times what the pool
    // runs); the victim is stopped 2 s in, and the flood goes on for 6 s after.
    let start = Instant::now();
    let kill_at = start + Duration::from_secs(2);
    let until = kill_at + Duration::from_secs(6);
    let noisy_clients = futures::future::join_all(noisy.iter().flat_map(|org| {
        let url = url.clone();
        (0..20).map(move |_| {
            let (url, org) = (url.clone(), org.clone());
            async move {
                let mut samples = Vec::new();
                while Instant::now() < until {
                    samples.push(stream(&url, &org, 1500, 300).await);
                }
                samples
            }
        })
    }));
    // The engines' queues while both sidecars admit: each to its half.
    let watch = async {
        let mut peak = (0.0f64, 0.0f64);
        while Instant::now() < kill_at {
            for sim in &sims {
                peak.0 = peak.0.max(sim.metric("vllm:num_requests_waiting").await);
                peak.1 = peak.1.max(sim.metric("vllm:num_requests_running").await);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        peak
    };
    let mut victim_sidecar = sidecars[victim].take().unwrap();
    let kill = async move {
        tokio::time::sleep_until(kill_at.into()).await;
        let killed_ms = weir_sidecar::support::clock::now_ms();
        tokio::task::spawn_blocking(move || {
            let status = victim_sidecar.terminate(Duration::from_secs(10));
            (victim_sidecar, status, killed_ms)
        })
        .await
        .unwrap()
    };
    let (noisy_samples, flooded, (peak_waiting, peak_running), (victim_sidecar, status, killed_ms)) =
        tokio::join!(noisy_clients, small_clients(until), watch, kill);
    let survivor = sidecars[survivor].as_ref().unwrap();
    let (noisy_samples, flooded) = (noisy_samples.concat(), flooded.concat());
    let status = status.expect("the victim exits after SIGTERM");
    assert!(status.success(), "a clean exit: {status:?}");

    // Its streams in flight at the end of the grace period ended with an error event, and its
    // queued requests with a 503 `shutting_down`: each with its one record in its ledger.
    let all: Vec<&Sample> = noisy_samples.iter().chain(&flooded).collect();
    let count = |pick: &dyn Fn(&Ending) -> bool| all.iter().filter(|s| pick(&s.ending)).count();
    let cut = count(&|e| *e == Ending::Cut("shutting_down".into()));
    let dequeued = count(&|e| matches!(e, Ending::Status(503, c) if c == "shutting_down"));
    let shutdown_records = victim_sidecar
        .ledger_rows(None)
        .iter()
        .filter(|r| r.outcome == "shutdown")
        .count();
    let other_cuts: Vec<&Ending> = all
        .iter()
        .map(|s| &s.ending)
        .filter(|e| matches!(e, Ending::Cut(code) if code != "shutting_down"))
        .collect();
    // The flood is shed by the sidecars' own overload refusals (a projected wait past the
    // deadline, a full queue); any other refusal is a request lost in the failover.
    let shed = |code: &str| ["projected_wait", "queue_full", "queue_deadline"].contains(&code);
    let mut refused: Vec<(u128, u16, &str)> = all
        .iter()
        .filter_map(|s| match &s.ending {
            Ending::Status(status, code) if code != "shutting_down" => Some((
                s.sent.duration_since(start).as_millis(),
                *status,
                code.as_str(),
            )),
            _ => None,
        })
        .collect();
    refused.sort();
    let small_refused = flooded
        .iter()
        .filter(|s| matches!(&s.ending, Ending::Status(_, c) if c != "shutting_down"))
        .count();
    println!(
        "SIGTERM with {LEAVE_MS} ms to leave the ring and a {GRACE_MS} ms grace: {cut} streams ended with a shutting_down error \
         event and {dequeued} queued requests with a 503 shutting_down; {shutdown_records} \
         shutdown records in its ledger; other cuts {other_cuts:?}; the flood shed {} times; \
         refused otherwise (ms after the flood began, status, code): {:?}",
        refused.iter().filter(|r| shed(r.2)).count(),
        refused.iter().filter(|r| !shed(r.2)).collect::<Vec<_>>()
    );
    // How many of its streams are running at the cut depends on the KV the other sidecar's
    // flood leaves it in the shared engines: one or two in most runs, none in some (its queue
    // then waits on KV). `sidecar_attacks` cuts a running stream deterministically.
    assert!(
        cut + dequeued > 0,
        "the victim had work when its grace period ended"
    );
    assert_eq!(
        cut + dequeued,
        shutdown_records,
        "every request the victim ended has its record, once"
    );
    assert!(
        other_cuts.is_empty(),
        "no stream ends without its error event"
    );
    assert!(
        refused.iter().all(|r| shed(r.2)),
        "nothing lost in the failover: requests that met the dead sidecar's port went to the \
         survivor"
    );
    assert_eq!(small_refused, 0, "small tenants are never shed");

    // Its orgs' new requests reach the survivor.
    let survivor_rows = survivor.ledger_rows(None);
    for org in on_victim[..3].iter() {
        let moved = survivor_rows
            .iter()
            .filter(|r| r.tenant.starts_with(&format!("{org}/")) && r.finished_at_ms > killed_ms)
            .count();
        println!(
            "{org} (was on the victim): {moved} requests served by the survivor after the kill"
        );
        assert!(moved > 0, "{org} moved to the survivor");
    }

    // Each sidecar admitted against half of each replica: together they never queued inside
    // an engine, and the survivor alone holds only its half.
    let limits = per_replica(survivor, "weir_replica_concurrency_limit").await;
    println!(
        "while both admitted: engines' peak running {peak_running}, peak waiting {peak_waiting} \
         (slots {SLOTS} per replica); the survivor's limit per replica {limits:?}"
    );
    assert_eq!(
        limits,
        vec![(SLOTS / 2) as f64; 2],
        "half of each replica's slots"
    );

    // The survivor still keeps small tenants' latency through the flood: theirs, moved or not,
    // against the baseline, from 1 s after the kill (when the ring has settled).
    let settled = kill_at + Duration::from_secs(1);
    let ttfts = |samples: &[Sample], from: Instant| -> Vec<f64> {
        samples
            .iter()
            .filter(|s| s.sent >= from)
            .filter_map(|s| s.ttft)
            .collect()
    };
    let (quiet_p95, after_p95) = (
        p95(ttfts(&quiet, start - Duration::from_secs(3600))),
        p95(ttfts(&flooded, settled)),
    );
    let before: Vec<f64> = flooded
        .iter()
        .filter(|s| s.sent < kill_at)
        .filter_map(|s| s.ttft)
        .collect();
    let noisy_after = noisy_samples
        .iter()
        .filter(|s| s.sent >= settled && s.ending == Ending::Done)
        .count();
    println!(
        "small TTFT p95: {:.1} ms alone, {:.1} ms under the flood on two sidecars, {:.1} ms on \
         the survivor alone ({} / {} / {} samples); noisy streams completed on the survivor \
         alone: {noisy_after}",
        quiet_p95 * 1e3,
        p95(before.clone()) * 1e3,
        after_p95 * 1e3,
        quiet.len(),
        before.len(),
        ttfts(&flooded, settled).len()
    );
    assert!(noisy_after > 10, "the noisy tenants are still served");
    assert!(
        kept_latency(quiet_p95, after_p95),
        "small tenants keep their latency on the survivor: {:.1} ms -> {:.1} ms",
        quiet_p95 * 1e3,
        after_p95 * 1e3
    );
}
