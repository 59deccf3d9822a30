//! The `fleet` section of the configuration: where the quota service is and how leases are
//! sized, plus the per-limit choice of what to do while the store is unreachable.
//!
//! A limit named in a level's `limits.fleet_wide` holds across every Envoy of the fleet: the
//! Envoy spends from a lease ([`crate::allowance`]) that a background renewal tops up from the
//! quota service. Lease calls are signed, so fleet-wide limits need `signing` as well.

use serde::Deserialize;

use crate::fleet::{self, Window};
use crate::price;

/// What a fleet-wide counter does once its lease is spent and the store cannot be reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailMode {
    /// Keep serving from a conservative local share (`fleet.fail_open_share` of the limit).
    FailOpen,
    /// Refuse with 429 `quota_unavailable` until the store answers again.
    FailClosed,
}

/// Top-level `fleet`: the quota service and lease sizing.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    /// The Envoy cluster of the quota service (the sidecar's).
    pub cluster: String,
    /// The `:authority` of lease calls.
    #[serde(default = "default_authority")]
    pub authority: String,
    /// How often one worker per Envoy renews every lease that needs tokens.
    #[serde(default = "default_renew_ms")]
    pub renew_ms: u64,
    /// A renewal that has not answered by then counts as the store being down.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// How long a lease lives without a new grant or a spend; its unspent tokens are then given
    /// back, and the counter's next request meets a cold start. Default: one minute, so a tenant
    /// that calls at least once a minute never waits for a lease (what idle Envoys hold unspent
    /// meanwhile is at most a lease each, already in the overshoot bound).
    #[serde(default)]
    pub lease_ttl_ms: Option<u64>,
    /// Largest ask, as a fraction of the limit: bounds what one Envoy can hold unspent.
    #[serde(default = "default_max_lease_fraction")]
    pub max_lease_fraction: f64,
    /// Smallest ask of a counter in use, as a fraction of the limit, so a slow start still
    /// gets a useful lease.
    #[serde(default = "default_min_lease_fraction")]
    pub min_lease_fraction: f64,
    /// While the store is down, what a `fail_open` counter may spend on this Envoy alone, as a
    /// fraction of its limit per minute.
    #[serde(default = "default_fail_open_share")]
    pub fail_open_share: f64,
}

fn default_authority() -> String {
    "weir-quota".into()
}

fn default_renew_ms() -> u64 {
    250
}

fn default_timeout_ms() -> u64 {
    1_000
}

fn default_max_lease_fraction() -> f64 {
    0.1
}

fn default_min_lease_fraction() -> f64 {
    0.01
}

fn default_fail_open_share() -> f64 {
    0.1
}

/// What the request path needs of the fleet config, resolved once and carried by every tenant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LeaseTerms {
    pub renew_ms: u64,
    pub lease_ttl_ms: u64,
    /// How often a lease that needs nothing still tells the store what it holds of a calendar
    /// window: a third of [`FleetConfig::hold_ms`], so a holder that lives is never taken for
    /// one that stopped.
    pub report_ms: u64,
    pub max_lease_fraction: f64,
    pub min_lease_fraction: f64,
    pub fail_open_share: f64,
}

/// How long an unused lease is kept by default (`lease_ttl_ms`).
const DEFAULT_LEASE_TTL_MS: u64 = 60_000;

impl FleetConfig {
    pub fn terms(&self) -> LeaseTerms {
        LeaseTerms {
            renew_ms: self.renew_ms,
            lease_ttl_ms: self
                .lease_ttl_ms
                .unwrap_or(DEFAULT_LEASE_TTL_MS.max(self.renew_ms)),
            report_ms: (self.hold_ms() / 3).max(1),
            max_lease_fraction: self.max_lease_fraction,
            min_lease_fraction: self.min_lease_fraction,
            fail_open_share: self.fail_open_share,
        }
    }

    /// How long the store keeps what this Envoy holds of a calendar window without hearing
    /// from it ([`crate::fleet::Holder`]): ten renewal periods (at least 5 s) and a call's
    /// timeout. A holder renews every period while it holds any, so only one that stopped, or
    /// has been cut off from the store that long, has its holding taken back.
    pub fn hold_ms(&self) -> u64 {
        self.renew_ms
            .saturating_mul(10)
            .max(5_000)
            .saturating_add(self.timeout_ms)
            .min(crate::fleet::MAX_HOLD_MS)
    }

