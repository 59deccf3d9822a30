//! A fleet-wide counter's local state on one Envoy: its lease of the fleet's budget.
//!
//! For a limit marked fleet-wide, the shared-data value is not a refilling bucket but the
//! tokens the quota service granted this Envoy and it has not spent yet. Requests take from it
//! with the same compare-and-swap loop as buckets; it may go negative (a request that used more
//! than it reserved leaves a debt, repaid from the next grant). The background renewal
//! ([`crate::renewal`]) tops it up: it sizes each ask to this Envoy's recent rate (an EWMA of
//! tokens spent per ms, clamped to `[min_lease_fraction, max_lease_fraction] × limit`), gives
//! back what a lapsed lease left unspent, and adds each grant.
//!
//! A lease lapses `lease_ttl_ms` after its last grant or spend, so an idle Envoy does not sit
//! on tokens the others could use (they go back with the next renewal); a calendar-window lease
//! lapses at its window's end at the latest, and what it left is not carried into the next. While the store is down (`weir:fleet:health`), granted tokens keep being spent; once
//! they are gone a `fail_open` counter spends from a local bucket of `fail_open_share × limit`
//! per minute and a `fail_closed` one refuses.
//!
//! Layout: 13 little-endian 8-byte fields, see [`Allowance::encode`].

use crate::bucket::Bucket;
use crate::fleet::{Grant, Window};
use crate::fleet_config::{FailMode, LeaseTerms};

/// Shared-data key of the store's health as this Envoy last saw it: 8 bytes, the time it was
/// first found down (0: up).
pub const HEALTH_KEY: &str = "weir:fleet:health";

/// Weight of the newest period in the rate estimate.
const RATE_ALPHA: f64 = 0.3;

/// How many renewal periods an ask should last at the recent rate.
const ASK_PERIODS: f64 = 4.0;

/// Request counts an Envoy may owe at once whatever the limit's size (up to the limit): a few
/// concurrent first requests of a small limit are served, not refused for want of a lease.
const MIN_OWED: f64 = 8.0;

/// A counter's lease on this Envoy.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Allowance {
    /// Granted and not yet spent; negative: a debt.
    pub tokens: f64,
    /// When the unspent tokens lapse (per-minute: last grant or spend + TTL; window: its end).
    pub expires_ms: u64,
    /// The calendar window the tokens belong to (0 for per-minute counters).
    pub window_start_ms: u64,
    /// What the store held after the last grant, and when it resets or is full again.
    pub remaining: u64,
    pub resets_ms: u64,
    /// Recent spend in tokens per ms, and what was spent since it was last measured.
    pub rate: f64,
    pub spent: f64,
    pub measured_ms: u64,
    /// The largest amount a request found missing since the last grant: asked for next.
    pub wanted: f64,
    /// The fail-open local share while the store is down.
    pub share: Bucket,
    /// Whether any grant ever arrived (a cold counter refuses until its first).
    pub granted: bool,
    /// Whether the counter is in the renewal's set of active counters ([`crate::renewal`]).
    pub listed: bool,
}

/// Why a counter's lease cannot cover a request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Shortage {
    /// No lease to spend from — no grant yet on this Envoy, or a lease that lapsed while the
    /// tenant was idle — though the store may well hold the tokens (`remaining`, its last
    /// word, 0 before any): worth asking for at once rather than refusing.
    Unleased { remaining: u64, retry_after_ms: u64 },
    /// The store is unreachable and the counter fails closed.
    Unavailable { retry_after_ms: u64 },
    /// The calendar window's budget is gone; it resets at `resets_ms`.
    Exhausted { resets_ms: u64 },
    /// The lease is spent; renewal will bring more.
    Spent { remaining: u64, retry_after_ms: u64 },
}

/// What a take needs besides the lease: the counter's terms and the store's health.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Context {
    pub limit: u64,
    pub window: Window,
    pub fail: FailMode,
    pub terms: LeaseTerms,
    pub store_down: bool,
}

