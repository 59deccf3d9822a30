//! The stream meter's cost per event on a real engine's stream (vLLM's chat deltas): as they
//! come, read by the plain-event reader, and the same events with an escape in each text,
//! which that reader declines to serde — both in the same run
//! (`cargo bench -p weir-core --bench meter`).

use std::time::Instant;

use weir_core::endpoint::Endpoint;
use weir_core::meter::StreamMeter;

/// The capture's text events: not the first (the role), nor the usage event and `[DONE]`.
fn deltas() -> Vec<String> {
    let capture = include_str!("../testdata/vllm-chat-stream.sse");
    capture
        .split_inclusive("\n\n")
        .filter(|e| e.contains("\"content\":\"") && !e.contains("\"content\":\"\""))
        .map(str::to_owned)
        .collect()
}

/// Nanoseconds an event, best of five runs of metering `events` as one stream 20,000 times.
fn ns_per_event(events: &[String]) -> f64 {
    let stream = events.concat();
    let rounds = 20_000;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        for _ in 0..rounds {
            let mut meter = StreamMeter::new(Endpoint::ChatCompletions, false);
            meter.meter(stream.as_bytes(), false);
            std::hint::black_box(meter.generated_tokens());
        }
        best = best.min(start.elapsed().as_secs_f64());
    }
    best * 1e9 / (rounds * events.len()) as f64
}

fn main() {
    let plain = deltas();
    let escaped: Vec<String> = plain
        .iter()
        .map(|e| e.replacen("\"content\":\"", "\"content\":\"\\t", 1))
        .collect();
    let (fast, serde) = (ns_per_event(&plain), ns_per_event(&escaped));
    println!("stream meter, {} vLLM chat deltas, best of 5", plain.len());
    println!("plain events (the one-pass reader): {fast:.0} ns an event");
    println!(
        "each with an escape (serde):        {serde:.0} ns an event ({:.2}x)",
        serde / fast
    );
}
