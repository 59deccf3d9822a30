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
//!
//! The config as written is `schema`; how a key resolves into its tenant, `resolution`; what a
//! config must hold to load, `validation`.

mod resolution;
mod rfc3339;
mod runs;
mod schema;
mod validation;

pub use resolution::{Directory, KeyRefusal, Level, Tenant};
pub use rfc3339::parse_rfc3339;
pub use runs::{
    ApprovalPolicy, ApprovalTerms, OnBlockedOffered, RUN_BUDGETS, RunBudgets, RunPolicy, ToolClass,
    ToolPolicy, ToolRule, Tools, malformed as malformed_tool_pattern, matches as tool_matches,
};
pub use schema::*;

use crate::parse_error;

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
}

#[cfg(test)]
mod tests;
