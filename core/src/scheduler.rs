//! Who goes next: per-tenant queues served by a virtual token counter (Sheng et al., OSDI 2024).
//!
//! Every tenant has a counter that grows by the tokens it is served, weighted
//! (`(w_in · input + w_out · output) / weight`). The next request comes from the backlogged
//! tenant with the smallest counter, so a tenant that floods the queue waits behind its own
//! requests. A tenant returning from idle cannot bank credit while away (the paper's
//! Algorithm 2): it is lifted to the smallest backlogged counter, or, when nobody is backlogged,
//! to the counter of the last tenant whose queue emptied. Without the second rule counters
//! drift apart while the pool is unsaturated, and a tenant that ran alone for an hour would be
//! starved by one that stayed quiet once contention starts. Priority classes are strict at the same decision point (interactive
//! before batch), but a batch request that has waited longer than the aging bound goes next, so
//! batch never starves. Each decision is O(log n) in the number of backlogged tenants.
//! A FIFO policy exists as the baseline for benchmarks.

use std::cmp::Ordering;
use std::collections::{BTreeSet, HashMap, VecDeque};

use crate::config::Priority;

/// How input and output tokens weigh in a tenant's counter (the paper's w_in and w_out:
/// output tokens cost more, being generated one step at a time).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenWeights {
    pub input: f64,
    pub output: f64,
}

