//! Fault injection for the end-to-end tests; compiled only with the `fault-injection` feature,
//! which is off by default and never part of a shipped build (`cargo xtask test` builds it
//! apart, as `target/wasm32-wasip1/fault-injection/weir_filter.wasm`).
//!
//! Why it exists: a concurrency slot is a lease (`weir_core::lease`) so that a slot whose
//! holder vanished without settling comes back by itself. The holder that vanishes is a
//! request whose VM trapped — Envoy's `FAIL_RELOAD` replaces the VM and every context on it
//! is gone, with no `on_log` and no release. The production filter never traps on purpose and
//! every trap found has been fixed, so without this a test of lease expiry would have nothing
//! to stand on. With it, a request carrying [`HEADER`] traps its VM at the named point.

use crate::exchange::Headers;

/// The request header naming the fault (not `x-weir-*`: those are stripped on arrival).
pub const HEADER: &str = "weir-fault";

/// Trap right after the request's reservation (and so its slot lease) was taken.
pub const TRAP_AFTER_RESERVE: &str = "trap-after-reserve";

/// The fault the request asks for in its [`HEADER`].
pub fn asked(headers: &Headers) -> Option<String> {
    headers.get(HEADER).map(str::to_owned)
}

/// Traps the VM if the request asked for `fault`.
pub fn trap_if(asked: Option<&str>, fault: &str) {
    if asked == Some(fault) {
        log::warn!("weir: fault injection: {fault}");
        trap();
    }
}

/// Ends the VM with a trap, as an unexpected fault would (`unreachable` in wasm).
fn trap() -> ! {
    #[cfg(target_arch = "wasm32")]
    core::arch::wasm32::unreachable();
    #[cfg(not(target_arch = "wasm32"))]
    std::process::abort();
}
