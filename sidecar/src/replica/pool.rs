//! Pools of engine replicas serving one model, and where a request should run.
//!
//! Each replica has a KV token budget; the dispatcher reserves a request's KV need on the replica
//! it picks and gives it back when the request ends, so work is only sent where it fits.
//! Scraped engine metrics ([`crate::replica::engine`]) add what the engine itself reports: a replica with
//! requests waiting inside the engine gets no more floods, so queueing happens here, in fair
//! order, and not in the engine's arrival order. A quiet tenant's request (within its part,
//! [`weir_core::scheduler::headroom::Start::Quiet`]) may still go there: an engine reports requests waiting
//! between its steps too, and a probe's snapshot of one would hold the request for the next
//! probe, while the floods' requests are kept out of the engine's queue ahead of it.
//!
//! Each replica also has a concurrency limit ([`crate::replica::limiter`]): the engine's own (its slots),
//! else the configured `max_concurrency_per_replica`, lowered while the engine holds a queue of
//! its own (or, for an engine that reports none, starts what it was sent slowly, as far as its
//! goodput allows). It holds whatever the KV figures say, so a replica whose engine reports no
//! KV (llama.cpp, TGI) or no load at all never holds a queue of weir's work either.

use std::collections::BTreeSet;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::net::SocketAddr;
use std::sync::Arc;
use weir_core::scheduler::headroom::{Room, Start};

use crate::config::engine::EngineShare;
use crate::config::{PoolConfig, Scheme};
use crate::isolation::Isolation;
use crate::replica::engine::{Dialect, EngineLimits, EngineSample};
use crate::replica::limiter::{Limiter, Mode, Ticket};
use crate::replica::upstream::Upstream;

/// A replica's identity within its pool, never reused: events about a replica that has left
/// (a late health sample, say) find nothing, rather than another replica.
pub type ReplicaId = u64;

#[derive(Clone, Debug)]
pub struct Replica {
    pub id: ReplicaId,
    pub url: String,
    /// Gone from the pool's set ([`crate::replica::roster`]): no new work; dropped once its requests end.
    pub leaving: bool,
    /// KV tokens this sidecar may reserve here: its share of what the replica holds (config,
    /// else scraped).
    pub kv_budget: u64,
    /// KV tokens reserved by requests dispatched here and not finished.
    pub reserved: u64,
    pub in_flight: u64,
    pub healthy: bool,
    /// How its prefix cache is kept per tenant; only some modes get work.
    pub isolation: Isolation,
    pub engine: EngineSample,
    /// Requests the engine says it runs at once (read when the replica joins), if it says.
    pub engine_limit: Option<u64>,
    /// `max_concurrency_per_replica`: the limit when the engine does not say its own.
    pub configured_limit: Option<u64>,
    /// `adaptive_concurrency`: the limit adapts (else it holds at the engine's or configured one).
    pub adaptive: bool,
    /// The adaptive limit, never above this sidecar's share of the engine's (or configured) one.
    pub limiter: Limiter,
    /// This sidecar's part of the replica, when other sidecars admit to it too.
    pub share: EngineShare,
    /// Its engine's dialect, once a probe has told it; `None` for an engine that only speaks
    /// OpenAI's API.
    pub dialect: Option<Dialect>,
    /// A flood's streams sent here whose first bytes have not come: the engine is prefilling
    /// their prompts.
    pub prefilling: Vec<Ticket>,
    /// Quiet requests sent here whose answer (a stream: its first bytes) has not come, with
    /// when each was sent: a flood's prompt started beside one would stretch the engine's
    /// steps while it is answered (see [`Pool::prefill_allows`]).
    pub answering: Vec<(Ticket, u64)>,
}

/// How long a quiet request's answer keeps floods' prompts off its replica at the most: a
/// longer answer is not doubled by a prefill step or two, and a quiet tenant cannot hold a
/// replica's slots from the floods by asking for long answers.
pub const QUIET_GUARD_MS: u64 = 1_000;

