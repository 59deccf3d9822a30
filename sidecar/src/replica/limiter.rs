//! A replica's adaptive concurrency limit: how many of weir's requests its engine can start at
//! once without queueing them inside itself — and without holding back work it could batch.
//!
//! An engine runs a fixed number of requests at once (llama.cpp's slots, SGLang's
//! `max_running_requests`, vLLM's `max_num_seqs`) and queues the rest in arrival order, where
//! weir's fair order no longer holds. The limit starts at that number where the engine says it
//! (or the configured `max_concurrency_per_replica`), otherwise at [`INITIAL_LIMIT`], and never
//! rises above it. How it moves depends on what the engine tells ([`Mode`]):
//!
//! - **An engine that reports its own queue** (every dialect weir reads: vLLM, SGLang,
//!   llama.cpp, TGI) says whether it holds requests back, so weir does not guess it from
//!   latency. Time to first byte does not lower the limit there: on an engine whose per-token
//!   time rises with the batch (every CPU-bound or small-GPU one) a request's TTFB rises as the
//!   batch fills, which is the batch's cost, not a queue — read as a queue it held two
//!   llama.cpp replicas of 4 slots at 1 and 3 under a flood, serving less while refusing more.
//!   Where weir admits without KV figures (llama.cpp, TGI), the engine's queue in
//!   [`QUEUE_SCRAPES`] scrapes in a row means it is out of slots, and the limit drops to what it
//!   runs ([`Limiter::engine_scrape`]); one scrape is not enough, as a request that arrives as an
//!   answer ends can wait a step for the slot that answer is freeing. Where weir admits by KV
//!   (the engine reports its capacity, or the config names it), a queue means weir's KV estimate
//!   fell short: the dispatcher sends nothing more there until it has drained and the limit
//!   stays, as a slot limit would count a 250-token request as much as a 5,000-token one (the
//!   dispatcher feeds [`Limiter::engine_scrape`] only the scrapes of replicas without KV figures).
//!   Every start (first bytes, or a whole non-streamed answer) raises the limit by one, if the
//!   replica is using at least half of it (a quiet replica proves nothing): so it climbs back
//!   to the engine's slots after a cut.
//! - **An engine that reports no queue** (one weir does not recognise) shows a queue only in time
//!   to first byte (TTFB): from dispatch to the first body bytes of a stream, the moment the engine
//!   has started the request. TTFB grows with the prompt (prefill), so each sample is divided by
//!   the floor — the least TTFB seen — of its own prompt-length class (powers of two of prompt
//!   tokens): a 1,500-token prompt is never judged against a 250-token one. Floors under
//!   [`MIN_FLOOR_MS`] count as that much, so a few milliseconds of scheduling jitter on a fast
//!   engine are not read as a queue. The ratios are smoothed ([`SMOOTHING`]): one slow answer is
//!   not a queue. Within [`TOLERANCE`] (which also covers the twofold spread of prompt lengths
//!   inside a class) the engine starts what it gets at once, and the limit grows by one per sample
//!   as above (and per non-streamed answer, whose time says nothing of a queue); beyond it, the
//!   limit is multiplied by the gradient `TOLERANCE / ratio`, never by less than [`MIN_GRADIENT`]
//!   at once. But TTFB cannot tell a queue from the batch's cost, so goodput judges each move, in a
//!   hill-climb on the output tokens/s the replica serves while full, measured per limit
//!   ([`Limiter::served`]): TTFB cuts the limit only once a window of output has been measured
//!   where it is, and a limit it was cut (or goodput raised) to is held until it is measured in
//!   turn; no cut goes as low as a limit measured serving less than the *knee*, the least limit
//!   measured within [`GOODPUT_MARGIN`] of the best; and a limit measured serving less than the
//!   knee goes back up a step at a time, each measured. Waiting for a slot adds no output, so
//!   limits above the engine's slots serve alike and the cuts go on down to them; below them the
//!   batch is smaller and serves less, and the limit climbs back: it settles at the knee. Figures
//!   are forgotten after [`GOODPUT_MEMORY_MS`], so the knee is looked for again as the load
//!   changes. The price: a queue in such an engine is cut once a window has closed
//!   ([`WINDOW_MIN_TOKENS`] output tokens, or [`WINDOW_MAX_MS`]), where TTFB alone cut it at the
//!   next sample.
//! - **No first byte within `relay.first_byte_ms`**, on any adaptive replica: the engine
//!   accepted the request and did not start it (hung, or a queue of someone else's): the limit
//!   halves ([`BACKOFF`]), and goodput figures measured before are forgotten.
//!
//! With `adaptive_concurrency: false` ([`Mode::Fixed`]) the limit holds where it starts.
//!
//! One decrease per round: samples of requests dispatched before the last decrease measured the
//! old limit and neither lower nor raise the new one (TCP's one reduction per window), and the
//! smoothed ratio starts afresh, so a burst of slow answers to one overload cuts the limit once,
//! not down to 1. The limit never falls below 1: a replica always takes one request, and its
//! answer is how it recovers.
//!
//! Floors drift up by [`FLOOR_DRIFT`] a sample, so one lucky sample (or a prefix-cache hit)
//! does not set the reference for ever; within a class, cache hits can only make the floor
//! lower, so misses look slower by their prefill, which [`TOLERANCE`] absorbs.

