//! Relays a job's engine events to its client: every sequence is submitted, each token becomes
//! a piece of text (after the token-level faults), pieces are gathered into chunks as the shape
//! flags lay them out, and the chunks go to the API's [`Encoder`] as a stream or into
//! [`Answer`]s for a whole body. A client that goes away aborts every sequence still running.

use std::io;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::stream;
use tokio::sync::mpsc;
use tracing::error;
use weir_core::error::ApiError;

use crate::app::App;
use crate::driver::{EngineHandle, Events, SeqEvent};
use crate::engine::{Finished, SeqId};
use crate::job::{Choice, Job};
use crate::shape::Field;
use crate::tool_call::{ToolCall, fragments};
use crate::wire::{self, Answer, Finish, Outcome, Output, merged};

/// How long an injected drop waits for earlier frames to be written out.
const FLUSH_BEFORE_DROP: std::time::Duration = std::time::Duration::from_millis(50);

/// Aborts the engine sequences that have not finished when dropped: a dropped handler or a
/// closed stream means the client went away.
pub struct AbortOnDrop {
    engine: EngineHandle,
    running: Vec<SeqId>,
}

impl AbortOnDrop {
    fn finished(&mut self, id: SeqId) {
        self.running.retain(|&r| r != id);
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for &id in &self.running {
            self.engine.abort(id);
        }
    }
}

/// Submits every sequence of the job; their events arrive on one channel.
pub fn submit(app: &App, job: &Job) -> (Events, AbortOnDrop) {
    let (tx, events) = EngineHandle::events();
    for choice in &job.choices {
        let reason = choice.finish.metric_reason();
        app.engine.submit(choice.spec.clone(), reason, &tx);
    }
    let guard = AbortOnDrop {
        engine: app.engine.clone(),
        running: job.choices.iter().map(|c| c.spec.id).collect(),
    };
    (events, guard)
}

/// The connection is to be cut, as a crashed engine would.
struct Dropped;

/// Applies the faults due before output `index` of the request numbered `accepted`.
async fn faults_before(app: &App, accepted: u64, index: u32) -> Result<(), Dropped> {
    if index == 0 && app.faults.is_fatal(accepted) {
        error!(request = accepted, "--exit-after reached: crashing");
        std::process::exit(70);
    }
    if app.faults.drops_before(index) {
        return Err(Dropped);
    }
    if let Some(stall) = app.faults.stall_before(index) {
        tokio::time::sleep(stall).await;
    }
    Ok(())
}

/// Which part of the answer a piece belongs to.
#[derive(Clone, Copy)]
enum Part {
    Reasoning,
    Text,
    /// The arguments of the call with this index.
    Arguments(u32),
}

/// A chunk of one choice's output, ready for the wire: one piece, or one per tool call it
/// touches when the answer makes several.
struct Chunk {
    choice: u32,
    pieces: Vec<(Part, String)>,
    finish: Option<Finish>,
}

impl Chunk {
    /// The chunk's outputs, the choice's finish on the last of its last chunk.
    fn outputs(&self) -> impl Iterator<Item = (Output<'_>, Option<Finish>)> {
        let last = self.pieces.len().saturating_sub(1);
        self.pieces
            .iter()
            .enumerate()
            .map(move |(i, (part, text))| {
                let output = match *part {
                    Part::Reasoning => Output::Reasoning(text),
                    Part::Text => Output::Text(text),
                    Part::Arguments(call) => Output::Arguments(call, text),
                };
                (output, self.finish.filter(|_| i == last))
            })
    }
}

/// Where one choice's generation stands.
#[derive(Default)]
struct Progress {
    pending: String,
    pending_tokens: u32,
    /// The tool call whose arguments are being filled.
    open_call: Option<usize>,
    done: Option<Finished>,
}

/// A job's generation as its tokens arrive.
struct Run<'a> {
    app: &'a App,
    choices: Vec<Choice>,
    progress: Vec<Progress>,
    accepted: u64,
    reasons: bool,
    calls: &'a [ToolCall],
}

impl<'a> Run<'a> {
    fn new(
        app: &'a App,
        choices: Vec<Choice>,
        accepted: u64,
        reasons: bool,
        calls: &'a [ToolCall],
    ) -> Self {
        let progress = choices.iter().map(|_| Progress::default()).collect();
        Run {
            app,
            choices,
            progress,
            accepted,
            reasons,
            calls,
        }
    }

