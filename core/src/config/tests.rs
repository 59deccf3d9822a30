use std::sync::Arc;

use super::schema::MODES;
use super::*;
use crate::fleet;
use crate::fleet_config::FleetConfig;
use crate::tokens::Encoding;

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
        let config = format!(r#"{{"routes": {{"by_name": {{"llm-api": {{"mode": {json}}}}}}}}}"#);
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
        let built_in = sample().replace(r#""tier": "enterprise""#, &format!(r#""tier": "{tier}""#));
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

/// One key under an org, with `org` and `key` as the two levels' policies.
fn agent_config(org: &str, key: &str) -> String {
    format!(
        r#"{{"orgs": [{{"id": "agentco", "policy": {org}, "workspaces": [{{"id": "w",
            "projects": [{{"id": "p", "keys": [{{"id": "k", "sha256": "{h}", "policy": {key}}}]}}]}}]}}]}}"#,
        h = hash('c')
    )
}

#[test]
fn a_key_s_runs_and_tools_combine_the_policies_along_its_path() {
    let org = r#"{"runs": {"budgets": {"model_calls": 100, "output_tokens": 5000}},
                  "tools": {"blocked": ["shell_*"], "classes": {"send_email": "side_effect"}}}"#;
    let key = r#"{"runs": {"idle_ttl_ms": 60000, "budgets": {"model_calls": 10, "tool_calls": 5}},
                  "tools": {"allowed": ["search_*", "send_email", "shell_ls"],
                            "classes": {"send_*": "approval"}, "on_blocked_offered": "remove"}}"#;
    let config = Config::parse(agent_config(org, key).as_bytes()).unwrap();
    let directory = config.directory();
    let tenant = directory.lookup(&hash('c')).unwrap();
    let budgets = tenant.run_budgets;
    assert_eq!(budgets.model_calls, Some(10));
    assert_eq!(budgets.tool_calls, Some(5));
    assert_eq!(budgets.output_tokens, Some(5000));
    let tools = &tenant.tools;
    assert_eq!(
        tools.rule("search_web"),
        ToolRule::Allowed(ToolClass::ReadOnly)
    );
    assert_eq!(
        tools.rule("send_email"),
        ToolRule::Allowed(ToolClass::Approval)
    );
    assert_eq!(tools.rule("shell_ls"), ToolRule::Blocked);
    assert_eq!(tools.rule("deploy"), ToolRule::Blocked);
    assert_eq!(tools.on_blocked_offered, OnBlockedOffered::Remove);
    // A key with no such policy anywhere on its path has none.
    let plain = Config::parse(agent_config("{}", "{}").as_bytes()).unwrap();
    let directory = plain.directory();
    let tenant = directory.lookup(&hash('c')).unwrap();
    assert_eq!(tenant.run_budgets, RunBudgets::default());
    assert!(tenant.tools.is_empty());
}

#[test]
fn a_run_or_tool_policy_that_cannot_hold_is_refused_with_its_field() {
    let cases = [
        (
            r#"{"runs": {"budgets": {"model_calls": 0}}}"#,
            "orgs[0].policy.runs.budgets",
        ),
        (
            r#"{"runs": {"idle_ttl_ms": 0}}"#,
            "orgs[0].policy.runs.idle_ttl_ms",
        ),
        (
            r#"{"runs": {"fleet_wide": {"model_calls": "fail_open"}}}"#,
            "orgs[0].policy.runs.fleet_wide.model_calls",
        ),
        (
            r#"{"runs": {"fleet_wide": {"requests": "fail_closed"}}}"#,
            "orgs[0].policy.runs.fleet_wide.requests",
        ),
        (
            r#"{"tools": {"allowed": []}}"#,
            "orgs[0].policy.tools.allowed",
        ),
        (
            r#"{"tools": {"blocked": ["ok", "rm -rf"]}}"#,
            "orgs[0].policy.tools.blocked[1]",
        ),
        (
            r#"{"tools": {"classes": {"a?": "approval"}}}"#,
            "orgs[0].policy.tools.classes.a?",
        ),
        (
            r#"{"tools": {"approval": {"ttl_ms": 0}}}"#,
            "orgs[0].policy.tools.approval.ttl_ms",
        ),
        (
            r#"{"tools": {"approval": {"max_pending": 0}}}"#,
            "orgs[0].policy.tools.approval.max_pending",
        ),
    ];
    for (org, field) in cases {
        let error = error_of(&agent_config(org, "{}"));
        assert_eq!(error.field, field, "{org}: {error}");
    }
    let error = error_of(&agent_config(
        r#"{"tools": {"classes": {"x": "risky"}}}"#,
        "{}",
    ));
    assert!(
        error.field.starts_with("orgs[0].policy.tools.classes"),
        "{error}"
    );
    // Fleet-wide run budgets need the fleet's quota store.
    let fleet_wide = r#"{"runs": {"fleet_wide": {"model_calls": "fail_closed"}}}"#;
    assert_eq!(error_of(&agent_config(fleet_wide, "{}")).field, "fleet");
}