use std::collections::BTreeMap;

/// Where the limit starts, and its floor for growth, when neither the engine nor the config
/// names one: today's default for engines without figures.
pub const INITIAL_LIMIT: u64 = 16;
/// The highest the limit grows without a limit from the engine or the config.
pub const MAX_LIMIT: u64 = 1024;
/// A smoothed TTFB this many times its class's floor or less is a start without waiting.
pub const TOLERANCE: f64 = 3.0;
/// Floors below this (ms) count as this much.
pub const MIN_FLOOR_MS: f64 = 10.0;
/// Weight of each new sample in the smoothed ratio (about the last ten samples count).
pub const SMOOTHING: f64 = 0.2;
/// The most one slow sample cuts the limit by (halving).
pub const MIN_GRADIENT: f64 = 0.5;
/// A first-byte timeout halves the limit.
pub const BACKOFF: f64 = 0.5;
/// How much a class's floor rises with each sample above it.
pub const FLOOR_DRIFT: f64 = 0.01;
/// Scrapes in a row that must show an engine's queue before the limit drops to what it runs.
pub const QUEUE_SCRAPES: u32 = 2;
/// A goodput window holds at least this many output tokens...
pub const WINDOW_MIN_TOKENS: u64 = 1024;
/// ...and this many per request of the limit: the relay reports a stream's tokens 16 at a
/// time, which blurs a window's rate by a few percent at most at this length.
pub const WINDOW_TOKENS_PER_SLOT: u64 = 64;
/// A window closes after this long (ms) however little it holds...
pub const WINDOW_MAX_MS: u64 = 30_000;
/// ...and counts if it holds this many reports at least.
pub const WINDOW_MIN_REPORTS: u64 = 16;
/// A limit whose goodput is more than this fraction below the best serves less.
pub const GOODPUT_MARGIN: f64 = 0.1;
/// How long (ms) a goodput figure holds before it is measured again.
pub const GOODPUT_MEMORY_MS: u64 = 300_000;
/// Prompt-length classes: ⌊log2(prompt tokens)⌋ + 1, the last one open-ended.
const CLASSES: usize = 24;

/// How a replica's limit moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Held where it starts (`adaptive_concurrency: false`).
    Fixed,
    /// The engine reports requests waiting inside it: its queue and first-byte timeouts lower
    /// the limit, starts raise it.
    EngineQueue,
    /// The engine reports no queue: TTFB lowers the limit as far as goodput allows.
    FirstByte,
}

/// A dispatch's place in the replica's order, carried to its samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ticket(u64);

#[cfg(test)]
impl Ticket {
    pub(crate) fn for_tests() -> Ticket {
        Ticket(0)
    }
}

#[derive(Clone, Debug)]
pub struct Limiter {
    mode: Mode,
    limit: f64,
    ceiling: f64,
    /// Per prompt-length class, the least TTFB seen (ms), drifting up.
    floors: [Option<f64>; CLASSES],
    /// TTFB over its class's floor, smoothed over this round's samples.
    ratio: f64,
    dispatched: u64,
    /// Tickets below this were dispatched before the last decrease.
    recovery: u64,
    /// Scrapes in a row that showed the engine holding a queue.
    queued_scrapes: u32,
    goodput: Goodput,
}

/// Output tokens/s the replica served while full, per limit ([`Mode::FirstByte`] only).
#[derive(Clone, Debug, Default)]
struct Goodput {
    /// Per limit: tokens/s, and when it was measured (ms).
    rates: BTreeMap<u64, (f64, u64)>,
    window: Option<Window>,
    stage: Stage,
    /// The latest report's time (ms), against which figures age.
    now_ms: u64,
}

/// Where the current limit stands in the hill-climb: each limit TTFB cuts from, and each one a
/// cut or goodput moves it to, is measured first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Stage {
    /// Where it (re)started, or a timeout left it: TTFB may raise it, and cut it once its
    /// goodput is measured.
    #[default]
    Started,
    /// Cut or raised to: held until its goodput is measured.
    Moved,
    /// Its goodput is measured: TTFB may move it.
    Measured,
}

/// Output reported at one limit since `start_ms`.
#[derive(Clone, Copy, Debug)]
struct Window {
    limit: u64,
    start_ms: u64,
    tokens: u64,
    reports: u64,
    /// Requests in flight, summed over the reports.
    busy: u64,
}