impl Context {
    fn share_per_minute(&self) -> u64 {
        (self.limit as f64 * self.terms.fail_open_share).floor() as u64
    }
}

/// Where a take was served from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The tokens the store granted this Envoy, for the calendar window starting then (0 for
    /// per-minute counters).
    Lease { window_start_ms: u64 },
    /// The local fail-open share, while the store is down.
    Share,
}

/// One counter's part of a renewal: how much to ask for, unspent tokens given back, and (for
/// a calendar window) what the lease still holds of the current window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ask {
    pub want: u64,
    pub returned: u64,
    pub returned_window_start_ms: Option<u64>,
    /// Whole unspent tokens of the window `held_window_start_ms` (0 for a per-minute counter).
    pub held: u64,
    pub held_window_start_ms: Option<u64>,
    /// The holding is worth a call of its own: it changed this period (tokens were spent), or
    /// the store has not heard of it for a while (a tick of `report_ms`).
    pub report: bool,
}

impl Allowance {
    pub fn encode(&self) -> Vec<u8> {
        let fields = [
            self.tokens.to_bits(),
            self.expires_ms,
            self.window_start_ms,
            self.remaining,
            self.resets_ms,
            self.rate.to_bits(),
            self.spent.to_bits(),
            self.measured_ms,
            self.wanted.to_bits(),
            self.share.level.to_bits(),
            self.share.updated_ms,
            u64::from(self.granted),
            u64::from(self.listed),
        ];
        fields.iter().flat_map(|f| f.to_le_bytes()).collect()
    }

    pub fn decode(bytes: &[u8]) -> Option<Allowance> {
        if bytes.len() != 13 * 8 {
            return None;
        }
        let mut fields = bytes
            .chunks_exact(8)
            .map(|c| c.try_into().map(u64::from_le_bytes).unwrap_or_default());
        let mut next = || fields.next().unwrap_or_default();
        let float = |bits: u64| Some(f64::from_bits(bits)).filter(|f| f.is_finite());
        Some(Allowance {
            tokens: float(next())?,
            expires_ms: next(),
            window_start_ms: next(),
            remaining: next(),
            resets_ms: next(),
            rate: float(next())?,
            spent: float(next())?,
            measured_ms: next(),
            wanted: float(next())?,
            share: Bucket {
                level: float(next())?,
                updated_ms: next(),
            },
            granted: next() != 0,
            listed: next() != 0,
        })
    }

    /// A counter seen for the first time: no lease, a full fail-open share.
    pub fn cold(ctx: &Context, now_ms: u64) -> Allowance {
        Allowance {
            share: Bucket::full(ctx.share_per_minute(), now_ms),
            measured_ms: now_ms,
            ..Allowance::default()
        }
    }

    /// Whether the unspent tokens are past their life (a debt never lapses: it is owed): a
    /// lease neither granted nor spent from for `lease_ttl_ms` (so an idle Envoy gives back what
    /// the others could use), or one of a calendar window that ended.
    fn lapsed(&self, window: Window, now_ms: u64) -> bool {
        match window.bounds(now_ms) {
            None => now_ms >= self.expires_ms,
            Some((start, _)) => start != self.window_start_ms || now_ms >= self.expires_ms,
        }
    }

    /// Keeps a lease in use alive for another `lease_ttl_ms`, never past its window's end.
    fn touch(&mut self, window: Window, ttl_ms: u64, now_ms: u64) {
        let until = now_ms.saturating_add(ttl_ms);
        let until = window
            .bounds(now_ms)
            .map_or(until, |(_, end)| until.min(end));
        self.expires_ms = self.expires_ms.max(until);
    }

    /// Tokens that may be spent now.
    pub fn usable(&self, window: Window, now_ms: u64) -> f64 {
        if self.lapsed(window, now_ms) {
            self.tokens.min(0.0)
        } else {
            self.tokens
        }
    }

