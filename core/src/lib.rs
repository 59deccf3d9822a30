//! Host-free logic shared by the weir filter, the sidecar and the simulator.
//!
//! Nothing here performs I/O or reads a clock: callers pass time in. The crate builds natively
//! and for `wasm32-wasip1`, so the same code is tested on the host and inside the proxy-wasm VM.

// Layers, each built on those declared before it: a module imports from its own layer and
// earlier ones, never from a later one, and no modules import each other round in a cycle
// (`cargo xtask test` checks both).

// layer: basics — errors, JSON, tokens, SSE, the shared-data store, trusted headers' values
#[cfg(test)]
mod draw;
pub mod error;
pub mod json;
pub mod keys;
pub mod parse_error;
pub mod sse;
pub mod store;
pub mod tokens;
pub mod trusted;

// layer: vocabulary — endpoints and paths, prices and signatures, fleet terms, buckets, leases,
// outcomes
pub mod bucket;
pub mod endpoint;
pub mod fairness;
pub mod fleet;
pub mod fleet_config;
pub mod kv_profile;
pub mod lease;
pub mod outcome;
pub mod path;
pub mod price;
pub mod signature;

// layer: requests — a request, whatever its API (a module per API, the prompt, the fields they
// share), estimates, metering, the body the engine receives
pub mod estimate;
pub mod meter;
pub mod request;
pub mod rewrite;
pub mod tools;

// layer: config — tenants, their limits and policies, output prediction
pub mod config;
pub mod prediction;

// layer: quota — allowances, reservations and their settlement, fleet renewals, denials' replies,
// retries and runs
pub mod active_set;
pub mod allowance;
pub mod renewal;
pub mod reply;
pub mod reservation;
pub mod retry;
pub mod run;

// layer: decisions — a request admitted at the front door, the scheduler's order
pub mod admission;
pub mod scheduler;

// layer: testing — inputs drawn for the fuzzers and property tests
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
