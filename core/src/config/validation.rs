//! What a config must hold to be loaded: each field in range, ids unique per level, key hashes
//! well-formed and unshared, tiers known, fleet-wide limits with a fleet to count them, and no
//! key whose limits together refuse every request. Each refusal names the field.

use std::collections::HashSet;

use super::resolution::{LevelConfig, Tenant, resolve};
use super::rfc3339::parse_rfc3339;
use super::runs::{self, RUN_BUDGETS, RunPolicy, ToolPolicy};
use super::schema::{Config, FLEET_WIDE_LIMITS, Key, Limits, Policy, TIERS, UnknownModels};
use super::{ConfigError, invalid};
use crate::fleet;
use crate::fleet_config::FailMode;
use crate::trusted;

impl Config {
    /// Refuses a config that does not hold together, naming the first field at fault.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        self.validate_routes()?;
        if self.max_body_bytes == 0 {
            return Err(invalid("max_body_bytes", "must be positive"));
        }
        if self.unknown_models == UnknownModels::Refuse && self.models.is_empty() {
            return Err(invalid(
                "unknown_models",
                "`refuse` with no `models` listed refuses every model; list the models served",
            ));
        }
        self.validate_signing()?;
        self.validate_default_tenant()?;
        if self.slot_lease_ms < 1_000 {
            return Err(invalid("slot_lease_ms", "must be at least 1000"));
        }
        self.prediction
            .validate()
            .map_err(|(field, message)| invalid(field, message))?;
        self.validate_fleet()?;
        self.validate_hierarchy()?;
        self.validate_run_fleet()
    }

    /// A run's fleet-wide budgets are reserved in the quota store: they need its cluster.
    fn validate_run_fleet(&self) -> Result<(), ConfigError> {
        let policies = self.orgs.iter().flat_map(|o| {
            let ws = o.workspaces.iter().flat_map(|w| {
                let projects = w
                    .projects
                    .iter()
                    .flat_map(|p| p.keys.iter().map(|k| &k.policy).chain([&p.policy]));
                projects.chain([&w.policy])
            });
            ws.chain([&o.policy])
        });
        let runs_fleet_wide = policies
            .filter_map(|p| p.runs.as_ref())
            .any(|r| !r.fleet_wide.is_empty());
        if runs_fleet_wide && self.fleet.is_none() {
            return Err(invalid(
                "fleet",
                "runs.fleet_wide needs a fleet section naming the quota service's cluster: a \
                 run's fleet-wide budgets are reserved in the quota store",
            ));
        }
        Ok(())
    }

    /// Each route's rollout share, the default route's too.
    fn validate_routes(&self) -> Result<(), ConfigError> {
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
            if let Some(header) = &route.run_id_header {
                check_run_id_header(&format!("{p}.run_id_header"), header)?;
            }
        }
        Ok(())
    }

    /// The `signing` section: where its secret comes from, and how long a signature lives.
    fn validate_signing(&self) -> Result<(), ConfigError> {
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
        Ok(())
    }

    /// Every level from the orgs down to the keys (ids unique on their path, key hashes across
    /// the config), and that each key, through its whole path, admits some request.
    fn validate_hierarchy(&self) -> Result<(), ConfigError> {
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
                        check_approves(&at, &key.approves, &org.id)?;
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
}

/// One level of the hierarchy at `at`, under the level whose path is `parent`.
fn check_level(
    at: &str,
    (id, limits, policy): LevelConfig<'_>,
    seen: &mut HashSet<String>,
    parent: &str,
    tiers: &[&str],
) -> Result<(), ConfigError> {
    check_id(at, id, seen, parent)?;
    check_policy(at, policy, tiers)?;
    check_limits(at, limits, policy)
}

/// A level's id: well-formed, and its path (`parent/id`) not already taken.
fn check_id(
    at: &str,
    id: &str,
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
    Ok(())
}

/// A level's policy: its weight in range, its tier known, its models well-named and not none.
fn check_policy(at: &str, policy: &Policy, tiers: &[&str]) -> Result<(), ConfigError> {
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
    if let Some(runs) = &policy.runs {
        check_runs(&format!("{at}.policy.runs"), runs)?;
    }
    if let Some(tools) = &policy.tools {
        check_tools(&format!("{at}.policy.tools"), tools)?;
    }
    Ok(())
}

