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
//! whose release never happened comes back by itself. A limit marked fleet-wide is charged to
//! this Envoy's lease of the fleet's budget instead of a local bucket ([`crate::allowance`]);
//! everything else (all-or-nothing, rollback, settle, extend) is the same for it.

use crate::active_set;
use crate::allowance::{self, Allowance, Shortage, Source};
use crate::bucket::Bucket;
use crate::config::{Level, Limits, Oversize, Tenant};
use crate::fleet::Window;
use crate::fleet_config::BudgetConfig;
use crate::fleet_config::{FailMode, LeaseTerms, Measure};
use crate::lease::Leases;
use crate::store::{SharedStore, Update, update};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitKind {
    Requests,
    InputTokens,
    OutputTokens,
    Concurrency,
    /// Calls that repeat one already sent ([`crate::retry`]): charged by retries alone
    /// ([`charge_retry`]), never by a first attempt, so it is not among [`LimitKind::ALL`].
    Retries,
    /// A long-window budget (`limits.budgets`), always fleet-wide.
    Budget(Measure),
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
            LimitKind::Retries => "retries_per_minute",
            LimitKind::Budget(_) => "budget",
        }
    }

    fn limit(self, limits: &Limits) -> Option<u64> {
        match self {
            LimitKind::Budget(_) => None,
            LimitKind::Requests => limits.requests_per_minute,
            LimitKind::InputTokens => limits.input_tokens_per_minute,
            LimitKind::OutputTokens => limits.output_tokens_per_minute,
            LimitKind::Concurrency => limits.concurrent_requests,
            LimitKind::Retries => limits.retries_per_minute,
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
    /// What the tokens cost at the request's price, in micro-units (0 without a price).
    pub cost_micros: u64,
}

impl Demand {
    /// The amount a budget of `measure` counts.
    fn of(&self, measure: Measure) -> u64 {
        match measure {
            Measure::InputTokens => self.input_tokens,
            Measure::OutputTokens => self.output_tokens,
            Measure::Tokens => self.input_tokens.saturating_add(self.output_tokens),
            Measure::Spend => self.cost_micros,
        }
    }
}

/// A counter's source before any take (a local bucket's for good: it has no lease).
const NO_LEASE: Source = Source::Lease { window_start_ms: 0 };

/// One counter on the request's path.
#[derive(Clone, Debug, PartialEq)]
struct Counter {
    key: String,
    kind: LimitKind,
    limit: u64,
    /// Set for a fleet-wide counter: its state is a lease, not a bucket.
    fleet: Option<Fleet>,
    /// What a request larger than the whole limit gets (input tokens per minute only).
    oversize: Oversize,
    /// For a held fleet-wide counter: where its tokens came from, so that settling gives them
    /// back there (share if any take of the request was served from it).
    source: Source,
}

/// How a fleet-wide counter is leased.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fleet {
    pub window: Window,
    pub fail: FailMode,
    pub terms: LeaseTerms,
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
    /// A fleet-wide limit has no lease on this Envoy (none granted yet, or lapsed while the
    /// tenant was idle), though the store may hold the tokens: the caller asks for a lease at
    /// once and tries again ([`crate::renewal::plan_for`]); if it still cannot, the answer is
    /// the limit's, as for [`Denial::Limit`].
    Unleased {
        level: String,
        kind: LimitKind,
        limit: u64,
        /// The store's last word (0 before any).
        remaining: u64,
        retry_after_ms: u64,
    },
    /// A fleet-wide limit's lease is spent, the store is unreachable and the limit fails
    /// closed.
    QuotaUnavailable {
        level: String,
        kind: LimitKind,
        retry_after_ms: u64,
    },
    /// One request asks more than a whole per-minute limit holds ([`Oversize::Refuse`]): it
    /// never fits.
    TooLarge {
        level: String,
        kind: LimitKind,
        limit: u64,
        requested: u64,
    },
    /// A long-window budget is spent for its window.
    BudgetExceeded {
        level: String,
        window: Window,
        measure: Measure,
        limit: u64,
        resets_ms: u64,
    },
    /// A counter kept changing under us; retrying shortly will do.
    Contended,
}

/// The counter's shared-data key, also its name at the quota service for a fleet-wide one
/// (whose value is then a lease, [`Allowance`], rather than a bucket).
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
        LimitKind::Retries => "retries",
        LimitKind::Budget(_) => "budget",
    };
    format!("weir:{ns}:{}:{suffix}", level.path)
}

