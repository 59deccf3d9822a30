//! Reserving quota across the hierarchy, and settling it when the request ends.
//!
//! A request is charged at every level on its key's path (org, workspace, project, key): one
//! request, its estimated input tokens, its reserved output tokens and a concurrency slot,
//! wherever a limit is set. The filter charges in two steps: the request and its slot before
//! its headers go upstream ([`reserve`] with no tokens), since from then on it holds a stream
//! there, and its tokens once its body says how many ([`extend`]). Charges are all-or-nothing:
//! if one level refuses, the ones already taken are given back. Each counter is updated with a compare-and-swap loop over the host's
//! shared data, bounded so a hot key can never spin a worker. Concurrency slots are leases
//! ([`crate::lease`]) that the holder renews while the request lives ([`renew`]), so a slot
//! whose release never happened comes back by itself.

use crate::bucket::Bucket;
use crate::config::{Level, Limits, Tenant};
use crate::lease::Leases;

/// Attempts per counter before a reservation gives up as contended.
pub const MAX_CAS_ATTEMPTS: usize = 16;

/// Key-value storage with compare-and-swap, shared by every worker (proxy-wasm shared data).
pub trait SharedStore {
    /// The value and its CAS token, if the key exists.
    fn load(&self, key: &str) -> Option<(Vec<u8>, u32)>;
    /// Writes if the key's CAS token still equals `cas` (`None`: unconditionally).
    fn store(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreError {
    /// Someone else wrote the key since it was read.
    CasMismatch,
    Failed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitKind {
    Requests,
    InputTokens,
    OutputTokens,
    Concurrency,
}

impl LimitKind {
    const ALL: [LimitKind; 4] = [
        LimitKind::Requests,
        LimitKind::InputTokens,
        LimitKind::OutputTokens,
        LimitKind::Concurrency,
    ];

    /// The config name of the limit, also used as the rejection reason.
    pub fn name(self) -> &'static str {
        match self {
            LimitKind::Requests => "requests_per_minute",
            LimitKind::InputTokens => "input_tokens_per_minute",
            LimitKind::OutputTokens => "output_tokens_per_minute",
            LimitKind::Concurrency => "concurrent_requests",
        }
    }

    fn limit(self, limits: &Limits) -> Option<u64> {
        match self {
            LimitKind::Requests => limits.requests_per_minute,
            LimitKind::InputTokens => limits.input_tokens_per_minute,
            LimitKind::OutputTokens => limits.output_tokens_per_minute,
            LimitKind::Concurrency => limits.concurrent_requests,
        }
    }
}

/// Separate counters for enforced and shadow routes, so shadow traffic never spends the
/// budget that enforced traffic is held to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ledger {
    Enforce,
    Shadow,
}

/// What a request asks for, or what it turned out to use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Demand {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// One counter on the request's path.
#[derive(Clone, Debug, PartialEq)]
struct Counter {
    key: String,
    kind: LimitKind,
    limit: u64,
}

/// The lease a request takes on its concurrency slots: a unique id (random, so ids never
/// collide across workers and VMs) and how long the slots outlive a holder that stops renewing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotLease {
    pub id: u64,
    pub ttl_ms: u64,
}

/// Charges held by a request until it settles.
#[derive(Clone, Debug, PartialEq)]
pub struct Reservation {
    held: Vec<Counter>,
    pub demand: Demand,
    pub slot: SlotLease,
    /// Where each limit stood once the reservation was taken.
    pub standing: Vec<Standing>,
}

/// Where one limit on a request's path stands: what the rate-limit headers report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Standing {
    pub kind: LimitKind,
    pub limit: u64,
    pub remaining: u64,
    /// Until the counter is back to its limit (a bucket refilled), or, for a refusal, until the
    /// request would fit; 0 for concurrency slots, which come back when requests end.
    pub reset_ms: u64,
}

