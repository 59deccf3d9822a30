//! A replica's adaptive concurrency limit: how many of weir's requests its engine can start at
//! once without queueing them inside itself, learnt from what weir measures.
//!
//! An engine runs a fixed number of requests at once (llama.cpp's slots, SGLang's
//! `max_running_requests`, vLLM's `max_num_seqs`) and queues the rest in arrival order, where
//! weir's fair order no longer holds. The limit starts at that number where the engine says it
//! (or the configured `max_concurrency_per_replica`), otherwise at [`INITIAL_LIMIT`], and never
//! rises above it. It adapts by AIMD, as the concurrency limiters of Netflix
//! (`concurrency-limits`) and Envoy (adaptive concurrency) do, on three signals:
//!
//! - **Time to first byte** (TTFB): from dispatch to the first body bytes of a stream, the
//!   moment the engine has started the request (llama.cpp sends a waiting stream's headers late,
//!   vLLM at once; the first body bytes come after the start on both). TTFB grows with the
//!   prompt (prefill), so each sample is divided by the floor — the least TTFB seen — of its
//!   own prompt-length class (powers of two of prompt tokens): a 1,500-token prompt is never
//!   judged against a 250-token one. Floors under [`MIN_FLOOR_MS`] count as that much, so a few
//!   milliseconds of scheduling jitter on a fast engine are not read as a queue. The ratios are
//!   smoothed ([`SMOOTHING`]): a batching engine slows every request a little as it fills, and
//!   one slow answer is not a queue. While the smoothed ratio stays within [`TOLERANCE`] (which
//!   also covers the twofold spread of prompt lengths inside a class), the engine starts what
//!   it gets at once: the limit grows by one per sample, if the replica is using at least half
//!   of it (a quiet replica proves nothing). Above, the engine holds requests back: the limit
//!   is multiplied by the gradient `TOLERANCE / ratio`, never by less than [`MIN_GRADIENT`] at
//!   once. Waiting for a slot costs a whole request's time, far beyond the tolerance.
//! - **A non-streamed answer**: it comes whole, so its time says nothing of a queue; it counts
//!   as the engine serving, and the limit grows by one as for a stream started at once.
//! - **No first byte within `relay.first_byte_ms`**: the engine accepted the request and did
//!   not start it (hung, or a queue of someone else's): the limit halves ([`BACKOFF`]).
//! - **An engine without KV figures reports requests waiting** (llama.cpp, TGI) in
//!   [`QUEUE_SCRAPES`] scrapes in a row: it can only be out of slots, so it runs no more
//!   requests at once than it is running, and the limit drops to that. One scrape is not
//!   enough: a request that arrives as an answer ends can wait a step for the slot that answer
//!   is freeing. Where weir admits by KV (the engine reports its capacity, or the config names it),
//!   a queue means weir's KV estimate fell short: nothing more is dispatched there until it has
//!   drained, and the limit stays, as a slot limit would count a 250-token request as much as a
//!   5,000-token one. (The dispatcher makes that call: it feeds [`Limiter::engine_scrape`] only the scrapes of
//!   replicas without KV figures.)
//!
//! One decrease per round: samples of requests dispatched before the last decrease measured the
//! old limit and neither lower nor raise the new one (TCP's one reduction per window), and the
//! smoothed ratio starts afresh, so a burst of slow answers to one overload cuts the limit once,
//! not down to 1. The limit never
//! falls below 1: a replica always takes one request, and its answer is how it recovers.
//!
//! Floors drift up by [`FLOOR_DRIFT`] a sample, so one lucky sample (or a prefix-cache hit)
//! does not set the reference for ever; within a class, cache hits can only make the floor
//! lower, so misses look slower by their prefill, which [`TOLERANCE`] absorbs.

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
/// Prompt-length classes: ⌊log2(prompt tokens)⌋ + 1, the last one open-ended.
const CLASSES: usize = 24;

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
}

impl Limiter {
    /// A limiter under `ceiling` (the engine's or the configured limit), starting there.
    pub fn new(ceiling: Option<u64>) -> Limiter {
        let mut limiter = Limiter {
            limit: 0.0,
            ceiling: 0.0,
            floors: [None; CLASSES],
            ratio: 1.0,
            dispatched: 0,
            recovery: 0,
            queued_scrapes: 0,
        };
        limiter.restart(ceiling);
        limiter
    }

    /// A replica (re)joined with `ceiling`: the limit starts over there (or at
    /// [`INITIAL_LIMIT`]), trusting the engine until it shows otherwise. Floors are kept.
    pub fn restart(&mut self, ceiling: Option<u64>) {
        self.ceiling = ceiling.unwrap_or(MAX_LIMIT).max(1) as f64;
        self.limit = ceiling.unwrap_or(INITIAL_LIMIT).max(1) as f64;
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
        let ratio = ttfb_ms / reference.max(MIN_FLOOR_MS);
        self.ratio += SMOOTHING * (ratio - self.ratio);
        if self.ratio > TOLERANCE {
            self.decrease((TOLERANCE / self.ratio).max(MIN_GRADIENT));
        } else {
            self.grow(in_flight);
        }
    }

    /// One more, if the replica is using at least half of its limit.
    fn grow(&mut self, in_flight: u64) {
        if 2 * in_flight >= self.limit() {
            self.limit = (self.limit + 1.0).min(self.ceiling);
        }
    }

