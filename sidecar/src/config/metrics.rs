//! The `metrics` section: tenant labels' depth, the fairness window, OTLP export.

use serde::Deserialize;

/// The `metrics` section of the config.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// How deep tenant labels go: `org` (default), `workspace` or `project`; never the key.
    #[serde(default)]
    pub tenant_depth: TenantDepth,
    /// Push the metrics to an OpenTelemetry collector too (off unless set).
    #[serde(default)]
    pub otlp: Option<OtlpConfig>,
    /// How long a window the live fairness figures are computed over.
    #[serde(default = "default_fairness_window_ms")]
    pub fairness_window_ms: u64,
}

fn default_fairness_window_ms() -> u64 {
    10_000
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            tenant_depth: TenantDepth::default(),
            otlp: None,
            fairness_window_ms: default_fairness_window_ms(),
        }
    }
}

/// How deep into a tenant's path (`org/workspace/project/key`) metric labels go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TenantDepth {
    /// `acme` (the default: fewest series).
    #[default]
    Org,
    /// `acme/search`.
    Workspace,
    /// `acme/search/ranking`.
    Project,
}

/// The `metrics.otlp` section.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OtlpConfig {
    /// The collector's OTLP/HTTP endpoint (`http://collector:4318`); `/v1/metrics` is added
    /// when it names no path.
    pub endpoint: String,
    /// How often the metrics are pushed.
    #[serde(default = "default_interval_ms")]
    pub interval_ms: u64,
}

pub(crate) fn default_interval_ms() -> u64 {
    10_000
}
