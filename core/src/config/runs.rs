//! How a level bounds its agents' runs and the tools their models may call: the schema, and
//! how the levels of a key's path combine — the tightest value of each run budget, the union
//! of blocked tools, the intersection of allowed ones, and the strictest class a tool has.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::fleet_config::FailMode;

/// A level's bounds on a run (a client-named sequence of model calls: one agent's task).
/// Every field is optional; a key's run is held to the tightest value along its path.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunPolicy {
    /// A run idle this long has ended; its id then starts a new run.
    pub idle_ttl_ms: Option<u64>,
    /// Refuse a call that names no run (else it is a run of its own).
    pub require_run_id: Option<bool>,
    #[serde(default)]
    pub budgets: RunBudgets,
    /// Which budgets hold across the whole fleet (by name, see [`RUN_BUDGETS`]), and what each
    /// does while the quota store is unreachable: a run's budget never fails open.
    #[serde(default)]
    pub fleet_wide: BTreeMap<String, FailMode>,
}

/// What one run may use, all told.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunBudgets {
    pub model_calls: Option<u64>,
    /// Tool calls the model made, and tool results sent back, each counted once.
    pub tool_calls: Option<u64>,
    /// Wall-clock time since the run's first call.
    pub runtime_ms: Option<u64>,
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    /// Spend, in millionths of the price table's currency.
    pub cost_micros: Option<u64>,
    /// Model calls of the run in flight at once.
    pub parallel_calls: Option<u64>,
    /// Calls that repeat one already seen in the run (its idempotency key, or its body).
    pub retries: Option<u64>,
}

/// The budgets `runs.fleet_wide` may name.
pub const RUN_BUDGETS: [&str; 8] = [
    "model_calls",
    "tool_calls",
    "runtime_ms",
    "input_tokens",
    "output_tokens",
    "cost_micros",
    "parallel_calls",
    "retries",
];

/// The smaller of two bounds, either possibly unset.
fn min<T: Ord>(a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

impl RunBudgets {
    /// The tighter of two levels' budgets, measure by measure.
    pub fn tightest(self, other: RunBudgets) -> RunBudgets {
        RunBudgets {
            model_calls: min(self.model_calls, other.model_calls),
            tool_calls: min(self.tool_calls, other.tool_calls),
            runtime_ms: min(self.runtime_ms, other.runtime_ms),
            input_tokens: min(self.input_tokens, other.input_tokens),
            output_tokens: min(self.output_tokens, other.output_tokens),
            cost_micros: min(self.cost_micros, other.cost_micros),
            parallel_calls: min(self.parallel_calls, other.parallel_calls),
            retries: min(self.retries, other.retries),
        }
    }
}

/// How risky a tool's call is, least first: what weir asks of a call to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolClass {
    /// Safe to retry.
    ReadOnly,
    /// A retried step must carry the idempotency key it had the first time.
    SideEffect,
    /// Withheld from the client until an approver approves it.
    Approval,
}

/// What a request that offers a blocked tool gets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnBlockedOffered {
    /// 403 `tool_blocked`, naming the tool.
    #[default]
    Refuse,
    /// The tool is taken out of the request before the engine sees it.
    Remove,
}

/// A level's tool policy. Names are tool names or patterns where `*` stands for any run of
/// characters (`search_*`); nothing else is special.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolPolicy {
    /// Only these tools may be offered and called; unset, every tool not blocked.
    pub allowed: Option<Vec<String>>,
    #[serde(default)]
    pub blocked: Vec<String>,
    /// Each tool's class, by name or pattern; a tool no entry names is `read_only`.
    #[serde(default)]
    pub classes: BTreeMap<String, ToolClass>,
    pub on_blocked_offered: Option<OnBlockedOffered>,
    /// How its `approval` tools' calls wait for an approver.
    #[serde(default)]
    pub approval: ApprovalPolicy,
}

/// A level's terms for held calls, each optional: along a key's path the strictest wins.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalPolicy {
    /// A pending approval expires this long after its call was held, a decided one this long
    /// after its decision (10 minutes unset).
    pub ttl_ms: Option<u64>,
    /// Approvals a key may have pending at once (64 unset); a call past it is not held, so
    /// its re-send finds no approval.
    pub max_pending: Option<u32>,
    /// The calling key may approve its own calls (when it also approves for its subtree);
    /// unset, no. Any level saying no says no.
    pub self_approve: Option<bool>,
}

/// The terms a key's held calls wait under: its path's [`ApprovalPolicy`]s combined. The
/// filter vouches them to the sidecar, which holds the calls (`x-weir-approval-terms`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ApprovalTerms {
    pub ttl_ms: u64,
    pub max_pending: u32,
    pub self_approve: bool,
}

impl Default for ApprovalTerms {
    fn default() -> ApprovalTerms {
        ApprovalTerms {
            ttl_ms: 600_000,
            max_pending: 64,
            self_approve: false,
        }
    }
}