impl Standing {
    fn of_bucket(bucket: Bucket, limit: u64) -> Standing {
        let missing = (limit as f64 - bucket.level).max(0.0);
        let per_ms = limit as f64 / 60_000.0;
        Standing {
            kind: LimitKind::InputTokens,
            limit,
            remaining: bucket.level.max(0.0) as u64,
            reset_ms: if per_ms > 0.0 {
                (missing / per_ms).ceil() as u64
            } else {
                0
            },
        }
    }
}

/// Why a reservation was refused.
#[derive(Clone, Debug, PartialEq)]
pub enum Denial {
    /// A limit at `level` (a tenant path prefix) has no room.
    Limit {
        level: String,
        kind: LimitKind,
        limit: u64,
        remaining: u64,
        retry_after_ms: u64,
    },
    /// A counter kept changing under us; retrying shortly will do.
    Contended,
}

fn counter_key(ledger: Ledger, level: &Level, kind: LimitKind) -> String {
    let ns = match ledger {
        Ledger::Enforce => "e",
        Ledger::Shadow => "s",
    };
    let suffix = match kind {
        LimitKind::Requests => "rpm",
        LimitKind::InputTokens => "itpm",
        LimitKind::OutputTokens => "otpm",
        LimitKind::Concurrency => "conc",
    };
    format!("weir:{ns}:{}:{suffix}", level.path)
}

fn counters(tenant: &Tenant, ledger: Ledger) -> impl Iterator<Item = Counter> + '_ {
    tenant.levels.iter().flat_map(move |level| {
        LimitKind::ALL.into_iter().filter_map(move |kind| {
            kind.limit(&level.limits).map(|limit| Counter {
                key: counter_key(ledger, level, kind),
                kind,
                limit,
            })
        })
    })
}

/// Creates the counters of every level that has none yet (full buckets, empty slots), so that
/// every later update is a compare-and-swap on an existing key.
pub fn initialize<'a>(
    store: &impl SharedStore,
    tenants: impl IntoIterator<Item = &'a Tenant>,
    now_ms: u64,
) {
    for tenant in tenants {
        for ledger in [Ledger::Enforce, Ledger::Shadow] {
            for c in counters(tenant, ledger) {
                if store.load(&c.key).is_none() {
                    let _ = store.store(&c.key, &initial(&c, now_ms), None);
                }
            }
        }
    }
}

fn initial(c: &Counter, now_ms: u64) -> Vec<u8> {
    match c.kind {
        LimitKind::Concurrency => Leases::default().encode(),
        _ => Bucket::full(c.limit, now_ms).encode().to_vec(),
    }
}

/// Outcome of one compare-and-swap update.
pub(crate) enum Update<T, D = ()> {
    Done(D),
    Refused(T),
    Contended,
}

/// Reads, transforms and conditionally writes one key, retrying on CAS conflicts.
pub(crate) fn update<T>(
    store: &impl SharedStore,
    key: &str,
    mut f: impl FnMut(Option<&[u8]>) -> Result<Vec<u8>, T>,
) -> Update<T> {
    for _ in 0..MAX_CAS_ATTEMPTS {
        let current = store.load(key);
        let next = match f(current.as_ref().map(|(v, _)| v.as_slice())) {
            Ok(next) => next,
            Err(refusal) => return Update::Refused(refusal),
        };
        match store.store(key, &next, current.map(|(_, cas)| cas)) {
            Ok(()) => return Update::Done(()),
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Failed) => return Update::Contended,
        }
    }
    Update::Contended
}

impl Counter {
    fn amount(&self, demand: Demand) -> u64 {
        match self.kind {
            LimitKind::Requests | LimitKind::Concurrency => 1,
            LimitKind::InputTokens => demand.input_tokens,
            LimitKind::OutputTokens => demand.output_tokens,
        }
    }

    fn leases(current: Option<&[u8]>, now_ms: u64, slot: SlotLease) -> Leases {
        current
            .and_then(|v| Leases::decode(v, now_ms, slot.ttl_ms))
            .unwrap_or_default()
    }