impl Window {
    fn new(limit: u64, start_ms: u64) -> Window {
        Window {
            limit,
            start_ms,
            tokens: 0,
            reports: 0,
            busy: 0,
        }
    }
}

impl Goodput {
    /// Figures younger than [`GOODPUT_MEMORY_MS`], by limit.
    fn fresh(&self) -> impl Iterator<Item = (u64, f64)> + '_ {
        (self.rates.iter())
            .filter(|(_, (_, at))| self.now_ms.saturating_sub(*at) <= GOODPUT_MEMORY_MS)
            .map(|(limit, (rate, _))| (*limit, *rate))
    }

    /// The least limit a cut may go to: one above the highest limit measured below the knee
    /// (the least limit measured within [`GOODPUT_MARGIN`] of the best), which served less.
    fn floor(&self) -> u64 {
        let best = self.fresh().map(|(_, rate)| rate).fold(0.0, f64::max);
        let knee = self
            .fresh()
            .find(|(_, rate)| *rate >= (1.0 - GOODPUT_MARGIN) * best);
        let below = |(limit, _): &(u64, f64)| knee.is_some_and(|(knee, _)| *limit < knee);
        self.fresh()
            .filter(below)
            .last()
            .map_or(1, |(less, _)| less + 1)
    }
}

impl Limiter {
    /// A limiter under `ceiling` (the engine's or the configured limit), starting there.
    pub fn new(ceiling: Option<u64>, mode: Mode) -> Limiter {
        let mut limiter = Limiter {
            mode,
            limit: 0.0,
            ceiling: 0.0,
            floors: [None; CLASSES],
            ratio: 1.0,
            dispatched: 0,
            recovery: 0,
            queued_scrapes: 0,
            goodput: Goodput::default(),
        };
        limiter.restart(ceiling);
        limiter
    }

    /// How the limit moves: as the pool's config and the engine's dialect say.
    pub fn set_mode(&mut self, mode: Mode) {
        self.mode = mode;
    }

    /// A replica (re)joined with `ceiling`: the limit starts over there (or at
    /// [`INITIAL_LIMIT`]), trusting the engine until it shows otherwise. Floors are kept;
    /// goodput, which another engine may serve differently, is measured again.
    pub fn restart(&mut self, ceiling: Option<u64>) {
        self.ceiling = ceiling.unwrap_or(MAX_LIMIT).max(1) as f64;
        self.limit = ceiling.unwrap_or(INITIAL_LIMIT).max(1) as f64;
        self.goodput = Goodput::default();
        self.new_round();
    }

    /// Requests the replica may run at once.
    pub fn limit(&self) -> u64 {
        (self.limit.floor() as u64).max(1)
    }

    /// The adaptive limit before rounding down.
    pub fn adaptive(&self) -> f64 {
        self.limit
    }

    /// The least TTFB (ms) seen on the replica, over all prompt lengths.
    pub fn floor_ms(&self) -> Option<f64> {
        self.floors.iter().flatten().copied().reduce(f64::min)
    }

    /// Numbers a dispatch.
    pub fn dispatch(&mut self) -> Ticket {
        self.dispatched += 1;
        Ticket(self.dispatched)
    }

    /// The engine started a request of `prompt_tokens` `ttfb_ms` after dispatch, while the
    /// replica had `in_flight` requests.
    pub fn first_byte(&mut self, ticket: Ticket, ttfb_ms: f64, prompt_tokens: u64, in_flight: u64) {
        if !(ttfb_ms.is_finite() && ttfb_ms >= 0.0) {
            return;
        }
        let class = (u64::BITS - prompt_tokens.leading_zeros()) as usize;
        let floor = &mut self.floors[class.min(CLASSES - 1)];
        let reference = floor.unwrap_or(ttfb_ms);
        *floor = Some(ttfb_ms.min(reference * (1.0 + FLOOR_DRIFT)));
        if ticket.0 <= self.recovery {
            return;
        }
        match self.mode {
            Mode::Fixed => {}
            // Whether it waited inside the engine, the engine says; how long it took is the
            // batch's cost.
            Mode::EngineQueue => self.grow(in_flight),
            Mode::FirstByte => {
                let ratio = ttfb_ms / reference.max(MIN_FLOOR_MS);
                self.ratio += SMOOTHING * (ratio - self.ratio);
                let stage = self.goodput.stage;
                if self.ratio <= TOLERANCE && stage != Stage::Moved {
                    self.grow(in_flight);
                } else if self.ratio > TOLERANCE && stage == Stage::Measured {
                    self.cut((TOLERANCE / self.ratio).max(MIN_GRADIENT));
                }
            }
        }
    }

    /// A TTFB cut by `gradient`, never to a limit measured serving less.
    fn cut(&mut self, gradient: f64) {
        let floor = self.goodput.floor() as f64;
        let next = (self.limit * gradient).max(floor).max(1.0);
        if (next.floor() as u64) < self.limit() {
            self.limit = next;
            self.goodput.stage = Stage::Moved;
            self.new_round();
        }
    }