impl ApprovalTerms {
    /// The levels' terms combined, org first: the shortest ttl, the fewest pending, self
    /// approval only where some level allows it and none forbids it.
    fn combine<'a>(levels: impl IntoIterator<Item = &'a ApprovalPolicy>) -> ApprovalTerms {
        let mut terms = ApprovalTerms::default();
        let (mut ttl, mut pending, mut allowed, mut forbidden) = (None, None, false, false);
        for level in levels {
            ttl = min(ttl, level.ttl_ms);
            pending = min(pending, level.max_pending);
            allowed |= level.self_approve == Some(true);
            forbidden |= level.self_approve == Some(false);
        }
        terms.ttl_ms = ttl.unwrap_or(terms.ttl_ms);
        terms.max_pending = pending.unwrap_or(terms.max_pending);
        terms.self_approve = allowed && !forbidden;
        terms
    }

    /// `<ttl_ms>,<max_pending>,<0|1>`, as the trusted header carries them.
    pub fn to_header(self) -> String {
        let ApprovalTerms {
            ttl_ms,
            max_pending,
            self_approve,
        } = self;
        format!("{ttl_ms},{max_pending},{}", u8::from(self_approve))
    }

    /// Terms read from [`to_header`](Self::to_header)'s form; `None` unless well formed and
    /// both bounds positive.
    pub fn parse_header(value: &str) -> Option<ApprovalTerms> {
        let mut parts = value.split(',');
        let ttl_ms: u64 = parts.next()?.parse().ok()?;
        let max_pending: u32 = parts.next()?.parse().ok()?;
        let self_approve = match parts.next()? {
            "0" => false,
            "1" => true,
            _ => return None,
        };
        let positive = ttl_ms > 0 && max_pending > 0;
        (parts.next().is_none() && positive).then_some(ApprovalTerms {
            ttl_ms,
            max_pending,
            self_approve,
        })
    }
}

/// A key's tool policy, its path's levels combined: a tool is blocked if any level blocks it
/// or any level that lists allowed tools leaves it out, and has the strictest class any level
/// gives it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tools {
    allowed: Vec<Vec<String>>,
    blocked: Vec<String>,
    classes: Vec<(String, ToolClass)>,
    /// The most specific level's choice.
    pub on_blocked_offered: OnBlockedOffered,
    /// How its `approval` tools' calls wait.
    pub approval: ApprovalTerms,
}

/// What the policy says of one tool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolRule {
    Blocked,
    Allowed(ToolClass),
}

impl Tools {
    /// The levels' policies combined, org first.
    pub fn combine<'a>(levels: impl IntoIterator<Item = &'a ToolPolicy>) -> Tools {
        let mut tools = Tools::default();
        let mut levels_seen = Vec::new();
        for level in levels {
            if let Some(allowed) = &level.allowed {
                tools.allowed.push(allowed.clone());
            }
            tools.blocked.extend(level.blocked.iter().cloned());
            (tools.classes).extend(level.classes.iter().map(|(p, c)| (p.clone(), *c)));
            if let Some(choice) = level.on_blocked_offered {
                tools.on_blocked_offered = choice;
            }
            levels_seen.push(&level.approval);
        }
        tools.approval = ApprovalTerms::combine(levels_seen);
        tools
    }

    /// Whether any level says anything of tools.
    pub fn is_empty(&self) -> bool {
        self.allowed.is_empty() && self.blocked.is_empty() && self.classes.is_empty()
    }

    /// The names and patterns of class `approval`: what the sidecar holds a call to for an
    /// approver (the filter vouches them on).
    pub fn approval_patterns(&self) -> impl Iterator<Item = &str> {
        (self.classes.iter())
            .filter(|(_, c)| *c == ToolClass::Approval)
            .map(|(p, _)| p.as_str())
    }

    pub fn rule(&self, tool: &str) -> ToolRule {
        let named = |patterns: &[String]| patterns.iter().any(|p| matches(p, tool));
        if named(&self.blocked) || self.allowed.iter().any(|a| !named(a)) {
            return ToolRule::Blocked;
        }
        let class = (self.classes.iter())
            .filter(|(p, _)| matches(p, tool))
            .map(|&(_, c)| c)
            .max();
        ToolRule::Allowed(class.unwrap_or(ToolClass::ReadOnly))
    }
}

