//! Leaves every other layer may use: the clock, a value replaced by reloads, the bounded reader
//! of engines' answers, `Retry-After` waits. Nothing here imports the rest of the crate.

pub mod answer;
pub mod backoff;
pub mod clock;
pub mod live;
pub mod respond;