    /// One more, if the replica is using at least half of its limit.
    fn grow(&mut self, in_flight: u64) {
        if in_flight.saturating_mul(2) >= self.limit() {
            self.limit = (self.limit + 1.0).min(self.ceiling);
        }
    }

    /// The engine answered a non-streamed request, while the replica had `in_flight` requests.
    pub fn answered(&mut self, ticket: Ticket, in_flight: u64) {
        let held = self.mode == Mode::FirstByte && self.goodput.stage == Stage::Moved;
        if self.mode != Mode::Fixed && !held && ticket.0 > self.recovery {
            self.grow(in_flight);
        }
    }

    /// No first byte within the deadline: the engine did not start the request.
    pub fn timed_out(&mut self, ticket: Ticket) {
        if self.mode != Mode::Fixed && ticket.0 > self.recovery {
            self.goodput.rates.clear();
            self.goodput.stage = Stage::Started;
            self.limit = (self.limit * BACKOFF).max(1.0);
            self.new_round();
        }
    }

    /// A scrape of an engine whose only shortage can be slots: `waiting` requests queued while
    /// it runs `running`.
    pub fn engine_scrape(&mut self, waiting: u64, running: u64) {
        if self.mode == Mode::Fixed {
            return;
        }
        self.queued_scrapes = if waiting > 0 {
            self.queued_scrapes + 1
        } else {
            0
        };
        let running = running.max(1) as f64;
        if self.queued_scrapes >= QUEUE_SCRAPES && running < self.limit {
            self.limit = running;
            self.new_round();
        }
    }

    /// The replica streamed `tokens` more output tokens at `now_ms`, with `in_flight` requests.
    ///
    /// Goodput is measured in windows of output at one limit, from the first report at which
    /// no request of a higher limit still runs; a window's rate counts only if the replica was
    /// full throughout (on average within half a request of its limit), so what it measures is
    /// the engine's pace at that limit, not the demand's. As a window closes, a limit serving
    /// less than the knee goes up a step: the cut that brought it there cost output.
    pub fn served(&mut self, tokens: u64, in_flight: u64, now_ms: u64) {
        if self.mode != Mode::FirstByte {
            return;
        }
        let limit = self.limit();
        let g = &mut self.goodput;
        g.now_ms = g.now_ms.max(now_ms);
        if in_flight > limit {
            g.window = None;
            return;
        }
        let Some(w) = g.window.as_mut().filter(|w| w.limit == limit) else {
            g.window = Some(Window::new(limit, now_ms));
            return;
        };
        w.tokens = w.tokens.saturating_add(tokens);
        w.reports += 1;
        w.busy = w.busy.saturating_add(in_flight);
        let ms = now_ms.saturating_sub(w.start_ms);
        let enough = WINDOW_MIN_TOKENS.max(WINDOW_TOKENS_PER_SLOT.saturating_mul(limit));
        if w.tokens < enough && ms < WINDOW_MAX_MS {
            return;
        }
        let w = *w;
        g.window = Some(Window::new(limit, now_ms));
        g.stage = Stage::Measured;
        let full = w.busy as f64 / w.reports as f64 >= limit as f64 - 0.5;
        if full && w.reports >= WINDOW_MIN_REPORTS {
            let now = g.now_ms;
            (g.rates).retain(|_, (_, at)| now.saturating_sub(*at) <= GOODPUT_MEMORY_MS);
            let rate = w.tokens as f64 * 1e3 / ms.max(1) as f64;
            g.rates.insert(limit, (rate, now));
        }
        let floor = g.floor();
        if floor > limit {
            self.limit = (floor as f64).min(self.ceiling);
            self.goodput.stage = Stage::Moved;
            self.new_round();
        }
    }

