//! The OpenAI-compatible HTTP front of the simulator. Inference and the test surface
//! (`/debug/*`) live here; everything engine-specific comes from the [`Dialect`].

use std::collections::VecDeque;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use futures::stream;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tracing::error;
use weir_core::openai::{ApiError, CompletionRequest, Endpoint};

use crate::dialect::{CacheScope, Dialect};
use crate::driver::{EngineHandle, SeqEvent};
use crate::engine::{SeqId, SeqSpec};
use crate::faults::{Faults, Verdict};
use crate::kv_cache::block_hashes;
use crate::profile::Profile;
use crate::shape::{Field, ShapeFlags};
use crate::text::TextGen;
use crate::wire::{Answer, ResponseHead, SSE_DONE, sse_event};

/// How long an injected drop waits for earlier frames to be written out.
const FLUSH_BEFORE_DROP: std::time::Duration = std::time::Duration::from_millis(50);

/// Prompts larger than this are tokenized off the async workers.
const INLINE_TOKENIZE_BYTES: usize = 64 * 1024;

/// Server settings from the command line.
pub struct Settings {
    /// The model name clients must send.
    pub model: String,
    pub seed: u64,
    pub max_body_bytes: usize,
    /// Keep the last N requests (headers and body) for `GET /debug/requests`; 0 keeps none.
    pub record_requests: usize,
    /// How answers are laid out on the wire.
    pub shape: ShapeFlags,
}

/// Everything the handlers share.
pub struct App {
    engine: EngineHandle,
    profile: Profile,
    dialect: Arc<dyn Dialect>,
    faults: Faults,
    settings: Settings,
    recorded: Mutex<VecDeque<Value>>,
    next_id: AtomicU64,
}

impl App {
    pub fn new(
        engine: EngineHandle,
        profile: Profile,
        dialect: Arc<dyn Dialect>,
        faults: Faults,
        settings: Settings,
    ) -> Self {
        App {
            engine,
            profile,
            dialect,
            faults,
            settings,
            recorded: Mutex::new(VecDeque::new()),
            next_id: AtomicU64::new(1),
        }
    }

    /// Keeps what a request looked like on arrival, for tests of the proxies in front.
    fn record(&self, path: &str, headers: &HeaderMap, body: &[u8]) {
        if self.settings.record_requests == 0 {
            return;
        }
        let headers: serde_json::Map<String, Value> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), json!(String::from_utf8_lossy(v.as_bytes()))))
            .collect();
        let body =
            serde_json::from_slice(body).unwrap_or_else(|_| json!(String::from_utf8_lossy(body)));
        let mut recorded = self.recorded.lock().unwrap_or_else(|e| e.into_inner());
        if recorded.len() == self.settings.record_requests {
            recorded.pop_front();
        }
        recorded.push_back(json!({"path": path, "headers": headers, "body": body}));
    }
}

pub fn router(app: Arc<App>) -> Router {
    let endpoints = app.dialect.clone().endpoints();
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/debug/requests", get(recorded_requests))
        .route("/debug/faults", get(faults))
        .route("/debug/faults/hang", put(switch_hang))
        .fallback(|State(app): State<Arc<App>>| async move {
            app.dialect
                .error(&ApiError::not_found("no such route; see /v1/models"))
        })
        .with_state(app)
        .merge(endpoints)
}

async fn chat_completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    complete(app, Endpoint::ChatCompletions, headers, body).await
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    complete(app, Endpoint::Completions, headers, body).await
}

async fn recorded_requests(State(app): State<Arc<App>>) -> Response {
    let recorded = app.recorded.lock().unwrap_or_else(|e| e.into_inner());
    axum::Json(Value::Array(recorded.iter().cloned().collect())).into_response()
}

/// The run-time fault switches and what they hold.
async fn faults(State(app): State<Arc<App>>) -> Response {
    axum::Json(json!({"hang": app.faults.hangs(), "hung": app.faults.num_hung()})).into_response()
}

/// `PUT /debug/faults/hang` with `true` or `false`: new requests hang, or are served again.
async fn switch_hang(State(app): State<Arc<App>>, body: Bytes) -> Response {
    match serde_json::from_slice::<bool>(&body) {
        Ok(on) => {
            app.faults.set_hang(on);
            faults(State(app)).await
        }
        Err(_) => app
            .dialect
            .error(&ApiError::bad_request("expected `true` or `false`")),
    }
}

/// One accepted request on its way through the engine.
struct Job {
    head: ResponseHead,
    spec: SeqSpec,
    finish_reason: &'static str,
    text: TextGen,
    stream: bool,
    include_usage: bool,
    accepted: u64,
}