#[test]
fn an_approver_key_approves_only_within_its_own_org_and_a_run_header_is_a_plain_header() {
    let with_approves = |approves: &str| {
        format!(
            r#"{{"orgs": [{{"id": "agentco", "workspaces": [{{"id": "w", "projects": [{{"id": "p",
                "keys": [{{"id": "ops", "sha256": "{h}", "approves": {approves},
                           "limits": {{"retries_per_minute": 30}}}}]}}]}}]}}]}}"#,
            h = hash('d')
        )
    };
    for ok in [
        r#"["agentco"]"#,
        r#"["agentco/w", "agentco/w/p/agent"]"#,
        "[]",
    ] {
        assert!(Config::parse(with_approves(ok).as_bytes()).is_ok(), "{ok}");
    }
    for bad in [
        r#"["globex"]"#,
        r#"["agentcox"]"#,
        r#"["agentco//p"]"#,
        r#"["agentco/a/b/c/d"]"#,
    ] {
        let error = error_of(&with_approves(bad));
        assert_eq!(
            error.field, "orgs[0].workspaces[0].projects[0].keys[0].approves[0]",
            "{bad}"
        );
    }
    let route = |header: &str| {
        format!(
            r#"{{"routes": {{"by_name": {{"llm": {{"mode": "enforce", "run_id_header": "{header}"}}}}}}}}"#
        )
    };
    for ok in ["x-langgraph-thread-id", "x-weir-run-id", "run_id"] {
        let config = Config::parse(route(ok).as_bytes()).unwrap();
        assert_eq!(
            config.routes.by_name["llm"].run_id_header.as_deref(),
            Some(ok)
        );
    }
    for bad in ["X-Run", "x-weir-tenant", "", "run id"] {
        let error = error_of(&route(bad));
        assert_eq!(error.field, "routes.by_name.llm.run_id_header", "{bad}");
    }
}

/// The config `cargo xtask up` starts with: it loads, and the agent demo key's runs are held
/// to what the README and the banner say.
#[test]
fn the_demo_config_loads_with_its_agent_key_s_runs_and_tools() {
    let raw = include_str!("../../../envoy/weir.example.json");
    let config = Config::parse(raw.as_bytes()).unwrap();
    let directory = config.directory();
    let agent = directory
        .lookup(&crate::keys::hash_key("wk-demo-agent"))
        .unwrap();
    assert_eq!(agent.path(), "agentlab/default/agents/agent");
    assert_eq!(
        (agent.run_budgets.model_calls, agent.run_budgets.tool_calls),
        (Some(10), Some(5))
    );
    assert_eq!(agent.tools.rule("shell_exec"), ToolRule::Blocked);
    assert_eq!(
        agent.tools.rule("deploy_prod"),
        ToolRule::Allowed(ToolClass::Approval)
    );
    assert_eq!(
        agent.tools.approval_patterns().collect::<Vec<_>>(),
        ["deploy_prod"]
    );
    let approver = directory
        .lookup(&crate::keys::hash_key("wk-demo-approver"))
        .unwrap();
    assert_eq!(approver.path(), "agentlab/default/agents/approver");
}
