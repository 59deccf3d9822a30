use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};
use weir_core::endpoint::Endpoint;
use weir_core::meter::StreamMeter;

use super::*;
use crate::dispatch::{Assignment, Event};
use crate::intake::app::App;
use crate::intake::trust::Trusted;
use crate::relay::body::{Delivery, Piece, deliver};
use crate::relay::engine::{EVENT_STREAM, JSON};
use crate::relay::pump::{MAX_PENDING_BYTES, pump};
use crate::relay::resume::Splice;

/// What a pump runs against: an App with a ledger in a file of its own, the dispatcher's
/// events, and the shutdown switch.
struct Rig {
    app: Arc<App>,
    events: mpsc::UnboundedReceiver<Event>,
    cut: tokio::sync::watch::Sender<bool>,
    _draining: tokio::sync::watch::Sender<bool>,
    ledger: std::path::PathBuf,
}

fn rig(client_stall_ms: u64) -> Rig {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("weir-pump-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ledger.db");
    let (events_tx, events) = mpsc::unbounded_channel();
    let (metrics, registry) =
        crate::metrics::Metrics::new(&crate::config::metrics::MetricsConfig::default(), None);
    let ledger = crate::ledger::Ledger::start(&path, None, Default::default()).unwrap();
    let (cut, cut_rx) = tokio::sync::watch::channel(false);
    let (draining, draining_rx) = tokio::sync::watch::channel(false);
    let (_waits, waits) =
        tokio::sync::watch::channel(Arc::new(crate::support::backoff::Waits::default()));
    let approvals = crate::approvals::Approvals::new(Default::default(), metrics.clone());
    let app = Arc::new(App {
        approvals,
        events: events_tx,
        ledger_reader: crate::ledger::Reader::open(&path, None).unwrap(),
        metrics,
        registry,
        ledger,
        pools: crate::support::live::Live::new(Vec::new()),
        exact_below_bytes: crate::support::live::Live::new(0),
        max_body_bytes: crate::support::live::Live::new(1 << 20),
        cache_salt_key: Vec::new(),
        queue_deadline_ms: crate::support::live::Live::new(0),
        trust: crate::intake::trust::Trust::new(Vec::new()),
        idempotency: crate::intake::idempotency::Idempotency::new(Default::default()),
        relay: crate::support::live::Live::new(crate::config::RelayConfig {
            client_stall_ms,
            ..Default::default()
        }),
        backoff: crate::support::backoff::Backoff::new(waits),
        predictions: crate::intake::prediction::Predictions::new(Default::default()),
        quota: None,
        cut: cut_rx,
        draining: draining_rx,
    });
    Rig {
        app,
        events,
        cut,
        _draining: draining,
        ledger: path,
    }
}

fn flight(rig: &Rig, hide_usage: bool) -> Flight {
    flight_of(rig, Endpoint::ChatCompletions, hide_usage)
}

fn flight_of(rig: &Rig, endpoint: Endpoint, hide_usage: bool) -> Flight {
    let attempt = Attempt {
        endpoint,
        who: Trusted {
            tenant: "t".into(),
            request_id: "r1".into(),
            idempotency_key: None,
            tier: "standard".into(),
            weights: vec![1.0],
            priority: Default::default(),
            kv_cap: None,
            models: None,
            prices: None,
            route: Some("llm-api".into()),
            mode: Some("shadow".into()),
            run_id: None,
            agent: None,
            tool_approval: Vec::new(),
            approval_terms: None,
            approves: Vec::new(),
        },
        model: "m".into(),
        input_tokens: 10,
        output_held: 100,
        unread_output: 100,
        uncapped: false,
        sequences: 1,
        arrived: Instant::now(),
        deadline_ms: u64::MAX,
        hide_usage,
        continuation: None,
        approval: None,
    };
    let assignment = Assignment::for_tests(rig.app.events.clone(), 110, None);
    Flight::new(rig.app.clone(), attempt, assignment, None)
}

type Feed = futures::channel::mpsc::UnboundedSender<reqwest::Result<Bytes>>;

/// A replica's stream the test writes to.
fn replica() -> (Feed, Upstream) {
    let (tx, rx) = futures::channel::mpsc::unbounded();
    (tx, Box::pin(rx))
}

fn token(i: usize) -> Bytes {
    Bytes::from(format!(
        "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i}\"}}}}]}}\n\n"
    ))
}

const LONG: Duration = Duration::from_secs(600);

/// A pump relaying `flight` from a replica the test writes to (`feed`) to the client's end
/// of the body channel, with `time` left on the stream.
struct Running {
    feed: Feed,
    client: mpsc::Receiver<Piece>,
    pump: tokio::task::JoinHandle<()>,
}

fn run(flight: Flight, time: Duration) -> Running {
    let (feed, upstream) = replica();
    let (tx, client) = mpsc::channel(1);
    let pump = tokio::spawn(pump(flight, upstream, tx, TokioInstant::now() + time));
    Running { feed, client, pump }
}

/// Sends tokens `0..n` from the replica; the bytes sent.
fn send_tokens(feed: &Feed, n: usize) -> Vec<u8> {
    let mut sent = Vec::new();
    for i in 0..n {
        let t = token(i);
        sent.extend_from_slice(&t);
        feed.unbounded_send(Ok(t)).unwrap();
    }
    sent
}

/// A stream that ends early: the client reads the bytes that were pending (`sent`), then
/// weir's closing event, which is returned once the pump is done.
async fn closes_after(
    mut client: mpsc::Receiver<Piece>,
    pump: tokio::task::JoinHandle<()>,
    sent: &[u8],
) -> String {
    let (got, how) = read_all(&mut client).await;
    assert_eq!(how, "last");
    let text = String::from_utf8_lossy(&got).into_owned();
    assert!(
        got.starts_with(sent),
        "the pending bytes come first: {text}"
    );
    pump.await.unwrap();
    text[sent.len()..].to_owned()
}

