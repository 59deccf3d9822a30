//! The gateway's configuration: the org → workspace → project → key hierarchy with limits and
//! policy at every level, the models it knows, and how routes opt in.
//!
//! Parsing names the offending field (`orgs[0].workspaces[1].limits.requests_per_minute: …`),
//! and [`Config::directory`] resolves every key into the [`Tenant`] it authenticates, so the
//! request path only does a hash lookup.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use serde::Deserialize;

use crate::path::AllowedPaths;
use crate::tokens::Encoding;
use crate::trusted;

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub orgs: Vec<Org>,
    /// Known models; a model missing here is served with `default_encoding` and no context cap.
    #[serde(default)]
    pub models: BTreeMap<String, ModelConfig>,
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
}

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
    /// Prompts up to this many bytes are counted exactly with BPE; longer ones are estimated.
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
}

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

/// Scheduling and access policy; unset fields inherit from the level above.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    pub tier: Option<String>,
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
    /// SHA-256 of the key, lowercase hex (`weir keys new` prints it).
    pub sha256: String,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub policy: Policy,
}

/// Whether weir acts on a route.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
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
    pub weight: f64,
    pub priority: Priority,
    pub models: Option<Vec<String>>,
    pub default_max_tokens: Option<u64>,
}

impl Tenant {
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
    /// Parses and validates a configuration; errors name the field.
    pub fn from_json(json: &[u8]) -> Result<Config, ConfigError> {
        let de = &mut serde_json::Deserializer::from_slice(json);
        let config: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            invalid(
                if path == "." || path == "?" {
                    "config".into()
                } else {
                    path
                },
                e.into_inner().to_string(),
            )
        })?;
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
        let mut seen_hashes = HashSet::new();
        let mut seen_ids = HashSet::new();
        for (o, org) in self.orgs.iter().enumerate() {
            let at = format!("orgs[{o}]");
            check_level(&at, &org.id, &org.limits, &org.policy, &mut seen_ids, "")?;
            for (w, ws) in org.workspaces.iter().enumerate() {
                let at = format!("{at}.workspaces[{w}]");
                check_level(&at, &ws.id, &ws.limits, &ws.policy, &mut seen_ids, &org.id)?;
                let ws_path = format!("{}/{}", org.id, ws.id);
                for (p, project) in ws.projects.iter().enumerate() {
                    let at = format!("{at}.projects[{p}]");
                    let (limits, policy) = (&project.limits, &project.policy);
                    check_level(&at, &project.id, limits, policy, &mut seen_ids, &ws_path)?;
                    let project_path = format!("{ws_path}/{}", project.id);
                    for (k, key) in project.keys.iter().enumerate() {
                        let at = format!("{at}.keys[{k}]");
                        let (limits, policy) = (&key.limits, &key.policy);
                        check_level(&at, &key.id, limits, policy, &mut seen_ids, &project_path)?;
                        let hex_ok = key.sha256.len() == 64
                            && key
                                .sha256
                                .bytes()
                                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
                        if !hex_ok {
                            return Err(invalid(
                                format!("{at}.sha256"),
                                "must be 64 lowercase hex digits (the SHA-256 of the key)",
                            ));
                        }
                        if !seen_hashes.insert(key.sha256.as_str()) {
                            return Err(invalid(format!("{at}.sha256"), "duplicate key hash"));
                        }
                    }
                }
            }
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
        if !trusted::is_level_id(&d.tier) {
            return Err(invalid(
                "default_tenant.tier",
                "letters, digits, '-', '_', '.'",
            ));
        }
        if !trusted::WEIGHT_RANGE.contains(&d.weight) {
            return Err(invalid("default_tenant.weight", weight_message()));
        }
        Ok(())
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
            weight: d.weight,
            priority: d.priority,
            models: None,
            default_max_tokens: None,
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
                        by_hash.insert(key.sha256.clone(), Arc::new(resolve(&chain)));
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

fn check_level(
    at: &str,
    id: &str,
    limits: &Limits,
    policy: &Policy,
    seen: &mut HashSet<String>,
    parent: &str,
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
    if let Some(tier) = policy.tier.as_deref().filter(|t| !trusted::is_level_id(t)) {
        return Err(invalid(
            format!("{at}.policy.tier"),
            format!("'{tier}': letters, digits, '-', '_', '.'"),
        ));
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

fn weight_message() -> String {
    let (lo, hi) = (trusted::WEIGHT_RANGE.start(), trusted::WEIGHT_RANGE.end());
    format!("must be a number between {lo} and {hi}")
}

type Chain<'a> = [(&'a String, &'a Limits, &'a Policy); 4];

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
        weight: most_specific(chain, |p| p.weight).unwrap_or(1.0),
        priority: most_specific(chain, |p| p.priority).unwrap_or_default(),
        models: most_specific(chain, |p| p.models.clone()),
        default_max_tokens: most_specific(chain, |p| p.default_max_tokens),
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
                            {{"id": "dev", "sha256": "{b}", "policy": {{"weight": 1, "priority": "interactive"}}}}
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
        Config::from_json(json.as_bytes()).unwrap_err()
    }

    #[test]
    fn resolves_keys_with_inherited_policy() {
        let config = Config::from_json(sample().as_bytes()).unwrap();
        let dir = config.directory();
        assert_eq!(dir.len(), 2);
        let ci = dir.lookup(&hash('a')).unwrap();
        assert_eq!(ci.path(), "acme/research/eval/ci");
        assert_eq!((ci.tier.as_str(), ci.weight), ("enterprise", 3.0));
        assert_eq!(ci.priority, Priority::Batch);
        assert!(
            ci.may_use("m1") && !ci.may_use("m2"),
            "project narrows the org's models"
        );
        assert_eq!(ci.levels.len(), 4);
        assert_eq!(ci.levels[0].limits.input_tokens_per_minute, Some(100000));
        assert_eq!(ci.tightest(|l| l.concurrent_requests), Some(4));

        let dev = dir.lookup(&hash('b')).unwrap();
        assert_eq!((dev.weight, dev.priority), (1.0, Priority::Interactive));
        assert!(dir.lookup(&hash('c')).is_none());
    }

    #[test]
    fn routes_and_models_fall_back_to_defaults() {
        let config = Config::from_json(sample().as_bytes()).unwrap();
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
        let config = Config::from_json(b"{}").unwrap();
        assert!(config.directory().is_empty());
        assert_eq!(config.max_body_bytes, 4 * 1024 * 1024);
        assert_eq!(config.signing, None);
        assert_eq!(config.default_tenant().path(), "anonymous");
    }

    #[test]
    fn signing_and_the_default_tenant_are_checked() {
        let ok = Config::from_json(
            br#"{"signing": {"secret_env": "S"}, "default_tenant": {"path": "public/anon", "weight": 0.5, "active_kv_tokens": 900}}"#,
        )
        .unwrap();
        assert_eq!(ok.signing.as_ref().map(|s| s.ttl_ms), Some(30_000));
        let t = ok.default_tenant();
        assert_eq!(
            (t.path(), t.weight, t.tier.as_str()),
            ("public/anon", 0.5, "free")
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
}
