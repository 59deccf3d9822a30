//! weir-sim: an LLM serving engine simulated at iteration level, behind vLLM's, SGLang's or
//! llama.cpp's API and metrics.
//!
//! The [`engine`] is a pure state machine in model time; the [`driver`] runs it against the wall
//! clock (optionally sped up); the [`server`] speaks the OpenAI API over HTTP, with the surface of
//! the engine its [`dialect`] plays.

pub mod dialect;
pub mod driver;
pub mod engine;
pub mod faults;
pub mod kv_cache;
pub mod metrics;
pub mod profile;
pub mod server;
pub mod shape;
pub mod text;
pub mod wire;