async fn complete(app: Arc<App>, endpoint: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let limit = app.settings.max_body_bytes;
    let Ok(bytes) = axum::body::to_bytes(body, limit).await else {
        return app.dialect.error(&ApiError::payload_too_large(limit));
    };
    let path = match endpoint {
        Endpoint::ChatCompletions => "/v1/chat/completions",
        Endpoint::Completions => "/v1/completions",
    };
    app.record(path, &headers, &bytes);
    if app.faults.hangs() {
        // Accepted, never answered: the handler is dropped when the client goes away.
        let _held = app.faults.hold();
        std::future::pending::<()>().await;
    }
    let job = match prepare(&app, endpoint, &bytes).await {
        Ok(job) => job,
        Err(refusal) => return refusal,
    };
    let mut events = app.engine.submit(job.spec.clone(), job.finish_reason);
    let guard = AbortOnDrop {
        engine: app.engine.clone(),
        id: Some(job.spec.id),
    };
    if !job.stream {
        return collect_response(app, job, events, guard).await;
    }
    if app.dialect.defers_headers() {
        // The status line waits until the engine starts the request; a client that gives up
        // first drops this handler, and the guard takes the request out of the queue.
        match events.recv().await {
            Some(SeqEvent::Started) => {}
            Some(SeqEvent::Rejected(msg)) => return app.dialect.error(&ApiError::bad_request(msg)),
            _ => return app.dialect.error(&ApiError::internal("engine stopped")),
        }
    }
    stream_response(app, job, events, guard)
}

/// Parses, validates and sizes a request: everything that can fail before the engine sees it.
async fn prepare(app: &App, endpoint: Endpoint, bytes: &Bytes) -> Result<Job, Response> {
    let refuse = |e: ApiError| app.dialect.error(&e);
    let req = CompletionRequest::parse(bytes).map_err(refuse)?;
    req.validate(endpoint).map_err(refuse)?;
    let model = app
        .dialect
        .served_model(&req.model, &app.settings.model)
        .map_err(refuse)?;
    let (verdict, accepted) = app.faults.admit();
    match verdict {
        Verdict::Serve => {}
        Verdict::Fail => return Err(refuse(ApiError::internal("injected engine failure"))),
        Verdict::Throttle => return Err(refuse(ApiError::rate_limited("injected throttling"))),
    }

    let encoding = app.profile.model.tokenizer;
    let (req, tokens) = if bytes.len() > INLINE_TOKENIZE_BYTES {
        tokio::task::spawn_blocking(move || {
            let tokens = req.prompt_tokens(endpoint, encoding);
            (req, tokens)
        })
        .await
        .map_err(|e| refuse(ApiError::internal(format!("tokenizer task failed: {e}"))))?
    } else {
        let tokens = req.prompt_tokens(endpoint, encoding);
        (req, tokens)
    };
    let tokens = tokens.map_err(|e| refuse(ApiError::internal(e.to_string())))?;

    let prompt_len = tokens.len() as u64;
    let max_tokens = app
        .dialect
        .output_budget(&req, prompt_len, &app.profile)
        .map_err(|refusal| *refusal)?;
    let block_hashes = match app.dialect.cache_scope(&req, bytes) {
        CacheScope::Salted(salt) => block_hashes(salt, &tokens),
        CacheScope::Off => Vec::new(),
    };

    let seed = req.seed.unwrap_or_else(|| {
        let mut h = DefaultHasher::new();
        (app.settings.seed, &tokens).hash(&mut h);
        h.finish()
    });
    let mut text = TextGen::new(seed);
    let output_len = if req.ignore_eos.unwrap_or(false) {
        max_tokens
    } else {
        text.natural_length(&app.profile.output).min(max_tokens)
    };
    let id = app.next_id.fetch_add(1, Ordering::Relaxed);
    Ok(Job {
        head: ResponseHead::new(endpoint, id, &model),
        spec: SeqSpec {
            id,
            prompt_len,
            block_hashes,
            output_len,
        },
        finish_reason: if output_len == max_tokens {
            "length"
        } else {
            "stop"
        },
        text,
        stream: req.is_streaming(),
        include_usage: req.wants_stream_usage(),
        accepted,
    })
}

/// Aborts the engine sequence unless the request completed: a dropped handler or a closed
/// stream means the client went away.
struct AbortOnDrop {
    engine: EngineHandle,
    id: Option<SeqId>,
}

impl AbortOnDrop {
    fn disarm(&mut self) {
        self.id = None;
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            self.engine.abort(id);
        }
    }
}

/// The connection is to be cut, as a crashed engine would.
struct Dropped;

/// Applies the token-level faults, then yields the piece of text for token `index`.
async fn next_piece(app: &App, job: &mut Job, index: u32) -> Result<&'static str, Dropped> {
    if index == 0 && app.faults.is_fatal(job.accepted) {
        error!(request = job.accepted, "--exit-after reached: crashing");
        std::process::exit(70);
    }
    if app.faults.drops_before(index) {
        return Err(Dropped);
    }
    if let Some(stall) = app.faults.stall_before(index) {
        tokio::time::sleep(stall).await;
    }
    Ok(job.text.next_piece())
}