    /// Takes `amount` from the lease, or from the fail-open share while the store is down; says
    /// which, so that a refund goes back where the tokens came from.
    pub fn take(
        mut self,
        amount: u64,
        ctx: &Context,
        now_ms: u64,
    ) -> Result<(Allowance, Source), Shortage> {
        let want = amount as f64;
        if amount == 0 {
            return Ok((self, self.lease_source()));
        }
        if self.usable(ctx.window, now_ms) >= want {
            self.tokens -= want;
            self.spent += want;
            self.touch(ctx.window, ctx.terms.lease_ttl_ms, now_ms);
            return Ok((self, self.lease_source()));
        }
        let retry_after_ms = ctx.terms.renew_ms.max(1);
        match (ctx.store_down, ctx.fail) {
            (true, FailMode::FailOpen) => {
                let share = ctx.share_per_minute();
                return match self.share.take(share, amount, now_ms) {
                    Ok(bucket) => {
                        self.share = bucket;
                        Ok((self, Source::Share))
                    }
                    Err(short) => Err(Shortage::Spent {
                        remaining: short.remaining,
                        retry_after_ms: short.retry_after_ms.max(retry_after_ms),
                    }),
                };
            }
            (true, FailMode::FailClosed) => {
                return Err(Shortage::Unavailable {
                    retry_after_ms: retry_after_ms.max(1_000),
                });
            }
            (false, _) => {}
        }
        if !self.granted || self.lapsed(ctx.window, now_ms) {
            return Err(Shortage::Unleased {
                remaining: self.remaining,
                retry_after_ms,
            });
        }
        // Gone for the window only when the store said so: with tokens left there, other
        // Envoys' leases lapse back to it, and the next renewal may bring them.
        let exhausted = ctx.window != Window::Minute && self.remaining == 0;
        if exhausted {
            return Err(Shortage::Exhausted {
                resets_ms: self.resets_ms,
            });
        }
        // A lease too small for the request while the store's last word holds what it lacks
        // (a first ask granted only what its request needed; a burst outran the renewal):
        // worth asking at once, not a refusal saying "remaining 0" of a budget nobody spent.
        let lacking = want - self.usable(ctx.window, now_ms).max(0.0);
        if self.remaining as f64 >= lacking {
            return Err(Shortage::Unleased {
                remaining: self.remaining,
                retry_after_ms,
            });
        }
        // Per-minute: the store refills at the limit's rate; wait for what it lacks.
        let missing = lacking - self.remaining as f64;
        let per_ms = ctx.limit as f64 / 60_000.0;
        let refill_ms = if missing > 0.0 && per_ms > 0.0 {
            (missing / per_ms).ceil() as u64
        } else {
            0
        };
        Err(Shortage::Spent {
            remaining: self.usable(ctx.window, now_ms).max(0.0) as u64,
            retry_after_ms: refill_ms.max(retry_after_ms),
        })
    }

    /// Takes a request count from a lease that lacks it ([`Shortage::Unleased`]), as a debt
    /// the grant its request asks for repays: the count is charged before the request's headers
    /// go on, with its concurrency slot, and the ask goes with its body. `None` past the most
    /// one Envoy may owe: what it may hold (`max_lease_fraction` of the limit), or a few
    /// concurrent first requests of a small limit ([`MIN_OWED`], never more than the limit),
    /// so a burst cannot run up a debt the renewals repay only later.
    pub fn owe(mut self, amount: u64, ctx: &Context) -> Option<Allowance> {
        let few = MIN_OWED.min(ctx.limit as f64);
        let most = (ctx.terms.max_lease_fraction * ctx.limit as f64)
            .max(few)
            .max(1.0);
        self.tokens -= amount as f64;
        self.spent += amount as f64;
        (self.tokens >= -most).then_some(self)
    }

    /// What a request that found no lease asks for at once (`crate::renewal::plan_for`): what
    /// requests found missing and what is owed, no more, so concurrent requests ask for what
    /// they spend, not a lease each (the period's renewal sizes leases to the rate), and the
    /// tokens of a lapsed lease given back.
    pub fn ask_now(mut self, ctx: &Context, now_ms: u64) -> (Allowance, Ask) {
        let mut ask = self.lapsed_returned(ctx, now_ms);
        let missing = self.wanted - self.usable(ctx.window, now_ms);
        ask.want = missing.clamp(0.0, 2.0 * ctx.limit as f64).ceil() as u64;
        self.holding(ctx, now_ms, &mut ask);
        (self, ask)
    }