/// A budget's counter (`weir:e:acme:month:spend`): one per window and measure at a level.
fn budget_counter(level: &Level, budget: &BudgetConfig, terms: LeaseTerms) -> Option<Counter> {
    let (measure, limit) = budget.measure().ok()?;
    Some(Counter {
        key: format!(
            "weir:e:{}:{}:{}",
            level.path,
            budget.window.name(),
            measure.name()
        ),
        kind: LimitKind::Budget(measure),
        limit,
        fleet: Some(Fleet {
            window: budget.window,
            fail: budget.on_store_down,
            terms,
        }),
        // A budget is no per-minute limit: the first request past it ends it for the window.
        oversize: Oversize::Debt,
        source: NO_LEASE,
    })
}

fn counters(tenant: &Tenant, ledger: Ledger) -> impl Iterator<Item = Counter> + '_ {
    tenant.levels.iter().flat_map(move |level| {
        LimitKind::ALL
            .into_iter()
            .filter_map(move |kind| {
                // Shadow traffic never rejects: it is counted locally, never leased.
                let fleet = match (ledger, tenant.lease_terms) {
                    (Ledger::Enforce, Some(terms)) => {
                        level.limits.fleet_wide.get(kind.name()).map(|&fail| Fleet {
                            window: Window::Minute,
                            fail,
                            terms,
                        })
                    }
                    _ => None,
                };
                per_minute_counter(ledger, level, kind, fleet)
            })
            .chain(
                // Budgets live in the store: enforced traffic only, and only with a fleet section.
                level
                    .limits
                    .budgets
                    .iter()
                    .filter(move |_| ledger == Ledger::Enforce)
                    .filter_map(move |b| budget_counter(level, b, tenant.lease_terms?)),
            )
    })
}

/// The counter of a per-minute limit `kind` at `level`, if the level sets it.
fn per_minute_counter(
    ledger: Ledger,
    level: &Level,
    kind: LimitKind,
    fleet: Option<Fleet>,
) -> Option<Counter> {
    kind.limit(&level.limits).map(|limit| Counter {
        key: counter_key(ledger, level, kind),
        kind,
        limit,
        fleet,
        oversize: level.limits.oversize,
        source: NO_LEASE,
    })
}

/// The retries buckets on the tenant's path (`limits.retries_per_minute`), always local to
/// this Envoy.
fn retry_counters(tenant: &Tenant, ledger: Ledger) -> impl Iterator<Item = Counter> + '_ {
    (tenant.levels.iter())
        .filter_map(move |l| per_minute_counter(ledger, l, LimitKind::Retries, None))
}

/// The fleet-wide counters of a tenant: their keys (the same on every Envoy), limits and
/// leasing, for the renewal to know what it asks for.
pub fn fleet_counters(tenant: &Tenant) -> impl Iterator<Item = (String, u64, Fleet)> + '_ {
    counters(tenant, Ledger::Enforce).filter_map(|c| c.fleet.map(|f| (c.key, c.limit, f)))
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
            for c in counters(tenant, ledger).chain(retry_counters(tenant, ledger)) {
                if store.load(&c.key).is_none() {
                    let _ = store.store(&c.key, &initial(&c, now_ms), None);
                }
            }
        }
    }
}

fn initial(c: &Counter, now_ms: u64) -> Vec<u8> {
    match (c.kind, c.fleet) {
        (LimitKind::Concurrency, _) => Leases::default().encode(),
        (_, Some(fleet)) => Allowance::cold(&c.lease_context(fleet, false), now_ms).encode(),
        _ => Bucket::full(c.limit, now_ms).encode().to_vec(),
    }
}

impl Counter {
    fn amount(&self, demand: Demand) -> u64 {
        match self.kind {
            LimitKind::Requests | LimitKind::Concurrency | LimitKind::Retries => 1,
            LimitKind::InputTokens => demand.input_tokens,
            LimitKind::OutputTokens => demand.output_tokens,
            LimitKind::Budget(measure) => demand.of(measure),
        }
    }

    fn leases(current: Option<&[u8]>, now_ms: u64, slot: SlotLease) -> Leases {
        current
            .and_then(|v| Leases::decode(v, now_ms, slot.ttl_ms))
            .unwrap_or_default()
    }

    fn lease_context(&self, fleet: Fleet, store_down: bool) -> allowance::Context {
        allowance::Context {
            limit: self.limit,
            window: fleet.window,
            fail: fleet.fail,
            terms: fleet.terms,
            store_down,
        }
    }