impl Default for TokenWeights {
    fn default() -> Self {
        TokenWeights {
            input: 1.0,
            output: 2.0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Virtual token counter with strict priority classes and aging.
    Fair,
    /// Arrival order across all tenants: the baseline.
    Fifo,
}

/// A counter value with a total order, so it can key an ordered set.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Counter(f64);

impl Eq for Counter {}

impl PartialOrd for Counter {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Counter {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

const CLASSES: usize = 2;

fn class_of(priority: Priority) -> usize {
    match priority {
        Priority::Interactive => 0,
        Priority::Batch => 1,
    }
}

struct Entry<T> {
    item: T,
    seq: u64,
    enqueued_ms: u64,
}

struct TenantState<T> {
    name: String,
    weight: f64,
    counter: f64,
    /// Decision number of the tenant's last dispatch: ties on the counter go to whoever was
    /// served least recently (a newcomer first).
    last_served: u64,
    queues: [VecDeque<Entry<T>>; CLASSES],
}

impl<T> TenantState<T> {
    fn backlogged(&self) -> bool {
        self.queues.iter().any(|q| !q.is_empty())
    }
}

/// What the dispatcher says of a candidate request in [`Scheduler::pop_where`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Dispatch it.
    Take,
    /// Its tenant may not go now (over its own cap): it keeps its place, the next tenant is
    /// considered.
    Skip,
    /// It is next but does not fit yet: nobody else goes ahead of it, so the room it needs
    /// builds up (no starvation of large requests by a stream of small ones).
    Wait,
}

/// A request handed out by [`Scheduler::pop`].
#[derive(Debug, PartialEq)]
pub struct Dispatch<'a, T> {
    pub tenant: &'a str,
    pub priority: Priority,
    pub item: T,
    pub waited_ms: u64,
}

pub struct Scheduler<T> {
    policy: Policy,
    weights: TokenWeights,
    aging_ms: u64,
    tenants: Vec<TenantState<T>>,
    by_name: HashMap<String, usize>,
    /// Per class, backlogged tenants ordered by counter, then by least recently served.
    ready: [BTreeSet<(Counter, u64, usize)>; CLASSES],
    /// Batch queue heads by arrival, for aging.
    batch_heads: BTreeSet<(u64, u64, usize)>,
    /// Every queue head by arrival, for FIFO.
    heads: BTreeSet<(u64, usize, usize)>,
    next_seq: u64,
    decisions: u64,
    len: usize,
    /// The tenant whose queue emptied last: an arrival to an empty scheduler is lifted to its
    /// counter.
    last_left: Option<usize>,
}

impl<T> Scheduler<T> {
    /// `aging_ms`: a batch request waiting this long is served ahead of interactive work.
    pub fn new(policy: Policy, weights: TokenWeights, aging_ms: u64) -> Self {
        Scheduler {
            policy,
            weights,
            aging_ms,
            tenants: Vec::new(),
            by_name: HashMap::new(),
            ready: Default::default(),
            batch_heads: BTreeSet::new(),
            heads: BTreeSet::new(),
            next_seq: 0,
            decisions: 0,
            len: 0,
            last_left: None,
        }
    }

    /// A new aging bound, for the next decision (a reloaded config).
    pub fn set_aging_ms(&mut self, aging_ms: u64) {
        self.aging_ms = aging_ms;
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Requests a tenant has waiting.
    pub fn depth(&self, tenant: &str) -> usize {
        self.by_name.get(tenant).map_or(0, |&t| {
            self.tenants[t].queues.iter().map(VecDeque::len).sum()
        })
    }

    /// A tenant's virtual token counter (0 for a tenant never seen).
    pub fn counter(&self, tenant: &str) -> f64 {
        self.by_name
            .get(tenant)
            .map_or(0.0, |&t| self.tenants[t].counter)
    }

    /// The smallest counter among backlogged tenants: where a returning tenant is lifted to.
    fn min_backlogged(&self) -> Option<f64> {
        self.ready
            .iter()
            .filter_map(|r| r.first().map(|(c, _, _)| c.0))
            .reduce(f64::min)
    }

    fn intern(&mut self, tenant: &str, weight: f64) -> usize {
        if let Some(&t) = self.by_name.get(tenant) {
            self.tenants[t].weight = weight;
            return t;
        }
        let t = self.tenants.len();
        self.tenants.push(TenantState {
            name: tenant.to_owned(),
            weight,
            counter: 0.0,
            last_served: 0,
            queues: Default::default(),
        });
        self.by_name.insert(tenant.to_owned(), t);
        t
    }

    /// Queues a request. `weight` is the tenant's current scheduling weight (> 0).
    pub fn push(&mut self, tenant: &str, weight: f64, priority: Priority, item: T, now_ms: u64) {
        self.queue(tenant, weight, priority, item, now_ms, false);
    }

    /// Queues a request at the head of its tenant's queue of its class, ahead of the tenant's
    /// other waiting requests (a preempted request resumes before the tenant's next one starts).
    /// Otherwise as [`push`](Self::push): the lift rule applies, and its wait (for aging and
    /// [`oldest_ms`](Self::oldest_ms)) counts from `now_ms`.
    pub fn push_front(
        &mut self,
        tenant: &str,
        weight: f64,
        priority: Priority,
        item: T,
        now_ms: u64,
    ) {
        self.queue(tenant, weight, priority, item, now_ms, true);
    }

    fn queue(&mut self, tenant: &str, w: f64, priority: Priority, item: T, now: u64, front: bool) {
        let weight = if w.is_finite() && w > 0.0 { w } else { 1.0 };
        let t = self.intern(tenant, weight);
        if !self.tenants[t].backlogged() {
            // Returning from idle: no credit for the time away.
            let floor = self
                .min_backlogged()
                .or_else(|| self.last_left.map(|l| self.tenants[l].counter));
            if let Some(floor) = floor {
                let state = &mut self.tenants[t];
                state.counter = state.counter.max(floor);
            }
        }
        let class = class_of(priority);
        let seq = self.next_seq;
        self.next_seq += 1;
        let entry = Entry {
            item,
            seq,
            enqueued_ms: now,
        };
        // The head is indexed by its own arrival: a new head is indexed afresh.
        self.unindex_head(t, class);
        if front {
            self.tenants[t].queues[class].push_front(entry);
        } else {
            self.tenants[t].queues[class].push_back(entry);
        }
        self.len += 1;
        self.index_head(t, class);
    }

    fn index_head(&mut self, t: usize, class: usize) {
        let state = &self.tenants[t];
        if let Some(head) = state.queues[class].front() {
            self.ready[class].insert((Counter(state.counter), state.last_served, t));
            self.heads.insert((head.seq, t, class));
            if class == 1 {
                self.batch_heads.insert((head.enqueued_ms, head.seq, t));
            }
        }
    }

    fn unindex_head(&mut self, t: usize, class: usize) {
        let state = &self.tenants[t];
        if let Some(head) = state.queues[class].front() {
            self.ready[class].remove(&(Counter(state.counter), state.last_served, t));
            self.heads.remove(&(head.seq, t, class));
            if class == 1 {
                self.batch_heads.remove(&(head.enqueued_ms, head.seq, t));
            }
        }
    }

    /// The tenant and class to serve next, in policy order, as `judge` allows.
    fn choose(
        &self,
        now_ms: u64,
        judge: &mut impl FnMut(&str, &T) -> Verdict,
    ) -> Option<(usize, usize)> {
        let aged = self
            .batch_heads
            .iter()
            .take_while(|&&(enqueued, _, _)| now_ms.saturating_sub(enqueued) >= self.aging_ms)
            .map(|&(_, _, t)| (t, 1));
        let order: Box<dyn Iterator<Item = (usize, usize)> + '_> =
            match self.policy {
                Policy::Fifo => Box::new(self.heads.iter().map(|&(_, t, class)| (t, class))),
                Policy::Fair => {
                    Box::new(aged.chain((0..CLASSES).flat_map(|class| {
                        self.ready[class].iter().map(move |&(_, _, t)| (t, class))
                    })))
                }
            };
        for (t, class) in order {
            let state = &self.tenants[t];
            let Some(head) = state.queues[class].front() else {
                continue;
            };
            match judge(&state.name, &head.item) {
                Verdict::Take => return Some((t, class)),
                Verdict::Skip => continue,
                Verdict::Wait => return None,
            }
        }
        None
    }

    /// Hands out the next request. Charge what it is served with [`charge`](Self::charge).
    pub fn pop(&mut self, now_ms: u64) -> Option<Dispatch<'_, T>> {
        self.pop_where(now_ms, |_, _| Verdict::Take)
    }

    /// Hands out the next request in policy order that `judge` takes; see [`Verdict`].
    pub fn pop_where(
        &mut self,
        now_ms: u64,
        mut judge: impl FnMut(&str, &T) -> Verdict,
    ) -> Option<Dispatch<'_, T>> {
        let (t, class) = self.choose(now_ms, &mut judge)?;
        for c in 0..CLASSES {
            self.unindex_head(t, c);
        }
        let entry = self.tenants[t].queues[class].pop_front();
        self.decisions += 1;
        self.tenants[t].last_served = self.decisions;
        for c in 0..CLASSES {
            self.index_head(t, c);
        }
        let entry = entry?;
        self.len -= 1;
        self.note_departure(t);
        let state = &self.tenants[t];
        Some(Dispatch {
            tenant: &state.name,
            priority: if class == 0 {
                Priority::Interactive
            } else {
                Priority::Batch
            },
            item: entry.item,
            waited_ms: now_ms.saturating_sub(entry.enqueued_ms),
        })
    }

    /// Adds served tokens to a tenant's counter.
    pub fn charge(&mut self, tenant: &str, input_tokens: u64, output_tokens: u64) {
        let Some(&t) = self.by_name.get(tenant) else {
            return;
        };
        for class in 0..CLASSES {
            self.unindex_head(t, class);
        }
        let state = &mut self.tenants[t];
        let cost =
            self.weights.input * input_tokens as f64 + self.weights.output * output_tokens as f64;
        state.counter += cost / state.weight;
        for class in 0..CLASSES {
            self.index_head(t, class);
        }
    }

    /// Replaces an input charge made from an estimate with the engine's count: an
    /// underestimate is charged in full, an overestimate refunded.
    pub fn correct_input(&mut self, tenant: &str, estimated: u64, reported: u64) {
        let Some(&t) = self.by_name.get(tenant) else {
            return;
        };
        for class in 0..CLASSES {
            self.unindex_head(t, class);
        }
        let state = &mut self.tenants[t];
        state.counter += self.weights.input * (reported as f64 - estimated as f64) / state.weight;
        for class in 0..CLASSES {
            self.index_head(t, class);
        }
    }

    /// Removes and returns every queued request matching `drop` (deadline passed, client gone).
    pub fn remove_where(&mut self, mut drop: impl FnMut(&T) -> bool) -> Vec<T> {
        let mut removed = Vec::new();
        for t in 0..self.tenants.len() {
            for class in 0..CLASSES {
                if !self.tenants[t].queues[class].iter().any(|e| drop(&e.item)) {
                    continue;
                }
                self.unindex_head(t, class);
                let queue = std::mem::take(&mut self.tenants[t].queues[class]);
                let (gone, kept): (VecDeque<_>, VecDeque<_>) =
                    queue.into_iter().partition(|e| drop(&e.item));
                self.len -= gone.len();
                removed.extend(gone.into_iter().map(|e| e.item));
                self.tenants[t].queues[class] = kept;
                self.index_head(t, class);
                self.note_departure(t);
            }
        }
        removed
    }

    /// Remembers a tenant whose queue just emptied, for lifting the next arrival.
    fn note_departure(&mut self, t: usize) {
        if !self.tenants[t].backlogged() {
            self.last_left = Some(t);
        }
    }

    /// Arrival time of the oldest queued request of a class, for projecting waits.
    pub fn oldest_ms(&self, priority: Priority) -> Option<u64> {
        let class = class_of(priority);
        self.heads
            .iter()
            .filter(|&&(_, _, c)| c == class)
            .filter_map(|&(_, t, c)| self.tenants[t].queues[c].front().map(|e| e.enqueued_ms))
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const I: Priority = Priority::Interactive;
    const B: Priority = Priority::Batch;

    fn fair() -> Scheduler<u32> {
        Scheduler::new(Policy::Fair, TokenWeights::default(), 60_000)
    }

    /// Serves `decisions` requests of `input`+`output` tokens, keeping every tenant backlogged;
    /// returns tokens served per tenant.
    fn serve(
        s: &mut Scheduler<u32>,
        decisions: usize,
        weights: &[(&str, f64)],
    ) -> HashMap<String, u64> {
        let mut served = HashMap::new();
        for _ in 0..decisions {
            let d = s.pop(0).unwrap();
            let tenant = d.tenant.to_owned();
            s.charge(&tenant, 100, 100);
            *served.entry(tenant.clone()).or_insert(0) += 200;
            let w = weights.iter().find(|(n, _)| *n == tenant).unwrap().1;
            s.push(&tenant, w, I, 0, 0);
        }
        served
    }

    #[test]
    fn weights_divide_served_tokens() {
        let mut s = fair();
        let weights = [("a", 3.0), ("b", 1.0)];
        for (name, w) in weights {
            for _ in 0..4 {
                s.push(name, w, I, 0, 0);
            }
        }
        let served = serve(&mut s, 4_000, &weights);
        let ratio = served["a"] as f64 / served["b"] as f64;
        assert!((ratio / 3.0 - 1.0).abs() < 0.10, "a:b = {ratio:.2}");
    }

    #[test]
    fn a_small_tenant_goes_ahead_of_a_flood() {
        let mut s = fair();
        for i in 0..100 {
            s.push("noisy", 1.0, I, i, 0);
        }
        // The flood has been served a while.
        for _ in 0..10 {
            let d = s.pop(0).unwrap();
            assert_eq!(d.tenant, "noisy");
            s.charge("noisy", 2_000, 0);
        }
        s.push("small", 1.0, I, 999, 0);
        assert_eq!(
            s.pop(0).unwrap().item,
            999,
            "the new tenant's counter is lowest"
        );
    }

    #[test]
    fn a_request_pushed_to_the_front_goes_before_its_tenant_s_others_and_ages_from_then() {
        let mut s = Scheduler::new(Policy::Fair, TokenWeights::default(), 1_000);
        s.push("a", 1.0, B, 1, 0);
        s.push("a", 1.0, B, 2, 0);
        s.push("b", 1.0, I, 3, 0);
        s.push_front("a", 1.0, B, 0, 900);
        assert_eq!(s.len(), 4);
        assert_eq!(s.depth("a"), 3);
        assert_eq!(s.oldest_ms(B), Some(900), "its wait counts from its push");
        // At 1500 a's head has waited 600 ms, under the aging bound: interactive first.
        assert_eq!(s.pop(1_500).unwrap().item, 3);
        assert_eq!(s.pop(1_500).unwrap().item, 0, "the head of a's batch queue");
        assert_eq!(s.pop(1_500).unwrap().item, 1);
        // Aged from its push: ahead of interactive work once the bound has passed.
        s.push("b", 1.0, I, 4, 2_000);
        s.push_front("a", 1.0, B, 5, 2_000);
        assert_eq!(s.pop(3_000).unwrap().item, 5);
    }

    #[test]
    fn returning_from_idle_lifts_to_the_backlogged_minimum() {
        let mut s = fair();
        s.push("a", 1.0, I, 1, 0);
        s.push("b", 1.0, I, 2, 0);
        // a and b run up their counters while c is idle.
        for _ in 0..2 {
            let d = s.pop(0).unwrap();
            let t = d.tenant.to_owned();
            s.charge(&t, 1_000, 0);
            s.push(&t, 1.0, I, 0, 0);
        }
        assert_eq!(s.counter("c"), 0.0);
        s.push("c", 1.0, I, 3, 0);
        assert_eq!(s.counter("c"), 1_000.0, "lifted, not left at 0");
        // So c gets one turn, not a burst: after one charge it is behind a and b again.
        assert_eq!(s.pop(0).unwrap().tenant, "c");
        s.charge("c", 1_000, 0);
        s.push("c", 1.0, I, 4, 0);
        assert_ne!(s.pop(0).unwrap().tenant, "c");
    }

    #[test]
    fn an_arrival_to_an_empty_queue_is_lifted_to_the_last_tenant_that_left() {
        let mut s = fair();
        // a runs alone, unsaturated: its queue empties after every request.
        for i in 0..10 {
            s.push("a", 1.0, I, i, 0);
            let d = s.pop(0).unwrap();
            assert_eq!(d.tenant, "a");
            s.charge("a", 1_000, 0);
        }
        assert!(s.is_empty());
        // b shows up to an empty queue: no credit for the hour a ran alone...
        s.push("b", 1.0, I, 100, 0);
        assert_eq!(s.counter("b"), 10_000.0);
        // ...so when contention starts they alternate instead of b monopolising.
        s.push("a", 1.0, I, 11, 0);
        let mut order = Vec::new();
        for _ in 0..6 {
            let d = s.pop(0).unwrap();
            let t = d.tenant.to_owned();
            s.charge(&t, 1_000, 0);
            s.push(&t, 1.0, I, 0, 0);
            order.push(t);
        }
        let b_turns = order.iter().filter(|t| *t == "b").count();
        assert_eq!(b_turns, 3, "{order:?}");
        // A counter never goes down by lifting.
        let mut s = fair();
        s.push("x", 1.0, I, 1, 0);
        s.pop(0);
        s.push("y", 1.0, I, 2, 0);
        s.pop(0);
        s.charge("y", 5_000, 0);
        s.push("x", 1.0, I, 3, 0);
        assert_eq!(s.counter("x"), 5_000.0);
        s.pop(0);
        s.charge("y", 1_000, 0);
        s.push("y", 1.0, I, 4, 0);
        assert_eq!(s.counter("y"), 6_000.0, "lifting never lowers a counter");
    }

    #[test]
    fn interactive_goes_before_batch_and_batch_ages() {
        let mut s = Scheduler::new(Policy::Fair, TokenWeights::default(), 5_000);
        s.push("bulk", 1.0, B, 1, 0);
        s.push("chat", 1.0, I, 2, 1_000);
        assert_eq!(s.pop(1_000).unwrap().item, 2);
        s.push("chat", 1.0, I, 3, 1_000);
        assert_eq!(
            s.pop(4_999).unwrap().item,
            3,
            "batch waits while interactive is queued"
        );
        s.push("chat", 1.0, I, 4, 5_000);
        let aged = s.pop(5_000).unwrap();
        assert_eq!((aged.item, aged.priority, aged.waited_ms), (1, B, 5_000));
        assert_eq!(s.pop(5_000).unwrap().item, 4);
        assert!(s.pop(5_000).is_none());
    }

    #[test]
    fn fifo_serves_in_arrival_order() {
        let mut s = Scheduler::new(Policy::Fifo, TokenWeights::default(), 60_000);
        for (i, t) in ["noisy", "noisy", "small", "noisy"].iter().enumerate() {
            s.push(t, 1.0, I, i as u32, 0);
        }
        let order: Vec<u32> = std::iter::from_fn(|| s.pop(0).map(|d| d.item)).collect();
        assert_eq!(order, vec![0, 1, 2, 3]);
    }

    #[test]
    fn removal_keeps_the_index_consistent() {
        let mut s = fair();
        for i in 0..6 {
            s.push(if i % 2 == 0 { "a" } else { "b" }, 1.0, I, i, 0);
        }
        let gone = s.remove_where(|&i| i < 3);
        assert_eq!(gone.len(), 3);
        assert_eq!((s.len(), s.depth("a"), s.depth("b")), (3, 1, 2));
        let rest: Vec<u32> = std::iter::from_fn(|| s.pop(0).map(|d| d.item)).collect();
        let mut sorted = rest.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![3, 4, 5]);
        assert!(s.is_empty());
    }

    #[test]
    fn skipped_tenants_keep_their_place_and_waiting_blocks_the_rest() {
        let mut s = fair();
        s.push("hog", 1.0, I, 1, 0);
        s.push("other", 1.0, I, 2, 0);
        s.charge("other", 500, 0);
        let skip_hog = |t: &str, _: &u32| {
            if t == "hog" {
                Verdict::Skip
            } else {
                Verdict::Take
            }
        };
        assert_eq!(
            s.pop_where(0, skip_hog).unwrap().item,
            2,
            "over its cap: skipped"
        );
        assert_eq!(s.pop(0).unwrap().item, 1, "and still first afterwards");

        s.push("big", 1.0, I, 3, 0);
        s.push("small", 1.0, I, 4, 0);
        s.charge("small", 500, 0);
        let big_waits = |t: &str, _: &u32| {
            if t == "big" {
                Verdict::Wait
            } else {
                Verdict::Take
            }
        };
        assert!(
            s.pop_where(0, big_waits).is_none(),
            "nobody overtakes a head that waits for room"
        );
    }

    #[test]
    fn fifo_blocks_behind_a_head_that_does_not_fit() {
        let mut s = Scheduler::new(Policy::Fifo, TokenWeights::default(), 60_000);
        s.push("noisy", 1.0, I, 1, 0);
        s.push("small", 1.0, I, 2, 0);
        let fits = |_: &str, item: &u32| {
            if *item == 1 {
                Verdict::Wait
            } else {
                Verdict::Take
            }
        };
        assert!(s.pop_where(0, fits).is_none());
    }

    #[test]
    fn an_estimate_is_replaced_by_the_engines_count() {
        let mut s = Scheduler::new(Policy::Fair, TokenWeights::default(), 60_000);
        s.push("x", 2.0, I, 1, 0);
        s.pop(0);
        s.charge("x", 10, 0);
        s.correct_input("x", 10, 3_000);
        assert_eq!(s.counter("x"), 1_500.0, "charged in full, by weight");
        s.correct_input("x", 3_000, 1_000);
        assert_eq!(s.counter("x"), 500.0, "an overestimate is refunded");
    }

    #[test]
    fn bad_weights_fall_back_to_one() {
        let mut s = fair();
        s.push("x", 0.0, I, 1, 0);
        s.pop(0);
        s.charge("x", 10, 0);
        assert_eq!(s.counter("x"), 10.0);
    }
}
