//! What a pool says of its engines: their dialect, whether their prefix caches may be shared
//! among tenants, and how many sidecars admit to them.

use serde::Deserialize;

/// A pool's `engine:` setting: detect the dialect from `/metrics`, or name it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineChoice {
    #[default]
    Auto,
    Vllm,
    Sglang,
    Llamacpp,
    Tgi,
}

/// A pool's choice in the config: probe every replica (the default), or declare that its
/// tenants may share the replicas' prefix caches (one tenant per pool, engines with their
/// prefix cache off, test engines).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum CacheIsolation {
    #[default]
    Probe,
    Shared,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct EngineShare {
    /// How many sidecars admit to the pool's replicas, this one included (at least 1).
    pub(crate) sidecars: u64,
}

impl Default for EngineShare {
    fn default() -> EngineShare {
        EngineShare { sidecars: 1 }
    }
}