    fn allowance(&self, current: Option<&[u8]>, fleet: Fleet, now_ms: u64) -> Allowance {
        current
            .and_then(Allowance::decode)
            .unwrap_or_else(|| Allowance::cold(&self.lease_context(fleet, false), now_ms))
    }

    /// Where the counter stands in the state `current` (see [`Standing`]).
    fn standing(&self, current: Option<&[u8]>, slot: SlotLease, now_ms: u64) -> Standing {
        if let Some(fleet) = self.fleet {
            // The fleet's figures as the last grant told them, plus what this Envoy holds.
            let a = self.allowance(current, fleet, now_ms);
            let held = a.usable(fleet.window, now_ms).max(0.0) as u64;
            return Standing {
                kind: self.kind,
                limit: self.limit,
                remaining: a.remaining.saturating_add(held).min(self.limit),
                reset_ms: a.resets_ms.saturating_sub(now_ms),
            };
        }
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

    /// Takes this counter's share of `demand` (and says where the counter then stands, and
    /// where a fleet-wide one was served from), or reports the shortfall.
    fn take(
        &self,
        store: &impl SharedStore,
        demand: Demand,
        slot: SlotLease,
        now_ms: u64,
    ) -> Update<Denial, (Standing, Source)> {
        let amount = self.amount(demand);
        if self.kind == LimitKind::InputTokens
            && self.oversize == Oversize::Refuse
            && amount > self.limit
        {
            return Update::Refused(Denial::TooLarge {
                level: level_of(&self.key),
                kind: self.kind,
                limit: self.limit,
                requested: amount,
            });
        }
        if let Some(fleet) = self.fleet {
            return self.take_leased(store, fleet, amount, slot, now_ms);
        }
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
            (Update::Done(()), Some(standing)) => Update::Done((standing, NO_LEASE)),
            (Update::Done(()), None) => Update::Contended,
            (Update::Refused(d), _) => Update::Refused(d),
            (Update::Contended, _) => Update::Contended,
        }
    }

    /// [`Self::take`] for a fleet-wide counter: from this Envoy's lease. A shortfall is marked
    /// on the lease, and the counter listed for renewal, so the next renewal asks for it.
    fn take_leased(
        &self,
        store: &impl SharedStore,
        fleet: Fleet,
        amount: u64,
        slot: SlotLease,
        now_ms: u64,
    ) -> Update<Denial, (Standing, Source)> {
        let health = store.load(allowance::HEALTH_KEY);
        let ctx = self.lease_context(
            fleet,
            allowance::store_down(health.as_ref().map(|(v, _)| v.as_slice())),
        );
        let mut taken = None;
        let mut enlist = false;
        let outcome = update(store, &self.key, |current| {
            let lease = self.allowance(current, fleet, now_ms);
            let (mut next, source) = match lease.take(amount, &ctx, now_ms) {
                // A request's count the lease lacks while the store may hold it: owed (within
                // a bound), so its headers go on holding its slot, and the ask its body sends
                // repays it.
                Err(short @ Shortage::Unleased { .. }) if self.kind == LimitKind::Requests => {
                    (lease.owe(amount, &ctx).ok_or(short)?, lease.lease_source())
                }
                taken => taken?,
            };
            enlist = !next.listed;
            next.listed = true;
            let encoded = next.encode();
            taken = Some((self.standing(Some(&encoded), slot, now_ms), source));
            Ok(encoded)
        });
        let outcome = match outcome {
            Update::Refused(shortage) => {
                let _ = update::<()>(store, &self.key, |current| {
                    let mut next = self
                        .allowance(current, fleet, now_ms)
                        .want(amount, self.limit);
                    enlist = !next.listed;
                    next.listed = true;
                    Ok(next.encode())
                });
                Update::Refused(self.denial(shortage, now_ms))
            }
            Update::Done(()) => Update::Done(()),
            Update::Contended => Update::Contended,
        };
        if enlist {
            active_set::enlist(store, &self.key);
        }
        match (outcome, taken) {
            (Update::Done(()), Some(standing)) => Update::Done(standing),
            (Update::Done(()), None) | (Update::Contended, _) => Update::Contended,
            (Update::Refused(d), _) => Update::Refused(d),
        }
    }