    /// What was dispatched until now measured the old limit.
    fn new_round(&mut self) {
        self.recovery = self.dispatched;
        self.ratio = 1.0;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    /// `n` dispatches, the last one's ticket.
    fn dispatch(l: &mut Limiter, n: u64) -> Ticket {
        (0..n).map(|_| l.dispatch()).last().unwrap()
    }

    /// A sample of a request dispatched now.
    fn sample(l: &mut Limiter, ttfb_ms: f64, prompt_tokens: u64) {
        let t = l.dispatch();
        l.first_byte(t, ttfb_ms, prompt_tokens, l.limit());
    }

    /// A window of goodput at the current limit, the replica full: `rate` tokens/s, reported
    /// 16 tokens at a time from `clock` (ms) on, which it advances.
    fn window(l: &mut Limiter, clock: &mut u64, rate: f64) {
        let limit = l.limit();
        let reports = WINDOW_MIN_TOKENS.max(WINDOW_TOKENS_PER_SLOT * limit) / 16 + 1;
        let every = 16e3 / rate;
        let start = *clock as f64;
        for i in 0..=reports {
            l.served(16, limit, (start + i as f64 * every) as u64);
        }
        *clock = (start + (reports + 1) as f64 * every) as u64;
    }

    #[test]
    fn starts_at_the_engine_s_limit_or_the_default() {
        assert_eq!(Limiter::new(Some(4), Mode::EngineQueue).limit(), 4);
        assert_eq!(Limiter::new(None, Mode::FirstByte).limit(), INITIAL_LIMIT);
        assert_eq!(Limiter::new(Some(0), Mode::Fixed).limit(), 1);
    }

    #[test]
    fn a_timeout_halves_the_limit_once_per_round_and_answers_bring_it_back() {
        for mode in [Mode::EngineQueue, Mode::FirstByte] {
            let mut l = Limiter::new(Some(8), mode);
            let early: Vec<Ticket> = (0..8).map(|_| l.dispatch()).collect();
            // Everything in flight timed out together: one halving, not eight.
            for t in &early {
                l.timed_out(*t);
            }
            assert_eq!(l.limit(), 4, "{mode:?}");
            let next = dispatch(&mut l, 4);
            l.timed_out(next);
            assert_eq!(l.limit(), 2, "{mode:?}");
            for _ in 0..4 {
                let t = l.dispatch();
                l.timed_out(t);
            }
            assert_eq!(l.limit(), 1, "{mode:?}: never below one");
            // The engine answers again: one more per prompt started at once, up to its slots.
            for i in 0..20 {
                sample(&mut l, 20.0, 100);
                assert!(l.limit() <= 8, "{mode:?}: round {i}");
            }
            assert_eq!(l.limit(), 8, "{mode:?}");
        }
    }

    #[test]
    fn a_stale_sample_from_before_a_decrease_changes_nothing() {
        let mut l = Limiter::new(Some(8), Mode::FirstByte);
        let old = l.dispatch();
        l.first_byte(old, 10.0, 100, 8);
        let before = dispatch(&mut l, 3);
        l.timed_out(before);
        assert_eq!(l.limit(), 4);
        l.first_byte(old, 10.0, 100, 8);
        l.first_byte(before, 500.0, 100, 8);
        assert_eq!(l.limit(), 4);
    }

    #[test]
    fn slow_first_bytes_cut_the_limit_by_the_smoothed_gradient() {
        let (mut l, mut clock) = (Limiter::new(Some(100), Mode::FirstByte), 0);
        window(&mut l, &mut clock, 500.0);
        sample(&mut l, 100.0, 300);
        // One answer ten times slower than the floor is not a queue yet (smoothed: 2.8×)...
        sample(&mut l, 1_000.0, 300);
        assert_eq!(l.limit(), 100);
        // ...two are (4.2×): × 3 / 4.2.
        sample(&mut l, 1_000.0, 300);
        assert_eq!(l.limit(), 71);
        // Far slower: halved at most, once 71's goodput is measured too.
        sample(&mut l, 100_000.0, 300);
        assert_eq!(l.limit(), 71, "not measured at 71 yet");
        window(&mut l, &mut clock, 500.0);
        sample(&mut l, 100_000.0, 300);
        assert_eq!(l.limit(), 35);
    }

    #[test]
    fn a_few_milliseconds_of_jitter_on_a_fast_engine_are_no_queue() {
        let (mut l, mut clock) = (Limiter::new(Some(8), Mode::FirstByte), 0);
        window(&mut l, &mut clock, 500.0);
        sample(&mut l, 2.0, 300);
        for _ in 0..50 {
            sample(&mut l, 9.0, 300);
        }
        assert_eq!(l.limit(), 8);
    }

    #[test]
    fn a_long_prompt_is_judged_against_long_prompts_only() {
        let (mut l, mut clock) = (Limiter::new(Some(10), Mode::FirstByte), 0);
        window(&mut l, &mut clock, 500.0);
        sample(&mut l, 10.0, 250);
        // Six times the short prompts' TTFB, for a six times longer prompt: its own class.
        for _ in 0..10 {
            sample(&mut l, 60.0, 1_500);
        }
        assert_eq!(l.limit(), 10);
        for _ in 0..10 {
            sample(&mut l, 600.0, 1_500);
        }
        assert!(l.limit() < 10, "but slow for its class: {}", l.limit());
        assert_eq!(l.floor_ms(), Some(10.0));
    }

    #[test]
    fn a_quiet_replica_does_not_grow_its_limit() {
        let (mut l, mut clock) = (Limiter::new(None, Mode::FirstByte), 0);
        window(&mut l, &mut clock, 500.0);
        for _ in 0..50 {
            let t = l.dispatch();
            l.first_byte(t, 10.0, 100, 2);
        }
        assert_eq!(l.limit(), INITIAL_LIMIT);
        for _ in 0..50 {
            sample(&mut l, 10.0, 100);
        }
        assert_eq!(l.limit(), INITIAL_LIMIT + 50, "busy, and starting at once");
    }

    #[test]
    fn non_streamed_answers_raise_the_limit_but_never_lower_it() {
        let mut l = Limiter::new(Some(6), Mode::EngineQueue);
        let before = l.dispatch();
        l.engine_scrape(1, 2);
        l.engine_scrape(1, 2);
        l.answered(before, 2);
        assert_eq!(l.limit(), 2, "dispatched before the drop: stale");
        for _ in 0..10 {
            let t = l.dispatch();
            l.answered(t, l.limit());
        }
        assert_eq!(l.limit(), 6);
        let t = l.dispatch();
        l.answered(t, 1);
        assert_eq!(l.limit(), 6);
    }

    #[test]
    fn a_lasting_engine_queue_brings_the_limit_down_to_what_it_runs() {
        let mut l = Limiter::new(None, Mode::EngineQueue);
        l.engine_scrape(1, 6);
        assert_eq!(l.limit(), INITIAL_LIMIT, "one scrape: a slot being freed");
        l.engine_scrape(0, 6);
        l.engine_scrape(1, 6);
        assert_eq!(l.limit(), INITIAL_LIMIT, "not in a row");
        l.engine_scrape(2, 6);
        assert_eq!(l.limit(), 6);
        l.engine_scrape(2, 9);
        assert_eq!(l.limit(), 6, "never raised by it");
        l.engine_scrape(1, 0);
        assert_eq!(l.limit(), 1);
    }

    #[test]
    fn an_engine_that_reports_its_queue_is_not_cut_for_slow_first_bytes() {
        let mut l = Limiter::new(Some(4), Mode::EngineQueue);
        sample(&mut l, 10.0, 100);
        for _ in 0..50 {
            sample(&mut l, 1_000.0, 100);
        }
        assert_eq!(l.limit(), 4, "a hundred times the floor: the batch's cost");
        // Its queue cuts; every start, however slow, brings the limit back to its slots.
        l.engine_scrape(1, 2);
        l.engine_scrape(1, 2);
        assert_eq!(l.limit(), 2);
        for _ in 0..2 {
            sample(&mut l, 1_000.0, 100);
        }
        assert_eq!(l.limit(), 4);
    }

    #[test]
    fn a_fixed_limit_never_moves() {
        let (mut l, mut clock) = (Limiter::new(Some(4), Mode::Fixed), 0);
        let t = l.dispatch();
        l.timed_out(t);
        sample(&mut l, 10.0, 100);
        for _ in 0..20 {
            sample(&mut l, 1_000.0, 100);
        }
        l.engine_scrape(3, 1);
        l.engine_scrape(3, 1);
        let t = l.dispatch();
        l.answered(t, 4);
        window(&mut l, &mut clock, 100.0);
        assert_eq!((l.limit(), l.adaptive()), (4, 4.0));
        assert!(l.floor_ms().is_some(), "its TTFB floor is still followed");
    }

    #[test]
    fn a_cut_that_served_less_is_undone_and_not_made_again() {
        let (mut l, mut clock) = (Limiter::new(Some(8), Mode::FirstByte), 0);
        sample(&mut l, 10.0, 100);
        for _ in 0..10 {
            sample(&mut l, 100.0, 100);
        }
        assert_eq!(l.limit(), 8, "nothing moves before 8's goodput is measured");
        window(&mut l, &mut clock, 400.0);
        sample(&mut l, 100.0, 100);
        assert_eq!(l.limit(), 4, "halved: nothing says 4 serves less yet");
        // 4 serves less than 8 did: back up a step at a time, each measured, until a limit
        // serves within the margin of the best.
        window(&mut l, &mut clock, 250.0);
        assert_eq!(l.limit(), 5);
        window(&mut l, &mut clock, 330.0);
        assert_eq!(l.limit(), 6);
        window(&mut l, &mut clock, 390.0);
        assert_eq!(l.limit(), 6, "6 is the knee");
        for _ in 0..20 {
            sample(&mut l, 1_000.0, 100);
        }
        assert_eq!(l.limit(), 6, "never cut below the knee");
    }

    #[test]
    fn limits_that_serve_alike_let_the_cut_go_on_down() {
        // Waiting inside the engine adds no output: 16 and 8 serve as much, and the cut goes
        // on below 8.
        let (mut l, mut clock) = (Limiter::new(None, Mode::FirstByte), 0);
        sample(&mut l, 10.0, 100);
        window(&mut l, &mut clock, 400.0);
        sample(&mut l, 5_000.0, 100);
        assert_eq!(l.limit(), 8);
        sample(&mut l, 5_000.0, 100);
        assert_eq!(l.limit(), 8, "held until 8 is measured");
        window(&mut l, &mut clock, 380.0);
        assert_eq!(l.limit(), 8, "within the margin");
        sample(&mut l, 5_000.0, 100);
        assert_eq!(l.limit(), 4);
    }

    #[test]
    fn goodput_counts_only_while_the_replica_is_full() {
        let (mut l, mut clock) = (Limiter::new(Some(8), Mode::FirstByte), 0);
        sample(&mut l, 10.0, 100);
        window(&mut l, &mut clock, 400.0);
        sample(&mut l, 5_000.0, 100);
        assert_eq!(l.limit(), 4);
        // Requests dispatched under 8 still running: not 4's pace yet.
        for i in 0..200 {
            l.served(16, 6, clock + i * 10);
        }
        clock += 2_000;
        sample(&mut l, 5_000.0, 100);
        assert_eq!(l.limit(), 4, "held: 4 is not measured");
        // Little demand at 4 (two in flight): the window says nothing of the engine's pace.
        for i in 0..=WINDOW_MIN_TOKENS / 16 {
            l.served(16, 2, clock + i * 100);
        }
        clock += WINDOW_MIN_TOKENS / 16 * 100 + 100;
        assert_eq!(l.limit(), 4, "not counted as serving less");
        sample(&mut l, 5_000.0, 100);
        assert_eq!(l.limit(), 2);
        // Full at 2, and serving less: a step back up.
        window(&mut l, &mut clock, 200.0);
        assert_eq!(l.limit(), 3);
    }

    #[test]
    fn goodput_figures_are_forgotten_and_measured_again() {
        let (mut l, mut clock) = (Limiter::new(Some(4), Mode::FirstByte), 0);
        sample(&mut l, 10.0, 100);
        window(&mut l, &mut clock, 400.0);
        sample(&mut l, 5_000.0, 100);
        assert_eq!(l.limit(), 2);
        window(&mut l, &mut clock, 250.0);
        window(&mut l, &mut clock, 390.0);
        sample(&mut l, 5_000.0, 100);
        assert_eq!(l.limit(), 3, "not cut below the knee");
        // Figures older than the memory are forgotten: the knee is looked for again.
        clock += GOODPUT_MEMORY_MS;
        window(&mut l, &mut clock, 390.0);
        sample(&mut l, 5_000.0, 100);
        assert_eq!(l.limit(), 1);
        window(&mut l, &mut clock, 200.0);
        assert_eq!(l.limit(), 2, "1 serves less than 3");
        // A first-byte timeout forgets them all: the engine is not what it was.
        let t = l.dispatch();
        l.timed_out(t);
        assert_eq!(l.limit(), 1);
        window(&mut l, &mut clock, 200.0);
        assert_eq!(l.limit(), 1, "nothing measured above it any more");
    }

    /// What [`flood`] measured over its second half.
    #[derive(Debug)]
    struct Flooded {
        tokens_per_s: f64,
        least_limit: u64,
        mean_limit: f64,
        /// Requests waiting inside the engine, on average.
        mean_waiting: f64,
    }

    /// An engine of `slots` slots under an endless flood of long generations (100–299 tokens),
    /// driven through a limiter as the dispatcher drives it, a millisecond a tick, for
    /// `seconds`; the second half is measured. CPU-bound: a decode step takes 20 ms + 5 ms ×
    /// the batch, so output rises with the batch (40, 67, 86, 100 tokens/s at 1–4), and a
    /// request's first token comes 0.2 ms × its prompt (64–127 tokens, one class) × (1 + 8 ×
    /// (batch − 1)) after it has a slot: TTFB linear in the batch it joins, 25 times the idle
    /// figure at a full batch — enough that the TTFB rule alone held such an engine at 1–2 of
    /// its 4 slots. A request without a slot waits inside the engine, which reports its
    /// `waiting` every 100 ms where `reports_queue`.
    fn flood(l: &mut Limiter, slots: usize, reports_queue: bool, seconds: u64) -> Flooded {
        struct Request {
            ticket: Ticket,
            dispatched: u64,
            prompt: u64,
            tokens: u64,
            next_token: u64,
            generated: u64,
            reported: u64,
        }
        let (mut running, mut waiting) = (Vec::<Request>::new(), VecDeque::new());
        let (mut in_flight, mut sent) = (0, 0);
        let measured_from = seconds * 1_000 / 2;
        let (mut tokens, mut limits, mut waited) = (0, 0, 0);
        let mut least_limit = u64::MAX;
        for t in 0..seconds * 1_000 {
            while in_flight < l.limit() {
                in_flight += 1;
                sent += 1;
                waiting.push_back(Request {
                    ticket: l.dispatch(),
                    dispatched: t,
                    prompt: 64 + sent * 37 % 64,
                    tokens: 100 + sent * 59 % 200,
                    next_token: 0,
                    generated: 0,
                    reported: 0,
                });
            }
            while running.len() < slots
                && let Some(mut r) = waiting.pop_front()
            {
                let batch = running.len() as f64 + 1.0;
                let prefill = 0.2 * r.prompt as f64 * (1.0 + 8.0 * (batch - 1.0));
                r.next_token = t + prefill as u64;
                running.push(r);
            }
            let step = 20 + 5 * running.len() as u64;
            let mut i = 0;
            while i < running.len() {
                let r = &mut running[i];
                if r.next_token > t {
                    i += 1;
                    continue;
                }
                if r.generated == 0 {
                    l.first_byte(r.ticket, (t - r.dispatched) as f64, r.prompt, in_flight);
                }
                r.generated += 1;
                r.next_token = t + step;
                if t >= measured_from {
                    tokens += 1;
                }
                let done = r.generated == r.tokens;
                if done || r.generated - r.reported == 16 {
                    l.served(r.generated - r.reported, in_flight, t);
                    r.reported = r.generated;
                }
                if done {
                    running.swap_remove(i);
                    in_flight -= 1;
                } else {
                    i += 1;
                }
            }
            if reports_queue && t % 100 == 0 {
                l.engine_scrape(waiting.len() as u64, running.len() as u64);
            }
            if t >= measured_from {
                least_limit = least_limit.min(l.limit());
                limits += l.limit();
                waited += waiting.len() as u64;
            }
        }
        let ticks = (seconds * 1_000 - measured_from) as f64;
        Flooded {
            tokens_per_s: tokens as f64 * 1e3 / ticks,
            least_limit,
            mean_limit: limits as f64 / ticks,
            mean_waiting: waited as f64 / ticks,
        }
    }

    /// Output of that engine (4 slots) at a limit fixed at its slots.
    fn fixed_at_four() -> f64 {
        flood(&mut Limiter::new(Some(4), Mode::Fixed), 4, true, 300).tokens_per_s
    }

    #[test]
    fn a_batch_s_cost_keeps_every_slot_of_an_engine_that_reports_its_queue() {
        let fixed = fixed_at_four();
        let run = flood(&mut Limiter::new(Some(4), Mode::EngineQueue), 4, true, 300);
        assert_eq!(run.least_limit, 4, "{run:?}");
        assert!(run.tokens_per_s >= 0.99 * fixed, "{run:?} vs {fixed}");
    }

    #[test]
    fn a_batch_s_cost_keeps_the_knee_of_an_engine_that_reports_no_queue() {
        let fixed = fixed_at_four();
        let run = flood(&mut Limiter::new(Some(4), Mode::FirstByte), 4, false, 300);
        assert!(run.mean_limit >= 3.5, "{run:?}");
        assert!(run.tokens_per_s >= 0.9 * fixed, "{run:?} vs {fixed}");
    }

    #[test]
    fn an_engine_that_queues_without_saying_so_is_cut_to_its_slots() {
        let fixed = fixed_at_four();
        // From 16, four times its slots: twelve requests wait a whole generation inside it.
        let run = flood(&mut Limiter::new(None, Mode::FirstByte), 4, false, 300);
        assert!(run.mean_limit <= 4.5, "{run:?}");
        assert!(run.mean_waiting < 0.1, "{run:?}");
        assert!(run.tokens_per_s >= 0.9 * fixed, "{run:?} vs {fixed}");
    }

    #[test]
    fn an_engine_that_reports_its_queue_is_cut_to_the_slots_it_has() {
        let fixed = fixed_at_four();
        // Said 8 (another sidecar's share miscounted, say): its queue brings the limit down.
        let run = flood(&mut Limiter::new(Some(8), Mode::EngineQueue), 4, true, 300);
        assert!(run.mean_limit <= 4.5, "{run:?}");
        assert!(run.tokens_per_s >= 0.99 * fixed, "{run:?} vs {fixed}");
    }

    #[test]
    fn floors_drift_up_so_an_old_low_sample_does_not_hold_for_ever() {
        let mut l = Limiter::new(Some(4), Mode::EngineQueue);
        sample(&mut l, 100.0, 100);
        for _ in 0..100 {
            sample(&mut l, 400.0, 100);
        }
        let floor = l.floor_ms().unwrap();
        assert!(floor > 250.0, "the floor followed: {floor}");
    }

    #[test]
    fn a_rejoining_replica_starts_over_at_its_new_limit() {
        let mut l = Limiter::new(None, Mode::FirstByte);
        let t = l.dispatch();
        l.timed_out(t);
        assert_eq!(l.limit(), 8);
        l.restart(Some(4));
        assert_eq!(l.limit(), 4);
        let t = l.dispatch();
        l.first_byte(t, 5.0, 10, 4);
        assert_eq!(l.limit(), 4, "capped at the engine's slots");
        l.first_byte(t, f64::NAN, 10, 4);
        assert_eq!(l.floor_ms(), Some(5.0), "a garbage sample is ignored");
    }
}