impl Replica {
    /// A replica joining `config`'s pool: unhealthy and unprobed until its probes say otherwise.
    pub fn new(id: ReplicaId, url: &str, config: &PoolConfig) -> Replica {
        Replica {
            id,
            url: normalize(url),
            leaving: false,
            kv_budget: config
                .sidecars
                .part(config.kv_tokens_per_replica.unwrap_or(0)),
            reserved: 0,
            in_flight: 0,
            // Unknown until the first probe answers.
            healthy: false,
            isolation: Isolation::initial(config.cache_isolation),
            engine: EngineSample::default(),
            engine_limit: None,
            configured_limit: config.max_concurrency_per_replica,
            adaptive: config.adaptive_concurrency,
            limiter: Limiter::new(
                config
                    .max_concurrency_per_replica
                    .map(|l| config.sidecars.part(l)),
                limit_mode(config.adaptive_concurrency, None),
            ),
            share: config.sidecars,
            dialect: None,
            prefilling: Vec::new(),
            answering: Vec::new(),
        }
    }

    /// Its engine can resume a preempted stream (see [`Dialect::resumes`]): batch streams
    /// dispatched here may be preempted. Unknown engines cannot.
    pub fn resumes(&self) -> bool {
        self.dialect.is_some_and(Dialect::resumes)
    }

    /// Requests weir may have running here at once: min(the engine's or configured limit, the
    /// adaptive one), at least 1.
    pub fn limit(&self) -> u64 {
        self.limiter.limit()
    }

    /// The replica answered its probe for the first time, or again after being unreachable,
    /// with its engine's `limits` and `dialect`: the adaptive limit starts over under them.
    pub fn join(&mut self, limits: EngineLimits, dialect: Option<Dialect>) {
        self.engine_limit = limits.max_concurrency;
        self.dialect = dialect;
        self.restart_limiter();
    }

    /// The adaptive limit starts over under this sidecar's share of the engine's (or
    /// configured) limit, moving as the config and the engine's dialect say.
    pub fn restart_limiter(&mut self) {
        let ceiling = self.engine_limit.or(self.configured_limit);
        self.limiter
            .set_mode(limit_mode(self.adaptive, self.dialect));
        self.limiter.restart(ceiling.map(|l| self.share.part(l)));
    }

    /// The replica holds `total` KV tokens (configured, or as its engine says): this sidecar
    /// reserves up to its share of them.
    pub fn hold_kv(&mut self, total: u64) {
        self.kv_budget = self.share.part(total);
    }

    /// Fraction of the replica in use: of its concurrency limit, of its KV by weir's
    /// reservations, or by the engine's own count, whichever is fullest.
    pub fn load(&self) -> f64 {
        let slots = self.in_flight as f64 / self.limit() as f64;
        let kv = if self.kv_budget == 0 {
            0.0
        } else {
            self.reserved as f64 / self.kv_budget as f64
        };
        slots.max(kv).max(self.engine.kv_usage)
    }

    /// Whether tenants' work may go here at all: healthy, and its prefix cache kept per
    /// tenant (or shared by the config's choice).
    pub fn serves(&self) -> bool {
        self.healthy && !self.leaving && self.isolation.serves()
    }

    /// Whether a request of one sequence needing `kv_need` KV tokens fits now.
    pub fn fits(&self, kv_need: u64) -> bool {
        self.fits_for(kv_need, 1, Start::Alone)
    }

    /// The request of `ticket` is past its prefill (its first bytes came, or it ended): no
    /// longer a flood prefilling here, nor a quiet request being answered.
    pub fn prefilled(&mut self, ticket: Ticket) {
        self.prefilling.retain(|&t| t != ticket);
        self.answering.retain(|&(t, _)| t != ticket);
    }

