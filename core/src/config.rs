//! The gateway's configuration: the org → workspace → project → key hierarchy with limits and
//! policy at every level, the models it knows, and how routes opt in.
//!
//! A config is YAML or JSON (Istio hands a `WasmPlugin`'s `pluginConfig` to the module as JSON;
//! plain Envoy users write YAML). Parsing names the offending field
//! (`orgs[0].workspaces[1].limits.requests_per_minute: …`), and [`Config::directory`] resolves
//! every key into the [`Tenant`] it authenticates, so the request path only does a hash lookup.
//!
//! Ids are what counters, fair shares and prefix-cache salts are keyed by: keep a level's `id`
//! when renaming it (its `name` is free text), and rotate a key by giving its entry the new hash
//! beside the old (`sha256` takes a list) — the key's counters stay where they are.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use serde::Deserialize;

use crate::fleet;
use crate::fleet_config::{BudgetConfig, FailMode, FleetConfig, LeaseTerms};
use crate::parse_error;
use crate::path::AllowedPaths;
use crate::prediction::PredictionConfig;
use crate::price::Prices;
use crate::tokens::Encoding;
use crate::trusted;

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

/// Why a known key is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyRefusal {
    Disabled,
    Expired,
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

const MODES: [Mode; 4] = [Mode::Ignore, Mode::Off, Mode::Shadow, Mode::Enforce];

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
}

fn default_rollout() -> u8 {
    100
}

impl Default for RouteConfig {
    fn default() -> Self {
        RouteConfig {
            mode: Mode::Enforce,
            rollout_percent: default_rollout(),
        }
    }
}

fn ignored() -> RouteConfig {
    RouteConfig {
        mode: Mode::Ignore,
        rollout_percent: default_rollout(),
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

/// A configuration that does not hold together; `field` is a path into the JSON.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

fn field_error(path: &serde_path_to_error::Path, error: &impl std::fmt::Display) -> ConfigError {
    let path = path.to_string();
    let message = parse_error::plain(&path, &error.to_string());
    let field = if path == "." || path == "?" {
        "config".into()
    } else {
        path
    };
    invalid(field, message)
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        message: message.into(),
    }
}

/// One level of the hierarchy on a key's path, with its own limits.
#[derive(Clone, Debug, PartialEq)]
pub struct Level {
    /// Slash-joined ids from the org down, e.g. `acme/research`; unique per level.
    pub path: String,
    pub limits: Limits,
}

/// Everything a key authenticates as, resolved through its ancestors.
#[derive(Clone, Debug, PartialEq)]
pub struct Tenant {
    pub org: String,
    pub workspace: String,
    pub project: String,
    pub key: String,
    /// Org first, key last.
    pub levels: Vec<Level>,
    pub tier: String,
    /// Scheduling weight of each level of the path among its siblings, org first.
    pub weights: Vec<f64>,
    pub priority: Priority,
    pub models: Option<Vec<String>>,
    pub default_max_tokens: Option<u64>,
    pub disabled: bool,
    /// When the key expires, in ms since the Unix epoch.
    pub expires_ms: Option<u64>,
    /// How leases of its fleet-wide limits are sized, when the config has a `fleet` section.
    pub lease_terms: Option<LeaseTerms>,
}

impl Tenant {
    /// Why the key may not be used at `now_ms`, if it may not.
    pub fn refusal(&self, now_ms: u64) -> Option<KeyRefusal> {
        if self.disabled {
            Some(KeyRefusal::Disabled)
        } else if self.expires_ms.is_some_and(|t| now_ms >= t) {
            Some(KeyRefusal::Expired)
        } else {
            None
        }
    }

    /// `org/workspace/project/key`: the tenant path passed to the sidecar.
    pub fn path(&self) -> &str {
        self.levels.last().map_or("", |l| l.path.as_str())
    }

    /// The tightest value of a per-request limit along the path.
    pub fn tightest(&self, limit: impl Fn(&Limits) -> Option<u64>) -> Option<u64> {
        self.levels.iter().filter_map(|l| limit(&l.limits)).min()
    }

    pub fn may_use(&self, model: &str) -> bool {
        self.models
            .as_ref()
            .is_none_or(|m| m.iter().any(|allowed| allowed == model))
    }
}

/// Keys by hash, ready for the request path. Tenants are shared, so a request holds one by
/// reference count rather than by copy.
#[derive(Clone, Debug, Default)]
pub struct Directory {
    by_hash: HashMap<String, Arc<Tenant>>,
}

impl Directory {
    pub fn lookup(&self, key_sha256: &str) -> Option<&Arc<Tenant>> {
        self.by_hash.get(key_sha256)
    }

    pub fn tenants(&self) -> impl Iterator<Item = &Tenant> {
        self.by_hash.values().map(Arc::as_ref)
    }

    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }
}

