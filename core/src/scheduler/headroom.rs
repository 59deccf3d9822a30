//! Headroom: a turn for every active tenant.
//!
//! A pool's slots and KV are shared among orgs by their weights (the *shares*; every key on its
//! own with `fair_share: key`). A key is active in a pool for `active_window_ms` after its last
//! request there, and while it has work queued. While others are active, an org's fair part is
//! `⌊slots · weight / active orgs' weights⌋` slots (at least one) and `capacity · weight /
//! active orgs' weights` KV tokens.
//!
//! - A key holding nothing starts a request — its turn (one larger than the pool runs alone) —
//!   unless its org already holds its part (so minted keys take their turns within their org's
//!   part).
//! - Any other request leaves a slot free for each other active org holding nothing and each
//!   other active key of its own org holding nothing, as far as the org's part goes: their
//!   turns.
//! - A request that takes its org past its fair part — a flood — also leaves `kv_headroom` of
//!   the slots (rounded up) and of the KV free while another active org is below its part, and
//!   each other active org its *reserve*: its recent peak and one more ([`Usage`]), as far as
//!   its share rounded up goes, less what it holds; one that takes only its key past its
//!   part within its org (below) leaves the `kv_headroom` room and the turns while a sibling
//!   key holds nothing.
//! - Past its part but no flood: a quiet org's burst (below its part on average lately, with
//!   nothing else queued) may go one request past it, and a flood catching up with the least
//!   of the others may too; both may use the `kv_headroom` room, but leave the others their
//!   reserves: nothing past its part takes room another org may ask for within its own.
//!
//! [`Headroom::admission`] says how a request starts ([`Start`]): a quiet one may join an
//! engine's own queue, a flood's keeps out of it.
//!
//! Within an org, a key's part is the org's split among its active keys by weight. A key past
//! it is a flood within its org (the headroom rule holds it back while a sibling holds
//! nothing) only while it also holds more, for its weight, than the least of its siblings past
//! theirs: split among many keys a part is a fraction of one request, and holding keys to it
//! alone held a key weighted 3× its siblings to 2× whenever a sibling's request ended.
//!
//! The rule is collective: however many tenants flood, together they never take the room kept
//! for the quiet ones, so a quiet tenant's request starts at the next decision instead of waiting
//! for the longest of the flood's streams. Turns are counted per org across orgs, so an org
//! that mints keys keeps no more turns free against the others than one; its keys take turns
//! among themselves. A tenant alone uses the whole pool.

use std::collections::HashMap;

/// What a key (or an org, summed over its keys) holds of a pool: slots (sequences running) and
/// KV tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Holding {
    pub slots: u64,
    pub kv: u64,
}

impl Holding {
    fn add(&mut self, other: Holding) {
        self.slots = self.slots.saturating_add(other.slots);
        self.kv = self.kv.saturating_add(other.kv);
    }
}

/// A pool's resources and how much of them is in use (weir's own accounting).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Room {
    pub slots: u64,
    pub slots_used: u64,
    /// KV tokens; 0 where the engines report none (the pool admits by slots alone).
    pub kv: u64,
    pub kv_used: u64,
}

/// How a request starts on a pool, as the headroom rule admits it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Start {
    /// Within its share's part while others are active (a turn, or a quiet tenant's burst):
    /// it may join requests waiting inside an engine, and goes where no flood is prefilling.
    Quiet,
    /// Past its part while others are active: it keeps out of engines' own queues, starts a
    /// stream only while another replica stays clear of the flood's prefills, and keeps off a
    /// replica answering a quiet request while another is not.
    Flood,
    /// Within its part, but its org has more queued: a backlog would fill engines' own queues,
    /// so it keeps out of them and to the floods' prefill rule, as a flood does; but its part
    /// is its own, so a quiet request being answered does not keep it off a replica.
    Backlog,
    /// Alone in the pool (or under the FIFO baseline): it keeps out of engines' own queues.
    Alone,
}

impl Start {
    /// A flood's request or a backlog's: kept out of engines' own queues and to the floods'
    /// prefill rule.
    pub fn floods(self) -> bool {
        matches!(self, Start::Flood | Start::Backlog)
    }
}

/// A key of a pool: its org, weight within it, when it was last active, what it holds.
#[derive(Clone, Debug)]
struct Key {
    org: String,
    weight: f64,
    seen: Option<u64>,
    held: Holding,
    /// Requests it has queued in the pool: a key with work queued stays active.
    queued: usize,
}

/// Float noise in an average of whole slots: the average and its correction take different
/// paths, so an org that held exactly its part reads a hair below it in most decisions.
const AVERAGE_NOISE: f64 = 1e-6;

/// An org's slots over time: the most it held at once over the window under way and the one
/// before it (what it may ask again soon, which a flood keeps free for it, up to its part), and
/// how many it held on average lately ([`Shares::averaging_ms`]).
#[derive(Clone, Copy, Debug, Default)]
struct Usage {
    current: u64,
    previous: u64,
    since_ms: u64,
    held: u64,
    mean: f64,
    at_ms: u64,
    /// When it first held a slot: where its average starts.
    since_first_ms: u64,
}

impl Usage {
    fn peak(&self) -> u64 {
        self.current.max(self.previous)
    }

    /// Its average since it first held a slot, corrected for the average's start from nothing:
    /// an org new to the pool is judged by what it has held so far (a flood holds its part at
    /// once), not by an average still rising from zero. Unknown (infinite) at its first hold.
    fn average(&self, span_ms: u64) -> f64 {
        let age = self.at_ms.saturating_sub(self.since_first_ms) as f64;
        let seen = 1.0 - (-age / span_ms.max(1) as f64).exp();
        if seen > 0.0 {
            self.mean / seen
        } else {
            f64::INFINITY
        }
    }

    /// Counts what it held until `now_ms` into the average, and holds `held` from then.
    fn update(&mut self, now_ms: u64, span_ms: u64, held: u64) {
        let elapsed = now_ms.saturating_sub(self.at_ms) as f64;
        let weight = 1.0 - (-elapsed / span_ms.max(1) as f64).exp();
        self.mean += (self.held as f64 - self.mean) * weight;
        self.held = held;
        self.at_ms = self.at_ms.max(now_ms);
        self.current = self.current.max(held);
    }
}

