//! Fuzz target: `weir_core::fuzzing::check_meter` (its doc states the input layout and invariants).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| weir_core::fuzzing::check_meter(data));