    /// The choice a sequence answers.
    fn choice(&self, seq: SeqId) -> Option<usize> {
        let first = self.choices.first()?.spec.id;
        let index = usize::try_from(seq.checked_sub(first)?).ok()?;
        (index < self.choices.len()).then_some(index)
    }

    /// Applies token `index`'s faults and takes its piece; returns the chunk it completes.
    async fn token(&mut self, c: usize, index: u32) -> Result<Option<Chunk>, Dropped> {
        faults_before(self.app, self.accepted, index).await?;
        let shape = &self.app.settings.shape;
        let (Some(choice), Some(progress)) = (self.choices.get_mut(c), self.progress.get_mut(c))
        else {
            return Ok(None);
        };
        progress.pending.push_str(choice.text.next_piece());
        progress.pending_tokens += 1;
        let len = choice.spec.output_len;
        if !shape.chunk_ends(index, len, progress.pending_tokens) {
            return Ok(None);
        }
        let last = index + 1 == len;
        let pending = std::mem::take(&mut progress.pending);
        progress.pending_tokens = 0;
        let field = if self.reasons {
            shape.field(index)
        } else {
            Field::Content
        };
        let pieces = match field {
            Field::Reasoning => vec![(Part::Reasoning, pending)],
            Field::Content if self.calls.is_empty() => vec![(Part::Text, pending)],
            Field::Content => {
                // The content is shared out over the calls in order, by token position.
                let reasoning = if self.reasons {
                    shape.reasoning_tokens
                } else {
                    0
                };
                let position = u64::from(index.saturating_sub(reasoning));
                let content_len = u64::from(len.saturating_sub(reasoning)).max(1);
                let target = position * self.calls.len() as u64 / content_len;
                let target = usize::try_from(target).unwrap_or(usize::MAX);
                fragments(self.calls, &mut progress.open_call, &pending, target, last)
                    .into_iter()
                    .map(|(call, text)| (Part::Arguments(call), text))
                    .collect()
            }
        };
        Ok(Some(Chunk {
            choice: u32::try_from(c).unwrap_or(u32::MAX),
            pieces,
            finish: last.then_some(choice.finish),
        }))
    }

    /// Records a finished sequence; once every one has, what the request came to.
    fn finish(&mut self, c: usize, done: Finished) -> Option<Outcome> {
        if let Some(progress) = self.progress.get_mut(c) {
            progress.done = Some(done);
        }
        let done: Vec<Finished> = self
            .progress
            .iter()
            .map(|p| p.done.clone())
            .collect::<Option<_>>()?;
        let reasoning = if self.reasons {
            self.app.settings.shape.reasoning_tokens
        } else {
            0
        };
        Some(Outcome {
            finishes: self.choices.iter().map(|c| c.finish).collect(),
            reasoning_tokens: done
                .iter()
                .map(|d| d.usage.completion_tokens.min(reasoning))
                .sum(),
            done: merged(&done),
        })
    }
}

/// Answers a job: streamed, or as a whole body once every sequence finished.
pub async fn reply(app: Arc<App>, job: Job, events: Events, guard: AbortOnDrop) -> Response {
    if job.stream {
        stream_response(app, job, events, guard).await
    } else {
        collect_response(app, job, events, guard).await
    }
}

type Frame = Result<Bytes, io::Error>;

async fn stream_response(
    app: Arc<App>,
    job: Job,
    mut events: Events,
    guard: AbortOnDrop,
) -> Response {
    let mut early = None;
    if app.dialect.defers_headers() {
        // The status line waits until the engine starts the request; a client that gives up
        // first drops this handler, and the guard takes the request out of the queue.
        let shape = job.reply.head.endpoint.error_shape();
        match events.recv().await {
            Some(started @ (_, SeqEvent::Started { .. })) => early = Some(started),
            Some((_, SeqEvent::Rejected(msg))) => {
                return app.refuse(shape, ApiError::bad_request(msg));
            }
            _ => return app.refuse(shape, ApiError::internal("engine stopped")),
        }
    }
    let (tx, rx) = mpsc::channel::<Frame>(64);
    tokio::spawn(pump(app, job, events, early, guard, tx));
    let body = Body::from_stream(stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|frame| (frame, rx))
    }));
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .unwrap_or_else(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response())
}