/// The outcomes the ledger recorded (waits for the writer).
fn outcomes(rig: &Rig) -> Vec<String> {
    records(rig)
        .into_iter()
        .map(|(_, outcome, _)| outcome)
        .collect()
}

/// The request id, outcome and completion tokens of each record in the ledger (waits for
/// the writer).
fn records(rig: &Rig) -> Vec<(String, String, u64)> {
    assert!(rig.app.ledger.flush(Duration::from_secs(5)));
    let conn = rusqlite::Connection::open(&rig.ledger).unwrap();
    let columns = "SELECT request_id, outcome, completion_tokens FROM usage";
    let mut stmt = conn.prepare(columns).unwrap();
    stmt.query_map([], |r| {
        Ok((r.get(0)?, r.get(1)?, r.get::<_, i64>(2)? as u64))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

/// Waits (up to `within`) for the replica's hold to be given back; how many times it was.
async fn released(rig: &mut Rig, within: Duration) -> usize {
    let mut n = 0;
    let _ = tokio::time::timeout(within, async {
        while let Some(e) = rig.events.recv().await {
            if matches!(e, Event::Finished { .. }) {
                n += 1;
                break;
            }
        }
    })
    .await;
    // Anything more already sent counts too.
    while let Ok(e) = rig.events.try_recv() {
        if matches!(e, Event::Finished { .. }) {
            n += 1;
        }
    }
    n
}

/// Everything the client reads until the pump's side ends.
async fn read_all(rx: &mut mpsc::Receiver<Piece>) -> (Vec<u8>, &'static str) {
    let mut out = Vec::new();
    loop {
        match rx.recv().await {
            Some(Piece::Chunk(c)) => out.extend_from_slice(&c),
            Some(Piece::Last(c)) => {
                out.extend_from_slice(&c);
                return (out, "last");
            }
            Some(Piece::End) => return (out, "end"),
            None => return (out, "closed"),
        }
    }
}

/// A Responses stream whose `response.created` and `response.completed` each repeat 200 KB
/// of instructions, arriving in 16 KiB pieces: the client gets it as it came, and it is
/// settled from the engine's usage (its cached tokens too) as completed work. The meter
/// lost events past its 64 KiB bound: `counted`, `failed`, and the key's retry billed again.
#[tokio::test]
async fn a_responses_stream_of_events_past_the_meters_bound_is_settled_from_its_usage() {
    let mut rig = rig(5_000);
    let flight = flight_of(&rig, Endpoint::Responses, false);
    let Running {
        feed,
        mut client,
        pump,
    } = run(flight, LONG);
    let instructions =
        serde_json::to_string(&"Answer as \"the {gateway}\" would.\n\n".repeat(6_000)).unwrap();
    let response = |status: &str, usage: &str| {
        format!(
            r#"{{"id":"r","object":"response","instructions":{instructions},"status":"{status}","tools":[],"usage":{usage}}}"#
        )
    };
    let usage = r#"{"input_tokens":51000,"input_tokens_details":{"cached_tokens":50000},"output_tokens":2,"total_tokens":51002}"#;
    let stream = format!(
        "event: response.created\ndata: {{\"type\":\"response.created\",\"response\":{}}}\n\n\
         event: response.output_text.delta\ndata: {{\"type\":\"response.output_text.delta\",\"delta\":\" hi\"}}\n\n\
         event: response.completed\ndata: {{\"type\":\"response.completed\",\"response\":{}}}\n\n",
        response("in_progress", "null"),
        response("completed", usage),
    );
    assert!(stream.len() > 400_000);
    for piece in stream.as_bytes().chunks(16 * 1024) {
        feed.unbounded_send(Ok(Bytes::copy_from_slice(piece)))
            .unwrap();
    }
    drop(feed);
    let (got, how) = read_all(&mut client).await;
    assert_eq!(how, "end");
    assert!(
        got == stream.as_bytes(),
        "{} bytes of {}",
        got.len(),
        stream.len()
    );
    pump.await.unwrap();
    assert_eq!(released(&mut rig, Duration::from_secs(1)).await, 1);
    assert!(rig.app.ledger.flush(Duration::from_secs(5)));
    let conn = rusqlite::Connection::open(&rig.ledger).unwrap();
    let row = conn
        .query_row(
            "SELECT source, outcome, prompt_tokens, completion_tokens, cached_prompt_tokens, \
             route || '/' || mode FROM usage",
            [],
            |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                    r.get::<_, String>(5)?,
                ))
            },
        )
        .unwrap();
    assert_eq!(
        row,
        (
            "engine".into(),
            "ok".into(),
            51000_i64,
            2_i64,
            50000_i64,
            "llm-api/shadow".into()
        )
    );
}