/// A level's run policy: budgets that admit something, fleet-wide ones that exist and never
/// fail open (a run's budget is a promise to whoever pays for it).
fn check_runs(at: &str, runs: &RunPolicy) -> Result<(), ConfigError> {
    if runs.idle_ttl_ms == Some(0) {
        return Err(invalid(
            format!("{at}.idle_ttl_ms"),
            "must be above 0".to_owned(),
        ));
    }
    let b = &runs.budgets;
    if b.parallel_calls == Some(0) || b.model_calls == Some(0) {
        return Err(invalid(
            format!("{at}.budgets"),
            "a model_calls or parallel_calls budget of 0 admits no call; leave it out for none"
                .to_owned(),
        ));
    }
    for (name, fail) in &runs.fleet_wide {
        if !RUN_BUDGETS.contains(&name.as_str()) {
            return Err(invalid(
                format!("{at}.fleet_wide.{name}"),
                format!("not a run budget (one of {})", RUN_BUDGETS.join(", ")),
            ));
        }
        if *fail == FailMode::FailOpen {
            return Err(invalid(
                format!("{at}.fleet_wide.{name}"),
                "a run's budget fails closed while the quota store is unreachable".to_owned(),
            ));
        }
    }
    Ok(())
}

/// A key's approver scopes: tenant paths within its own org, so no key approves another
/// org's tool calls.
fn check_approves(at: &str, approves: &[String], org: &str) -> Result<(), ConfigError> {
    for (i, path) in approves.iter().enumerate() {
        let mut levels = path.split('/');
        let well_formed = levels.clone().count() <= 4 && !path.split('/').any(str::is_empty);
        if !well_formed || levels.next() != Some(org) {
            return Err(invalid(
                format!("{at}.approves[{i}]"),
                format!("'{path}': a tenant path within the key's own org ('{org}' or under it)"),
            ));
        }
    }
    Ok(())
}

/// A route's run-id header: a lowercase header name a client may set, never one of weir's own
/// (`x-weir-*` headers are stripped from every request before anything reads them).
fn check_run_id_header(at: &str, header: &str) -> Result<(), ConfigError> {
    let token = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_';
    if header.is_empty() || header.len() > 64 || !header.chars().all(token) {
        return Err(invalid(
            at.to_owned(),
            format!("'{header}': a lowercase header name (letters, digits, '-', '_')"),
        ));
    }
    // A run id is vouched on, recorded in the ledger and named in refusals: never a secret,
    // nor a header whose value is not the caller's to choose per task.
    const NOT_RUN_IDS: [&str; 9] = [
        "authorization",
        "proxy-authorization",
        "x-api-key",
        "api-key",
        "cookie",
        "idempotency-key",
        "host",
        "content-length",
        "content-type",
    ];
    if NOT_RUN_IDS.contains(&header) {
        return Err(invalid(
            at.to_owned(),
            format!("'{header}' carries a credential or the request's framing, not a run id"),
        ));
    }
    if header.starts_with("x-weir-") && header != "x-weir-run-id" {
        return Err(invalid(
            at.to_owned(),
            format!("'{header}': weir's own headers are stripped before it is read"),
        ));
    }
    Ok(())
}

/// A level's tool policy: every name or pattern well formed, and an allow-list that allows
/// something.
fn check_tools(at: &str, tools: &ToolPolicy) -> Result<(), ConfigError> {
    if tools.allowed.as_ref().is_some_and(Vec::is_empty) {
        return Err(invalid(
            format!("{at}.allowed"),
            "an empty list allows no tool; block tools by name in 'blocked' instead".to_owned(),
        ));
    }
    let lists = [
        ("allowed", tools.allowed.as_deref()),
        ("blocked", Some(&tools.blocked[..])),
    ];
    for (list, names) in lists {
        for (i, name) in names.unwrap_or_default().iter().enumerate() {
            if let Some(why) = runs::malformed(name) {
                return Err(invalid(
                    format!("{at}.{list}[{i}]"),
                    format!("'{name}' {why}"),
                ));
            }
        }
    }
    for name in tools.classes.keys() {
        if let Some(why) = runs::malformed(name) {
            return Err(invalid(format!("{at}.classes.{name}"), why.to_owned()));
        }
    }
    let approval = &tools.approval;
    let zero = [
        ("ttl_ms", approval.ttl_ms == Some(0)),
        ("max_pending", approval.max_pending == Some(0)),
    ];
    if let Some((field, _)) = zero.iter().find(|(_, zero)| *zero) {
        return Err(invalid(
            format!("{at}.approval.{field}"),
            "must be positive".to_owned(),
        ));
    }
    Ok(())
}

/// A level's limits: none 0 (which would refuse every request), its fleet-wide ones, and no
/// token count (the policy's `default_max_tokens` too) past what can be vouched for to the
/// sidecar (nor is any model's).
fn check_limits(at: &str, limits: &Limits, policy: &Policy) -> Result<(), ConfigError> {
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

fn weight_message() -> String {
    let (lo, hi) = (trusted::WEIGHT_RANGE.start(), trusted::WEIGHT_RANGE.end());
    format!("must be a number between {lo} and {hi}")
}