/// A pool's keys and orgs: which are active and what each holds.
#[derive(Debug, Default)]
pub struct Shares {
    keys: HashMap<String, Key>,
    /// Orgs' weights among orgs, as last seen.
    org_weights: HashMap<String, f64>,
    usage: HashMap<String, Usage>,
    /// The time and active window last seen (`expire` runs every few ms), for the usage.
    now_ms: u64,
    window_ms: u64,
}

impl Shares {
    /// A request of `key` (of `org`, with `org_weight` among orgs and `key_weight` within the
    /// org) arrived, or was queued again, at `now_ms`.
    pub fn arrived(&mut self, key: &str, org: &str, org_weight: f64, key_weight: f64, now_ms: u64) {
        self.org_weights.insert(org.to_owned(), org_weight);
        self.now_ms = self.now_ms.max(now_ms);
        let k = self.entry(key, org);
        k.weight = key_weight;
        k.seen = Some(now_ms);
    }

    fn entry(&mut self, key: &str, org: &str) -> &mut Key {
        self.keys.entry(key.to_owned()).or_insert_with(|| Key {
            org: org.to_owned(),
            weight: 1.0,
            seen: None,
            held: Holding::default(),
            queued: 0,
        })
    }

    /// `key` (of `org`) has `depth` requests queued in the pool.
    pub fn queued(&mut self, key: &str, org: &str, depth: usize) {
        match self.keys.get_mut(key) {
            Some(k) => k.queued = depth,
            None if depth > 0 => self.entry(key, org).queued = depth,
            None => {}
        }
    }

    /// Keys with no request for `window_ms` are no longer active; those holding nothing are
    /// forgotten, and orgs with no key left.
    pub fn expire(&mut self, now_ms: u64, window_ms: u64) {
        for k in self.keys.values_mut() {
            if k.queued > 0 {
                // Backlogged: active as long as it waits, and a window after.
                k.seen = Some(now_ms);
            } else if k
                .seen
                .is_some_and(|seen| now_ms.saturating_sub(seen) >= window_ms)
            {
                k.seen = None;
            }
        }
        self.keys
            .retain(|_, k| k.seen.is_some() || k.held != Holding::default() || k.queued > 0);
        let keys = &self.keys;
        self.org_weights
            .retain(|org, _| keys.values().any(|k| &k.org == org));
        self.usage
            .retain(|org, _| keys.values().any(|k| &k.org == org));
        let mut held: HashMap<&str, u64> = HashMap::new();
        for k in keys.values() {
            let slots = held.entry(&k.org).or_default();
            *slots = slots.saturating_add(k.held.slots);
        }
        (self.now_ms, self.window_ms) = (self.now_ms.max(now_ms), window_ms);
        for (org, usage) in &mut self.usage {
            let slots = held.get(org.as_str()).copied().unwrap_or(0);
            usage.update(now_ms, self.window_ms / 4, slots);
            if now_ms.saturating_sub(usage.since_ms) >= window_ms {
                (usage.previous, usage.current, usage.since_ms) = (usage.current, slots, now_ms);
            }
        }
    }

    /// The span an org's average use is taken over: a quarter of the active window (2.5 s by
    /// default), long beside a chat, short beside a flood.
    fn averaging_ms(&self) -> u64 {
        self.window_ms / 4
    }

    /// `key` (of `org`) starts (`add`) or ends holding `slots` and `kv` tokens.
    pub fn hold(&mut self, key: &str, org: &str, slots: u64, kv: u64, add: bool) {
        let k = self.entry(key, org);
        if add {
            k.held.add(Holding { slots, kv });
        } else {
            k.held.slots = k.held.slots.saturating_sub(slots);
            k.held.kv = k.held.kv.saturating_sub(kv);
        }
        if k.seen.is_none() && k.held == Holding::default() && k.queued == 0 {
            self.keys.remove(key);
        }
        if slots > 0 {
            let held = self.keys.values().filter(|k| k.org == org);
            let held = held.map(|k| k.held.slots).fold(0, u64::saturating_add);
            let (now_ms, span_ms) = (self.now_ms, self.averaging_ms());
            let usage = (self.usage.entry(org.to_owned())).or_insert_with(|| Usage {
                since_first_ms: now_ms,
                at_ms: now_ms,
                ..Usage::default()
            });
            usage.update(now_ms, span_ms, held);
        }
    }

    /// `key`'s fair part of the pool as a fraction (1 when nobody else is active): its org's
    /// weight over the active orgs', times its own over its org's active keys'.
    pub fn part(&self, key: &str) -> f64 {
        let Some(k) = self.keys.get(key) else {
            return 1.0;
        };
        let (orgs, keys) = self.active_weights(&k.org);
        let org = self.org_weights.get(&k.org).copied().unwrap_or(1.0);
        let of = |own: f64, all: f64| if all > 0.0 { (own / all).min(1.0) } else { 1.0 };
        of(org, orgs) * of(k.weight, keys)
    }

    /// The weights of the orgs that compete for the pool (keys with work queued or running),
    /// and of `org`'s such keys: a pace is shared only with those.
    fn active_weights(&self, org: &str) -> (f64, f64) {
        let mut orgs: HashMap<&str, f64> = HashMap::new();
        let mut keys = 0.0;
        let competing = |k: &&Key| k.queued > 0 || k.held != Holding::default();
        for k in self.keys.values().filter(competing) {
            let w = self.org_weights.get(&k.org).copied().unwrap_or(1.0);
            orgs.insert(&k.org, w);
            if k.org == org {
                keys += k.weight;
            }
        }
        (orgs.values().sum(), keys)
    }

    /// The rule at one decision, over `room`, with `fraction` (`queue.kv_headroom`).
    pub fn headroom(&self, room: Room, fraction: f64) -> Headroom<'_> {
        Headroom::new(self, room, fraction)
    }
}

/// An org at one decision: its weight if active, what its keys hold, its active keys.
#[derive(Debug, Default)]
struct Org {
    weight: f64,
    active: bool,
    held: Holding,
    /// Active keys holding no slot, and holding no KV: within an org, the keys a flood of
    /// one of them leaves the headroom for (parts split among many keys are fractions of a
    /// request, which a key holding one is already past).
    idle_keys: usize,
    idle_kv_keys: usize,
    /// Its active keys' weights.
    key_weights: f64,
    /// Slots a flood leaves free for it: up to one more than it held at its recent peak, as far
    /// as its part goes, less what it holds.
    reserve: u64,
    /// Requests its keys have queued.
    queued: usize,
    /// Slots it held on average lately ([`Usage::average`]); infinite at its first hold.
    mean: f64,
}

