//! A request made ready for its pool: the filter's signature checked, its demand (prompt tokens,
//! output KV held) and prediction, its idempotency key claimed; and [`app::App`], what every
//! handler and relay shares.

pub mod app;
pub mod demand;
pub mod idempotency;
pub mod prediction;
pub mod prepare;
pub mod trust;