    /// Where the counter stands in the state `current` (see [`Standing`]).
    fn standing(&self, current: Option<&[u8]>, slot: SlotLease, now_ms: u64) -> Standing {
        let standing = match self.kind {
            LimitKind::Concurrency => {
                let held = Self::leases(current, now_ms, slot).held(now_ms) as u64;
                Standing {
                    kind: self.kind,
                    limit: self.limit,
                    remaining: self.limit.saturating_sub(held),
                    reset_ms: 0,
                }
            }
            _ => Standing::of_bucket(
                current
                    .and_then(Bucket::decode)
                    .unwrap_or_else(|| Bucket::full(self.limit, now_ms))
                    .refilled(self.limit, now_ms),
                self.limit,
            ),
        };
        Standing {
            kind: self.kind,
            ..standing
        }
    }

    /// Takes this counter's share of `demand` (and says where the counter then stands), or
    /// reports the shortfall.
    fn take(
        &self,
        store: &impl SharedStore,
        demand: Demand,
        slot: SlotLease,
        now_ms: u64,
    ) -> Update<Denial, Standing> {
        let amount = self.amount(demand);
        let mut taken = None;
        let outcome = update(store, &self.key, |current| {
            let next = match self.kind {
                LimitKind::Concurrency => Self::leases(current, now_ms, slot)
                    .acquire(slot.id, self.limit, now_ms, slot.ttl_ms)
                    .map(|l| l.encode())
                    .map_err(|_| (0, 1_000)),
                _ => {
                    let bucket = current
                        .and_then(Bucket::decode)
                        .unwrap_or_else(|| Bucket::full(self.limit, now_ms));
                    bucket
                        .take(self.limit, amount, now_ms)
                        .map(|b| b.encode().to_vec())
                        .map_err(|s| (s.remaining, s.retry_after_ms))
                }
            };
            if let Ok(next) = &next {
                taken = Some(self.standing(Some(next), slot, now_ms));
            }
            next
        })
        .map_refusal(|(remaining, retry_after_ms)| Denial::Limit {
            level: level_of(&self.key),
            kind: self.kind,
            limit: self.limit,
            remaining,
            retry_after_ms,
        });
        match (outcome, taken) {
            (Update::Done(()), Some(standing)) => Update::Done(standing),
            (Update::Done(()), None) => Update::Contended,
            (Update::Refused(d), _) => Update::Refused(d),
            (Update::Contended, _) => Update::Contended,
        }
    }

    /// Gives back `refund` tokens (negative: charges more) or releases the slot.
    fn give_back(
        &self,
        store: &impl SharedStore,
        refund: f64,
        slot: SlotLease,
        now_ms: u64,
    ) -> bool {
        let result = update::<()>(store, &self.key, |current| {
            Ok(match self.kind {
                LimitKind::Concurrency => Self::leases(current, now_ms, slot)
                    .release(slot.id, now_ms)
                    .encode(),
                _ => current
                    .and_then(Bucket::decode)
                    .unwrap_or_else(|| Bucket::full(self.limit, now_ms))
                    .adjust(self.limit, refund, now_ms)
                    .encode()
                    .to_vec(),
            })
        });
        matches!(result, Update::Done(()))
    }
}

impl<T> Update<T> {
    fn map_refusal<U>(self, f: impl FnOnce(T) -> U) -> Update<U> {
        match self {
            Update::Done(()) => Update::Done(()),
            Update::Refused(t) => Update::Refused(f(t)),
            Update::Contended => Update::Contended,
        }
    }
}

/// The tenant path a counter key belongs to (`weir:e:acme/team:rpm` → `acme/team`).
fn level_of(key: &str) -> String {
    let inner = key.splitn(3, ':').nth(2).unwrap_or(key);
    inner
        .rsplit_once(':')
        .map_or(inner, |(path, _)| path)
        .to_owned()
}

/// Charges `demand` at every level of the tenant's path, all or nothing; concurrency slots are
/// taken under `slot`.
pub fn reserve(
    store: &impl SharedStore,
    tenant: &Tenant,
    demand: Demand,
    ledger: Ledger,
    slot: SlotLease,
    now_ms: u64,
) -> Result<Reservation, Denial> {
    let mut taken = Reservation {
        held: Vec::new(),
        demand,
        slot,
        standing: Vec::new(),
    };
    for counter in counters(tenant, ledger) {
        let denial = match counter.take(store, demand, slot, now_ms) {
            Update::Done(standing) => {
                taken.held.push(counter);
                taken.standing.push(standing);
                continue;
            }
            Update::Refused(denial) => denial,
            Update::Contended => Denial::Contended,
        };
        release(store, &taken, Demand::default(), now_ms, true);
        return Err(denial);
    }
    Ok(taken)
}