    /// Marks this fleet-wide counter wanted for `demand` when its lease cannot cover it for want
    /// of a lease: a request refused [`Denial::Unleased`] at one counter asks at once for every
    /// counter it lacks, not the first only ([`crate::renewal::plan_for`]).
    fn note_unleased(&self, store: &impl SharedStore, demand: Demand, now_ms: u64) {
        let Some(fleet) = self.fleet else {
            return;
        };
        let (amount, ctx) = (self.amount(demand), self.lease_context(fleet, false));
        let mut enlist = false;
        let _ = update::<()>(store, &self.key, |current| {
            let lease = self.allowance(current, fleet, now_ms);
            if !matches!(
                lease.take(amount, &ctx, now_ms),
                Err(Shortage::Unleased { .. })
            ) {
                return Err(());
            }
            let mut next = lease.want(amount, self.limit);
            enlist = !next.listed;
            next.listed = true;
            Ok(next.encode())
        });
        if enlist {
            active_set::enlist(store, &self.key);
        }
    }

    fn denial(&self, shortage: Shortage, now_ms: u64) -> Denial {
        let level = level_of(&self.key);
        let (remaining, retry_after_ms) = match shortage {
            Shortage::Unavailable { retry_after_ms } => {
                return Denial::QuotaUnavailable {
                    level,
                    kind: self.kind,
                    retry_after_ms,
                };
            }
            Shortage::Unleased {
                remaining,
                retry_after_ms,
            } => {
                return Denial::Unleased {
                    level,
                    kind: self.kind,
                    limit: self.limit,
                    remaining,
                    retry_after_ms,
                };
            }
            Shortage::Spent {
                remaining,
                retry_after_ms,
            } => (remaining, retry_after_ms),
            Shortage::Exhausted { resets_ms } => match (self.kind, self.fleet) {
                (LimitKind::Budget(measure), Some(fleet)) => {
                    return Denial::BudgetExceeded {
                        level,
                        window: fleet.window,
                        measure,
                        limit: self.limit,
                        resets_ms,
                    };
                }
                _ => (0, resets_ms.saturating_sub(now_ms).max(1)),
            },
        };
        Denial::Limit {
            level,
            kind: self.kind,
            limit: self.limit,
            remaining,
            retry_after_ms,
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
        if let Some(fleet) = self.fleet {
            if refund == 0.0 {
                return true;
            }
            let ctx = self.lease_context(fleet, false);
            let result = update::<()>(store, &self.key, |current| {
                Ok(self
                    .allowance(current, fleet, now_ms)
                    .adjust(refund, self.source, &ctx, now_ms)
                    .encode())
            });
            return matches!(result, Update::Done(()));
        }
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

/// The tenant path a counter key belongs to (`weir:e:acme/team:rpm` → `acme/team`, and
/// `weir:e:acme:month:spend` → `acme`: ids never hold a ':').
fn level_of(key: &str) -> String {
    let inner = key.splitn(3, ':').nth(2).unwrap_or(key);
    inner
        .split_once(':')
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
    take_all(store, counters(tenant, ledger), demand, slot, now_ms)
}

/// Charges one retry at every level of the tenant's path that limits retries
/// (`retries_per_minute`), all or nothing. Never given back: a retry let through was sent.
pub fn charge_retry(
    store: &impl SharedStore,
    tenant: &Tenant,
    ledger: Ledger,
    now_ms: u64,
) -> Result<(), Denial> {
    let slot = SlotLease { id: 0, ttl_ms: 0 };
    let counters = retry_counters(tenant, ledger);
    take_all(store, counters, Demand::default(), slot, now_ms).map(|_| ())
}

/// Takes `demand` from each of `counters`, all or nothing.
fn take_all(
    store: &impl SharedStore,
    mut all: impl Iterator<Item = Counter>,
    demand: Demand,
    slot: SlotLease,
    now_ms: u64,
) -> Result<Reservation, Denial> {
    let mut taken = Reservation {
        held: Vec::new(),
        demand,
        slot,
        standing: Vec::new(),
    };
    while let Some(counter) = all.next() {
        let denial = match counter.take(store, demand, slot, now_ms) {
            Update::Done((standing, source)) => {
                taken.held.push(Counter { source, ..counter });
                taken.standing.push(standing);
                continue;
            }
            Update::Refused(denial) => denial,
            Update::Contended => Denial::Contended,
        };
        if matches!(denial, Denial::Unleased { .. }) {
            all.for_each(|rest| rest.note_unleased(store, demand, now_ms));
        }
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
    let mut taken: Vec<(usize, (Standing, Source))> = Vec::new();
    for (i, counter) in reservation.held.iter().enumerate() {
        if !matches!(
            counter.kind,
            LimitKind::InputTokens | LimitKind::OutputTokens | LimitKind::Budget(_)
        ) {
            continue;
        }
        let denial = match counter.take(store, more, slot, now_ms) {
            Update::Done(taken_now) => {
                taken.push((i, taken_now));
                continue;
            }
            Update::Refused(denial) => denial,
            Update::Contended => Denial::Contended,
        };
        if matches!(denial, Denial::Unleased { .. }) {
            let tokens = |c: &&Counter| c.kind != LimitKind::Requests;
            for rest in reservation.held.iter().skip(i + 1).filter(tokens) {
                rest.note_unleased(store, more, now_ms);
            }
        }
        for &(j, (_, source)) in &taken {
            // Back where this take came from, which may differ from the reservation's.
            let c = Counter {
                source,
                ..reservation.held[j].clone()
            };
            c.give_back(store, c.amount(more) as f64, slot, now_ms);
        }
        return Err(denial);
    }
    for (i, (standing, source)) in taken {
        reservation.standing[i] = standing;
        // Settling adjusts one place. The fail-open share wins (a refund never becomes store
        // tokens); otherwise the lease the body's tokens came from: one for a window that
        // started since the headers (or granted since, where there was none) holds them, and
        // the old window is closed.
        let held = &mut reservation.held[i].source;
        if *held != Source::Share {
            *held = source;
        }
    }
    let demand = &mut reservation.demand;
    demand.input_tokens = demand.input_tokens.saturating_add(more.input_tokens);
    demand.output_tokens = demand.output_tokens.saturating_add(more.output_tokens);
    demand.cost_micros = demand.cost_micros.saturating_add(more.cost_micros);
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
                LimitKind::Requests | LimitKind::Retries if rollback => 1.0,
                LimitKind::Requests | LimitKind::Retries => return false,
                LimitKind::Concurrency => 0.0,
                LimitKind::InputTokens => reserved.input_tokens as f64 - actual.input_tokens as f64,
                LimitKind::OutputTokens => {
                    reserved.output_tokens as f64 - actual.output_tokens as f64
                }
                LimitKind::Budget(m) => reserved.of(m) as f64 - actual.of(m) as f64,
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
    use crate::store::{MAX_CAS_ATTEMPTS, StoreError};

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
            // An absent key is written whatever the token, as Envoy does.
            if current.is_some() && cas.is_some() && cas != current {
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
        cost_micros: 0,
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
            cost_micros: 0,
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
            cost_micros: 0,
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
            other => panic!("not a limit: {other:?}"),
        }
        // The org's input tokens taken by the refused request were given back.
        assert_eq!(store.level("weir:e:acme:itpm"), 990.0);
    }

    #[test]
    fn a_prompt_larger_than_a_whole_minute_is_refused_as_too_large_unless_in_debt() {
        // 60,000 input tokens a minute at the key; the org lets oversized requests run in debt.
        let t = tenant(
            r#"{"input_tokens_per_minute":1000000,"oversize":"debt"}"#,
            r#"{"input_tokens_per_minute":60000}"#,
        );
        let store = Memory::default();
        initialize(&store, [&t], 0);
        let huge = Demand {
            input_tokens: 80_000,
            output_tokens: 10,
            cost_micros: 0,
        };
        let denial = reserve(&store, &t, huge, Ledger::Enforce, slot(), 0).unwrap_err();
        assert_eq!(
            denial,
            Denial::TooLarge {
                level: "acme/w/p/k".into(),
                kind: LimitKind::InputTokens,
                limit: 60_000,
                requested: 80_000,
            }
        );
        // Nothing was taken, at any level.
        assert_eq!(store.level("weir:e:acme/w/p/k:itpm"), 60_000.0);
        assert_eq!(store.level("weir:e:acme:itpm"), 1_000_000.0);
        // A request that fits the key's minute goes through the same full buckets.
        let fits = Demand {
            input_tokens: 60_000,
            ..huge
        };
        assert!(reserve(&store, &t, fits, Ledger::Enforce, slot(), 0).is_ok());
        // In debt at the key too: from a full bucket, the oversized request runs and leaves
        // the bucket below zero.
        let t = tenant(
            "{}",
            r#"{"input_tokens_per_minute":60000,"oversize":"debt"}"#,
        );
        let store = Memory::default();
        initialize(&store, [&t], 0);
        assert!(reserve(&store, &t, huge, Ledger::Enforce, slot(), 0).is_ok());
        assert_eq!(store.level("weir:e:acme/w/p/k:itpm"), -20_000.0);
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
            cost_micros: 0,
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
