//! The body the engine receives instead of the client's. One rewrite serves both hops: the
//! filter applies it to the requests it meters, the sidecar — the last hop before the engine —
//! to every request, since off-mode and out-of-rollout bodies reach it as the client sent them.
//! Each hop keeps the body in its own form ([`Fields`]): the filter as raw top-level fields (no
//! tree of the body inside the VM, see [`crate::json`]), the sidecar as a `serde_json` tree.

use serde::Serialize;
use serde_json::{Map, Value};

use crate::json::TopLevel;

/// Body fields by which a request steers the engine itself, across the tenant boundary, and
/// that only weir may set: vLLM's `cache_salt` (prefix-cache scope; the sidecar sets a
/// per-tenant one), `priority` (reorders the engine's own queue: queueing belongs to weir),
/// `kv_transfer_params` (KV blocks to pull from a prefill instance, another tenant's if
/// guessed) and `request_id` (the engine's id for the request; a collision mixes or aborts
/// another tenant's).
pub const ENGINE_CONTROL_FIELDS: [&str; 4] =
    ["cache_salt", "priority", "kv_transfer_params", "request_id"];

/// What changes in a body on its way to the engine, besides the [`ENGINE_CONTROL_FIELDS`],
/// which are always stripped.
#[derive(Clone, Copy, Debug, Default)]
pub struct Rewrite<'a> {
    /// The tenant's prefix-cache scope, which only weir may set.
    pub cache_salt: Option<&'a str>,
    /// Ask the engine for a stream's usage event the caller did not ask for, so the stream is
    /// billed on the engine's counts.
    pub ask_usage: bool,
    /// The API's own output-limit field, and the limit weir fills in.
    pub output_limit: Option<(&'a str, u64)>,
}

impl Rewrite<'_> {
    /// Rewrites a body's top-level fields; whether anything changed.
    pub fn apply(&self, fields: &mut impl Fields) -> Result<bool, serde_json::Error> {
        let mut changed = false;
        for field in ENGINE_CONTROL_FIELDS {
            changed |= fields.remove(field);
        }
        if let Some(salt) = self.cache_salt {
            fields.set("cache_salt", salt)?;
            changed = true;
        }
        if self.ask_usage {
            fields.include_usage()?;
            changed = true;
        }
        if let Some((field, limit)) = self.output_limit {
            fields.set(field, limit)?;
            changed = true;
        }
        Ok(changed)
    }

    /// The rewritten body as JSON, if it differs from the client's.
    pub fn body(&self, mut fields: TopLevel) -> Result<Option<Vec<u8>>, serde_json::Error> {
        let changed = self.apply(&mut fields)?;
        changed.then(|| fields.to_vec()).transpose()
    }
}

/// A JSON object's top-level fields, as a [`Rewrite`] edits them.
pub trait Fields {
    /// Removes a field; whether it was there.
    fn remove(&mut self, field: &str) -> bool;

    fn set(&mut self, field: &str, value: impl Serialize) -> Result<(), serde_json::Error>;

    /// Sets `stream_options.include_usage`, keeping the other options (options that are not
    /// an object are replaced).
    fn include_usage(&mut self) -> Result<(), serde_json::Error>;
}

impl Fields for TopLevel {
    fn remove(&mut self, field: &str) -> bool {
        TopLevel::remove(self, field)
    }

    fn set(&mut self, field: &str, value: impl Serialize) -> Result<(), serde_json::Error> {
        TopLevel::set(self, field, value)
    }

    fn include_usage(&mut self) -> Result<(), serde_json::Error> {
        let mut options = self
            .get("stream_options")
            .and_then(|o| TopLevel::parse(o.get().as_bytes()).ok())
            .unwrap_or_default();
        options.set("include_usage", true)?;
        self.set_raw("stream_options", options.to_raw()?);
        Ok(())
    }
}

impl Fields for Map<String, Value> {
    fn remove(&mut self, field: &str) -> bool {
        Map::remove(self, field).is_some()
    }

    fn set(&mut self, field: &str, value: impl Serialize) -> Result<(), serde_json::Error> {
        self.insert(field.to_owned(), serde_json::to_value(value)?);
        Ok(())
    }

    fn include_usage(&mut self) -> Result<(), serde_json::Error> {
        match self.get_mut("stream_options") {
            Some(Value::Object(options)) => {
                options.insert("include_usage".to_owned(), Value::Bool(true));
            }
            _ => {
                let options = Map::from_iter([("include_usage".to_owned(), Value::Bool(true))]);
                self.insert("stream_options".to_owned(), Value::Object(options));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn both_forms_of_a_body_are_rewritten_alike() {
        let plan = Rewrite {
            cache_salt: Some("tenant-salt"),
            ask_usage: true,
            output_limit: Some(("max_tokens", 20)),
        };
        for client in [
            json!({"model": "m", "priority": -9, "cache_salt": "steal", "stream_options": {"x": 1}}),
            json!({"model": "m", "request_id": "r", "stream_options": null}),
            json!({"model": "m"}),
        ] {
            let bytes = serde_json::to_vec(&client).unwrap();
            let raw = plan
                .body(TopLevel::parse(&bytes).unwrap())
                .unwrap()
                .unwrap();
            let mut tree = client.as_object().unwrap().clone();
            assert!(plan.apply(&mut tree).unwrap());
            let raw: Value = serde_json::from_slice(&raw).unwrap();
            assert_eq!(raw, Value::Object(tree), "{client}");
            assert_eq!(raw["stream_options"]["include_usage"], true, "{client}");
            assert_eq!(raw["cache_salt"], "tenant-salt");
            for field in ["priority", "request_id", "kv_transfer_params"] {
                assert!(raw.get(field).is_none(), "{field}");
            }
        }
        let untouched = TopLevel::parse(br#"{"model":"m"}"#).unwrap();
        assert_eq!(Rewrite::default().body(untouched).unwrap(), None);
    }
}