    /// A quiet request's answer has been waited for long enough ([`QUIET_GUARD_MS`]) to stop
    /// guarding it from floods' prompts.
    pub fn unguard_older(&mut self, now: u64) {
        (self.answering).retain(|&(_, sent)| now.saturating_sub(sent) < QUIET_GUARD_MS);
    }

    /// Whether a request the engine runs as `sequences` sequences (a completions batch: one
    /// per prompt, each in a slot of its own) fits now: each takes a slot of the limit. One
    /// larger than the whole limit runs alone, as a prompt larger than the KV budget does.
    /// Only a quiet one may join requests waiting inside the engine.
    pub fn fits_for(&self, kv_need: u64, sequences: u64, start: Start) -> bool {
        let idle = self.in_flight == 0;
        let kv_room =
            self.kv_budget == 0 || self.reserved.saturating_add(kv_need) <= self.kv_budget || idle;
        let slot_room = idle || self.in_flight.saturating_add(sequences) <= self.limit();
        let queue = start == Start::Quiet || self.engine.waiting == 0;
        self.serves() && queue && slot_room && kv_room
    }
}

/// How a replica's limit moves: held, or adapting — to the engine's own queue where it reports
/// one (every dialect weir reads does: see [`crate::replica::engine`]), else to time to first byte.
fn limit_mode(adaptive: bool, dialect: Option<Dialect>) -> Mode {
    match (adaptive, dialect) {
        (false, _) => Mode::Fixed,
        (true, Some(_)) => Mode::EngineQueue,
        (true, None) => Mode::FirstByte,
    }
}

#[derive(Clone, Debug)]
pub struct Pool {
    pub model: String,
    pub replicas: Vec<Replica>,
    pub affinity_load_threshold: f64,
    pub affinity_prefix_bytes: usize,
    /// Its settings as last configured (a reload may change them).
    pub config: PoolConfig,
    /// How requests reach its replicas: client, TLS roots, credential.
    pub upstream: Arc<Upstream>,
    /// Removed from the config: it takes no new requests, and its replicas leave once its
    /// queue is empty. A reload that names the model again revives it.
    pub retired: bool,
    /// The replicas its config lists, and those its discovery found last.
    pub listed: BTreeSet<String>,
    pub discovered: BTreeSet<String>,
    /// The id the next replica to join gets.
    pub next_id: ReplicaId,
}

impl Pool {
    /// What its replicas that serve have, and hold for weir's requests ([`Room`]).
    pub fn room(&self) -> Room {
        let serving = || self.replicas.iter().filter(|r| r.serves());
        let sum = |figure: fn(&Replica) -> u64| serving().map(figure).fold(0, u64::saturating_add);
        Room {
            slots: self.concurrency(),
            slots_used: sum(|r| r.in_flight),
            kv: self.capacity(),
            kv_used: sum(|r| r.reserved),
        }
    }

    /// A pool with the replicas `config` lists (ids 0, 1, ...), reached with a plain client.
    pub fn new(config: &PoolConfig) -> Pool {
        Pool::with_upstream(config, Upstream::plain())
    }

    pub fn with_upstream(config: &PoolConfig, upstream: Arc<Upstream>) -> Pool {
        let listed = listed(config);
        let mut replicas: Vec<Replica> = Vec::new();
        // In the config's order (what `/ready` shows), each once.
        for url in &config.replicas {
            let url = normalize(url);
            if !replicas.iter().any(|r| r.url == url) {
                replicas.push(Replica::new(replicas.len() as ReplicaId, &url, config));
            }
        }
        Pool {
            model: config.model.clone(),
            next_id: replicas.len() as ReplicaId,
            replicas,
            affinity_load_threshold: config.affinity_load_threshold,
            affinity_prefix_bytes: config.affinity_prefix_bytes,
            config: config.clone(),
            upstream,
            retired: false,
            listed,
            discovered: BTreeSet::new(),
        }
    }

    /// Its replica with this id, if it has not left.
    pub fn replica(&self, id: ReplicaId) -> Option<&Replica> {
        self.replicas.iter().find(|r| r.id == id)
    }

