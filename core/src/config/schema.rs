//! The config as it is written: the hierarchy's levels with their limits and policies, the
//! models, routes, signing, the default tenant; each field's default and spelling.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::runs::{RunPolicy, ToolPolicy};

use crate::fleet_config::{BudgetConfig, FailMode, FleetConfig};
use crate::path::AllowedPaths;
use crate::prediction::PredictionConfig;
use crate::price::Prices;
use crate::tokens::Encoding;

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub orgs: Vec<Org>,
    /// Known models; a model missing here is served with `default_encoding` and no context cap,
    /// unless `unknown_models` refuses it.
    #[serde(default)]
    pub models: BTreeMap<String, ModelConfig>,
    /// What a request for a model `models` does not list gets.
    #[serde(default)]
    pub unknown_models: UnknownModels,
    #[serde(default)]
    pub default_encoding: Encoding,
    #[serde(default)]
    pub routes: RoutesConfig,
    #[serde(default)]
    pub estimator: EstimatorConfig,
    /// Largest request body read; larger ones are answered 413.
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: usize,
    /// Forward the client's API key upstream (off: the key stops at the gateway).
    #[serde(default)]
    pub forward_api_key: bool,
    /// Paths served unmetered on enforced routes; any other path that is not metered is refused.
    #[serde(default)]
    pub allowed_paths: AllowedPaths,
    /// Signing of the trusted headers, so the sidecar serves only what this filter vouched
    /// for. Needed in front of the sidecar; without it nothing is signed.
    #[serde(default)]
    pub signing: Option<SigningConfig>,
    /// Who a request is scheduled as when its route does not enforce (off, shadow, outside its
    /// rollout share) and it carries no valid key.
    #[serde(default)]
    pub default_tenant: DefaultTenant,
    /// How long a concurrency slot outlives a request that stopped renewing it (its VM died):
    /// the longest a leaked slot stays taken. Live requests renew every third of it.
    #[serde(default = "default_slot_lease_ms")]
    pub slot_lease_ms: u64,
    /// How much output a request that sets no limit is reserved for ([`crate::prediction`]).
    #[serde(default)]
    pub prediction: PredictionConfig,
    /// The quota service behind fleet-wide limits ([`crate::fleet_config`]).
    #[serde(default)]
    pub fleet: Option<FleetConfig>,
    /// Prices per model per million tokens: what spend budgets count and the ledger records.
    #[serde(default)]
    pub prices: Option<Prices>,
    /// Tier names a `policy.tier` may use besides [`TIERS`].
    #[serde(default)]
    pub tiers: Vec<String>,
}

/// The tiers every config knows: `free` is shed first when the sidecar's queue fills,
/// `standard` is a key's tier when no level sets one, `enterprise` is the examples'. A tier
/// is otherwise a label (on the sidecar's metrics), so a name not known is a typo that would
/// silently change who is shed: refused, unless the config declares it under `tiers`.
pub const TIERS: [&str; 3] = ["free", "standard", "enterprise"];

/// Where the signing secret comes from (never inline) and how long a signature stays valid.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SigningConfig {
    /// Environment variable holding the secret (at least 32 bytes). In Envoy, list it in the
    /// VM's `vm_config.environment_variables.host_env_keys`.
    pub secret_env: String,
    /// Lifetime of a signature: covers the hop to the sidecar plus clock skew between hosts.
    #[serde(default = "default_signature_ttl_ms")]
    pub ttl_ms: u64,
}

fn default_signature_ttl_ms() -> u64 {
    30_000
}

/// The tenant of unauthenticated traffic on routes that promise not to reject: scheduled in
/// its own queue with its own weight, so it cannot take a configured tenant's share or bill it.
/// The filter's quotas do not apply on such routes (they never reject); the sidecar's queue
/// bounds and `active_kv_tokens` do.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DefaultTenant {
    /// Tenant path (one to four ids); its first id must not be a configured org.
    pub path: String,
    pub tier: String,
    pub weight: f64,
    pub priority: Priority,
    /// KV tokens its running requests may hold at once in the sidecar.
    pub active_kv_tokens: Option<u64>,
}

impl Default for DefaultTenant {
    fn default() -> Self {
        DefaultTenant {
            path: "anonymous".into(),
            tier: "free".into(),
            weight: 1.0,
            priority: Priority::Interactive,
            active_kv_tokens: None,
        }
    }
}

fn default_max_body_bytes() -> usize {
    4 * 1024 * 1024
}

fn default_slot_lease_ms() -> u64 {
    30_000
}