    /// The engine answered a non-streamed request, while the replica had `in_flight` requests.
    pub fn answered(&mut self, ticket: Ticket, in_flight: u64) {
        if ticket.0 > self.recovery {
            self.grow(in_flight);
        }
    }

    /// No first byte within the deadline: the engine did not start the request.
    pub fn timed_out(&mut self, ticket: Ticket) {
        if ticket.0 > self.recovery {
            self.decrease(BACKOFF);
        }
    }

    /// A scrape of an engine whose only shortage can be slots: `waiting` requests queued while
    /// it runs `running`.
    pub fn engine_scrape(&mut self, waiting: u64, running: u64) {
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

    fn decrease(&mut self, factor: f64) {
        self.limit = (self.limit * factor).max(1.0);
        self.new_round();
    }

    /// What was dispatched until now measured the old limit.
    fn new_round(&mut self) {
        self.recovery = self.dispatched;
        self.ratio = 1.0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` dispatches, the last one's ticket.
    fn dispatch(l: &mut Limiter, n: u64) -> Ticket {
        (0..n).map(|_| l.dispatch()).last().unwrap()
    }

    #[test]
    fn starts_at_the_engine_s_limit_or_the_default() {
        assert_eq!(Limiter::new(Some(4)).limit(), 4);
        assert_eq!(Limiter::new(None).limit(), INITIAL_LIMIT);
        assert_eq!(Limiter::new(Some(0)).limit(), 1);
    }

    #[test]
    fn a_timeout_halves_the_limit_once_per_round_and_answers_bring_it_back() {
        let mut l = Limiter::new(Some(8));
        let early: Vec<Ticket> = (0..8).map(|_| l.dispatch()).collect();
        // Everything in flight timed out together: one halving, not eight.
        for t in &early {
            l.timed_out(*t);
        }
        assert_eq!(l.limit(), 4);
        let next = dispatch(&mut l, 4);
        l.timed_out(next);
        assert_eq!(l.limit(), 2);
        for _ in 0..4 {
            let t = l.dispatch();
            l.timed_out(t);
        }
        assert_eq!(l.limit(), 1, "never below one");
        // The engine answers again: one more per prompt started at once, up to its slots.
        for i in 0..20 {
            let t = l.dispatch();
            l.first_byte(t, 20.0, 100, l.limit());
            assert!(l.limit() <= 8, "round {i}");
        }
        assert_eq!(l.limit(), 8);
    }

    #[test]
    fn a_stale_sample_from_before_a_decrease_changes_nothing() {
        let mut l = Limiter::new(Some(8));
        let old = l.dispatch();
        l.first_byte(old, 10.0, 100, 8);
        let before = dispatch(&mut l, 3);
        l.timed_out(before);
        assert_eq!(l.limit(), 4);
        l.first_byte(old, 10.0, 100, 8);
        l.first_byte(before, 500.0, 100, 8);
        assert_eq!(l.limit(), 4);
    }

    /// A sample of a request dispatched now.
    fn sample(l: &mut Limiter, ttfb_ms: f64, prompt_tokens: u64) {
        let t = l.dispatch();
        l.first_byte(t, ttfb_ms, prompt_tokens, l.limit());
    }

    #[test]
    fn slow_first_bytes_cut_the_limit_by_the_smoothed_gradient() {
        let mut l = Limiter::new(Some(100));
        sample(&mut l, 100.0, 300);
        // One answer ten times slower than the floor is not a queue yet (smoothed: 2.8×)...
        sample(&mut l, 1_000.0, 300);
        assert_eq!(l.limit(), 100);
        // ...two are (4.2×): × 3 / 4.2.
        sample(&mut l, 1_000.0, 300);
        assert_eq!(l.limit(), 71);
        // Far slower: halved at most.
        sample(&mut l, 100_000.0, 300);
        assert_eq!(l.limit(), 35);
    }

    #[test]
    fn a_few_milliseconds_of_jitter_on_a_fast_engine_are_no_queue() {
        let mut l = Limiter::new(Some(8));
        sample(&mut l, 2.0, 300);
        for _ in 0..50 {
            sample(&mut l, 9.0, 300);
        }
        assert_eq!(l.limit(), 8);
    }

    #[test]
    fn a_long_prompt_is_judged_against_long_prompts_only() {
        let mut l = Limiter::new(Some(10));
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
        let mut l = Limiter::new(None);
        for _ in 0..50 {
            let t = l.dispatch();
            l.first_byte(t, 10.0, 100, 2);
        }
        assert_eq!(l.limit(), INITIAL_LIMIT);
        for _ in 0..50 {
            let t = l.dispatch();
            l.first_byte(t, 10.0, 100, l.limit());
        }
        assert_eq!(l.limit(), INITIAL_LIMIT + 50, "busy, and starting at once");
    }

    #[test]
    fn non_streamed_answers_raise_the_limit_but_never_lower_it() {
        let mut l = Limiter::new(Some(6));
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
        let mut l = Limiter::new(None);
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
    fn floors_drift_up_so_an_old_low_sample_does_not_hold_for_ever() {
        let mut l = Limiter::new(Some(4));
        sample(&mut l, 100.0, 100);
        for _ in 0..100 {
            sample(&mut l, 400.0, 100);
        }
        let floor = l.floor_ms().unwrap();
        assert!(floor > 250.0, "the floor followed: {floor}");
        assert_eq!(l.limit(), 4, "400 ms is now a start without waiting");
    }

    #[test]
    fn a_rejoining_replica_starts_over_at_its_new_limit() {
        let mut l = Limiter::new(None);
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