/// An engine whose non-streamed answer outgrows `relay.max_response_bytes` (a batch of
/// embeddings too large, or an engine gone wrong) is not read whole: the caller gets 502
/// `response_too_large`, and the attempt is billed its prompt and its answer's bound.
/// Before, the sidecar read any answer whole into memory.
#[tokio::test]
async fn a_non_streamed_answer_past_the_bound_is_refused_and_billed_not_held() {
    let rig = rig(5_000);
    let huge = |declared: bool| async move {
        let answer = format!(
            r#"{{"object":"list","data":[{{"embedding":[{}]}}]}}"#,
            "0.123456789,".repeat(20_000) + "0"
        );
        if declared {
            answer.into_response()
        } else {
            // Chunked, without a length: the bound is found reading.
            let chunks = answer
                .into_bytes()
                .chunks(4096)
                .map(|c| Ok::<_, std::io::Error>(Bytes::copy_from_slice(c)))
                .collect::<Vec<_>>();
            Body::from_stream(futures::stream::iter(chunks)).into_response()
        }
    };
    let engine = axum::Router::new()
        .route("/declared", axum::routing::post(move || huge(true)))
        .route("/chunked", axum::routing::post(move || huge(false)));
    let url = serve(engine).await;
    rig.app.relay.store(crate::config::RelayConfig {
        max_response_bytes: 64 * 1024,
        ..Default::default()
    });
    for (i, path) in ["/declared", "/chunked"].into_iter().enumerate() {
        let mut flight = flight_of(&rig, Endpoint::Embeddings, false);
        flight.who.request_id = format!("big-{i}");
        flight.hold.assignment.url = url.clone();
        let resp = relay(flight, path, b"{}".to_vec(), false, None).await;
        let (status, v) = answer_of(resp).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY, "{path}: {v}");
        assert_eq!(v["error"]["code"], "response_too_large", "{path}: {v}");
    }
    assert_eq!(
        billed(&rig),
        vec![("response_too_large".into(), 10, 100, "bound".into()); 2],
        "its prompt, and its answer's bound"
    );
}

/// An engine's own refusal reaches the caller with its status and message in the
/// provider's values: vLLM's exception class and numeric code were passed on as they came.
#[tokio::test]
async fn an_engine_s_refusal_reaches_the_caller_in_the_provider_s_values() {
    let rig = rig(5_000);
    let refuse = || async {
        let body = r#"{"error":{"message":"max_tokens is too large","type":"BadRequestError","param":"max_tokens","code":400}}"#;
        (StatusCode::BAD_REQUEST, body).into_response()
    };
    let url = serve(axum::Router::new().route("/refuse", axum::routing::post(refuse))).await;
    for (endpoint, want) in [
        (
            Endpoint::ChatCompletions,
            json!({"error": {"message": "max_tokens is too large",
                "type": "invalid_request_error", "param": "max_tokens", "code": null}}),
        ),
        (
            Endpoint::Messages,
            json!({"type": "error", "error": {"type": "invalid_request_error",
                "message": "max_tokens is too large"}}),
        ),
    ] {
        let mut flight = flight_of(&rig, endpoint, false);
        flight.who.request_id = format!("refused-{}", endpoint.name());
        flight.hold.assignment.url = url.clone();
        let resp = relay(flight, "/refuse", b"{}".to_vec(), false, None).await;
        let (status, v) = answer_of(resp).await;
        assert_eq!((status, v), (StatusCode::BAD_REQUEST, want));
    }
}

/// Each record's outcome, prompt and output tokens and their source, by request id (waits
/// for the writer).
fn billed(rig: &Rig) -> Vec<(String, u64, u64, String)> {
    assert!(rig.app.ledger.flush(Duration::from_secs(5)));
    let conn = rusqlite::Connection::open(&rig.ledger).unwrap();
    let columns = "SELECT outcome, prompt_tokens, completion_tokens, source FROM usage \
                   ORDER BY request_id";
    let mut stmt = conn.prepare(columns).unwrap();
    stmt.query_map([], |r| {
        Ok((
            r.get(0)?,
            r.get::<_, i64>(1)? as u64,
            r.get::<_, i64>(2)? as u64,
            r.get(3)?,
        ))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

/// Serves `engine` on loopback; its URL.
async fn serve(engine: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, engine).await });
    url
}

/// An engine that takes the request in and never answers.
async fn silent() -> &'static str {
    std::future::pending().await
}

/// An engine that sends a stream's headers and never its first byte (a long prefill).
async fn unstarted() -> Response {
    let body = Body::from_stream(futures::stream::pending::<std::io::Result<Bytes>>());
    ([(header::CONTENT_TYPE, EVENT_STREAM)], body).into_response()
}

/// The status and JSON body of the caller's answer.
async fn answer_of(resp: Response) -> (StatusCode, Value) {
    let status = resp.status();
    let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    (status, serde_json::from_slice(&body).unwrap())
}

/// A client that leaves a request the engine is working on before any of its answer came.
/// Non-streamed, nobody reads the answer: the attempt is billed its prompt and the answer's
/// bound (its `max_tokens`), as the filter charges it. Before, the ledger billed no output.
/// Streamed, what was relayed is counted: nothing yet.
#[tokio::test]
async fn a_non_streamed_answer_the_client_left_is_billed_its_bound() {
    let rig = rig(5_000);
    // A stream asked for and answered as JSON whose body never ends: the filter meters it
    // as the stream it asked for (it never got the answer's headers), so the ledger does.
    let half_json = || async {
        let start = futures::stream::once(async { Ok(Bytes::from_static(b"{\"choices\":[")) });
        let body =
            Body::from_stream(start.chain(futures::stream::pending::<std::io::Result<Bytes>>()));
        ([(header::CONTENT_TYPE, JSON)], body).into_response()
    };
    let engine = axum::Router::new()
        .route("/answer", axum::routing::post(silent))
        .route("/stream", axum::routing::post(unstarted))
        .route("/json", axum::routing::post(half_json));
    let url = serve(engine).await;
    let exits = [("/answer", false), ("/stream", true), ("/json", true)];
    for (i, (path, stream)) in exits.into_iter().enumerate() {
        let mut flight = flight(&rig, false);
        flight.who.request_id = format!("r{i}");
        flight.hold.assignment.url = url.clone();
        let left = tokio::time::timeout(
            Duration::from_millis(200),
            relay(flight, path, b"{}".to_vec(), stream, None),
        )
        .await;
        assert!(left.is_err(), "{path}: the engine answered");
    }
    assert_eq!(
        billed(&rig),
        [
            ("cancelled".into(), 10, 100, "bound".into()),
            ("cancelled".into(), 10, 0, "counted".into()),
            ("cancelled".into(), 10, 0, "counted".into()),
        ]
    );
}