type Chunk = Result<Bytes, io::Error>;

fn stream_response(
    app: Arc<App>,
    job: Job,
    events: mpsc::UnboundedReceiver<SeqEvent>,
    guard: AbortOnDrop,
) -> Response {
    let (tx, rx) = mpsc::channel::<Chunk>(64);
    tokio::spawn(pump(app, job, events, guard, tx));
    let body = Body::from_stream(stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|chunk| (chunk, rx))
    }));
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .unwrap_or_else(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response())
}

/// Relays engine events as SSE until the sequence ends or the client leaves.
async fn pump(
    app: Arc<App>,
    mut job: Job,
    mut events: mpsc::UnboundedReceiver<SeqEvent>,
    mut guard: AbortOnDrop,
    tx: mpsc::Sender<Chunk>,
) {
    let shape = &app.settings.shape;
    let wire = app.dialect.wire();
    let (mut pending, mut pending_tokens, mut first) = (String::new(), 0, true);
    loop {
        let event = tokio::select! {
            event = events.recv() => event,
            _ = tx.closed() => return,
        };
        let frame = match event {
            Some(SeqEvent::Started) => continue,
            Some(SeqEvent::Token { index }) => match next_piece(&app, &mut job, index).await {
                Ok(piece) => {
                    pending.push_str(piece);
                    pending_tokens += 1;
                    let len = job.spec.output_len;
                    if !shape.chunk_ends(index, len, pending_tokens) {
                        continue;
                    }
                    let last = index + 1 == len;
                    let field = match job.head.endpoint {
                        Endpoint::ChatCompletions => shape.field(index),
                        Endpoint::Completions => Field::Content,
                    };
                    let frames = wire.token_frames(
                        &job.head,
                        &pending,
                        field,
                        first,
                        last.then_some(job.finish_reason),
                    );
                    pending.clear();
                    (pending_tokens, first) = (0, false);
                    frames
                }
                Err(Dropped) => {
                    // Let the tokens already sent reach the socket before the cut, so clients
                    // see exactly `--drop-after` tokens.
                    tokio::time::sleep(FLUSH_BEFORE_DROP).await;
                    let _ = tx.send(Err(io::Error::other("injected drop"))).await;
                    return;
                }
            },
            Some(SeqEvent::Finished(done)) => {
                guard.disarm();
                let usage = (!shape.omit_usage).then_some(job.include_usage);
                let tail = wire.closing_frames(&job.head, job.finish_reason, &done, usage);
                let _ = tx.send(Ok(Bytes::from(tail))).await;
                return;
            }
            Some(SeqEvent::Rejected(msg)) => {
                guard.disarm();
                let err = ApiError::bad_request(msg).to_json().to_string();
                let _ = tx.send(Ok(Bytes::from(sse_event(&err) + SSE_DONE))).await;
                return;
            }
            None => {
                let err = ApiError::internal("engine stopped").to_json().to_string();
                let _ = tx.send(Ok(Bytes::from(sse_event(&err)))).await;
                return;
            }
        };
        if tx.send(Ok(Bytes::from(frame))).await.is_err() {
            return;
        }
    }
}

async fn collect_response(
    app: Arc<App>,
    mut job: Job,
    mut events: mpsc::UnboundedReceiver<SeqEvent>,
    mut guard: AbortOnDrop,
) -> Response {
    let shape = &app.settings.shape;
    let (mut reasoning, mut text) = (String::new(), String::new());
    while let Some(event) = events.recv().await {
        match event {
            SeqEvent::Started => {}
            SeqEvent::Token { index } => match next_piece(&app, &mut job, index).await {
                Ok(piece) => match (job.head.endpoint, shape.field(index)) {
                    (Endpoint::ChatCompletions, Field::Reasoning) => reasoning.push_str(piece),
                    _ => text.push_str(piece),
                },
                Err(Dropped) => {
                    let cut =
                        stream::once(async { Err::<Bytes, _>(io::Error::other("injected drop")) });
                    return Body::from_stream(cut).into_response();
                }
            },
            SeqEvent::Finished(done) => {
                guard.disarm();
                let answer = Answer {
                    reasoning: (!reasoning.is_empty()).then_some(reasoning.as_str()),
                    text: &text,
                    finish_reason: job.finish_reason,
                };
                let body = app
                    .dialect
                    .wire()
                    .response(&job.head, answer, &done, !shape.omit_usage);
                return ([(header::CONTENT_TYPE, "application/json")], body).into_response();
            }
            SeqEvent::Rejected(msg) => {
                guard.disarm();
                return app.dialect.error(&ApiError::bad_request(msg));
            }
        }
    }
    app.dialect.error(&ApiError::internal("engine stopped"))
}
