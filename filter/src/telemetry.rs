//! What the filter counts (Envoy stats `wasmcustom.weir.*`) and what it leaves for access logs
//! (filter state `wasm.weir.*`). Counts and labels only: never prompt or response content.

use proxy_wasm::types::MetricType;
use weir_core::config::Mode;
use weir_core::outcome;

use crate::exchange::Host;
use crate::host::Metrics;

pub const OUTCOMES: [&str; 5] = [
    outcome::OK,
    "rejected",
    outcome::UPSTREAM_ERROR,
    outcome::CANCELLED,
    "passthrough",
];

pub const REJECTIONS: [&str; 28] = [
    "invalid_idempotency_key",
    "missing_api_key",
    "invalid_api_key",
    "key_disabled",
    "key_expired",
    "invalid_path",
    "unknown_path",
    "not_metered",
    "method_not_allowed",
    "missing_body",
    "body_too_large",
    "unsupported_encoding",
    "malformed_body",
    "invalid_request",
    "model_not_found",
    "model_not_allowed",
    "max_tokens_over_limit",
    "context_length_exceeded",
    "requests_per_minute",
    "input_tokens_per_minute",
    "output_tokens_per_minute",
    "concurrent_requests",
    "quota_unavailable",
    "budget_exceeded",
    "contended",
    "internal",
    "retry_budget_exceeded",
    "side_effect_retry_requires_idempotency_key",
];

pub const TOKENS_IN: &str = "weir.tokens.input";
pub const TOKENS_OUT: &str = "weir.tokens.output";
/// |estimate − engine count| / engine count, in percent, per request with engine usage.
pub const ESTIMATE_ERROR: &str = "weir.estimate.error_pct";
/// A predicted answer's length over its prediction, in percent (100: exact), per settled request
/// whose output was predicted.
pub const PREDICTION_ACTUAL_PCT: &str = "weir.prediction.actual_pct";
/// Output tokens generated past their prediction, charged when they settled: what the bound on
/// overshoot is made of.
pub const PREDICTION_OVERRUN: &str = "weir.prediction.overrun_tokens";
/// Tokens currently held by reservations on this Envoy.
pub const RESERVED: &str = "weir.reserved_tokens";
pub const SHADOW_WOULD_REJECT: &str = "weir.shadow.would_reject";
pub const SETTLE_CONFLICTS: &str = "weir.settle.conflicts";
/// Lease renewals answered by the quota service, and those that failed (store down).
pub const FLEET_RENEWALS: &str = "weir.fleet.renewals";
pub const FLEET_RENEWAL_FAILURES: &str = "weir.fleet.renewal_failures";
/// Requests that found no lease and asked the quota service at once.
pub const FLEET_LEASES_ASKED_AT_ONCE: &str = "weir.fleet.leases_asked_at_once";
/// Settles of runs' fleet-wide budgets a worker dropped (its queue full, or the call not
/// sent): those calls stay charged what they reserved.
pub const FLEET_RUN_SETTLES_DROPPED: &str = "weir.fleet.run_settles_dropped";
/// Metered responses the upstream compressed anyway: charged their reservation.
pub const UNREADABLE_RESPONSES: &str = "weir.meter.unreadable";

pub fn request_metric(outcome: &str) -> String {
    format!("weir.requests.{outcome}")
}

/// Refusals by reason: `weir.rejections.<reason>` for those answered, and
/// `weir.shadow.rejections.<reason>` for those a shadow route would have answered, kept apart so
/// a rollout can set what shadow mode would refuse beside what enforcement does refuse.
pub fn rejection_metric(reason: &str, shadow: bool) -> String {
    if shadow {
        format!("weir.shadow.rejections.{reason}")
    } else {
        format!("weir.rejections.{reason}")
    }
}

/// What the filter made of one request it acted on, counted per route and mode as
/// `weir.filter.decisions.route.<route>.mode.<mode>.decision.<decision>` (Envoy's `stats_tags`
/// turn it into `weir_filter_decisions{route,mode,decision}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Metered and let through.
    Admitted,
    /// Refused (enforce).
    Rejected,
    /// Let through, but enforcement would have refused it (shadow).
    WouldReject,
    /// Let through without metering: the route is off, the request fell outside its rollout
    /// share, or its path has nothing to meter (models, health).
    Unmetered,
}

impl Decision {
    fn as_str(self) -> &'static str {
        match self {
            Decision::Admitted => "admitted",
            Decision::Rejected => "rejected",
            Decision::WouldReject => "would_reject",
            Decision::Unmetered => "unmetered",
        }
    }
}

/// The counter of `decision` on a route (its label from [`route_label`]) in `mode`.
pub fn decision_metric(route: &str, mode: Mode, decision: Decision) -> String {
    format!(
        "weir.filter.decisions.route.{route}.mode.{}.decision.{}",
        mode.as_str(),
        decision.as_str()
    )
}

/// The longest route label ([`route_label`]).
pub const MAX_ROUTE_LABEL: usize = 128;

