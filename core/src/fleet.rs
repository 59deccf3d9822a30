//! What a filter and the quota service say to each other: fleet-wide limits as leases.
//!
//! A limit marked fleet-wide has one budget for the whole fleet, kept in a Redis-protocol store
//! behind the sidecar's quota endpoint (`POST /v1/quota/leases`). Each Envoy spends from a local
//! slice of it, its lease, and asks for more in the background: one call per Envoy per renewal
//! period carries every counter that needs tokens, never one call per request. The body is JSON;
//! the call is signed like forwarded requests ([`crate::signature`]) over its `x-weir-*` headers,
//! which include the body's SHA-256 ([`crate::trusted::BODY_SHA256`]).
//!
//! A counter is a per-minute token bucket (the rate limits: refills continuously, holds one
//! minute of its rate) or a calendar window in UTC (hour, day, month: the budget is the limit,
//! and it resets when the window ends).

use serde::{Deserialize, Serialize};

/// The quota service's path on the sidecar.
pub const PATH: &str = "/v1/quota/leases";

/// Counters one renewal may carry; more wait for the next period.
pub const MAX_COUNTERS: usize = 1_024;

/// The largest `limit`, `want` or `returned` the quota service takes: 2^50 (about 1.1e15), so
/// sums stay exact in its script's doubles (2^53). That is a million billion tokens per window,
/// or a budget of over a billion currency units counted in micro-units.
pub const MAX_AMOUNT: u64 = 1 << 50;

/// The largest fleet-wide limit or budget: a renewal asks for up to twice a limit, and one ask
/// the service refuses refuses the whole renewal, every tenant's counters with it.
pub const MAX_LIMIT: u64 = MAX_AMOUNT / 2;

/// How a fleet-wide counter refills.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Window {
    /// A token bucket of one minute of its rate, refilled continuously.
    Minute,
    /// Calendar windows in UTC: the budget resets at the top of the hour, at midnight, or on
    /// the first of the month.
    Hour,
    Day,
    Month,
}

const HOUR_MS: u64 = 3_600_000;
const DAY_MS: u64 = 24 * HOUR_MS;

impl Window {
    pub fn name(self) -> &'static str {
        match self {
            Window::Minute => "minute",
            Window::Hour => "hour",
            Window::Day => "day",
            Window::Month => "month",
        }
    }

    /// The calendar window holding `now_ms` (Unix ms, UTC) as `[start, end)`; `None` for
    /// [`Window::Minute`], which is a bucket, not a window.
    pub fn bounds(self, now_ms: u64) -> Option<(u64, u64)> {
        match self {
            Window::Minute => None,
            Window::Hour => {
                let start = now_ms - now_ms % HOUR_MS;
                Some((start, start + HOUR_MS))
            }
            Window::Day => {
                let start = now_ms - now_ms % DAY_MS;
                Some((start, start + DAY_MS))
            }
            Window::Month => {
                let (year, month, _) = civil_from_days(now_ms / DAY_MS);
                let (next_year, next_month) = if month == 12 {
                    (year + 1, 1)
                } else {
                    (year, month + 1)
                };
                Some((
                    days_from_civil(year, month, 1) * DAY_MS,
                    days_from_civil(next_year, next_month, 1) * DAY_MS,
                ))
            }
        }
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm), for
/// dates from 1970 on.
fn days_from_civil(year: u64, month: u64, day: u64) -> u64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day count since 1970-01-01: (year, month 1–12, day 1–31).
pub(crate) fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// A renewal: every counter this Envoy needs tokens for, gives back, or holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRequest {
    pub counters: Vec<CounterAsk>,
    /// Who sends it. With it the store keeps what each Envoy holds unspent of a calendar
    /// window's budget ([`CounterAsk::held`]) and takes back the holding of one that has not
    /// renewed within its `hold_ms` (stopped, killed, or cut off from the store): an Envoy's
    /// lease is not lost to the fleet until the window resets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<Holder>,
}