/// Whether `name` matches `pattern`, where `*` stands for any run of characters.
pub fn matches(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let Some(first) = parts.next() else {
        return false;
    };
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

/// Why a tool name or pattern is malformed, if it is: empty, too long, or with characters a
/// tool name does not have (the APIs allow letters, digits, `_`, `-`, `.`, `:`).
pub fn malformed(pattern: &str) -> Option<&'static str> {
    let legal = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':' | '*');
    if pattern.is_empty() {
        Some("is empty")
    } else if pattern.len() > 128 {
        Some("is longer than 128 characters")
    } else if !pattern.chars().all(legal) {
        Some("may hold only letters, digits, '_', '-', '.', ':' and '*'")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pattern_s_star_stands_for_any_run_of_characters_and_nothing_else_is_special() {
        assert!(matches("search_*", "search_web"));
        assert!(matches("search_*", "search_"));
        assert!(!matches("search_*", "research_web"));
        assert!(matches("*_prod", "deploy_prod"));
        assert!(matches("a*b*c", "a-x-b-y-c"));
        assert!(!matches("a*b*c", "a-x-c-y-b"));
        assert!(matches("*", "anything"));
        assert!(matches("exact", "exact") && !matches("exact", "exactly"));
        assert!(!matches("ab*ba", "aba"), "the two ends may not overlap");
        assert!(!matches("sh.ll", "shell"), "a dot is a dot");
    }

    #[test]
    fn levels_combine_to_the_union_of_blocked_the_intersection_of_allowed_and_the_strictest_class()
    {
        let org = ToolPolicy {
            allowed: Some(vec![
                "search_*".into(),
                "send_email".into(),
                "deploy_*".into(),
            ]),
            blocked: vec!["shell_*".into()],
            classes: BTreeMap::from([("send_email".into(), ToolClass::SideEffect)]),
            on_blocked_offered: None,
            approval: ApprovalPolicy::default(),
        };
        let key = ToolPolicy {
            allowed: Some(vec![
                "search_*".into(),
                "send_email".into(),
                "shell_ls".into(),
            ]),
            blocked: vec![],
            classes: BTreeMap::from([
                ("send_*".into(), ToolClass::Approval),
                ("search_*".into(), ToolClass::ReadOnly),
            ]),
            on_blocked_offered: Some(OnBlockedOffered::Remove),
            approval: ApprovalPolicy::default(),
        };
        let tools = Tools::combine([&org, &key]);
        assert_eq!(
            tools.rule("search_web"),
            ToolRule::Allowed(ToolClass::ReadOnly)
        );
        assert_eq!(
            tools.rule("send_email"),
            ToolRule::Allowed(ToolClass::Approval)
        );
        assert_eq!(
            tools.rule("deploy_prod"),
            ToolRule::Blocked,
            "not allowed by the key"
        );
        assert_eq!(
            tools.rule("shell_ls"),
            ToolRule::Blocked,
            "blocked by the org"
        );
        assert_eq!(tools.rule("other"), ToolRule::Blocked);
        assert_eq!(tools.on_blocked_offered, OnBlockedOffered::Remove);
        let open = Tools::combine([&ToolPolicy::default()]);
        assert!(open.is_empty());
        assert_eq!(open.rule("any"), ToolRule::Allowed(ToolClass::ReadOnly));
    }

    #[test]
    fn a_run_is_held_to_the_tightest_budget_of_each_measure() {
        let org = RunBudgets {
            model_calls: Some(100),
            output_tokens: Some(5_000),
            ..RunBudgets::default()
        };
        let key = RunBudgets {
            model_calls: Some(10),
            tool_calls: Some(5),
            ..RunBudgets::default()
        };
        let run = org.tightest(key);
        assert_eq!(run.model_calls, Some(10));
        assert_eq!(run.tool_calls, Some(5));
        assert_eq!(run.output_tokens, Some(5_000));
        assert_eq!(run.retries, None);
    }

    #[test]
    fn approval_terms_combine_to_the_strictest_and_cross_in_their_header() {
        let level = |ttl_ms, max_pending, self_approve| ApprovalPolicy {
            ttl_ms,
            max_pending,
            self_approve,
        };
        let none = ApprovalTerms::combine([&level(None, None, None)]);
        assert_eq!(none, ApprovalTerms::default());
        let org = level(Some(60_000), None, Some(true));
        let key = level(Some(120_000), Some(4), None);
        let terms = ApprovalTerms::combine([&org, &key]);
        assert_eq!(
            (terms.ttl_ms, terms.max_pending, terms.self_approve),
            (60_000, 4, true)
        );
        let forbids = level(None, None, Some(false));
        assert!(
            !ApprovalTerms::combine([&org, &forbids]).self_approve,
            "any no is no"
        );
        assert_eq!(ApprovalTerms::parse_header(&terms.to_header()), Some(terms));
        for bad in [
            "", "1,2", "1,2,3", "0,2,0", "1,0,1", "1,2,1,4", "x,2,0", "-1,2,0",
        ] {
            assert_eq!(ApprovalTerms::parse_header(bad), None, "{bad}");
        }
    }

    #[test]
    fn malformed_tool_names_are_named() {
        assert_eq!(malformed("search_*"), None);
        assert_eq!(malformed("ns:tool.v2-x"), None);
        assert!(malformed("").is_some());
        assert!(malformed("a b").is_some());
        assert!(malformed("a?").is_some());
        assert!(malformed(&"x".repeat(129)).is_some());
    }
}