impl Config {
    /// Parses and validates a configuration, YAML or JSON; errors name the field.
    pub fn parse(text: &[u8]) -> Result<Config, ConfigError> {
        let config: Config = if text.trim_ascii_start().starts_with(b"{") {
            let de = &mut serde_json::Deserializer::from_slice(text);
            serde_path_to_error::deserialize(de).map_err(|e| field_error(e.path(), e.inner()))?
        } else {
            let de = serde_yaml_ng::Deserializer::from_slice(text);
            serde_path_to_error::deserialize(de).map_err(|e| field_error(e.path(), e.inner()))?
        };
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        for (p, route) in self
            .routes
            .by_name
            .iter()
            .map(|(name, r)| (format!("routes.by_name.{name}"), r))
            .chain([("routes.default".to_owned(), &self.routes.default)])
        {
            if route.rollout_percent > 100 {
                return Err(invalid(
                    format!("{p}.rollout_percent"),
                    "must be between 0 and 100",
                ));
            }
        }
        if self.max_body_bytes == 0 {
            return Err(invalid("max_body_bytes", "must be positive"));
        }
        if self.unknown_models == UnknownModels::Refuse && self.models.is_empty() {
            return Err(invalid(
                "unknown_models",
                "`refuse` with no `models` listed refuses every model; list the models served",
            ));
        }
        if let Some(signing) = &self.signing {
            if signing.secret_env.is_empty() {
                return Err(invalid(
                    "signing.secret_env",
                    "name an environment variable",
                ));
            }
            if !(1..=300_000).contains(&signing.ttl_ms) {
                return Err(invalid("signing.ttl_ms", "must be between 1 and 300000"));
            }
        }
        self.validate_default_tenant()?;
        if self.slot_lease_ms < 1_000 {
            return Err(invalid("slot_lease_ms", "must be at least 1000"));
        }
        self.prediction
            .validate()
            .map_err(|(field, message)| invalid(field, message))?;
        self.validate_fleet()?;
        let tiers = self.known_tiers()?;
        let mut seen_hashes = HashSet::new();
        let mut seen_ids = HashSet::new();
        for (o, org) in self.orgs.iter().enumerate() {
            let at = format!("orgs[{o}]");
            let level = (&org.id, &org.limits, &org.policy);
            check_level(&at, level, &mut seen_ids, "", &tiers)?;
            for (w, ws) in org.workspaces.iter().enumerate() {
                let at = format!("{at}.workspaces[{w}]");
                let level = (&ws.id, &ws.limits, &ws.policy);
                check_level(&at, level, &mut seen_ids, &org.id, &tiers)?;
                let ws_path = format!("{}/{}", org.id, ws.id);
                for (p, project) in ws.projects.iter().enumerate() {
                    let at = format!("{at}.projects[{p}]");
                    let level = (&project.id, &project.limits, &project.policy);
                    check_level(&at, level, &mut seen_ids, &ws_path, &tiers)?;
                    let project_path = format!("{ws_path}/{}", project.id);
                    for (k, key) in project.keys.iter().enumerate() {
                        let at = format!("{at}.keys[{k}]");
                        let level = (&key.id, &key.limits, &key.policy);
                        check_level(&at, level, &mut seen_ids, &project_path, &tiers)?;
                        check_key(&at, key, &mut seen_hashes)?;
                        let chain = [
                            (&org.id, &org.limits, &org.policy),
                            (&ws.id, &ws.limits, &ws.policy),
                            (&project.id, &project.limits, &project.policy),
                            (&key.id, &key.limits, &key.policy),
                        ];
                        check_admits_something(&at, &resolve(&chain))?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The `fleet` section, and that fleet-wide limits have one (and signing: lease calls are
    /// signed like forwarded requests).
    fn validate_fleet(&self) -> Result<(), ConfigError> {
        if let Some(fleet) = &self.fleet {
            fleet
                .check()
                .map_err(|(field, message)| invalid(field, message))?;
        }
        let levels = self.orgs.iter().flat_map(|o| {
            let ws = o.workspaces.iter().flat_map(|w| {
                let projects = w
                    .projects
                    .iter()
                    .flat_map(|p| p.keys.iter().map(|k| &k.limits).chain([&p.limits]));
                projects.chain([&w.limits])
            });
            ws.chain([&o.limits])
        });
        if let Some(prices) = &self.prices {
            prices
                .check()
                .map_err(|(field, message)| invalid(field, message))?;
        }
        let levels: Vec<&Limits> = levels.collect();
        let spends = levels
            .iter()
            .flat_map(|l| &l.budgets)
            .any(|b| b.spend.is_some());
        if spends && self.prices.as_ref().is_none_or(|p| p.default.is_none()) {
            return Err(invalid(
                "prices.default",
                "a spend budget needs a price for every request: set prices.default",
            ));
        }
        let fleet_wide = levels
            .iter()
            .any(|l| !l.fleet_wide.is_empty() || !l.budgets.is_empty());
        if fleet_wide && self.fleet.is_none() {
            return Err(invalid(
                "fleet",
                "limits.fleet_wide and limits.budgets need a fleet section naming the quota \
                 service's cluster",
            ));
        }
        if fleet_wide && self.signing.is_none() {
            return Err(invalid(
                "signing",
                "limits.fleet_wide and limits.budgets need signing: lease calls to the quota \
                 service are signed",
            ));
        }
        // Each Envoy renews at most this many counters; one left out would be refused for
        // good, whichever tenant's counters (or an attacker's traffic) filled the set first.
        let counters: usize = levels
            .iter()
            .map(|l| l.fleet_wide.len() + l.budgets.len())
            .sum();
        if counters > fleet::MAX_COUNTERS {
            return Err(invalid(
                "fleet",
                format!(
                    "{counters} fleet-wide limits and budgets; an Envoy renews at most {} \
                     (set them at a higher level, where its keys share one)",
                    fleet::MAX_COUNTERS
                ),
            ));
        }
        Ok(())
    }

    fn validate_default_tenant(&self) -> Result<(), ConfigError> {
        let d = &self.default_tenant;
        if !trusted::is_tenant_path(&d.path) {
            return Err(invalid(
                "default_tenant.path",
                "one to four ids (letters, digits, '-', '_', '.') joined by '/'",
            ));
        }
        let first = d.path.split('/').next().unwrap_or_default();
        if self.orgs.iter().any(|org| org.id == first) {
            return Err(invalid(
                "default_tenant.path",
                format!("'{first}' is a configured org: anonymous traffic would bill it"),
            ));
        }
        check_tier("default_tenant.tier", &d.tier, &self.known_tiers()?)?;
        if !trusted::WEIGHT_RANGE.contains(&d.weight) {
            return Err(invalid("default_tenant.weight", weight_message()));
        }
        Ok(())
    }

    /// [`TIERS`] and the tiers the config declares, each declared one well-formed.
    fn known_tiers(&self) -> Result<Vec<&str>, ConfigError> {
        for (i, tier) in self.tiers.iter().enumerate() {
            if !trusted::is_level_id(tier) {
                return Err(invalid(
                    format!("tiers[{i}]"),
                    format!("'{tier}': letters, digits, '-', '_', '.'"),
                ));
            }
        }
        Ok(TIERS
            .into_iter()
            .chain(self.tiers.iter().map(String::as_str))
            .collect())
    }

    /// The default tenant as a [`Tenant`] of one level.
    pub fn default_tenant(&self) -> Tenant {
        let d = &self.default_tenant;
        Tenant {
            org: d.path.split('/').next().unwrap_or_default().to_owned(),
            workspace: String::new(),
            project: String::new(),
            key: String::new(),
            levels: vec![Level {
                path: d.path.clone(),
                limits: Limits {
                    active_kv_tokens: d.active_kv_tokens,
                    ..Limits::default()
                },
            }],
            tier: d.tier.clone(),
            // Its own top-level node, weighted against the orgs.
            weights: d
                .path
                .split('/')
                .enumerate()
                .map(|(i, _)| if i == 0 { d.weight } else { 1.0 })
                .collect(),
            priority: d.priority,
            models: None,
            default_max_tokens: None,
            disabled: false,
            expires_ms: None,
            lease_terms: None,
        }
    }

    /// Resolves every key into the tenant it authenticates as.
    pub fn directory(&self) -> Directory {
        let mut by_hash = HashMap::new();
        for org in &self.orgs {
            for ws in &org.workspaces {
                for project in &ws.projects {
                    for key in &project.keys {
                        let chain = [
                            (&org.id, &org.limits, &org.policy),
                            (&ws.id, &ws.limits, &ws.policy),
                            (&project.id, &project.limits, &project.policy),
                            (&key.id, &key.limits, &key.policy),
                        ];
                        let tenant = Arc::new(Tenant {
                            disabled: key.disabled,
                            expires_ms: key.expires_at.as_deref().and_then(parse_rfc3339),
                            lease_terms: self.fleet.as_ref().map(FleetConfig::terms),
                            ..resolve(&chain)
                        });
                        for hash in key.sha256.iter() {
                            by_hash.insert(hash.to_owned(), tenant.clone());
                        }
                    }
                }
            }
        }
        Directory { by_hash }
    }

    pub fn route(&self, route_name: Option<&str>) -> &RouteConfig {
        route_name
            .and_then(|name| self.routes.by_name.get(name))
            .unwrap_or(&self.routes.default)
    }

    /// Whether the config acts on no route it names, nor on any it does not (`routes.default` is
    /// `ignore`): only a route whose metadata sets a mode is weir's. Legitimate before a rollout
    /// starts; a config written for an earlier weir, whose default was `enforce`, reads so too.
    pub fn acts_on_no_named_route(&self) -> bool {
        self.routes.default.mode == Mode::Ignore
            && self.routes.by_name.values().all(|r| r.mode == Mode::Ignore)
    }

    /// Whether a request for `model` goes on: it is listed, or unknown models are served.
    pub fn serves(&self, model: &str) -> bool {
        self.unknown_models == UnknownModels::Serve || self.models.contains_key(model)
    }

    /// The encoding and context cap for a model.
    pub fn model(&self, name: &str) -> (Encoding, Option<u64>) {
        match self.models.get(name) {
            Some(m) => (
                m.encoding.unwrap_or(self.default_encoding),
                m.max_context_tokens,
            ),
            None => (self.default_encoding, None),
        }
    }
}

/// One level of the hierarchy: its id, limits and policy.
type LevelConfig<'a> = (&'a String, &'a Limits, &'a Policy);

fn check_level(
    at: &str,
    (id, limits, policy): LevelConfig<'_>,
    seen: &mut HashSet<String>,
    parent: &str,
    tiers: &[&str],
) -> Result<(), ConfigError> {
    if !trusted::is_level_id(id) {
        return Err(invalid(
            format!("{at}.id"),
            "must be non-empty and use only letters, digits, '-', '_' or '.'",
        ));
    }
    let path = if parent.is_empty() {
        id.to_owned()
    } else {
        format!("{parent}/{id}")
    };
    if !seen.insert(path.clone()) {
        return Err(invalid(
            format!("{at}.id"),
            format!("duplicate id '{path}'"),
        ));
    }
    if policy
        .weight
        .is_some_and(|w| !trusted::WEIGHT_RANGE.contains(&w))
    {
        return Err(invalid(format!("{at}.policy.weight"), weight_message()));
    }
    if let Some(tier) = &policy.tier {
        check_tier(&format!("{at}.policy.tier"), tier, tiers)?;
    }
    if let Some(model) = policy
        .models
        .iter()
        .flatten()
        .find(|m| !trusted::is_model_name(m))
    {
        return Err(invalid(
            format!("{at}.policy.models"),
            format!("'{model}': 1 to 255 visible ASCII characters, no ','"),
        ));
    }
    if policy.models.as_ref().is_some_and(Vec::is_empty) {
        return Err(invalid(
            format!("{at}.policy.models"),
            "an empty list allows no model; leave it out to allow every model".to_owned(),
        ));
    }
    let zero = [
        ("requests_per_minute", limits.requests_per_minute),
        ("input_tokens_per_minute", limits.input_tokens_per_minute),
        ("output_tokens_per_minute", limits.output_tokens_per_minute),
        ("max_context_tokens", limits.max_context_tokens),
        ("max_output_tokens", limits.max_output_tokens),
    ]
    .into_iter()
    .find(|(_, v)| *v == Some(0));
    if let Some((name, _)) = zero {
        return Err(invalid(
            format!("{at}.limits.{name}"),
            "0 would reject every request; remove the key or the limit instead",
        ));
    }
    check_fleet_wide(at, limits)?;
    // Token counts past this cannot be vouched for to the sidecar (nor are they any model's).
    let huge = [
        ("limits.max_context_tokens", limits.max_context_tokens),
        ("limits.max_output_tokens", limits.max_output_tokens),
        ("limits.active_kv_tokens", limits.active_kv_tokens),
        ("policy.default_max_tokens", policy.default_max_tokens),
    ]
    .into_iter()
    .find(|(_, v)| v.is_some_and(|v| v > trusted::MAX_TOKENS));
    if let Some((name, _)) = huge {
        return Err(invalid(
            format!("{at}.{name}"),
            format!("at most {} tokens", trusted::MAX_TOKENS),
        ));
    }
    Ok(())
}

/// That `tier` is one of the `known` tiers.
fn check_tier(field: &str, tier: &str, known: &[&str]) -> Result<(), ConfigError> {
    if known.contains(&tier) {
        return Ok(());
    }
    Err(invalid(
        field,
        format!(
            "'{tier}' is not a known tier ({}); declare another under `tiers`",
            known.join(", ")
        ),
    ))
}

/// That `limits.fleet_wide` names per-minute limits this level sets.
fn check_fleet_wide(at: &str, limits: &Limits) -> Result<(), ConfigError> {
    for name in limits.fleet_wide.keys() {
        let field = format!("{at}.limits.fleet_wide.{name}");
        if name == "concurrent_requests" {
            return Err(invalid(
                field,
                "concurrency stays local to each Envoy (a slot lives as long as its request); \
                 set a per-Envoy concurrent_requests instead",
            ));
        }
        let set = match name.as_str() {
            "requests_per_minute" => limits.requests_per_minute,
            "input_tokens_per_minute" => limits.input_tokens_per_minute,
            "output_tokens_per_minute" => limits.output_tokens_per_minute,
            _ => {
                return Err(invalid(
                    field,
                    format!("not a limit that can be fleet-wide: one of {FLEET_WIDE_LIMITS:?}"),
                ));
            }
        };
        match set {
            None => return Err(invalid(field, format!("this level sets no {name}"))),
            Some(limit) if limit > fleet::MAX_LIMIT => {
                return Err(invalid(
                    field,
                    format!("a fleet-wide limit is at most {}", fleet::MAX_LIMIT),
                ));
            }
            Some(_) => {}
        }
    }
    let mut seen = HashSet::new();
    for (i, budget) in limits.budgets.iter().enumerate() {
        let field = format!("{at}.limits.budgets[{i}]");
        let (measure, _) = budget
            .measure()
            .map_err(|message| invalid(&field, message))?;
        // Both would be one counter in the store, each request charged to it twice.
        if !seen.insert((budget.window, measure)) {
            return Err(invalid(
                field,
                "this level already has a budget of this window and measure",
            ));
        }
    }
    Ok(())
}

/// A key's hashes (well-formed, used by no other key), its expiry.
fn check_key<'c>(at: &str, key: &'c Key, seen: &mut HashSet<&'c str>) -> Result<(), ConfigError> {
    let mut hashes = key.sha256.iter().peekable();
    if hashes.peek().is_none() {
        return Err(invalid(format!("{at}.sha256"), "at least one key hash"));
    }
    for hash in hashes {
        let hex_ok =
            hash.len() == 64 && hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        if !hex_ok {
            return Err(invalid(
                format!("{at}.sha256"),
                "must be 64 lowercase hex digits (the SHA-256 of the key)",
            ));
        }
        if !seen.insert(hash) {
            return Err(invalid(format!("{at}.sha256"), "duplicate key hash"));
        }
    }
    if let Some(at_time) = &key.expires_at
        && parse_rfc3339(at_time).is_none()
    {
        return Err(invalid(
            format!("{at}.expires_at"),
            "an RFC 3339 time in UTC or with an offset, e.g. 2027-01-31T00:00:00Z",
        ));
    }
    Ok(())
}

/// Limits that together refuse every request the key could send.
fn check_admits_something(at: &str, tenant: &Tenant) -> Result<(), ConfigError> {
    let (context, output) = (
        tenant.tightest(|l| l.max_context_tokens),
        tenant.tightest(|l| l.max_output_tokens),
    );
    if context.is_some_and(|c| c < 2) {
        return Err(invalid(
            format!("{at}: max_context_tokens"),
            "a prompt and an answer need at least 2 tokens of context",
        ));
    }
    if let (Some(default), Some(cap)) = (tenant.default_max_tokens, output)
        && default > cap
    {
        return Err(invalid(
            format!("{at}: policy.default_max_tokens"),
            format!(
                "{default} is over the max_output_tokens of {cap} on the key's path: weir would \
                 fill in more output than the key may ask for"
            ),
        ));
    }
    if let (Some(default), Some(context)) = (tenant.default_max_tokens, context)
        && default >= context
    {
        return Err(invalid(
            format!("{at}: policy.default_max_tokens"),
            format!(
                "{default} leaves no room for a prompt in the max_context_tokens of {context} on \
                 the key's path: every request that sets no output limit would be refused"
            ),
        ));
    }
    Ok(())
}

/// An RFC 3339 time (`2027-01-31T00:00:00Z`, fractions and `±HH:MM` offsets allowed) in ms
/// since the Unix epoch. Years and offsets are bounded as RFC 3339 bounds them (four digits,
/// under a day), which also keeps the arithmetic from overflowing on a hostile config.
pub fn parse_rfc3339(text: &str) -> Option<u64> {
    let (date, time) = text.split_once(['T', 't'])?;
    let mut d = date.split('-');
    let (y, m, day): (i64, i64, i64) = (
        d.next()?.parse().ok()?,
        d.next()?.parse().ok()?,
        d.next()?.parse().ok()?,
    );
    if d.next().is_some()
        || !(0..=9999).contains(&y)
        || !(1..=12).contains(&m)
        || !(1..=31).contains(&day)
    {
        return None;
    }
    let (clock, offset_s) = if let Some(clock) = time.strip_suffix(['Z', 'z']) {
        (clock, 0)
    } else {
        let at = time.rfind(['+', '-'])?;
        let (clock, offset) = time.split_at(at);
        let (sign, hm) = offset.split_at(1);
        let (oh, om) = hm.split_once(':')?;
        let (oh, om): (i64, i64) = (oh.parse().ok()?, om.parse().ok()?);
        if !(0..=23).contains(&oh) || !(0..=59).contains(&om) {
            return None;
        }
        let seconds = oh * 3600 + om * 60;
        (clock, if sign == "-" { -seconds } else { seconds })
    };
    let mut c = clock.split(':');
    let (h, min): (i64, i64) = (c.next()?.parse().ok()?, c.next()?.parse().ok()?);
    let seconds: f64 = c.next()?.parse().ok()?;
    if c.next().is_some()
        || !(0..=23).contains(&h)
        || !(0..=59).contains(&min)
        || !(0.0..61.0).contains(&seconds)
    {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let ms = (days * 86_400 + h * 3_600 + min * 60 - offset_s) * 1_000 + (seconds * 1_000.0) as i64;
    u64::try_from(ms).ok()
}

fn weight_message() -> String {
    let (lo, hi) = (trusted::WEIGHT_RANGE.start(), trusted::WEIGHT_RANGE.end());
    format!("must be a number between {lo} and {hi}")
}

type Chain<'a> = [LevelConfig<'a>; 4];

/// The value set by the most specific level on the chain.
fn most_specific<T>(chain: &Chain<'_>, get: impl Fn(&Policy) -> Option<T>) -> Option<T> {
    chain.iter().rev().find_map(|c| get(c.2))
}

fn resolve(chain: &Chain<'_>) -> Tenant {
    let mut path = String::new();
    let levels = chain
        .iter()
        .map(|(id, limits, _)| {
            if !path.is_empty() {
                path.push('/');
            }
            path.push_str(id);
            Level {
                path: path.clone(),
                limits: (*limits).clone(),
            }
        })
        .collect();
    Tenant {
        org: chain[0].0.clone(),
        workspace: chain[1].0.clone(),
        project: chain[2].0.clone(),
        key: chain[3].0.clone(),
        levels,
        tier: most_specific(chain, |p| p.tier.clone()).unwrap_or_else(|| "standard".into()),
        weights: chain.iter().map(|c| c.2.weight.unwrap_or(1.0)).collect(),
        priority: most_specific(chain, |p| p.priority).unwrap_or_default(),
        models: most_specific(chain, |p| p.models.clone()),
        default_max_tokens: most_specific(chain, |p| p.default_max_tokens),
        disabled: false,
        expires_ms: None,
        lease_terms: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(c: char) -> String {
        c.to_string().repeat(64)
    }

    fn sample() -> String {
        format!(
            r#"{{
            "orgs": [{{
                "id": "acme",
                "limits": {{"input_tokens_per_minute": 100000}},
                "policy": {{"tier": "enterprise", "weight": 3, "models": ["m1", "m2"]}},
                "workspaces": [{{
                    "id": "research",
                    "policy": {{"priority": "batch"}},
                    "projects": [{{
                        "id": "eval",
                        "policy": {{"models": ["m1"]}},
                        "keys": [
                            {{"id": "ci", "sha256": "{a}", "limits": {{"concurrent_requests": 4}}}},
                            {{"id": "dev", "sha256": "{b}", "policy": {{"weight": 2, "priority": "interactive"}}}}
                        ]
                    }}]
                }}]
            }}],
            "models": {{"m1": {{"encoding": "o200k_base", "max_context_tokens": 8192}}}},
            "routes": {{"by_name": {{"shadowed": {{"mode": "shadow", "rollout_percent": 50}}}}}}
        }}"#,
            a = hash('a'),
            b = hash('b')
        )
    }

    fn error_of(json: &str) -> ConfigError {
        Config::parse(json.as_bytes()).unwrap_err()
    }

    #[test]
    fn resolves_keys_with_inherited_policy() {
        let config = Config::parse(sample().as_bytes()).unwrap();
        let dir = config.directory();
        assert_eq!(dir.len(), 2);
        let ci = dir.lookup(&hash('a')).unwrap();
        assert_eq!(ci.path(), "acme/research/eval/ci");
        assert_eq!(ci.tier.as_str(), "enterprise");
        assert_eq!(ci.weights, [3.0, 1.0, 1.0, 1.0], "each level's own weight");
        assert_eq!(ci.priority, Priority::Batch);
        assert!(
            ci.may_use("m1") && !ci.may_use("m2"),
            "project narrows the org's models"
        );
        assert_eq!(ci.levels.len(), 4);
        assert_eq!(ci.levels[0].limits.input_tokens_per_minute, Some(100000));
        assert_eq!(ci.tightest(|l| l.concurrent_requests), Some(4));

        let dev = dir.lookup(&hash('b')).unwrap();
        assert_eq!(dev.weights, [3.0, 1.0, 1.0, 2.0]);
        assert_eq!(dev.priority, Priority::Interactive);
        assert!(dir.lookup(&hash('c')).is_none());
    }

    #[test]
    fn modes_are_named_as_the_config_spells_them() {
        for mode in MODES {
            let parsed: Mode = serde_json::from_value(mode.as_str().into()).unwrap();
            assert_eq!(parsed, mode);
        }
    }

    #[test]
    fn a_mode_of_false_says_a_bare_off_is_read_as_false() {
        // What the filter gets from a WasmPlugin whose YAML says `mode: off`: before, only
        // "routes.by_name.llm-api.mode: expected value".
        let mode_of = |json: &str| {
            let config =
                format!(r#"{{"routes": {{"by_name": {{"llm-api": {{"mode": {json}}}}}}}}}"#);
            error_of(&config).to_string()
        };
        assert_eq!(
            mode_of("false"),
            "routes.by_name.llm-api.mode: must be one of `ignore`, `off`, `shadow`, `enforce`, \
             not false (in a Kubernetes manifest a bare off is read as false: quote it, \"off\")"
        );
        assert_eq!(
            mode_of("3"),
            "routes.by_name.llm-api.mode: must be one of `ignore`, `off`, `shadow`, `enforce`, not 3"
        );
        assert_eq!(
            mode_of(r#""enforced""#),
            "routes.by_name.llm-api.mode: must be one of `ignore`, `off`, `shadow`, `enforce`, \
             not `enforced`"
        );
        let yaml = Config::parse(b"routes: {default: {mode: off}}\n").unwrap();
        assert_eq!(
            yaml.routes.default.mode,
            Mode::Off,
            "YAML 1.2: a bare off is the name"
        );
    }

    #[test]
    fn routes_and_models_fall_back_to_defaults() {
        let config = Config::parse(sample().as_bytes()).unwrap();
        assert_eq!(config.route(Some("shadowed")).mode, Mode::Shadow);
        assert_eq!(config.route(Some("shadowed")).rollout_percent, 50);
        assert_eq!(
            config.route(Some("other")).mode,
            Mode::Ignore,
            "a route the config does not name is not weir's"
        );
        assert_eq!(config.route(None).rollout_percent, 100);
        assert_eq!(config.model("m1"), (Encoding::O200kBase, Some(8192)));
        assert_eq!(config.model("m9"), (Encoding::Cl100kBase, None));
        assert!(config.serves("m9"), "unlisted models are served by default");
        let refusing = sample().replace(
            r#""models": {"m1""#,
            r#""unknown_models": "refuse", "models": {"m1""#,
        );
        let config = Config::parse(refusing.as_bytes()).unwrap();
        assert!(config.serves("m1") && !config.serves("m9"));
        let nothing = r#"{"unknown_models": "refuse"}"#;
        assert_eq!(error_of(nothing).field, "unknown_models");
    }

    #[test]
    fn errors_name_the_field() {
        let wrong_type = sample().replace(
            r#""concurrent_requests": 4"#,
            r#""concurrent_requests": "four""#,
        );
        let e = error_of(&wrong_type);
        assert_eq!(
            e.field,
            "orgs[0].workspaces[0].projects[0].keys[0].limits.concurrent_requests"
        );

        let unknown = sample().replace(r#""tier": "enterprise""#, r#""teir": "enterprise""#);
        assert_eq!(error_of(&unknown).field, "orgs[0].policy.teir");

        let bad_hash = sample().replace(&hash('b'), "not-a-hash");
        assert_eq!(
            error_of(&bad_hash).field,
            "orgs[0].workspaces[0].projects[0].keys[1].sha256"
        );

        let dup_hash = sample().replace(&hash('b'), &hash('a'));
        assert!(error_of(&dup_hash).message.contains("duplicate key hash"));

        let dup_id = sample().replace(r#""id": "dev""#, r#""id": "ci""#);
        assert!(
            error_of(&dup_id)
                .message
                .contains("duplicate id 'acme/research/eval/ci'")
        );

        let rollout = sample().replace(r#""rollout_percent": 50"#, r#""rollout_percent": 150"#);
        assert_eq!(
            error_of(&rollout).field,
            "routes.by_name.shadowed.rollout_percent"
        );

        let zero = sample().replace(
            r#""input_tokens_per_minute": 100000"#,
            r#""input_tokens_per_minute": 0"#,
        );
        assert_eq!(
            error_of(&zero).field,
            "orgs[0].limits.input_tokens_per_minute"
        );

        let weight = sample().replace(r#""weight": 3"#, r#""weight": -1"#);
        assert_eq!(error_of(&weight).field, "orgs[0].policy.weight");

        assert_eq!(error_of("{").field, "config");
    }

    #[test]
    fn empty_config_is_valid() {
        let config = Config::parse(b"{}").unwrap();
        assert!(config.directory().is_empty());
        assert_eq!(config.max_body_bytes, 4 * 1024 * 1024);
        assert_eq!(config.signing, None);
        assert_eq!(config.default_tenant().path(), "anonymous");
    }

    #[test]
    fn fleet_wide_limits_need_a_fleet_section_signing_and_a_limit_they_name() {
        let with = |fleet: &str, limits: &str| {
            format!(
                r#"{{{fleet}"orgs":[{{"id":"a","limits":{limits},"workspaces":[{{"id":"w",
                "projects":[{{"id":"p","keys":[{{"id":"k","sha256":"{h}"}}]}}]}}]}}]}}"#,
                h = "b".repeat(64)
            )
        };
        let both = r#""signing":{"secret_env":"S"},"fleet":{"cluster":"quota"},"#;
        let limits = r#"{"input_tokens_per_minute":600,
            "fleet_wide":{"input_tokens_per_minute":"fail_open"}}"#;
        let ok = Config::parse(with(both, limits).as_bytes()).unwrap();
        let fleet = ok.fleet.as_ref().map(FleetConfig::terms);
        assert_eq!(
            fleet.map(|t| (t.renew_ms, t.lease_ttl_ms)),
            Some((250, 60_000))
        );
        let tenant = ok.directory().tenants().next().cloned();
        assert_eq!(tenant.and_then(|t| t.lease_terms), fleet);
        for (fleet, limits, field) in [
            ("", limits, "fleet"),
            (r#""fleet":{"cluster":"quota"},"#, limits, "signing"),
            (
                both,
                r#"{"concurrent_requests":2,"fleet_wide":{"concurrent_requests":"fail_open"}}"#,
                "orgs[0].limits.fleet_wide.concurrent_requests",
            ),
            (
                both,
                r#"{"fleet_wide":{"requests_per_minute":"fail_closed"}}"#,
                "orgs[0].limits.fleet_wide.requests_per_minute",
            ),
            (
                both,
                r#"{"requests_per_minute":5,"fleet_wide":{"rpm":"fail_closed"}}"#,
                "orgs[0].limits.fleet_wide.rpm",
            ),
            (
                r#""signing":{"secret_env":"S"},"fleet":{"cluster":"q","max_lease_fraction":2},"#,
                limits,
                "fleet.max_lease_fraction",
            ),
            (
                r#""signing":{"secret_env":"S"},"fleet":{"cluster":"q","lease_ttl_ms":100},"#,
                limits,
                "fleet.lease_ttl_ms",
            ),
            (
                both,
                r#"{"budgets":[{"window":"month","spend":5}]}"#,
                "prices.default",
            ),
            (
                both,
                r#"{"budgets":[{"window":"day","tokens":5,"input_tokens":3}]}"#,
                "orgs[0].limits.budgets[0]",
            ),
            (
                both,
                r#"{"budgets":[{"window":"minute","tokens":5}]}"#,
                "orgs[0].limits.budgets[0]",
            ),
            (
                both,
                r#"{"budgets":[{"window":"month","tokens":5},{"window":"day","tokens":5},
                    {"window":"month","tokens":9}]}"#,
                "orgs[0].limits.budgets[2]",
            ),
            (
                r#""signing":{"secret_env":"S"},"#,
                r#"{"budgets":[{"window":"hour","tokens":5}]}"#,
                "fleet",
            ),
            // Above what the quota service takes (2^49: its asks reach twice the limit), which
            // would refuse every renewal of the Envoy, every tenant's.
            (
                both,
                r#"{"input_tokens_per_minute":562949953421313,
                    "fleet_wide":{"input_tokens_per_minute":"fail_open"}}"#,
                "orgs[0].limits.fleet_wide.input_tokens_per_minute",
            ),
            (
                both,
                r#"{"budgets":[{"window":"month","tokens":562949953421313}]}"#,
                "orgs[0].limits.budgets[0]",
            ),
        ] {
            let error = error_of(&with(fleet, limits));
            assert_eq!(error.field, field, "{}", error.message);
        }
        // More counters than an Envoy renews: one key's would go unrenewed, refused for good.
        let keyed = |n: usize| {
            let keys: Vec<String> = (0..n)
                .map(|i| {
                    format!(
                        r#"{{"id":"k{i}","sha256":"{:064x}","limits":{{"budgets":[
                        {{"window":"day","tokens":9}}]}}}}"#,
                        i + 1
                    )
                })
                .collect();
            format!(
                r#"{{{both}"orgs":[{{"id":"a","workspaces":[{{"id":"w",
                "projects":[{{"id":"p","keys":[{}]}}]}}]}}]}}"#,
                keys.join(",")
            )
        };
        assert!(Config::parse(keyed(fleet::MAX_COUNTERS).as_bytes()).is_ok());
        let error = error_of(&keyed(fleet::MAX_COUNTERS + 1));
        assert_eq!(error.field, "fleet", "{}", error.message);
    }

    #[test]
    fn signing_and_the_default_tenant_are_checked() {
        let ok = Config::parse(
            br#"{"signing": {"secret_env": "S"}, "default_tenant": {"path": "public/anon", "weight": 0.5, "active_kv_tokens": 900}}"#,
        )
        .unwrap();
        assert_eq!(ok.signing.as_ref().map(|s| s.ttl_ms), Some(30_000));
        let t = ok.default_tenant();
        assert_eq!(
            (t.path(), t.weights.as_slice(), t.tier.as_str()),
            ("public/anon", [0.5, 1.0].as_slice(), "free")
        );
        assert_eq!(t.tightest(|l| l.active_kv_tokens), Some(900));

        for (json, field) in [
            (r#"{"signing": {"secret_env": ""}}"#, "signing.secret_env"),
            (
                r#"{"signing": {"secret_env": "S", "ttl_ms": 0}}"#,
                "signing.ttl_ms",
            ),
            (r#"{"signing": {"secret": "inline"}}"#, "signing"),
            (
                r#"{"default_tenant": {"path": "a/../b"}}"#,
                "default_tenant.path",
            ),
            (
                r#"{"default_tenant": {"weight": 1e300}}"#,
                "default_tenant.weight",
            ),
            (
                r#"{"default_tenant": {"tier": "a b"}}"#,
                "default_tenant.tier",
            ),
        ] {
            let field_of = error_of(json).field;
            assert!(field_of.starts_with(field), "{json}: {field_of}");
        }
        let clash = sample().replacen('{', r#"{"default_tenant": {"path": "acme/x"},"#, 1);
        assert_eq!(error_of(&clash).field, "default_tenant.path");
        let huge = sample().replace(r#""weight": 3"#, r#""weight": 1e300"#);
        assert_eq!(error_of(&huge).field, "orgs[0].policy.weight");
    }

    #[test]
    fn yaml_and_json_read_the_same_and_errors_name_the_field_in_both() {
        let json = format!(
            r#"{{"orgs":[{{"id":"acme","workspaces":[{{"id":"w","projects":[{{"id":"p","keys":[{{"id":"k","sha256":"{h}","limits":{{"requests_per_minute":5}}}}]}}]}}]}}]}}"#,
            h = hash('a')
        );
        let yaml = format!(
            "orgs:\n- id: acme\n  workspaces:\n  - id: w\n    projects:\n    - id: p\n      keys:\n      - id: k\n        sha256: {h}\n        limits: {{requests_per_minute: 5}}\n",
            h = hash('a')
        );
        let (from_json, from_yaml) = (
            Config::parse(json.as_bytes()).unwrap(),
            Config::parse(yaml.as_bytes()).unwrap(),
        );
        let tenant = |c: &Config| c.directory().lookup(&hash('a')).unwrap().as_ref().clone();
        assert_eq!(tenant(&from_json), tenant(&from_yaml));
        let bad = yaml.replace("requests_per_minute: 5", "requests_per_minute: lots");
        let err = Config::parse(bad.as_bytes()).unwrap_err();
        assert_eq!(
            err.field,
            "orgs[0].workspaces[0].projects[0].keys[0].limits.requests_per_minute"
        );
        let unknown = yaml.replace("limits:", "limitz:");
        let err = Config::parse(unknown.as_bytes()).unwrap_err();
        assert!(err.message.contains("unknown field"), "{err}");
    }

    #[test]
    fn a_tier_not_known_is_refused_with_its_field() {
        // A typo'd tier loaded before, and a key on it was no longer shed as `free` nor
        // counted as `enterprise`.
        let typo = sample().replace(r#""tier": "enterprise""#, r#""tier": "enterprize""#);
        let error = error_of(&typo);
        assert_eq!(error.field, "orgs[0].policy.tier");
        assert_eq!(
            error.message,
            "'enterprize' is not a known tier (free, standard, enterprise); declare another \
             under `tiers`"
        );
        let on_a_key = sample().replace(
            r#""policy": {"weight": 2,"#,
            r#""policy": {"tier": "fre", "weight": 2,"#,
        );
        assert_eq!(
            error_of(&on_a_key).field,
            "orgs[0].workspaces[0].projects[0].keys[1].policy.tier"
        );
        let anonymous = r#"{"default_tenant": {"tier": "fre"}}"#;
        assert!(
            error_of(anonymous)
                .message
                .contains("'fre' is not a known tier")
        );

        // Declared, a tier of the platform's own naming is known, the built-in ones still.
        let gold = sample().replace(r#""tier": "enterprise""#, r#""tier": "gold""#);
        assert_eq!(error_of(&gold).field, "orgs[0].policy.tier");
        let declared = gold.replacen('{', r#"{"tiers": ["gold", "silver"],"#, 1);
        let config = Config::parse(declared.as_bytes()).unwrap();
        assert_eq!(config.directory().lookup(&hash('a')).unwrap().tier, "gold");
        let listed = declared.replace(r#""tier": "gold""#, r#""tier": "bronze""#);
        assert!(
            error_of(&listed)
                .message
                .contains("(free, standard, enterprise, gold, silver)")
        );
        let malformed = sample().replacen('{', r#"{"tiers": ["gold", "a b"],"#, 1);
        assert_eq!(error_of(&malformed).field, "tiers[1]");
        for tier in TIERS {
            let built_in =
                sample().replace(r#""tier": "enterprise""#, &format!(r#""tier": "{tier}""#));
            assert!(Config::parse(built_in.as_bytes()).is_ok(), "{tier}");
        }
    }

    #[test]
    fn type_errors_say_what_the_field_must_be_once() {
        // Before: "orgs[0].limits.requests_per_minute: invalid type: integer `-5`, expected u64
        // at line 3 column 33", the path again in the message.
        let yaml = "orgs:\n- id: acme\n  limits: {requests_per_minute: -5}\n";
        let json = r#"{"orgs": [{"id": "acme", "limits": {"requests_per_minute": -5}}]}"#;
        for text in [yaml, json] {
            let error = Config::parse(text.as_bytes()).unwrap_err();
            assert_eq!(
                error.to_string(),
                "orgs[0].limits.requests_per_minute: must be a non-negative integer, not -5"
            );
        }
        let error = error_of(r#"{"forward_api_key": "yes"}"#);
        assert_eq!(error.message, "must be true or false, not \"yes\"");
        let hashes = one_key(r#"{"id":"k","sha256":5}"#).unwrap_err();
        assert_eq!(
            hashes.to_string(),
            "orgs[0].workspaces[0].projects[0].keys[0].sha256: must be a key hash or a list of \
             key hashes"
        );
    }

    fn one_key(key: &str) -> Result<Config, ConfigError> {
        Config::parse(
            format!(r#"{{"orgs":[{{"id":"o","workspaces":[{{"id":"w","projects":[{{"id":"p","keys":[{key}]}}]}}]}}]}}"#)
                .as_bytes(),
        )
    }

    #[test]
    fn a_rotated_key_answers_to_both_hashes_as_one_tenant_with_one_set_of_counters() {
        let c = one_key(&format!(
            r#"{{"id":"k","sha256":["{}","{}"]}}"#,
            hash('a'),
            hash('b')
        ))
        .unwrap();
        let dir = c.directory();
        let (old, new) = (
            dir.lookup(&hash('a')).unwrap(),
            dir.lookup(&hash('b')).unwrap(),
        );
        assert!(Arc::ptr_eq(old, new));
        assert_eq!(
            old.path(),
            "o/w/p/k",
            "counters are keyed by ids, not hashes"
        );
        assert!(one_key(r#"{"id":"k","sha256":[]}"#).is_err());
    }

    #[test]
    fn disabled_and_expired_keys_are_refused_but_known() {
        let c = one_key(&format!(
            r#"{{"id":"k","sha256":"{}","disabled":true}},{{"id":"j","sha256":"{}","expires_at":"2027-01-31T00:00:00Z"}}"#,
            hash('a'),
            hash('b')
        ))
        .unwrap();
        let dir = c.directory();
        assert_eq!(
            dir.lookup(&hash('a')).unwrap().refusal(0),
            Some(KeyRefusal::Disabled)
        );
        let expiring = dir.lookup(&hash('b')).unwrap();
        let at = parse_rfc3339("2027-01-31T00:00:00Z").unwrap();
        assert_eq!(expiring.refusal(at - 1), None);
        assert_eq!(expiring.refusal(at), Some(KeyRefusal::Expired));
        let err = one_key(&format!(
            r#"{{"id":"k","sha256":"{}","expires_at":"tomorrow"}}"#,
            hash('a')
        ))
        .unwrap_err();
        assert!(err.field.ends_with("keys[0].expires_at"), "{err}");
    }

    #[test]
    fn rfc3339_times_are_read_with_their_offsets() {
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            parse_rfc3339("2000-02-29T12:30:00.5Z"),
            Some(951_827_400_500)
        );
        assert_eq!(
            parse_rfc3339("2000-02-29T14:30:00+02:00"),
            parse_rfc3339("2000-02-29T12:30:00Z")
        );
        for bad in [
            "2000-13-01T00:00:00Z",
            "2000-01-01",
            "2000-01-01T25:00:00Z",
            "x",
            // Past what RFC 3339 spells, and past what the arithmetic holds.
            "99999999999999999-01-01T00:00:00Z",
            "2000-01-01T00:00:00+99999999999999:00",
            "2000-01-01T00:00:00-00:99999999999999",
        ] {
            assert_eq!(parse_rfc3339(bad), None, "{bad}");
        }
    }

    #[test]
    fn limits_that_refuse_every_request_are_refused() {
        let key = |limits: &str, policy: &str| {
            one_key(&format!(
                r#"{{"id":"k","sha256":"{}","limits":{limits},"policy":{policy}}}"#,
                hash('a')
            ))
        };
        let err = key(
            r#"{"max_output_tokens":100}"#,
            r#"{"default_max_tokens":200}"#,
        )
        .unwrap_err();
        assert!(err.message.contains("over the max_output_tokens"), "{err}");
        let err = key(
            r#"{"max_context_tokens":100}"#,
            r#"{"default_max_tokens":100}"#,
        )
        .unwrap_err();
        assert!(err.message.contains("leaves no room"), "{err}");
        assert!(key(r#"{"max_context_tokens":1}"#, "{}").is_err());
        assert!(
            key(
                r#"{"max_output_tokens":100,"max_context_tokens":200}"#,
                r#"{"default_max_tokens":100}"#
            )
            .is_ok()
        );
    }
}