/// An answer with no usage weir can read or count (not the API's JSON) is billed its bound,
/// as the filter charges it; before, the ledger billed no output.
#[tokio::test]
async fn an_answer_with_no_usage_weir_can_read_is_billed_its_bound() {
    let rig = rig(5_000);
    let odd = || async {
        (
            [(header::CONTENT_TYPE, JSON)],
            "{\"object\":\"odd\",\"output\":\"...\"}",
        )
    };
    let url = serve(axum::Router::new().route("/", axum::routing::post(odd))).await;
    // Asked for as a stream too: answered whole as JSON, the filter meters it as a body.
    for (i, stream) in [false, true].into_iter().enumerate() {
        let mut flight = flight(&rig, false);
        flight.who.request_id = format!("r{i}");
        flight.hold.assignment.url = url.clone();
        let resp = relay(flight, "/", b"{}".to_vec(), stream, None).await;
        assert_eq!(resp.status(), StatusCode::OK);
    }
    assert_eq!(
        billed(&rig),
        vec![("ok".into(), 10, 100, "bound".into()); 2]
    );
}

/// An engine that cannot be reached ran nothing and is billed nothing; one that fails
/// partway through a non-streamed answer took the prompt and is billed it (its output is
/// in the part that never came), and the 502 says so for the filter.
#[tokio::test]
async fn an_engine_that_fails_is_billed_for_what_it_took_in() {
    let rig = rig(5_000);
    let failing = || async {
        let start = Bytes::from_static(b"{\"id\":\"chatcmpl-1\",\"choices\":[");
        let dies = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            Err(std::io::Error::other("engine died"))
        };
        let pieces = futures::stream::once(async { Ok(start) }).chain(futures::stream::once(dies));
        Body::from_stream(pieces).into_response()
    };
    let url = serve(axum::Router::new().route("/", axum::routing::post(failing))).await;
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    let mut usages = Vec::new();
    for (i, url) in [url, closed].into_iter().enumerate() {
        let mut flight = flight(&rig, false);
        flight.who.request_id = format!("r{i}");
        flight.hold.assignment.url = url;
        let resp = relay(flight, "/", b"{}".to_vec(), false, None).await;
        let (status, v) = answer_of(resp).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY, "{v}");
        usages.push(v["usage"].clone());
    }
    assert_eq!(
        (&usages[0]["prompt_tokens"], &usages[0]["completion_tokens"]),
        (&json!(10), &json!(0))
    );
    assert_eq!(usages[1], Value::Null, "nothing billed, nothing said");
    assert_eq!(
        billed(&rig),
        [
            ("failed".into(), 10, 0, "counted".into()),
            ("failed".into(), 0, 0, "counted".into()),
        ]
    );
}

/// A stream the engine has not started by `relay.first_byte_ms`: one it took in (its
/// headers came) ran or queued its prompt and is billed it, and the 503 says so for the
/// filter; one it never answered is billed nothing. Before, both were free to retry.
#[tokio::test]
async fn a_stream_not_started_by_its_first_byte_is_billed_its_prompt_once_taken_in() {
    let rig = rig(5_000);
    let engine = axum::Router::new()
        .route("/taken", axum::routing::post(unstarted))
        .route("/silent", axum::routing::post(silent));
    let url = serve(engine).await;
    rig.app.relay.store(crate::config::RelayConfig {
        first_byte_ms: 200,
        ..Default::default()
    });
    let mut usages = Vec::new();
    // The third: a plain request the engine took in as a stream, billed no bound either.
    let exits = [("/taken", true), ("/silent", true), ("/taken", false)];
    for (i, (path, stream)) in exits.into_iter().enumerate() {
        let mut flight = flight(&rig, false);
        flight.who.request_id = format!("r{i}");
        flight.hold.assignment.url = url.clone();
        let resp = relay(flight, path, b"{}".to_vec(), stream, None).await;
        let (status, v) = answer_of(resp).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{path}: {v}");
        assert_eq!(v["error"]["code"], "first_byte_deadline", "{path}: {v}");
        usages.push(v["usage"].clone());
    }
    assert_eq!(usages[0]["prompt_tokens"], 10, "{usages:?}");
    assert_eq!(usages[0]["completion_tokens"], 0, "{usages:?}");
    assert_eq!(usages[1], Value::Null, "nothing billed, nothing said");
    assert_eq!(
        billed(&rig),
        [
            ("first_byte_deadline".into(), 10, 0, "counted".into()),
            ("first_byte_deadline".into(), 0, 0, "counted".into()),
            ("first_byte_deadline".into(), 10, 0, "counted".into()),
        ]
    );
}