    pub fn replica_mut(&mut self, id: ReplicaId) -> Option<&mut Replica> {
        self.replicas.iter_mut().find(|r| r.id == id)
    }

    pub fn fits(&self, kv_need: u64) -> bool {
        self.fits_for(kv_need, 1, Start::Alone)
    }

    /// [`Replica::fits_for`] on some replica where [`prefill_allows`](Self::prefill_allows).
    pub fn fits_for(&self, kv_need: u64, sequences: u64, start: Start) -> bool {
        (self.replicas.iter())
            .any(|r| r.fits_for(kv_need, sequences, start) && self.prefill_allows(r, start))
    }

    /// Whether `r` may take a request starting as `start`. A flood's (or a backlog's) only
    /// while another replica that serves has none of its prompts prefilling, so a quiet
    /// tenant's request finds an engine whose next step is not a flood's long prefill (a
    /// compute-bound engine runs a step of its whole prefill budget for one: tens of ms to
    /// seconds); a flood may add prefills to a replica that has some, and a pool of one
    /// replica has no choice. And a flood's not where a quiet request is being answered
    /// while another replica the rule lets it start on is not: the prefill would stretch
    /// that answer's steps (a short chat's answer would take twice as long).
    pub fn prefill_allows(&self, r: &Replica, start: Start) -> bool {
        let others = |r: &Replica| {
            let id = r.id;
            self.replicas
                .iter()
                .filter(move |o| o.id != id && o.serves())
        };
        let clear_elsewhere =
            |r: &Replica| others(r).next().is_none() || others(r).any(|o| o.prefilling.is_empty());
        let answering = |o: &Replica| !o.answering.is_empty();
        let calmer_elsewhere = || others(r).any(|o| !answering(o) && clear_elsewhere(o));
        !start.floods()
            || (clear_elsewhere(r)
                && (start != Start::Flood || !answering(r) || !calmer_elsewhere()))
    }

    /// Requests the replicas that serve may run at once, together.
    pub fn concurrency(&self) -> u64 {
        self.total(Replica::limit)
    }

    /// KV tokens across the replicas that serve.
    pub fn capacity(&self) -> u64 {
        self.total(|r| r.kv_budget)
    }

    /// A figure summed over the replicas that serve, saturating: the figures come from the
    /// engines (`/props`, `cache_config_info`), and an absurd one must not wrap the total (to a
    /// small share for every tenant) or panic the dispatcher.
    fn total(&self, figure: impl Fn(&Replica) -> u64) -> u64 {
        self.replicas
            .iter()
            .filter(|r| r.serves())
            .map(figure)
            .fold(0, u64::saturating_add)
    }

    /// The replica a tenant's prefix maps to (rendezvous hashing over the replicas that
    /// serve, by URL), so its prompts keep landing where its prefix cache is warm — also as
    /// replicas join and leave: only the prefixes of one that left move.
    pub fn affine(&self, affinity: u64) -> Option<usize> {
        self.replicas
            .iter()
            .enumerate()
            .filter(|(_, r)| r.serves())
            .max_by_key(|(_, r)| {
                let mut h = DefaultHasher::new();
                (affinity, &r.url).hash(&mut h);
                h.finish()
            })
            .map(|(i, _)| i)
    }

    /// The affine replica unless it is over the load threshold or full; then the least
    /// loaded replica that fits.
    pub fn route(&self, affinity: u64, kv_need: u64) -> Option<usize> {
        self.route_for(affinity, kv_need, 1, Start::Alone)
    }

