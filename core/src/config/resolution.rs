//! What a key authenticates as: its [`Tenant`], resolved through the levels above it (the most
//! specific level's policy wins; every level's limits apply), the [`Directory`] of keys by hash
//! the request path looks up, and the route and model a request is served under.

use std::collections::HashMap;
use std::sync::Arc;

use super::rfc3339::parse_rfc3339;
use super::runs::{RunBudgets, Tools};
use super::schema::{Config, Limits, Mode, Policy, Priority, RouteConfig, UnknownModels};
use crate::fleet_config::{FleetConfig, LeaseTerms};
use crate::tokens::Encoding;

/// Why a known key is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyRefusal {
    Disabled,
    Expired,
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
    /// What one of its runs may use: the tightest budget of each measure along its path.
    pub run_budgets: RunBudgets,
    /// Those of `run_budgets` some level of its path names in `runs.fleet_wide`, held across
    /// the fleet by the quota store; set only when the config has a `fleet` section (the rest
    /// are held per Envoy).
    pub run_fleet_wide: RunBudgets,
    /// How long one of its runs may sit idle before it has ended (the shortest along its
    /// path; unset, the run table's default).
    pub run_idle_ttl_ms: Option<u64>,
    /// A call must name its run (some level sets `runs.require_run_id`).
    pub run_required: bool,
    /// Its tool policy, its path's levels combined.
    pub tools: Tools,
    /// The tenant subtrees whose held tool calls the key approves or rejects (its `approves`).
    pub approves: Vec<String>,
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
            run_budgets: RunBudgets::default(),
            run_fleet_wide: RunBudgets::default(),
            run_idle_ttl_ms: None,
            run_required: false,
            tools: Tools::default(),
            approves: Vec::new(),
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
                        let resolved = resolve(&chain);
                        let tenant = Arc::new(Tenant {
                            disabled: key.disabled,
                            expires_ms: key.expires_at.as_deref().and_then(parse_rfc3339),
                            lease_terms: self.fleet.as_ref().map(FleetConfig::terms),
                            approves: key.approves.clone(),
                            run_fleet_wide: match self.fleet {
                                Some(_) => resolved.run_fleet_wide,
                                None => RunBudgets::default(),
                            },
                            ..resolved
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
pub(super) type LevelConfig<'a> = (&'a String, &'a Limits, &'a Policy);

pub(super) type Chain<'a> = [LevelConfig<'a>; 4];

/// The value set by the most specific level on the chain.
fn most_specific<T>(chain: &Chain<'_>, get: impl Fn(&Policy) -> Option<T>) -> Option<T> {
    chain.iter().rev().find_map(|c| get(c.2))
}

/// The budgets of `budgets` that some level of the chain names in `runs.fleet_wide`.
fn fleet_wide_of(chain: &Chain<'_>, budgets: RunBudgets) -> RunBudgets {
    let named = |name: &str| {
        (chain.iter())
            .filter_map(|c| c.2.runs.as_ref())
            .any(|r| r.fleet_wide.contains_key(name))
    };
    let keep = |name: &str, budget: Option<u64>| budget.filter(|_| named(name));
    RunBudgets {
        model_calls: keep("model_calls", budgets.model_calls),
        tool_calls: keep("tool_calls", budgets.tool_calls),
        runtime_ms: keep("runtime_ms", budgets.runtime_ms),
        input_tokens: keep("input_tokens", budgets.input_tokens),
        output_tokens: keep("output_tokens", budgets.output_tokens),
        cost_micros: keep("cost_micros", budgets.cost_micros),
        parallel_calls: keep("parallel_calls", budgets.parallel_calls),
        retries: keep("retries", budgets.retries),
    }
}

pub(super) fn resolve(chain: &Chain<'_>) -> Tenant {
    let run_budgets = (chain.iter())
        .filter_map(|c| c.2.runs.as_ref())
        .fold(RunBudgets::default(), |run, r| run.tightest(r.budgets));
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
        run_budgets,
        run_fleet_wide: fleet_wide_of(chain, run_budgets),
        run_idle_ttl_ms: (chain.iter())
            .filter_map(|c| c.2.runs.as_ref()?.idle_ttl_ms)
            .min(),
        run_required: (chain.iter()).any(|c| {
            c.2.runs
                .as_ref()
                .is_some_and(|r| r.require_run_id == Some(true))
        }),
        tools: Tools::combine(chain.iter().filter_map(|c| c.2.tools.as_ref())),
        approves: Vec::new(),
    }
}
