//! How each replica's prefix cache is kept per tenant.
//!
//! Every request carries its tenant's `cache_salt`, but only engines that honour the salt
//! (vLLM) keep their prefix caches apart that way: llama.cpp's server ignores it and serves one
//! tenant's cached prompt to another, which shows in `cached_tokens` and in timing. So each
//! replica is probed when it joins ([`crate::replica::isolation_probe`]) and gets a mode:
//!
//! | mode | what weir does | traffic |
//! |---|---|---|
//! | `unprobed` | nothing yet: not probed since it joined, or its last probe failed | none (fail closed) |
//! | `salt` | the engine honours `cache_salt`: the salt alone scopes the cache | yes |
//! | `cache_off` | the salt is ignored; the engine's own off-switch (`cache_prompt: false`) is set on every request | yes |
//! | `none` | neither works: no tenant's request goes there | none |
//! | `shared` | the pool's config says its tenants may share the cache (`cache_isolation: shared`); not probed | yes |

use serde_json::Value;

use crate::config::engine::CacheIsolation;

/// What the probe found when it could make the cache per tenant in no way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gap {
    /// Another salt hit the cache, and the engine's off-switch did not turn the hit off.
    SaltIgnored,
    /// Not even the same salt hit: the engine reports no cached tokens, or caches nothing, so
    /// weir cannot tell whether the salt is honoured.
    NoHitSeen,
}

/// A replica's isolation mode (see the module doc).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Isolation {
    #[default]
    Unprobed,
    Salt,
    CacheOff,
    Unisolated(Gap),
    Shared,
}

/// The engine-specific field that turns prompt caching off for one request (llama.cpp's).
pub const OFF_SWITCH: &str = "cache_prompt";

impl Isolation {
    /// Every mode's label, for the metric's bounded `mode` label.
    pub const MODES: [&'static str; 5] = ["unprobed", "salt", "cache_off", "none", "shared"];

    /// The starting mode of a pool's replicas.
    pub fn initial(policy: CacheIsolation) -> Isolation {
        match policy {
            CacheIsolation::Probe => Isolation::Unprobed,
            CacheIsolation::Shared => Isolation::Shared,
        }
    }

    /// Whether tenants' requests may go to a replica in this mode.
    pub fn serves(self) -> bool {
        matches!(
            self,
            Isolation::Salt | Isolation::CacheOff | Isolation::Shared
        )
    }

    pub fn label(self) -> &'static str {
        match self {
            Isolation::Unprobed => "unprobed",
            Isolation::Salt => "salt",
            Isolation::CacheOff => "cache_off",
            Isolation::Unisolated(_) => "none",
            Isolation::Shared => "shared",
        }
    }

    /// Why a replica in this mode gets no traffic, or what sharing means; `None` when
    /// isolated.
    pub fn reason(self) -> Option<&'static str> {
        match self {
            Isolation::Unprobed => Some(
                "not probed since it joined, or its last probe failed (see the log): no traffic until a probe succeeds",
            ),
            Isolation::Unisolated(Gap::SaltIgnored) => Some(
                "the engine ignores cache_salt and has no working off-switch: no traffic, so no tenant sees another's cache",
            ),
            Isolation::Unisolated(Gap::NoHitSeen) => Some(
                "no prefix-cache hit seen even with the same salt (the engine reports no cached tokens, or caches nothing): isolation cannot be verified, so no traffic",
            ),
            Isolation::Shared => {
                Some("the pool is configured with cache_isolation: shared; not probed")
            }
            Isolation::Salt | Isolation::CacheOff => None,
        }
    }

    /// Makes a request body bound for a replica in this mode keep to its tenant's cache. Runs
    /// after the caller's engine-control fields were stripped and the salt set, so whatever the
    /// caller sent, weir's setting is the one the engine reads.
    pub fn apply(self, body: &mut Value) {
        if self == Isolation::CacheOff
            && let Some(fields) = body.as_object_mut()
        {
            fields.insert(OFF_SWITCH.into(), Value::Bool(false));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_isolated_or_explicitly_shared_replicas_serve() {
        let serving: Vec<_> = [
            Isolation::Unprobed,
            Isolation::Salt,
            Isolation::CacheOff,
            Isolation::Unisolated(Gap::SaltIgnored),
            Isolation::Unisolated(Gap::NoHitSeen),
            Isolation::Shared,
        ]
        .iter()
        .filter(|m| m.serves())
        .map(|m| m.label())
        .collect();
        assert_eq!(serving, ["salt", "cache_off", "shared"]);
        assert!(Isolation::MODES.contains(&Isolation::Unisolated(Gap::NoHitSeen).label()));
    }

    #[test]
    fn a_callers_cache_prompt_cannot_turn_the_cache_back_on() {
        let mut body = json!({"model": "m", "cache_prompt": true, "messages": []});
        Isolation::CacheOff.apply(&mut body);
        assert_eq!(body["cache_prompt"], false);
        let mut body = json!({"model": "m"});
        Isolation::CacheOff.apply(&mut body);
        assert_eq!(body["cache_prompt"], false, "set when the caller sent none");
        let mut body = json!({"model": "m"});
        Isolation::Salt.apply(&mut body);
        assert_eq!(
            body,
            json!({"model": "m"}),
            "the salt alone scopes the cache"
        );
    }
}