    /// What the lease holds of its calendar window, for the store (nothing for a per-minute
    /// counter, whose bucket refills whatever a stopped Envoy held).
    fn holding(&self, ctx: &Context, now_ms: u64, ask: &mut Ask) {
        if ctx.window != Window::Minute {
            ask.held = self.usable(ctx.window, now_ms).max(0.0).floor() as u64;
            ask.held_window_start_ms = Some(self.window_start_ms);
        }
    }

    /// An ask giving back what a lapsed lease left unspent (taken out of the lease).
    fn lapsed_returned(&mut self, ctx: &Context, now_ms: u64) -> Ask {
        let mut ask = Ask::default();
        if self.lapsed(ctx.window, now_ms) && self.tokens > 0.0 {
            ask.returned = self.tokens.floor() as u64;
            if ctx.window != Window::Minute {
                ask.returned_window_start_ms = Some(self.window_start_ms);
            }
            self.tokens = 0.0;
        }
        ask
    }

    /// Marks that a request of `amount` found too little, so the next renewal asks for it.
    pub fn want(mut self, amount: u64, limit: u64) -> Allowance {
        self.wanted = self.wanted.max(amount.min(limit) as f64);
        self
    }

    pub(crate) fn lease_source(&self) -> Source {
        Source::Lease {
            window_start_ms: self.window_start_ms,
        }
    }

    /// Adds `delta` tokens (a settled refund; negative: an overrun charged) where the request
    /// took them from. A refund of the fail-open share goes back to the share, never to the
    /// lease: the store did not grant those tokens, and a lapsed lease gives its tokens back to
    /// the store, which would then hand them out again. A calendar window's refund or overrun
    /// settled once the next window's lease is here is dropped: the old window is closed (the
    /// store takes no returns for it, a debt is forgiven at the reset), and carrying it over
    /// would spend the old month's budget in the new one.
    pub fn adjust(mut self, delta: f64, source: Source, ctx: &Context, now_ms: u64) -> Allowance {
        match source {
            Source::Lease { window_start_ms } if window_start_ms == self.window_start_ms => {
                self.tokens += delta;
                self.spent = (self.spent - delta).max(0.0);
            }
            Source::Lease { .. } => {}
            Source::Share => {
                self.share = self.share.adjust(ctx.share_per_minute(), delta, now_ms);
            }
        }
        self
    }

    /// This counter's part of the next renewal, and the lease as it stands once the ask is
    /// sent (lapsed tokens taken out to be returned, the rate measured). `None`: nothing to ask
    /// or give back, and the counter is idle.
    pub fn ask(mut self, ctx: &Context, now_ms: u64) -> (Allowance, Option<Ask>) {
        let elapsed = now_ms.saturating_sub(self.measured_ms);
        let spent = self.spent > 0.0;
        if elapsed > 0 {
            let recent = self.spent / elapsed as f64;
            self.rate = RATE_ALPHA * recent + (1.0 - RATE_ALPHA) * self.rate;
            self.spent = 0.0;
            self.measured_ms = now_ms;
        }
        let mut ask = self.lapsed_returned(ctx, now_ms);
        let limit = ctx.limit as f64;
        let horizon = ASK_PERIODS * ctx.terms.renew_ms as f64;
        let in_use = self.rate * horizon >= 1.0 || self.wanted > 0.0;
        let target = if in_use {
            let (floor, cap) = (
                ctx.terms.min_lease_fraction * limit,
                ctx.terms.max_lease_fraction * limit,
            );
            (self.rate * horizon).clamp(floor, cap).max(self.wanted)
        } else {
            0.0
        };
        let usable = self.usable(ctx.window, now_ms);
        // Below half the target (or short of what a request wanted): top it up to the target.
        if usable < target / 2.0 || usable < self.wanted || usable < 0.0 {
            ask.want = (target - usable).clamp(0.0, 2.0 * limit).ceil() as u64;
        }
        self.holding(ctx, now_ms, &mut ask);
        let tick = now_ms % ctx.terms.report_ms.max(1) < ctx.terms.renew_ms;
        ask.report = ask.held > 0 && (spent || tick);
        let idle = ask.want == 0 && ask.returned == 0 && ask.held == 0 && !in_use;
        (self, (!idle || self.tokens != 0.0).then_some(ask))
    }