/// The two least weighted holdings (held ÷ weight) among an org's active keys past their part,
/// with the key: a key past its own part is a flood within its org only while it holds more,
/// for its weight, than the least of its siblings past theirs.
type LeastPast<'a> = [Option<(&'a str, f64)>; 2];

/// Keeps the two least of `list` by their figure.
fn two_least<'a>(mut list: Vec<(&'a str, f64)>) -> LeastPast<'a> {
    list.sort_unstable_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(b.0)));
    [list.first().copied(), list.get(1).copied()]
}

/// The least of `least` that is not `key`'s.
fn least_other(least: &LeastPast<'_>, key: &str) -> Option<f64> {
    least
        .iter()
        .flatten()
        .find(|(k, _)| *k != key)
        .map(|&(_, f)| f)
}

/// The shares of a pool at one decision.
pub struct Headroom<'a> {
    shares: &'a Shares,
    room: Room,
    fraction: f64,
    orgs: HashMap<&'a str, Org>,
    org_weights: f64,
    active_keys: usize,
    /// Active orgs holding no slot, and below their part of slots and of KV.
    idle_orgs: usize,
    /// The active orgs' reserves, summed.
    reserved: u64,
    below_slots: usize,
    below_kv: usize,
    /// The two least slot holdings among orgs past their part (the floods), with their orgs:
    /// a request that leaves its org holding no more than the least of the other floods may
    /// use the headroom (a quiet tenant's burst), one beyond them may not.
    least_past: [Option<(&'a str, u64)>; 2],
    /// Per org, [`LeastPast`] of slots and of KV.
    least_past_keys: HashMap<&'a str, (LeastPast<'a>, LeastPast<'a>)>,
}

/// The key asking for room, at one decision.
#[derive(Clone, Copy)]
struct Asker<'b> {
    key: &'b str,
    org: &'b str,
    /// The key is active in the pool.
    active: bool,
    held: Holding,
    /// Its org as the decision sees it (none when the org holds and wants nothing yet).
    o: Option<&'b Org>,
}

impl Asker<'_> {
    /// What its org holds.
    fn org_held(&self) -> Holding {
        self.o.map_or(Holding::default(), |o| o.held)
    }

    /// Other orgs below their parts, and other keys of its org holding nothing (own ones taken
    /// out): what an org past its part, and a key past its part within its org, leave the
    /// headroom for.
    fn others(&self, orgs: usize, keys: usize, org_below: bool, key_below: bool) -> (usize, usize) {
        let in_org = self.o.map_or(0, |_| {
            keys.saturating_sub(usize::from(self.active && key_below))
        });
        (
            orgs.saturating_sub(usize::from(self.o.is_some_and(|o| o.active) && org_below)),
            in_org,
        )
    }
}

/// Whether `org` holding and `want` more stays within `part`.
fn within(org: u64, want: u64, part: f64) -> bool {
    org.saturating_add(want) as f64 <= part
}

/// Its turn: a key holding nothing, unless its org is past its part (an org's minted keys take
/// their turns within the org's part).
fn turn(own: u64, org: u64, want: u64, part: f64) -> bool {
    own == 0 && (org == 0 || within(org, want, part))
}

/// How a turn starts: a turn past its part at once (many sequences, a long prompt) is no quiet
/// one: it would join an engine's own queue ahead of the quiet tenants' requests.
fn turn_start(org: u64, want: u64, part: f64) -> Start {
    if within(org, want, part) {
        Start::Quiet
    } else {
        Start::Flood
    }
}

/// Per org, what its keys hold and queue and whether any is active (with the org's weight);
/// and how many keys are active.
fn org_holdings(shares: &Shares) -> (HashMap<&str, Org>, usize) {
    let mut orgs: HashMap<&str, Org> = HashMap::new();
    let mut active_keys = 0;
    for k in shares.keys.values() {
        let org = orgs.entry(&k.org).or_default();
        org.held.add(k.held);
        org.queued = org.queued.saturating_add(k.queued);
        if k.seen.is_some() {
            active_keys += 1;
            org.active = true;
            org.weight = shares.org_weights.get(&k.org).copied().unwrap_or(1.0);
        }
    }
    (orgs, active_keys)
}

impl<'a> Headroom<'a> {
    fn new(shares: &'a Shares, room: Room, fraction: f64) -> Self {
        let (orgs, active_keys) = org_holdings(shares);
        let mut h = Headroom {
            shares,
            room,
            fraction,
            org_weights: orgs.values().map(|o| o.weight).sum(),
            orgs,
            active_keys,
            idle_orgs: 0,
            reserved: 0,
            below_slots: 0,
            below_kv: 0,
            least_past: [None; 2],
            least_past_keys: HashMap::new(),
        };
        h.count_active_keys();
        h.least_past_keys = h.keys_past_their_parts();
        h.weigh_orgs_against_their_parts();
        h
    }

    /// Per org, its active keys holding no slot and no KV, and their weights summed.
    fn count_active_keys(&mut self) {
        for k in self.shares.keys.values().filter(|k| k.seen.is_some()) {
            if let Some(o) = self.orgs.get_mut(k.org.as_str()) {
                o.idle_keys += usize::from(k.held.slots == 0);
                o.idle_kv_keys += usize::from(k.held.kv == 0);
                o.key_weights += k.weight;
            }
        }
    }