/// A client that stops reading is cut at its stall limit, not when the timer set for the
/// replica's 30 s silence next fires (which kept the engine's KV and slot for 30 s).
#[tokio::test]
async fn a_client_that_stops_reading_is_cut_at_the_stall_limit_not_the_idle_timeout() {
    let mut rig = rig(200);
    let Running {
        feed,
        client: _never_read,
        pump,
    } = run(flight(&rig, false), LONG);
    // One chunk fills the body channel; the next waits for a client that never takes it.
    for i in 0..4 {
        feed.unbounded_send(Ok(token(i))).unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let started = std::time::Instant::now();
    let n = released(&mut rig, Duration::from_secs(3)).await;
    assert_eq!(
        n,
        1,
        "the hold is given back once within 3 s of a 200 ms stall (took {:?})",
        started.elapsed()
    );
    tokio::time::timeout(Duration::from_secs(1), pump)
        .await
        .unwrap()
        .unwrap();
    // Billed its prompt and the tokens the pump took from the replica (two in each `tN`).
    assert_eq!(
        billed(&rig),
        [("slow_client".into(), 10, 8, "counted".into())]
    );
}

/// A replica that ends its stream while bytes wait for a slow client: all of it reaches
/// the client, in order, then the end; one record, one release.
#[tokio::test]
async fn pending_bytes_reach_a_slow_client_in_order_before_the_end() {
    let mut rig = rig(5_000);
    let Running {
        feed,
        mut client,
        pump,
    } = run(flight(&rig, false), LONG);
    let mut want = send_tokens(&feed, 2000);
    want.extend_from_slice(b"data: [DONE]\n\n");
    feed.unbounded_send(Ok(Bytes::from_static(b"data: [DONE]\n\n")))
        .unwrap();
    drop(feed);
    // A slow client: a chunk every 20 ms.
    let mut got = Vec::new();
    let ending = loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        match client.recv().await {
            Some(Piece::Chunk(c)) => {
                assert!(c.len() <= MAX_PENDING_BYTES + 200, "a chunk of {}", c.len());
                got.extend_from_slice(&c);
            }
            Some(Piece::End) => break "end",
            Some(Piece::Last(_)) => break "last",
            None => break "closed",
        }
    };
    assert_eq!(ending, "end");
    assert!(got == want, "{} bytes of {}", got.len(), want.len());
    pump.await.unwrap();
    assert_eq!(released(&mut rig, Duration::from_secs(1)).await, 1);
    assert_eq!(outcomes(&rig), ["ok"]);
}

/// The stream's deadline while bytes are pending for a client that has not taken the last
/// chunk: the pending bytes, then weir's closing event, one record.
#[tokio::test]
async fn the_deadline_delivers_what_was_pending_before_its_event() {
    let mut rig = rig(5_000);
    let Running { feed, client, pump } = run(flight(&rig, false), Duration::from_millis(300));
    let want = send_tokens(&feed, 50);
    // The client reads nothing until the deadline has passed.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let event = closes_after(client, pump, &want).await;
    assert!(event.contains("stream_deadline") && event.ends_with("data: [DONE]\n\n"));
    assert_eq!(released(&mut rig, Duration::from_secs(1)).await, 1);
    assert_eq!(outcomes(&rig), ["stream_deadline"]);
    drop(feed);
}

/// The shutdown cut, with bytes pending: they come first, then weir's closing event.
#[tokio::test]
async fn the_shutdown_cut_delivers_what_was_pending_before_its_event() {
    let mut rig = rig(5_000);
    let Running { feed, client, pump } = run(flight(&rig, false), LONG);
    let want = send_tokens(&feed, 50);
    tokio::time::sleep(Duration::from_millis(100)).await;
    rig.cut.send(true).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let event = closes_after(client, pump, &want).await;
    assert!(event.contains("shutting_down") && event.ends_with("data: [DONE]\n\n"));
    assert_eq!(released(&mut rig, Duration::from_secs(1)).await, 1);
    assert_eq!(
        billed(&rig),
        [("shutdown".into(), 10, 100, "counted".into())],
        "its prompt and what was relayed, no bound"
    );
    drop(feed);
}

/// A client that never reads does not make the pump read without bound: it stops taking
/// the replica's bytes at 16 KiB pending (plus the chunk in the channel).
#[tokio::test]
async fn a_client_that_never_reads_stops_the_pump_reading() {
    let rig = rig(5_000);
    let (feed, rx) = futures::channel::mpsc::unbounded::<reqwest::Result<Bytes>>();
    let taken = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = taken.clone();
    let upstream: Upstream = Box::pin(rx.inspect(move |c| {
        if let Ok(c) = c {
            counted.fetch_add(c.len(), std::sync::atomic::Ordering::Relaxed);
        }
    }));
    let (tx, _client) = mpsc::channel(1);
    let deadline = TokioInstant::now() + Duration::from_secs(600);
    let pump = tokio::spawn(pump(flight(&rig, false), upstream, tx, deadline));
    send_tokens(&feed, 5000);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let taken = taken.load(std::sync::atomic::Ordering::Relaxed);
    assert!(taken >= MAX_PENDING_BYTES, "it reads: {taken}");
    assert!(
        taken <= 2 * MAX_PENDING_BYTES + 2 * token(0).len(),
        "took {taken} bytes for a client that took none"
    );
    pump.abort();
    drop(feed);
}

/// A preempted stream that cannot be resumed, with bytes pending for a client
/// that has not taken the last chunk: the pending bytes, then the `not_resumed` event;
/// one release, one record.
#[tokio::test]
async fn a_preempted_stream_delivers_what_was_pending_before_it_ends() {
    let mut rig = rig(5_000);
    let (feed, upstream) = replica();
    let (tx, client) = mpsc::channel(1);
    let (preempt, preempted) = oneshot::channel();
    let mut flight = flight(&rig, false);
    flight.hold.assignment = Assignment::for_tests(rig.app.events.clone(), 110, Some(preempted));
    // The hold replaced here is given back: not the pump's.
    assert_eq!(released(&mut rig, Duration::from_secs(1)).await, 1);
    flight.continuation = Some(Continuation {
        body: serde_json::json!({"model": "m", "messages": [], "stream": true}),
        trace_id: None,
        splice: Splice::new(Default::default()),
    });
    let deadline = TokioInstant::now() + Duration::from_secs(600);
    let pump = tokio::spawn(pump(flight, upstream, tx, deadline));
    let want = send_tokens(&feed, 50);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (requeue, requeued) = oneshot::channel();
    preempt.send(requeued).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let _ = requeue.send(Err(crate::dispatch::Refusal::NoReplica));
    let event = closes_after(client, pump, &want).await;
    assert!(event.contains("\"preempted\"") && event.ends_with("data: [DONE]\n\n"));
    assert_eq!(released(&mut rig, Duration::from_secs(1)).await, 1);
    assert_eq!(outcomes(&rig), ["not_resumed"]);
    drop(feed);
}