/// The Envoy behind a renewal.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Holder {
    /// Random per Envoy start ([`MAX_HOLDER_ID_LEN`] hex digits at most).
    pub id: String,
    /// How long its holdings stand without another renewal from it.
    pub hold_ms: u64,
}

/// Longest [`Holder::id`] the quota service takes.
pub const MAX_HOLDER_ID_LEN: usize = 32;

/// Shortest and longest [`Holder::hold_ms`] the quota service takes: a second, a day.
pub const MIN_HOLD_MS: u64 = 1_000;
pub const MAX_HOLD_MS: u64 = 86_400_000;

/// One counter's ask. `limit` and `window` come from the filter's configuration (the service
/// keeps no tenant configuration of its own); the store's state is clamped to them, so a
/// changed limit takes effect at the next renewal.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CounterAsk {
    /// The counter's name, the same on every Envoy (`weir:e:<tenant path>:<limit>`).
    pub key: String,
    pub window: Window,
    /// Tokens (or micro-units of currency) per minute for [`Window::Minute`], per window else.
    pub limit: u64,
    /// How much this Envoy would like granted now (0: only give back).
    pub want: u64,
    /// Unspent tokens of an earlier grant this Envoy returns (its lease lapsed unused).
    #[serde(default)]
    pub returned: u64,
    /// For a calendar window: the start of the window `returned` was granted in; tokens from an
    /// earlier window are not added back.
    #[serde(default)]
    pub returned_window_start_ms: Option<u64>,
    /// For a calendar window: what this Envoy's lease holds unspent of the current window once
    /// `returned` is given back, before this ask's grant. Sent every period while it holds
    /// any, so the store can tell a holder that stopped from one that is still spending.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<u64>,
    /// The calendar window `held` belongs to: a report that reaches the store after that
    /// window ended is not filed under the next one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_window_start_ms: Option<u64>,
}

/// The service's answer: one grant per ask, in the same order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseResponse {
    pub grants: Vec<Grant>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    pub key: String,
    /// Granted now: at most `want`, and never more than the store holds.
    pub granted: u64,
    /// What the store holds after this grant (for rate-limit headers and budget errors).
    pub remaining: u64,
    /// For a calendar window: when it ends and the budget resets; unspent grants lapse then.
    /// For a bucket: when it would be full again.
    pub resets_ms: u64,
    /// For a calendar window: its start (to give unspent tokens back to the right window).
    #[serde(default)]
    pub window_start_ms: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2026-12-02T03:43:20Z, as Unix ms.
    const DEC_2_2026: u64 = 1_796_183_000_000;

    #[test]
    fn calendar_windows_end_at_the_top_of_the_hour_at_midnight_and_on_the_first() {
        let (start, end) = Window::Hour.bounds(DEC_2_2026).unwrap_or_default();
        assert_eq!((start % HOUR_MS, end - start), (0, HOUR_MS));
        assert!(start <= DEC_2_2026 && DEC_2_2026 < end);
        let (start, end) = Window::Day.bounds(DEC_2_2026).unwrap_or_default();
        assert_eq!((start, end), (1_796_169_600_000, 1_796_256_000_000));
        // December 2026 runs from 2026-12-01 to 2027-01-01: across the year boundary.
        let (start, end) = Window::Month.bounds(DEC_2_2026).unwrap_or_default();
        assert_eq!((start, end), (1_796_083_200_000, 1_798_761_600_000));
        // February of a leap year has 29 days: 2028-02-10 → [2028-02-01, 2028-03-01).
        let (start, end) = Window::Month.bounds(1_833_753_600_000).unwrap_or_default();
        assert_eq!((start, end), (1_832_976_000_000, 1_835_481_600_000));
        assert_eq!((end - start) / DAY_MS, 29);
        assert_eq!(Window::Minute.bounds(DEC_2_2026), None);
    }

    #[test]
    fn civil_dates_round_trip_over_decades() {
        for days in (0..40_000).step_by(13) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
        assert_eq!(civil_from_days(0), (1970, 1, 1));
    }
}