/// A route's name as a metric label: `default` for a route without one; lower case, and any
/// character but `[a-z0-9_-]` as `_`, so a name cannot add a dot (a stat-name segment) and
/// shift the segments Envoy's `stats_tags` extract. Route names come from the operator's route
/// table, so the labels are as few as its routes. At most [`MAX_ROUTE_LABEL`] characters: the
/// label is vouched as `x-weir-route`, which the sidecar refuses past 255 (every request on a
/// route of a longer name was answered 401 `untrusted_request`).
pub fn route_label(name: Option<&str>) -> String {
    match name {
        None | Some("") => "default".to_owned(),
        Some(name) => name
            .chars()
            .take(MAX_ROUTE_LABEL)
            .map(|c| match c.to_ascii_lowercase() {
                c @ ('a'..='z' | '0'..='9' | '_' | '-') => c,
                _ => '_',
            })
            .collect(),
    }
}

/// What the run, tool and retry policies refused, by tenant.
pub mod runs;

pub fn define() -> Metrics {
    let mut m = Metrics::default();
    for outcome in OUTCOMES {
        m.define(MetricType::Counter, &request_metric(outcome));
    }
    for reason in REJECTIONS {
        for shadow in [false, true] {
            m.define(MetricType::Counter, &rejection_metric(reason, shadow));
        }
    }
    for counter in [
        TOKENS_IN,
        TOKENS_OUT,
        SHADOW_WOULD_REJECT,
        SETTLE_CONFLICTS,
        UNREADABLE_RESPONSES,
        PREDICTION_OVERRUN,
        FLEET_RENEWALS,
        FLEET_RENEWAL_FAILURES,
        FLEET_LEASES_ASKED_AT_ONCE,
        FLEET_RUN_SETTLES_DROPPED,
    ] {
        m.define(MetricType::Counter, counter);
    }
    m.define(MetricType::Gauge, RESERVED);
    m.define(MetricType::Histogram, ESTIMATE_ERROR);
    m.define(MetricType::Histogram, PREDICTION_ACTUAL_PCT);
    m
}

/// One request's record for the access log, read as `%FILTER_STATE(wasm.weir.<field>:PLAIN)%`.
pub struct AccessRecord<'a> {
    pub tenant: &'a str,
    /// The API called (`chat_completions`, `responses`, `messages`, ...), `-` if none.
    pub api: &'a str,
    pub model: &'a str,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub estimate: u64,
    pub outcome: &'a str,
}

impl AccessRecord<'_> {
    pub fn publish(&self, host: &impl Host) {
        host.set_filter_state("weir.tenant", self.tenant);
        host.set_filter_state("weir.api", self.api);
        host.set_filter_state("weir.model", &log_field(self.model));
        host.set_filter_state("weir.tokens_in", &self.tokens_in.to_string());
        host.set_filter_state("weir.tokens_out", &self.tokens_out.to_string());
        host.set_filter_state("weir.estimate", &self.estimate.to_string());
        host.set_filter_state("weir.outcome", self.outcome);
    }
}

/// A caller's string (the model it named) as one field of the access log line: visible ASCII
/// only, anything else `?` (a line break would end the line and start one the caller wrote, a
/// space would start a field), and at most [`weir_core::trusted::MAX_ID_LEN`] bytes, `...`
/// marking the cut.
fn log_field(value: &str) -> String {
    let mut field: String = value
        .bytes()
        .take(weir_core::trusted::MAX_ID_LEN)
        .map(|b| {
            if b.is_ascii_graphic() {
                char::from(b)
            } else {
                '?'
            }
        })
        .collect();
    if value.len() > weir_core::trusted::MAX_ID_LEN {
        field.push_str("...");
    }
    field
}

#[cfg(test)]
mod tests {
    use super::{Decision, Mode, decision_metric, log_field, route_label};

    #[test]
    fn a_caller_s_model_is_one_bounded_field_of_the_access_log() {
        assert_eq!(log_field("llama-3.1-8b"), "llama-3.1-8b");
        assert_eq!(log_field("m\nforged line\r"), "m?forged?line?");
        assert_eq!(log_field("é"), "??");
        let long = log_field(&"x".repeat(10_000));
        assert_eq!(long.len(), weir_core::trusted::MAX_ID_LEN + 3);
    }

    #[test]
    fn route_labels_cannot_add_stat_name_segments() {
        assert_eq!(route_label(Some("chat-v1_2")), "chat-v1_2");
        assert_eq!(route_label(Some("Chat.Eu:443/x")), "chat_eu_443_x");
        assert_eq!(route_label(Some("é")), "_");
        assert_eq!(route_label(Some("")), "default");
        assert_eq!(route_label(None), "default");
    }

    #[test]
    fn a_long_route_name_is_a_label_the_sidecar_accepts() {
        let label = route_label(Some(&"r".repeat(300)));
        assert!(weir_core::trusted::is_id(&label), "{} bytes", label.len());
    }

    #[test]
    fn decision_metrics_name_route_mode_and_decision() {
        assert_eq!(
            decision_metric("shadowed", Mode::Shadow, Decision::WouldReject),
            "weir.filter.decisions.route.shadowed.mode.shadow.decision.would_reject"
        );
    }
}
