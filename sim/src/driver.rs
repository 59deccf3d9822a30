//! Runs the [`Engine`] against the wall clock on its own thread.
//!
//! A step's tokens are released when the step would have finished on the GPU: its model-time
//! end divided by the time scale. Requests and aborts are taken between steps, so an abort
//! frees its blocks before the next step is built.

use std::collections::HashMap;
use std::thread;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tracing::warn;

use crate::engine::{Engine, Finished, SeqId, SeqSpec, StepReport};
use crate::metrics::{EngineMetrics, THROUGHPUT_WINDOW};
use crate::profile::Profile;

/// What a request's handler hears from the engine about one of its sequences.
#[derive(Debug)]
pub enum SeqEvent {
    /// The engine scheduled the sequence for the first time (a slot took it), finding
    /// `cached_tokens` of its prompt in the prefix cache.
    Started {
        cached_tokens: u64,
    },
    /// The sequence produced its token number `index` (0-based).
    Token {
        index: u32,
    },
    Finished(Finished),
    /// The engine refused the sequence.
    Rejected(String),
}

/// Events of every sequence of one request arrive on one channel, each with its sequence.
pub type Events = UnboundedReceiver<(SeqId, SeqEvent)>;
pub type EventSender = UnboundedSender<(SeqId, SeqEvent)>;

enum Command {
    Submit {
        spec: SeqSpec,
        finish_reason: &'static str,
        events: EventSender,
    },
    Abort(SeqId),
}

/// A handle to the engine thread; cheap to clone.
#[derive(Clone)]
pub struct EngineHandle {
    commands: UnboundedSender<Command>,
}

impl EngineHandle {
    /// Starts the engine thread. `time_scale` > 1 runs model time faster than the wall clock.
    pub fn spawn(
        profile: Profile,
        time_scale: f64,
        metrics: EngineMetrics,
    ) -> std::io::Result<Self> {
        let (tx, rx) = unbounded_channel();
        let driver = Driver {
            engine: Engine::new(profile),
            metrics,
            subscribers: HashMap::new(),
            scale: time_scale,
            start: Instant::now(),
            window: (0, 0.0),
        };
        thread::Builder::new()
            .name("engine".into())
            .spawn(move || driver.run(rx))?;
        Ok(EngineHandle { commands: tx })
    }

    /// A channel for the events of one request's sequences.
    pub fn events() -> (EventSender, Events) {
        unbounded_channel()
    }

    /// Queues a sequence; its events arrive on `events`, tagged with its id.
    /// `finish_reason` is what the sequence reports when it generates all its tokens.
    pub fn submit(&self, spec: SeqSpec, finish_reason: &'static str, events: &EventSender) {
        let id = spec.id;
        let cmd = Command::Submit {
            spec,
            finish_reason,
            events: events.clone(),
        };
        if self.commands.send(cmd).is_err() {
            let _ = events.send((id, SeqEvent::Rejected("engine stopped".into())));
        }
    }

    pub fn abort(&self, id: SeqId) {
        let _ = self.commands.send(Command::Abort(id));
    }
}

struct Subscriber {
    events: EventSender,
    finish_reason: &'static str,
    arrival: f64,
    last_token: f64,
}

struct Driver {
    engine: Engine,
    metrics: EngineMetrics,
    subscribers: HashMap<SeqId, Subscriber>,
    scale: f64,
    start: Instant,
    /// Tokens generated and model seconds spent since the throughput window opened.
    window: (u64, f64),
}

impl Driver {
    fn run(mut self, mut rx: UnboundedReceiver<Command>) {
        loop {
            if self.engine.is_idle() {
                // Sleep until work arrives; the GPU's clock runs on meanwhile.
                let Some(cmd) = rx.blocking_recv() else {
                    return;
                };
                let now = self.model_now();
                self.engine.advance_to(now);
                self.apply(cmd);
            }
            while let Ok(cmd) = rx.try_recv() {
                self.apply(cmd);
            }
            match self.engine.step() {
                Some(report) => {
                    self.wait_until(report.end);
                    self.publish(report);
                }
                // Submission guarantees every sequence fits, so this is only reached when all
                // work was aborted in the same breath; yield rather than spin.
                None => thread::sleep(Duration::from_millis(1)),
            }
            self.update_gauges();
        }
    }

    fn model_now(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * self.scale
    }

    fn wait_until(&self, model_time: f64) {
        let due = self.start + Duration::from_secs_f64(model_time / self.scale);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
    }

    fn apply(&mut self, cmd: Command) {
        match cmd {
            Command::Submit {
                spec,
                finish_reason,
                events,
            } => {
                let id = spec.id;
                match self.engine.submit(spec) {
                    Ok(()) => {
                        let arrival = self.engine.now();
                        self.subscribers.insert(
                            id,
                            Subscriber {
                                events,
                                finish_reason,
                                arrival,
                                last_token: arrival,
                            },
                        );
                    }
                    Err(e) => {
                        let _ = events.send((id, SeqEvent::Rejected(e.to_string())));
                    }
                }
            }
            Command::Abort(id) => self.abort(id),
        }
        self.update_gauges();
    }

    fn publish(&mut self, report: StepReport) {
        let m = &self.metrics;
        m.steps.inc();
        m.batched_sequences.inc_by(report.batched_sequences as u64);
        m.iteration_tokens.observe(report.batched_tokens as f64);
        m.preemptions.inc_by(u64::from(report.preemptions));
        m.prefix_queries.inc_by(report.prefix_queries);
        m.prefix_hits.inc_by(report.prefix_hits);
        if report.prefix_queries > 0 {
            m.recent_prefix_hit_rate
                .set(report.prefix_hits as f64 / report.prefix_queries as f64);
        }
        self.window.0 += report.tokens.len() as u64;
        self.window.1 += report.duration;
        if m.steps.get().is_multiple_of(THROUGHPUT_WINDOW) {
            let (tokens, seconds) = std::mem::take(&mut self.window);
            m.recent_generation_throughput.set(tokens as f64 / seconds);
        }

        let mut gone = Vec::new();
        for &(id, cached_tokens) in &report.started {
            if let Some(sub) = self.subscribers.get(&id)
                && sub
                    .events
                    .send((id, SeqEvent::Started { cached_tokens }))
                    .is_err()
            {
                gone.push(id);
            }
        }
        for &(id, index) in &report.tokens {
            let Some(sub) = self.subscribers.get_mut(&id) else {
                continue;
            };
            if index == 0 {
                m.ttft.observe(report.end - sub.arrival);
            } else {
                m.itl.observe(report.end - sub.last_token);
            }
            sub.last_token = report.end;
            m.generation_tokens.inc();
            if sub.events.send((id, SeqEvent::Token { index })).is_err() {
                gone.push(id);
            }
        }
        for done in report.finished {
            let Some(sub) = self.subscribers.remove(&done.id) else {
                continue;
            };
            m.record_finished(&done, sub.finish_reason);
            let _ = sub.events.send((done.id, SeqEvent::Finished(done)));
        }
        for id in gone {
            warn!(seq = id, "receiver gone; aborting");
            self.abort(id);
        }
    }

    /// Drops a sequence whose client went away.
    fn abort(&mut self, id: SeqId) {
        if self.engine.abort(id) {
            self.metrics.aborted.inc();
        }
        self.subscribers.remove(&id);
    }

    fn update_gauges(&self) {
        self.metrics.running.set(self.engine.num_running() as i64);
        self.metrics.waiting.set(self.engine.num_waiting() as i64);
        self.metrics.kv_usage.set(self.engine.kv_usage());
    }
}
