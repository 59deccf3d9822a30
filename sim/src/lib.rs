//! weir-sim: an LLM serving engine simulated at iteration level, behind vLLM's, SGLang's or
//! llama.cpp's API and metrics.
//!
//! The [`engine`] is a pure state machine in model time; the [`driver`] runs it against the wall
//! clock (optionally sped up); the [`server`] (sharing the [`app`]) speaks the OpenAI APIs and Anthropic's Messages API
//! over HTTP — each request a [`job`] of engine sequences whose events the [`relay`] puts on the
//! [`wire`] — with the surface of the engine its [`dialect`] plays.

pub mod app;
pub mod dialect;
pub mod driver;
pub mod engine;
pub mod faults;
pub mod framing;
pub mod job;
pub mod kv_cache;
pub mod metrics;
pub mod profile;
pub mod relay;
pub mod server;
pub mod shape;
pub mod text;
pub mod tool_call;
pub mod wire;