/// A replica whose connection fails mid-stream, with bytes pending: they come
/// first, then the lost-replica event; the dispatcher is told; one record.
#[tokio::test]
async fn a_failing_replica_delivers_what_was_pending_before_its_event() {
    let mut rig = rig(5_000);
    let Running { feed, client, pump } = run(flight(&rig, false), LONG);
    let want = send_tokens(&feed, 50);
    let error = reqwest::get("http://127.0.0.1:9/").await.unwrap_err();
    feed.unbounded_send(Err(error)).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let event = closes_after(client, pump, &want).await;
    assert!(event.contains("replica_lost") && event.ends_with("data: [DONE]\n\n"));
    let mut failed = 0;
    let mut finished = 0;
    while let Ok(e) = rig.events.try_recv() {
        match e {
            Event::ReplicaFailed { .. } => failed += 1,
            Event::Finished { .. } => finished += 1,
            _ => {}
        }
    }
    assert_eq!((failed, finished), (1, 1));
    assert_eq!(outcomes(&rig), ["failed"]);
}

/// Weir's usage chunk stays hidden when it comes in the same burst as the
/// tokens, and the client still gets `[DONE]`.
#[tokio::test]
async fn a_hidden_usage_chunk_does_not_leak_from_a_gathered_burst() {
    let mut rig = rig(5_000);
    let Running {
        feed,
        mut client,
        pump,
    } = run(flight(&rig, true), LONG);
    send_tokens(&feed, 20);
    let usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":20,\"total_tokens\":27}}\n\n";
    // Split mid-event, as a connection may.
    feed.unbounded_send(Ok(Bytes::from(&usage[..30]))).unwrap();
    feed.unbounded_send(Ok(Bytes::from(&usage[30..]))).unwrap();
    feed.unbounded_send(Ok(Bytes::from_static(b"data: [DONE]\n\n")))
        .unwrap();
    drop(feed);
    let (got, how) = read_all(&mut client).await;
    let got = String::from_utf8(got).unwrap();
    assert_eq!(how, "end");
    assert!(!got.contains("usage"), "{got}");
    assert!(
        got.contains("t19") && got.ends_with("data: [DONE]\n\n"),
        "{got}"
    );
    pump.await.unwrap();
    assert_eq!(released(&mut rig, Duration::from_secs(1)).await, 1);
    assert_eq!(outcomes(&rig), ["ok"]);
}

/// The client leaving while bytes are pending: cancelled, once, and released.
#[tokio::test]
async fn a_client_that_leaves_with_bytes_pending_is_cancelled_once() {
    let mut rig = rig(5_000);
    let Running { feed, client, pump } = run(flight(&rig, false), LONG);
    send_tokens(&feed, 50);
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(client);
    tokio::time::timeout(Duration::from_secs(1), pump)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(released(&mut rig, Duration::from_secs(1)).await, 1);
    assert_eq!(outcomes(&rig), ["cancelled"]);
    drop(feed);
}

#[tokio::test]
async fn a_client_that_does_not_take_a_chunk_in_time_is_stalled_and_one_that_left_is_gone() {
    let stall = Duration::from_millis(50);
    let (tx, mut rx) = mpsc::channel(1);
    let chunk = || Piece::Chunk(Bytes::from_static(b"data: {}\n\n"));
    assert!(matches!(
        deliver(&tx, chunk(), stall).await,
        Delivery::Taken
    ));
    // The client has not taken that one: the next waits, then gives up.
    let started = std::time::Instant::now();
    assert!(matches!(
        deliver(&tx, chunk(), stall).await,
        Delivery::ClientStalled
    ));
    assert!(started.elapsed() >= stall);
    // A client reading in time is never stalled.
    assert!(rx.recv().await.is_some());
    assert!(matches!(
        deliver(&tx, chunk(), stall).await,
        Delivery::Taken
    ));
    drop(rx);
    assert!(matches!(
        deliver(&tx, chunk(), stall).await,
        Delivery::ClientGone
    ));
}

/// Answer pieces of one token by every count (the engine's, the meters' estimate), each
/// distinct, so a token lost or repeated shows in the text.
const ANSWER: [&str; 6] = [" The", " cache", " is", " warm", ",", " so"];
/// The completions prompt (a continuation's carries the generated text after it).
const PROMPT: &str = "Once";

/// Segment `segment`'s stream of the answer from its token `from` on, event by event, with
/// vLLM's fields (its own chunk id and creation time; a chat's opens with the role): the
/// tokens, the finish reason, the usage, `[DONE]`. Event `i` ends with `endings[i % len]`
/// (its data line's line ending, then the empty line's).
fn answer(endpoint: Endpoint, segment: u32, from: usize, endings: &[&str]) -> Vec<String> {
    let chat = endpoint == Endpoint::ChatCompletions;
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let chunk = |choices: Value| {
        json!({"id": format!("cmpl-{segment}"), "object": object, "created": 7 + segment,
               "model": "m", "choices": choices})
    };
    let piece = |text: &str, finish: Value| {
        let generated = if chat {
            json!({"index": 0, "delta": {"content": text}})
        } else {
            json!({"index": 0, "text": text})
        };
        let mut choice = generated;
        choice["logprobs"] = Value::Null;
        choice["finish_reason"] = finish;
        chunk(json!([choice]))
    };
    let mut events = Vec::new();
    if chat {
        let role = json!({"role": "assistant", "content": ""});
        let choice = json!({"index": 0, "delta": role, "logprobs": null, "finish_reason": null});
        events.push(chunk(json!([choice])));
    }
    events.extend(ANSWER[from..].iter().map(|t| piece(t, Value::Null)));
    events.push(piece("", json!("stop")));
    let mut usage = chunk(json!([]));
    let prompt = 9 + from;
    usage["usage"] = json!({"prompt_tokens": prompt, "completion_tokens": ANSWER.len() - from,
                            "total_tokens": prompt + ANSWER.len() - from});
    events.push(usage);
    let data = events.iter().map(Value::to_string).chain(["[DONE]".into()]);
    data.enumerate()
        .map(|(i, d)| format!("data: {d}{}", endings[i % endings.len()]))
        .collect()
}

