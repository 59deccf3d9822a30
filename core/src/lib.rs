//! Host-free logic shared by the weir filter, the sidecar and the simulator.
//!
//! Nothing here performs I/O or reads a clock: callers pass time in. The crate builds natively
//! and for `wasm32-wasip1`, so the same code is tested on the host and inside the proxy-wasm VM.

pub mod admission;
pub mod allowance;
pub mod bucket;
pub mod config;
pub mod embeddings;
pub mod endpoint;
pub mod error;
pub mod estimate;
pub mod fairness;
pub mod fleet;
pub mod fleet_config;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod json;
pub mod keys;
pub mod kv_profile;
pub mod lease;
pub mod messages;
pub mod meter;
pub mod openai;
pub mod parse_error;
pub mod path;
pub mod prediction;
pub mod price;
pub mod prompt;
pub mod renewal;
pub mod reply;
pub mod request;
pub mod reservation;
pub mod responses;
pub mod scheduler;
pub mod signature;
pub mod sse;
pub mod tokens;
pub mod trusted;