/// What the front door does with a model its config does not list.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownModels {
    /// Sent on: the upstream decides.
    #[default]
    Serve,
    /// Refused with OpenAI's 404 `model_not_found` before any quota is taken: `models` lists
    /// every model the upstream serves.
    Refuse,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    #[serde(default)]
    pub encoding: Option<Encoding>,
    #[serde(default)]
    pub max_context_tokens: Option<u64>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EstimatorConfig {
    /// Prompts up to this many bytes may be counted exactly with BPE (the sidecar always does;
    /// the filter where the count decides, see filter/README.md); longer ones are estimated.
    #[serde(default = "default_exact_below_bytes")]
    pub exact_below_bytes: usize,
}

fn default_exact_below_bytes() -> usize {
    8 * 1024
}

impl Default for EstimatorConfig {
    fn default() -> Self {
        EstimatorConfig {
            exact_below_bytes: default_exact_below_bytes(),
        }
    }
}

/// Limits a level may carry; every one is optional.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    pub requests_per_minute: Option<u64>,
    pub input_tokens_per_minute: Option<u64>,
    pub output_tokens_per_minute: Option<u64>,
    pub concurrent_requests: Option<u64>,
    pub max_context_tokens: Option<u64>,
    /// Per request: a larger `max_tokens` is rejected.
    pub max_output_tokens: Option<u64>,
    /// Enforced by the sidecar: KV tokens a tenant may hold at once.
    pub active_kv_tokens: Option<u64>,
    /// Calls a minute that repeat one already sent (its idempotency key, or its request id and
    /// body): past it they are refused with a growing `Retry-After`; first attempts still flow.
    pub retries_per_minute: Option<u64>,
    /// Which of this level's per-minute limits hold across the whole fleet (by limit name),
    /// and what each does while the quota store is unreachable.
    #[serde(default)]
    pub fleet_wide: BTreeMap<String, FailMode>,
    /// Long-window budgets (hour, day, month; tokens or spend), always fleet-wide.
    #[serde(default)]
    pub budgets: Vec<BudgetConfig>,
    /// What a single request whose prompt is larger than this level's whole
    /// `input_tokens_per_minute` gets.
    #[serde(default)]
    pub oversize: Oversize,
}

/// What a request larger than a whole per-minute token limit gets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Oversize {
    /// 429 `request_too_large`, naming the limit and the size, without `Retry-After`: it never
    /// fits, however long the caller waits (OpenAI's answer).
    #[default]
    Refuse,
    /// Let through from a full bucket, leaving a debt the next minute repays: slowed, not
    /// banned.
    Debt,
}

/// The limits `limits.fleet_wide` may name: per-minute rates. Concurrency stays local (a slot
/// is held for a request's life, which a lease renewed every `renew_ms` cannot track).
pub const FLEET_WIDE_LIMITS: [&str; 3] = [
    "requests_per_minute",
    "input_tokens_per_minute",
    "output_tokens_per_minute",
];

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    #[default]
    Interactive,
    Batch,
}

impl Priority {
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Interactive => "interactive",
            Priority::Batch => "batch",
        }
    }
}

