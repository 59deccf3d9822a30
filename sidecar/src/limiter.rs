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
//!   prompt (prefill), so each sample is compared with the floor — the least TTFB seen — of its
//!   own prompt-length class (powers of two of prompt tokens): a 1,500-token prompt is never
//!   judged against a 250-token one. Within [`TOLERANCE`]× the floor (which also covers the
//!   twofold spread of prompt lengths inside a class), the engine started it at once: the limit
//!   grows by one, if the replica is using at least half of it (a quiet replica proves nothing).
//!   Above, the engine held it: the limit is multiplied by the gradient
//!   `TOLERANCE · floor / sample`, never by less than [`MIN_GRADIENT`] at once.
//! - **No first byte within `relay.first_byte_ms`**: the engine accepted the request and did
//!   not start it (hung, or a queue of someone else's): the limit halves ([`BACKOFF`]).
//! - **The engine reports requests waiting**: it runs no more than it is running, so the limit
//!   drops to that.
//!
//! One decrease per round: samples of requests dispatched before the last decrease measured the
//! old limit and neither lower nor raise the new one (TCP's one reduction per window), so a
//! burst of slow answers to one overload halves the limit once, not down to 1. The limit never
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
/// A sample this many times its class's floor or less is a start without waiting.
pub const TOLERANCE: f64 = 2.0;
/// The most one slow sample cuts the limit by (halving).
pub const MIN_GRADIENT: f64 = 0.5;
/// A first-byte timeout halves the limit.
pub const BACKOFF: f64 = 0.5;
/// How much a class's floor rises with each sample above it.
pub const FLOOR_DRIFT: f64 = 0.01;
/// Prompt-length classes: ⌊log2(prompt tokens)⌋ + 1, the last one open-ended.
const CLASSES: usize = 24;

/// A dispatch's place in the replica's order, carried to its samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ticket(u64);

#[derive(Clone, Debug)]
pub struct Limiter {
    limit: f64,
    ceiling: f64,
    /// Per prompt-length class, the least TTFB seen (ms), drifting up.
    floors: [Option<f64>; CLASSES],
    dispatched: u64,
    /// Tickets below this were dispatched before the last decrease.
    recovery: u64,
}

impl Limiter {
    /// A limiter under `ceiling` (the engine's or the configured limit), starting there.
    pub fn new(ceiling: Option<u64>) -> Limiter {
        let mut limiter = Limiter {
            limit: 0.0,
            ceiling: 0.0,
            floors: [None; CLASSES],
            dispatched: 0,
            recovery: 0,
        };
        limiter.restart(ceiling);
        limiter
    }

    /// A replica (re)joined with `ceiling`: the limit starts over there (or at
    /// [`INITIAL_LIMIT`]), trusting the engine until it shows otherwise. Floors are kept.
    pub fn restart(&mut self, ceiling: Option<u64>) {
        self.ceiling = ceiling.unwrap_or(MAX_LIMIT).max(1) as f64;
        self.limit = ceiling.unwrap_or(INITIAL_LIMIT).max(1) as f64;
        self.recovery = self.dispatched;
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
        // A floor of 0 ms (a clock too coarse) must not make every sample look slow.
        let gradient = (TOLERANCE * reference.max(1.0) / ttfb_ms.max(1.0)).clamp(MIN_GRADIENT, 1.0);
        if gradient < 1.0 {
            self.decrease(gradient);
        } else if 2 * in_flight >= self.limit() {
            self.limit = (self.limit + 1.0).min(self.ceiling);
        }
    }

    /// No first byte within the deadline: the engine did not start the request.
    pub fn timed_out(&mut self, ticket: Ticket) {
        if ticket.0 > self.recovery {
            self.decrease(BACKOFF);
        }
    }

    /// The engine reports requests waiting while it runs `running`.
    pub fn engine_queue(&mut self, running: u64) {
        let running = running.max(1) as f64;
        if running < self.limit {
            self.limit = running;
            self.recovery = self.dispatched;
        }
    }

    fn decrease(&mut self, factor: f64) {
        self.limit = (self.limit * factor).max(1.0);
        self.recovery = self.dispatched;
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

    #[test]
    fn a_slow_first_byte_cuts_the_limit_by_its_gradient() {
        let mut l = Limiter::new(Some(100));
        let t = l.dispatch();
        l.first_byte(t, 10.0, 300, 100);
        assert_eq!(l.limit(), 100, "at the ceiling");
        // Within tolerance: twice the floor is a start without waiting.
        let t = l.dispatch();
        l.first_byte(t, 20.0, 300, 100);
        assert_eq!(l.limit(), 100);
        // 25 ms against 2 × 10 ms: × 0.8.
        let t = l.dispatch();
        l.first_byte(t, 25.0, 300, 100);
        assert_eq!(l.limit(), 80);
        // Far slower: halved at most.
        let t = l.dispatch();
        l.first_byte(t, 10_000.0, 300, 80);
        assert_eq!(l.limit(), 40);
    }

    #[test]
    fn a_long_prompt_is_judged_against_long_prompts_only() {
        let mut l = Limiter::new(Some(10));
        let t = l.dispatch();
        l.first_byte(t, 10.0, 250, 10);
        // Six times the short prompts' TTFB, for a six times longer prompt: its own class.
        let t = l.dispatch();
        l.first_byte(t, 60.0, 1_500, 10);
        assert_eq!(l.limit(), 10);
        let t = l.dispatch();
        l.first_byte(t, 400.0, 1_500, 10);
        assert_eq!(l.limit(), 5, "but slow for its class");
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
    fn an_engine_queue_brings_the_limit_down_to_what_it_runs() {
        let mut l = Limiter::new(None);
        l.engine_queue(6);
        assert_eq!(l.limit(), 6);
        l.engine_queue(9);
        assert_eq!(l.limit(), 6, "never raised by it");
        l.engine_queue(0);
        assert_eq!(l.limit(), 1);
    }

    #[test]
    fn floors_drift_up_so_an_old_low_sample_does_not_hold_for_ever() {
        let mut l = Limiter::new(Some(4));
        let t = l.dispatch();
        l.first_byte(t, 10.0, 100, 4);
        for _ in 0..100 {
            let t = l.dispatch();
            l.first_byte(t, 30.0, 100, 4);
        }
        let floor = l.floor_ms().unwrap();
        assert!(floor > 25.0, "the floor followed: {floor}");
        let t = l.dispatch();
        l.first_byte(t, 30.0, 100, 4);
        assert_eq!(l.limit(), 4, "30 ms is now a start without waiting");
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
