//! Token counting throughput: exact BPE vs the fast estimator, and the estimator's error.
//! Runs natively (`cargo bench -p weir-core --bench token_counting`) and inside wasm under
//! Node's V8 (`cargo xtask bench` does both), printing MB/s per method and kind of text.

use std::time::Instant;

use weir_core::estimate::fast_count;
use weir_core::tokens::Encoding;

const SAMPLES: [(&str, &str); 4] = [
    ("prose", include_str!("../testdata/prose.txt")),
    ("code", include_str!("../src/reservation.rs")),
    ("json", include_str!("../testdata/request.json")),
    ("chinese", include_str!("../testdata/chinese.txt")),
];

/// Repeats `text` to about `bytes` bytes.
fn corpus(text: &str, bytes: usize) -> String {
    text.repeat(bytes / text.len() + 1)
}

/// Best of five runs, in MB/s, with the last result.
fn throughput<T>(text: &str, f: impl Fn(&str) -> T) -> (f64, T) {
    let mut best = f64::MAX;
    let mut out = f(text);
    for _ in 0..5 {
        let start = Instant::now();
        out = f(text);
        best = best.min(start.elapsed().as_secs_f64());
    }
    (text.len() as f64 / 1e6 / best, out)
}

fn main() {
    let target = if cfg!(target_arch = "wasm32") {
        "wasm32 (V8)"
    } else {
        "native"
    };
    let bpe = Encoding::Cl100kBase;
    // Load the vocabulary before timing.
    let _ = bpe.encode("warm up");
    println!("token counting, {target}, 1 MB per kind of text, best of 5");
    println!(
        "{:<8} {:>12} {:>12} {:>8} {:>10}",
        "text", "exact MB/s", "fast MB/s", "fast/x", "fast err"
    );
    for (kind, sample) in SAMPLES {
        let text = corpus(sample, 1_000_000);
        let (exact_rate, exact) =
            throughput(&text, |t| bpe.encode(t).map_or(0, |v| v.len() as u64));
        let (fast_rate, fast) = throughput(&text, fast_count);
        let err = (fast as f64 - exact as f64) / exact as f64 * 100.0;
        println!(
            "{kind:<8} {exact_rate:>12.1} {fast_rate:>12.1} {:>7.0}x {err:>+9.1}%",
            fast_rate / exact_rate
        );
    }
}