/// Scheduling and access policy; unset fields inherit from the level above, except `weight`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    pub tier: Option<String>,
    /// This level's share of its parent's among its siblings (default 1): an org's among the
    /// orgs, a key's among its project's keys. Not inherited.
    pub weight: Option<f64>,
    pub priority: Option<Priority>,
    /// Models this level may call; unset means every model.
    pub models: Option<Vec<String>>,
    /// `max_tokens` assumed when a request sets none. Unset: the request's output is capped only
    /// by the model's context and `max_output_tokens` limits, and that is what is reserved.
    pub default_max_tokens: Option<u64>,
    /// Bounds on an agent's runs; every level's apply (the tightest of each).
    pub runs: Option<RunPolicy>,
    /// The tools a model may be offered and may call; every level's apply.
    pub tools: Option<ToolPolicy>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Org {
    pub id: String,
    /// For people: free text, never a key of anything.
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub policy: Policy,
    #[serde(default)]
    pub workspaces: Vec<Workspace>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workspace {
    pub id: String,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub policy: Policy,
    #[serde(default)]
    pub projects: Vec<Project>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Project {
    pub id: String,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub policy: Policy,
    #[serde(default)]
    pub keys: Vec<Key>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Key {
    pub id: String,
    #[serde(default)]
    pub name: Option<String>,
    /// SHA-256 of the key, lowercase hex (`weir keys new` prints it); during a rotation, the
    /// new key's and the old one's.
    pub sha256: KeyHashes,
    /// A disabled key is refused (401 `key_disabled`) but keeps its place and its counters.
    #[serde(default)]
    pub disabled: bool,
    /// From this time on (RFC 3339, e.g. `2027-01-31T00:00:00Z`) the key is refused (401
    /// `key_expired`).
    #[serde(default)]
    pub expires_at: Option<String>,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub policy: Policy,
    /// The tenant paths (an org, or a level under it, of the key's own org) whose pending tool
    /// calls this key may approve or reject.
    #[serde(default)]
    pub approves: Vec<String>,
}

/// One key hash, or several for one key being rotated.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged, expecting = "must be a key hash or a list of key hashes")]
pub enum KeyHashes {
    One(String),
    Several(Vec<String>),
}

impl KeyHashes {
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        let hashes: &[String] = match self {
            KeyHashes::One(h) => std::slice::from_ref(h),
            KeyHashes::Several(hs) => hs,
        };
        hashes.iter().map(String::as_str)
    }
}

/// Whether weir acts on a route.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// Not weir's route: the request passes as it came (only caller-sent `x-weir-*` headers
    /// are removed), neither authenticated, signed, metered nor counted. What a shared
    /// gateway's other routes get unless the config names them.
    Ignore,
    /// Neither metered nor refused; still signed and scheduled (as the key's tenant when it
    /// is valid, else as the default tenant).
    Off,
    /// Decide and record everything, reject nothing (a missing or unknown key goes on as the
    /// default tenant).
    Shadow,
    #[default]
    Enforce,
}

impl Mode {
    /// The mode as the config spells it (and the filter's metrics label it).
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Ignore => "ignore",
            Mode::Off => "off",
            Mode::Shadow => "shadow",
            Mode::Enforce => "enforce",
        }
    }
}

pub(super) const MODES: [Mode; 4] = [Mode::Ignore, Mode::Off, Mode::Shadow, Mode::Enforce];

/// By hand rather than derived, for what a boolean gets: Kubernetes reads a manifest's bare
/// `off` as `false`, and serde_json's derived message for that was only "expected value".
impl<'de> Deserialize<'de> for Mode {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Mode, D::Error> {
        deserializer.deserialize_any(ModeVisitor)
    }
}

struct ModeVisitor;

impl serde::de::Visitor<'_> for ModeVisitor {
    type Value = Mode;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("one of `ignore`, `off`, `shadow`, `enforce`")
    }

    fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<Mode, E> {
        MODES
            .into_iter()
            .find(|m| m.as_str() == name)
            .ok_or_else(|| E::unknown_variant(name, &["ignore", "off", "shadow", "enforce"]))
    }

    fn visit_bool<E: serde::de::Error>(self, value: bool) -> Result<Mode, E> {
        let why = if value {
            ""
        } else {
            " (in a Kubernetes manifest a bare off is read as false: quote it, \"off\")"
        };
        Err(E::custom(format!(
            "must be one of `ignore`, `off`, `shadow`, `enforce`, not {value}{why}"
        )))
    }
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    #[serde(default)]
    pub mode: Mode,
    /// Share of requests the mode applies to, drawn per request from the id weir generates for
    /// it (no caller can pick its side); the rest are treated as `off`.
    #[serde(default = "default_rollout")]
    pub rollout_percent: u8,
    /// The request header that names a call's agent run (an agent framework's own, say); unset,
    /// `x-weir-run-id`.
    #[serde(default)]
    pub run_id_header: Option<String>,
}

fn default_rollout() -> u8 {
    100
}

impl Default for RouteConfig {
    fn default() -> Self {
        RouteConfig {
            mode: Mode::Enforce,
            rollout_percent: default_rollout(),
            run_id_header: None,
        }
    }
}

fn ignored() -> RouteConfig {
    RouteConfig {
        mode: Mode::Ignore,
        rollout_percent: default_rollout(),
        run_id_header: None,
    }
}

impl Default for RoutesConfig {
    fn default() -> Self {
        RoutesConfig {
            default: ignored(),
            by_name: BTreeMap::new(),
        }
    }
}

/// Per-route behaviour, selected by the Envoy route name (or the `weir` route metadata). A
/// route the config does not name gets `default`, which is `ignore` unless set: on a shared
/// gateway weir acts only on the routes it is configured for.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutesConfig {
    #[serde(default = "ignored")]
    pub default: RouteConfig,
    #[serde(default)]
    pub by_name: BTreeMap<String, RouteConfig>,
}