    /// [`route`](Self::route) for a request of `sequences` sequences starting as `start`
    /// ([`Replica::fits_for`], [`prefill_allows`](Self::prefill_allows)): a quiet one goes
    /// where no flood is prefilling, if any replica that fits is so.
    pub fn route_for(
        &self,
        affinity: u64,
        kv_need: u64,
        sequences: u64,
        start: Start,
    ) -> Option<usize> {
        let fits =
            |r: &Replica| r.fits_for(kv_need, sequences, start) && self.prefill_allows(r, start);
        let clear = start == Start::Quiet
            && (self.replicas.iter()).any(|r| fits(r) && r.prefilling.is_empty());
        let takes = |r: &Replica| fits(r) && (!clear || r.prefilling.is_empty());
        if let Some(i) = self.affine(affinity) {
            let r = &self.replicas[i];
            if takes(r) && r.load() < self.affinity_load_threshold {
                return Some(i);
            }
        }
        self.replicas
            .iter()
            .enumerate()
            .filter(|(_, r)| takes(r))
            .min_by(|(_, a), (_, b)| a.load().total_cmp(&b.load()))
            .map(|(i, _)| i)
    }
}

/// The key of tenant-scoped prefix affinity: the tenant and the leading bytes of its prompt.
pub fn affinity_key(tenant: &str, prompt_prefix: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    tenant.hash(&mut h);
    prompt_prefix.hash(&mut h);
    h.finish()
}

/// A replica URL as weir keys it: no surrounding space, no trailing slash.
pub fn normalize(url: &str) -> String {
    url.trim().trim_end_matches('/').to_owned()
}

/// The replicas a pool's config lists.
pub fn listed(config: &PoolConfig) -> BTreeSet<String> {
    config.replicas.iter().map(|u| normalize(u)).collect()
}