    /// Per org, [`LeastPast`] of its keys past their part of slots and of KV, by weighted
    /// holding.
    fn keys_past_their_parts(&self) -> HashMap<&'a str, (LeastPast<'a>, LeastPast<'a>)> {
        type Past<'k> = Vec<(&'k str, f64)>;
        let shares = self.shares;
        let mut past_keys: HashMap<&str, (Past, Past)> = HashMap::new();
        for (name, k) in shares.keys.iter().filter(|(_, k)| k.seen.is_some()) {
            let (slots, kv) = self.key_part(name);
            let entry = past_keys.entry(&k.org).or_default();
            let w = k.weight.max(f64::MIN_POSITIVE);
            if k.held.slots as f64 > slots {
                entry.0.push((name, k.held.slots as f64 / w));
            }
            if k.held.kv as f64 > kv {
                entry.1.push((name, k.held.kv as f64 / w));
            }
        }
        past_keys
            .into_iter()
            .map(|(org, (slots, kv))| (org, (two_least(slots), two_least(kv))))
            .collect()
    }

    /// Each org against its parts: active orgs idle and below their parts, each one's reserve
    /// (applied once all are read) and average use, and the two least floods.
    fn weigh_orgs_against_their_parts(&mut self) {
        let shares = self.shares;
        let (mut idle, mut below_slots, mut below_kv) = (0, 0, 0);
        let mut past: Vec<(&str, u64)> = Vec::new();
        let mut usages: Vec<(&str, u64, f64)> = Vec::new();
        for (name, o) in &self.orgs {
            let (slots, kv) = self.org_part(name);
            let usage = shares.usage.get(*name);
            let mean = usage
                .filter(|_| shares.window_ms > 0)
                .map_or(f64::INFINITY, |u| u.average(shares.averaging_ms()));
            let mut reserve = 0;
            if o.active {
                idle += usize::from(o.held.slots == 0);
                below_slots += usize::from((o.held.slots as f64) < slots);
                below_kv += usize::from((o.held.kv as f64) < kv);
                reserve = self.org_reserve(name, o, usage);
            }
            usages.push((name, reserve, mean));
            if o.held.slots as f64 > slots {
                past.push((name, o.held.slots));
            }
        }
        for (name, reserve, mean) in usages {
            self.reserved = self.reserved.saturating_add(reserve);
            if let Some(o) = self.orgs.get_mut(name) {
                (o.reserve, o.mean) = (reserve, mean);
            }
        }
        past.sort_unstable_by_key(|&(name, held)| (held, name));
        self.least_past = [past.first().copied(), past.get(1).copied()];
        (self.idle_orgs, self.below_slots, self.below_kv) = (idle, below_slots, below_kv);
    }

    /// The slots an active org is held in reserve beyond what it holds: its recent peak and
    /// one more, up to its share of the slots rounded up (with more orgs than a pool has slots
    /// twice over, a part of one would keep a quiet tenant no second request).
    fn org_reserve(&self, name: &str, o: &Org, usage: Option<&Usage>) -> u64 {
        let cap = (self.room.slots as f64 * self.org_share(name))
            .ceil()
            .max(1.0);
        let peak = usage.map_or(0, Usage::peak);
        let wants = (peak.saturating_add(1) as f64).min(cap) as u64;
        wants.saturating_sub(o.held.slots)
    }

    /// A key's fair part: its org's, split among the org's active keys by weight.
    fn key_part(&self, key: &str) -> (f64, f64) {
        let Some(k) = self.shares.keys.get(key) else {
            return (self.room.slots as f64, self.room.kv as f64);
        };
        let (slots, kv) = self.org_part(&k.org);
        let all = self.orgs.get(k.org.as_str()).map_or(0.0, |o| o.key_weights);
        let share = if all > 0.0 {
            (k.weight / all).min(1.0)
        } else {
            1.0
        };
        (slots * share, kv * share)
    }

    /// Whether `key` holding `held` and asking `want` more is past its part within its org: past
    /// its share of the org's part, and holding more for its weight than the least of its
    /// siblings past theirs (a weighted key may hold its weight's worth of theirs).
    fn key_past(&self, key: &str, org: &str, held: u64, want: u64, kv: bool) -> bool {
        let (slots_part, kv_part) = self.key_part(key);
        let part = if kv { kv_part } else { slots_part };
        let after = held.saturating_add(want) as f64;
        if after <= part {
            return false;
        }
        let w = self
            .shares
            .keys
            .get(key)
            .map_or(1.0, |k| k.weight.max(f64::MIN_POSITIVE));
        let least = self
            .least_past_keys
            .get(org)
            .and_then(|(slots, kvs)| least_other(if kv { kvs } else { slots }, key));
        least.is_none_or(|least| after / w > least)
    }

    /// An org's fair part: slots (whole, at least one) and KV tokens.
    fn org_part(&self, org: &str) -> (f64, f64) {
        let share = self.org_share(org);
        let slots = (self.room.slots as f64 * share).floor().max(1.0);
        (slots, self.room.kv as f64 * share)
    }

    /// An org's share of the pool: its weight over the active orgs'.
    fn org_share(&self, org: &str) -> f64 {
        let w = self.orgs.get(org).map_or(1.0, |o| o.weight);
        if self.org_weights > 0.0 {
            (w / self.org_weights).min(1.0)
        } else {
            1.0
        }
    }

    /// Whether `key` (of `org`) may start a request of `sequences` slots and `kv_need` KV
    /// tokens now (if it fits a replica: that is the pool's to say).
    pub fn admits(&self, key: &str, org: &str, sequences: u64, kv_need: u64) -> bool {
        self.admission(key, org, sequences, kv_need).is_some()
    }

    /// [`admits`](Self::admits), and how ([`Start`]): quiet for a request within its share's
    /// part (a turn, or a quiet tenant's burst) while others are active, alone for a share
    /// alone in the pool, a flood for any other it admits.
    pub fn admission(&self, key: &str, org: &str, sequences: u64, kv_need: u64) -> Option<Start> {
        let own = self.shares.keys.get(key);
        let active = own.is_some_and(|k| k.seen.is_some());
        if self.active_keys <= usize::from(active) {
            return Some(Start::Alone);
        }
        let asker = Asker {
            key,
            org,
            active,
            held: own.map_or(Holding::default(), |k| k.held),
            o: self.orgs.get(org),
        };
        let (org_slots, org_kv) = self.org_part(org);
        let slots = self.slots_start(&asker, sequences, org_slots);
        let kv = self.kv_start(&asker, kv_need, org_kv);
        let o = asker.o;
        // An org with a backlog is no quiet one, within its part or not: its requests would
        // fill engines' own queues (two flooding orgs on a KV-bound pool: the one of many keys
        // got 0.87-0.97 of the other's share, against 0.94-0.98 with both kept out).
        let backlogged = o.is_some_and(|o| o.queued > 1);
        match (slots?, kv?) {
            (Start::Quiet, Start::Quiet) if backlogged => Some(Start::Backlog),
            (Start::Quiet, Start::Quiet) => Some(Start::Quiet),
            _ => Some(Start::Flood),
        }
    }

    /// How the rule admits the request's `sequences` slots ([`admission`](Self::admission)):
    /// its turn, a quiet burst or a flood catching up, or a flood, each leaving the others
    /// what it owes them; `None` while it must wait.
    fn slots_start(&self, a: &Asker<'_>, sequences: u64, org_slots: f64) -> Option<Start> {
        let Asker {
            key, org, held, o, ..
        } = *a;
        let org_held = a.org_held();
        if turn(held.slots, org_held.slots, sequences, org_slots) {
            Some(turn_start(org_held.slots, sequences, org_slots))
        } else {
            let org_past = org_held.slots.saturating_add(sequences) as f64 > org_slots;
            let key_past = self.key_past(key, org, held.slots, sequences, false);
            let (orgs_below, keys_idle) = a.others(
                self.below_slots,
                o.map_or(0, |o| o.idle_keys),
                (org_held.slots as f64) < org_slots,
                held.slots == 0,
            );
            // Its org holds something, so it is not among the idle orgs; `keys_idle` leaves it
            // out of its org's idle keys. Turns within the org go no further than the org's
            // part: an org of more keys than its part has slots takes turns in fair order.
            let org_left = (org_slots - org_held.slots as f64).max(0.0) as usize;
            let turns = (self.idle_orgs + keys_idle.min(org_left)) as u64;
            // A burst that leaves its org holding no more than every other flood does: the
            // headroom is kept against floods, not against the quiet tenants it is for.
            let least_other = self
                .least_past
                .iter()
                .flatten()
                .find(|(name, _)| *name != org)
                .map(|&(_, held)| held);
            // And a quiet tenant's burst one past its part — an org that held less than its part
            // on average lately and has nothing else queued: its requests come and go in
            // bursts (a Poisson stream of short chats sometimes runs three at once), not as a
            // flood's backlog. A flood has its backlog queued.
            let after = org_held.slots.saturating_add(sequences);
            let steady = o.is_some_and(|o| o.mean + AVERAGE_NOISE < org_slots && o.queued <= 1)
                && after as f64 <= org_slots + 1.0;
            let catching_up = least_other.is_some_and(|l| after <= l);
            // An org past its part leaves every other org its reserve (its recent peak and one
            // more): a quiet tenant's next requests find room at once, not after the longest
            // of a flood's streams (its turn alone would be taken by its first). A key past its
            // part within an org that is not owes its idle siblings their turns, and the other
            // orgs only theirs (with two flooding orgs, the one of many keys was held to
            // 0.87-0.89 of the other's share in a third of the runs when its keys left the
            // other org its reserve too).
            let held_back_org = org_past && orgs_below > 0;
            let reserves = if held_back_org {
                (self.reserved).saturating_sub(o.map_or(0, |o| o.reserve))
            } else {
                self.idle_orgs as u64
            };
            let held_back = held_back_org || (key_past && keys_idle > 0);
            // A quiet tenant's burst, and a flood catching up with another, may use the
            // headroom but leave the others their reserves: a request past its part never takes
            // room another org may ask for within its own (a flood's first seconds look like a
            // quiet burst, and its streams held the room a small tenant's second request needed
            // for seconds).
            let in_org = keys_idle.min(org_left) as u64;
            let kept = match (held_back, steady || catching_up) {
                (false, _) => turns,
                (true, true) => turns.max(in_org.saturating_add(reserves)),
                (true, false) => ((self.fraction * self.room.slots as f64).ceil() as u64)
                    .max(in_org.saturating_add(reserves)),
            };
            let used = self.room.slots_used.saturating_add(sequences);
            // Only a quiet org's requests start quiet: a flood catching up with another may
            // use the room, but stays out of engines' own queues.
            // Quiet or not is between orgs: a key past its part within an org that is not is
            // its siblings' business (an org's many keys would keep out of engines' queues
            // while a single-key org's requests went in).
            let quiet = steady || (catching_up && org_held.slots as f64 <= org_slots) || !org_past;
            (used <= self.room.slots && self.room.slots - used >= kept).then_some(if quiet {
                Start::Quiet
            } else {
                Start::Flood
            })
        }
    }

    /// How the rule admits the request's `kv_need` KV tokens ([`admission`](Self::admission)).
    fn kv_start(&self, a: &Asker<'_>, kv_need: u64, org_kv: f64) -> Option<Start> {
        let Asker {
            key, org, held, o, ..
        } = *a;
        let org_held = a.org_held();
        if self.room.kv == 0 {
            Some(Start::Quiet)
        } else if turn(held.kv, org_held.kv, kv_need, org_kv) {
            Some(turn_start(org_held.kv, kv_need, org_kv))
        } else {
            let org_past = org_held.kv.saturating_add(kv_need) as f64 > org_kv;
            let key_past = self.key_past(key, org, held.kv, kv_need, true);
            let (orgs_below, keys_idle) = a.others(
                self.below_kv,
                o.map_or(0, |o| o.idle_kv_keys),
                (org_held.kv as f64) < org_kv,
                held.kv == 0,
            );
            let held_back = (org_past && orgs_below > 0) || (key_past && keys_idle > 0);
            let kept = if held_back {
                self.fraction * self.room.kv as f64
            } else {
                0.0
            };
            let free = self
                .room
                .kv
                .saturating_sub(self.room.kv_used.saturating_add(kv_need));
            let quiet = !org_past;
            (free as f64 >= kept).then_some(if quiet { Start::Quiet } else { Start::Flood })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shares of `(key, org weight, slots held, kv held)`, each key an org of its own (the
    /// org is the key's first path id).
    fn shares(list: &[(&str, f64, u64, u64)]) -> Shares {
        let mut s = Shares::default();
        for &(key, weight, slots, kv) in list {
            let org = key.split('/').next().unwrap_or(key);
            s.arrived(key, org, weight, 1.0, 0);
            s.hold(key, org, slots, kv, true);
        }
        s
    }

    fn slots(total: u64, list: &[(&str, f64, u64, u64)]) -> (Room, Shares) {
        let room = Room {
            slots: total,
            slots_used: list.iter().map(|s| s.2).sum(),
            kv: 0,
            kv_used: 0,
        };
        (room, shares(list))
    }

    /// [`shares`], where `key` (an org of its own) held `peak` slots at once a moment ago.
    fn peaked(list: &[(&str, f64, u64, u64)], key: &str, peak: u64) -> Shares {
        let mut s = shares(list);
        s.hold(key, key, peak, 0, true);
        s.hold(key, key, peak, 0, false);
        s
    }

    /// A pool of `total` slots, as many used as `s`'s keys hold, and no KV figures.
    fn held_of(total: u64, s: &Shares) -> Room {
        Room {
            slots: total,
            slots_used: s.keys.values().map(|k| k.held.slots).sum(),
            kv: 0,
            kv_used: 0,
        }
    }

    fn org(key: &str) -> &str {
        key.split('/').next().unwrap_or(key)
    }

    /// How many more slots `key` may take, one at a time, as nobody else moves.
    fn takes(total: u64, list: &[(&str, f64, u64, u64)], key: &str) -> u64 {
        let mut list: Vec<(&str, f64, u64, u64)> = list.to_vec();
        let mut taken = 0;
        loop {
            let (room, s) = slots(total, &list);
            if room.slots_used == total || !s.headroom(room, 0.2).admits(key, org(key), 1, 0) {
                return taken;
            }
            taken += 1;
            if let Some(s) = list.iter_mut().find(|s| s.0 == key) {
                s.2 += 1;
            }
        }
    }

    #[test]
    fn alone_a_share_uses_the_whole_pool() {
        assert_eq!(takes(8, &[("flood", 1.0, 0, 0)], "flood"), 8);
        // Alone with keys of its own org: the same.
        assert_eq!(takes(8, &[("o/k1", 1.0, 0, 0)], "o/k1"), 8);
    }

    #[test]
    fn however_many_shares_flood_a_turn_stays_free_for_each_quiet_one() {
        // One to four flooders, one to six quiet tenants holding nothing, 2 to 16 slots, orgs
        // of their own or keys of one org: the flooders, taking turns, leave a slot for each
        // quiet one (and the headroom fraction), as far as the pool has slots beyond one each.
        for same_org in [false, true] {
            for flooders in 1..=4usize {
                for quiet in 1..=6usize {
                    for total in 2..=16u64 {
                        let name = |kind: &str, i| {
                            if same_org {
                                format!("acme/{kind}{i}")
                            } else {
                                format!("{kind}{i}")
                            }
                        };
                        let names: Vec<String> = (0..flooders).map(|i| name("f", i)).collect();
                        let quiet_names: Vec<String> = (0..quiet).map(|i| name("q", i)).collect();
                        let mut list: Vec<(&str, f64, u64, u64)> = names
                            .iter()
                            .chain(&quiet_names)
                            .map(|n| (n.as_str(), 1.0, 0, 0))
                            .collect();
                        // Round robin among the flooders until none may take more.
                        loop {
                            let mut moved = false;
                            for i in 0..flooders {
                                let (room, s) = slots(total, &list);
                                let key = list[i].0;
                                if room.slots_used < total
                                    && s.headroom(room, 0.2).admits(key, org(key), 1, 0)
                                {
                                    list[i].2 += 1;
                                    moved = true;
                                }
                            }
                            if !moved {
                                break;
                            }
                        }
                        let free = total - list.iter().map(|s| s.2).sum::<u64>();
                        let owed = (quiet as u64).min(total.saturating_sub(flooders as u64));
                        assert!(
                            free >= owed,
                            "{flooders} flooders, {quiet} quiet, {total} slots, one org {same_org}: {free} free"
                        );
                        // Every quiet tenant may start one request now, while a slot is free.
                        let (room, s) = slots(total, &list);
                        let headroom = s.headroom(room, 0.2);
                        assert!(
                            free == 0
                                || quiet_names.iter().all(|q| headroom.admits(q, org(q), 1, 0))
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_share_within_its_fair_part_takes_it_beside_a_busy_share() {
        // 8 slots, two shares: 4 each.
        assert_eq!(takes(8, &[("a", 1.0, 0, 0), ("b", 1.0, 4, 0)], "a"), 4);
        // Weighted: 3 to 1 of 8 slots is 6 and 2.
        assert!(takes(8, &[("a", 3.0, 0, 0), ("b", 1.0, 2, 0)], "a") >= 6);
    }

    #[test]
    fn once_every_other_share_has_its_part_the_rest_may_go_to_a_flood() {
        // b holds its fair part (4 of 8): nothing is kept for it.
        assert_eq!(takes(8, &[("a", 1.0, 0, 0), ("b", 1.0, 4, 0)], "a"), 4);
        // b holds 1 of its 4: the headroom (2 slots) stays free.
        assert_eq!(takes(8, &[("a", 1.0, 0, 0), ("b", 1.0, 1, 0)], "a"), 5);
    }

    #[test]
    fn a_quiet_tenant_s_recent_peak_stays_free_through_a_flood() {
        // 12 slots, four orgs (a part of 3 each): a flood f and quiet tenants q0, q1, q2. q0
        // ran two requests at once earlier in the window and holds nothing now.
        let list = [
            ("f", 1.0, 0, 0),
            ("q0", 1.0, 0, 0),
            ("q1", 1.0, 0, 0),
            ("q2", 1.0, 0, 0),
        ];
        let mut s = peaked(&list, "q0", 2);
        let room = |s: &Shares| held_of(12, s);
        let admits = |s: &Shares, key: &str| s.headroom(room(s), 0.2).admits(key, key, 1, 0);
        while admits(&s, "f") {
            s.hold("f", "f", 1, 0, true);
        }
        // The flood keeps q0 its peak and one more (3, its part), q1 and q2 a turn each.
        assert_eq!(12 - room(&s).slots_used, 5);
        // q0's burst of two starts at once, not after one of the flood's streams ends...
        for _ in 0..2 {
            assert!(admits(&s, "q0"));
            s.hold("q0", "q0", 1, 0, true);
        }
        // ...and leaves q1's and q2's turns.
        assert!(admits(&s, "q1") && admits(&s, "q2"));
        // A window later with q0 holding one, its peak is that one: the flood may take
        // back all but one more for it.
        s.hold("q0", "q0", 1, 0, false);
        s.expire(20_000, 10_000);
        s.expire(40_000, 10_000);
        for k in ["f", "q0", "q1", "q2"] {
            s.arrived(k, k, 1.0, 1.0, 40_000);
        }
        let mut took = 0;
        while admits(&s, "f") {
            s.hold("f", "f", 1, 0, true);
            took += 1;
        }
        assert_eq!(took, 1, "q0: 1 held and 1 kept; q1, q2: a turn each");
    }

    #[test]
    fn a_flood_s_burst_to_another_flood_leaves_the_quiet_orgs_their_reserves() {
        // 24 slots, four orgs (a part of 6 each): f1 floods (12), f2 floods less (7); d ran
        // three at once earlier (a reserve of 4), e nothing (a reserve of 1): 5 free.
        let list = [
            ("f1", 1.0, 12, 0),
            ("f2", 1.0, 7, 0),
            ("d", 1.0, 0, 0),
            ("e", 1.0, 0, 0),
        ];
        let mut s = peaked(&list, "d", 3);
        let room = |s: &Shares| held_of(24, s);
        let mut took = 0;
        while s.headroom(room(&s), 0.2).admits("f2", "f2", 1, 0) {
            s.hold("f2", "f2", 1, 0, true);
            took += 1;
        }
        assert_eq!(took, 0, "f2 catching up with f1 takes d's and e's reserves");
        // d's burst of its peak and one more starts at once, and e's turn after it.
        for _ in 0..4 {
            assert!(s.headroom(room(&s), 0.2).admits("d", "d", 1, 0));
            s.hold("d", "d", 1, 0, true);
        }
        assert!(s.headroom(room(&s), 0.2).admits("e", "e", 1, 0));
    }

    #[test]
    fn a_flood_below_another_flood_starts_as_a_flood() {
        // 24 slots, four orgs (a part of 6 each): a and b both flood, c and d hold nothing.
        // a, past its part already, is below b: its next request may use the room (a burst,
        // as far as b's holding), but it is no quiet tenant's: it stays out of an engine's
        // own queue.
        let (mut room, mut s) = slots(
            24,
            &[
                ("a", 1.0, 7, 0),
                ("b", 1.0, 9, 0),
                ("c", 1.0, 0, 0),
                ("d", 1.0, 0, 0),
            ],
        );
        let h = s.headroom(room, 0.2);
        assert_eq!(h.admission("a", "a", 1, 0), Some(Start::Flood));
        // A quiet org's burst past its part, as far as the least flood, still starts quiet.
        room.slots_used += 6;
        s.hold("c", "c", 6, 0, true);
        let h = s.headroom(room, 0.2);
        assert_eq!(h.admission("c", "c", 1, 0), Some(Start::Quiet));
    }

    #[test]
    fn quiet_or_flood_is_between_orgs_not_among_one_org_s_keys() {
        // 12 slots, orgs m (four keys) and s: a part of 6 each, 1.5 a key within m. m/k0 runs
        // two and asks a third: past its own part (its idle siblings keep their turns), but m
        // is within its part, so the request starts quiet, as s's would.
        let (room, s) = slots(
            12,
            &[
                ("m/k0", 1.0, 2, 0),
                ("m/k1", 1.0, 0, 0),
                ("m/k2", 1.0, 0, 0),
                ("m/k3", 1.0, 0, 0),
                ("s", 1.0, 2, 0),
            ],
        );
        let h = s.headroom(room, 0.2);
        assert_eq!(h.admission("m/k0", "m", 1, 0), Some(Start::Quiet));
        assert_eq!(h.admission("s", "s", 1, 0), Some(Start::Quiet));
    }

    #[test]
    fn a_key_past_its_part_within_its_org_owes_its_siblings_not_other_orgs() {
        // 12 slots, three orgs (a part of 4 each): m's k0 runs two (its part within m) while
        // k1 idles, s ran four at once lately and runs one (a reserve of 3), f floods (5).
        // k0's third leaves k1 its turn and the headroom; s's reserve is owed by f, past its
        // part, not by m, within its own.
        let list = [
            ("m/k0", 1.0, 2, 0),
            ("m/k1", 1.0, 0, 0),
            ("s", 1.0, 1, 0),
            ("f", 1.0, 5, 0),
        ];
        let s = peaked(&list, "s", 3);
        let room = held_of(12, &s);
        assert!(s.headroom(room, 0.2).admits("m/k0", "m", 1, 0));
        assert!(!s.headroom(room, 0.2).admits("f", "f", 1, 0));
    }

    #[test]
    fn a_turn_larger_than_its_part_starts_as_a_flood() {
        // 12 slots and 1000 KV tokens, four orgs (parts of 3 slots and 250 tokens), nothing
        // held: a turn of 8 sequences, or of 600 tokens, is past its part at once and must not
        // join an engine's own queue ahead of the quiet tenants' requests.
        let s = shares(&[
            ("a", 1.0, 0, 0),
            ("b", 1.0, 0, 0),
            ("c", 1.0, 0, 0),
            ("d", 1.0, 0, 0),
        ]);
        let room = Room {
            slots: 12,
            slots_used: 0,
            kv: 1_000,
            kv_used: 0,
        };
        let h = s.headroom(room, 0.2);
        assert_eq!(h.admission("a", "a", 8, 10), Some(Start::Flood));
        assert_eq!(h.admission("a", "a", 1, 600), Some(Start::Flood));
        assert_eq!(h.admission("a", "a", 3, 250), Some(Start::Quiet));
    }

    #[test]
    fn a_quiet_tenant_s_burst_may_go_one_past_its_part_from_room_nobody_else_may_need() {
        // 12 slots, six orgs (a part of 2 each): three floods hold their parts with backlogs,
        // q0 and q1 ran `ran` requests at a time earlier (a reserve of one more each), q2 has
        // held `first` slots since `since` and holds its part at 12 s. It bursts to a third.
        let burst = |ran: u64, since: u64, first: u64| {
            let mut s = Shares::default();
            let orgs = ["f0", "f1", "f2", "q0", "q1", "q2"];
            for k in orgs {
                s.arrived(k, k, 1.0, 1.0, 0);
            }
            s.expire(0, 10_000);
            for q in ["q0", "q1"] {
                s.hold(q, q, ran, 0, true);
                s.hold(q, q, ran, 0, false);
            }
            for f in ["f0", "f1", "f2"] {
                s.hold(f, f, 2, 0, true);
                s.queued(f, f, 5);
            }
            for k in orgs {
                s.arrived(k, k, 1.0, 1.0, since);
            }
            s.expire(since, 10_000);
            s.hold("q2", "q2", first, 0, true);
            for k in orgs {
                s.arrived(k, k, 1.0, 1.0, 12_000);
            }
            s.expire(12_000, 10_000);
            if first < 2 {
                s.hold("q2", "q2", 2 - first, 0, true);
            }
            s.queued("q2", "q2", 1);
            let room = Room {
                slots: 12,
                slots_used: 8,
                kv: 0,
                kv_used: 0,
            };
            let h = s.headroom(room, 0.2);
            (h.admission("q2", "q2", 1, 0), h.admission("q2", "q2", 2, 0))
        };
        // Below its part on average over the window, with q0 and q1 idle lately (a reserve of
        // one each): its third starts, quietly; a fourth would not.
        assert_eq!(burst(0, 0, 1), (Some(Start::Quiet), None));
        // With q0 and q1 having run one each, a third would leave 3 free for their reserves of
        // 2: it waits (before, it left them only their turns, and a flood's first seconds, which
        // look like such a burst, held a small tenant's second request for seconds).
        assert_eq!(burst(1, 0, 1), (None, None));
        // New to the pool a second ago, it is judged by what it held so far: one slot, below
        // its part (before, its average was unknown for a quarter of the window, and a Poisson
        // tenant's bursts waited for its own requests to end in its first seconds).
        assert_eq!(burst(0, 11_000, 1), (Some(Start::Quiet), None));
        // Holding its part from the start, as a flood's first second does: a flood, kept out
        // of the engines' queues.
        assert_eq!(burst(0, 11_000, 2), (Some(Start::Flood), None));
    }

    #[test]
    fn an_org_holding_exactly_its_part_is_never_below_it() {
        // Two orgs on 4 slots (a part of 2 each): f holds 2 from its first request on, with one
        // more queued, while the expiry ticks every 2-8 ms; o holds nothing. At every tick f's
        // third request would be a flood, held back for o's turn and reserve — never a quiet
        // burst (the average's float noise read it below its part in most ticks).
        let mut s = Shares::default();
        for k in ["f", "o"] {
            s.arrived(k, k, 1.0, 1.0, 0);
        }
        s.expire(0, 10_000);
        s.hold("o", "o", 1, 0, true);
        s.hold("o", "o", 1, 0, false);
        s.hold("f", "f", 2, 0, true);
        s.queued("f", "f", 1);
        let room = Room {
            slots: 4,
            slots_used: 2,
            kv: 0,
            kv_used: 0,
        };
        let mut now = 0;
        for tick in 0..200u64 {
            now += 2 + (tick * 7919) % 7;
            s.arrived("f", "f", 1.0, 1.0, now);
            s.expire(now, 10_000);
            let h = s.headroom(room, 0.2);
            assert_eq!(h.admission("f", "f", 1, 0), None, "tick {tick} at {now} ms");
        }
    }

    #[test]
    fn keys_minted_by_one_org_keep_one_turn_free_against_another() {
        // Org m has eight active keys holding nothing; org f floods. m's idle keys keep one
        // turn (m is one org), not eight.
        let mut list = vec![("f/k", 1.0, 0, 0)];
        let minted: Vec<String> = (0..8).map(|i| format!("m/k{i}")).collect();
        list.extend(minted.iter().map(|k| (k.as_str(), 1.0, 0, 0)));
        assert_eq!(
            takes(8, &list, "f/k"),
            6,
            "the headroom (2) and one turn kept"
        );
        // Within m, its keys take turns among themselves: one running, the others kept a turn
        // each as far as m's part (4) goes.
        let mut list = vec![("f/k", 1.0, 4, 0)];
        list.extend(minted.iter().map(|k| (k.as_str(), 1.0, 0, 0)));
        list[1].2 = 1;
        assert_eq!(takes(8, &list, "m/k0"), 0, "its siblings' turns come first");
    }

    #[test]
    fn kv_past_its_fair_part_leaves_the_headroom_free() {
        let s = shares(&[("flood", 1.0, 1, 500), ("quiet", 1.0, 0, 0)]);
        let room = |used| Room {
            slots: 100,
            slots_used: 1,
            kv: 1_000,
            kv_used: used,
        };
        // 500 held of a fair 500: 300 more would leave 200 free (20%), 301 would not.
        assert!(s.headroom(room(500), 0.2).admits("flood", "flood", 1, 300));
        assert!(!s.headroom(room(500), 0.2).admits("flood", "flood", 1, 301));
        // A share holding nothing starts a request of any size.
        assert!(
            s.headroom(room(500), 0.2)
                .admits("quiet", "quiet", 1, 5_000)
        );
    }

    #[test]
    fn a_key_s_part_is_its_org_s_split_among_its_active_keys() {
        // (Keys competing for the pool: each runs a request.)
        let s = shares(&[("a/k1", 1.0, 1, 0), ("a/k2", 1.0, 1, 0), ("b/k", 1.0, 1, 0)]);
        assert_eq!(s.part("a/k1"), 0.25);
        assert_eq!(s.part("b/k"), 0.5);
        assert_eq!(s.part("nobody"), 1.0);
    }

    #[test]
    fn idle_keys_are_forgotten_once_they_hold_nothing() {
        let mut s = shares(&[("a/k", 1.0, 1, 10)]);
        s.expire(10_000, 1_000);
        assert_eq!(s.keys.len(), 1, "still holds a slot");
        s.hold("a/k", "a", 1, 10, false);
        assert!(s.keys.is_empty() && !s.org_weights.is_empty());
        s.expire(10_000, 1_000);
        assert!(s.org_weights.is_empty());
    }
    #[test]
    fn absurd_demands_do_not_overflow() {
        // A key running one request asks for u64::MAX sequences (`n` as sent on an off-mode
        // route) or KV tokens, while another key is active.
        let s = shares(&[("a", 1.0, 1, 10), ("b", 1.0, 0, 0)]);
        let room = Room {
            slots: 8,
            slots_used: 1,
            kv: 1_000,
            kv_used: 10,
        };
        let h = s.headroom(room, 0.2);
        assert!(!h.admits("a", "a", u64::MAX, 1));
        assert!(!h.admits("a", "a", 1, u64::MAX));
    }
}