    /// Adds a grant to the lease. A grant for a new calendar window replaces what was left of
    /// the old one (debt included: the budget reset). A grant of nothing while the store holds
    /// tokens (a quiet counter asked for none) is no lease: it leaves a lapsed one lapsed, so
    /// the next request asks at once instead of finding a live lease of nothing.
    pub fn add_grant(mut self, grant: &Grant, ctx: &Context, now_ms: u64) -> Allowance {
        let granted = grant.granted as f64;
        let leases = grant.granted > 0 || grant.remaining == 0;
        match (ctx.window, grant.window_start_ms) {
            (Window::Minute, _) | (_, None) => {
                if self.lapsed(ctx.window, now_ms) {
                    self.tokens = self.tokens.min(0.0);
                }
                self.tokens += granted;
                if leases {
                    self.expires_ms = now_ms.saturating_add(ctx.terms.lease_ttl_ms);
                }
            }
            (_, Some(start)) => {
                if start != self.window_start_ms {
                    self.tokens = 0.0;
                    self.window_start_ms = start;
                } else if self.lapsed(ctx.window, now_ms) {
                    self.tokens = self.tokens.min(0.0);
                }
                self.tokens += granted;
                if leases {
                    self.expires_ms = now_ms
                        .saturating_add(ctx.terms.lease_ttl_ms)
                        .min(grant.resets_ms);
                }
            }
        }
        self.remaining = grant.remaining;
        self.resets_ms = grant.resets_ms;
        self.granted = true;
        if self.tokens >= self.wanted {
            self.wanted = 0.0;
        }
        self
    }
}

/// Whether the store is down as this Envoy last saw it (the value of [`HEALTH_KEY`]).
pub fn store_down(health: Option<&[u8]>) -> bool {
    down_since(health).is_some()
}

/// When the store was first found down, if it is.
pub fn down_since(health: Option<&[u8]>) -> Option<u64> {
    let bytes: [u8; 8] = health?.get(..8)?.try_into().ok()?;
    Some(u64::from_le_bytes(bytes)).filter(|&t| t != 0)
}