/// The URL of a replica found at `addr` (IPv6 in brackets).
pub fn url_of(scheme: Scheme, addr: SocketAddr) -> String {
    format!("{}://{addr}", scheme.name())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::engine::EngineChoice;

    fn pool(n: usize) -> Pool {
        let mut p = Pool::new(&PoolConfig {
            kv_tokens_per_replica: Some(1000),
            affinity_load_threshold: 0.8,
            affinity_prefix_bytes: 64,
            max_concurrency_per_replica: Some(16),
            engine: EngineChoice::Auto,
            ..PoolConfig::listing("m", (0..n).map(|i| format!("http://r{i}")))
        });
        for r in &mut p.replicas {
            r.healthy = true;
            r.isolation = Isolation::Salt;
        }
        p
    }

    #[test]
    fn the_same_tenant_prefix_goes_to_the_same_replica() {
        let p = pool(4);
        let a = affinity_key("t1", b"You are a helpful assistant");
        let b = affinity_key("t2", b"You are a helpful assistant");
        assert_eq!(p.route(a, 10), p.route(a, 10));
        let spread: std::collections::HashSet<_> = (0..64)
            .map(|i| p.affine(affinity_key(&format!("t{i}"), b"same prefix")))
            .collect();
        assert!(spread.len() > 1, "tenants spread over replicas");
        assert!(p.route(b, 10).is_some());
    }

    #[test]
    fn a_loaded_affine_replica_is_passed_over() {
        let mut p = pool(2);
        let key = affinity_key("t", b"prefix");
        let affine = p.affine(key).unwrap();
        p.replicas[affine].reserved = 900;
        p.replicas[affine].in_flight = 3;
        let other = 1 - affine;
        assert_eq!(p.route(key, 50), Some(other), "over the load threshold");
        p.replicas[other].reserved = 990;
        p.replicas[other].in_flight = 9;
        assert_eq!(p.route(key, 50), Some(affine), "the least loaded that fits");
        assert_eq!(p.route(key, 500), None, "nothing fits");
    }

    #[test]
    fn a_flood_s_prefills_keep_off_one_replica_for_the_quiet_tenants() {
        let mut p = pool(2);
        let key = affinity_key("t", b"prompt");
        let affine = p.affine(key).unwrap();
        // A flood's stream prefills on the affine replica: the flood may add more there, not
        // on the other, which stays clear for quiet tenants' requests; they go there.
        p.replicas[affine].prefilling.push(Ticket::for_tests());
        assert_eq!(p.route_for(key, 10, 1, Start::Flood), Some(affine));
        assert!(!p.prefill_allows(&p.replicas[1 - affine], Start::Flood));
        assert_eq!(p.route_for(key, 10, 1, Start::Quiet), Some(1 - affine));
        // Alone in the pool, or under FIFO, a tenant goes where it would.
        assert_eq!(p.route_for(key, 10, 1, Start::Alone), Some(affine));
        // With the other replica full, a quiet request takes the prefilling one; a flood
        // still may not start on the full one, and a pool of one replica has no choice.
        p.replicas[1 - affine].in_flight = 16;
        assert_eq!(p.route_for(key, 10, 1, Start::Quiet), Some(affine));
        let mut one = pool(1);
        one.replicas[0].prefilling.push(Ticket::for_tests());
        assert_eq!(one.route_for(key, 10, 1, Start::Flood), Some(0));
        p.replicas[affine].prefilled(Ticket::for_tests());
        assert!(p.replicas[affine].prefilling.is_empty());
    }

    #[test]
    fn a_flood_s_prompt_keeps_off_a_replica_answering_a_quiet_request() {
        let mut p = pool(2);
        let key = affinity_key("t", b"prompt");
        let affine = p.affine(key).unwrap();
        // A quiet request is being answered on the affine replica and the other is full: the
        // flood's prompt waits for the answer rather than stretch its steps, though it fits
        // there; a quiet request may still go there.
        p.replicas[affine].answering.push((Ticket::for_tests(), 0));
        p.replicas[1 - affine].in_flight = 16;
        assert_eq!(p.route_for(key, 10, 1, Start::Flood), None);
        assert!(!p.fits_for(10, 1, Start::Flood));
        assert!(p.fits_for(10, 1, Start::Quiet));
        // Answered (or waited for a second), the replica takes the flood again.
        p.replicas[affine].unguard_older(QUIET_GUARD_MS - 1);
        assert!(!p.fits_for(10, 1, Start::Flood), "guarded for a second");
        p.replicas[affine].unguard_older(QUIET_GUARD_MS);
        assert_eq!(p.route_for(key, 10, 1, Start::Flood), Some(affine));
        p.replicas[affine].answering.push((Ticket::for_tests(), 0));
        p.replicas[affine].prefilled(Ticket::for_tests());
        assert_eq!(p.route_for(key, 10, 1, Start::Flood), Some(affine));
        // Where every replica answers one, or in a pool of one, there is no choice.
        p.replicas[1 - affine].in_flight = 0;
        for r in &mut p.replicas {
            r.answering.push((Ticket::for_tests(), 0));
        }
        assert!(p.route_for(key, 10, 1, Start::Flood).is_some());
        let mut one = pool(1);
        one.replicas[0].answering.push((Ticket::for_tests(), 0));
        assert_eq!(one.route_for(key, 10, 1, Start::Flood), Some(0));
    }

    #[test]
    fn a_flood_may_add_to_a_prefilling_replica_that_also_answers_a_quiet_request() {
        // The other replica is clear of prefills and answers nothing, but the prefill rule
        // keeps the flood off it: the guard has nowhere else to send it.
        let mut p = pool(2);
        p.replicas[0].prefilling.push(Ticket::for_tests());
        p.replicas[0].answering.push((Ticket::for_tests(), 0));
        assert!(p.fits_for(10, 1, Start::Flood), "no replica takes a flood");
        assert_eq!(p.route_for(0, 10, 1, Start::Flood), Some(0));
        // A backlog within its part is kept to the prefill rule, not by the guard.
        p.replicas[0].prefilling.clear();
        p.replicas[1].in_flight = 16;
        assert_eq!(p.route_for(0, 10, 1, Start::Flood), None);
        assert_eq!(p.route_for(0, 10, 1, Start::Backlog), Some(0));
        p.replicas[1].in_flight = 0;
        p.replicas[1].prefilling.push(Ticket::for_tests());
        assert_eq!(p.route_for(0, 10, 1, Start::Backlog), Some(1));
    }

    #[test]
    fn engines_with_a_queue_of_their_own_get_no_more() {
        let mut p = pool(1);
        assert!(p.fits(10));
        p.replicas[0].engine.waiting = 1;
        assert!(!p.fits(10));
        assert!(
            p.fits_for(10, 1, Start::Quiet),
            "a quiet tenant's request may join the queue"
        );
        p.replicas[0].engine.waiting = 0;
        p.replicas[0].healthy = false;
        assert!(!p.fits(10));
    }

    #[test]
    fn a_replica_whose_cache_is_not_kept_per_tenant_gets_no_work() {
        use crate::isolation::Gap;
        let mut p = pool(2);
        let key = affinity_key("t", b"prefix");
        let affine = p.affine(key).unwrap();
        for mode in [Isolation::Unprobed, Isolation::Unisolated(Gap::SaltIgnored)] {
            p.replicas[affine].isolation = mode;
            assert_eq!(p.route(key, 10), Some(1 - affine), "{mode:?}");
            assert_eq!(p.affine(key), Some(1 - affine), "nor is it affine");
            assert_eq!(p.capacity(), 1000, "nor counted in the pool's KV");
        }
        p.replicas[1 - affine].isolation = Isolation::Unprobed;
        assert!(!p.fits(10), "no replica serves");
        for mode in [Isolation::CacheOff, Isolation::Shared] {
            p.replicas[affine].isolation = mode;
            assert_eq!(p.route(key, 10), Some(affine), "{mode:?}");
        }
    }

    #[test]
    fn a_request_of_several_sequences_takes_a_slot_for_each() {
        let mut p = pool(1);
        p.replicas[0].join(
            EngineLimits {
                max_concurrency: Some(4),
                kv_tokens: None,
            },
            None,
        );
        p.replicas[0].kv_budget = 0;
        assert!(
            p.fits_for(1, 9, Start::Alone),
            "larger than the limit: alone on an idle replica"
        );
        p.replicas[0].in_flight = 2;
        assert!(p.fits_for(1, 2, Start::Alone));
        assert!(!p.fits_for(1, 3, Start::Alone), "two slots left, not three");
        assert_eq!(p.route_for(0, 1, 3, Start::Alone), None);
        assert!(p.fits(1));
    }

    #[test]
    fn a_replica_runs_no_more_than_its_limit_whatever_its_kv_says() {
        let mut p = pool(1);
        p.replicas[0].join(
            EngineLimits {
                max_concurrency: Some(2),
                kv_tokens: None,
            },
            None,
        );
        p.replicas[0].kv_budget = 0;
        assert!(p.fits(100_000), "no KV budget of 0 that blocks forever");
        p.replicas[0].in_flight = 1;
        assert!(p.fits(100_000));
        assert!(p.replicas[0].load() < 1.0);
        p.replicas[0].in_flight = 2;
        assert!(!p.fits(1), "but no more than its concurrency at once");
        assert_eq!(p.replicas[0].load(), 1.0);
        // With KV to spare, the same.
        p.replicas[0].kv_budget = 1_000_000;
        assert!(!p.fits(1));
    }

    #[test]
    fn the_engine_s_limit_replaces_the_configured_one_when_it_joins() {
        let mut p = pool(2);
        p.replicas[0].join(
            EngineLimits {
                max_concurrency: Some(4),
                kv_tokens: None,
            },
            None,
        );
        p.replicas[1].join(EngineLimits::default(), None);
        assert_eq!((p.replicas[0].limit(), p.replicas[1].limit()), (4, 16));
        assert_eq!(p.concurrency(), 20);
        p.replicas[1].healthy = false;
        assert_eq!(p.concurrency(), 4, "serving replicas only");
    }

    #[test]
    fn one_of_two_sidecars_admits_against_half_of_each_replica() {
        let mut p = Pool::new(&PoolConfig {
            kv_tokens_per_replica: Some(1000),
            max_concurrency_per_replica: Some(16),
            sidecars: EngineShare::of(2),
            ..PoolConfig::listing("m", ["http://r0".to_owned()])
        });
        let r = &mut p.replicas[0];
        (r.healthy, r.isolation) = (true, Isolation::Salt);
        assert_eq!(
            (r.kv_budget, r.limit()),
            (500, 8),
            "configured figures, halved"
        );
        r.join(
            EngineLimits {
                max_concurrency: Some(6),
                kv_tokens: None,
            },
            None,
        );
        r.hold_kv(3001);
        assert_eq!(
            (r.kv_budget, r.limit()),
            (1500, 3),
            "the engine's figures, halved"
        );
        r.in_flight = 1;
        r.reserved = 1400;
        assert!(!p.fits(101), "no more KV than its half");
        assert!(p.fits(100));
    }

    #[test]
    fn the_engine_s_dialect_and_the_config_choose_how_the_limit_moves() {
        let limits = EngineLimits {
            max_concurrency: Some(4),
            kv_tokens: None,
        };
        let slow_starts = |r: &mut Replica| {
            for ttfb_ms in [10.0, 1_000.0, 1_000.0, 1_000.0] {
                let t = r.limiter.dispatch();
                r.limiter.first_byte(t, ttfb_ms, 100, 4);
            }
        };
        let config = PoolConfig::listing("m", ["http://r0".to_owned()]);
        // llama.cpp reports its queue: slow starts are its batch's cost.
        let mut r = Replica::new(0, "http://r0", &config);
        r.join(limits, Some(Dialect::Llamacpp));
        slow_starts(&mut r);
        assert_eq!(r.limit(), 4);
        r.limiter.engine_scrape(2, 1);
        r.limiter.engine_scrape(2, 1);
        assert_eq!(r.limit(), 1, "its queue does lower it");
        // `adaptive_concurrency: false`, as a reload sets it: held at the engine's slots.
        r.adaptive = false;
        r.restart_limiter();
        r.limiter.engine_scrape(2, 1);
        r.limiter.engine_scrape(2, 1);
        let t = r.limiter.dispatch();
        r.limiter.timed_out(t);
        assert_eq!(r.limit(), 4);
        // Turned on again: it adapts again.
        r.adaptive = true;
        r.restart_limiter();
        r.limiter.engine_scrape(2, 1);
        r.limiter.engine_scrape(2, 1);
        assert_eq!(r.limit(), 1);
        // An engine weir does not know: TTFB moves it, once goodput is measured.
        let mut r = Replica::new(0, "http://r0", &config);
        r.join(limits, None);
        for i in 0..=64 {
            r.limiter.served(16, 4, i * 10);
        }
        slow_starts(&mut r);
        assert_eq!(r.limit(), 2);
    }

    #[test]
    fn absurd_engine_figures_saturate_the_pool_s_totals() {
        // Engines that claim u64::MAX slots (`/props`) and KV tokens (`cache_config_info`).
        let mut p = pool(2);
        for r in &mut p.replicas {
            r.join(
                EngineLimits {
                    max_concurrency: Some(u64::MAX),
                    kv_tokens: None,
                },
                None,
            );
            r.kv_budget = u64::MAX;
        }
        assert_eq!(p.concurrency(), u64::MAX);
        assert_eq!(p.capacity(), u64::MAX);
    }

    #[test]
    fn urls_of_found_addresses() {
        let v4: SocketAddr = "10.1.2.3:8000".parse().unwrap();
        let v6: SocketAddr = "[fd00::1]:8443".parse().unwrap();
        assert_eq!(url_of(Scheme::Http, v4), "http://10.1.2.3:8000");
        assert_eq!(url_of(Scheme::Https, v6), "https://[fd00::1]:8443");
    }
}