    /// The field at fault and why, for a section that cannot work.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if self.cluster.is_empty() {
            return Err(("fleet.cluster", "name the quota service's cluster".into()));
        }
        if !(10..=60_000).contains(&self.renew_ms) {
            return Err(("fleet.renew_ms", "must be between 10 and 60000".into()));
        }
        if !(1..=60_000).contains(&self.timeout_ms) {
            return Err(("fleet.timeout_ms", "must be between 1 and 60000".into()));
        }
        if self.lease_ttl_ms.is_some_and(|t| t < self.renew_ms) {
            return Err((
                "fleet.lease_ttl_ms",
                "must be at least renew_ms: a lease would lapse before its renewal".into(),
            ));
        }
        let fraction = |x: f64| x.is_finite() && x > 0.0 && x <= 1.0;
        for (field, value) in [
            ("fleet.max_lease_fraction", self.max_lease_fraction),
            ("fleet.min_lease_fraction", self.min_lease_fraction),
        ] {
            if !fraction(value) {
                return Err((field, "must be a fraction in (0, 1]".into()));
            }
        }
        if self.min_lease_fraction > self.max_lease_fraction {
            return Err((
                "fleet.min_lease_fraction",
                "must not exceed max_lease_fraction".into(),
            ));
        }
        if !(self.fail_open_share.is_finite() && (0.0..=1.0).contains(&self.fail_open_share)) {
            return Err((
                "fleet.fail_open_share",
                "must be a fraction in [0, 1]".into(),
            ));
        }
        Ok(())
    }
}

/// What a budget counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Measure {
    InputTokens,
    OutputTokens,
    /// Input and output tokens together.
    Tokens,
    /// Cost in micro-units of `prices.currency` ([`crate::price`]).
    Spend,
}

impl Measure {
    pub fn name(self) -> &'static str {
        match self {
            Measure::InputTokens => "input_tokens",
            Measure::OutputTokens => "output_tokens",
            Measure::Tokens => "tokens",
            Measure::Spend => "spend",
        }
    }
}

/// One entry of a level's `limits.budgets`: a long-window allowance, always fleet-wide (it
/// lives in the store).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetConfig {
    pub window: Window,
    #[serde(default)]
    pub input_tokens: Option<u64>,
    #[serde(default)]
    pub output_tokens: Option<u64>,
    #[serde(default)]
    pub tokens: Option<u64>,
    /// An amount of the currency.
    #[serde(default)]
    pub spend: Option<f64>,
    /// Money fails closed unless told otherwise.
    #[serde(default = "fail_closed")]
    pub on_store_down: FailMode,
}

fn fail_closed() -> FailMode {
    FailMode::FailClosed
}

impl BudgetConfig {
    /// What it counts and its limit (tokens, or micro-units for spend), if exactly one measure
    /// is set and positive.
    pub fn measure(&self) -> Result<(Measure, u64), String> {
        let set: Vec<(Measure, u64)> = [
            (Measure::InputTokens, self.input_tokens),
            (Measure::OutputTokens, self.output_tokens),
            (Measure::Tokens, self.tokens),
            (
                Measure::Spend,
                self.spend
                    .filter(|s| s.is_finite() && *s > 0.0 && *s <= 1e12)
                    .map(|s| (s * price::MICROS).round() as u64),
            ),
        ]
        .into_iter()
        .filter_map(|(m, v)| v.map(|v| (m, v)))
        .collect();
        match set.as_slice() {
            [(_, 0)] => Err("a budget of 0 refuses every request".into()),
            [(_, above)] if *above > fleet::MAX_LIMIT => Err(format!(
                "a budget is at most {} (tokens, or micro-units of spend)",
                fleet::MAX_LIMIT
            )),
            [one] if self.window != Window::Minute => Ok(*one),
            [_] => Err("window: one of hour, day, month (per-minute limits are rates)".into()),
            _ if self.spend.is_some() => Err("spend must be a positive amount, alone".into()),
            _ => Err("exactly one of input_tokens, output_tokens, tokens or spend".into()),
        }
    }
}