/// Relays engine events as SSE until every sequence ends or the client leaves.
async fn pump(
    app: Arc<App>,
    job: Job,
    mut events: Events,
    mut early: Option<(SeqId, SeqEvent)>,
    mut guard: AbortOnDrop,
    tx: mpsc::Sender<Frame>,
) {
    let Job {
        reply,
        choices,
        accepted,
        reasons,
        ..
    } = job;
    let mut run = Run::new(&app, choices, accepted, reasons, &reply.calls);
    let mut encoder = wire::encoder(&reply, app.dialect.wire());
    loop {
        let event = match early.take() {
            Some(event) => Some(event),
            None => tokio::select! {
                event = events.recv() => event,
                _ = tx.closed() => return,
            },
        };
        let Some((seq, event)) = event else {
            let frames = encoder.error(&ApiError::internal("engine stopped"));
            let _ = tx.send(Ok(Bytes::from(frames))).await;
            return;
        };
        let Some(c) = run.choice(seq) else {
            continue;
        };
        let frames = match event {
            SeqEvent::Started { cached_tokens } => {
                encoder.started(u32::try_from(c).unwrap_or(u32::MAX), cached_tokens)
            }
            SeqEvent::Token { index } => match run.token(c, index).await {
                Ok(Some(chunk)) => chunk
                    .outputs()
                    .map(|(output, finish)| encoder.output(chunk.choice, output, finish))
                    .collect(),
                Ok(None) => continue,
                Err(Dropped) => {
                    // Let the tokens already sent reach the socket before the cut, so clients
                    // see exactly `--drop-after` tokens.
                    tokio::time::sleep(FLUSH_BEFORE_DROP).await;
                    let _ = tx.send(Err(io::Error::other("injected drop"))).await;
                    return;
                }
            },
            SeqEvent::Finished(done) => {
                guard.finished(seq);
                let Some(outcome) = run.finish(c, done) else {
                    continue;
                };
                let _ = tx.send(Ok(Bytes::from(encoder.close(&outcome)))).await;
                return;
            }
            SeqEvent::Rejected(msg) => {
                guard.finished(seq);
                let frames = encoder.error(&ApiError::bad_request(msg));
                let _ = tx.send(Ok(Bytes::from(frames))).await;
                return;
            }
        };
        if !frames.is_empty() && tx.send(Ok(Bytes::from(frames))).await.is_err() {
            return;
        }
    }
}

/// A body cut off as a crashed engine would leave it.
fn cut() -> Response {
    let cut = stream::once(async { Err::<Bytes, _>(io::Error::other("injected drop")) });
    Body::from_stream(cut).into_response()
}

async fn collect_response(
    app: Arc<App>,
    job: Job,
    mut events: Events,
    mut guard: AbortOnDrop,
) -> Response {
    let shape = job.reply.head.endpoint.error_shape();
    let prompt_only = job.prompt_only();
    let Job {
        reply,
        choices,
        accepted,
        reasons,
        ..
    } = job;
    let mut answers: Vec<Answer> = choices
        .iter()
        .map(|c| Answer {
            finish: c.finish,
            ..Answer::default()
        })
        .collect();
    let mut run = Run::new(&app, choices, accepted, reasons, &reply.calls);
    while let Some((seq, event)) = events.recv().await {
        let Some(c) = run.choice(seq) else {
            continue;
        };
        match event {
            SeqEvent::Started { .. } => {}
            SeqEvent::Token { index } => match run.token(c, index).await {
                Ok(Some(chunk)) => {
                    if let Some(answer) = answers.get_mut(c) {
                        chunk.outputs().for_each(|(output, _)| answer.push(output));
                    }
                }
                Ok(None) => {}
                Err(Dropped) => return cut(),
            },
            SeqEvent::Finished(done) => {
                guard.finished(seq);
                let Some(outcome) = run.finish(c, done) else {
                    continue;
                };
                // An embedding is the request's one output: the token-level faults of its first.
                if prompt_only && faults_before(&app, accepted, 0).await.is_err() {
                    return cut();
                }
                let body = wire::body(&reply, app.dialect.wire(), &answers, &outcome);
                return ([(header::CONTENT_TYPE, "application/json")], body).into_response();
            }
            SeqEvent::Rejected(msg) => {
                guard.finished(seq);
                return app.refuse(shape, ApiError::bad_request(msg));
            }
        }
    }
    app.refuse(shape, ApiError::internal("engine stopped"))
}