/// An engine that continues the answer: after the text a continuation carries (the chat's
/// final message, or what follows the prompt) it streams the rest, as segment 1; a text
/// that is not the answer's first tokens gets a 400. Its URL.
async fn continuing_engine(endpoint: Endpoint, endings: &'static [&'static str]) -> String {
    let continues = move |axum::Json(body): axum::Json<Value>| async move {
        let text = match endpoint {
            Endpoint::Completions => body["prompt"].as_str().and_then(|p| p.strip_prefix(PROMPT)),
            _ => body["messages"]
                .as_array()
                .and_then(|m| m.last()?["content"].as_str()),
        };
        match (0..=ANSWER.len()).find(|&k| text == Some(ANSWER[..k].concat().as_str())) {
            Some(from) => {
                let stream = answer(endpoint, 1, from, endings).concat();
                ([(header::CONTENT_TYPE, EVENT_STREAM)], stream).into_response()
            }
            None => StatusCode::BAD_REQUEST.into_response(),
        }
    };
    serve(axum::Router::new().route(endpoint.path(), axum::routing::post(continues))).await
}

/// What the client reads of `stream` (its events one chunk each) preempted once its first
/// `cut` bytes were read, and resumed on `engine`; the pump is done when it returns. A
/// stream that cannot be resumed runs on to its end. `at` names the request (its ledger
/// record's request id).
async fn preempted_at(
    rig: &Rig,
    (endpoint, at): (Endpoint, &str),
    stream: &[String],
    cut: usize,
    engine: &str,
) -> Vec<u8> {
    let mut flight = flight(rig, false);
    flight.who.request_id = at.to_owned();
    (flight.endpoint, flight.meter.stream) = (endpoint, StreamMeter::new(endpoint, false));
    let (preempt, preempted) = oneshot::channel();
    flight.hold.assignment = Assignment::for_tests(rig.app.events.clone(), 110, Some(preempted));
    let body = match endpoint {
        Endpoint::Completions => json!({"model": "m", "prompt": PROMPT, "stream": true}),
        _ => json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "stream": true}),
    };
    flight.continuation = Some(Continuation {
        body,
        trace_id: None,
        splice: Splice::new(Default::default()),
    });
    let mut next = Assignment::for_tests(rig.app.events.clone(), 110, None);
    next.url = engine.to_owned();
    let (requeue, requeued) = oneshot::channel();
    assert!(requeue.send(Ok(next)).is_ok());
    let mut chunks = Vec::new();
    let mut start = 0;
    for event in stream.iter().map(String::as_bytes) {
        let read = event.get(..cut.saturating_sub(start)).unwrap_or(event);
        if !read.is_empty() {
            chunks.push(Ok(Bytes::copy_from_slice(read)));
        }
        start += event.len();
    }
    let rest = Bytes::from(stream.concat()).slice(cut..);
    let preempting = futures::stream::once(async move {
        let _ = preempt.send(requeued);
        // The pump takes the word before it reads on: the rest is for a stream that runs on.
        tokio::task::yield_now().await;
        Ok(rest)
    });
    let upstream: Upstream = Box::pin(futures::stream::iter(chunks).chain(preempting));
    let (tx, mut client) = mpsc::channel(1);
    let pump = tokio::spawn(pump(flight, upstream, tx, TokioInstant::now() + LONG));
    let (got, how) = read_all(&mut client).await;
    pump.await.unwrap();
    assert_eq!(how, "end", "{at}: {}", String::from_utf8_lossy(&got));
    got
}

/// The data of each event a client's parser dispatches from `stream` (the HTML standard's
/// reading: a line ends at CRLF, LF or CR, an empty line dispatches the data lines before
/// it), and whether the stream ends between events, not inside one.
fn dispatched(stream: &[u8]) -> (Vec<String>, bool) {
    let text = String::from_utf8_lossy(stream)
        .replace("\r\n", "\n")
        .replace('\r', "\n");
    let mut lines: Vec<&str> = text.split('\n').collect();
    let unended = lines.pop().unwrap_or_default();
    let (mut events, mut data) = (Vec::new(), String::new());
    for line in lines {
        if line.is_empty() {
            events.extend(data.strip_suffix('\n').map(str::to_owned));
            data.clear();
        } else if let Some(value) = line.strip_prefix("data:") {
            data.push_str(value.strip_prefix(' ').unwrap_or(value));
            data.push('\n');
        }
    }
    (events, unended.is_empty() && data.is_empty())
}

