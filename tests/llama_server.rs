//! Engine compatibility: weir in front of real llama.cpp `llama-server` replicas.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is a failed check

use weir_e2e::llama::LlamaServer;

#[tokio::test]
async fn the_engine_serves() {
    let s = LlamaServer::start(4, 2048);
    println!("{:?}", s.slots().await.len());
}