/// Adds the tokens of `more` to `reservation` at every level on its path (a request charged
/// before its body was read), all or nothing: on a refusal the reservation stands as it was,
/// and the caller gives it back with [`cancel`].
pub fn extend(
    store: &impl SharedStore,
    reservation: &mut Reservation,
    more: Demand,
    now_ms: u64,
) -> Result<(), Denial> {
    let slot = reservation.slot;
    let mut taken: Vec<(usize, Standing)> = Vec::new();
    for (i, counter) in reservation.held.iter().enumerate() {
        if !matches!(
            counter.kind,
            LimitKind::InputTokens | LimitKind::OutputTokens
        ) {
            continue;
        }
        let denial = match counter.take(store, more, slot, now_ms) {
            Update::Done(standing) => {
                taken.push((i, standing));
                continue;
            }
            Update::Refused(denial) => denial,
            Update::Contended => Denial::Contended,
        };
        for &(j, _) in &taken {
            let c = &reservation.held[j];
            c.give_back(store, c.amount(more) as f64, slot, now_ms);
        }
        return Err(denial);
    }
    for (i, standing) in taken {
        reservation.standing[i] = standing;
    }
    let demand = &mut reservation.demand;
    demand.input_tokens = demand.input_tokens.saturating_add(more.input_tokens);
    demand.output_tokens = demand.output_tokens.saturating_add(more.output_tokens);
    Ok(())
}

/// Gives a reservation back whole, its request included: for a request refused after it was
/// charged (a body that cannot be admitted, or whose tokens do not fit). Returns how many
/// counters could not be updated.
pub fn cancel(store: &impl SharedStore, reservation: &Reservation, now_ms: u64) -> usize {
    release(store, reservation, Demand::default(), now_ms, true)
}

/// Where every limit on the tenant's path stands, read without taking anything (for answers
/// that are not metered, such as the model list).
pub fn standing(
    store: &impl SharedStore,
    tenant: &Tenant,
    ledger: Ledger,
    now_ms: u64,
) -> Vec<Standing> {
    // A count written before leases is read as slots held for good: never under-reported.
    let slot = SlotLease {
        id: 0,
        ttl_ms: u64::MAX,
    };
    counters(tenant, ledger)
        .map(|c| {
            let current = store.load(&c.key);
            c.standing(current.as_ref().map(|(v, _)| v.as_slice()), slot, now_ms)
        })
        .collect()
}

/// Extends the reservation's slot leases; the holder calls it well within the lease's time to
/// live for as long as the request runs. Returns how many counters could not be updated.
pub fn renew(store: &impl SharedStore, reservation: &Reservation, now_ms: u64) -> usize {
    let slot = reservation.slot;
    reservation
        .held
        .iter()
        .filter(|c| c.kind == LimitKind::Concurrency)
        .filter(|c| {
            let renewed = update::<()>(store, &c.key, |current| {
                Ok(Counter::leases(current, now_ms, slot)
                    .renew(slot.id, c.limit, now_ms, slot.ttl_ms)
                    .encode())
            });
            !matches!(renewed, Update::Done(()))
        })
        .count()
}

/// Replaces the reservation with what the request actually used: unused tokens go back,
/// overruns are charged, the concurrency slot is released. Returns how many counters could
/// not be updated (contention past the retry bound).
pub fn settle(
    store: &impl SharedStore,
    reservation: &Reservation,
    actual: Demand,
    now_ms: u64,
) -> usize {
    release(store, reservation, actual, now_ms, false)
}