/// A batch stream preempted at every byte of a realistic stream, each API's, in each
/// framing an engine may use: the client gets whole events only (a read ending between
/// `data: …\n` and its empty line, when the stream was preempted, joined the next segment's
/// first line into a half event), every token once, and the client's usage chunk, the
/// ledger and the filter's meter (reading what the client got) all bill the tokens the
/// client received.
#[tokio::test]
async fn a_stream_preempted_at_any_byte_reaches_the_client_as_whole_events_billed_as_received() {
    const FRAMINGS: [&[&str]; 3] = [
        &["\n\n"],
        &["\r\n\r\n"],
        &["\r\n\n", "\n\r\n", "\r\r", "\r\n\r\n", "\n\n"],
    ];
    let rig = rig(5_000);
    let n = ANSWER.len() as u64;
    let mut cuts = 0;
    for endpoint in [Endpoint::ChatCompletions, Endpoint::Completions] {
        for endings in FRAMINGS {
            let engine = continuing_engine(endpoint, endings).await;
            let stream = answer(endpoint, 0, 0, endings);
            for cut in 0..=stream.concat().len() {
                let at = format!("{} {endings:?} cut at {cut}", endpoint.name());
                let got = preempted_at(&rig, (endpoint, &at), &stream, cut, &engine).await;
                let (events, whole) = dispatched(&got);
                let got = String::from_utf8_lossy(&got);
                assert!(whole, "{at}: the stream ends inside an event: {got:?}");
                assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{at}");
                let (mut text, mut ids, mut roles, mut usage) =
                    (String::new(), Vec::new(), 0, Vec::new());
                for data in &events[..events.len() - 1] {
                    let chunk: Value = serde_json::from_str(data).unwrap_or_else(|e| {
                        panic!("{at}: a half event ({e}): {data:?} in {got:?}")
                    });
                    ids.push((chunk["id"].clone(), chunk["created"].clone()));
                    for choice in chunk["choices"].as_array().unwrap() {
                        let delta = &choice["delta"];
                        roles += usize::from(!delta["role"].is_null());
                        text.push_str(
                            delta["content"]
                                .as_str()
                                .or(choice["text"].as_str())
                                .unwrap_or_default(),
                        );
                    }
                    usage.extend(chunk["usage"]["completion_tokens"].as_u64());
                }
                assert_eq!(
                    text,
                    ANSWER.concat(),
                    "{at}: tokens lost or repeated: {got:?}"
                );
                ids.dedup();
                assert_eq!(ids.len(), 1, "{at}: one stream's chunks: {ids:?}");
                let role = usize::from(endpoint == Endpoint::ChatCompletions);
                assert_eq!(roles, role, "{at}: {got:?}");
                assert_eq!(usage, [n], "{at}: the usage the client gets");
                let mut filter = StreamMeter::new(endpoint, false);
                filter.meter(got.as_bytes(), true);
                assert_eq!(filter.usage().map(|u| u.completion_tokens), Some(n), "{at}");
                assert_eq!(
                    filter.generated_tokens(),
                    n,
                    "{at}: the tokens the client got"
                );
                cuts += 1;
            }
        }
    }
    let billed = records(&rig);
    assert_eq!(billed.len(), cuts, "one record each");
    for (at, outcome, completion) in billed {
        assert_eq!(
            (outcome.as_str(), completion),
            ("ok", n),
            "{at}: the ledger"
        );
    }
}

/// A call of a run is recorded with its run id, agent and the tool calls its answer made, and
/// none of them reaches a metric label: series grow with tenants, never with runs.
#[tokio::test]
async fn metrics_have_no_run_label() {
    let mut rig = rig(5_000);
    let mut flight = flight(&rig, false);
    flight.who.run_id = Some("run-7f3a".into());
    flight.who.agent = Some("planner-9".into());
    flight.who.prices = weir_core::price::Prices::parse_header("USD:*=1,1,2");
    let Running {
        feed,
        mut client,
        pump,
    } = run(flight, LONG);
    let stream = "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"search\",\"arguments\":\"{}\"}}]}}]}\n\n\
                  data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n\
                  data: [DONE]\n\n";
    feed.unbounded_send(Ok(Bytes::from(stream))).unwrap();
    drop(feed);
    assert_eq!(read_all(&mut client).await.1, "end");
    pump.await.unwrap();
    assert_eq!(released(&mut rig, Duration::from_secs(1)).await, 1);
    assert!(rig.app.ledger.flush(Duration::from_secs(5)));
    let conn = rusqlite::Connection::open(&rig.ledger).unwrap();
    let recorded: (String, String, i64) = conn
        .query_row("SELECT run_id, agent_id, tool_calls FROM usage", [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .unwrap();
    assert_eq!(recorded, ("run-7f3a".into(), "planner-9".into(), 1));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &rig.app.registry).unwrap();
    assert!(
        text.contains("weir_spend_micros_total{"),
        "the call was counted"
    );
    for never in ["run-7f3a", "planner-9", "run=", "run_id=", "agent="] {
        assert!(!text.contains(never), "{never} in the metrics:\n{text}");
    }
}

/// A call to an approval-class tool is held by the time the client is handed the event that
/// completes it (the filter then names a stored approval), and not before its arguments are
/// whole.
#[tokio::test]
async fn record_precedes_completing_event() {
    let rig = rig(5_000);
    let mut flight = flight(&rig, false);
    flight.who.tool_approval = vec!["deploy_*".into()];
    flight.approval = Watch::of(&flight.who, Endpoint::ChatCompletions, || [1; 32]);
    let Running {
        feed, mut client, ..
    } = run(flight, LONG);
    let events = [
        r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"deploy_prod","arguments":"{\"env\":"}}]}}]}"#,
        r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"prod\"}"}}]}}]}"#,
        r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
    ];
    let id = weir_core::tools::approval_id("r1", 0, "call_1");
    let ops = crate::approvals::Approver {
        tenant: "ops".into(),
        scopes: vec!["t".into()],
    };
    let held = || {
        (rig.app.approvals)
            .get(&ops, &id, crate::support::clock::now_ms())
            .map(|a| a.call.arguments)
    };
    for (i, event) in events.iter().enumerate() {
        feed.unbounded_send(Ok(Bytes::from(format!("data: {event}\n\n"))))
            .unwrap();
        let Some(Piece::Chunk(chunk)) = client.recv().await else {
            panic!("event {i} relayed");
        };
        let completing = String::from_utf8_lossy(&chunk).contains("finish_reason");
        assert_eq!(completing, i == 2);
        let expected = completing.then(|| r#"{"env":"prod"}"#.to_owned());
        assert_eq!(held(), expected, "event {i}");
    }
}