/// The [`HEALTH_KEY`] value: down since `since_ms`, or up.
pub fn health(down_since_ms: Option<u64>) -> [u8; 8] {
    down_since_ms
        .unwrap_or(0)
        .max(u64::from(down_since_ms.is_some()))
        .to_le_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TERMS: LeaseTerms = LeaseTerms {
        renew_ms: 250,
        lease_ttl_ms: 1_000,
        report_ms: 2_000,
        max_lease_fraction: 0.1,
        min_lease_fraction: 0.01,
        fail_open_share: 0.1,
    };

    fn ctx(window: Window, fail: FailMode, store_down: bool) -> Context {
        Context {
            limit: 60_000,
            window,
            fail,
            terms: TERMS,
            store_down,
        }
    }

    fn grant(granted: u64, remaining: u64, window_start_ms: Option<u64>, resets_ms: u64) -> Grant {
        Grant {
            key: "k".into(),
            granted,
            remaining,
            resets_ms,
            window_start_ms,
        }
    }

    /// A per-minute lease's source.
    const LEASE: Source = Source::Lease { window_start_ms: 0 };

    const UP: bool = false;
    const DOWN: bool = true;

    #[test]
    fn a_cold_counter_is_unleased_until_its_first_grant_then_spends_it() {
        let c = ctx(Window::Minute, FailMode::FailClosed, UP);
        let a = Allowance::cold(&c, 0);
        assert_eq!(
            a.take(10, &c, 0),
            Err(Shortage::Unleased {
                remaining: 0,
                retry_after_ms: 250
            })
        );
        let a = a.want(10, c.limit);
        let (a, ask) = a.ask(&c, 100);
        // Something was wanted: the ask is the floor (1% of the limit), at least what was wanted.
        assert_eq!(ask.map(|a| a.want), Some(600));
        let a = a.add_grant(&grant(600, 59_400, None, 600), &c, 100);
        let a = a.take(500, &c, 150).unwrap().0;
        assert_eq!(a.tokens, 100.0);
        // Short by 100 of what the store still holds: asked for at once.
        assert!(matches!(
            a.take(200, &c, 150),
            Err(Shortage::Unleased {
                remaining: 59_400,
                retry_after_ms: 250,
            })
        ));
        // 500 tokens in the 150 ms since the last measure: 0.3 × 3.33 = 1 token/ms. The ask
        // lasts four periods (1,000 tokens, within the 600 floor and the 6,000 cap).
        let (a, ask) = a.ask(&c, 250);
        assert!((a.rate - 1.0).abs() < 1e-9, "{}", a.rate);
        assert_eq!(
            ask.map(|a| a.want),
            Some(900),
            "1,000 target minus 100 held"
        );
    }

    #[test]
    fn a_lease_that_lapsed_while_idle_is_unleased_not_spent() {
        // Granted 600 with 59,400 left in the store, then idle past the lease's life: the next
        // request finds no lease, but the store's last word says it holds plenty. Before, that
        // was a 429 saying "remaining 0".
        let c = ctx(Window::Minute, FailMode::FailClosed, UP);
        let a = Allowance::cold(&c, 0).add_grant(&grant(600, 59_400, None, 600), &c, 0);
        let idle = c.terms.lease_ttl_ms + 1;
        assert_eq!(
            a.take(10, &c, idle),
            Err(Shortage::Unleased {
                remaining: 59_400,
                retry_after_ms: 250
            })
        );
        // A lease spent under load (not lapsed) asks at once too while the store holds what
        // it lacks; once the store says it has too little, it waits for the refill.
        let (spent, _) = a.take(590, &c, 10).unwrap();
        assert!(matches!(
            spent.take(20, &c, 20),
            Err(Shortage::Unleased {
                remaining: 59_400,
                ..
            })
        ));
        let dry = spent.add_grant(&grant(0, 5, None, 600), &c, 30);
        assert!(matches!(
            dry.take(20, &c, 40),
            Err(Shortage::Spent { remaining: 10, .. })
        ));
    }

    #[test]
    fn a_lapsed_lease_given_back_stays_unleased_through_a_grant_of_nothing() {
        // The renewal gives a lapsed lease back and, the counter going quiet, asks for nothing;
        // the store answers with a grant of 0 and plenty left. That answer is not a lease: the
        // next request asks at once. Before, it revived an empty lease for its TTL, and the
        // tenant's first request after idle was a 429 saying "remaining 0".
        let c = ctx(Window::Minute, FailMode::FailClosed, UP);
        let a = Allowance::cold(&c, 0).add_grant(&grant(1, 59_999, None, 0), &c, 0);
        let (a, ask) = a.ask(&c, 5_000);
        assert_eq!(ask.map(|a| (a.want, a.returned)), Some((0, 1)));
        let a = a.add_grant(&grant(0, 60_000, None, 0), &c, 5_010);
        assert!(
            matches!(a.take(1, &c, 5_020), Err(Shortage::Unleased { .. })),
            "{:?}",
            a.take(1, &c, 5_020)
        );
        // A grant of nothing because the store has nothing left is the store's word: spent.
        let a = a.add_grant(&grant(0, 0, None, 0), &c, 5_030);
        assert!(matches!(
            a.take(1, &c, 5_040),
            Err(Shortage::Spent { remaining: 0, .. })
        ));
    }

    #[test]
    fn with_the_default_terms_a_lease_outlives_a_tenant_calling_every_few_seconds() {
        let fleet: crate::fleet_config::FleetConfig =
            serde_json::from_str(r#"{"cluster": "quota"}"#).unwrap();
        let c = Context {
            terms: fleet.terms(),
            ..ctx(Window::Minute, FailMode::FailClosed, UP)
        };
        let mut a = Allowance::cold(&c, 0).add_grant(&grant(600, 59_400, None, 600), &c, 0);
        // One request every 5 s: each finds the lease it was granted, none meets a cold start
        // (with a lease kept 1 s, every one of them did).
        for i in 1..=10 {
            a = match a.take(10, &c, i * 5_000) {
                Ok((a, _)) => a,
                Err(e) => panic!("request {i} refused: {e:?}"),
            };
        }
        assert_eq!(a.tokens, 500.0);
    }

    #[test]
    fn overruns_leave_a_debt_that_the_next_grant_repays_and_refunds_come_back() {
        let c = ctx(Window::Minute, FailMode::FailClosed, UP);
        let a = Allowance::cold(&c, 0).add_grant(&grant(1_000, 0, None, 0), &c, 0);
        let a = a.take(800, &c, 0).unwrap().0.adjust(-500.0, LEASE, &c, 0);
        assert_eq!(a.tokens, -300.0, "used 1,300 of 1,000");
        assert!(a.take(1, &c, 0).is_err());
        let (a, ask) = a.ask(&c, 100);
        assert!(ask.is_some_and(|a| a.want >= 300), "{ask:?}");
        let a = a.add_grant(&grant(500, 0, None, 0), &c, 100);
        assert_eq!(a.tokens, 200.0);
        assert_eq!(
            a.adjust(50.0, LEASE, &c, 100).tokens,
            250.0,
            "a refund goes back to the lease"
        );
    }

    #[test]
    fn an_idle_lease_lapses_and_is_returned_and_a_quiet_counter_stops_asking() {
        let c = ctx(Window::Minute, FailMode::FailClosed, UP);
        let a = Allowance::cold(&c, 0).add_grant(&grant(1_000, 0, None, 0), &c, 0);
        let a = a.take(100, &c, 0).unwrap().0;
        assert_eq!(a.usable(Window::Minute, 999), 900.0);
        assert_eq!(a.usable(Window::Minute, 1_000), 0.0, "lapsed a TTL after");
        let (a, ask) = a.ask(&c, 1_000);
        assert_eq!(ask.map(|a| a.returned), Some(900));
        assert_eq!(a.tokens, 0.0);
        // With no spend its rate decays; once under a token per horizon it asks for nothing.
        let mut a = a;
        let mut now = 1_000;
        let mut last = Some(Ask::default());
        for _ in 0..40 {
            now += 250;
            (a, last) = a.ask(&c, now);
        }
        assert_eq!(last, None, "rate {}", a.rate);
    }

    #[test]
    fn asks_follow_the_rate_within_the_floor_and_the_cap() {
        let c = ctx(Window::Minute, FailMode::FailClosed, UP);
        let mut a = Allowance::cold(&c, 0).add_grant(&grant(60_000, 0, None, 0), &c, 0);
        let mut now = 0;
        // 40 tokens per ms for a while: 4 periods of it is 40,000, capped at 6,000.
        for _ in 0..20 {
            now += 250;
            a = a.take(10_000, &c, now).map_or(a, |(a, _)| a);
            a.tokens = 60_000.0;
            a = a.ask(&c, now).0;
        }
        a.tokens = 0.0;
        assert_eq!(a.ask(&c, now + 1).1.map(|a| a.want), Some(6_000));
        // A trickle: the floor of 1%.
        let mut slow = Allowance::cold(&c, 0).add_grant(&grant(100, 0, None, 0), &c, 0);
        slow = slow.take(1, &c, 0).unwrap().0;
        slow.tokens = 0.0;
        assert_eq!(slow.ask(&c, 250).1.map(|a| a.want), Some(600));
    }

    #[test]
    fn while_the_store_is_down_grants_are_spent_then_fail_open_uses_its_share() {
        let open = ctx(Window::Minute, FailMode::FailOpen, DOWN);
        let closed = ctx(Window::Minute, FailMode::FailClosed, DOWN);
        let a = Allowance::cold(&open, 0).add_grant(&grant(100, 0, None, 0), &open, 0);
        // Granted tokens are spent whatever the mode.
        let a = a.take(100, &closed, 0).unwrap().0;
        assert!(matches!(
            a.take(1, &closed, 0),
            Err(Shortage::Unavailable { .. })
        ));
        // fail_open: a local bucket of 10% of the limit per minute.
        let a = a.take(6_000, &open, 0).unwrap().0;
        assert!(matches!(a.take(100, &open, 0), Err(Shortage::Spent { .. })));
        assert!(a.take(100, &open, 1_000).is_ok(), "refilled at 100/s");
        // A cold fail_open counter serves from its share while the store is down.
        assert!(Allowance::cold(&open, 0).take(10, &open, 0).is_ok());
    }

    #[test]
    fn a_refund_settled_after_its_window_ended_is_not_carried_into_the_next() {
        let c = ctx(Window::Month, FailMode::FailClosed, UP);
        let (start, end) = Window::Month.bounds(1_796_183_000_000).unwrap_or_default();
        let now = start + 1_000;
        let a = Allowance::cold(&c, now).add_grant(&grant(500, 0, Some(start), end), &c, now);
        // A request reserves 400 and is still running when the month ends.
        let (a, source) = a.take(400, &c, now).unwrap();
        let (a, _) = a.ask(&c, end);
        let (next_start, next_end) = Window::Month.bounds(end).unwrap_or_default();
        let a = a.add_grant(&grant(300, 59_700, Some(next_start), next_end), &c, end);
        // It settles in the new month having used nothing: the old month's 400 stay there.
        let a = a.adjust(400.0, source, &c, end + 10);
        println!("new month's lease after the late refund: {}", a.tokens);
        assert_eq!(a.tokens, 300.0, "only the new month's grant");
    }

    #[test]
    fn a_window_budget_is_exhausted_until_it_resets_and_a_new_window_starts_afresh() {
        let c = ctx(Window::Month, FailMode::FailClosed, UP);
        let (start, end) = Window::Month.bounds(1_796_183_000_000).unwrap_or_default();
        let now = start + 1_000;
        let a = Allowance::cold(&c, now).add_grant(&grant(500, 0, Some(start), end), &c, now);
        let a = a.take(400, &c, now).unwrap().0;
        assert_eq!(
            a.take(200, &c, now),
            Err(Shortage::Exhausted { resets_ms: end })
        );
        // The month ends: what was left lapses and is not returned to the new window.
        let (a, ask) = a.want(200, c.limit).ask(&c, end);
        assert_eq!(ask.map(|a| a.returned_window_start_ms), Some(Some(start)));
        let (next_start, next_end) = Window::Month.bounds(end).unwrap_or_default();
        let a = a
            .adjust(
                -50.0,
                Source::Lease {
                    window_start_ms: start,
                },
                &c,
                end,
            )
            .add_grant(&grant(300, 59_700, Some(next_start), next_end), &c, end);
        assert_eq!(
            a.tokens, 300.0,
            "a debt from the old window is forgiven at its reset"
        );
        assert!(a.take(200, &c, end).is_ok());
    }

    #[test]
    fn encoding_round_trips_and_health_reads_back() {
        let c = ctx(Window::Minute, FailMode::FailOpen, UP);
        let a = Allowance::cold(&c, 5)
            .add_grant(&grant(10, 3, None, 9), &c, 5)
            .want(4, 60_000);
        assert_eq!(Allowance::decode(&a.encode()), Some(a));
        assert_eq!(Allowance::decode(&[0; 8]), None);
        assert!(!store_down(None));
        assert!(!store_down(Some(&health(None))));
        assert_eq!(down_since(Some(&health(Some(42)))), Some(42));
        assert!(
            store_down(Some(&health(Some(0)))),
            "down at time 0 is still down"
        );
    }
}