fn release(
    store: &impl SharedStore,
    reservation: &Reservation,
    actual: Demand,
    now_ms: u64,
    rollback: bool,
) -> usize {
    let reserved = reservation.demand;
    reservation
        .held
        .iter()
        .filter(|c| {
            let refund = match c.kind {
                LimitKind::Requests if rollback => 1.0,
                LimitKind::Requests => return false,
                LimitKind::Concurrency => 0.0,
                LimitKind::InputTokens => reserved.input_tokens as f64 - actual.input_tokens as f64,
                LimitKind::OutputTokens => {
                    reserved.output_tokens as f64 - actual.output_tokens as f64
                }
            };
            !c.give_back(store, refund, reservation.slot, now_ms)
        })
        .count()
}

#[cfg(test)]
pub(crate) mod tests {
    use std::cell::{Cell, RefCell};
    use std::collections::HashMap;

    use super::*;
    use crate::config::Config;

    /// Shared data as Envoy keeps it, with optional injected CAS conflicts.
    #[derive(Default)]
    pub(crate) struct Memory {
        data: RefCell<HashMap<String, (Vec<u8>, u32)>>,
        pub(crate) conflicts: Cell<usize>,
    }

    impl SharedStore for Memory {
        fn load(&self, key: &str) -> Option<(Vec<u8>, u32)> {
            self.data.borrow().get(key).cloned()
        }

        fn store(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
            if self.conflicts.get() > 0 {
                self.conflicts.set(self.conflicts.get() - 1);
                return Err(StoreError::CasMismatch);
            }
            let mut data = self.data.borrow_mut();
            let current = data.get(key).map(|(_, c)| *c);
            if cas.is_some() && cas != current {
                return Err(StoreError::CasMismatch);
            }
            data.insert(key.to_owned(), (value.to_vec(), current.unwrap_or(0) + 1));
            Ok(())
        }
    }

    impl Memory {
        fn level(&self, key: &str) -> f64 {
            Bucket::decode(&self.data.borrow()[key].0).unwrap().level
        }

        fn count(&self, key: &str) -> usize {
            Leases::decode(&self.data.borrow()[key].0, 0, TTL)
                .unwrap()
                .held(0)
        }
    }

    fn tenant(org: &str, key: &str) -> Tenant {
        let json = format!(
            r#"{{"orgs":[{{"id":"acme","limits":{org},"workspaces":[{{"id":"w","projects":[
                {{"id":"p","keys":[{{"id":"k","sha256":"{h}","limits":{key}}}]}}]}}]}}]}}"#,
            h = "a".repeat(64)
        );
        let config = Config::parse(json.as_bytes()).unwrap();
        config
            .directory()
            .lookup(&"a".repeat(64))
            .unwrap()
            .as_ref()
            .clone()
    }

    const TTL: u64 = 30_000;

    /// A fresh lease for each reservation, as the filter draws random ids.
    fn slot() -> SlotLease {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        SlotLease {
            id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            ttl_ms: TTL,
        }
    }

    const IN_100: Demand = Demand {
        input_tokens: 100,
        output_tokens: 50,
    };

    #[test]
    fn charges_every_level_and_settles_the_difference() {
        let t = tenant(
            r#"{"input_tokens_per_minute":1000,"output_tokens_per_minute":500}"#,
            r#"{"concurrent_requests":2,"requests_per_minute":10}"#,
        );
        let store = Memory::default();
        initialize(&store, [&t], 0);
        let r = reserve(&store, &t, IN_100, Ledger::Enforce, slot(), 0).unwrap();
        assert_eq!(store.level("weir:e:acme:itpm"), 900.0);
        assert_eq!(store.level("weir:e:acme:otpm"), 450.0);
        assert_eq!(store.count("weir:e:acme/w/p/k:conc"), 1);
        assert_eq!(store.level("weir:e:acme/w/p/k:rpm"), 9.0);

        let actual = Demand {
            input_tokens: 120,
            output_tokens: 10,
        };
        assert_eq!(settle(&store, &r, actual, 0), 0);
        assert_eq!(
            store.level("weir:e:acme:itpm"),
            880.0,
            "input overrun charged"
        );
        assert_eq!(
            store.level("weir:e:acme:otpm"),
            490.0,
            "unused output refunded"
        );
        assert_eq!(store.count("weir:e:acme/w/p/k:conc"), 0);
        assert_eq!(
            store.level("weir:e:acme/w/p/k:rpm"),
            9.0,
            "a request stays counted"
        );
    }

    #[test]
    fn a_refusal_anywhere_rolls_back_everything() {
        let t = tenant(
            r#"{"input_tokens_per_minute":1000}"#,
            r#"{"output_tokens_per_minute":40}"#,
        );
        let store = Memory::default();
        initialize(&store, [&t], 0);
        let small = Demand {
            input_tokens: 10,
            output_tokens: 10,
        };
        reserve(&store, &t, small, Ledger::Enforce, slot(), 0).unwrap();
        let denial = reserve(&store, &t, IN_100, Ledger::Enforce, slot(), 0).unwrap_err();
        match denial {
            Denial::Limit {
                level,
                kind,
                limit,
                retry_after_ms,
                ..
            } => {
                assert_eq!(level, "acme/w/p/k");
                assert_eq!(kind, LimitKind::OutputTokens);
                assert_eq!(limit, 40);
                // Over the whole bucket: it waits until the bucket is full again (10 at 40/min).
                assert_eq!(retry_after_ms, 15_000);
            }
            Denial::Contended => panic!("not contended"),
        }
        // The org's input tokens taken by the refused request were given back.
        assert_eq!(store.level("weir:e:acme:itpm"), 990.0);
    }

    #[test]
    fn concurrency_slots_are_bounded_and_released() {
        let t = tenant("{}", r#"{"concurrent_requests":2}"#);
        let store = Memory::default();
        let a = reserve(&store, &t, IN_100, Ledger::Enforce, slot(), 0).unwrap();
        let _b = reserve(&store, &t, IN_100, Ledger::Enforce, slot(), 0).unwrap();
        assert!(reserve(&store, &t, IN_100, Ledger::Enforce, slot(), 0).is_err());
        settle(&store, &a, IN_100, 0);
        assert!(reserve(&store, &t, IN_100, Ledger::Enforce, slot(), 0).is_ok());
    }

    #[test]
    fn a_slot_that_is_never_released_comes_back_when_its_lease_lapses() {
        let t = tenant("{}", r#"{"concurrent_requests":1}"#);
        let store = Memory::default();
        initialize(&store, [&t], 0);
        let live = reserve(&store, &t, IN_100, Ledger::Enforce, slot(), 0).unwrap();
        // The holder keeps renewing: the slot stays taken past the first expiry.
        assert_eq!(renew(&store, &live, TTL / 2), 0);
        assert!(reserve(&store, &t, IN_100, Ledger::Enforce, slot(), TTL + 1).is_err());
        // Then its VM dies: no settle, no renewal. The lease lapses and the slot heals.
        let lapsed = TTL / 2 + TTL;
        assert!(reserve(&store, &t, IN_100, Ledger::Enforce, slot(), lapsed - 1).is_err());
        let next = reserve(&store, &t, IN_100, Ledger::Enforce, slot(), lapsed + 1).unwrap();
        assert_eq!(store.count("weir:e:acme/w/p/k:conc"), 1);
        // A settle that loses every CAS race leaks nothing either: the lease just lapses.
        store.conflicts.set(MAX_CAS_ATTEMPTS);
        assert_eq!(settle(&store, &next, IN_100, lapsed + 2), 1);
        assert!(reserve(&store, &t, IN_100, Ledger::Enforce, slot(), lapsed + 2).is_err());
        assert!(
            reserve(
                &store,
                &t,
                IN_100,
                Ledger::Enforce,
                slot(),
                lapsed + 2 + TTL
            )
            .is_ok()
        );
    }

    #[test]
    fn shadow_counters_are_separate() {
        let t = tenant("{}", r#"{"requests_per_minute":1}"#);
        let store = Memory::default();
        assert!(reserve(&store, &t, IN_100, Ledger::Shadow, slot(), 0).is_ok());
        assert!(reserve(&store, &t, IN_100, Ledger::Shadow, slot(), 0).is_err());
        assert!(reserve(&store, &t, IN_100, Ledger::Enforce, slot(), 0).is_ok());
    }

    #[test]
    fn cas_conflicts_are_retried_then_reported() {
        let t = tenant("{}", r#"{"requests_per_minute":10}"#);
        let store = Memory::default();
        initialize(&store, [&t], 0);
        store.conflicts.set(MAX_CAS_ATTEMPTS - 1);
        assert!(reserve(&store, &t, IN_100, Ledger::Enforce, slot(), 0).is_ok());
        store.conflicts.set(MAX_CAS_ATTEMPTS);
        assert_eq!(
            reserve(&store, &t, IN_100, Ledger::Enforce, slot(), 0),
            Err(Denial::Contended)
        );
        assert_eq!(store.level("weir:e:acme/w/p/k:rpm"), 9.0);
    }

    #[test]
    fn a_request_charged_before_its_body_holds_its_slot_then_takes_its_tokens_or_nothing() {
        let t = tenant(
            r#"{"input_tokens_per_minute":1000}"#,
            r#"{"concurrent_requests":1,"requests_per_minute":10,"output_tokens_per_minute":80}"#,
        );
        let store = Memory::default();
        initialize(&store, [&t], 0);
        // Headers: the request and its slot, no tokens yet.
        let mut r = reserve(&store, &t, Demand::default(), Ledger::Enforce, slot(), 0).unwrap();
        assert_eq!(store.count("weir:e:acme/w/p/k:conc"), 1);
        assert_eq!(store.level("weir:e:acme/w/p/k:rpm"), 9.0);
        assert_eq!(store.level("weir:e:acme:itpm"), 1000.0);
        assert!(
            reserve(&store, &t, Demand::default(), Ledger::Enforce, slot(), 0).is_err(),
            "a second request waiting for its body is over the concurrency limit"
        );
        // Body: its tokens at every level.
        extend(&store, &mut r, IN_100, 0).unwrap();
        assert_eq!(r.demand, IN_100);
        assert_eq!(store.level("weir:e:acme:itpm"), 900.0);
        assert_eq!(store.level("weir:e:acme/w/p/k:otpm"), 30.0);
        let output = r
            .standing
            .iter()
            .find(|s| s.kind == LimitKind::OutputTokens);
        assert_eq!(
            output.map(|s| s.remaining),
            Some(30),
            "the answer's standing"
        );
        // Tokens that do not fit are taken nowhere, and the reservation stays as it was.
        let before = r.clone();
        assert!(matches!(
            extend(&store, &mut r, IN_100, 0),
            Err(Denial::Limit {
                kind: LimitKind::OutputTokens,
                ..
            })
        ));
        assert_eq!(r, before);
        assert_eq!(store.level("weir:e:acme:itpm"), 900.0, "rolled back");
        // Cancelled: everything back, the request too, and the slot free.
        assert_eq!(cancel(&store, &r, 0), 0);
        assert_eq!(store.level("weir:e:acme:itpm"), 1000.0);
        assert_eq!(store.level("weir:e:acme/w/p/k:otpm"), 80.0);
        assert_eq!(store.level("weir:e:acme/w/p/k:rpm"), 10.0);
        assert_eq!(store.count("weir:e:acme/w/p/k:conc"), 0);
    }

    #[test]
    fn retry_after_is_when_the_bucket_refills() {
        let t = tenant("{}", r#"{"input_tokens_per_minute":600}"#);
        let store = Memory::default();
        let big = Demand {
            input_tokens: 500,
            output_tokens: 0,
        };
        reserve(&store, &t, big, Ledger::Enforce, slot(), 0).unwrap();
        let Err(Denial::Limit { retry_after_ms, .. }) =
            reserve(&store, &t, big, Ledger::Enforce, slot(), 0)
        else {
            panic!("expected a limit")
        };
        assert_eq!(retry_after_ms, 40_000, "400 more tokens at 10/s");
        assert!(reserve(&store, &t, big, Ledger::Enforce, slot(), 40_000).is_ok());
    }
}
